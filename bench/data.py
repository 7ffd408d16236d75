"""Preprocess throughput on this machine: each input reader, MinHash signatures + LSH, and tokenization per core
against SentencePiece's own batch encoder (docs/data.md quotes the numbers).

    python bench/data.py [--docs 20000] [--words 200]

Generated web-like documents (a 2,000-word vocabulary, `--words` words each) are written as JSON lines (plain,
.gz, .zst), Parquet, a datasets.save_to_disk-style folder and plain text; each reader is timed on one core
(text_cleaning.read_documents + clean_text), then MinHash signatures (near_dedup.signatures) and the LSH walk
(near_dedup.find_near_duplicates), then tokenization: our worker path (text_cleaning.tokenize_texts, one
process) against sentencepiece.SentencePieceProcessor.encode(list, num_threads=1) on the same texts.
"""

import argparse
import collections
import gzip
import json
import os
import random
import tempfile
import time

import pyarrow as pa
import pyarrow.parquet as pq
import sentencepiece as spm
import zstandard

from t5x_like.data import near_dedup
from t5x_like.data import preprocessing as pp
from t5x_like.data import text_cleaning
from t5x_like.data import tokenizer as tokenizer_lib
from t5x_like.data import tokenizer_formats


def make_texts(n, words, seed=0):
  rng = random.Random(seed)
  vocab = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(2000)]
  return [" ".join(rng.choice(vocab) for _ in range(words)) + "." for _ in range(n)]


def write_inputs(root, texts):
  lines = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()
  paths = {"jsonl": os.path.join(root, "d.jsonl"), "jsonl.gz": os.path.join(root, "d.jsonl.gz"),
           "jsonl.zst": os.path.join(root, "d.jsonl.zst"), "parquet": os.path.join(root, "d.parquet"),
           "datasets folder": os.path.join(root, "ds"), "text (blank_line)": os.path.join(root, "d.txt")}
  open(paths["jsonl"], "wb").write(lines)
  open(paths["jsonl.gz"], "wb").write(gzip.compress(lines))
  open(paths["jsonl.zst"], "wb").write(zstandard.ZstdCompressor().compress(lines))
  pq.write_table(pa.table({"text": texts}), paths["parquet"])
  os.makedirs(paths["datasets folder"])
  table = pa.table({"text": texts})
  with pa.ipc.new_stream(os.path.join(paths["datasets folder"], "data-00000-of-00001.arrow"), table.schema) as w:
    w.write_table(table)
  json.dump({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]},
            open(os.path.join(paths["datasets folder"], "state.json"), "w"))
  open(paths["text (blank_line)"], "w").write("\n\n".join(texts))
  return paths


def bench_readers(paths, mb):
  cfg = text_cleaning.CleaningConfig()
  for name, path in paths.items():
    raw = pp.read_raw(path)
    t0 = time.perf_counter()
    counts = collections.Counter()
    docs, _ = text_cleaning.read_documents(raw, pp.input_kind(path), "blank_line", "text", counts, path)
    docs = [text_cleaning.clean_text(d, cfg, counts) for d in docs]
    dt = time.perf_counter() - t0
    print(f"| read + clean: {name} | {len(docs) / dt:,.0f} | {mb / dt:.1f} |")


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--docs", type=int, default=20000)
  ap.add_argument("--words", type=int, default=200)
  args = ap.parse_args()
  texts = make_texts(args.docs, args.words)
  mb = sum(len(t.encode()) for t in texts) / 1e6
  print(f"{args.docs} documents of {args.words} words, {mb:.1f} MB of text, one core\n")
  print("| stage | documents/s | MB/s |\n|---|---|---|")
  with tempfile.TemporaryDirectory() as root:
    bench_readers(write_inputs(root, texts), mb)
    config = near_dedup.NearDedupConfig(enabled=True)
    t0 = time.perf_counter()
    sigs = near_dedup.signatures(texts, config)
    dt = time.perf_counter() - t0
    print(f"| MinHash signatures (128 perm, 5-word shingles) | {len(texts) / dt:,.0f} | {mb / dt:.1f} |")
    t0 = time.perf_counter()
    near_dedup.find_near_duplicates(sigs, config)
    dt = time.perf_counter() - t0
    print(f"| MinHash LSH walk (threshold 0.8) | {len(texts) / dt:,.0f} | {mb / dt:.1f} |")
    tok = tokenizer_lib.train_tokenizer(iter(texts[:5000]), os.path.join(root, "t.model"), vocab_size=8000)
    ours = tokenizer_formats.encoder(tok.encoder_model)
    t0 = time.perf_counter()
    text_cleaning.tokenize_texts(texts, ours, tok.eos_id)
    dt_ours = time.perf_counter() - t0
    sp = spm.SentencePieceProcessor(model_proto=tok.encoder_model)
    t0 = time.perf_counter()
    sp.encode(texts, num_threads=1)
    dt_sp = time.perf_counter() - t0
    print(f"| tokenize (ours: tokenize_texts, 1 process) | {len(texts) / dt_ours:,.0f} | {mb / dt_ours:.1f} |")
    print(f"| tokenize (SentencePiece encode(list, num_threads=1)) | {len(texts) / dt_sp:,.0f} | {mb / dt_sp:.1f} |")


if __name__ == "__main__":
  main()
