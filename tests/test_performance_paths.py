"""Fast paths give the reference results: donated jitted steps equal undonated ones, the layer scan equals
unrolled blocks, ZeRO-Offload (real, on CPU's pinned_host memory) equals the plain step, and is refused
up front (with the reason) on a backend without pinned host memory.

Tolerances: float32 throughout; the scan vs unrolled comparison within 1e-6 (same ops, same order); donated
and offloaded steps bit-identical to the plain one (only buffers and memory spaces differ).
"""

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5x_like.model import blocks
from t5x_like.parallel import offload
from t5x_like.training import step as train_step
from t5x_like.training.objectives import language_model
from tests import test_precision

CFG = test_precision.CFG


class _DeviceWithoutHostMemory:
  """A device whose backend has no 'pinned_host' memory space (as XLA:CPU before jax 0.10)."""
  platform = "cpu"

  def addressable_memories(self):
    return [types.SimpleNamespace(kind="device")]


def test_offload_is_refused_with_the_reason_where_there_is_no_pinned_host_memory():
  assert offload.supported()  # jax 0.10's CPU backend has it: the real offloaded step runs below
  with pytest.raises(ValueError, match=r"TrainConfig.offload_optimizer=True needs a 'pinned_host' memory "
                                       r"space .* backend has only \['device'\]: set it to False"):
    offload.check_supported(device=_DeviceWithoutHostMemory())
  with pytest.raises(ValueError, match=r"TrainConfig.offload_params=True"):
    offload.check_supported("TrainConfig.offload_params", device=_DeviceWithoutHostMemory())


@pytest.fixture(scope="module")
def plain_run():
  """(final state, per-step metrics) of 3 plain float32 steps (test_precision's run)."""
  return test_precision.run_steps("float32")


@pytest.mark.slow  # fast subset: the developer loop; CI runs it
@pytest.mark.parametrize("offload_params", [False, True])
def test_offloaded_step_equals_the_plain_step_with_state_in_pinned_host(plain_run, offload_params):
  """ZeRO-Offload for real on CPU: AdamW's moments (and with offload_params the float32 master weights)
  stay in 'pinned_host' memory between steps, the jitted step brings them in and sends the update back,
  and the same 3 steps give bit-identical losses, parameters and optimizer state to the plain run."""
  model, tx, lr_fn, state = test_precision.make_state(CFG)
  fn = functools.partial(train_step.train_step, objective=language_model.LanguageModel(model.apply), tx=tx,
                         lr_fn=lr_fn)
  mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  shardings = offload.offload_shardings(jax.tree.map(lambda _: replicated, state), params=offload_params)
  offloaded = jax.device_put(jax.tree.map(jnp.copy, state), shardings)  # donated below: not `state`'s buffers
  step = jax.jit(offload.with_device_opt_state(fn, shardings), in_shardings=(shardings, None),
                 out_shardings=(shardings, None), donate_argnums=0)
  plain, plain_history = plain_run
  for i in range(test_precision.STEPS):
    offloaded, metrics = step(offloaded, test_precision.synthetic_batch(i))
    assert float(metrics["loss"]) == float(plain_history[i]["loss"])
  kinds = lambda tree: {leaf.sharding.memory_kind for leaf in jax.tree.leaves(tree)}
  assert kinds(offloaded.opt_state) == {"pinned_host"}
  assert kinds(offloaded.params) == ({"pinned_host"} if offload_params else {"device"})
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(offloaded.params), jax.device_get(plain.params))
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(offloaded.opt_state), jax.device_get(plain.opt_state))
  assert not np.array_equal(np.asarray(plain.params["ln_f"]["scale"]), np.asarray(state.params["ln_f"]["scale"]))


def test_scanned_blocks_equal_unrolled_blocks():
  """lax.scan over the stacked LAYERS axis (one compiled block) computes what applying each block does."""
  cfg = dataclasses.replace(CFG, num_layers=3)
  x = jax.random.normal(jax.random.key(1), (2, 8, cfg.d_model), jnp.float32)
  mask = jnp.ones((2, 1, 8, 8), jnp.bool_) & jnp.tril(jnp.ones((8, 8), jnp.bool_))
  stacked = blocks.init_stacked_blocks(cfg, jax.random.key(0), cfg.num_layers)
  stacked = jax.tree.map(lambda b: b.value, stacked, is_leaf=lambda b: hasattr(b, "value"))
  positions = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (2, 8))
  scanned = blocks.scan_blocks(cfg, stacked, x, mask, positions)
  block = blocks.block_fn(cfg)
  unrolled = x
  for i in range(cfg.num_layers):
    unrolled = block(jax.tree.map(lambda p: p[i], stacked), unrolled, mask, positions)
  np.testing.assert_allclose(scanned, unrolled, atol=1e-6)


@pytest.mark.slow  # fast subset: the developer loop; CI runs it
def test_donated_step_equals_undonated_step():
  model, tx, lr_fn, state = test_precision.make_state(CFG)
  fn = functools.partial(train_step.train_step, objective=language_model.LanguageModel(model.apply), tx=tx, lr_fn=lr_fn)
  batch = test_precision.synthetic_batch()
  plain, plain_metrics = jax.jit(fn)(state, batch)
  donated_input = jax.tree.map(jnp.copy, state)
  donated, donated_metrics = jax.jit(fn, donate_argnums=0)(donated_input, batch)
  assert float(plain_metrics["loss"]) == float(donated_metrics["loss"])
  jax.tree.map(np.testing.assert_array_equal, plain.params, donated.params)
