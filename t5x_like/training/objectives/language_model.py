"""Language modelling: token-weighted next-token cross-entropy (pre-training, and SFT through `weights`)."""

import dataclasses
from typing import Callable, Optional

import jax
import jax.numpy as jnp

FEATURES = ("inputs", "targets", "segment_ids", "positions", "weights")


def cross_entropy_sums(logits: jax.Array, targets: jax.Array, weights: jax.Array):
  """(Σ weight·CE, Σ weight) in float32. logits: (B, L, V) float32, possibly vocab-sharded.

  The target logit is picked with a one-hot contraction, which XLA fuses and which stays a local
  reduction plus one all-reduce when the vocabulary is sharded (no gather of the logits).
  """
  logits = logits.astype(jnp.float32)
  log_z = jax.nn.logsumexp(logits, axis=-1)  # (B, L)
  target_logit = jnp.sum(logits * jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype), axis=-1)
  weights = weights.astype(jnp.float32)
  return jnp.sum((log_z - target_logit) * weights), jnp.sum(weights)


def chunked_cross_entropy_sums(logits_fn: Callable, hidden: jax.Array, targets: jax.Array,
                               weights: jax.Array, chunk: int):
  """cross_entropy_sums without the (B, L, V) float32 logits: the sequence is cut into chunks of
  `chunk` positions, each projected to logits, reduced and dropped (and recomputed in the backward
  pass), so the largest live logits block is (B, chunk, V). hidden: (B, L, D); L % chunk == 0."""
  b, length, _ = hidden.shape
  n = length // chunk
  split = lambda x: jnp.swapaxes(x.reshape((b, n, chunk) + x.shape[2:]), 0, 1)  # (n, B, chunk, ...)

  @jax.checkpoint
  def one(h, t, w):
    return cross_entropy_sums(logits_fn(h), t, w)

  def body(carry, xs):
    loss, weight = one(*xs)
    return (carry[0] + loss, carry[1] + weight), None

  zero = jnp.zeros((), jnp.float32)
  return jax.lax.scan(body, (zero, zero), (split(hidden), split(targets), split(weights)))[0]


@dataclasses.dataclass(frozen=True)
class LanguageModel:
  """Next-token cross-entropy weighted per token by `weights` (0 on padding, and on prompts for SFT).

  Attributes:
    apply_fn: the decoder's `apply` ({'params': p}, tokens, positions, segment_ids) → (B, L, V) logits.
    logits_fn: (params, hidden) → logits (decoder.project_logits), for the chunked loss.
    loss_chunk: > 0: compute the loss over chunks of this many positions (never the full f32 logits).
  """
  apply_fn: Callable
  logits_fn: Optional[Callable] = None
  loss_chunk: int = 0
  features: tuple = FEATURES

  def loss(self, params, batch, frozen=None):
    del frozen  # language modelling uses no frozen model
    args = (batch["inputs"], batch["positions"], batch["segment_ids"])
    if self.loss_chunk and self.logits_fn is not None and batch["inputs"].shape[1] > self.loss_chunk:
      hidden = self.apply_fn({"params": params}, *args, return_hidden=True)
      loss_sum, weight_sum = chunked_cross_entropy_sums(lambda h: self.logits_fn(params, h), hidden,
                                                        batch["targets"], batch["weights"], self.loss_chunk)
    else:
      loss_sum, weight_sum = cross_entropy_sums(self.apply_fn({"params": params}, *args), batch["targets"],
                                                batch["weights"])
    return loss_sum, weight_sum, {}
