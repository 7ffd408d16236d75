"""Launches of the methods that train on their own samples and on pairs through `python -m t5x_like.train`.

Exact resume: a DPO, a GRPO and a PPO run killed with -9 after a checkpoint redo the lost steps bit for bit when
relaunched (the same losses, gradient norms and, for GRPO and PPO, the same rollouts' rewards). PPO is killed
inside a rollout cycle (3 updates per rollout, checkpoints every 4 steps), so the relaunch reads that cycle's
rollout back from MODEL_DIR.

Several processes: GRPO and PPO on 2 processes × 2 CPU devices (jax.distributed) train like 1 process × 4 devices:
every process samples the same rollouts and keeps its rows of the global batch."""

import dataclasses
import os
import signal
import subprocess
import sys

import pytest

from tests import conftest
from tests import forkserver
from tests import interrupt
from tests import test_multihost
from tests.test_dpo import SEQ as DPO_SEQ
from tests.test_dpo import prefs  # pylint: disable=unused-import  (a fixture)
from tests.test_dpo import run_config as dpo_run_config
from tests.test_finetune import OPT, REPO, TINY, model_params, run_config
from tests.test_grpo import chat_data  # pylint: disable=unused-import  (a fixture)

from t5x_like.posttrain import ppo_rollout
from t5x_like.recipes import experiment as experiment_lib
from t5x_like.training import checkpointing

STEPS, EVERY = 24, 4
# a random base answers nothing right: reward the samples that contain an "e" (about half), so every step moves
FORMAT = "--gin.{}.reward_format='.*e.*'"
SIZE = {"num_layers": 1, "d_model": 32, "num_heads": 2, "d_ff": 64}
METHODS = {  # gin file, its flags, which data, SEQ_LEN, the logged keys that must repeat
    "dpo": (["--gin_file=configs/runs/dpo.gin", "--gin.BATCH_SIZE=8"], "prefs", DPO_SEQ, ("loss", "grad_norm")),
    "grpo": (["--gin_file=configs/runs/grpo.gin", "--gin.BATCH_SIZE=16", "--gin.GRPO_GROUP=4", "--gin.GRPO_KL=0.05",
              "--gin.GRPO_MAX_NEW_TOKENS=6", "--gin.GRPO_REWARD='format'", FORMAT.format("grpo.GrpoConfig")],
             "chat", 32, ("loss", "grad_norm", "reward_mean", "response_length")),
    "ppo": (["--gin_file=configs/runs/ppo.gin", "--gin.BATCH_SIZE=16", "--gin.PPO_EPOCHS=3",
             "--gin.PPO_MAX_NEW_TOKENS=6", "--gin.PPO_REWARD='format'", FORMAT.format("ppo.PpoConfig")],
            "chat", 32, ("loss", "grad_norm", "value_loss", "reward_mean")),
}


