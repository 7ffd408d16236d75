"""The interleaved pipeline's weights in stage order (GPTConfig.blocks_in_stage_order), seen from outside the
trainer: its checkpoints are in layer order, so any layout reads them and an interleaved run resumes a plain run's
(a rollback's restore included), and the engine decodes from a stage-ordered runtime what it decodes from a plain one.

Tolerance: the layouts differ only in the order of float32 sums (as tests/test_parallelism.py's), so losses agree
within rtol 1e-5 and parameters within its atol 4e-6 + rtol 1e-5 after 4 AdamW steps (eps 1e-6, as there). Blocks
left in stage order where layer order is expected move whole layers (differences of the weights' own size, ~0.02).
"""

import dataclasses
import json

import jax
import numpy as np
import pytest

from tests import conftest
from tests import test_parallelism
from tests import test_train_e2e
from t5x_like import data as data_lib
from t5x_like.data import input_pipeline
from t5x_like.inference import engine as engine_lib
from t5x_like.inference.sampling import SamplingParams
from t5x_like.model import decoder as model_lib
from t5x_like.model import pipeline_parallel
from t5x_like.parallel import partitioning
from t5x_like.recipes import experiment
from t5x_like.training import checkpointing
from t5x_like.training import fault_tolerance
from t5x_like.training import runtime as runtime_lib
from t5x_like.training import trainer

# 4 layers: 2 stages × 2 repeats of one layer each, so stage order differs from layer order
MODEL = model_lib.GPTConfig(num_layers=4, num_heads=2, d_model=32, d_ff=64, max_len=32, dtype="float32",
                            pipeline_repeats=2)
INTERLEAVED = {"pipeline": 2, "data": -1}
PLAIN = {"data": -1}


# step 3's batch poisoned with NaN weights: seen after step 4, the run rolls back to checkpoint 2 and redoes 3 and 4
ROLLBACK = fault_tolerance.FaultToleranceConfig(debug_nan_steps=(3,), nonfinite_patience=1, nonfinite_action="rollback")


def run_config(model_dir, corpus, steps: int, mesh_shape: dict, **overrides):
  return test_train_e2e.run_config(str(model_dir), corpus, train_steps=steps, batch_size=16, log_every=1,
                                   checkpoint_every=2, eval_every=0, mesh_shape=mesh_shape,
                                   data=data_lib.DataConfig(eval_batches=1, shuffle_buffer=64), **overrides)


def train(model_dir, corpus, steps: int, mesh_shape: dict, **overrides) -> None:
  model = MODEL if mesh_shape.get("pipeline", 1) > 1 else dataclasses.replace(MODEL, pipeline_repeats=1)
  trainer.train(run_config(model_dir, corpus, steps, mesh_shape, **overrides), model, test_parallelism.OPT)


def losses(model_dir) -> dict:
  return {r["step"]: r["loss"] for r in map(json.loads, open(model_dir / "metrics.jsonl")) if "loss" in r}


def params(model_dir, step: int):
  return checkpointing.restore_params(str(model_dir), step)[1]


