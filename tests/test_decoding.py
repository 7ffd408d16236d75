"""Decoding: the decoder's KV-cache API gives the full forward logits for chunks fed in turn (left padding
included); the engine's greedy tokens are those of a cache-free recompute; top-k / top-p / temperature keep
exactly the tokens they should, per row, and sampling never leaves the kept set. (Step-by-step logits of the
engine against a recompute, continuous batching and stops: tests/test_engine.py.)

Tolerances: float32 throughout. Logits of the random model spread ≈ 0.8 per row (std ≈ 0.12); the cache
path equals the recompute within 1e-6 (measured ≤ 1e-7: the same ops over a different key count), while
an off-by-one decode position moves them by 0.48 and an attended padding slot by 0.24 (measured).
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5x_like.inference import sampling
from t5x_like.inference.engine import Engine
from t5x_like.inference.sampling import SamplingParams
from t5x_like.model import decoder as model_lib
from t5x_like.parallel import mesh as mesh_lib
from t5x_like.parallel import partitioning
from tests.decode_reference import generate_by_recompute

CFG = model_lib.GPTConfig(vocab_size=128, max_len=32, num_layers=2, num_heads=4, d_model=32, d_ff=64,
                          dtype="float32")
LOGITS_ATOL = 1e-6


@pytest.fixture(scope="module")
def params():
  return partitioning.unbox(model_lib.GPT(CFG).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])


@pytest.fixture(scope="module")
def engine(params):
  mesh = mesh_lib.create_mesh({"data": 1}, devices=jax.devices()[:1])
  return Engine(CFG, params, mesh, partitioning.DEFAULT_RULES, slots=2)


@pytest.fixture(scope="module")
def full_logits(params):
  """Logits (T, V) of a full forward pass over unpadded tokens, without a cache. The tokens are
  right-padded to max_len so that one compilation serves every length: a causal model's logits at
  position i depend on tokens ≤ i only (tests/test_model.py)."""
  apply = jax.jit(lambda t: model_lib.GPT(CFG).apply({"params": params}, t))

  def logits(tokens):
    padded = np.zeros((1, CFG.max_len), np.int32)
    padded[0, :len(tokens)] = tokens
    return np.asarray(apply(padded))[0, :len(tokens)]
  return logits


def test_decoder_cache_chunks_give_the_full_forward_logits(params, full_logits):
  """The decoder's `cache=` path fed a left-padded chunk (2 padding slots + 4 tokens), then chunks of 3
  and 1 tokens: every position's logits equal the full forward pass over the unpadded tokens."""
  apply = jax.jit(model_lib.GPT(CFG).apply)
  seq = np.random.RandomState(4).randint(4, 128, 8).astype(np.int32)
  pad = 2
  cache = model_lib.init_cache(CFG, 1, pad + len(seq))
  chunks = [(0, np.concatenate([np.zeros(pad, np.int32), seq[:4]]), np.array([0, 0, 0, 1, 2, 3], np.int32),
             np.array([0, 0, 1, 1, 1, 1], np.int32)),
            (pad + 4, seq[4:7], np.arange(4, 7, dtype=np.int32), np.ones(3, np.int32)),
            (pad + 7, seq[7:], np.array([7], np.int32), np.ones(1, np.int32))]
  cached = []
  for index, chunk, positions, segment_ids in chunks:
    logits, cache = apply({"params": params}, chunk[None], positions[None], segment_ids[None], cache, index)
    cached.append(np.asarray(logits)[0])
  cached[0] = cached[0][pad:]  # logits at padding slots are never used
  np.testing.assert_allclose(np.concatenate(cached), full_logits(seq.tolist()), rtol=0, atol=LOGITS_ATOL)


def test_greedy_tokens_are_those_of_a_cache_free_recompute(params, engine):
  rng = np.random.RandomState(2)
  prompts = [list(rng.randint(4, 128, 5)), list(rng.randint(4, 128, 2))]
  out = engine.generate(prompts, SamplingParams(max_tokens=6))
  for prompt, [c] in zip(prompts, out):
    want = np.asarray(generate_by_recompute(params, np.array([prompt]), config=CFG, max_new_tokens=6))[0]
    np.testing.assert_array_equal(c.tokens, want)


def test_top_k_one_is_greedy(engine):
  prompt = [9, 10, 11]
  [[greedy]] = engine.generate([prompt], SamplingParams(max_tokens=5))
  [[sampled]] = engine.generate([prompt], SamplingParams(max_tokens=5, temperature=1.3, top_k=1, seed=7))
  assert greedy.tokens == sampled.tokens


