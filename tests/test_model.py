"""Model behaviour: causality, document isolation, parameter count, config validation (decoding: test_decoding.py)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5x_like.model import decoder as model_lib
from t5x_like.parallel import partitioning

CFG = model_lib.GPTConfig(vocab_size=128, max_len=32, num_layers=2, num_heads=4, d_model=32, d_ff=64,
                          dtype="float32")


@pytest.fixture(scope="module")
def params():
  return partitioning.unbox(model_lib.GPT(CFG).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])


def test_future_tokens_do_not_change_past_logits(params):
  tokens = np.random.RandomState(0).randint(0, 128, (2, 16)).astype(np.int32)
  changed = tokens.copy()
  changed[:, 10:] = (changed[:, 10:] + 1) % 128
  apply = jax.jit(lambda t: model_lib.GPT(CFG).apply({"params": params}, t))
  a, b = np.asarray(apply(tokens)), np.asarray(apply(changed))
  np.testing.assert_array_equal(a[:, :10], b[:, :10])
  assert not np.allclose(a[:, 10:], b[:, 10:])


def test_packed_documents_do_not_see_each_other(params):
  rng = np.random.RandomState(1)
  doc_a, doc_b = rng.randint(0, 128, 6), rng.randint(0, 128, 10)
  packed = np.concatenate([doc_a, doc_b])[None].astype(np.int32)
  segments = np.array([[1] * 6 + [2] * 10], np.int32)
  positions = np.array([list(range(6)) + list(range(10))], np.int32)
  model = model_lib.GPT(CFG)
  packed_logits = model.apply({"params": params}, packed, positions, segments)
  alone = model.apply({"params": params}, doc_b[None].astype(np.int32))
  np.testing.assert_allclose(packed_logits[0, 6:], alone[0], rtol=1e-5, atol=1e-5)


def test_count_params_matches_initialised(params):
  assert model_lib.count_params(CFG) == sum(x.size for x in jax.tree.leaves(params))


def test_gpt2_small_has_124m_parameters():
  cfg = model_lib.GPTConfig(vocab_size=50304)  # GPT-2's 50257 pieces padded to a multiple of 128
  # embeddings 50304·768 + 1024·768, 12 blocks of 12·768² + 13·768, final LayerNorm 2·768
  expected = 50304 * 768 + 1024 * 768 + 12 * (12 * 768 * 768 + 13 * 768) + 2 * 768
  assert model_lib.count_params(cfg) == expected == 124_475_904


def test_config_validation_names_the_field():
  with pytest.raises(ValueError, match="num_heads"):
    model_lib.GPTConfig(d_model=30, num_heads=4).validate()
  with pytest.raises(ValueError, match="remat_policy"):
    model_lib.GPTConfig(remat_policy="sometimes").validate()
  with pytest.raises(ValueError, match="scan_unroll"):
    model_lib.GPTConfig(scan_unroll=-1).validate()


def _loss_and_grads(cfg, tokens):
  loss = lambda p: jnp.mean(jax.nn.log_softmax(model_lib.GPT(cfg).apply({"params": p}, tokens))[..., 0])
  return jax.jit(jax.value_and_grad(loss))


@pytest.mark.parametrize("unroll", [0, 2])
def test_unrolled_layer_scan_equals_the_rolled_loop_and_has_no_loop(params, unroll):
  """scan_unroll only changes how the layer stack is compiled: on CPU, auto (0) and 2 = every layer of CFG's 2
  unrolled (no while loop left in the step), with the rolled loop's (1) loss and gradients."""
  tokens = np.random.RandomState(2).randint(0, 128, (2, 16)).astype(np.int32)
  rolled_cfg, unrolled_cfg = dataclasses.replace(CFG, scan_unroll=1), dataclasses.replace(CFG, scan_unroll=unroll)
  assert unrolled_cfg.layer_unroll == 2 and rolled_cfg.layer_unroll == 1
  rolled_fn, unrolled_fn = _loss_and_grads(rolled_cfg, tokens), _loss_and_grads(unrolled_cfg, tokens)
  assert "while" in rolled_fn.lower(params).as_text() and "while" not in unrolled_fn.lower(params).as_text()
  (rolled_loss, rolled_grads), (loss, grads) = rolled_fn(params), unrolled_fn(params)
  np.testing.assert_allclose(loss, rolled_loss, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(rolled_grads)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
