"""tf.data input: manifest checks -> host split -> interleave -> batched parse -> pack -> shuffle -> batch -> prefetch."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import posixpath
import sys
import threading
import time

import numpy as np
import tensorflow as tf

from t5x_like.data import packing
from t5x_like.data.packing import pack_features  # pylint: disable=unused-import  (public API)

try:  # TensorFlow only feeds data here: keep it off the accelerators JAX owns.
  tf.config.set_visible_devices([], "GPU")
except RuntimeError:  # TF already initialised by the caller; it then decided device placement
  pass

AUTOTUNE = tf.data.AUTOTUNE
FORMATS = ("text", "chat", "preference")  # manifest "format": what the records hold (a manifest without one is text)
WEIGHTED = ("chat", "preference")  # formats that store a loss weight per token (preference: rows of whole pairs)
log = logging.getLogger(__name__)
_PREPROCESS_HINT = "run python -m t5x_like.preprocess --input=GLOB --output_dir={d}"


def graph_fn(fn):
  """`fn` for a tf.data transformation (map, filter, scan, interleave), traced as written: tf.data otherwise runs
  AutoGraph over every function it is given, which re-writes its source (about 1 s of CPU in a `train` launch's
  start-up for the ~20 functions of one input pipeline). Every function given to tf.data here is plain graph code (no
  Python `if` / `for` on a tensor: one would fail when the dataset is built)."""
  return tf.autograph.experimental.do_not_convert(fn)


def _join(data_dir: str, rel: str) -> str:
  return f"{data_dir.rstrip('/')}/{rel}"


def resolve_path(data_dir: str, rel: str) -> str:
  """Path of a manifest entry; absolute paths, URLs and '..' that leave DATA_DIR are refused."""
  norm = posixpath.normpath(str(rel))
  if (not rel or "://" in rel or norm.startswith("/") or norm == ".." or norm.startswith("../")
      or "\\" in rel):
    raise ValueError(f"manifest.json in DATA_DIR '{data_dir}' names '{rel}', a path outside "
                     "DATA_DIR: entries must be relative paths inside it")
  return _join(data_dir, norm)


def file_sha256(path: str) -> str:
  """SHA-256 of a file on any TF filesystem, read in 4 MiB chunks."""
  h = hashlib.sha256()
  with tf.io.gfile.GFile(path, "rb") as f:
    while chunk := f.read(1 << 22):
      h.update(chunk)
  return h.hexdigest()


def load_manifest(data_dir: str, *, verify: str = "size") -> dict:
  """Reads and checks DATA_DIR/manifest.json against the files next to it.

  Args:
    data_dir: the prepared dataset directory (local or gs://...).
    verify: "none": files exist; "size": also each shard's byte size (default, cheap);
      "sha256": also each shard's hash (reads every shard).

  Returns:
    The manifest dict.

  Raises:
    FileNotFoundError: DATA_DIR, manifest.json, the tokenizer or a shard is missing (message names it).
    ValueError: the manifest is malformed, refers outside DATA_DIR, or disagrees with the files.
  """
  data_dir = str(data_dir)
  if not tf.io.gfile.isdir(data_dir):
    raise FileNotFoundError(f"DATA_DIR '{data_dir}' does not exist: " + _PREPROCESS_HINT.format(d=data_dir))
  path = _join(data_dir, "manifest.json")
  if not tf.io.gfile.exists(path):
    raise FileNotFoundError(f"DATA_DIR '{data_dir}' has no manifest.json: "
                            + _PREPROCESS_HINT.format(d=data_dir))
  try:
    with tf.io.gfile.GFile(path) as f:
      manifest = json.load(f)
  except ValueError as e:
    raise ValueError(f"{path} is not valid JSON: {e}") from e
  if not isinstance(manifest, dict) or manifest.get("format_version") != 1:
    raise ValueError(f"{path}: format_version must be 1, found "
                     f"{manifest.get('format_version') if isinstance(manifest, dict) else manifest!r}")
  for key in ("tokenizer", "tokenizer_sha256", "vocab_size", "pad_id", "eos_id", "splits"):
    if key not in manifest:
      raise ValueError(f"{path} lacks the key '{key}'")
  if manifest.get("format", "text") not in FORMATS:
    raise ValueError(f"{path}: format must be one of {FORMATS}, found {manifest['format']!r}")
  tok = resolve_path(data_dir, manifest["tokenizer"])
  if not tf.io.gfile.exists(tok):
    raise FileNotFoundError(f"Tokenizer '{tok}' listed in {path} is missing")
  if verify != "none" and file_sha256(tok) != manifest["tokenizer_sha256"]:
    raise ValueError(f"Tokenizer '{tok}' does not match tokenizer_sha256 in {path}: the shards "
                     "were written with another tokenizer; re-run preprocess")
  for split, entry in manifest["splits"].items():
    shards = entry.get("shards") or []
    if not shards:
      raise ValueError(f"{path}: split '{split}' lists no shards")
    for key in ("num_documents", "num_tokens"):
      if key in entry and entry[key] != sum(s.get(key, 0) for s in shards):
        raise ValueError(f"{path}: split '{split}' {key}={entry[key]} but its shards add up to "
                         f"{sum(s.get(key, 0) for s in shards)}")
    for s in shards:
      f = resolve_path(data_dir, s["path"])
      if not tf.io.gfile.exists(f):
        raise FileNotFoundError(f"Shard '{f}' listed in {path} is missing")
      if verify in ("size", "sha256") and "num_bytes" in s:
        size = tf.io.gfile.stat(f).length
        if size != s["num_bytes"]:
          raise ValueError(f"Shard '{f}' has {size} bytes but {path} says {s['num_bytes']}: "
                           "truncated, corrupt or from another run")
      if verify == "sha256" and "sha256" in s and file_sha256(f) != s["sha256"]:
        raise ValueError(f"Shard '{f}' does not match its sha256 in {path}")
  if verify not in ("none", "size", "sha256"):
    raise ValueError(f"verify must be 'none', 'size' or 'sha256', got '{verify}'")
  return manifest


def _read_shard(path, expected, *, records_per_read, record_shard, on_corrupt):
  """Batches of serialized records of one shard; an unreadable tail errors (or warns) naming it."""
  ds = tf.data.TFRecordDataset(path).ignore_errors()
  if record_shard is not None:
    ds = ds.shard(*record_shard)
  body = ds.batch(records_per_read).map(graph_fn(lambda b: (b, False)))
  end = tf.data.Dataset.from_tensors((tf.zeros([0], tf.string), True))

  def check(count, element):
    batch, is_end = element
    count += tf.size(batch, out_type=tf.int64)
    bad = is_end & tf.not_equal(count, expected)
    msg = ["Shard", path, "yielded", count, "records but manifest.json lists", expected,
           "for this reader: the file is corrupt, truncated or does not match the manifest"]
    if on_corrupt == "raise":
      op = tf.debugging.Assert(~bad, msg, summarize=1)
    else:
      op = tf.cond(bad, lambda: _warn(["WARNING: skipped unreadable records."] + msg),
                   lambda: tf.constant(False))
    with tf.control_dependencies([op]):
      return count, tf.identity(batch)

  return (body.concatenate(end).scan(tf.constant(0, tf.int64), graph_fn(check))
          .filter(graph_fn(lambda b: tf.size(b) > 0)))


def _warn(msg):
  with tf.control_dependencies([tf.print(*msg, output_stream=sys.stderr)]):
    return tf.constant(True)


def _parse_flat(serialized):
  """(K,) serialized Examples of one document each -> their tokens back to back, int32 (n,)."""
  tokens = tf.io.parse_example(serialized, {"tokens": tf.io.RaggedFeature(tf.int64)})["tokens"]
  return tf.cast(tokens.flat_values, tf.int32)


def _parse_packed_flat(records, *, length: int, dtype: str, pad_id: int):
  """(K,) pre-packed rows of another length -> their tokens without padding, int32 (n,)."""
  tokens = tf.reshape(packing.parse_packed(records, length, dtype)[:, packing.TOKENS], [-1])
  tokens = tf.cast(tokens, tf.int32)
  return tf.boolean_mask(tokens, tf.not_equal(tokens, pad_id))


def _parse_chat(serialized):
  """(K,) serialized chat Examples -> (tokens, weights), each ragged int32 (K, None)."""
  spec = {k: tf.io.RaggedFeature(tf.int64) for k in ("tokens", "weights")}
  docs = tf.io.parse_example(serialized, spec)
  return tf.cast(docs["tokens"], tf.int32), tf.cast(docs["weights"], tf.int32)


def _cut(tokens, weights, *, length: int):
  return tokens[:length], weights[:length]


def _pack_documents(docs: tf.data.Dataset, *, length: int, pad_id: int, flush: bool) -> tf.data.Dataset:
  """(tokens, weights) documents -> rows (4, length) holding whole documents, never split across rows
  (`packing.pack_documents_np`'s next-fit, as a scan: its state is in the iterator checkpoint).

  A document longer than `length` is cut to it. `flush`: also emit the last, partly filled row (a
  finite dataset).
  """
  docs = docs.map(graph_fn(functools.partial(_cut, length=length)))
  if flush:  # a full-length document forces out the row before it and is itself never emitted
    docs = docs.concatenate(tf.data.Dataset.from_tensors(
        (tf.fill([length], pad_id), tf.zeros([length], tf.int32))))
  initial, step = packing.pack_documents_step(length, pad_id)
  return (docs.scan(initial, graph_fn(step)).filter(graph_fn(_is_finished))
          .map(graph_fn(_finished_row)))


def _is_finished(row, finished):
  del row
  return finished


def _finished_row(row, finished):
  del finished
  return row


def _to_rows(tokens, *, length: int, pad_id: int, eos_id: int):
  """A flat chunk of the token stream -> segmented rows of `length` (the last one padded)."""
  pad = (-tf.size(tokens)) % length
  rows = tf.reshape(tf.pad(tokens, [[0, pad]], constant_values=pad_id), [-1, length])
  return packing.segment_rows(rows, pad_id, eos_id)


def _permute(index, rows, *, seed: int):
  """Seeded permutation of a block of rows (R, 3, N); a pure function of (seed, block index)."""
  key = tf.stack([tf.constant(seed, tf.int64), index])
  return tf.gather(rows, tf.argsort(tf.random.stateless_uniform([tf.shape(rows)[0]], key)))


def _pad_to(x, size: int, axis: int):
  pad = [[0, 0]] * len(x.shape)
  pad[axis] = [0, size - tf.shape(x)[axis]]
  out = tf.pad(x, pad)
  return tf.ensure_shape(out, [size if i == axis else d for i, d in enumerate(x.shape)])


def ordered_splits(manifest: dict) -> tuple[str, ...]:
  """The splits `preprocess --order_by` wrote in an order the reader must keep (manifest "order")."""
  return tuple((manifest.get("order") or {}).get("splits", ()))


def host_shards(manifest: dict, data_dir: str, split: str, process_index: int,
                process_count: int) -> tuple[list[tuple[str, int]], tuple[int, int] | None]:
  """This process's (path, expected records) and the record-level split when shards are too few.

  Shards are dealt round-robin to readers when there are at least as many as readers; otherwise
  every reader reads every shard, keeping records i with i % process_count == process_index. An
  ordered split (its records dealt round-robin over the shards in score order) is read record-level
  too unless the reader count divides the shard count, so that every reader moves through the order
  at the same pace: the i-th record a reader reads is near record i·P of the global order.
  """
  if split not in manifest["splits"]:
    raise ValueError(f"DATA_DIR '{data_dir}' has no split '{split}' "
                     f"(available: {sorted(manifest['splits'])})")
  shards = [(resolve_path(data_dir, s["path"]), int(s["num_records"] if "num_records" in s
                                                   else s["num_documents"]))
            for s in manifest["splits"][split]["shards"]]
  uneven = split in ordered_splits(manifest) and len(shards) % process_count
  if len(shards) >= process_count and not uneven:
    return shards[process_index::process_count], None
  count = lambda n: len(range(process_index, n, process_count))  # records i with i % P == index
  return [(p, count(n)) for p, n in shards], (process_count, process_index)


def make_dataset(data_dir: str, split: str, *, batch_size: int, seq_len: int, seed: int = 0,
                 shuffle: bool = True, repeat: bool = True, process_index: int | None = None,
                 process_count: int | None = None, shuffle_buffer: int = 1024,
                 num_parallel_reads: int = AUTOTUNE, cycle_length: int | None = None,
                 records_per_read: int = 64, on_corrupt: str = "raise", verify: str = "size",
                 prefetch: int = AUTOTUNE, order_window: int = 0) -> tf.data.Dataset:
  """This process's batches of packed rows; see `packing.pack_features` for the element.

  Shards are dealt to processes round-robin (record-level when there are fewer shards than
  processes). Rows are cut from the stream of documents (each ending in EOS) in read order, so
  with repeat=True rows run across epochs and no token is dropped; with repeat=False the last row
  and the last batch are padded (segment 0, weight 0) so no token is dropped either. Pre-packed
  data (manifest packed_length == seq_len + 1) is read with its stored segment ids and positions,
  without repacking; other lengths are repacked from its tokens.

  Chat data (manifest format "chat") stores a loss weight per token: rows hold whole conversations
  (next-fit in read order, `packing.pack_documents_np`; one longer than a row is cut to it), and a
  batch's weights are the segment validity above times the stored weight of each target token.

  Shuffling is in two levels, both pure functions of (seed, position), so the iterator checkpoint
  holds no buffer: shard order is reshuffled each epoch, and rows are permuted within consecutive
  blocks of `shuffle_buffer` rows (a vectorized permutation instead of a per-row shuffle buffer).

  An ordered split (`preprocess --order_by`, manifest "order") is read in its order: its shards in
  manifest order, all open at once, one record from each in turn (the writer dealt the sorted
  records round-robin, so this is the sorted sequence), and never shuffled across it: with
  shuffle=True, rows are permuted only within consecutive blocks of `order_window` rows (0: not at
  all). Each epoch repeats the same order.

  Args:
    data_dir: prepared DATA_DIR.
    split: "train" or "validation".
    batch_size: rows per batch produced by this process.
    seq_len: L; rows hold L+1 tokens (inputs = row[:-1], targets = row[1:]).
    seed: file-order and row shuffle seed (same seed -> same batches).
    shuffle: shuffle shard order each epoch and rows within blocks of `shuffle_buffer` rows.
    repeat: cycle forever.
    process_index, process_count: default jax.process_index() / jax.process_count().
    num_parallel_reads: parallel shard readers.
    cycle_length: shards open at once (default min(#shards, 8)); fixed, so order is machine-independent.
    records_per_read: records parsed per `parse_example` call.
    on_corrupt: "raise": an unreadable shard fails naming the file; "skip": its unreadable tail
      is skipped and a warning with the count of skipped records is printed.
    verify: manifest checks before reading ("none", "size", "sha256").
    prefetch: batches prefetched.
    order_window: an ordered split's local shuffle: rows permuted within blocks of this many (with
      shuffle=True; 0 = strict order, the default). `shuffle_buffer` and `cycle_length` do not apply.

  Returns:
    tf.data.Dataset of {inputs, targets, segment_ids, positions: int32 (B, L), weights: f32 (B, L)}.
  """
  if on_corrupt not in ("raise", "skip"):
    raise ValueError(f"on_corrupt must be 'raise' or 'skip', got '{on_corrupt}'")
  if batch_size < 1 or seq_len < 1:
    raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}")
  manifest = load_manifest(data_dir, verify=verify)
  if process_index is None or process_count is None:
    import jax  # pylint: disable=g-import-not-at-top  (lazy: TF-only users never load JAX)
    process_index, process_count = jax.process_index(), jax.process_count()
  if order_window < 0:
    raise ValueError(f"order_window must be >= 0, got {order_window}")
  shards, record_shard = host_shards(manifest, data_dir, split, process_index, process_count)
  pad_id, eos_id, length = manifest["pad_id"], manifest["eos_id"], seq_len + 1
  local_seed = seed * 1_000_003 + process_index
  ordered = split in ordered_splits(manifest)
  files = tf.data.Dataset.from_tensor_slices(([p for p, _ in shards],
                                             tf.constant([n for _, n in shards], tf.int64)))
  if shuffle and not ordered:
    files = files.shuffle(len(shards), seed=local_seed, reshuffle_each_iteration=True)
  if repeat:
    files = files.repeat()
  read = functools.partial(_read_shard, records_per_read=records_per_read,
                           record_shard=record_shard, on_corrupt=on_corrupt)
  if ordered:  # one record of each shard in turn: the order the writer dealt them in
    log.info("DATA_DIR '%s' split '%s' is ordered by %s: read in that order (local shuffle window: %d rows)",
             data_dir, split, manifest["order"].get("by"), order_window if shuffle else 0)
    ds = files.interleave(graph_fn(lambda path, n: read(path, n).unbatch()), cycle_length=len(shards),
                          block_length=1, num_parallel_calls=num_parallel_reads, deterministic=True)
    ds = ds.batch(records_per_read)
  else:
    ds = files.interleave(graph_fn(read), cycle_length=cycle_length or min(len(shards), 8), block_length=1,
                          num_parallel_calls=num_parallel_reads, deterministic=True)
  packed = manifest.get("packed_length")
  chat = manifest.get("format", "text") in WEIGHTED
  window = (order_window if ordered else shuffle_buffer) if shuffle else 0  # rows permuted together
  block = window or batch_size  # rows
  if packed == length:  # pre-packed rows with their segment ids and positions: no repacking
    parse = functools.partial(packing.parse_packed, length=length, dtype=manifest["packed_dtype"],
                              channels=4 if chat else 3)
    ds = ds.map(graph_fn(parse), num_parallel_calls=AUTOTUNE, deterministic=True)
    if window:
      ds = ds.rebatch(block, drop_remainder=False)
  elif chat and packed:
    again = "without --pack_length" if manifest["format"] == "chat" else f"with --pack_length={length}"
    raise ValueError(f"DATA_DIR '{data_dir}' holds {manifest['format']} rows pre-packed to {packed} tokens: read it "
                     f"with seq_len={packed - 1} (got {seq_len}), or preprocess it again {again}")
  elif chat:  # whole conversations with their loss weights, packed into rows without splitting any
    longest = manifest["splits"][split].get("max_document_tokens", 0)
    if longest > length:
      log.warning("DATA_DIR '%s' split '%s' has conversations of up to %d tokens: those longer than "
                  "seq_len + 1 = %d are cut to it (preprocess --max_tokens drops or cuts them at a turn "
                  "boundary instead)", data_dir, split, longest, length)
    ds = ds.map(graph_fn(_parse_chat), num_parallel_calls=AUTOTUNE, deterministic=True).unbatch()
    ds = _pack_documents(ds, length=length, pad_id=pad_id, flush=not repeat)
    ds = ds.batch(block, drop_remainder=False)
  else:
    if packed:
      parse = functools.partial(_parse_packed_flat, length=packed, dtype=manifest["packed_dtype"],
                                pad_id=pad_id)
    else:
      parse = _parse_flat
    ds = ds.map(graph_fn(parse), num_parallel_calls=AUTOTUNE, deterministic=True)
    ds = ds.rebatch(block * length, drop_remainder=repeat)
    ds = ds.map(graph_fn(functools.partial(_to_rows, length=length, pad_id=pad_id, eos_id=eos_id)),
                num_parallel_calls=AUTOTUNE, deterministic=True)
  if window:
    ds = ds.enumerate().map(graph_fn(functools.partial(_permute, seed=local_seed)),
                            num_parallel_calls=AUTOTUNE, deterministic=True)
  ds = ds.rebatch(batch_size, drop_remainder=repeat)
  if not repeat:
    ds = ds.map(graph_fn(lambda rows: _pad_to(rows, batch_size, 0)))
  ds = ds.map(graph_fn(packing.row_features), num_parallel_calls=AUTOTUNE, deterministic=True)
  options = tf.data.Options()
  options.deterministic = True
  return ds.with_options(options).prefetch(prefetch)


def prefetch_depth(iterator) -> int | None:
  """Batches waiting in the final prefetch buffer of a tf.data iterator (None if unavailable).

  tf.data has no public gauge for this; its autotuning model (`get_model_proto`) records the
  buffered elements of every asynchronous node, and we read the outermost Prefetch node.
  """
  try:
    model = tf.data.experimental.get_model_proto(iterator)
  except Exception:  # pylint: disable=broad-except  (autotune off, or an older TF)
    return None
  node = model.nodes.get(model.output)
  for _ in range(len(model.nodes)):
    if node is None:
      return None
    if node.name == "Prefetch":
      return int(node.buffered_elements)
    node = model.nodes.get(node.inputs[0]) if node.inputs else None
  return None


def release(iterator) -> None:
  """Frees a tf.data iterator on a daemon thread once the caller's last reference to it is gone.

  Freeing one joins its threads, and its autotuning thread can miss the cancellation and sleep out its period first:
  7 of 17 runs of the demo's 300 steps waited 24.6–30.5 s at the end for it (docs/performance.md). TensorFlow lets go
  of the GIL while it waits, so the thread costs the caller nothing, and a process that exits does not wait for it.
  If the caller still holds the iterator after 5 s, the thread lets go of it and the caller frees it as before.
  """
  held = [iterator]
  del iterator

  def drop():
    deadline = time.monotonic() + 5
    while sys.getrefcount(held[0]) > 2 and time.monotonic() < deadline:  # 2: `held` and getrefcount's argument
      time.sleep(0.01)
    held.clear()

  threading.Thread(target=drop, name="t5x_like-release-iterator", daemon=True).start()


def unigram_baseline(data_dir: str, max_tokens: int = 20_000_000, seq_len: int = 1023) -> float:
  """Cross-entropy (nats/token) of the validation targets under the train split's unigram distribution
  (add-one smoothed, from at most `max_tokens` train tokens): the loss a model that ignores context gets.

  A trained model's eval/loss should sit well below it.
  """
  counts = {}
  for split, cap in (("train", max_tokens), ("validation", max_tokens)):
    seen = np.zeros(int(load_manifest(data_dir, verify="none")["vocab_size"]), np.int64)
    ds = make_dataset(data_dir, split, batch_size=16, seq_len=seq_len, shuffle=False, repeat=False,
                      process_index=0, process_count=1)
    for batch in ds:
      targets = batch["targets"].numpy()[batch["weights"].numpy() > 0]
      seen += np.bincount(targets, minlength=seen.size)[:seen.size]
      if seen.sum() >= cap:
        break
    counts[split] = seen
  train, val = counts["train"], counts["validation"]
  log_p = np.log((train + 1) / (train.sum() + train.size))
  return float(-(val * log_p).sum() / max(val.sum(), 1))
