"""Weighted mixtures of DATA_DIRs: a seeded, stateless choice of source for every row, weights fixed or in stages.

Each training step's K rows of a data stream are split between the sources by systematic sampling: with
cumulative weights C and an offset u in [0, 1) hashed from (seed, stream, step), source s gets the slots
[ceil(K·C[s-1] − u), ceil(K·C[s] − u)), then the slots are permuted by a seeded permutation. So every
batch holds K·w[s] rows of source s give or take one, their expectation exactly K·w[s], and the choice is
a pure function of (seed, stream, step): nothing but the sources' own positions is in the iterator
checkpoint, resuming continues the same sequence, and the rows a source contributed up to any step can
be recounted without reading data (`Mixture.rows_seen`).
"""

from __future__ import annotations

import dataclasses
import math
import posixpath
from typing import Mapping, Sequence

import numpy as np
import tensorflow as tf

from t5x_like.data import input_pipeline

SOURCE = "source"  # the row feature naming its source: int32 (B, L), the source's index in Mixture.paths
_HASH_BUCKETS = 2**52


def _check_weights(weights: Mapping[str, float], what: str) -> None:
  if not isinstance(weights, Mapping) or not weights:
    raise ValueError(f"{what} must be a non-empty dict {{DATA_DIR: weight}}, got {weights!r}")
  for path, w in weights.items():
    if not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
      raise ValueError(f"{what}: weight of '{path}' must be a finite number >= 0, got {w!r}")
  if not sum(weights.values()) > 0:
    raise ValueError(f"{what}: weights must sum to a positive number, got {dict(weights)}")


def source_names(paths: Sequence[str]) -> list[str]:
  """Short metric names: each DATA_DIR's last folder name, with its index where two would clash."""
  base = [posixpath.basename(str(p).rstrip("/")) or f"source{i}" for i, p in enumerate(paths)]
  return [b if base.count(b) == 1 else f"{b}_{i}" for i, b in enumerate(base)]


@dataclasses.dataclass
class Mixture:
  """Sources (DATA_DIRs with one tokenizer) and their weights over training steps.

  Attributes:
    paths: the DATA_DIRs, in the order of the first weights dict (later stages may not add new ones).
    starts: int64 (stages,): the 0-based step at which each stage's weights begin (the first is 0).
    weights: float64 (stages, sources): normalised weights of each stage.
    manifests: each source's manifest (checked: same tokenizer, pad and eos ids, record format).
  """
  paths: list[str]
  starts: np.ndarray
  weights: np.ndarray
  manifests: list[dict]

  @classmethod
  def create(cls, weights: Mapping[str, float] | None = None,
             stages: Sequence[tuple[int, Mapping[str, float]]] = (), verify: str = "size") -> "Mixture":
    """From DataConfig.mixture ({DATA_DIR: weight}) or DataConfig.mixture_stages ((first step, weights), ...)."""
    if weights and stages:
      raise ValueError("set DataConfig.mixture or DataConfig.mixture_stages, not both")
    stages = list(stages) if stages else [(0, weights)]
    for k, stage in enumerate(stages):
      if not (isinstance(stage, (tuple, list)) and len(stage) == 2 and isinstance(stage[0], int)):
        raise ValueError(f"DataConfig.mixture_stages[{k}] must be (first step, {{DATA_DIR: weight}}), got {stage!r}")
      _check_weights(stage[1], "DataConfig.mixture" if k == 0 and stage[0] == 0 and len(stages) == 1
                     else f"DataConfig.mixture_stages[{k}]")
    starts = [s for s, _ in stages]
    if starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])):
      raise ValueError(f"DataConfig.mixture_stages must start at step 0 and increase, got steps {starts}")
    paths = list(stages[0][1])
    for k, (_, w) in enumerate(stages):
      extra = sorted(set(w) - set(paths))
      if extra:
        raise ValueError(f"DataConfig.mixture_stages[{k}] names '{extra[0]}', which the first stage does not "
                         f"(list every DATA_DIR in the first stage, with weight 0 if need be)")
    table = np.array([[float(w.get(p, 0.0)) for p in paths] for _, w in stages], np.float64)
    table /= table.sum(axis=1, keepdims=True)
    manifests = [input_pipeline.load_manifest(p, verify=verify) for p in paths]
    check_compatible(paths, manifests)
    return cls(paths, np.array(starts, np.int64), table, manifests)

  @property
  def names(self) -> list[str]:
    return source_names(self.paths)

  @property
  def manifest(self) -> dict:
    """The first source's manifest: the vocabulary, pad and eos every source shares."""
    return self.manifests[0]

  def block_counts(self, blocks, batch_size: int, seed: int, stream: int):
    """int32 (n, sources): rows of each source in the batches `blocks` (int64 (n,), 0-based steps) of a
    stream's `batch_size`-row batches. The one definition the reader and `rows_seen` both use."""
    blocks = tf.cast(blocks, tf.int64)
    stage = tf.searchsorted(tf.constant(self.starts), blocks, side="right") - 1
    cumulative = tf.gather(tf.constant(np.cumsum(self.weights, axis=1)), stage)  # (n, sources)
    cumulative = tf.concat([cumulative[:, :-1], tf.ones_like(cumulative[:, -1:])], axis=1)
    buckets = tf.strings.to_hash_bucket_strong(tf.strings.as_string(blocks), _HASH_BUCKETS,
                                               key=[int(seed) % 2**63, int(stream)])
    offset = tf.cast(buckets, tf.float64) / _HASH_BUCKETS  # u in [0, 1)
    ends = tf.clip_by_value(tf.math.ceil(batch_size * cumulative - offset[:, None]), 0, batch_size)
    ends = tf.cast(ends, tf.int32)
    return tf.concat([ends[:, :1], ends[:, 1:] - ends[:, :-1]], axis=1)

  def _block_sources(self, block, *, batch_size: int, seed: int, stream: int):
    """int64 (batch_size,): the source of each row of one batch, in a seeded order."""
    counts = self.block_counts(block[None], batch_size, seed, stream)[0]
    slots = tf.ensure_shape(tf.repeat(tf.range(len(self.paths), dtype=tf.int64), counts), [batch_size])
    noise = tf.random.stateless_uniform([batch_size], seed=tf.stack([tf.constant(seed % 2**62, tf.int64) * 8 + stream,
                                                                     block]))
    return tf.gather(slots, tf.argsort(noise, stable=True))

  def rows_seen(self, steps: int, *, batch_size: int, num_streams: int, seed: int, start: int = 0) -> np.ndarray:
    """int64 (sources,): rows each source gave the global batches of steps start+1..steps (all streams of
    `batch_size` rows each), computed from the choice alone."""
    total = np.zeros(len(self.paths), np.int64)
    for lo in range(start, steps, 1 << 20):
      blocks = tf.range(lo, min(steps, lo + (1 << 20)), dtype=tf.int64)
      for s in range(num_streams):
        total += self.block_counts(blocks, batch_size, seed, s).numpy().sum(axis=0)
    return total

  def make_dataset(self, split: str, *, batch_size: int, seq_len: int, seed: int = 0, shuffle: bool = True,
                   process_index: int = 0, process_count: int = 1, **kwargs) -> tf.data.Dataset:
    """Reader `process_index` of `process_count`'s batches of rows from every source, mixed by weight.

    Each source is read by `input_pipeline.make_dataset` (repeating, its own seed) for this reader; rows carry
    their source's index as the feature SOURCE. kwargs: make_dataset's (shuffle_buffer, order_window, ...).
    """
    sources = []
    for i, path in enumerate(self.paths):
      ds = input_pipeline.make_dataset(path, split, batch_size=batch_size, seq_len=seq_len, seed=seed * 1009 + i,
                                       shuffle=shuffle, repeat=True, process_index=process_index,
                                       process_count=process_count, **kwargs).unbatch()
      sources.append(ds.map(input_pipeline.graph_fn(
          lambda row, i=i: {**row, SOURCE: tf.fill(tf.shape(row["inputs"]), i)})))
    choice = tf.data.Dataset.counter().map(input_pipeline.graph_fn(
        lambda block: self._block_sources(block, batch_size=batch_size, seed=seed, stream=process_index))).unbatch()
    mixed = tf.data.Dataset.choose_from_datasets(sources, choice, stop_on_empty_dataset=True)
    return mixed.batch(batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE)


