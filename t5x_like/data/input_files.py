"""Finding and reading preprocess inputs on any TF filesystem: globs, `datasets` folders, their bytes."""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from t5x_like.data import readers
from t5x_like.data import shard_writer


def is_dataset_folder(path: str) -> bool:
  """A `datasets.Dataset.save_to_disk` folder (state.json + Arrow files)."""
  return tf.io.gfile.isdir(path) and tf.io.gfile.exists(shard_writer.join(path, readers.HF_STATE))


def expand_inputs(patterns: Sequence[str]) -> list[str]:
  """Expands each glob (any TF filesystem) to files and `datasets` folders; a pattern matching none is an
  error naming it, and so is a DatasetDict folder (name one of its split folders)."""
  if isinstance(patterns, str):
    patterns = [patterns]
  if not patterns:
    raise ValueError("No --input given")
  files = []
  for pattern in patterns:
    found = sorted(tf.io.gfile.glob(pattern))
    for p in found:
      if tf.io.gfile.isdir(p) and tf.io.gfile.exists(shard_writer.join(p, readers.HF_DICT)):
        raise ValueError(f"--input '{p}' is a datasets DatasetDict folder: give one split's folder, e.g. "
                         f"'{shard_writer.join(p, 'train')}'")
    matches = [p for p in found if not tf.io.gfile.isdir(p) or is_dataset_folder(p)]
    if not matches:
      raise ValueError(f"--input '{pattern}' matches no file")
    files.extend(m for m in matches if m not in files)
  return files


def input_kind(path: str) -> str:
  """readers.input_kind: "hf_dataset", "jsonl", "parquet", "html" or "text"."""
  return readers.input_kind(path, is_dir=is_dataset_folder(path))


def read_raw(path: str) -> bytes:
  """An input's bytes as stored (compressed ones compressed); a `datasets` folder's Arrow files, framed."""
  if is_dataset_folder(path):
    with tf.io.gfile.GFile(shard_writer.join(path, readers.HF_STATE), "rb") as f:
      names = readers.hf_dataset_files(f.read(), path)
    parts = []
    for name in names:
      with tf.io.gfile.GFile(shard_writer.join(path, name), "rb") as f:
        parts.append(f.read())
    return readers.frame(parts)
  with tf.io.gfile.GFile(path, "rb") as f:
    return f.read()


def read_input(path: str) -> bytes:
  """A file's bytes, .gz / .zst uncompressed; a corrupt one is a ValueError naming it."""
  return readers.decompress(read_raw(path), path)
