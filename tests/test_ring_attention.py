"""Ring attention (GPTConfig.context_parallelism='ring', model/ring.py) on the fake 8-device CPU mesh: it equals
single-device attention, forward and gradients, over sequence = 2, 4 and 8, on a packed and padded grouped-query
batch, causal and with a sliding window and soft-capping; and it refuses what it cannot do. A model trained on a
`sequence` mesh with the ring equals one device in tests/test_parallelism.py (layout sequence4_data2_ring), and
tests/test_long_sequence.py compares the ring's compiled memory with the all-gather's.

Tolerance: float32 throughout; the ring sums each row's softmax terms in another order (block by block, rescaled
by the running maximum), so outputs and gradients agree to 1e-5 of the largest, not bit for bit.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5x_like.model import layers
from t5x_like.model import ring
from t5x_like.model import decoder as model_lib

B, T, H, K, DH = 2, 32, 4, 2, 8


def packed_batch(seed=0):
  """q (B, T, H, Dh), k, v (B, T, K, Dh) and segment ids: row 0 = documents of 10 and 15 tokens then 7 padding, row
  1 = documents of 3, 20 and 9 tokens (boundaries off the ring's blocks)."""
  rng = np.random.RandomState(seed)
  q, k, v = (rng.normal(size=(B, T, heads, DH)).astype(np.float32) for heads in (H, K, K))
  seg = np.array([[1] * 10 + [2] * 15 + [0] * 7, [1] * 3 + [2] * 20 + [3] * 9], np.int32)
  return q, k, v, seg


def loss_and_grads(attend, q, k, v, seg, weights):
  """Σ weights · attention output over the non-padding rows, and its gradients in q, k, v."""
  valid = (seg != 0)[:, :, None, None]
  loss = lambda q, k, v: jnp.sum(jnp.where(valid, attend(q, k, v) * weights, 0.0))
  return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)


def reference(q, k, v, seg, window, softcap, scale_dim):
  mask = layers.causal_segment_mask(jnp.asarray(seg), window)
  out = lambda q, k, v: layers.reference_attention(q, k, v, mask, scale_dim, softcap)
  return out(q, k, v), out


CASES = {"causal": dict(window=0, softcap=0.0, scale_dim=0),
         # cap 1 with logits scaled by 1/√1: capping bites on most logits; a window of 5 crosses block boundaries
         "window5_softcap1": dict(window=5, softcap=1.0, scale_dim=1)}


@pytest.mark.parametrize("sequence", [2, 4, 8])
@pytest.mark.parametrize("case", list(CASES))
def test_ring_equals_single_device_attention(sequence, case):
  opts = CASES[case]
  q, k, v, seg = packed_batch()
  weights = np.random.RandomState(1).normal(size=(B, T, H, DH)).astype(np.float32)
  ref_out, ref_fn = reference(q, k, v, seg, **opts)
  ref_loss, ref_grads = loss_and_grads(ref_fn, q, k, v, seg, weights)
  mesh = jax.make_mesh((8 // sequence, sequence), ("data", "sequence"), devices=jax.devices()[:8])
  with jax.set_mesh(mesh):
    scale = (opts["scale_dim"] or DH) ** -0.5
    ring_fn = lambda q, k, v: ring.attention(q, k, v, jnp.asarray(seg), axis="sequence", window=opts["window"],
                                             scale=scale, softcap=opts["softcap"])
    out = jax.jit(ring_fn)(q, k, v)
    loss, grads = jax.jit(functools.partial(loss_and_grads, ring_fn))(q, k, v, seg, weights)
  valid = (seg != 0)[:, :, None, None]
  np.testing.assert_allclose(np.where(valid, out, 0), np.where(valid, ref_out, 0), atol=1e-5 * np.abs(ref_out).max())
  assert np.all(np.asarray(out)[seg == 0] == 0)  # padding rows: zeros, never NaN
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  for name, g, ref_g in zip("qkv", grads, ref_grads):
    np.testing.assert_allclose(g, ref_g, atol=1e-5 * np.abs(ref_g).max(), err_msg=f"d{name}")


def test_ring_is_refused_where_it_cannot_run():
  cfg = model_lib.GPTConfig(vocab_size=256, num_layers=2, num_heads=2, d_model=32, d_ff=64,
                            context_parallelism="ring")
  cfg.validate()
  for bad, match in ((dict(context_parallelism="allgather"), r"context_parallelism='allgather': expected one of"),
                     (dict(num_stages=2), r"'ring' does not support num_stages=2"),
                     (dict(sliding_window=4, sliding_window_pattern=2, position_embedding="rope"),
                      r"'ring' does not support sliding_window_pattern=2")):
    with pytest.raises(ValueError, match=match):
      dataclasses.replace(cfg, **bad).validate()
