"""Log-prob helpers every objective shares: target-token log-probs, the chosen/rejected pair layout, chunked sums.

Language modelling (training/objectives/language_model.py) and the post-training objectives (posttrain/: preference,
reward, GRPO, distillation) read them from here, so each formula is written once:

  token_logps        log softmax(logits)[target] per position; the cross-entropy is its negative
  model_token_logps  the same from a model's forward pass on a batch (a policy, a reference)
  pair_slots         a preference row's layout: pair k is segment 2k + 1 (prompt + chosen) and 2k + 2 (rejected)
  pair_sums          Σ of per-position values over each pair's chosen and rejected segment
  chunked_sums       Σ of a loss over sequence chunks (never the full (B, L, V) logits)
  chunked_pair_sums  pair_sums of weighted target log-probs, projected to logits one chunk at a time
"""

from typing import Callable

import jax
import jax.numpy as jnp


def token_logps(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """log softmax(logits)[target] per position, float32 (B, L), from logits (B, L, V), possibly vocab-sharded.

  The target logit is picked with a one-hot contraction, which XLA fuses and which stays a local reduction
  plus one all-reduce when the vocabulary is sharded (no gather of the logits).
  """
  logits = logits.astype(jnp.float32)
  log_z = jax.nn.logsumexp(logits, axis=-1)  # (B, L)
  target_logit = jnp.sum(logits * jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype), axis=-1)  # (B, L)
  return target_logit - log_z


def model_token_logps(apply_fn: Callable, params, batch) -> jax.Array:
  """log π(target) per position, float32 (B, L), of the model `apply_fn` ({'params': p}, tokens, positions,
  segment_ids) → (B, L, V) logits, on a batch's inputs and targets."""
  logits = apply_fn({"params": params}, batch["inputs"], batch["positions"], batch["segment_ids"])
  return token_logps(logits, batch["targets"])


def pair_slots(segment_ids: jax.Array, max_pairs: int, dtype=jnp.float32) -> jax.Array:
  """(B, L, 2P) one-hot of each position's slot in a row of preference pairs (data/preference.py).

  Segment s > 0 is slot s − 1: slot 2k is pair k's chosen segment, slot 2k + 1 its rejected one; segment 0
  (padding) is in no slot.
  """
  return jax.nn.one_hot(segment_ids - 1, 2 * max_pairs, dtype=dtype)


def chosen_rejected(per_slot: jax.Array):
  """(chosen, rejected), each (B, P), of per-slot values (B, 2P)."""
  return per_slot[:, 0::2], per_slot[:, 1::2]


def pair_sums(values: jax.Array, segment_ids: jax.Array, max_pairs: int):
  """Σ of `values` (B, L) over each row's chosen and rejected segments: two (B, max_pairs) float32 arrays."""
  sums = jnp.einsum("bl,bls->bs", values.astype(jnp.float32), pair_slots(segment_ids, max_pairs))  # (B, 2P)
  return chosen_rejected(sums)


def above(a: jax.Array, b: jax.Array) -> jax.Array:
  """1 where a > b, 1/2 where equal, 0 below: a pair's accuracy, a tie counted half."""
  return jnp.where(a > b, 1.0, jnp.where(a == b, 0.5, 0.0))


def chunks(x: jax.Array, chunk: int) -> jax.Array:
  """(B, L, ...) → (L / chunk, B, chunk, ...): sequence chunks along a leading scan axis; L % chunk == 0."""
  b, length = x.shape[:2]
  return jnp.swapaxes(x.reshape((b, length // chunk, chunk) + x.shape[2:]), 0, 1)


def unchunk(x: jax.Array) -> jax.Array:
  """The inverse of `chunks`: (n, B, chunk, ...) → (B, n·chunk, ...)."""
  n, b, chunk = x.shape[:3]
  return jnp.swapaxes(x, 0, 1).reshape((b, n * chunk) + x.shape[3:])


def chunked_sums(fn: Callable, chunk: int, *arrays: jax.Array) -> tuple:
  """Σ over sequence chunks of fn(*chunks of `arrays`), a tuple of float32 scalars, accumulated by a scan.

  Args:
    fn: (each array's (B, chunk, ...) slice) → a tuple of scalars; only one chunk's intermediates (its logits)
      are live at a time.
    arrays: (B, L, ...) each, L % chunk == 0.
  """
  xs = tuple(chunks(x, chunk) for x in arrays)
  shapes = jax.eval_shape(fn, *(x[0] for x in xs))
  init = tuple(jnp.zeros(s.shape, s.dtype) for s in shapes)

  def body(carry, chunk_xs):
    return tuple(c + s for c, s in zip(carry, fn(*chunk_xs))), None

  return jax.lax.scan(body, init, xs)[0]


def chunked_pair_sums(logits_fn: Callable, head: dict, hidden: jax.Array, batch: dict, max_pairs: int,
                      chunk: int):
  """pair_sums of weight · log softmax(logits_fn(head, hidden))[target], one sequence chunk at a time.

  Only one chunk's (B, chunk, V) logits are live: the forward pass accumulates each chunk's per-slot sums, and
  under differentiation each chunk's logits are recomputed from its hidden states in the backward pass
  (jax.checkpoint) instead of being stored for every chunk.

  Args:
    logits_fn: (head, hidden (B, c, D)) → (B, c, V) logits (decoder.project_logits).
    head: the parameters logits_fn reads; gradients flow to it and to `hidden`.
    hidden: (B, L, D) final hidden states; L % chunk == 0.
    batch: its targets, weights and segment_ids (B, L).
  Returns:
    (chosen, rejected), each (B, max_pairs) float32, as pair_sums.
  """

  @jax.checkpoint
  def per_slot(h, targets, weights, segment_ids):
    values = token_logps(logits_fn(head, h), targets) * weights
    return (jnp.einsum("bl,bls->bs", values, pair_slots(segment_ids, max_pairs)),)

  (sums,) = chunked_sums(per_slot, chunk, hidden, batch["targets"], batch["weights"].astype(jnp.float32),
                         batch["segment_ids"])
  return chosen_rejected(sums)
