"""What keeps a run alive: preemption (SIGTERM/SIGINT), non-finite steps, failed saves, warm start, exit codes.

The trainer calls a `RunGuard` at three points: after each step (`after_step`), when a checkpoint is
due (`save`), and at the end (`finish`, which raises the reason the run stopped early, if any).
"""

import dataclasses
import errno
import os
import signal
import threading
from typing import Callable, Optional

from absl import logging
from etils import epath
import jax
import numpy as np
import tensorflow as tf

from t5x_like import errors
from t5x_like.training import checkpointing as checkpoints

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: a checkpoint was written at the signal's step; relaunch to resume
EXIT_SAVE_FAILED = 74  # EX_IOERR: checkpoints could not be written (read-only or full MODEL_DIR)
EXIT_NONFINITE = 65  # EX_DATAERR: too many consecutive non-finite steps
MAX_ROLLBACKS = 3  # rollbacks to the last checkpoint per launch before a non-finite streak stops the run


@dataclasses.dataclass(frozen=True)
class FaultToleranceConfig:
  """What a run does about failed saves and non-finite steps."""
  max_failed_saves: int = 2  # consecutive failed checkpoint saves tolerated; one more stops the run (exit 74)
  nonfinite_patience: int = 5  # consecutive non-finite steps (each skipped) that trigger nonfinite_action; 0 = never
  nonfinite_action: str = "stop"  # 'stop' (exit 65) or 'rollback' (to the last checkpoint, skipping the batches since)
  debug_nan_steps: tuple = ()  # fault injection for tests and drills: steps (1-based) whose batch gets NaN weights


class RunStopped(Exception):
  """The run stopped early on purpose; `exit_code` is what `python -m t5x_like.train` exits with."""
  exit_code = 1


class Preempted(RunStopped):
  exit_code = EXIT_PREEMPTED


class CheckpointSaveError(RunStopped):
  exit_code = EXIT_SAVE_FAILED


class NonFiniteError(RunStopped):
  exit_code = EXIT_NONFINITE


def check_writable(model_dir: str) -> None:
  """Fails before any compute when MODEL_DIR cannot take a checkpoint (read-only, full, not a dir)."""
  directory = epath.Path(model_dir)  # local or gs://
  probe = directory / f".write_probe.{os.getpid()}"
  try:
    directory.mkdir(parents=True, exist_ok=True)
    with probe.open("wb") as f:
      f.write(b"\0" * 4096)
      f.flush()
      if hasattr(f, "fileno"):  # a local file: a full disk shows at fsync, not at write
        os.fsync(f.fileno())
    probe.unlink()
  except (OSError, tf.errors.OpError) as e:
    reason = {errno.ENOSPC: "the disk is full", errno.EROFS: "it is on a read-only file system",
              errno.EACCES: "permission denied", errno.EPERM: "operation not permitted"}.get(
                  getattr(e, "errno", None), getattr(e, "strerror", None) or errors.first_line(e))
    raise CheckpointSaveError(
        f"MODEL_DIR '{model_dir}' is not writable ({reason}): no checkpoint could be saved. Checkpoints "
        f"already there are untouched; free space or fix permissions and relaunch") from e


class PreemptionWatcher:
  """Turns SIGTERM/SIGINT into "checkpoint and stop at the next step boundary".

  Multi-process runs use JAX's preemption notifier (it owns SIGTERM; every process reaches the same
  sync step). Single-process runs install a signal handler. A second SIGINT interrupts at once.
  """

  def __init__(self):
    self.signal_name: Optional[str] = None
    self._previous = {}
    self._use_jax = jax.process_count() > 1 and _jax_preemption_available()

  def __enter__(self):
    if threading.current_thread() is not threading.main_thread():
      logging.warning("train() runs outside the main thread: SIGTERM/SIGINT are not turned into checkpoints")
      return self
    for sig in (signal.SIGINT,) if self._use_jax else (signal.SIGTERM, signal.SIGINT):
      self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous = {}

  def _handle(self, signum, frame):  # pylint: disable=unused-argument
    if self.signal_name is not None and signum == signal.SIGINT:
      signal.signal(signal.SIGINT, signal.default_int_handler)
      raise KeyboardInterrupt
    self.signal_name = signal.Signals(signum).name
    logging.warning("%s received: saving a checkpoint at the next step boundary, then exiting with %d",
                    self.signal_name, EXIT_PREEMPTED)

  def should_stop(self, step: int) -> bool:
    """Called by every process after every step."""
    if self._use_jax:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      if multihost_utils.reached_preemption_sync_point(step):
        self.signal_name = self.signal_name or "SIGTERM"
        return True
      return False  # a local SIGINT alone would split the processes: only the notifier decides
    return self.signal_name is not None


