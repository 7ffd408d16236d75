"""Metric sinks (the log, TensorBoard event files, MODEL_DIR/metrics.jsonl) and the log-interval meter that turns
per-step device metrics into loss, throughput, MFU, time split, memory and queue-depth scalars."""

import contextlib
import json
import math
import os
import resource
import time
from typing import Mapping, Optional

from absl import logging
import jax
import numpy as np
import tensorflow as tf
from tensorboard.compat.proto import event_pb2
from tensorboard.compat.proto import summary_pb2
from tensorboard.plugins.scalar import summary_v2 as tb_scalar
from tensorboard.summary.writer import event_file_writer

from t5x_like.observe import flops
from t5x_like.data import input_pipeline


class MetricsLogger:
  """Writes scalars to the log, TensorBoard and metrics.jsonl (process 0 only writes files).

  The log line is "[step] key=value, ..." (sorted keys, floats to 6 significant digits). TensorBoard's event
  files in MODEL_DIR are written by TensorBoard's own event-file writer, one event per call holding every scalar
  as tf.summary.scalar writes it (a float32 tensor, the scalars plugin's metadata): tf.summary.scalar ran TF ops
  eagerly, ~10 ms for 20 scalars and 65 ms for a writer's first call; clu's writer, used before, imported
  TensorBoard's hparams plugin and through it Keras (docs/performance.md, Start-up). metrics.jsonl holds one JSON
  object per call: {"step": N, "loss": 3.1415926..., ...}, floats at full precision (Python's shortest round-trip
  repr of the float32/float64 value).
  """

  def __init__(self, model_dir: str, is_primary: Optional[bool] = None):
    self.is_primary = jax.process_index() == 0 if is_primary is None else is_primary
    self._path = os.path.join(model_dir, "metrics.jsonl")
    self._summary = event_file_writer.EventFileWriter(model_dir) if self.is_primary else None

  def write(self, step: int, scalars: Mapping[str, float]) -> None:
    clean = {key: _to_python(value) for key, value in scalars.items()}
    numbers = {k: float(v) if isinstance(v, str) else v for k, v in clean.items()
               if isinstance(v, (int, float)) or v in ("nan", "inf", "-inf")}
    logging.info("[%d] %s", step, ", ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}"
                                            for k, v in sorted(numbers.items())))
    if self.is_primary:
      values = [tb_scalar.scalar_pb(key, value).value[0] for key, value in numbers.items()]
      self._summary.add_event(event_pb2.Event(wall_time=time.time(), step=int(step),
                                              summary=summary_pb2.Summary(value=values)))
      with tf.io.gfile.GFile(self._path, "a") as f:
        f.write(json.dumps({"step": int(step), **clean}) + "\n")

  def flush(self) -> None:
    if self._summary is not None:
      self._summary.flush()

  def close(self) -> None:
    if self._summary is not None:
      self._summary.close()


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
  """Bytes in use and peak, the largest over this process's devices (`memory_stats`), plus host RSS.

  Backends without `memory_stats` (CPU) report only the host figures.
  """
  out = {}
  stats = [d.memory_stats() or {} for d in jax.local_devices()]
  if any("bytes_in_use" in s for s in stats):
    out["memory/device_bytes_in_use"] = max(s.get("bytes_in_use", 0) for s in stats)
    out["memory/device_peak_bytes"] = max(s.get("peak_bytes_in_use", s.get("bytes_in_use", 0)) for s in stats)
    limits = [s["bytes_limit"] for s in stats if "bytes_limit" in s]
    if limits:
      out["memory/device_bytes_limit"] = min(limits)
  out.update(host_memory())
  return out


