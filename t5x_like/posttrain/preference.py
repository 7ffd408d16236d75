"""Direct preference optimisation over a preference DATA_DIR: DPO (sigmoid), IPO, and reference-free SimPO.

A batch holds rows of whole pairs (data/preference.py): pair k of a row is segment 2k+1 (prompt + chosen)
and segment 2k+2 (prompt + rejected); `weights` is 1 on the response tokens. Per pair, with log π(y|x) the
sum of the policy's token log-probabilities over the response tokens, and π_ref the frozen reference's:

  h = log π(y_c|x) − log π_ref(y_c|x) − (log π(y_r|x) − log π_ref(y_r|x))
  sigmoid (DPO, Rafailov et al. 2023):  −log σ(β·h)
  ipo (Azar et al. 2023):                (h − 1/(2β))²
  simpo (Meng et al. 2024):              −log σ(β·(log π(y_c|x)/|y_c| − log π(y_r|x)/|y_r|) − γ)   (no reference)

Sums over pairs: (Σ loss, number of pairs, metrics), so the step's Σ / Σ weight is a mean per pair.
Metrics: rewards/chosen and rewards/rejected (β·(log π − log π_ref); SimPO: β·log π/|y|), rewards/margin,
rewards/accuracy (the chosen reward above the rejected; a tie counts 1/2, so a policy equal to its
reference scores exactly 0.5), logps/chosen, logps/rejected (the policy's summed log-probs) and
logps/accuracy (the policy alone gives the chosen response the higher log-probability; ties 1/2).
"""

import dataclasses
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from t5x_like.training import logprobs
from t5x_like.training.objectives import language_model

REFERENCE = "reference"  # the frozen reference model's key in `frozen`
LOSS_TYPES = ("sigmoid", "ipo", "simpo")
REFERENCE_FREE = ("simpo",)


def sequence_logps(apply_fn: Callable, params, batch, max_pairs: int, logits_fn: Optional[Callable] = None,
                   loss_chunk: int = 0, moe: bool = False):
  """((Σ log π over chosen responses, over rejected ones), each (B, max_pairs); the forward pass's state, which
  holds the MoE statistics it sowed with `moe`, else {}). With `loss_chunk` (and the model's `logits_fn`), the
  hidden states are projected to logits one chunk of positions at a time (never the full (B, L, V) logits;
  logprobs.chunked_pair_sums)."""
  if loss_chunk and logits_fn is not None and batch["inputs"].shape[1] > loss_chunk:
    hidden, state = language_model.forward(apply_fn, params, batch, moe=moe, return_hidden=True)
    return logprobs.chunked_pair_sums(logits_fn, language_model.head_params(params), hidden, batch, max_pairs,
                                      loss_chunk), state
  logits, state = language_model.forward(apply_fn, params, batch, moe=moe)
  weighted = logprobs.token_logps(logits, batch["targets"]) * batch["weights"].astype(jnp.float32)
  return logprobs.pair_sums(weighted, batch["segment_ids"], max_pairs), state


def moe_pair_terms(state: dict, batch, pairs: jax.Array):
  """(auxiliary loss, metrics) of an MoE policy's forward pass for an objective normalised per pair: the
  load-balancing and router z-losses averaged over every non-padding token of the rows (prompts included: the
  router saw them), times the number of pairs. (0, {}) for a dense model."""
  tokens = (batch["segment_ids"] > 0).astype(jnp.float32)
  return language_model.moe_terms(state, tokens, jnp.sum(tokens), units=pairs)


