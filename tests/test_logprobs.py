"""training/logprobs.py against NumPy: target log-probs (also vocab-sharded), pair layout, chunked sums; path_name."""

import flax
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from t5x_like.parallel import mesh as mesh_lib
from t5x_like.training import logprobs
from t5x_like.training import trainable

B, L, V = 3, 12, 7
RNG = np.random.default_rng(0)
LOGITS = RNG.normal(size=(B, L, V)).astype(np.float32) * 3
TARGETS = RNG.integers(0, V, (B, L)).astype(np.int32)
# Two pairs per row: segments 1 (pair 0 chosen), 2 (pair 0 rejected), 3, 4; 0 = padding. Row 2 holds one pair.
SEGMENTS = np.array([[1, 1, 1, 2, 2, 3, 3, 3, 4, 4, 0, 0],
                     [1, 1, 2, 2, 2, 2, 3, 4, 4, 4, 4, 0],
                     [1, 1, 1, 1, 2, 2, 2, 0, 0, 0, 0, 0]], np.int32)


def np_token_logps(logits, targets):
  shifted = logits.astype(np.float64) - logits.max(-1, keepdims=True)
  log_softmax = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
  return np.take_along_axis(log_softmax, targets[..., None], -1)[..., 0]


def test_token_logps_is_log_softmax_at_the_target():
  got = np.asarray(logprobs.token_logps(jnp.asarray(LOGITS, jnp.bfloat16), TARGETS))
  assert got.dtype == np.float32
  np.testing.assert_allclose(got, np_token_logps(LOGITS.astype(jnp.bfloat16).astype(np.float32), TARGETS),
                             rtol=1e-5, atol=1e-5)


def test_token_logps_with_the_vocabulary_sharded_equals_one_device():
  mesh = mesh_lib.create_mesh({"data": 2, "tensor": 4})
  vocab = 8  # divisible by the tensor axis
  logits = RNG.normal(size=(4, 6, vocab)).astype(np.float32)
  targets = RNG.integers(0, vocab, (4, 6)).astype(np.int32)
  sharded = jax.device_put(logits, NamedSharding(mesh, P("data", None, "tensor")))
  got = jax.jit(logprobs.token_logps)(sharded, jax.device_put(targets, NamedSharding(mesh, P("data"))))
  np.testing.assert_allclose(np.asarray(got), np_token_logps(logits, targets), rtol=1e-5, atol=1e-6)


def test_model_token_logps_runs_the_model_on_the_batch():
  table = RNG.normal(size=(V, V)).astype(np.float32)
  apply_fn = lambda variables, inputs, positions, segment_ids: variables["params"][inputs] + positions[..., None]
  inputs, positions = RNG.integers(0, V, (B, L)), np.tile(np.arange(L), (B, 1))
  batch = {"inputs": inputs, "positions": positions, "segment_ids": SEGMENTS, "targets": TARGETS}
  got = logprobs.model_token_logps(apply_fn, table, batch)
  np.testing.assert_allclose(np.asarray(got), np_token_logps(table[inputs] + positions[..., None], TARGETS),
                             rtol=1e-5, atol=1e-5)


def test_pair_sums_add_each_pairs_chosen_and_rejected_segment():
  values = RNG.normal(size=(B, L)).astype(np.float32)
  chosen, rejected = logprobs.pair_sums(values, SEGMENTS, max_pairs=3)  # a third slot no row fills
  want = np.zeros((B, 6))
  for b in range(B):
    for s in range(1, 7):
      want[b, s - 1] = values[b][SEGMENTS[b] == s].sum()
  np.testing.assert_allclose(np.asarray(chosen), want[:, 0::2], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(rejected), want[:, 1::2], rtol=1e-6, atol=1e-6)
  assert np.asarray(chosen)[2, 1] == 0 and np.asarray(rejected)[0, 2] == 0  # absent pairs sum to 0


def test_pair_slots_layout_and_above():
  slots = np.asarray(logprobs.pair_slots(SEGMENTS, 2, dtype=jnp.bool_))  # (B, L, 4)
  assert slots.shape == (B, L, 4) and slots.dtype == np.bool_
  assert not slots[0, 10].any() and slots[0, 0, 0] and slots[0, 3, 1] and slots[0, 5, 2] and slots[0, 8, 3]
  assert np.asarray(logprobs.above(jnp.array([2.0, 1.0, 0.0]), jnp.array([1.0, 1.0, 1.0]))).tolist() == [1, 0.5, 0]


def test_chunks_round_trip_and_chunked_sums_equal_the_whole_sequence():
  x = jnp.asarray(RNG.normal(size=(B, L, 5)), jnp.float32)
  split = logprobs.chunks(x, 4)
  assert split.shape == (3, B, 4, 5)
  np.testing.assert_array_equal(np.asarray(split[1]), np.asarray(x[:, 4:8]))
  np.testing.assert_array_equal(np.asarray(logprobs.unchunk(split)), np.asarray(x))

  weights = jnp.asarray(SEGMENTS > 0, jnp.float32)
  fn = lambda lg, t, w: (-jnp.sum(logprobs.token_logps(lg, t) * w), jnp.sum(w))
  loss, weight = jax.jit(lambda lg: logprobs.chunked_sums(fn, 4, lg, TARGETS, weights))(LOGITS)
  want = -(np_token_logps(LOGITS, TARGETS) * (SEGMENTS > 0)).sum()
  np.testing.assert_allclose(float(loss), want, rtol=1e-5)
  assert float(weight) == (SEGMENTS > 0).sum()
  grad = jax.grad(lambda lg: logprobs.chunked_sums(fn, 6, lg, TARGETS, weights)[0])(LOGITS)
  np.testing.assert_allclose(np.asarray(grad), np.asarray(jax.grad(lambda lg: fn(lg, TARGETS, weights)[0])(LOGITS)),
                             rtol=1e-5, atol=1e-6)


def test_path_name_of_a_flatten_dict_key_and_of_a_jax_key_path():
  tree = {"blocks": {"attn": {"qkv": {"kernel": 1}}}, "ln_f": {"scale": 2}}
  from_keys = sorted(trainable.path_name(k) for k in flax.traverse_util.flatten_dict(tree))
  from_paths = sorted(trainable.path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0])
  assert from_keys == from_paths == ["blocks/attn/qkv/kernel", "ln_f/scale"]