def host_memory() -> dict:
  """This process's resident set size now (Linux /proc) and its peak (getrusage)."""
  out = {"memory/host_rss_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
  try:
    with open("/proc/self/statm") as f:
      out["memory/host_rss_bytes"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
  except (OSError, ValueError, IndexError):
    pass
  return out


# What training/step.py's train_step reports itself; any other key is an objective's metric (e.g. moe/*).
_STEP_KEYS = frozenset({"loss", "tokens", "grad_norm", "param_norm", "lr", "nonfinite", "loss_scale", "overflow"})


def mean_step_metrics(records: list) -> dict:
  """Averages per-step metrics (fetched to host) over a log interval.

  loss, and each metric of the objective, is weighted by each step's loss tokens (Σ weight), so the
  interval loss is the mean over all its tokens; grad_norm is the mean over steps; param_norm and lr are
  the last step's. A single step keeps its loss (and metrics) exactly as the device computed them.
  """
  tokens = np.array([r["tokens"] for r in records], np.float64)
  losses = np.array([r["loss"] for r in records], np.float64)
  out = {
      "loss": float(np.sum(tokens * losses) / max(tokens.sum(), 1.0)),
      "grad_norm": float(np.mean([r["grad_norm"] for r in records])),
      "param_norm": float(records[-1]["param_norm"]),
      "lr": float(records[-1]["lr"]),
      "loss_tokens": float(tokens.sum()),
      "nonfinite_steps": int(sum(int(r["nonfinite"]) for r in records)),
  }
  if "loss_scale" in records[-1]:  # dynamic loss scaling (float16): skipped steps and the current scale
    out["overflow_steps"] = int(sum(int(r["overflow"]) for r in records))
    out["loss_scale"] = float(records[-1]["loss_scale"])
  for name in sorted(set(records[-1]) - _STEP_KEYS):  # the objective's metrics: per-token means, like loss
    out[name] = float(np.sum(tokens * np.array([r[name] for r in records], np.float64)) / max(tokens.sum(), 1.0))
  if len(records) == 1:
    out["loss"] = float(records[0]["loss"])
    out.update({name: float(records[0][name]) for name in set(records[0]) - _STEP_KEYS})
  out["perplexity"] = perplexity(out["loss"])
  return out


def perplexity(loss: float) -> float:
  """exp(loss); inf above exp(709) or for a non-finite loss."""
  return math.exp(loss) if math.isfinite(loss) and loss < 709.0 else float("inf")


class IntervalMeter:
  """Per-step device metrics kept on device until a log step, then averaged with throughput and timing.

  The loop calls `begin_step()` before fetching a batch, `data_ready()` once the global batch exists,
  `end_step(metrics)` after dispatching the step, and `summary()` at log steps (the only host sync).
  Step time is the interval's wall-clock time (dispatch is asynchronous, so the device's work shows up
  wherever the host next waits for it) less what the loop runs under `excluded()`: evaluation and
  checkpoint saves. The first step
  of a launch (`compiling=True`) is blocked on and reported as compile_seconds; its time and tokens
  are left out of throughput.

  Args:
    tokens_per_step: global tokens processed per optimizer step (BATCH_SIZE × SEQ_LEN).
    num_devices: devices the step runs on (for per-device throughput and MFU).
    flops_per_token: model FLOPs per trained token (flops.train_flops_per_token).
    peak_flops_per_device: peak FLOP/s of one device (hardware.peak_flops_per_device).
  """

  def __init__(self, tokens_per_step: int, num_devices: int, flops_per_token: float,
               peak_flops_per_device: float):
    self.tokens_per_step = tokens_per_step
    self.num_devices = num_devices
    self.flops_per_token = flops_per_token
    self.peak_flops_per_device = peak_flops_per_device
    self.nonfinite_total = 0
    self._compile_seconds = None
    self._reset()

  def _reset(self):
    self._records = []
    self._interval_start = None
    self._excluded_seconds = 0.0
    self._timed_steps = 0
    self._step_seconds = 0.0
    self._data_seconds = 0.0

  def begin_step(self) -> None:
    self._t0 = time.perf_counter()
    if self._interval_start is None:  # time excluded before the interval began (an eval right after a log) is not in it
      self._interval_start, self._excluded_seconds = self._t0, 0.0

  @contextlib.contextmanager
  def excluded(self):
    """Time spent inside (evaluation, checkpointing) is not training-step time."""
    t0 = time.perf_counter()
    try:
      yield
    finally:
      self._excluded_seconds += time.perf_counter() - t0

  def data_ready(self) -> None:
    self._t_data = time.perf_counter() - self._t0

  def end_step(self, step_metrics, compiling: bool = False, sync: bool = False) -> None:
    """Records a dispatched step; `sync` waits for it inside the timed region (before a host-side
    pause such as stopping a profiler trace, so the wait is not lost from the interval)."""
    if compiling:
      jax.block_until_ready(step_metrics)
      self._compile_seconds = time.perf_counter() - self._t0 - self._t_data
      self._interval_start, self._excluded_seconds = None, 0.0  # throughput starts after compilation
    else:
      if sync:
        jax.block_until_ready(step_metrics)
      self._data_seconds += self._t_data
      self._timed_steps += 1
    self._records.append(step_metrics)

  def summary(self, data_iterator=None) -> dict:
    """Fetches the interval's metrics (one device→host transfer) and returns its scalars; resets.

    Adds device/host memory and, given the training tf.data iterator, the batches waiting in its
    prefetch buffer (data_queue_depth).
    """
    records = jax.device_get(self._records)  # waiting here is device time of the interval's steps
    if self._interval_start is not None:
      self._step_seconds = time.perf_counter() - self._interval_start - self._excluded_seconds
    out = mean_step_metrics(records)
    self.nonfinite_total += out["nonfinite_steps"]
    out["nonfinite_steps_total"] = self.nonfinite_total
    if self._timed_steps:
      seconds = self._step_seconds / self._timed_steps
      data = self._data_seconds / self._timed_steps
      tokens_per_sec = self.tokens_per_step / seconds
      out.update({
          "step_seconds": seconds,
          "data_wait_seconds": data,
          "compute_seconds": seconds - data,
          "data_wait_fraction": data / seconds,
          "tokens_per_sec": tokens_per_sec,
          "tokens_per_sec_per_device": tokens_per_sec / self.num_devices,
          "mfu": flops.mfu(tokens_per_sec, self.flops_per_token, self.num_devices, self.peak_flops_per_device),
      })
    if self._compile_seconds is not None:
      out["compile_seconds"], self._compile_seconds = self._compile_seconds, None
    depth = input_pipeline.prefetch_depth(data_iterator) if data_iterator is not None else None
    if depth is not None:
      out["data_queue_depth"] = depth
    out.update(device_memory())
    self._reset()
    return out


def progress_line(step: int, total: int, loss: float, tokens_per_sec: Optional[float],
                  mfu: Optional[float], step_seconds: Optional[float]) -> str:
  """'step 40/1000  loss 3.2100  12,345 tok/s  MFU 41.0%  ETA 0h05m12s' (— while nothing is timed yet)."""
  if tokens_per_sec is None or step_seconds is None:
    return f"step {step}/{total}  loss {loss:.4f}  (first step: compiling)"
  eta = max(0, total - step) * step_seconds
  return (f"step {step}/{total}  loss {loss:.4f}  {tokens_per_sec:,.0f} tok/s  MFU {100 * mfu:.1f}%  "
          f"ETA {int(eta // 3600)}h{int(eta % 3600 // 60):02d}m{int(eta % 60):02d}s")
