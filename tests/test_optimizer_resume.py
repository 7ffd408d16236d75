"""Exact resume for every optimizer: Muon, Adafactor, Lion and SGD in process from a checkpoint with the newer ones
lost (AdamW through the CLI after kill -9: test_fault_tolerance); a WSD run cut mid-constant decays from there."""

import os
import shutil
import signal
import subprocess

import pytest

from tests import forkserver
from tests import interrupt
from tests import test_fault_tolerance
from tests.test_fault_tolerance import REPO, launch_args, launch_env
from t5x_like.training import checkpointing as checkpoints
from t5x_like.training import fault_tolerance
from t5x_like.training import optimizer as opt

STEPS = 12


def _launch(model_dir, data_dir, steps, *extra):
  log = open(f"{model_dir}.log", "ab")
  return forkserver.Popen(launch_args(model_dir, data_dir, steps) + list(extra), cwd=REPO, env=launch_env(),
                          stdout=log, stderr=subprocess.STDOUT)


def _run_until(model_dir, data_dir, steps, at_step, sig, *extra) -> int:
  """Launches a run, sends `sig` once it logged a step >= at_step, returns its exit code."""
  return interrupt.signal_at_step(lambda: _launch(model_dir, data_dir, steps, *extra), model_dir, at_step, sig)


@pytest.mark.slow  # two in-process trainings per optimizer (≈ 15 s each on 2 cores)
@pytest.mark.parametrize("name", ["muon", "adafactor", "lion", "sgd"])
def test_resume_after_losing_the_newest_checkpoints_is_bit_identical(name, tmp_path, corpus):
  """What kill -9 leaves, in process: a 6-step run checkpointed at steps 2, 4 and 6 loses checkpoints 4 and 6 (as if
  killed after step 5 while step 4 was saving); the relaunch restores Muon's partitioned state (Muon on the 2-D
  matrices, AdamW on the rest), Adafactor's factored second moments, Lion's or SGD's momentum from step 2, and its
  redone steps 3..6 and final parameters equal the first run's bit for bit. The kill itself, the data position and
  the checkpoint's atomicity are the optimizer-independent part that tests/test_fault_tolerance.py shows through
  kill -9 of the CLI (AdamW)."""
  model_dir = tmp_path / "run"
  optimizer = dict(name=name, learning_rate={"muon": 2e-2, "adafactor": 1e-2, "lion": 3e-3, "sgd": 0.3}[name])
  test_fault_tolerance._train(model_dir, corpus, optimizer_overrides=optimizer)  # pylint: disable=protected-access
  assert checkpoints.committed_steps(str(model_dir)) == [2, 4, 6]
  digest = lambda: checkpoints.params_digest(checkpoints.restore_params(str(model_dir))[1])
  first = digest()
  for step in (4, 6):
    shutil.rmtree(os.path.join(checkpoints.checkpoint_dir(str(model_dir)), str(step)))
  test_fault_tolerance._train(model_dir, corpus, optimizer_overrides=optimizer)  # pylint: disable=protected-access
  losses = interrupt.losses(str(model_dir))
  assert sorted(losses) == list(range(1, 7)) and [len(losses[s]) for s in range(1, 7)] == [1, 1, 2, 2, 2, 2]
  assert all(values[0] == values[1] for values in list(losses.values())[2:]), losses
  assert losses[6][0] < losses[1][0]  # it trained
  assert digest() == first


@pytest.mark.slow  # end to end: two CLI launches
def test_wsd_cut_mid_constant_decays_from_there(tmp_path, corpus):
  """A WSD run planned for 40 steps is stopped (SIGTERM, checkpointed) at a step S ≥ 6, in its constant stage
  (steps ≤ 32), and relaunched with TRAIN_STEPS=S+4 and a decay over the last 40%: the learning rate stayed at the
  peak, and now decays over steps S+1..S+4 to the final rate, as the schedule for S+4 steps says. (S is where the
  run stopped, not the step the signal was sent after: a loaded machine's run takes a few more steps first.)"""
  data_dir, model_dir = corpus, str(tmp_path / "wsd")
  wsd = ["--gin.optimizer.OptimizerConfig.decay='wsd'", "--gin.optimizer.OptimizerConfig.warmup_steps=2",
         "--gin.optimizer.OptimizerConfig.learning_rate=0.001", "--gin.optimizer.OptimizerConfig.min_lr_ratio=0.0"]
  code = _run_until(model_dir, data_dir, 40, 6, signal.SIGTERM, *wsd,
                    "--gin.optimizer.OptimizerConfig.decay_fraction=0.2")
  assert code == fault_tolerance.EXIT_PREEMPTED
  stopped = checkpoints.committed_steps(model_dir)[-1]
  assert 6 <= stopped <= 32  # the 40-step schedule decays over its last 20%: steps 33..40
  total = stopped + 4  # its last 40% (≥ 4 steps from S = 6) all after S: every relaunched step decays
  assert _launch(model_dir, data_dir, total, *wsd, "--gin.optimizer.OptimizerConfig.decay_fraction=0.4").wait(
      timeout=300) == 0
  lr = {r["step"]: r["lr"] for r in interrupt.logged(model_dir) if "lr" in r}
  assert [lr[s] for s in range(3, stopped + 1)] == pytest.approx([0.001] * (stopped - 2))  # constant stage
  schedule = opt.learning_rate_schedule(opt.OptimizerConfig(decay="wsd", warmup_steps=2, learning_rate=0.001,
                                                            min_lr_ratio=0.0, decay_fraction=0.4), total)
  expected = [float(schedule(s - 1)) for s in range(stopped + 1, total + 1)]  # step s trains with the rate at count s-1
  assert [lr[s] for s in range(stopped + 1, total + 1)] == pytest.approx(expected, rel=1e-6)
  assert expected == sorted(expected, reverse=True) and expected[-1] < 0.0003  # it decays to the final rate
