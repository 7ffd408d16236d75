"""Sampling: left padding of ragged prompts, top-k / top-p filtering and the choice of the next token, with
settings per row (one compiled program serves requests of different temperatures and filters)."""

import dataclasses
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How one request is continued.

  max_tokens: new tokens at most. temperature: 0 = greedy, else the softmax temperature. top_k: sample among
  the k most likely tokens (0 = all). top_p: then among the smallest set holding this much of the tempered
  top-k probability (1 = all). stop_token_ids: a sequence ends after emitting one of these (it is kept in its
  tokens). stop: strings; the sequence ends once its decoded text holds one, its text is cut before it and its
  tokens after the token that completed it. seed: this request's sampling seed (None: the engine picks one).
  """
  max_tokens: int = 16
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  stop_token_ids: tuple = ()
  stop: tuple = ()
  seed: Optional[int] = None

  def __post_init__(self):
    object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
    object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
    if self.max_tokens < 1:
      raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
    if self.temperature < 0:
      raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
    if self.top_k < 0:
      raise ValueError(f"SamplingParams.top_k must be >= 0, got {self.top_k}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
    if any(not s for s in self.stop):
      raise ValueError(f"SamplingParams.stop holds an empty string: {self.stop!r}")


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int = 0, width: int = 1) -> tuple:
  """Token lists → (tokens (B, P) left-padded, segment_ids (B, P): 1 on prompt tokens, 0 on padding), with P the
  longest prompt or `width` if wider (one shape for several batches: one compiled program)."""
  width = max(width, max(len(p) for p in prompts))
  tokens = np.full((len(prompts), width), pad_id, np.int32)
  segments = np.zeros((len(prompts), width), np.int32)
  for row, prompt in enumerate(prompts):
    if len(prompt):
      tokens[row, width - len(prompt):] = prompt
      segments[row, width - len(prompt):] = 1
  return tokens, segments


def _per_row(value, rows: int, dtype) -> jax.Array:
  return jnp.broadcast_to(jnp.asarray(value, dtype), (rows,))


def filter_logits(logits: jax.Array, top_k=0, top_p=1.0) -> jax.Array:
  """Masks (B, V) logits outside each row's top-k, then outside the smallest set of the remaining (renormalised)
  distribution with probability ≥ top_p. `top_k` (0 = off) and `top_p` (1 = off): scalars or (B,) per row."""
  rows, vocab = logits.shape
  top_k, top_p = _per_row(top_k, rows, jnp.int32), _per_row(top_p, rows, jnp.float32)
  k = jnp.where((top_k <= 0) | (top_k > vocab), vocab, top_k)  # (B,)
  # a row with both filters off keeps every logit: when no row filters (plain sampling, greedy), the sort of the
  # whole vocabulary, most of a small model's decode step, is skipped
  filters = jnp.any((k < vocab) | (top_p < 1.0))
  return jax.lax.cond(filters, _filter, lambda logits, k, top_p: logits, logits, k, top_p)


def _filter(logits: jax.Array, k: jax.Array, top_p: jax.Array) -> jax.Array:
  vocab = logits.shape[1]
  neg = jnp.finfo(logits.dtype).min
  ranked = jnp.sort(logits, axis=-1)[:, ::-1]  # (B, V) descending
  kth = jnp.take_along_axis(ranked, (k - 1)[:, None], axis=1)  # (B, 1)
  logits = jnp.where(logits < kth, neg, logits)
  ranked = jnp.where(jnp.arange(vocab)[None] < k[:, None], ranked, neg)
  probs = jax.nn.softmax(ranked, axis=-1)
  before = jnp.cumsum(probs, axis=-1) - probs  # the mass of the more likely tokens; the top one always stays
  keep = (before < top_p[:, None]) | (top_p[:, None] >= 1.0)
  threshold = jnp.min(jnp.where(keep, ranked, jnp.inf), axis=-1, keepdims=True)  # (B, 1)
  return jnp.where(logits < threshold, neg, logits)


def choose(logits: jax.Array, rng, temperature=0.0, top_k=0, top_p=1.0) -> jax.Array:
  """The next token of each row, (B, V) → (B,) int32: the argmax where temperature == 0, else a draw from the
  filtered, tempered distribution. `rng`: one key for the batch, or (B,) keys (one per row); the settings:
  scalars or (B,) per row."""
  rows = logits.shape[0]
  temperature = _per_row(temperature, rows, jnp.float32)
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  hot = temperature > 0

  def draw(logits):
    filtered = filter_logits(logits / jnp.where(hot, temperature, 1.0)[:, None], top_k, top_p)
    if jnp.ndim(rng) == 0:
      return jax.random.categorical(rng, filtered, axis=-1).astype(jnp.int32)
    return jax.vmap(lambda key, row: jax.random.categorical(key, row))(rng, filtered).astype(jnp.int32)

  # all rows greedy (evaluation, greedy decoding): nothing is tempered, filtered or drawn
  drawn = jax.lax.cond(jnp.any(hot), draw, lambda logits: greedy, logits)
  return jnp.where(hot, drawn, greedy)


def token_logprobs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
  """log_softmax of the raw float32 logits (B, V) at each row's token (B,): the number the trainer's forward
  computes for that token (not the tempered or filtered distribution's)."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return jnp.take_along_axis(logp, tokens[:, None], axis=1)[:, 0]
