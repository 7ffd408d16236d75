"""The chunked loss (no full (B, L, V) logits) equals the plain loss, in value and gradient."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5x_like.model import decoder as model_lib
from t5x_like.parallel import partitioning
from t5x_like.training import step as train_step
from t5x_like.training.objectives import language_model


@pytest.mark.parametrize("tied,dtype", [(True, "float32"), pytest.param(False, "float32", marks=pytest.mark.slow),
                                        pytest.param(True, "float16", marks=pytest.mark.slow)])
def test_chunked_loss_and_grads_equal_full(tied, dtype):
  """The fused chunked loss against the plain one. float16: with the cotangent dynamic loss scaling gives
  (2^15 / Σ weight), every gradient is finite and equals the plain path's within float16 rounding."""
  cfg = model_lib.GPTConfig(vocab_size=128, max_len=32, num_layers=2, num_heads=4, d_model=32, d_ff=64,
                            dtype=dtype, tie_embeddings=tied)
  model = model_lib.GPT(cfg)
  params = partitioning.unbox(model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])
  rng = np.random.RandomState(0)
  tokens = rng.randint(0, 128, (4, 33)).astype(np.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
           "segment_ids": np.repeat([[1] * 20 + [2] * 10 + [0] * 2], 4, 0).astype(np.int32),
           "positions": np.repeat([list(range(20)) + list(range(10)) + [0, 0]], 4, 0).astype(np.int32),
           "weights": np.repeat([[1.0] * 19 + [0.0] + [1.0] * 9 + [0.0] * 3], 4, 0).astype(np.float32)}
  chunked = dict(logits_fn=functools.partial(model_lib.project_logits, config=cfg), loss_chunk=8)

  scale = 2.0 ** 15 if dtype == "float16" else 1.0

  def loss(p, **kw):
    total, weight, _ = language_model.LanguageModel(model.apply, **kw).loss(p, batch)
    return total / weight * scale

  full_value, full_grad = jax.jit(jax.value_and_grad(loss))(params)  # jitted: one compile, not one per op
  chunk_value, chunk_grad = jax.jit(jax.value_and_grad(functools.partial(loss, **chunked)))(params)
  if dtype == "float32":
    np.testing.assert_allclose(chunk_value, full_value, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(chunk_grad), jax.tree.leaves(full_grad)):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    return
  # float16 matmuls: the two paths round differently; compare each leaf's gradient as a vector
  np.testing.assert_allclose(chunk_value, full_value, rtol=1e-3)
  for path, a in jax.tree_util.tree_leaves_with_path(chunk_grad):
    b = np.asarray(dict(jax.tree_util.tree_leaves_with_path(full_grad))[path], np.float64)
    a = np.asarray(a, np.float64)
    assert np.all(np.isfinite(a)), path
    assert np.linalg.norm(a - b) <= 2e-2 * np.linalg.norm(b) + 1e-3 * scale * 1e-4, (path, np.linalg.norm(a - b),
                                                                                    np.linalg.norm(b))
