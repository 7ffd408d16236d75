"""Metric arithmetic without a training run: interval averages, throughput, progress line, exporter, profiler."""

import math
import urllib.request

import jax.numpy as jnp
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from t5x_like.observe import metrics
from t5x_like.observe import prometheus as monitoring
from t5x_like.observe import plots as plot
from t5x_like.observe import profiling


def step_record(loss, tokens, grad_norm=1.0, nonfinite=0, lr=1e-3, param_norm=2.0):
  return {"loss": jnp.float32(loss), "tokens": jnp.float32(tokens), "grad_norm": jnp.float32(grad_norm),
          "param_norm": jnp.float32(param_norm), "lr": jnp.float32(lr), "nonfinite": jnp.int32(nonfinite)}


def test_interval_loss_is_weighted_by_tokens_and_perplexity_is_its_exp():
  out = metrics.mean_step_metrics([{k: np.asarray(v) for k, v in step_record(2.0, 100).items()},
                                   {k: np.asarray(v) for k, v in step_record(4.0, 300, grad_norm=3.0).items()}])
  assert out["loss"] == pytest.approx((2.0 * 100 + 4.0 * 300) / 400, rel=1e-12)  # not the step mean 3.0
  assert out["perplexity"] == math.exp(out["loss"])
  assert out["grad_norm"] == 2.0 and out["loss_tokens"] == 400


def test_perplexity_of_a_huge_or_nonfinite_loss_is_inf():
  assert metrics.perplexity(1000.0) == math.inf and metrics.perplexity(math.nan) == math.inf
  assert metrics.perplexity(1.0) == math.e


class Clock:
  """The meter's clock in these tests (metrics.time): it moves only when the test says, so the figures are exact."""

  def __init__(self):
    self.now = 1000.0

  def perf_counter(self) -> float:
    return self.now

  def sleep(self, seconds: float) -> None:
    self.now += seconds


@pytest.fixture
def clock(monkeypatch):
  fake = Clock()
  monkeypatch.setattr(metrics, "time", fake)
  return fake


def test_meter_leaves_the_compile_step_out_of_throughput_and_counts_nonfinite_steps(clock):
  def step(meter, data_seconds, compute_seconds, nonfinite, compiling=False):
    meter.begin_step()
    clock.sleep(data_seconds)
    meter.data_ready()
    clock.sleep(compute_seconds)
    meter.end_step(step_record(4.0, 10, nonfinite=nonfinite), compiling=compiling)

  meter = metrics.IntervalMeter(tokens_per_step=1000, num_devices=4, flops_per_token=6e6,
                                peak_flops_per_device=1e12)
  step(meter, 0.05, 0.2, 1, compiling=True)  # a slow "compile", in the same interval as the next three steps
  for _ in range(3):
    step(meter, 0.01, 0.02, 1)
  out = meter.summary()
  assert out["compile_seconds"] == pytest.approx(0.2)
  assert out["nonfinite_steps"] == 4 and out["nonfinite_steps_total"] == 4
  assert out["step_seconds"] == pytest.approx(0.03)  # the compile step is not in it
  assert out["data_wait_seconds"] == pytest.approx(0.01) and out["compute_seconds"] == pytest.approx(0.02)
  assert out["tokens_per_sec"] == pytest.approx(1000 / 0.03)
  assert out["tokens_per_sec_per_device"] == pytest.approx(out["tokens_per_sec"] / 4)
  assert out["mfu"] == pytest.approx(out["tokens_per_sec"] * 6e6 / (4 * 1e12))
  assert out["memory/host_rss_peak_bytes"] > 0
  for _ in range(2):
    step(meter, 0.0, 0.04, 0)
  out = meter.summary()
  assert "compile_seconds" not in out and out["step_seconds"] == pytest.approx(0.04)
  assert out["nonfinite_steps"] == 0 and out["nonfinite_steps_total"] == 4
  alone = metrics.IntervalMeter(tokens_per_step=1000, num_devices=4, flops_per_token=6e6, peak_flops_per_device=1e12)
  step(alone, 0.0, 0.2, 0, compiling=True)
  out = alone.summary()  # logged at step 1: nothing but the compile step was timed
  assert out["compile_seconds"] == pytest.approx(0.2) and "tokens_per_sec" not in out


def test_an_evaluation_between_intervals_is_not_subtracted_from_the_next_interval(clock):
  """A log step, then an evaluation (excluded time) before the next interval's first step: the next interval's
  step time is its own steps' time, never less (it came out negative when the eval was subtracted)."""
  meter = metrics.IntervalMeter(tokens_per_step=10, num_devices=1, flops_per_token=1.0, peak_flops_per_device=1.0)
  meter.begin_step()
  meter.data_ready()
  meter.end_step(step_record(1.0, 10), compiling=True)
  meter.summary()
  with meter.excluded():  # the eval hook after the log hook
    clock.sleep(0.1)
  for _ in range(2):
    meter.begin_step()
    meter.data_ready()
    clock.sleep(0.02)
    meter.end_step(step_record(1.0, 10))
  assert meter.summary()["step_seconds"] == pytest.approx(0.02)


def test_progress_line_shows_step_loss_throughput_mfu_and_eta():
  line = metrics.progress_line(40, 100, 3.14159, 12345.6, 0.41, 2.0)
  assert line == "step 40/100  loss 3.1416  12,346 tok/s  MFU 41.0%  ETA 0h02m00s"
  assert "compiling" in metrics.progress_line(1, 100, 6.0, None, None, None)


def test_exporter_serves_parseable_gauges_from_one_update():
  exporter = monitoring.PrometheusExporter(0)
  try:
    exporter.update({"loss": 2.5, "tokens_per_sec": 1e4, "memory/host_rss_bytes": 7, "note": "text"}, step=12)
    text = urllib.request.urlopen(f"http://127.0.0.1:{exporter.port}/metrics", timeout=10).read().decode()
  finally:
    exporter.close()
  values = {f.name: f.samples[0].value for f in text_string_to_metric_families(text)}
  assert values == {"t5x_like_step": 12, "t5x_like_loss": 2.5, "t5x_like_tokens_per_second": 1e4,
                    "t5x_like_host_rss_bytes": 7}


def test_exporter_is_off_at_port_zero():
  off = monitoring.start(0)
  off.update({"loss": 1.0}, step=1)
  off.close()
  assert not isinstance(off, monitoring.PrometheusExporter)


@pytest.mark.parametrize("steps", [(0, 2), (5, 3), (1, 2, 3), ("a", 2)])
def test_profile_steps_are_validated(tmp_path, steps):
  with pytest.raises(ValueError, match="profile_steps"):
    profiling.StepProfiler(str(tmp_path), steps)


def test_plot_series_keeps_the_last_value_of_a_repeated_step_and_skips_nonfinite():
  records = [{"step": 1, "loss": 5.0}, {"step": 2, "loss": "nan"}, {"step": 3, "loss": 4.0},
             {"step": 2, "loss": 4.5}, {"step": 3, "eval/loss": 4.2}]
  assert plot.series(records, "loss") == ([1, 2, 3], [5.0, 4.5, 4.0])
  assert plot.series(records, "eval/loss") == ([3], [4.2])
