"""Multi-process runs on one machine: 2 processes × 2 CPU devices (gloo) versus 1 process × 4 devices."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests import conftest


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture(scope="module")
def dataset(corpus):
  return corpus


def train_args(model_dir, data_dir, steps, extra=()):
  return [sys.executable, "-m", "t5x_like.train", "--gin_file=configs/models/gpt_tiny.gin",
          "--gin_file=configs/runs/pretrain.gin", f"--gin.MODEL_DIR='{model_dir}'", f"--gin.DATA_DIR='{data_dir}'",
          f"--gin.TRAIN_STEPS={steps}", "--gin.BATCH_SIZE=8", "--gin.SEQ_LEN=32", "--gin.LOG_EVERY=1",
          "--gin.EVAL_EVERY=0", "--gin.CHECKPOINT_EVERY=2", "--gin.model.GPTConfig.num_layers=2",
          "--gin.model.GPTConfig.dtype='float32'",  # DataConfig.data_streams: the default (1)
          "--gin.data.DataConfig.eval_batches=2", "--gin.optimizer.OptimizerConfig.warmup_steps=2",
          "--gin.optimizer.OptimizerConfig.decay='constant'", *extra]  # schedule independent of TRAIN_STEPS


def env(devices):
  return {**os.environ, "XLA_FLAGS": conftest.xla_flags(devices), "JAX_PLATFORMS": "cpu"}


def launch(model_dir, data_dir, steps, processes, heartbeat=60):
  """Starts the run as `processes` processes (4 devices in all); returns the Popen objects."""
  if processes == 1:
    return [subprocess.Popen(train_args(model_dir, data_dir, steps), cwd=ROOT, env=env(4),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]
  port = free_port()
  return [subprocess.Popen(
      train_args(model_dir, data_dir, steps, [f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
                                              f"--process_id={i}", f"--heartbeat_timeout={heartbeat}",
                                              "--shutdown_timeout=20"]),
      cwd=ROOT, env=env(2), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]


def wait_all(procs, timeout=400):
  outputs = [p.communicate(timeout=timeout)[0] for p in procs]
  for p, out in zip(procs, outputs):
    assert p.returncode == 0, "\n".join(line for line in out.splitlines()
                                        if line[:1] in "EF" or "error" in line.lower())[-4000:]
  return outputs


def losses(model_dir):
  with open(os.path.join(model_dir, "metrics.jsonl")) as f:
    return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def test_two_processes_match_one_and_checkpoints_cross_over(dataset, tmp_path):
  """One 8-step run on 1 process × 4 devices is the reference. A second run goes 2 processes (steps 1-4)
  → 1 process (5-8), the second launch resuming the first's checkpoint: every step's loss equals the
  reference's (same global batches with the default data streams, same math). (Two processes restoring a
  checkpoint is the relaunch in the killed-peer test below.)"""
  one, handed = str(tmp_path / "one"), str(tmp_path / "handed")
  wait_all(launch(one, dataset, 8, processes=1))
  reference = losses(one)
  assert sorted(reference) == list(range(1, 9))

  def assert_matches(steps):
    got = losses(handed)
    for step in steps:  # equal up to float32 reduction order
      assert got[step] == pytest.approx(reference[step], rel=2e-5), (step, got, reference)

  wait_all(launch(handed, dataset, 4, processes=2))
  assert_matches([1, 2, 3, 4])
  with open(os.path.join(handed, "metrics.jsonl")) as f:  # process 0 alone writes: one record per step
    assert [r["step"] for r in map(json.loads, f) if "loss" in r] == [1, 2, 3, 4]
  assert len([n for n in os.listdir(handed) if n.startswith("events.out.tfevents")]) == 1
  wait_all(launch(handed, dataset, 8, processes=1))  # written by 2 processes, continued by 1
  assert_matches([5, 6, 7, 8])
  assert sorted(losses(handed)) == list(range(1, 9))


def test_killed_peer_makes_the_other_exit_with_a_reason(dataset, tmp_path):
  model_dir = str(tmp_path / "run")
  procs = launch(model_dir, dataset, 400, processes=2, heartbeat=10)
  metrics = os.path.join(model_dir, "metrics.jsonl")
  checkpoints = os.path.join(model_dir, "checkpoints")

  def finalized():  # a step directory appears only once orbax has committed (renamed) the save
    return [int(d) for d in os.listdir(checkpoints) if d.isdigit()] if os.path.isdir(checkpoints) else []

  deadline = time.time() + 300
  while time.time() < deadline and not (finalized() and os.path.exists(metrics)
                                        and len(open(metrics).readlines()) >= 3):
    time.sleep(0.5)
  assert finalized() and os.path.exists(metrics), procs[0].communicate(timeout=5)[0][-3000:]
  procs[1].send_signal(signal.SIGKILL)
  start = time.time()
  out, _ = procs[0].communicate(timeout=120)
  assert procs[0].returncode != 0
  assert time.time() - start < 90  # heartbeat timeout 10 s, plus a loaded machine's slack
  # either our line naming the dead process, or JAX's own heartbeat verdict naming it
  named = "process(es) [1] stopped responding" in out or re.search(r"stopped sending heartbeats\):\s*1", out)
  assert named, out[-2000:]
  procs[1].communicate(timeout=10)
  # relaunching both resumes from the newest checkpoint
  saved = max(finalized())
  with open(os.path.join(model_dir, "metrics.jsonl")) as f:
    before = sum(1 for _ in f)
  wait_all(launch(model_dir, dataset, saved + 2, processes=2))
  with open(os.path.join(model_dir, "metrics.jsonl")) as f:
    new_steps = [r["step"] for r in map(json.loads, f.readlines()[before:]) if "loss" in r]
  assert new_steps == [saved + 1, saved + 2]
