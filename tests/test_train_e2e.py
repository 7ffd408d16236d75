"""End to end: text → shards → a tiny GPT that learns → a restart that continues; bad input fails clearly."""

import json
import math
import os
import subprocess
import sys

import gin
import numpy as np
import pytest

from tests import conftest
from tests import forkserver
from tests import test_fault_tolerance

from t5x_like import cli
from t5x_like.data import input_pipeline
from t5x_like.model import decoder as model_lib
from t5x_like.training import optimizer as optimizer_lib
from t5x_like.training import config as config_lib
from t5x_like import data as data_lib
from t5x_like.training import fault_tolerance
from t5x_like.training import trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = model_lib.GPTConfig(num_layers=2, num_heads=4, d_model=64, d_ff=256, max_len=64, dtype="float32")
OPT = optimizer_lib.OptimizerConfig(learning_rate=3e-3, warmup_steps=10, decay="cosine")


@pytest.fixture(scope="module")
def dataset(corpus):
  return corpus


@pytest.fixture(scope="module")
def launches(dataset, tmp_path_factory):
  """The module's two CLI launches, started by its first test so that their start-ups overlap its training:
  a missing DATA_DIR, and test_fault_tolerance's TINY launch (its compiled step in the persistent cache) with NaN
  at steps 2..4."""
  root = tmp_path_factory.mktemp("launches")
  started = {"missing": _cli(f"--gin.MODEL_DIR='{root}/r'", f"--gin.DATA_DIR='{root}/nope'"),
             "nan": forkserver.Popen(test_fault_tolerance.launch_args(f"{root}/nan", dataset) + [
                 "--gin.fault_tolerance.FaultToleranceConfig.nonfinite_patience=2",
                 "--gin.fault_tolerance.FaultToleranceConfig.debug_nan_steps=(2, 3, 4)"], cwd=ROOT,
                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=test_fault_tolerance.launch_env())}
  yield {"root": str(root), **started}
  for proc in started.values():
    if proc.poll() is None:
      proc.kill()
    proc.communicate()


def run_config(model_dir, data_dir, **overrides):
  base = dict(model_dir=model_dir, data_dir=data_dir, train_steps=80, batch_size=8, seq_len=32, seed=0,
              log_every=10, eval_every=40, checkpoint_every=40, mesh_shape={"data": -1})
  base.update(overrides)
  return config_lib.TrainConfig(**base)


@pytest.mark.slow  # end to end: trains, or launches the CLI
def test_tiny_model_learns_far_below_unigram_baseline_and_a_restart_continues_from_saved_step(
    dataset, tmp_path, monkeypatch, launches):  # pylint: disable=unused-argument  (they start first)
  """80 steps learn far below the unigram baseline; a second launch with TRAIN_STEPS 84 continues the finished run
  from its step-80 checkpoint (steps 81..84), not from step 1. MODEL_DIR is relative, as the demo config's; the
  loss is chunked (loss_chunk=16 of SEQ_LEN=32), so the chunked loss runs through the trainer."""
  monkeypatch.chdir(tmp_path)
  model_dir = "run"
  result = trainer.train(run_config(model_dir, dataset, loss_chunk=16,
                                    data=data_lib.DataConfig(report_unigram_baseline=True)), TINY, OPT)
  baseline = input_pipeline.unigram_baseline(dataset)
  assert result["eval/unigram_baseline"] == baseline
  assert result["eval/loss"] < 0.6 * baseline, (result["eval/loss"], baseline)
  assert math.isclose(result["eval/perplexity"], math.exp(result["eval/loss"]), rel_tol=1e-9)
  run = tmp_path / "run"
  assert (run / "config.gin").exists() and (run / "checkpoints" / "80").is_dir()
  assert any(name.startswith("events.out.tfevents") for name in os.listdir(run))
  records = [json.loads(line) for line in open(run / "metrics.jsonl")]
  assert [r["step"] for r in records if "loss" in r] == [10, 20, 30, 40, 50, 60, 70, 80]
  assert {"lr", "grad_norm", "tokens_per_sec", "mfu"} <= set(next(r for r in records if "loss" in r))
  assert records[0]["step"] == 0 and records[0]["params/trainable"] == records[0]["params/total"]  # start-up report
  # the restart: four more steps (logged at the last one), evaluating one batch at the end
  trainer.train(run_config(model_dir, dataset, train_steps=84, loss_chunk=16,
                           data=data_lib.DataConfig(eval_batches=1, shuffle_buffer=64)), TINY, OPT)
  records = [json.loads(line) for line in open(run / "metrics.jsonl")]
  assert [r["step"] for r in records if "loss" in r] == [10, 20, 30, 40, 50, 60, 70, 80, 84]  # started at 81
  assert [r["step"] for r in records if "params/total" in r] == [0, 80]  # each launch's start-up report
  assert sorted(int(s) for s in os.listdir(run / "checkpoints") if s.isdigit())[-1] == 84


