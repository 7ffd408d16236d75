"""Learning-rate schedules and the weight-decay mask."""

import jax.numpy as jnp
import numpy as np
import pytest

from t5x_like.training import optimizer


def test_warmup_then_cosine_reaches_min_ratio():
  cfg = optimizer.OptimizerConfig(learning_rate=1.0, warmup_steps=10, decay="cosine", min_lr_ratio=0.1)
  lr = optimizer.learning_rate_schedule(cfg, 110)
  assert float(lr(0)) == 0.0
  np.testing.assert_allclose(float(lr(5)), 0.5, rtol=1e-6)
  np.testing.assert_allclose(float(lr(10)), 1.0, rtol=1e-6)
  np.testing.assert_allclose(float(lr(60)), 0.55, rtol=1e-5)  # halfway: (1 + 0.1) / 2
  np.testing.assert_allclose(float(lr(110)), 0.1, rtol=1e-5)


def test_linear_and_constant_decay():
  linear = optimizer.learning_rate_schedule(
      optimizer.OptimizerConfig(learning_rate=2.0, warmup_steps=0, decay="linear", min_lr_ratio=0.0), 100)
  np.testing.assert_allclose(float(linear(50)), 1.0, rtol=1e-6)
  const = optimizer.learning_rate_schedule(optimizer.OptimizerConfig(learning_rate=2.0, warmup_steps=4,
                                                                     decay="constant"), 100)
  np.testing.assert_allclose([float(const(2)), float(const(80))], [1.0, 2.0], rtol=1e-6)
  with pytest.raises(ValueError, match="decay"):
    optimizer.learning_rate_schedule(optimizer.OptimizerConfig(decay="step"), 10)


def test_weight_decay_only_on_kernels_by_default():
  params = {"token_embedding": jnp.ones((4, 2)), "blocks": {"mlp_in": {"kernel": jnp.ones((2, 2)),
                                                                      "bias": jnp.ones(2)},
                                                           "ln_1": {"scale": jnp.ones(2)}}}
  mask = optimizer.weight_decay_mask(params)
  assert mask == {"token_embedding": False, "blocks": {"mlp_in": {"kernel": True, "bias": False},
                                                       "ln_1": {"scale": False}}}
  assert optimizer.weight_decay_mask(params, decay_embeddings=True)["token_embedding"] is True


def test_decay_moves_kernels_not_biases():
  cfg = optimizer.OptimizerConfig(learning_rate=0.1, warmup_steps=0, decay="constant", weight_decay=0.5)
  tx = optimizer.make_optimizer(cfg, 10)
  params = {"w": {"kernel": jnp.ones((2, 2)), "bias": jnp.ones(2)}}
  zero_grads = {"w": {"kernel": jnp.zeros((2, 2)), "bias": jnp.zeros(2)}}
  updates, _ = tx.update(zero_grads, tx.init(params), params)
  assert float(jnp.abs(updates["w"]["kernel"]).sum()) > 0
  assert float(jnp.abs(updates["w"]["bias"]).sum()) == 0
