"""Every mesh layout trains exactly like one device: data, fsdp, tensor, pipeline, combined, with
gradient accumulation and remat; parameters and optimizer state are really sharded; bad layouts
are refused up front with errors naming the key.

Tolerance (float32 compute throughout): per-step losses and gradient norms within rtol 1e-5, and every
parameter after 3 AdamW steps within atol 2e-6 + rtol 1e-5 of the single-device run. The only
differences left are the order of float32 sums (all-reduces, accumulation, pipeline microbatches).
AdamW's eps is 1e-6 here: the key bias has an exactly zero true gradient (softmax ignores a shift
shared by all keys), and with a tiny eps Adam would turn its float32 noise (~1e-11) into ±lr steps.
"""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5x_like import mesh as mesh_lib
from t5x_like import model as model_lib
from t5x_like import optimizer
from t5x_like import partitioning
from t5x_like import train_state
from t5x_like import train_step

CFG = model_lib.GPTConfig(vocab_size=256, max_len=32, num_layers=4, num_heads=8, d_model=64, d_ff=256,
                          dtype="float32")
BATCH, SEQ, STEPS = 32, 16, 3
LOSS_RTOL = 1e-5
PARAM_ATOL, PARAM_RTOL = 2e-6, 1e-5
RULES = partitioning.DEFAULT_RULES
OPT = optimizer.OptimizerConfig(learning_rate=1e-3, warmup_steps=1, eps=1e-6)


def synthetic_batch(seed: int = 0) -> dict:
  """Packed rows (two documents each, some padding) so segment ids and weights matter."""
  rng = np.random.RandomState(seed)
  tokens = rng.randint(0, CFG.vocab_size, (BATCH, SEQ + 1)).astype(np.int32)
  cut = rng.randint(3, SEQ - 3, BATCH)
  col = np.arange(SEQ)[None]
  segment_ids = np.where(col < cut[:, None], 1, 2).astype(np.int32)
  segment_ids[::3, SEQ - 2:] = 0  # padding tails
  positions = np.where(col < cut[:, None], col, col - cut[:, None]).astype(np.int32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": segment_ids,
          "positions": positions, "weights": (segment_ids != 0).astype(np.float32)}


def setup(mesh_shape: dict, *, remat: str = "none", pipeline_microbatches: int = 0, devices=None):
  """(mesh, model config, model, optimizer, lr schedule), validated for BATCH before anything compiles."""
  mesh = mesh_lib.create_mesh(mesh_shape, devices)
  cfg = dataclasses.replace(CFG, remat_policy=remat, num_stages=mesh.shape["pipeline"],
                            pipeline_microbatches=pipeline_microbatches)
  cfg.validate()
  model = model_lib.GPT(cfg)
  return mesh, cfg, model, optimizer.make_optimizer(OPT, 10), optimizer.learning_rate_schedule(OPT, 10)


@pytest.fixture(scope="module")
def initial_state():
  """The initial TrainState as host arrays (one init compile; each layout shards it its own way)."""
  mesh, _, model, tx, _ = setup({"data": 1}, devices=jax.devices()[:1])
  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    state, _ = train_state.init_state(model, tx, jax.random.key(0), mesh, RULES)
  return jax.tree.map(np.asarray, state)


def train(initial, mesh_shape: dict, *, num_microbatches: int = 1, remat: str = "none",
          pipeline_microbatches: int = 0, devices=None):
  """Runs STEPS train steps from `initial` on one batch; returns ([(loss, grad_norm)], params as numpy)."""
  mesh, cfg, model, tx, lr_fn = setup(mesh_shape, remat=remat, pipeline_microbatches=pipeline_microbatches,
                                      devices=devices)
  partitioning.check_layout(cfg, mesh.shape, BATCH, num_microbatches)
  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    _, shardings = train_state.state_shardings(model, tx, mesh, RULES)
    state = jax.device_put(initial, shardings)
    batch_sharding = partitioning.batch_sharding(mesh, RULES)
    batch = {k: jax.device_put(v, batch_sharding) for k, v in synthetic_batch().items()}
    step = jax.jit(functools.partial(train_step.train_step, apply_fn=model.apply, tx=tx, lr_fn=lr_fn,
                                     num_microbatches=num_microbatches),
                   in_shardings=(shardings, {k: batch_sharding for k in batch}),
                   out_shardings=(shardings, None))
    history = []
    for _ in range(STEPS):
      state, metrics = step(state, batch)
      history.append((float(metrics["loss"]), float(metrics["grad_norm"])))
  return np.array(history), jax.tree.map(np.asarray, state.params)


@pytest.fixture(scope="module")
def reference(initial_state):
  """The single-device run: no sharding, no accumulation, no remat, no pipeline."""
  return train(initial_state, {"data": 1}, devices=jax.devices()[:1])


def assert_same_training(result, reference_run):
  (losses, params), (ref_losses, ref_params) = result, reference_run
  np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
  assert losses[-1, 0] < losses[0, 0]  # it trained
  flat, ref_flat = jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(ref_params)
  for (path, leaf), ref_leaf in zip(flat, ref_flat):
    np.testing.assert_allclose(leaf, ref_leaf, atol=PARAM_ATOL, rtol=PARAM_RTOL,
                               err_msg=jax.tree_util.keystr(path))


LAYOUTS = {
    "data8": dict(mesh_shape={"data": 8}),
    "fsdp8": dict(mesh_shape={"fsdp": 8}),
    "tensor8": dict(mesh_shape={"tensor": 8}),
    "data2_fsdp2_tensor2": dict(mesh_shape={"data": 2, "fsdp": 2, "tensor": 2}),
    "pipeline2_data2_tensor2": dict(mesh_shape={"pipeline": 2, "data": 2, "tensor": 2}),
    "pipeline4_fsdp2": dict(mesh_shape={"pipeline": 4, "fsdp": 2}),
    "pipeline2_tensor4_m4": dict(mesh_shape={"pipeline": 2, "tensor": 4}, pipeline_microbatches=4),
    "pipeline2_fsdp2_tensor2_m8": dict(mesh_shape={"pipeline": 2, "fsdp": 2, "tensor": 2},
                                       pipeline_microbatches=8),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_trains_like_one_device(layout, initial_state, reference):
  assert_same_training(train(initial_state, **LAYOUTS[layout]), reference)


@pytest.mark.slow  # a second compile per layout; CI runs it
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_with_accumulation_and_remat_trains_like_one_device(layout, initial_state, reference):
  assert_same_training(train(initial_state, **LAYOUTS[layout], num_microbatches=2, remat="full"), reference)
