"""Fault tolerance: exact resume after kill -9 and SIGTERM, non-finite steps skipped / stopped / rolled back."""

import logging
import os
import random
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from tests import conftest
from tests import forkserver
from tests import interrupt

from t5x_like.training import checkpointing as checkpoints
from t5x_like.training import fault_tolerance
from t5x_like.observe import metrics as metrics_lib
from t5x_like.parallel import global_batch
from t5x_like.recipes import experiment

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {"model.GPTConfig.num_layers": 1, "model.GPTConfig.d_model": 32, "model.GPTConfig.num_heads": 2,
        "model.GPTConfig.d_ff": 64, "model.GPTConfig.max_len": 32}
STEPS = 40  # long enough to be interrupted twice at a step ≥ 10 with 12 steps to spare


@pytest.fixture(scope="module")
def data_dir(corpus):
  return corpus


# ----------------------------------------------------------------------------------------------------
# In-process: the non-finite guard and its policies.


def _train(model_dir, data_dir, fault_tolerance_overrides=(), optimizer_overrides=(), model_overrides=(), **overrides):
  from t5x_like.model import decoder as model  # pylint: disable=g-import-not-at-top
  from t5x_like.training import optimizer  # pylint: disable=g-import-not-at-top
  from t5x_like.training import config as config_lib  # pylint: disable=g-import-not-at-top
  from t5x_like import data as data_lib  # pylint: disable=g-import-not-at-top
  from t5x_like.training import trainer  # pylint: disable=g-import-not-at-top
  nested = {"fault_tolerance": fault_tolerance.FaultToleranceConfig(**dict(fault_tolerance_overrides))}
  base = dict(model_dir=str(model_dir), data_dir=data_dir, train_steps=6, batch_size=8, seq_len=16, log_every=1,
              eval_every=0, checkpoint_every=2, data=data_lib.DataConfig(eval_batches=1, shuffle_buffer=64),
              checkpoint=checkpoints.CheckpointConfig(async_save=False), **nested)
  config = config_lib.TrainConfig(**{**base, **overrides})
  model_config = model.GPTConfig(**{**{k.split(".")[-1]: v for k, v in TINY.items()}, **dict(model_overrides)})
  opt = optimizer.OptimizerConfig(**{"learning_rate": 1e-2, "warmup_steps": 0, **dict(optimizer_overrides)})
  return trainer.train(config, model_config, opt), (config, model_config, opt)


def _records(model_dir):
  return [r for r in metrics_lib.read_metrics(str(model_dir)) if "loss" in r]


def test_nonfinite_monitor_counts_streaks_one_step_late():
  monitor = fault_tolerance.NonFiniteMonitor(patience=2)
  assert monitor.observe(1, 0) is None
  assert monitor.observe(2, 1) is None  # step 1 resolved: fine
  assert monitor.observe(3, 0) is None  # step 2 bad: 1 in a row
  assert monitor.observe(4, 1) is None  # step 3 good: streak reset
  assert monitor.observe(5, 1) is None  # step 4 bad: 1
  assert monitor.flush() == 5  # step 5 bad: 2 in a row → patience reached
  assert monitor.total == 3


def test_nonfinite_streak_stops_with_a_clear_message(tmp_path):
  manager = checkpoints.make_manager(str(tmp_path), async_save=False)
  guard = fault_tolerance.RunGuard(manager, None, nonfinite_patience=2, nonfinite_action="stop",
                                   max_failed_saves=0)
  for step, flag in [(1, 0), (2, 1), (3, 1)]:
    assert not guard.after_step(step, {"nonfinite": flag})
  with pytest.raises(fault_tolerance.NonFiniteError, match=r"^2 consecutive non-finite steps ending at "
                     r"step 3 \(FaultToleranceConfig.nonfinite_patience=2\): stopped; lower the learning rate") as info:
    guard.after_step(4, {"nonfinite": 0})
  assert info.value.exit_code == fault_tolerance.EXIT_NONFINITE == 65


