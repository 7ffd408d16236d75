"""Train/validation split, balanced seeded sharding, optional packing and atomic TFRecord writes."""

from __future__ import annotations

import hashlib
import heapq
import json
import os
import posixpath
from typing import Iterable, Sequence

import numpy as np
import tensorflow as tf

from t5x_like.data import packing
from t5x_like.data.input_pipeline import file_sha256

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.model"
SPLITS = ("train", "validation")
# The per-token features each record format stores ("weights": 0/1 loss weight of predicting the token).
FEATURES = {"text": ("tokens",), "chat": ("tokens", "weights"), "preference": ("tokens", "weights")}


def join(base: str, rel: str) -> str:
  """Joins for local and URL-like paths (gs://bucket/dir) alike."""
  return posixpath.join(base, rel) if "://" in base else os.path.join(base, rel)


def shard_name(split: str, index: int, count: int) -> str:
  return f"{split}-{index:05d}-of-{count:05d}.tfrecord"


def is_validation(doc_hash: bytes, fraction: float, seed: int) -> bool:
  """Deterministic split by content: the same document lands in the same split on every run."""
  h = hashlib.sha256(seed.to_bytes(8, "little", signed=True) + bytes(doc_hash)).digest()
  return int.from_bytes(h[:8], "little") < fraction * 2.0**64


MAX_TOPPED_UP_FRACTION = 0.1  # the validation minimum never takes more than this share of the documents


def _split_score(doc_hash: bytes, seed: int) -> bytes:
  return hashlib.sha256(seed.to_bytes(8, "little", signed=True) + bytes(doc_hash)).digest()


def split_documents(hashes: Sequence[bytes], fraction: float, seed: int, lengths: Sequence[int] | None = None,
                    min_documents: int = 0, min_tokens: int = 0) -> np.ndarray:
  """Boolean mask of validation documents: those whose seeded content hash falls under `fraction`; at
  least one when fraction > 0 and there are >= 2 docs. With fraction > 0, topped up in the same hash order
  to `min_documents` documents and `min_tokens` tokens (`lengths`), but never past MAX_TOPPED_UP_FRACTION
  of the documents, so small corpora still get a validation split large enough to measure."""
  mask = np.array([is_validation(h, fraction, seed) for h in hashes], bool)
  if fraction > 0 and len(hashes) >= 2:
    order = np.argsort([_split_score(h, seed) for h in hashes], kind="stable")  # lowest score first
    if not mask.any():
      mask[order[0]] = True
    cap = max(int(mask.sum()), int(len(hashes) * MAX_TOPPED_UP_FRACTION))
    sizes = np.zeros(len(hashes), np.int64) if lengths is None else np.asarray(lengths, np.int64)
    docs, tokens = int(mask.sum()), int(sizes[mask].sum())
    for i in order:
      if docs >= cap or (docs >= min_documents and (lengths is None or tokens >= min_tokens)):
        break
      if not mask[i]:
        mask[i] = True
        docs, tokens = docs + 1, tokens + int(sizes[i])
  if mask.all() and len(hashes) >= 2:  # keep at least one training document
    mask[0] = False
  return mask


def plan_shards(lengths: Sequence[int], num_shards: int, seed: int) -> list[list[int]]:
  """Assigns documents to shards: seeded shuffle, then each to the shard with fewest tokens so far.

  Example:
    >>> plan_shards([5, 1, 1, 3], num_shards=2, seed=0)   # two shards of 5 tokens each
    [[0], [3, 1, 2]]   # (order depends on the seed)

  Returns:
    For each shard, the document indices in the order they are written.
  """
  order = np.random.default_rng(seed).permutation(len(lengths))
  heap = [(0, i) for i in range(num_shards)]
  shards: list[list[int]] = [[] for _ in range(num_shards)]
  for doc in order.tolist():
    size, i = heapq.heappop(heap)
    shards[i].append(doc)
    heapq.heappush(heap, (size + int(lengths[doc]), i))
  return shards


