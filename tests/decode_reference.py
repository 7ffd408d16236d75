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
def _logits_at(params, tokens, at, *, config: model_lib.GPTConfig):
  """(B, V) logits at column `at` of right-padded (B, max_len) tokens."""
  logits = model_lib.GPT(config).apply({"params": params}, tokens)
  return jax.lax.dynamic_index_in_dim(logits, at, axis=1, keepdims=False)


def generate_by_recompute(params, tokens, *, config: model_lib.GPTConfig, max_new_tokens: int):
  """(B, max_new_tokens) greedy tokens after unpadded prompts (B, P), without a cache: every new token from a full
  forward pass over the prompt and the tokens so far, right-padded to max_len (a causal model's logits at a
  column depend on the tokens up to it only; an MoE model must be dropless for that), so one compile per config
  and batch size serves every length."""
  batch, length = np.shape(tokens)
  seq = np.zeros((batch, config.max_len), np.int32)
  seq[:, :length] = tokens
  for i in range(max_new_tokens):
    logits = _logits_at(params, seq, length - 1 + i, config=config)
    seq[:, length + i] = np.asarray(jnp.argmax(logits, axis=-1))
  return jnp.asarray(seq[:, length:length + max_new_tokens])


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
