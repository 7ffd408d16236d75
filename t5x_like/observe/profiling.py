"""A jax.profiler trace of training steps N..M, written to MODEL_DIR/profile/ (TensorBoard / XProf)."""

import os
from typing import Optional, Sequence

from absl import logging
import jax


def profile_dir(model_dir: str) -> str:
  return os.path.join(model_dir, "profile")


class StepProfiler:
  """Starts a trace before step `first` runs and stops it once step `last` has finished.

  Steps are numbered as in metrics.jsonl: step k is the k-th optimizer step (1-based). A launch that
  resumes past `first` does not trace. View with `tensorboard --logdir MODEL_DIR/profile` (needs the
  tensorboard-plugin-profile package) or xprof.

  Args:
    model_dir: run directory; the trace goes under MODEL_DIR/profile/plugins/profile/<timestamp>/.
    steps: (first, last) inclusive, or None/() for no trace.
  """

  def __init__(self, model_dir: str, steps: Optional[Sequence[int]], is_primary: bool = True):
    self.first, self.last = _validate(steps)
    self.dir = profile_dir(model_dir)
    self.active = False
    self._enabled = is_primary and self.first is not None

  def before_step(self, step: int) -> None:
    """`step`: the number the step about to run will have (last completed + 1)."""
    if self._enabled and not self.active and step == self.first:
      jax.profiler.start_trace(self.dir)
      self.active = True
      logging.info("profiling steps %d..%d into %s", self.first, self.last, self.dir)

  def stops_after(self, step: int) -> bool:
    """True when the trace stops once `step` has run (the caller may sync on it while timing)."""
    return self.active and step >= self.last

  def after_step(self, step: int, outputs) -> None:
    """`step`: the number of the step just dispatched; `outputs` are blocked on before stopping."""
    if self.stops_after(step):
      self.stop(outputs)

  def stop(self, outputs=None) -> None:
    if self.active:
      jax.block_until_ready(outputs)
      jax.profiler.stop_trace()
      self.active = False
      logging.info("profile written to %s", self.dir)


def _validate(steps):
  if not steps:
    return None, None
  if len(steps) != 2 or not all(isinstance(s, int) for s in steps) or not 1 <= steps[0] <= steps[1]:
    raise ValueError(f"ObserveConfig.profile_steps must be (first, last) with 1 <= first <= last, "
                     f"got {steps!r}")
  return int(steps[0]), int(steps[1])