# Filtering and sampling on hand-made (B, V) logits.

def random_logits(batch: int = 4, vocab: int = 16, seed: int = 0) -> np.ndarray:
  return np.random.RandomState(seed).normal(0, 2, (batch, vocab)).astype(np.float32)


def kept(filtered) -> list:
  """Per row, the set of token ids `filter_logits` left unmasked."""
  filtered = np.asarray(filtered)
  return [set(np.flatnonzero(row > np.finfo(np.float32).min).tolist()) for row in filtered]


def top_k_only(logits: np.ndarray, k: int) -> np.ndarray:
  """The logits with all but each row's k largest set to -inf (numpy)."""
  top = np.argsort(-logits, axis=-1)[:, :k]
  masked = np.full_like(logits, -np.inf)
  np.put_along_axis(masked, top, np.take_along_axis(logits, top, axis=-1), axis=-1)
  return masked


def nucleus(logits: np.ndarray, p: float) -> list:
  """Per row, the smallest set of most probable tokens whose probability reaches p (numpy, float64)."""
  out = []
  for row in logits.astype(np.float64):
    probs = np.exp(row - row.max())
    probs /= probs.sum()
    order = np.argsort(-probs)
    n = int(np.searchsorted(np.cumsum(probs[order]), p)) + 1  # first prefix with mass ≥ p
    # at p = 1 the prefix sums may end a rounding error below 1; tokens of probability 0 are never needed
    n = min(n, int(np.count_nonzero(probs)))
    out.append(set(order[:n].tolist()))
  return out


@pytest.mark.parametrize("k", [1, 3, 15])
def test_top_k_keeps_exactly_the_k_largest_unchanged(k):
  logits = random_logits()
  filtered = np.asarray(sampling.filter_logits(jnp.asarray(logits), top_k=k))
  assert kept(filtered) == [set(np.flatnonzero(np.isfinite(row)).tolist()) for row in top_k_only(logits, k)]
  survivors = filtered > np.finfo(np.float32).min
  np.testing.assert_array_equal(filtered[survivors], logits[survivors])


@pytest.mark.parametrize("p", [0.05, 0.3, 0.6, 0.9, 0.99])
def test_top_p_keeps_the_smallest_set_reaching_p(p):
  logits = random_logits(batch=8)
  sets = kept(sampling.filter_logits(jnp.asarray(logits), top_p=p))
  assert sets == nucleus(logits, p)


def test_top_p_applies_to_the_top_k_distribution():
  """top-k first, then the nucleus of the renormalised top-k distribution (the order HF's warpers use)."""
  logits = random_logits(batch=8)
  assert kept(sampling.filter_logits(jnp.asarray(logits), top_k=3, top_p=0.7)) == nucleus(top_k_only(logits, 3), 0.7)


def test_no_filter_keeps_every_token():
  logits = random_logits()
  np.testing.assert_array_equal(np.asarray(sampling.filter_logits(jnp.asarray(logits), top_k=0, top_p=1.0)), logits)


def sample_many(logits, temperature, top_k=0, top_p=1.0, seeds=2000) -> np.ndarray:
  """(seeds, B) tokens drawn by `choose`, one PRNG key per draw."""
  draw = jax.jit(jax.vmap(lambda key: sampling.choose(jnp.asarray(logits), key, temperature, top_k, top_p)))
  return np.asarray(draw(jax.random.split(jax.random.key(1), seeds)))


def test_temperature_zero_and_near_zero_are_greedy():
  logits = random_logits()
  greedy = logits.argmax(-1)
  assert (np.diff(np.sort(logits, -1)[:, -2:], axis=-1) > 1e-2).all()  # 1e-4 sharpens every top gap ≫ 1
  np.testing.assert_array_equal(np.asarray(sampling.choose(jnp.asarray(logits), jax.random.key(0), 0.0, 0, 1.0)),
                                greedy)
  assert (sample_many(logits, 1e-4, seeds=200) == greedy).all()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 4, 1.0), (1.0, 0, 0.6), (2.0, 5, 0.8),
                                                     (0.5, 0, 0.9)])