def pack_rows(docs: Iterable[np.ndarray], length: int, pad_id: int) -> np.ndarray:
  """Concatenates documents and cuts the stream into rows of `length`; the last row is padded.

  Example:
    >>> pack_rows([np.array([5, 6, 1]), np.array([7, 1])], length=3, pad_id=0)
    array([[5, 6, 1], [7, 1, 0]], dtype=int32)
  """
  stream = np.concatenate([np.asarray(d, np.int32) for d in docs] or [np.zeros([0], np.int32)])
  rows = -(-len(stream) // length)
  out = np.full([rows * length], pad_id, np.int32)
  out[:len(stream)] = stream
  return out.reshape(rows, length)


def serialize(tokens: np.ndarray, weights: np.ndarray | None = None) -> bytes:
  """One `tf.train.Example` with int64 feature "tokens" (and "weights", the per-token loss weights)."""
  int64 = lambda x: tf.train.Feature(int64_list=tf.train.Int64List(value=np.asarray(x).tolist()))
  feature = {"tokens": int64(tokens)}
  if weights is not None:
    feature["weights"] = int64(weights)
  return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


def write_records(path: str, records: Iterable[bytes]) -> dict:
  """Writes a TFRecord file to a temporary name and renames it into place when complete."""
  tmp = f"{path}.tmp-{os.getpid()}"
  tf.io.gfile.makedirs(posixpath.dirname(path) if "://" in path else os.path.dirname(path) or ".")
  n = 0
  with tf.io.TFRecordWriter(tmp) as w:
    for r in records:
      w.write(r)
      n += 1
  tf.io.gfile.rename(tmp, path, overwrite=True)
  return {"num_records": n, "num_bytes": tf.io.gfile.stat(path).length, "sha256": file_sha256(path)}


def write_shard(output_dir: str, name: str, docs: Sequence[np.ndarray], pack_length: int | None,
                pad_id: int, eos_id: int = 1, packed_dtype: str = "uint16",
                weights: Sequence[np.ndarray] | None = None) -> dict:
  """Writes one shard of documents (or of packed rows) and returns its manifest entry.

  With `weights` (chat data: one loss-weight array per document), records carry them next to the
  tokens, and packed rows hold whole documents (`packing.pack_documents_np`) with a weights channel.
  """
  if pack_length and weights is not None:
    records = (packing.serialize_packed_row(row, packed_dtype)
               for row in packing.pack_documents_np(zip(docs, weights), pack_length, pad_id))
  elif pack_length:
    rows = pack_rows(docs, pack_length, pad_id)
    segments, positions = packing.segment_rows_np(rows, pad_id, eos_id)
    records = (packing.serialize_packed_row(np.stack(x), packed_dtype)
               for x in zip(rows, segments, positions))
  elif weights is not None:
    records = (serialize(d, w) for d, w in zip(docs, weights))
  else:
    records = (serialize(d) for d in docs)
  entry = {"path": name, "num_documents": len(docs),
           "num_tokens": int(sum(len(d) for d in docs))}
  entry.update(write_records(join(output_dir, name), records))
  return entry


def write_ordered_shards(output_dir: str, split: str, docs: Sequence[np.ndarray], num_shards: int,
                         pack_length: int | None, pad_id: int, eos_id: int = 1, packed_dtype: str = "uint16",
                         weights: Sequence[np.ndarray] | None = None) -> list[dict]:
  """Writes documents already in their final order so that shard-by-shard round-robin reading restores it.

  Record k of the sequence goes to shard k % num_shards: reading record 0 of every shard, then record
  1 of every shard, ... gives records 0, 1, 2, ... With `pack_length`, the records are the rows packed
  from the whole ordered sequence (text: cut from its token stream; chat: whole documents, as in
  `write_shard`), so rows, not only documents, come back in order.

  Example (5 documents, 2 shards, no packing):
    shard 0: docs 0, 2, 4    shard 1: docs 1, 3

  Returns:
    The manifest entries of the shards, in shard order.
  """
  docs, weights = list(docs), None if weights is None else list(weights)
  names = [shard_name(split, i, num_shards) for i in range(num_shards)]
  if not pack_length:
    return [write_shard(output_dir, names[i], docs[i::num_shards], None, pad_id, eos_id, packed_dtype,
                        None if weights is None else weights[i::num_shards]) for i in range(num_shards)]
  if weights is not None:  # (R, 4, N): whole documents; each starts at position 0 of its row
    rows = packing.pack_documents_np(zip(docs, weights), pack_length, pad_id)
    row_tokens = (rows[:, packing.SEGMENTS] > 0).sum(axis=1)
    row_docs = ((rows[:, packing.POSITIONS] == 0) & (rows[:, packing.SEGMENTS] > 0)).sum(axis=1)
  else:  # (R, 3, N): the token stream cut into rows; a document counts in the row it starts in
    tokens = pack_rows(docs, pack_length, pad_id)
    lengths = np.array([len(d) for d in docs], np.int64)
    rows = np.stack([tokens, *packing.segment_rows_np(tokens, pad_id, eos_id)], axis=1)
    total = int(lengths.sum())
    row_tokens = np.clip(total - np.arange(len(rows)) * pack_length, 0, pack_length)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]) // pack_length
    row_docs = np.bincount(starts, minlength=len(rows)) if len(docs) else np.zeros(len(rows), np.int64)
  entries = []
  for i in range(num_shards):
    mine = rows[i::num_shards]
    entry = {"path": names[i], "num_documents": int(row_docs[i::num_shards].sum()),
             "num_tokens": int(row_tokens[i::num_shards].sum())}
    entry.update(write_records(join(output_dir, names[i]),
                               (packing.serialize_packed_row(row, packed_dtype) for row in mine)))
    entries.append(entry)
  return entries