@pytest.mark.slow  # end to end: trains, or launches the CLI
def test_nan_batch_skipped_then_streak_rolls_back_and_skips_batches(tmp_path, data_dir, caplog):
  """Step 2 alone is poisoned: skipped, run continues. Steps 5, 6 in a row (patience 2): detected after
  step 7, rolled back to the step-4 checkpoint, and 5..8 rerun on the batches after the bad ones."""
  caplog.set_level(logging.WARNING, logger="absl")
  model_dir = tmp_path / "run"
  _, configs = _train(model_dir, data_dir, train_steps=8, checkpoint_every=4,
                      fault_tolerance_overrides=dict(debug_nan_steps=(2, 5, 6), nonfinite_patience=2, nonfinite_action="rollback"))
  records = _records(model_dir)
  assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6, 7, 5, 6, 7, 8]
  assert [r["nonfinite_steps"] for r in records] == [0, 1, 0, 0, 1, 1, 0, 0, 0, 0, 0]
  assert records[1]["loss"] == "nan" and records[1]["param_norm"] == records[0]["param_norm"]  # not updated
  assert records[2]["param_norm"] != records[1]["param_norm"]  # the run went on training
  assert all(np.isfinite(r["loss"]) for r in records[7:])
  # Exact: the redone step 5 started from the step-4 checkpoint and read the 8th batch of the stream (the
  # iterator stays past the bad batches): its logged loss is that batch's loss under checkpoint 4's params.
  exp = experiment.Experiment(*configs)
  stream = iter(exp.dataset("train", shuffle=True, repeat=True))
  for _ in range(8):
    tf_batch = next(stream)
  with exp.context():
    _, params = exp.restore_params(4)
    loss_sum, weight_sum, _ = jax.jit(exp.objective.loss)(params, exp.global_batch(global_batch.tf_to_numpy(tf_batch)), {})
  # rtol 3e-5: a forward-only program, fused apart from the train step's (XLA:CPU, its library dots and unrolled
  # layers: 7e-6 at optimisation level 0, 1.0e-5 at the default level); the losses of other batches differ by 1e-3
  # and more.
  np.testing.assert_allclose(records[7]["loss"], float(loss_sum / weight_sum), rtol=3e-5)
  assert records[7]["loss"] != records[6]["loss"]
  assert "rolled back to step 4" in caplog.text
  assert checkpoints.committed_steps(str(model_dir))[-1] == 8


# ----------------------------------------------------------------------------------------------------
# End to end: `python -m t5x_like.train` killed and relaunched gives the uninterrupted run bit for bit.


def launch_args(model_dir, data_dir, steps=STEPS) -> list:
  """The CLI launch of a TINY run on 2 CPU devices (tests/test_train_e2e.py's non-finite launch is one too, so its
  compiled step comes from the persistent cache)."""
  args = [sys.executable, "-m", "t5x_like.train", "--gin_file=configs/models/gpt_tiny.gin",
          "--gin_file=configs/runs/pretrain.gin", f"--gin.MODEL_DIR='{model_dir}'",
          f"--gin.DATA_DIR='{data_dir}'", f"--gin.TRAIN_STEPS={steps}", "--gin.LOG_EVERY=1",
          "--gin.EVAL_EVERY=0", "--gin.CHECKPOINT_EVERY=4", "--gin.BATCH_SIZE=8", "--gin.SEQ_LEN=16",
          "--gin.MESH_SHAPE={'pipeline': 1, 'data': 2, 'fsdp': 1, 'tensor': 1}",
          "--gin.data.DataConfig.eval_batches=1", "--gin.data.DataConfig.shuffle_buffer=64",
          "--gin.optimizer.OptimizerConfig.warmup_steps=5"]
  return args + [f"--gin.{k}={v}" for k, v in TINY.items()]


