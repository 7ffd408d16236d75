"""Decoding helpers of the tests: the cache-free greedy reference (the whole sequence re-run for every new token)
and the engine's tokens as one array."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from t5x_like.inference.engine import Engine
from t5x_like.inference.sampling import SamplingParams
from t5x_like.model import decoder as model_lib
from t5x_like.parallel import mesh as mesh_lib
from t5x_like.parallel import partitioning


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


def engine_tokens(config: model_lib.GPTConfig, params, prompts, max_new_tokens: int, *, mesh=None,
                  rules=partitioning.DEFAULT_RULES, pad_id: int = 0, **sampling) -> np.ndarray:
  """(B, max_new_tokens) tokens the inference engine continues each prompt (token lists) with, one slot per
  prompt, on `mesh` (default: one device); a row that stopped early is filled with `pad_id`."""
  mesh = mesh or mesh_lib.create_mesh({"data": 1}, devices=jax.devices()[:1])
  engine = Engine(config, params, mesh, rules, slots=len(prompts), pad_id=pad_id)
  out = engine.generate([list(map(int, p)) for p in prompts], SamplingParams(max_tokens=max_new_tokens, **sampling))
  rows = np.full((len(prompts), max_new_tokens), pad_id, np.int32)
  for row, [c] in zip(rows, out):
    row[:len(c.tokens)] = c.tokens
  return rows
