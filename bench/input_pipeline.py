"""Input pipeline throughput (tokens/s): read+parse ceiling, runtime packing, pre-packed rows."""

from __future__ import annotations

import os
import sys
import tempfile
import time

from absl import app
from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_TOKENS = flags.DEFINE_integer("tokens", 16_000_000, "Synthetic corpus size in tokens.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 1024, "Model sequence length L (rows of L+1).")
_BATCH = flags.DEFINE_integer("batch_size", 32, "Rows per batch.")
_SHARDS = flags.DEFINE_integer("shards", 8, "Shards per dataset.")
_SECONDS = flags.DEFINE_float("seconds", 5.0, "Minimum measuring time per row of the table.")
_WORK_DIR = flags.DEFINE_string("work_dir", None, "Where to write the synthetic data (temp dir).")


def write_synthetic(out_dir: str, tokens: int, shards: int, pack_length: int | None) -> None:
  """A DATA_DIR of random documents (log-normal lengths, mean ~1000 tokens) with a real manifest."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from t5x_like.data import shard_writer  # pylint: disable=g-import-not-at-top
  from t5x_like.data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  tok = tokenizer_lib.train_tokenizer(["the quick brown fox jumps over the lazy dog " * 50] * 20,
                                      None, vocab_size=300, num_threads=1)
  docs, total = [], 0
  while total < tokens:
    n = int(min(max(rng.lognormal(6.5, 0.8), 8), 16_000))
    doc = rng.integers(4, 8192, size=n, dtype=np.int32)
    doc[-1] = tok.eos_id
    docs.append(doc)
    total += n
  plan = shard_writer.plan_shards([len(d) for d in docs], shards, seed=0)
  entries = [shard_writer.write_shard(out_dir, shard_writer.shard_name("train", i, shards),
                                      [docs[j] for j in plan[i]], pack_length, tok.pad_id)
             for i in range(shards)]
  tok.save(os.path.join(out_dir, shard_writer.TOKENIZER))
  manifest = shard_writer.make_manifest(tok, {"train": shard_writer.split_entry(entries)},
                                        pack_length, {"synthetic": True})
  manifest["vocab_size"] = 8192
  shard_writer.write_json(os.path.join(out_dir, shard_writer.MANIFEST), manifest)


def measure(ds, tokens_of, seconds: float) -> tuple[float, float, int]:
  """(tokens/s, tokens per CPU-second of this process, elements) of `ds`, consumed in-graph."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  count = lambda n: ds.take(n).reduce(tf.constant(0, tf.int64), lambda a, x: a + tokens_of(x))
  count(4)  # warm up: graph building, file opening, autotuning start
  n = 16
  while True:
    start, cpu = time.perf_counter(), time.process_time()
    tokens = int(count(n))
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    if elapsed >= seconds:
      return tokens / elapsed, tokens / max(cpu, 1e-9), n
    n = int(n * max(2.0, 1.2 * seconds / max(elapsed, 1e-3)))


def main(argv) -> None:
  del argv
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from t5x_like.data import input_pipeline as ip  # pylint: disable=g-import-not-at-top
  length = _SEQ_LEN.value + 1
  work = _WORK_DIR.value or tempfile.mkdtemp(prefix="bench_input_")
  docs_dir, packed_dir = os.path.join(work, "docs"), os.path.join(work, "packed")
  for d, pack in ((docs_dir, None), (packed_dir, length)):
    if not os.path.exists(os.path.join(d, "manifest.json")):
      t = time.time()
      write_synthetic(d, _TOKENS.value, _SHARDS.value, pack)
      print(f"wrote {d} in {time.time() - t:.1f}s", file=sys.stderr)

  def files(d):
    m = ip.load_manifest(d)
    paths = [ip.resolve_path(d, s["path"]) for s in m["splits"]["train"]["shards"]]
    return tf.data.Dataset.from_tensor_slices(paths).repeat().interleave(
        tf.data.TFRecordDataset, cycle_length=len(paths), num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True).batch(64)

  ragged = {"tokens": tf.io.RaggedFeature(tf.int64)}
  from t5x_like.data import packing  # pylint: disable=g-import-not-at-top
  dtype = ip.load_manifest(packed_dir)["packed_dtype"]
  parse_docs = files(docs_dir).map(lambda s: tf.io.parse_example(s, ragged)["tokens"].flat_values,
                                   num_parallel_calls=tf.data.AUTOTUNE)
  parse_rows = files(packed_dir).map(lambda s: packing.parse_packed(s, length, dtype),
                                     num_parallel_calls=tf.data.AUTOTUNE)
  common = dict(batch_size=_BATCH.value, seq_len=_SEQ_LEN.value, process_index=0, process_count=1)
  size = lambda x: tf.size(x, out_type=tf.int64)
  batch_tokens = lambda b: tf.size(b["inputs"], out_type=tf.int64)
  rows = [
      ("read + parse, one document per record (ceiling)", parse_docs, size),
      ("read + decode, pre-packed rows (ceiling)", parse_rows, lambda x: size(x) // 3),
      ("make_dataset, runtime packing", ip.make_dataset(docs_dir, "train", **common), batch_tokens),
      ("make_dataset, pre-packed", ip.make_dataset(packed_dir, "train", **common), batch_tokens),
      ("make_dataset, runtime packing, no shuffle",
       ip.make_dataset(docs_dir, "train", shuffle=False, **common), batch_tokens),
      ("make_dataset, pre-packed, no shuffle",
       ip.make_dataset(packed_dir, "train", shuffle=False, **common), batch_tokens),
  ]
  print(f"\nInput pipeline on {os.cpu_count()} CPU cores, L={_SEQ_LEN.value}, "
        f"B={_BATCH.value}, {_TOKENS.value / 1e6:.0f}M-token synthetic corpus, "
        f"{_SHARDS.value} shards\n")
  print("| pipeline | tokens/s | tokens per CPU-second | elements timed |\n|---|---:|---:|---:|")
  for name, ds, tokens_of in rows:
    rate, per_cpu, n = measure(ds, tokens_of, _SECONDS.value)
    print(f"| {name} | {rate / 1e6:.1f}M | {per_cpu / 1e6:.1f}M | {n} |", flush=True)
  print("\nwall tokens/s counts what the pipeline delivers with the CPUs it gets (other processes "
        "share them); tokens per CPU-second is its cost. Load average: "
        f"{os.getloadavg()[0]:.1f}.")


if __name__ == "__main__":
  app.run(main)
