"""Prepares DATA_DIR from this machine's Python standard library sources (no download)."""

from __future__ import annotations

import logging
import os
import sys
import sysconfig

from absl import app
from absl import flags

_HERE = os.path.dirname(os.path.abspath(__file__))
_OUTPUT_DIR = flags.DEFINE_string("output_dir", os.path.join(_HERE, "prepared"),
                                  "DATA_DIR to write (git-ignored by default).")
_MAX_MB = flags.DEFINE_float("max_mb", 10.0, "Stop adding files once the corpus reaches this size.")
_INCLUDE_TESTS = flags.DEFINE_bool("include_tests", False, "Include the stdlib's test packages.")
_VOCAB_SIZE = flags.DEFINE_integer("vocab_size", 4096, "SentencePiece vocabulary size.")
_NUM_TRAIN_SHARDS = flags.DEFINE_integer("num_train_shards", 8, "Train shards.")
_VALIDATION_FRACTION = flags.DEFINE_float("validation_fraction", 0.02, "Validation share.")
_PACK_LENGTH = flags.DEFINE_integer("pack_length", None, "Pre-pack rows of this many tokens.")
_MAX_TOKENIZER_MB = flags.DEFINE_float("max_tokenizer_mb", 3.0, "Text used to train the tokenizer.")
_NUM_WORKERS = flags.DEFINE_integer("num_workers", 0, "Tokenization processes (0: CPU count).")
_SEED = flags.DEFINE_integer("seed", 0, "Split and shard seed.")


def stdlib_files(max_bytes: int, include_tests: bool = False) -> list[str]:
  """The stdlib's *.py files in sorted path order, until their total size reaches max_bytes."""
  root = sysconfig.get_paths()["stdlib"]
  skip = {"site-packages", "dist-packages", "__pycache__"}
  if not include_tests:
    skip |= {"test", "tests", "idle_test"}
  files, total = [], 0
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in skip)
    for name in sorted(filenames):
      if name.endswith(".py"):
        path = os.path.join(dirpath, name)
        size = os.path.getsize(path)
        if size and total < max_bytes:
          files.append(path)
          total += size
  if not files:
    raise SystemExit(f"prepare: error: no *.py files under the stdlib directory '{root}'")
  return files


def main(argv) -> None:
  del argv
  logging.basicConfig(level=logging.INFO, format="%(message)s")
  from t5x_like.data import data_dir  # pylint: disable=g-import-not-at-top  (after flag parsing)
  from t5x_like.data import preprocessing as preprocess  # pylint: disable=g-import-not-at-top
  files = stdlib_files(int(_MAX_MB.value * 2**20), _INCLUDE_TESTS.value)
  logging.info("Corpus: %d files, %.1f MB from %s", len(files),
               sum(map(os.path.getsize, files)) / 2**20, sysconfig.get_paths()["stdlib"])
  report = preprocess.preprocess(
      files, _OUTPUT_DIR.value, vocab_size=_VOCAB_SIZE.value, num_train_shards=_NUM_TRAIN_SHARDS.value,
      validation_fraction=_VALIDATION_FRACTION.value, pack_length=_PACK_LENGTH.value,
      max_tokenizer_chars=int(_MAX_TOKENIZER_MB.value * 2**20), num_workers=_NUM_WORKERS.value or None,
      seed=_SEED.value, doc_split="file")
  print(data_dir.format_report(report))
  print(f"DATA_DIR={_OUTPUT_DIR.value}")


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.dirname(_HERE)))  # run from a checkout without install
  app.run(main)
