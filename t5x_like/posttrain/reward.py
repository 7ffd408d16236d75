"""Reward model: the decoder's scalar head read at the last response token, Bradley–Terry loss on preference pairs.

A batch holds rows of whole pairs (data/preference.py), as DPO reads them: pair k of a row is segment 2k+1
(prompt + chosen) and segment 2k+2 (prompt + rejected); `weights` is 1 on the response tokens. The reward of
a segment is the score head at the position whose input is the segment's last learned token (the last
position with weight 1, plus one): the model has read the whole prompt and response, end marker included.
A scorer reads a token sequence the same way at its last token (posttrain/reward_scoring.py). Per pair:

  loss = −log σ(r_chosen − r_rejected)        (Bradley & Terry 1952; Ouyang et al. 2022)

Sums over pairs: (Σ loss, number of pairs, metrics), so the step's Σ / Σ weight is a mean per pair.
Metrics: rewards/chosen, rewards/rejected (mean rewards), rewards/margin (r_chosen − r_rejected) and
rewards/accuracy (r_chosen above r_rejected: the pairwise accuracy; a tie counts 1/2, so a fresh zero head
scores exactly 0.5).
"""

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from t5x_like.posttrain import preference
from t5x_like.training import logprobs
from t5x_like.training.objectives import language_model

FEATURES = ("inputs", "segment_ids", "positions", "weights")


def read_positions(weights: jax.Array, segment_ids: jax.Array, max_pairs: int) -> jax.Array:
  """(B, 2·max_pairs) index of the position each segment s = 1.. is read at, −1 where a row has no segment s.

  Position j is read for segment s when its input is the last token of s that carries loss weight (a weight
  on position j − 1, whose target is input j): the last such position of the segment.
  """
  length = weights.shape[1]
  learned_input = jnp.pad(weights[:, :-1] > 0, ((0, 0), (1, 0)))  # (B, L): input j was target j − 1, learned
  slots = logprobs.pair_slots(segment_ids, max_pairs, dtype=jnp.bool_)  # (B, L, 2P); segment 0 → none
  index = jnp.arange(length, dtype=jnp.int32)[None, :, None]
  return jnp.max(jnp.where(learned_input[..., None] & slots, index, -1), axis=1)  # (B, S)


def segment_rewards(scores: jax.Array, weights: jax.Array, segment_ids: jax.Array, max_pairs: int):
  """(chosen rewards, rejected rewards, pair present), each (B, max_pairs), from per-position scores (B, L)."""
  read = read_positions(weights, segment_ids, max_pairs)  # (B, 2P)
  select = (jnp.arange(scores.shape[1])[None, :, None] == read[:, None, :]).astype(jnp.float32)  # (B, L, 2P)
  rewards = jnp.einsum("bl,bls->bs", scores.astype(jnp.float32), select)
  chosen_read, rejected_read = logprobs.chosen_rejected(read >= 0)
  return (*logprobs.chosen_rejected(rewards), (chosen_read & rejected_read).astype(jnp.float32))


def bradley_terry(chosen: jax.Array, rejected: jax.Array) -> jax.Array:
  """−log σ(r_chosen − r_rejected), elementwise."""
  return -jax.nn.log_sigmoid(chosen - rejected)


@dataclasses.dataclass(frozen=True)
class Reward:
  """Bradley–Terry over pairs on the scalar head (see the module docstring).

  Attributes:
    apply_fn: the decoder's `apply` ({'params': p}, tokens, positions, segment_ids, return_hidden=True) →
      (B, L, D) final hidden states.
    score_fn: (params, hidden) → (B, L) float32 scores (model/heads.py project_scores).
    max_pairs: the most pairs a row holds (the DATA_DIR manifest's max_pairs_per_row).
    moe: the model has experts: their auxiliary losses are added as per-token means (preference.moe_pair_terms).
  """
  apply_fn: Callable
  score_fn: Callable
  max_pairs: int = 1
  moe: bool = False
  features: tuple = FEATURES

  def __post_init__(self):
    if self.max_pairs < 1:
      raise ValueError(f"max_pairs must be >= 1, got {self.max_pairs}")

  def scores(self, params, batch) -> jax.Array:
    """The score head at every position, (B, L) float32."""
    return self._scores_and_state(params, batch)[0]

  def _scores_and_state(self, params, batch):
    hidden, state = language_model.forward(self.apply_fn, params, batch, moe=self.moe, return_hidden=True)
    return self.score_fn(params, hidden), state

  def loss(self, params, batch, frozen=None):
    del frozen  # a reward model reads no frozen model
    scores, state = self._scores_and_state(params, batch)
    chosen, rejected, valid = segment_rewards(scores, batch["weights"], batch["segment_ids"], self.max_pairs)
    total = lambda x: jnp.sum(x * valid)
    metrics = {"rewards/chosen": total(chosen), "rewards/rejected": total(rejected),
               "rewards/margin": total(chosen - rejected),
               "rewards/accuracy": total(logprobs.above(chosen, rejected))}
    aux, moe_metrics = preference.moe_pair_terms(state, batch, jnp.sum(valid))
    return total(bradley_terry(chosen, rejected)) + aux, jnp.sum(valid), {**metrics, **moe_metrics}
