"""Model behaviour: causality, document isolation, parameter count, KV-cache decoding equals recompute."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5x_like.model import decoder as model_lib
from t5x_like.parallel import partitioning
from t5x_like.model import decoding as sampling

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


def test_kv_cache_greedy_equals_full_recompute(params):
  prompts = np.random.RandomState(2).randint(4, 128, (3, 5)).astype(np.int32)
  cached = sampling.generate(params, prompts, np.ones_like(prompts), jax.random.key(0), config=CFG,
                             max_new_tokens=12)
  reference = sampling.generate_by_recompute(params, prompts, config=CFG, max_new_tokens=12)
  np.testing.assert_array_equal(np.asarray(cached), np.asarray(reference))


def test_left_padded_batch_decodes_like_each_prompt_alone(params):
  rng = np.random.RandomState(3)
  prompts = [list(rng.randint(4, 128, 7)), list(rng.randint(4, 128, 3))]
  tokens, segments = sampling.left_pad(prompts)
  batched = np.asarray(sampling.generate(params, tokens, segments, jax.random.key(0), config=CFG,
                                         max_new_tokens=8))
  for row, prompt in enumerate(prompts):
    alone = sampling.generate_by_recompute(params, np.array([prompt], np.int32), config=CFG, max_new_tokens=8)
    np.testing.assert_array_equal(batched[row], np.asarray(alone)[0])


def test_eos_stops_a_row():
  # greedy run, then ask it to stop at its own first generated token
  p = partitioning.unbox(model_lib.GPT(CFG).init(jax.random.key(5), jnp.zeros((1, 4), jnp.int32))["params"])
  prompt = np.array([[5, 6, 7]], np.int32)
  free = np.asarray(sampling.generate(p, prompt, np.ones_like(prompt), jax.random.key(0), config=CFG,
                                      max_new_tokens=6))
  stopped = np.asarray(sampling.generate(p, prompt, np.ones_like(prompt), jax.random.key(0), config=CFG,
                                         max_new_tokens=6, eos_id=int(free[0, 0]), pad_id=0))
  assert stopped[0, 0] == free[0, 0] and (stopped[0, 1:] == 0).all(), (free, stopped)


def test_top_k_one_is_greedy(params):
  prompt = np.array([[9, 10, 11]], np.int32)
  greedy = sampling.generate(params, prompt, np.ones_like(prompt), jax.random.key(0), config=CFG, max_new_tokens=5)
  sampled = sampling.generate(params, prompt, np.ones_like(prompt), jax.random.key(7), config=CFG,
                              max_new_tokens=5, temperature=1.3, top_k=1)
  np.testing.assert_array_equal(np.asarray(greedy), np.asarray(sampled))


def test_config_validation_names_the_field():
  with pytest.raises(ValueError, match="num_heads"):
    model_lib.GPTConfig(d_model=30, num_heads=4).validate()
  with pytest.raises(ValueError, match="remat_policy"):
    model_lib.GPTConfig(remat_policy="sometimes").validate()
