"""Fast paths give the reference results: donated jitted steps equal undonated ones, the layer scan equals
unrolled blocks, and ZeRO-Offload is refused up front (with the reason) where there is no pinned host memory.

Tolerances: float32 throughout; the scan vs unrolled comparison within 1e-6 (same ops, same order).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5x_like.model import blocks
from t5x_like.model import decoder as model_lib
from t5x_like.parallel import offload
from t5x_like.training import optimizer
from t5x_like.training import train_state
from t5x_like.training import step as train_step
from tests import test_precision

CFG = test_precision.CFG


def test_offload_is_refused_on_cpu_with_the_reason():
  if offload.supported():
    pytest.skip("this backend has pinned_host memory")
  with pytest.raises(ValueError, match=r"TrainConfig.offload_optimizer=True needs a 'pinned_host' memory space"):
    offload.check_supported()
  shardings = train_state.TrainState(step=None, params={}, opt_state={})
  with pytest.raises(ValueError, match="offload_params=True"):
    offload.offload_shardings(shardings, params=True)


def test_scanned_blocks_equal_unrolled_blocks():
  """lax.scan over the stacked LAYERS axis (one compiled block) computes what applying each block does."""
  cfg = dataclasses.replace(CFG, num_layers=3)
  x = jax.random.normal(jax.random.key(1), (2, 8, cfg.d_model), jnp.float32)
  mask = jnp.ones((2, 1, 8, 8), jnp.bool_) & jnp.tril(jnp.ones((8, 8), jnp.bool_))
  stacked = blocks.init_stacked_blocks(cfg, jax.random.key(0), cfg.num_layers)
  stacked = jax.tree.map(lambda b: b.value, stacked, is_leaf=lambda b: hasattr(b, "value"))
  scanned = blocks.scan_blocks(cfg, stacked, x, mask)
  block = blocks.block_fn(cfg)
  unrolled = x
  for i in range(cfg.num_layers):
    unrolled = block(jax.tree.map(lambda p: p[i], stacked), unrolled, mask)
  np.testing.assert_allclose(scanned, unrolled, atol=1e-6)


def test_donated_step_equals_undonated_step():
  model, tx, lr_fn, state = test_precision.make_state(CFG)
  fn = functools.partial(train_step.train_step, apply_fn=model.apply, tx=tx, lr_fn=lr_fn)
  batch = test_precision.synthetic_batch()
  plain, plain_metrics = jax.jit(fn)(state, batch)
  donated_input = jax.tree.map(jnp.copy, state)
  donated, donated_metrics = jax.jit(fn, donate_argnums=0)(donated_input, batch)
  assert float(plain_metrics["loss"]) == float(donated_metrics["loss"])
  jax.tree.map(np.testing.assert_array_equal, plain.params, donated.params)