def split_entry(shards: list[dict]) -> dict:
  return {"shards": shards,
          "num_documents": sum(s["num_documents"] for s in shards),
          "num_tokens": sum(s["num_tokens"] for s in shards),
          "num_records": sum(s["num_records"] for s in shards)}


def write_json(path: str, value: dict) -> None:
  tmp = f"{path}.tmp-{os.getpid()}"
  with tf.io.gfile.GFile(tmp, "w") as f:
    f.write(json.dumps(value, indent=1, sort_keys=False) + "\n")
  tf.io.gfile.rename(tmp, path, overwrite=True)


def remove_stale(output_dir: str, keep: Iterable[str]) -> list[str]:
  """Deletes shard files (and temp files) from earlier runs that the new manifest does not list."""
  keep = set(keep)
  removed = []
  for split in SPLITS:
    for path in tf.io.gfile.glob(join(output_dir, f"{split}-*.tfrecord*")):
      if posixpath.basename(path) not in keep:
        tf.io.gfile.remove(path)
        removed.append(path)
  return removed


def make_manifest(tokenizer, splits: dict, pack_length: int | None, extra: dict,
                  data_format: str = "text") -> dict:
  """The manifest.json content; see input_pipeline.load_manifest for what readers check.

  `data_format`: "text" (records hold tokens) or "chat" (tokens and per-token loss weights).
  """
  manifest = {
      "format_version": FORMAT_VERSION,
      "tokenizer": tokenizer.filename,  # tokenizer.model (SentencePiece) or tokenizer.json (HF)
      "tokenizer_sha256": tokenizer.sha256,
      "vocab_size": tokenizer.vocab_size,
      "pad_id": tokenizer.pad_id,
      "eos_id": tokenizer.eos_id,
      "bos_id": tokenizer.bos_id,
      "unk_id": tokenizer.unk_id,
      "eos_appended": True,          # every document in the records ends in exactly one EOS
      "packed_length": pack_length,  # None: one document per record; N: rows of N tokens, 0-padded
      "format": data_format,
      "features": list(FEATURES[data_format]),
  }
  if pack_length:  # raw little-endian rows with their segment ids and positions (and chat's weights)
    manifest["record_format"] = packing.RECORD_FORMAT
    manifest["packed_dtype"] = packing.packed_dtype(tokenizer.vocab_size, pack_length)
  else:
    manifest["record_format"] = "example"  # tf.train.Example, int64 "tokens" (chat: and "weights") = one document
  manifest["splits"] = splits
  manifest.update(extra)
  return manifest