def _jax_preemption_available() -> bool:
  """jax.distributed starts its preemption notifier with the service when this config is on (the default)."""
  return jax.distributed.is_initialized() and bool(jax.config.jax_enable_preemption_service)


class NonFiniteMonitor:
  """Counts consecutive non-finite steps, reading each step's flag one step late (no per-step sync)."""

  def __init__(self, patience: int):
    self.patience = patience
    self.consecutive = 0
    self.total = 0
    self._pending = None  # (step, device flag)

  def observe(self, step: int, nonfinite) -> Optional[int]:
    """Records this step's flag; returns the step that completed a streak of `patience`, if any."""
    ready, self._pending = self._pending, (step, nonfinite)
    return self._resolve(ready)

  def flush(self) -> Optional[int]:
    ready, self._pending = self._pending, None
    return self._resolve(ready)

  def _resolve(self, ready) -> Optional[int]:
    if ready is None:
      return None
    step, flag = ready
    if int(flag):
      self.consecutive += 1
      self.total += 1
      logging.warning("step %d: non-finite loss or gradients; update skipped (%d in a row)", step,
                      self.consecutive)
    else:
      self.consecutive = 0
    return step if self.patience and self.consecutive >= self.patience else None

  def reset(self) -> None:
    self.consecutive, self._pending = 0, None


class Saver:
  """Checkpoint saves that report failures instead of crashing, and stop after too many in a row.

  An async save's error surfaces at the next save or at `finish`; either way it is logged, the
  leftovers of the failed step are removed and the manager's step list is re-read from disk (orbax
  never deletes an old step before a newer one commits, so the last good checkpoint stays).
  """

  def __init__(self, manager, max_failures: int):
    self.manager, self.max_failures = manager, max_failures
    self.failures = 0
    self.last_saved: Optional[int] = None
    self._pending: Optional[int] = None
    self._attempted: Optional[int] = None

  def save(self, step: int, state, iterator, metadata: dict) -> None:
    self.settle()
    self._attempted = step
    try:
      if checkpoints.save(self.manager, step, state, iterator, metadata):
        self._pending = step
        if not self.manager.is_saving_in_progress():
          self.settle()
    except Exception as e:  # pylint: disable=broad-except  # disk full, read-only, permission, ...
      self._failed(step, e)

  def settle(self) -> None:
    """Waits for an in-flight save; a failure is reported (and counted) here."""
    step, self._pending = self._pending, None
    try:
      self.manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      self._failed(step, e)
      return
    if step is not None:
      self.failures, self.last_saved = 0, step

  def _failed(self, step, error: Exception) -> None:
    self.failures += 1
    self.manager.reload()
    checkpoints.remove_tmp_dirs(self.manager, step)
    logging.error("checkpoint save at step %s FAILED (%s, %d in a row); the newest committed checkpoint "
                  "is step %s in %s", step, errors.first_line(error, with_type=True), self.failures,
                  self.manager.latest_step(), self.manager.directory)
    if self.failures > self.max_failures:
      raise CheckpointSaveError(
          f"{self.failures} checkpoint saves in a row failed, the last at step {step} "
          f"({errors.first_line(error, with_type=True)}); stopped. The newest committed checkpoint is step "
          f"{self.manager.latest_step()} in {self.manager.directory}: free space or fix permissions, "
          "then relaunch to resume from it") from error

  def finish(self, final_step: int) -> None:
    """Waits for the last save; if this launch tried to save `final_step`, it must have committed."""
    self.settle()
    if self._attempted == final_step and self.last_saved != final_step:
      raise CheckpointSaveError(
          f"the final checkpoint (step {final_step}) could not be saved; the newest committed one is "
          f"step {self.manager.latest_step()} in {self.manager.directory}")