def test_samples_stay_in_the_kept_set_with_its_tempered_probabilities(temperature, top_k, top_p):
  """Over 2000 draws per row: no token outside the kept set (top-k, then the nucleus of the tempered
  top-k distribution), and each kept token drawn with its renormalised tempered probability within 5
  standard errors (a kept token of probability 0.2 dropped, or untempered, is off by > 10)."""
  logits = random_logits()
  draws = sample_many(logits, temperature, top_k, top_p)
  keep = nucleus(top_k_only(logits, top_k or logits.shape[-1]) / temperature, top_p)
  for row in range(logits.shape[0]):
    counts = collections.Counter(draws[:, row].tolist())
    assert set(counts) <= keep[row], (row, sorted(counts), sorted(keep[row]))
    ids = np.array(sorted(keep[row]))
    probs = np.exp((logits[row, ids] - logits[row, ids].max()) / temperature)
    probs /= probs.sum()
    freq = np.array([counts[i] for i in ids]) / len(draws)
    stderr = np.sqrt(probs * (1 - probs) / len(draws))
    assert (np.abs(freq - probs) <= 5 * stderr).all(), (row, freq, probs)


def test_left_pad_right_aligns_prompts_to_the_longest_or_a_wider_run_width():
  """One width for every batch of a run (chat evaluation, GRPO rollouts) keeps one compiled program."""
  tokens, segments = sampling.left_pad([[5, 6], [7]], pad_id=9)
  np.testing.assert_array_equal(tokens, [[5, 6], [9, 7]])
  np.testing.assert_array_equal(segments, [[1, 1], [0, 1]])
  tokens, segments = sampling.left_pad([[5, 6], [7]], pad_id=9, width=4)
  np.testing.assert_array_equal(tokens, [[9, 9, 5, 6], [9, 9, 9, 7]])
  np.testing.assert_array_equal(segments, [[0, 0, 1, 1], [0, 0, 0, 1]])
  assert sampling.left_pad([[1, 2, 3]], width=2)[0].shape == (1, 3)  # never narrower than the longest prompt


def test_filters_apply_per_row():
  """One batch, each row its own top-k / top-p / temperature: each row keeps what it keeps alone."""
  logits = random_logits(batch=4)
  top_k, top_p = np.array([0, 3, 1, 5]), np.array([0.6, 1.0, 1.0, 0.8], np.float32)
  together = kept(sampling.filter_logits(jnp.asarray(logits), top_k=top_k, top_p=top_p))
  for row in range(4):
    assert together[row] == kept(sampling.filter_logits(jnp.asarray(logits[row:row + 1]), int(top_k[row]),
                                                        float(top_p[row])))[0]
  temperature = np.array([0.0, 1.0, 0.0, 2.0], np.float32)
  keys = jax.random.split(jax.random.key(0), 4)
  drawn = np.asarray(sampling.choose(jnp.asarray(logits), keys, temperature, top_k, top_p))
  assert drawn[0] == logits[0].argmax() and drawn[2] == logits[2].argmax() and drawn[1] in together[1]


def test_one_row_that_filters_or_samples_is_treated_as_alone():
  """filter_logits skips its sort, and choose its draw, only when no row of the batch needs them: one row that
  asks among rows that do not is filtered (top-k, top-p) and drawn from exactly as it is alone."""
  logits = random_logits(batch=4)
  for top_k, top_p in (([0, 0, 2, 0], [1.0] * 4), ([0] * 4, [1.0, 0.5, 1.0, 1.0])):
    together = kept(sampling.filter_logits(jnp.asarray(logits), top_k=np.array(top_k),
                                           top_p=np.array(top_p, np.float32)))
    row = next(r for r in range(4) if top_k[r] or top_p[r] < 1)
    assert together[row] == kept(sampling.filter_logits(jnp.asarray(logits[row:row + 1]), top_k[row], top_p[row]))[0]
    assert len(together[row]) < logits.shape[1]
    assert all(len(together[r]) == logits.shape[1] for r in range(4) if r != row)
  flat = np.zeros_like(logits)
  flat[:, 0] = 1e-3  # argmax 0; a draw is nearly uniform over the 16 tokens
  temperature = np.array([0.0, 0.0, 0.0, 1.0], np.float32)
  keys = jax.random.split(jax.random.key(1), 4)
  drawn = np.asarray(sampling.choose(jnp.asarray(flat), keys, temperature))
  alone = np.asarray(sampling.choose(jnp.asarray(flat[3:]), keys[3:], temperature[3:]))
  assert drawn.tolist()[:3] == [0, 0, 0] and drawn[3] == alone[0] != 0, (drawn, alone)
