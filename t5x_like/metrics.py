"""Metric sinks: clu writers (TensorBoard + log) and MODEL_DIR/metrics.jsonl; host memory and timing helpers."""

import json
import os
import resource
import time
from typing import Mapping, Optional

from absl import logging
from clu import metric_writers
import jax
import numpy as np
import tensorflow as tf


class MetricsLogger:
  """Writes scalars to TensorBoard, the log and metrics.jsonl (process 0 only writes files).

  metrics.jsonl holds one JSON object per call: {"step": N, "loss": 3.1415926..., ...}, floats at full
  precision (Python's shortest round-trip repr of the float32/float64 value).
  """

  def __init__(self, model_dir: str, is_primary: Optional[bool] = None):
    self.is_primary = jax.process_index() == 0 if is_primary is None else is_primary
    self._path = os.path.join(model_dir, "metrics.jsonl")
    self._writer = metric_writers.create_default_writer(model_dir, just_logging=not self.is_primary,
                                                        asynchronous=False)

  def write(self, step: int, scalars: Mapping[str, float]) -> None:
    clean = {key: _to_python(value) for key, value in scalars.items()}
    self._writer.write_scalars(step, {k: v for k, v in clean.items() if v is not None})
    if self.is_primary:
      with tf.io.gfile.GFile(self._path, "a") as f:
        f.write(json.dumps({"step": int(step), **clean}) + "\n")

  def flush(self) -> None:
    self._writer.flush()

  def close(self) -> None:
    self._writer.close()


def _to_python(value):
  value = np.asarray(value).item() if not isinstance(value, (int, float, str)) else value
  if isinstance(value, float) and not np.isfinite(value):
    return str(value)  # JSON has no NaN/Inf literals
  return value


def read_metrics(model_dir: str) -> list:
  """The records of MODEL_DIR/metrics.jsonl, in file order."""
  path = os.path.join(model_dir, "metrics.jsonl")
  with tf.io.gfile.GFile(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def device_memory() -> dict:
  """Bytes in use / peak on the first local device, or host RSS where the backend has no memory_stats."""
  stats = jax.local_devices()[0].memory_stats() or {}
  if "bytes_in_use" in stats:
    return {"memory/device_bytes_in_use": stats["bytes_in_use"],
            "memory/device_peak_bytes": stats.get("peak_bytes_in_use", stats["bytes_in_use"])}
  rss_peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  return {"memory/host_rss_peak_bytes": rss_peak_kb * 1024}


class Stopwatch:
  """Accumulates named durations between log steps."""

  def __init__(self):
    self.totals = {}
    self._start = time.perf_counter()

  def add(self, name: str, seconds: float) -> None:
    self.totals[name] = self.totals.get(name, 0.0) + seconds

  def elapsed(self) -> float:
    return time.perf_counter() - self._start

  def reset(self) -> None:
    self.totals = {}
    self._start = time.perf_counter()


def progress_line(step: int, total: int, loss: float, tokens_per_sec: float, mfu: float,
                  seconds_per_step: float) -> str:
  eta = max(0, total - step) * seconds_per_step
  return (f"step {step}/{total}  loss {loss:.4f}  {tokens_per_sec:,.0f} tok/s  MFU {100 * mfu:.1f}%  "
          f"ETA {int(eta // 3600)}h{int(eta % 3600 // 60):02d}m{int(eta % 60):02d}s")
