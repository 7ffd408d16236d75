"""Every gin file under configs/ parses and builds its config objects; bad gin input fails clearly."""

import glob
import os

import gin
import pytest

from t5x_like import cli as gin_utils
from t5x_like.model import decoder as model
from t5x_like.training import optimizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = sorted(glob.glob(os.path.join(ROOT, "configs", "models", "*.gin")))
OTHERS = sorted(set(glob.glob(os.path.join(ROOT, "configs", "**", "*.gin"), recursive=True)) - set(MODELS))
BASE = ["configs/models/gpt_tiny.gin", "configs/runs/pretrain.gin"]


@pytest.fixture(autouse=True)
def clear_gin():
  gin.clear_config()
  yield
  gin.clear_config()


def _build():
  return (gin_utils.train_config(), gin_utils.configured(model.GPTConfig, "model"),
          gin_utils.configured(optimizer.OptimizerConfig, "optimizer"))


@pytest.mark.parametrize("model_file", MODELS, ids=os.path.basename)
def test_model_file_with_pretrain_run(model_file):
  gin_utils.parse_gin([model_file, "configs/runs/pretrain.gin"], ["MODEL_DIR='/tmp/x'", "DATA_DIR='/tmp/d'"])
  run, cfg, _ = _build()
  cfg.validate()
  assert run.model_dir == "/tmp/x" and cfg.num_layers > 0


@pytest.mark.parametrize("gin_file", OTHERS, ids=lambda p: os.path.relpath(p, ROOT))
def test_other_gin_files_parse(gin_file):
  files = [gin_file] if "experiments" in gin_file else ["configs/models/gpt_tiny.gin", gin_file]
  if "runs/" not in gin_file and "experiments" not in gin_file:
    files.append("configs/runs/pretrain.gin")
  gin_utils.parse_gin(files, ["MODEL_DIR='/tmp/x'", "DATA_DIR='/tmp/d'"] if "experiments" not in gin_file else [])
  _build()


def test_contract_macros_override_from_the_command_line():
  gin_utils.parse_gin(BASE, [
      "MODEL_DIR='/tmp/m'", "DATA_DIR='/tmp/d'", "TRAIN_STEPS=7", "BATCH_SIZE=4", "SEQ_LEN=16",
      "NUM_MICROBATCHES=2", "MESH_SHAPE={'pipeline': 1, 'data': 2, 'fsdp': 2, 'tensor': 2}", "SEED=3",
      "LOG_EVERY=2", "EVAL_EVERY=5", "CHECKPOINT_EVERY=6"])
  run, _, _ = _build()
  assert (run.model_dir, run.data_dir, run.train_steps, run.batch_size, run.seq_len, run.num_microbatches,
          run.seed, run.log_every, run.eval_every, run.checkpoint_every) == (
              "/tmp/m", "/tmp/d", 7, 4, 16, 2, 3, 2, 5, 6)
  assert run.mesh_shape == {"pipeline": 1, "data": 2, "fsdp": 2, "tensor": 2}


def test_per_concern_configs_are_bound_under_their_own_names():
  gin_utils.parse_gin(BASE, ["MODEL_DIR='/tmp/m'", "DATA_DIR='/tmp/d'", "checkpointing.CheckpointConfig.keep = 5",
                             "data.DataConfig.eval_batches = 3", "fault_tolerance.FaultToleranceConfig.nonfinite_action = 'rollback'",
                             "observe.ObserveConfig.prometheus_port = 9100", "trainer.TrainConfig.trainable = 'blocks/.*'"])
  run, _, _ = _build()
  assert (run.checkpoint.keep, run.data.eval_batches, run.fault_tolerance.nonfinite_action,
          run.observe.prometheus_port, run.trainable) == (5, 3, "rollback", 9100, "blocks/.*")
  assert run.data.data_streams == 1  # the default: batches never depend on the process count


def test_bad_nested_value_is_refused_naming_the_key():
  gin_utils.parse_gin(BASE, ["MODEL_DIR='/tmp/m'", "DATA_DIR='/tmp/d'",
                             "fault_tolerance.FaultToleranceConfig.nonfinite_action = 'retry'"])
  with pytest.raises(ValueError, match="FaultToleranceConfig.nonfinite_action must be 'stop' or 'rollback'"):
    _build()


@pytest.mark.parametrize("chunk", [48, 32, 256])  # 32 divides 128; 256: one chunk longer than the sequence (off)
def test_a_loss_chunk_that_does_not_divide_seq_len_is_refused(chunk):
  gin_utils.parse_gin(BASE, ["MODEL_DIR='/tmp/m'", "DATA_DIR='/tmp/d'", "SEQ_LEN=128",
                             f"trainer.TrainConfig.loss_chunk = {chunk}"])
  if chunk == 48:
    with pytest.raises(ValueError, match=r"TrainConfig.loss_chunk=48 must be 0 \(off\) or divide SEQ_LEN=128"):
      _build()
  else:
    assert _build()[0].loss_chunk == chunk


def test_unknown_macro_binding_is_refused():
  with pytest.raises(ValueError, match="NO_SUCH_THING"):
    gin_utils.parse_gin(BASE, ["NO_SUCH_THING=1"])


def test_unknown_configurable_parameter_is_refused():
  with pytest.raises(ValueError, match="no_such_field"):
    gin_utils.parse_gin(BASE, ["model.GPTConfig.no_such_field=1"])


def test_missing_gin_file_is_named():
  with pytest.raises(FileNotFoundError, match="nope.gin"):
    gin_utils.parse_gin(["configs/models/nope.gin"])


def test_malformed_gin_file_is_named(tmp_path):
  bad = tmp_path / "bad.gin"
  bad.write_text("model.GPTConfig.num_layers = = 3\n")
  with pytest.raises(ValueError, match="bad.gin"):
    gin_utils.parse_gin([str(bad)])


def test_rewrite_gin_args():
  assert gin_utils.rewrite_gin_args(["prog", "--gin.TRAIN_STEPS=5", "--gin_file=a.gin"]) == [
      "prog", "--gin_bindings=TRAIN_STEPS = 5", "--gin_file=a.gin"]