def check_compatible(paths: Sequence[str], manifests: Sequence[dict]) -> None:
  """Every source must share the first one's tokenizer, pad and eos ids and record format; else an error
  naming the odd DATA_DIR."""
  first = manifests[0]
  for path, m in zip(paths[1:], manifests[1:]):
    for key, what in (("tokenizer_sha256", "tokenizer"), ("pad_id", "pad id"), ("eos_id", "eos id"),
                      ("format", "record format")):
      if m.get(key, "text" if key == "format" else None) != first.get(key, "text" if key == "format" else None):
        raise ValueError(f"mixture source '{path}' has another {what} than '{paths[0]}' ({key} {m.get(key)!r} vs "
                         f"{first.get(key)!r}): preprocess every source with --tokenizer={paths[0]}")


class TokensSeen:
  """A metric sink wrapper: adds data/tokens/<source> (training tokens each source gave, all processes,
  from step 1) to every record that has a training loss. Recounted from the choice, so exact after a resume."""

  def __init__(self, sink, mixture: Mixture, *, batch_size: int, num_streams: int, seq_len: int, seed: int):
    self.sink, self.mixture, self.seq_len = sink, mixture, seq_len
    self.kw = dict(batch_size=batch_size // num_streams, num_streams=num_streams, seed=seed)
    self.step, self.rows = 0, np.zeros(len(mixture.paths), np.int64)

  def write(self, step: int, scalars) -> None:
    if "loss" in scalars:
      if step < self.step:  # a rollback: count again from the start
        self.step, self.rows = 0, np.zeros_like(self.rows)
      self.rows += self.mixture.rows_seen(step, start=self.step, **self.kw)
      self.step = step
      tokens = self.rows * self.seq_len
      scalars = {**scalars, **{f"data/tokens/{n}": int(t) for n, t in zip(self.mixture.names, tokens)},
                 **{f"data/token_share/{n}": float(t / max(tokens.sum(), 1))
                    for n, t in zip(self.mixture.names, tokens)}}
    self.sink.write(step, scalars)

  def __getattr__(self, name):  # flush / close of the wrapped sink
    return getattr(self.sink, name)


def combine_evaluations(per_source: Mapping[str, dict]) -> dict:
  """eval/* over all sources (each figure token-weighted by its source's eval/tokens) and eval/<source>/*
  of each; perplexity is left to the caller."""
  out, total = {}, sum(r["eval/tokens"] for r in per_source.values())
  for name, result in per_source.items():
    out.update({f"eval/{name}/{key.removeprefix('eval/')}": value for key, value in result.items()})
  for key in next(iter(per_source.values())):
    if key in ("eval/tokens", "eval/batches"):
      out[key] = sum(r[key] for r in per_source.values())
    elif key != "eval/perplexity":
      out[key] = sum(r[key] * r["eval/tokens"] for r in per_source.values()) / max(total, 1.0)
  return out
