"""Per-input cache of tokenized documents, keyed by content hash and every setting that matters."""

from __future__ import annotations

import collections
import hashlib
import io
import json
import logging
import os

import numpy as np
import tensorflow as tf

from t5x_like.data import text_cleaning
from t5x_like.data.shard_writer import join

log = logging.getLogger(__name__)
CACHE_VERSION = "1"  # bump when the cached content changes meaning


def digest(*parts) -> str:
  return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


class Cache:
  """Per-input results keyed by content hash + settings, so unchanged inputs are not re-tokenized."""

  def __init__(self, cache_dir: str | None):
    self.dir = cache_dir
    if cache_dir:
      tf.io.gfile.makedirs(cache_dir)

  def path(self, name: str) -> str | None:
    return join(self.dir, name) if self.dir else None

  def get_docs(self, key: str) -> text_cleaning.FileDocuments | None:
    path = self.path(f"docs-{key}.npz")
    if not path or not tf.io.gfile.exists(path):
      return None
    try:
      with tf.io.gfile.GFile(path, "rb") as f:
        z = np.load(io.BytesIO(f.read()))
        counts = collections.Counter(json.loads(str(z["counts"])))
        scores = z["scores"] if "scores" in z.files else None  # --order_by=field:NAME values
        return text_cleaning.FileDocuments(z["tokens"], z["lengths"], z["hashes"], counts, scores)
    except Exception as e:  # a damaged cache entry is recomputed, never trusted
      log.warning("Ignoring unreadable cache entry %s: %s", path, e)
      return None

  def put_docs(self, key: str, docs: text_cleaning.FileDocuments) -> None:
    path = self.path(f"docs-{key}.npz")
    if not path:
      return
    buf = io.BytesIO()
    scores = {} if docs.scores is None else {"scores": docs.scores}
    np.savez(buf, tokens=docs.tokens, lengths=docs.lengths, hashes=docs.hashes,
             counts=np.array(json.dumps(dict(docs.counts))), **scores)
    tmp = f"{path}.tmp-{os.getpid()}"
    with tf.io.gfile.GFile(tmp, "wb") as f:
      f.write(buf.getvalue())
    tf.io.gfile.rename(tmp, path, overwrite=True)