def launch_env() -> dict:
  """2 CPU devices; the test run's persistent compilation cache (tests/conftest.py)."""
  return dict(os.environ, XLA_FLAGS=conftest.xla_flags(2), JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")


def _launch(model_dir, data_dir, steps=STEPS):
  log = open(os.path.join(os.path.dirname(model_dir), os.path.basename(model_dir) + ".log"), "ab")
  return forkserver.Popen(launch_args(model_dir, data_dir, steps), cwd=REPO, env=launch_env(), stdout=log,
                          stderr=subprocess.STDOUT)


def _interrupt(model_dir, data_dir, at_step: int, sig) -> int:
  """Launches a run and sends it `sig` once this launch has logged a step ≥ at_step; returns the exit code."""
  return interrupt.signal_at_step(lambda: _launch(model_dir, data_dir), model_dir, at_step, sig)


def _assert_same_run(model_dir, reference):
  # a step logged twice (killed after logging, before its checkpoint) keeps both losses
  losses, ref = interrupt.losses(model_dir), interrupt.losses(reference)
  assert sorted(losses) == sorted(ref) == list(range(1, STEPS + 1))
  for step, values in losses.items():
    assert all(v == ref[step][0] for v in values), (step, values, ref[step])  # bit for bit
  digest = checkpoints.params_digest(checkpoints.restore_params(str(model_dir))[1])
  assert digest == checkpoints.params_digest(checkpoints.restore_params(str(reference))[1])


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, data_dir):
  """The uninterrupted run (and a warm JAX compilation cache for the interrupted ones), launched right after a
  `--check` of the same configuration in its own MODEL_DIR, in one process (conftest.launch_each): base, the run's
  MODEL_DIR, and the check's MODEL_DIR and CompletedProcess."""
  base = tmp_path_factory.mktemp("ft_e2e")
  model_dir, check_dir = str(base / "reference"), str(base / "check")
  check, done = conftest.launch_each("t5x_like.train", [launch_args(check_dir, data_dir)[3:] + ["--check"],
                                                         launch_args(model_dir, data_dir)[3:]], env=launch_env())
  assert done.returncode == 0, done.stderr[-2000:]
  return base, model_dir, (check_dir, check)


@pytest.mark.slow  # one CLI launch (shared with the reference run)
def test_train_check_flag_prints_the_report_and_configuration_ok_and_writes_nothing(reference_run):
  _, _, (check_dir, check) = reference_run
  assert check.returncode == 0, check.stderr[-2000:]
  stdout = check.stdout
  lines = stdout.strip().splitlines()
  assert lines[-1] == "configuration OK" and any(line.startswith("params/total ") for line in lines), stdout
  assert not os.path.exists(check_dir)  # nothing compiled, nothing written


@pytest.mark.slow  # end to end: launches the CLI three times
def test_sigterm_then_kill_9_then_resume_is_bit_identical(reference_run, data_dir):
  """One run, interrupted twice: SIGTERM at step ≥ 10 checkpoints at that step and exits 75; the relaunch is
  killed -9 at a random later step (seed 1), losing the steps after its last checkpoint; the third launch
  finishes. Every logged loss (the redone steps too) and the final parameters equal the uninterrupted run's."""
  base, reference, _ = reference_run
  model_dir = str(base / "interrupted")
  code = _interrupt(model_dir, data_dir, 10, signal.SIGTERM)
  assert code == fault_tolerance.EXIT_PREEMPTED
  stopped_at = max(r["step"] for r in interrupt.logged(model_dir))
  assert 10 <= stopped_at < STEPS - 12
  assert checkpoints.committed_steps(model_dir)[-1] == stopped_at  # saved at the signal's step
  assert "SIGTERM at step" in open(model_dir + ".log").read()
  kill_at = stopped_at + random.Random(1).randint(2, 10)
  code = _interrupt(model_dir, data_dir, kill_at, signal.SIGKILL)
  assert code == -signal.SIGKILL, f"the run ended ({code}) before step {kill_at}"
  assert _launch(model_dir, data_dir).wait(timeout=300) == 0
  _assert_same_run(model_dir, reference)