def pair_losses(loss_type: str, beta: float, gamma: float, policy, reference, lengths):
  """(per-pair loss, chosen reward, rejected reward), each (B, P), from summed log-probs.

  policy, reference: (chosen, rejected) summed log-probs; lengths: (chosen, rejected) response token counts.
  """
  (pc, pr), (lc, lr) = policy, lengths
  if loss_type == "simpo":
    rc, rr = beta * pc / jnp.maximum(lc, 1.0), beta * pr / jnp.maximum(lr, 1.0)
    return -jax.nn.log_sigmoid(rc - rr - gamma), rc, rr
  qc, qr = pc - reference[0], pr - reference[1]
  rc, rr = beta * qc, beta * qr
  if loss_type == "sigmoid":
    return -jax.nn.log_sigmoid(rc - rr), rc, rr
  if loss_type == "ipo":
    return jnp.square(qc - qr - 1.0 / (2.0 * beta)), rc, rr
  raise ValueError(f"preference loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")


@dataclasses.dataclass(frozen=True)
class Preference:
  """DPO / IPO / SimPO on pairs (see the module docstring).

  Attributes:
    apply_fn: the decoder's `apply` ({'params': p}, tokens, positions, segment_ids) → (B, L, V) logits.
    loss_type: 'sigmoid' (DPO), 'ipo' or 'simpo' (reference-free: `frozen` needs no REFERENCE).
    beta: β, the strength of the implicit KL to the reference (SimPO: the reward scale).
    gamma: SimPO's target reward margin γ (unused by the others).
    max_pairs: the most pairs a row holds (the DATA_DIR manifest's max_pairs_per_row); pairs beyond it
      would be ignored.
    logits_fn: (params, hidden) → logits (decoder.project_logits), for `loss_chunk`.
    loss_chunk: > 0: the policy's and the reference's log-probs over chunks of this many positions
      (TrainConfig.loss_chunk; never the full (B, L, V) logits).
    moe: the model has experts: the policy's auxiliary (load-balancing, router z) losses are added, as
      per-token means (moe_pair_terms), with their moe/ metrics.
  """
  apply_fn: Callable
  loss_type: str = "sigmoid"
  beta: float = 0.1
  gamma: float = 0.5
  max_pairs: int = 1
  logits_fn: Optional[Callable] = None
  loss_chunk: int = 0
  moe: bool = False
  features: tuple = language_model.FEATURES

  def __post_init__(self):
    if self.loss_type not in LOSS_TYPES:
      raise ValueError(f"DpoConfig.loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
    if self.beta <= 0:
      raise ValueError(f"DpoConfig.beta must be > 0, got {self.beta}")
    if self.max_pairs < 1:
      raise ValueError(f"max_pairs must be >= 1, got {self.max_pairs}")

  @property
  def needs_reference(self) -> bool:
    return self.loss_type not in REFERENCE_FREE

  def loss(self, params, batch, frozen):
    logps = lambda p, moe: sequence_logps(self.apply_fn, p, batch, self.max_pairs, self.logits_fn, self.loss_chunk,
                                          moe)
    policy, state = logps(params, self.moe)
    lengths = logprobs.pair_sums(batch["weights"], batch["segment_ids"], self.max_pairs)
    reference = None
    if self.needs_reference:
      if REFERENCE not in frozen:
        raise ValueError(f"the {self.loss_type} preference loss needs the frozen model '{REFERENCE}' "
                         "(REFERENCE_CHECKPOINT_PATH)")
      reference = jax.tree.map(jax.lax.stop_gradient, logps(frozen[REFERENCE], False)[0])
    losses, rc, rr = pair_losses(self.loss_type, self.beta, self.gamma, policy, reference, lengths)
    valid = ((lengths[0] > 0) & (lengths[1] > 0)).astype(jnp.float32)  # a pair present in this row slot
    total = lambda x: jnp.sum(x * valid)
    metrics = {
        "rewards/chosen": total(rc), "rewards/rejected": total(rr), "rewards/margin": total(rc - rr),
        "rewards/accuracy": total(logprobs.above(rc, rr)),
        "logps/chosen": total(policy[0]), "logps/rejected": total(policy[1]),
        "logps/accuracy": total(logprobs.above(policy[0], policy[1])),
    }
    aux, moe_metrics = moe_pair_terms(state, batch, jnp.sum(valid))
    return total(losses) + aux, jnp.sum(valid), {**metrics, **moe_metrics}
