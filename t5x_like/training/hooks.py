"""The loop's periodic actions: log, evaluate, profile, checkpoint; each decides when it is due.

A hook is called after every optimizer step as `hook(step, state, step_metrics)`; `Every` says whether
a step is one of its steps (every N, and always the last one). Metric sinks (metrics.jsonl +
TensorBoard, Prometheus) receive what the log and eval hooks produce.
"""

import dataclasses
from typing import Callable, Optional, Sequence

from absl import logging

from t5x_like.observe import metrics as metrics_lib


@dataclasses.dataclass(frozen=True)
class Every:
  """Due every `steps` steps (0 = never) and, with `at_end`, at `last_step`."""
  steps: int
  last_step: int
  at_end: bool = True

  def __call__(self, step: int) -> bool:
    return bool(self.steps and step % self.steps == 0) or (self.at_end and step == self.last_step)


class LogHook:
  """At log steps: fetches the interval's step metrics from the meter (the only device→host transfer
  of them), writes them to every sink and prints the progress line."""

  def __init__(self, due: Every, meter: metrics_lib.IntervalMeter, sinks: Sequence, data_iterator=None):
    self.due, self.meter, self.sinks, self.data_iterator = due, meter, sinks, data_iterator
    self.last = {}

  def __call__(self, step: int, state, step_metrics) -> None:
    del state, step_metrics  # the meter holds the interval's metrics
    if not self.due(step):
      return
    scalars = self.meter.summary(self.data_iterator)
    for sink in self.sinks:
      sink.write(step, scalars)
    logging.info("%s", metrics_lib.progress_line(step, self.due.last_step, scalars["loss"],
                                                 scalars.get("tokens_per_sec"), scalars.get("mfu"),
                                                 scalars.get("step_seconds")))
    self.last.update(scalars)


class EvalHook:
  """At eval steps: `evaluate(params)` → eval/* figures to every sink; `final_extra()` adds figures to
  the last evaluation (e.g. the unigram baseline). Its time is kept out of the step time."""

  def __init__(self, due: Every, evaluate: Callable, meter: metrics_lib.IntervalMeter, sinks: Sequence,
               final_extra: Optional[Callable[[], dict]] = None):
    self.due, self.evaluate, self.meter, self.sinks, self.final_extra = due, evaluate, meter, sinks, final_extra
    self.last = {}

  def __call__(self, step: int, state, step_metrics) -> None:
    del step_metrics
    if not self.due(step):
      return
    with self.meter.excluded():
      result = self.evaluate(state.params)
      if self.final_extra is not None and step == self.due.last_step:
        result.update(self.final_extra())
    for sink in self.sinks:
      sink.write(step, result)
    baseline = result.get("eval/unigram_baseline")
    if "eval/loss" in result:
      logging.info("step %d: eval loss %.4f perplexity %.2f%s", step, result["eval/loss"], result["eval/perplexity"],
                   f" (unigram baseline {baseline:.4f})" if baseline is not None else "")
    else:  # an objective scored by generation (GRPO: eval/reward_mean)
      logging.info("step %d: %s", step, " ".join(f"{k} {v:.4g}" for k, v in sorted(result.items())))
    self.last.update(result)


class ProfileHook:
  """Starts a jax.profiler trace before step `first` and stops it after step `last` (observe/profiling)."""

  def __init__(self, profiler):
    self.profiler = profiler

  def before_step(self, step: int) -> None:
    self.profiler.before_step(step)

  def syncs_after(self, step: int) -> bool:
    """Whether the step's outputs are waited for once it has run (the trace stops after it)."""
    return self.profiler.stops_after(step)

  def __call__(self, step: int, state, step_metrics) -> None:
    del state
    self.profiler.after_step(step, step_metrics)


class CheckpointHook:
  """At checkpoint steps, and at once when `force` (a preemption), saves state + data iterator + metadata
  through the run guard (failed-save policy); its time is kept out of the step time."""

  def __init__(self, due: Every, save: Callable, meter: metrics_lib.IntervalMeter):
    self.due, self.save, self.meter = due, save, meter

  def __call__(self, step: int, state, step_metrics, force: bool = False) -> None:
    del step_metrics
    if force or self.due(step):
      with self.meter.excluded():
        self.save(step, state)
