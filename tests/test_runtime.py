"""The runtime (training/runtime.py): built without an optimizer, it restores a plain run as saved and a LoRA run
with the settings the run recorded (rank, alpha, targets, base), so `infer` needs no LoRA flag for a LoRA run."""

import dataclasses
import os

import jax
import numpy as np
import pytest

from tests import conftest
from tests.test_finetune import REPO, TINY, random_params, run_config

from t5x_like.parallel import partitioning
from t5x_like.posttrain import lora
from t5x_like.posttrain import lora_runs  # pylint: disable=unused-import  (registers the LoRA reader, as cli does)
from t5x_like.training import checkpointing
from t5x_like.training import runtime as runtime_lib

# The run's recorded LoRA settings: attention kernels only, rank 2, alpha 6 (scale 3), none of them defaults.
RUN_LORA = lora.LoraConfig(rank=2, alpha=6.0, targets=r"blocks/attn/(qkv|out)/kernel")
CLI_MODEL = {"model.GPTConfig.num_layers": 2, "model.GPTConfig.d_model": 32, "model.GPTConfig.num_heads": 2,
             "model.GPTConfig.d_ff": 64, "model.GPTConfig.max_len": 32, "model.GPTConfig.dtype": "'float32'"}


def _random_tree(abstract, seed: int):
  rng = np.random.RandomState(seed)
  return jax.tree.map(lambda x: rng.normal(0.0, 0.3, x.shape).astype(np.float32), abstract)


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
  """A base, a LoRA run over it (random adapters, B ≠ 0, saved with its settings in the metadata) and the same
  run merged into a plain checkpoint."""
  root = tmp_path_factory.mktemp("runtime")
  plain = runtime_lib.Runtime(run_config("unused", corpus), TINY)
  base = random_params(partitioning.unbox(plain.boxed_params), seed=3)
  base_dir = str(root / "base")
  checkpointing.save_params(base_dir, base)
  kernels = lora.target_kernels(plain.boxed_params, RUN_LORA.targets)
  abstract = partitioning.unbox(jax.eval_shape(lambda: lora.init_adapters(jax.random.key(0), kernels, RUN_LORA)))
  adapters = _random_tree(abstract, seed=4)
  lora_dir = str(root / "lora")
  entry = {"base": os.path.join(base_dir, "checkpoints", "0"), "rank": RUN_LORA.rank, "alpha": RUN_LORA.alpha,
           "targets": RUN_LORA.targets}
  checkpointing.save_params(lora_dir, adapters, step=3, metadata={"lora": entry, "step": 3})
  merged = jax.tree.map(np.asarray, lora.merge(base, adapters, RUN_LORA.scale))
  merged_dir = str(root / "merged")
  checkpointing.save_params(merged_dir, merged)
  return {"base": base, "lora_dir": lora_dir, "merged": merged, "merged_dir": merged_dir}


def test_runtime_restores_a_plain_run_without_an_optimizer(corpus, runs):
  runtime = runtime_lib.Runtime(run_config(runs["merged_dir"], corpus), TINY)
  step, params = runtime.restore_params()
  assert step == 0
  for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(runs["merged"])):
    np.testing.assert_array_equal(np.asarray(got), want)
  assert runtime.load_tokenizer().vocab_size <= runtime.model_config.vocab_size


def test_lora_run_restores_merged_with_its_recorded_settings(corpus, runs):
  # a config with no LoRA setting at all (LoraConfig.rank 0, default targets and alpha)
  config = run_config(runs["lora_dir"], corpus)
  assert config.lora.rank == 0
  step, params = runtime_lib.Runtime(config, TINY).restore_params()
  assert step == 3
  changed = 0
  for (path, got), want, before in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(runs["merged"]),
                                       jax.tree.leaves(runs["base"])):
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6, err_msg=jax.tree_util.keystr(path))
    changed += not np.array_equal(want, before)
  assert changed == 2  # the run's targets (qkv, out), not the default seven kernels


def _infer_each(model_dirs, data_dir) -> list:
  """The stdout of `python -m t5x_like.infer` on each of `model_dirs`, launched one after another in one process
  (conftest.launch_each; in the test worker its flags would clash with another entry point's, e.g. checkpoints'
  --step)."""
  runs = []
  for model_dir in model_dirs:
    argv = [f"--gin_file={REPO}/configs/runs/pretrain.gin", f"--gin.MODEL_DIR='{model_dir}'",
            f"--gin.DATA_DIR='{data_dir}'", "--gin.SEQ_LEN=16", "--gin.BATCH_SIZE=8",
            "--prompt=the trainer reads", "--prompt=a shard", "--max_new_tokens=6"]
    runs.append(argv + [f"--gin.{k}={v}" for k, v in CLI_MODEL.items()])
  done = conftest.launch_each("t5x_like.infer", runs,
                              env=dict(os.environ, XLA_FLAGS=conftest.xla_flags(8), JAX_PLATFORMS="cpu"))
  for run in done:
    assert run.returncode == 0, run.stderr[-2000:]
  return [run.stdout for run in done]


@pytest.mark.slow  # an infer launch
def test_infer_on_a_lora_run_needs_no_lora_flag(corpus, runs):
  """infer on the LoRA run (no LoRA flag) prints what infer on the merged plain run prints, at the run's step."""
  lora_out, merged_out = _infer_each([runs["lora_dir"], runs["merged_dir"]], corpus)
  assert lora_out.splitlines()[0] == "# checkpoint step 3" and merged_out.splitlines()[0] == "# checkpoint step 0"
  assert lora_out.splitlines()[1:] == merged_out.splitlines()[1:] and len(lora_out.splitlines()) > 3


def test_a_lora_checkpoint_without_its_base_is_a_one_line_error(corpus, runs, tmp_path):
  _, adapters = checkpointing.restore_params(runs["lora_dir"])
  checkpointing.save_params(str(tmp_path), adapters, step=1, metadata={"lora": {"rank": 2, "alpha": 6.0}})
  with pytest.raises(ValueError, match=r"checkpoints/1: the checkpoint's LoRA metadata lacks lora.base"):
    runtime_lib.Runtime(dataclasses.replace(run_config(str(tmp_path), corpus)), TINY).restore_params()


def test_a_lora_run_read_before_its_reader_is_registered_is_a_one_line_error(corpus, runs, monkeypatch):
  """The LoRA reader registers when t5x_like.posttrain.lora_runs is imported (cli.py does, for every entry point); a
  library caller that has not imported it gets an error naming the checkpoint and the module, not a failed restore
  of the base's tree."""
  monkeypatch.delitem(runtime_lib.READERS, "lora")
  with pytest.raises(ValueError, match=r"checkpoints/3: a checkpoint with 'lora' metadata, whose reader is not "
                                       r"registered: import t5x_like\.posttrain\.lora_runs first"):
    runtime_lib.Runtime(run_config(runs["lora_dir"], corpus), TINY).restore_params()