def _launch(method, model_dir, data_dir, base_dir, *, steps=STEPS, mesh="'data': 2", devices=2, extra=()):
  flags, _, seq_len, _ = METHODS[method]
  args = [sys.executable, "-m", "t5x_like.train", "--gin_file=configs/models/gpt_tiny.gin", *flags,
          f"--gin.MODEL_DIR='{model_dir}'", f"--gin.DATA_DIR='{data_dir}'",
          f"--gin.INITIAL_CHECKPOINT_PATH='{base_dir}'",
          f"--gin.TRAIN_STEPS={steps}", "--gin.LOG_EVERY=1", "--gin.EVAL_EVERY=0", f"--gin.CHECKPOINT_EVERY={EVERY}",
          f"--gin.SEQ_LEN={seq_len}", f"--gin.MESH_SHAPE={{'pipeline': 1, {mesh}, 'fsdp': 1, 'tensor': 1}}",
          "--gin.model.GPTConfig.dtype='float32'", f"--gin.model.GPTConfig.max_len={seq_len}",
          "--gin.data.DataConfig.eval_batches=1", "--gin.data.DataConfig.shuffle_buffer=64",
          "--gin.optimizer.OptimizerConfig.learning_rate=1e-3"]
  args += [f"--gin.model.GPTConfig.{k}={v}" for k, v in SIZE.items()] + list(extra)
  env = dict(os.environ, XLA_FLAGS=conftest.xla_flags(devices), JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
  log = open(f"{model_dir}.log", "ab")
  return forkserver.Popen(args, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def _base(method, data_dir, tmp_path) -> str:
  """A random base MODEL_DIR of the launches' model (gpt_tiny.gin with SIZE) over `data_dir`'s vocabulary."""
  seq_len = METHODS[method][2]
  config = (dpo_run_config if method == "dpo" else run_config)("unused", data_dir, seq_len=seq_len)
  exp = experiment_lib.Experiment(config, dataclasses.replace(TINY, max_len=seq_len, **SIZE), OPT)
  base_dir = str(tmp_path / "base")
  checkpointing.save_params(base_dir, model_params(exp, seed=5))
  return base_dir


@pytest.mark.slow  # end to end: two CLI launches per method (≈ 25 s each on 2 cores)
@pytest.mark.parametrize("method", ["dpo", "grpo", "ppo"])
def test_kill_9_then_resume_redoes_the_lost_steps_bit_for_bit(method, prefs, chat_data, tmp_path):
  data_dir = prefs[0] if METHODS[method][1] == "prefs" else chat_data[0]
  base_dir = _base(method, data_dir, tmp_path)
  killed = str(tmp_path / method)
  proc = _launch(method, killed, data_dir, base_dir)

  def replayable() -> bool:  # a committed checkpoint and >= 2 steps logged after it: the relaunch redoes them
    logged = max(interrupt.by_step(killed), default=0)
    if logged < EVERY + 2 or not os.path.isdir(checkpointing.checkpoint_dir(killed)):
      return False
    steps = checkpointing.committed_steps(killed)
    if not steps or (method == "ppo" and steps[-1] % 3 == 0):  # PPO: inside a cycle (3 updates): 4, 8, 16 or 20
      return False
    return logged >= steps[-1] + 2

  interrupt.signal_when(proc, replayable, signal.SIGKILL, what="a checkpoint with 2 steps logged after it",
                        log=killed + ".log")
  assert proc.wait(timeout=60) == -signal.SIGKILL, open(killed + ".log").read()[-2000:]
  resumed_from = checkpointing.committed_steps(killed)[-1]
  if method == "ppo":
    cycle = resumed_from // 3 + 1
    assert resumed_from % 3 and f"{cycle}.npz" in os.listdir(os.path.join(killed, ppo_rollout.ROLLOUT_DIR))
  assert _launch(method, killed, data_dir, base_dir).wait(timeout=300) == 0, open(killed + ".log").read()[-3000:]
  records = interrupt.by_step(killed)
  assert sorted(records) == list(range(1, STEPS + 1))
  replayed = [step for step, logged in records.items() if len(logged) == 2]
  assert len(replayed) >= 2 and min(replayed) == resumed_from + 1, (replayed, resumed_from)
  assert any(logged[0]["loss"] != 0 for logged in records.values())  # it trained
  for step in replayed:
    first, second = records[step]
    for key in METHODS[method][3]:
      assert first[key] == second[key], (method, step, key, first[key], second[key])


@pytest.mark.slow  # three processes per method (≈ 40 s on 2 cores)
@pytest.mark.parametrize("method", ["grpo", "ppo"])
def test_two_processes_train_like_one(method, chat_data, tmp_path):
  """8 steps (PPO: 3 updates per rollout) on 2 processes × 2 devices and on 1 process × 4 devices, data-parallel
  over the 4: the same rewards and lengths at every step (the same samples), the same losses up to float32
  reduction order across processes (rel 2e-5, as pre-training's in tests/test_multihost.py)."""
  data_dir = chat_data[0]
  base_dir = _base(method, data_dir, tmp_path)
  steps, mesh = 8, "'data': 4"
  one = str(tmp_path / "one")
  assert _launch(method, one, data_dir, base_dir, steps=steps, mesh=mesh, devices=4).wait(timeout=300) == 0, \
      open(one + ".log").read()[-3000:]
  two = str(tmp_path / "two")
  port = test_multihost.free_port()
  procs = [_launch(method, two, data_dir, base_dir, steps=steps, mesh=mesh, devices=2,
                   extra=[f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2", f"--process_id={i}"])
           for i in range(2)]
  for proc in procs:
    assert proc.wait(timeout=300) == 0, open(two + ".log").read()[-3000:]
  single, multi = interrupt.by_step(one), interrupt.by_step(two)
  assert sorted(single) == sorted(multi) == list(range(1, steps + 1))
  assert any(logged[0]["loss"] != 0 for logged in single.values())  # it trained
  for step in single:
    (a,), (b,) = single[step], multi[step]
    assert a["reward_mean"] == b["reward_mean"] and a["response_length"] == b["response_length"], step
    assert b["loss"] == pytest.approx(a["loss"], rel=2e-5, abs=1e-7), (step, a["loss"], b["loss"])
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=2e-5), step
