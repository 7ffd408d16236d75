"""Autoregressive generation with a KV cache: prefill the prompt once, then one position per new token."""

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from t5x_like.model import decoder as model_lib


def left_pad(prompts: list, pad_id: int = 0, width: int = 1) -> tuple:
  """Token lists → (tokens (B, P) left-padded, segment_ids (B, P): 1 on prompt tokens, 0 on padding), with P the
  longest prompt or `width` if wider (one shape for several batches: one compiled program)."""
  width = max(width, max(len(p) for p in prompts))
  tokens = np.full((len(prompts), width), pad_id, np.int32)
  segments = np.zeros((len(prompts), width), np.int32)
  for row, prompt in enumerate(prompts):
    if prompt:
      tokens[row, width - len(prompt):] = prompt
      segments[row, width - len(prompt):] = 1
  return tokens, segments


def filter_logits(logits: jax.Array, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
  """Masks (B, V) logits outside the top-k and outside the smallest set with probability ≥ top_p."""
  neg = jnp.finfo(logits.dtype).min
  if top_k and top_k < logits.shape[-1]:
    kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
    logits = jnp.where(logits < kth, neg, logits)
  if top_p < 1.0:
    sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
    cumulative = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
    # keep every token whose preceding mass is < top_p (the top one is always kept)
    keep_sorted = (cumulative - jax.nn.softmax(sorted_logits, axis=-1)) < top_p
    threshold = jnp.min(jnp.where(keep_sorted, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits < threshold, neg, logits)
  return logits


def choose(logits: jax.Array, rng, temperature: float, top_k: int, top_p: float) -> jax.Array:
  """Greedy when temperature == 0, else a sample from the filtered, tempered distribution. (B, V) → (B,)."""
  if temperature <= 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = filter_logits(logits / temperature, top_k, top_p)
  return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("config", "max_new_tokens", "temperature", "top_k", "top_p",
                                             "eos_id", "pad_id"))
def generate(params, tokens, segment_ids, rng, *, config: model_lib.GPTConfig, max_new_tokens: int,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, eos_id: Optional[int] = None,
             pad_id: int = 0):
  """Continues left-padded prompts with a KV cache.

  Args:
    params: model parameters.
    tokens: (B, P) int32 left-padded prompts; segment_ids (B, P): 1 on prompt tokens, 0 on padding.
    rng: PRNG key for sampling.

  Returns:
    (B, max_new_tokens) int32 new tokens; after a row emits `eos_id`, the rest of the row is `pad_id`.
  """
  model = model_lib.GPT(config)
  batch, prompt_len = tokens.shape
  cache = model_lib.init_cache(config, batch, prompt_len + max_new_tokens)
  positions = jnp.maximum(jnp.cumsum(segment_ids, axis=1) - 1, 0).astype(jnp.int32)
  logits, cache = model.apply({"params": params}, tokens, positions, segment_ids, cache, 0)
  next_pos = positions[:, -1] + 1
  rng, sub = jax.random.split(rng)
  first = choose(logits[:, -1], sub, temperature, top_k, top_p)
  done = jnp.zeros((batch,), jnp.bool_)

  def step(carry, index):
    token, pos, cache, done, rng = carry
    emitted = jnp.where(done, pad_id, token)  # the EOS itself is emitted; what follows it is padding
    if eos_id is not None:
      done = done | (token == eos_id)
    logits, cache = model.apply({"params": params}, token[:, None], pos[:, None],
                                jnp.ones((batch, 1), jnp.int32), cache, prompt_len + index)
    rng, sub = jax.random.split(rng)
    nxt = choose(logits[:, -1], sub, temperature, top_k, top_p)
    return (nxt, pos + 1, cache, done, rng), emitted

  _, out = jax.lax.scan(step, (first, next_pos, cache, done, rng), jnp.arange(max_new_tokens))
  return out.T  # (B, max_new_tokens)


@functools.partial(jax.jit, static_argnames=("config",))
def _last_logits(params, tokens, *, config: model_lib.GPTConfig):
  return model_lib.GPT(config).apply({"params": params}, tokens)[:, -1]  # (B, V)


def generate_by_recompute(params, tokens, *, config: model_lib.GPTConfig, max_new_tokens: int):
  """Greedy reference without a cache: the whole sequence is re-run for every new token (for tests/bench).

  Compiles once per sequence length; the compilations are cached across calls."""
  seq = jnp.asarray(tokens)
  out = []
  for _ in range(max_new_tokens):
    nxt = jnp.argmax(_last_logits(params, seq, config=config), axis=-1).astype(jnp.int32)
    out.append(nxt)
    seq = jnp.concatenate([seq, nxt[:, None]], axis=1)
  return jnp.stack(out, axis=1)
