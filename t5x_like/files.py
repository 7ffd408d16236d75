"""Whole-file writes a reader never sees half-done (a temporary name, then a rename), local or gs://."""

import contextlib
import os
import posixpath
from typing import Iterator, Union

import tensorflow as tf


@contextlib.contextmanager
def atomic_path(path: str) -> Iterator[str]:
  """Yields a temporary path next to `path`; renames it onto `path` when the block ends without error.

  Example:
    with atomic_path("gs://b/data/train-00000.tfrecord") as tmp:
      with tf.io.TFRecordWriter(tmp) as w: ...
  """
  parent = posixpath.dirname(path) if "://" in path else os.path.dirname(path)
  if parent:
    tf.io.gfile.makedirs(parent)
  tmp = f"{path}.tmp-{os.getpid()}"
  try:
    yield tmp
  except BaseException:
    if tf.io.gfile.exists(tmp):
      tf.io.gfile.remove(tmp)
    raise
  tf.io.gfile.rename(tmp, path, overwrite=True)


def write_atomic(path: str, data: Union[bytes, str]) -> None:
  """Writes `data` (bytes, or text as UTF-8) to `path` through tf.io.gfile via a temporary file."""
  with atomic_path(path) as tmp:
    with tf.io.gfile.GFile(tmp, "wb" if isinstance(data, bytes) else "w") as f:
      f.write(data)
