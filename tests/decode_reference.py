"""The cache-free greedy reference of the tests: the whole sequence is re-run for every new token."""

import functools

import jax
import jax.numpy as jnp

from t5x_like.model import decoder as model_lib


@functools.partial(jax.jit, static_argnames=("config",))
def _last_logits(params, tokens, *, config: model_lib.GPTConfig):
  return model_lib.GPT(config).apply({"params": params}, tokens)[:, -1]  # (B, V)


def generate_by_recompute(params, tokens, *, config: model_lib.GPTConfig, max_new_tokens: int):
  """(B, max_new_tokens) greedy tokens after unpadded prompts (B, P), without a cache. Compiles once per
  sequence length; the compilations are cached across calls."""
  seq = jnp.asarray(tokens)
  out = []
  for _ in range(max_new_tokens):
    nxt = jnp.argmax(_last_logits(params, seq, config=config), axis=-1).astype(jnp.int32)
    out.append(nxt)
    seq = jnp.concatenate([seq, nxt[:, None]], axis=1)
  return jnp.stack(out, axis=1)