class RunGuard:
  """Preemption, non-finite policy and safe saves for one launch of the training loop.

  Args:
    manager: the run's CheckpointManager.
    abstract_state: ShapeDtypeStructs with shardings (for a rollback restore).
    nonfinite_patience: consecutive non-finite steps that trigger `nonfinite_action`; 0 = never.
    nonfinite_action: "stop" (raise NonFiniteError) or "rollback" (restore the last checkpoint's
      state and continue with the data after the offending batches).
    max_failed_saves: consecutive failed saves tolerated; one more stops the run.
    debug_nan_steps: tests only: steps whose batch `poison` fills with NaN loss weights.
    restored: a restored state → the state the loop runs on (Runtime.stage_order_of: an interleaved pipeline's
      blocks in stage order).
  """

  def __init__(self, manager, abstract_state, *, nonfinite_patience: int, nonfinite_action: str,
               max_failed_saves: int, debug_nan_steps=(), restored: Callable = lambda state: state):
    if nonfinite_action not in ("stop", "rollback"):
      raise ValueError(f"FaultToleranceConfig.nonfinite_action must be 'stop' or 'rollback', got {nonfinite_action!r}")
    self.manager, self.abstract_state, self.action = manager, abstract_state, nonfinite_action
    self.preemption = PreemptionWatcher()
    self.nonfinite = NonFiniteMonitor(nonfinite_patience)
    self.saver = Saver(manager, max_failed_saves)
    self.rollbacks = 0
    self.restored = restored
    self._poison = set(debug_nan_steps or ())

  def __enter__(self):
    self.preemption.__enter__()
    return self

  def __exit__(self, exc_type, exc, tb):
    self.preemption.__exit__(exc_type, exc, tb)
    if exc_type is not None:  # stopping early: let an in-flight async save commit before leaving
      try:
        self.manager.wait_until_finished()
      except Exception as e:  # pylint: disable=broad-except
        logging.error("the checkpoint being written when the run stopped failed: %s", e)

  def poison(self, batch: dict, step: int) -> dict:
    """Test hook: NaN loss weights for the batch of `step` in debug_nan_steps, the first time that step
    runs (a replay after a rollback draws new batches, as a bad record in the data would not recur)."""
    if step not in self._poison:
      return batch
    self._poison.discard(step)
    logging.warning("step %d: poisoning the batch with NaN weights (FaultToleranceConfig.debug_nan_steps)", step)
    return dict(batch, weights=np.full_like(batch["weights"], np.nan))

  def after_step(self, step: int, step_metrics) -> bool:
    """True when the caller must roll back (`rollback`); raises NonFiniteError under "stop"."""
    bad = self.nonfinite.observe(step, step_metrics["nonfinite"])
    if bad is None:
      return False
    message = (f"{self.nonfinite.consecutive} consecutive non-finite steps ending at step {bad} "
               f"(FaultToleranceConfig.nonfinite_patience={self.nonfinite.patience})")
    if self.action == "rollback" and self.rollbacks < MAX_ROLLBACKS:
      logging.error("%s: rolling back to the last checkpoint and skipping the batches since", message)
      return True
    raise NonFiniteError(f"{message}: stopped; lower the learning rate, check the data, or set "
                         "FaultToleranceConfig.nonfinite_action='rollback'. Parameters were not updated by those "
                         f"steps; the newest checkpoint is step {self.manager.latest_step()}")

  def rollback(self):
    """(step, state) of the newest checkpoint; the data iterator is left where it is (past the bad batches)."""
    self.saver.settle()
    self.rollbacks += 1
    self.nonfinite.reset()
    step, state, _ = checkpoints.restore_latest(self.manager, self.abstract_state)
    if state is None:
      raise NonFiniteError("non-finite streak and no checkpoint to roll back to: stopped")
    logging.warning("rolled back to step %d (rollback %d of at most %d)", step, self.rollbacks, MAX_ROLLBACKS)
    return int(step), self.restored(state)

  def preempted(self, step: int) -> bool:
    return self.preemption.should_stop(step)

  def save(self, step: int, state, iterator, metadata: dict) -> None:
    self.saver.save(step, state, iterator, metadata)

  def finish(self, step: int) -> None:
    """Waits for the last save (raises CheckpointSaveError when the final one did not commit)."""
    self.nonfinite.flush()
    self.saver.finish(step)

  def raise_if_preempted(self, step: int, train_steps: int) -> None:
    if step < train_steps and self.preemption.signal_name:
      raise Preempted(f"{self.preemption.signal_name} at step {step}: checkpoint saved to "
                      f"{self.manager.directory}/{step}; relaunch the same command to resume")


def warm_start(source: str, abstract_state, with_optimizer: bool, around: Callable):
  """A fresh TrainState (step 0) with the parameters (and optionally optimizer state) of another run's checkpoint.

  Args:
    source: the other run's MODEL_DIR (newest step) or one of its `checkpoints/<step>` directories.
    abstract_state: this run's ShapeDtypeStructs with shardings: the source is resharded onto them.
    with_optimizer: also take the source's optimizer state (it must have the same structure).
    around: params → this run's fresh TrainState holding them (Experiment.state_around): nothing is initialised
      at random only to be replaced.
  """
  if with_optimizer:
    step, params, opt_state = checkpoints.restore_params(source, abstract_params=abstract_state.params,
                                                         with_opt_state_of=abstract_state.opt_state)
    state = around(params).replace(opt_state=opt_state)
  else:
    step, params = checkpoints.restore_params(source, abstract_params=abstract_state.params)
    state = around(params)
  logging.info("warm start: parameters%s from %s step %d", " and optimizer state" if with_optimizer else "",
               source, step)
  return state