def assert_close(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(x, y, atol=test_parallelism.PARAM_ATOL, rtol=test_parallelism.PARAM_RTOL,
                               err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow  # four short training launches
def test_interleaved_checkpoints_load_without_a_pipeline_and_plain_ones_resume_interleaved(corpus, tmp_path):
  """An interleaved run's step-2 checkpoint, restored onto a mesh without a pipeline, holds what a plain run's does
  (layer order). The reverse, with a rollback: the plain run's step 2 resumed interleaved to 4 with step 3 poisoned
  (rolled back to checkpoint 2, so restored twice) ends where the same resume without a pipeline does."""
  train(tmp_path / "plain", corpus, 2, PLAIN)
  train(tmp_path / "pipelined", corpus, 2, INTERLEAVED)
  plain_model = dataclasses.replace(MODEL, pipeline_repeats=1)
  loaded = []
  for name in ("pipelined", "plain"):
    runtime = runtime_lib.Runtime(run_config(tmp_path / name, corpus, 2, PLAIN), plain_model)
    with runtime.context():
      loaded.append(jax.tree.map(np.asarray, runtime.restore_params(2)[1]))
  assert_close(*loaded)
  np.testing.assert_allclose(list(losses(tmp_path / "pipelined").values()), list(losses(tmp_path / "plain").values()),
                             rtol=test_parallelism.LOSS_RTOL)
  for name, mesh_shape in (("rolled_back", PLAIN), ("rolled_back_pipelined", INTERLEAVED)):
    train(conftest.rewind(tmp_path / "plain", tmp_path / name, 2), corpus, 4, mesh_shape, fault_tolerance=ROLLBACK)
  records = [json.loads(line) for line in open(tmp_path / "rolled_back_pipelined" / "metrics.jsonl")]
  assert [r["step"] for r in records if "loss" in r] == [3, 4, 3, 4]  # rolled back once
  redone, reference = losses(tmp_path / "rolled_back_pipelined"), losses(tmp_path / "rolled_back")
  np.testing.assert_allclose([redone[s] for s in (3, 4)], [reference[s] for s in (3, 4)],
                             rtol=test_parallelism.LOSS_RTOL)
  assert_close(params(tmp_path / "rolled_back_pipelined", 4), params(tmp_path / "rolled_back", 4))


@pytest.mark.slow  # two runtimes' compiles and decodes (~10 s): the fast subset keeps to its 3 minutes
def test_the_engine_decodes_a_trainers_stage_ordered_parameters_like_a_plain_runtimes(corpus, tmp_path):
  """A checkpoint restored by a trainer's runtime (Experiment) on the interleaved layout comes back in stage order
  (the blocks regrouped, everything else as saved), and so does a frozen model it loads (a DPO reference); an engine
  given those parameters and that config greedily decodes the tokens an engine on a plain runtime does, with the
  same log-probs."""
  model = dataclasses.replace(MODEL, vocab_size=runtime_lib.padded_vocab_size(
      input_pipeline.load_manifest(corpus)["vocab_size"]))
  runtime = runtime_lib.Runtime(run_config(tmp_path / "run", corpus, 1, PLAIN), model)
  with runtime.context():
    fresh = jax.jit(lambda: partitioning.unbox(runtime.model.init(jax.random.key(1), jax.numpy.zeros((1, 1), "int32"))[
        "params"]), out_shardings=runtime.model_shardings)()
  checkpointing.save_params(str(tmp_path / "run"), jax.tree.map(np.asarray, fresh))
  prompts = [[5, 9, 12], [7, 3, 3, 8, 2]]
  decoded = []
  for mesh_shape, stage_order in ((PLAIN, False), (INTERLEAVED, True)):
    config = run_config(tmp_path / "run", corpus, 1, mesh_shape)
    run = (experiment.Experiment(config, model, test_parallelism.OPT) if stage_order
           else runtime_lib.Runtime(config, model))
    with run.context():
      _, restored = run.restore_params()
      engine = engine_lib.Engine(run.model_config, restored, run.mesh, run.rules, slots=2)
      decoded.append([(c.tokens, c.logprobs) for [c] in engine.generate(prompts, SamplingParams(max_tokens=6))])
    if stage_order:
      assert run.model_config.blocks_stage_ordered
      host = jax.tree.map(np.asarray, restored)
      np.testing.assert_array_equal(host["token_embedding"], np.asarray(fresh["token_embedding"]))
      kernel, saved = host["blocks"]["mlp_in"]["kernel"], np.asarray(fresh["blocks"]["mlp_in"]["kernel"])
      np.testing.assert_array_equal(kernel, saved[[0, 2, 1, 3]])  # device 0 holds layers 0, 2; device 1 holds 1, 3
      jax.tree.map(np.testing.assert_array_equal, jax.tree.map(
          np.asarray, pipeline_parallel.to_layer_order(run.model_config, restored)), jax.tree.map(np.asarray, fresh))
      reference = run.add_frozen("reference", str(tmp_path / "run"))
      jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, reference), host)
  for (tokens, logprobs), (plain_tokens, plain_logprobs) in zip(decoded[1], decoded[0]):
    assert tokens == plain_tokens and len(tokens) == 6
    np.testing.assert_allclose(logprobs, plain_logprobs, rtol=1e-5, atol=1e-6)  # the layers ran in their order