def test_seq_len_beyond_max_len_is_refused(dataset, tmp_path):
  with pytest.raises(ValueError, match="SEQ_LEN=128.*max_len=64"):
    trainer.train(run_config(str(tmp_path / "r"), dataset, seq_len=128), TINY, OPT)


def test_batch_not_divisible_by_devices_is_refused(dataset, tmp_path):
  with pytest.raises(ValueError, match="BATCH_SIZE=6"):
    trainer.train(run_config(str(tmp_path / "r"), dataset, batch_size=6), TINY, OPT)


def test_missing_data_dir_is_named(tmp_path):
  with pytest.raises((FileNotFoundError, ValueError), match=str(tmp_path / "nope")):
    trainer.train(run_config(str(tmp_path / "r"), str(tmp_path / "nope")), TINY, OPT)


def _cli(*args) -> subprocess.Popen:
  return forkserver.Popen([sys.executable, "-m", "t5x_like.train", "--gin_file=configs/models/gpt_tiny.gin",
                           "--gin_file=configs/runs/pretrain.gin", *args], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env={**os.environ, "XLA_FLAGS": conftest.xla_flags(0)})


@pytest.mark.slow  # end to end: trains, or launches the CLI
def test_cli_bad_input_exits_with_one_line_reason(launches, tmp_path):
  missing = conftest.finished(launches["missing"])
  assert missing.returncode != 0
  last = missing.stderr.strip().splitlines()[-1]
  assert last.startswith("error:") and f"{launches['root']}/nope" in last
  # the other parse errors reach the same one-line printer (one launch above shows it) from cli.parse_gin
  files = ["configs/models/gpt_tiny.gin", "configs/runs/pretrain.gin"]
  gin.clear_config()
  try:
    with pytest.raises(ValueError, match="unknown gin binding 'NO_SUCH_THING=1'.*macro NO_SUCH_THING"):
      cli.parse_gin(files, [f"MODEL_DIR='{tmp_path}/r'", "NO_SUCH_THING=1"])
    gin.clear_config()
    with pytest.raises(FileNotFoundError, match="gin file 'configs/runs/typo.gin' not found"):
      cli.parse_gin([*files, "configs/runs/typo.gin"])
  finally:
    gin.clear_config()


@pytest.mark.slow
def test_exit_codes_nonfinite_65_and_unwritable_model_dir_74(launches, dataset, tmp_path):
  nan = conftest.finished(launches["nan"])
  assert nan.returncode == 65, nan.stderr[-2000:]
  assert nan.stderr.strip().splitlines()[-1].startswith("stopped: 2 consecutive non-finite steps ending at step 3")
  locked = tmp_path / "locked"
  locked.mkdir()
  if os.geteuid() == 0:
    assert subprocess.run(["chattr", "+i", str(locked)], capture_output=True).returncode == 0, "chattr +i failed"
    unlock = ["chattr", "-i", str(locked)]
  else:
    os.chmod(locked, 0o555)
    unlock = ["chmod", "755", str(locked)]
  # the launch above shows RunStopped's exit code and "stopped:" line; a read-only MODEL_DIR is one of those
  try:
    with pytest.raises(fault_tolerance.RunStopped, match="is not writable") as stopped:
      trainer.train(run_config(f"{locked}/run", dataset, train_steps=2), TINY, OPT)
  finally:
    subprocess.run(unlock, check=True)
  assert stopped.value.exit_code == 74
