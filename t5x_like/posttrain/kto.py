"""KTO (Ethayarajh et al. 2024): Kahneman–Tversky optimisation against a frozen reference, on labelled examples:
unpaired thumbs-up / thumbs-down data (`preprocess --format=unpaired`), or preference pairs read as two examples
(each pair's chosen response desirable, its rejected one undesirable, as TRL's conversion of paired data does).

A batch holds rows in the pair layout DPO reads (data/preference.py); an unpaired example is a pair slot with one
side present: the chosen side for a desirable example, the rejected side for an undesirable one. Per response y
to prompt x, with
r(y) = log π(y|x) − log π_ref(y|x) (summed over the response tokens) and z0 the KL reference point:

  desirable y:    λ_D · (1 − σ(β · (r(y) − z0)))
  undesirable y:  λ_U · (1 − σ(β · (z0 − r(y))))

z0 estimates KL(π ‖ π_ref) and only shifts the reference point: it carries no gradient (as in the paper and TRL).
The paper and TRL estimate it on mismatched pairs (prompt i with the completion of example j ≠ i), which the
batch would have to hold as extra sequences. Here it is the simpler estimate over the batch's own responses:

  z0 = max(0, mean over every response y in the batch of r(y))   (stop-gradient)

the same log-ratio the mismatched estimate averages, taken on the data's responses instead of others'. It is
the mean over the batch the loss sees: the whole global batch across devices (any layout equals one device),
one microbatch at a time under gradient accumulation (as TRL, per accumulation step).

Sums: (½ Σ loss over the examples present, ½ the number of examples, metrics): per pair of paired data the mean
of its two examples' losses and a weight of 1, so the step's Σ / Σ weight is TRL's mean over examples in both
cases. Metrics, TRL's names, as sums the step divides by that weight (per pair, for paired data): kl (z0),
rewards/chosen and rewards/rejected (β·r of the desirable and the undesirable examples), rewards/margins and
rewards/accuracies (of whole pairs only: the chosen reward above the rejected, held-out pairwise accuracy; a tie
counts 1/2, so a policy equal to its reference scores 0.5; 0 on unpaired data), logps/chosen and logps/rejected
(the policy's summed log-probs).
"""

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from t5x_like.posttrain import preference
from t5x_like.training import logprobs
from t5x_like.training.objectives import language_model

REFERENCE = preference.REFERENCE  # the frozen reference model's key in `frozen`


def kl_estimate(log_ratios, present) -> jax.Array:
  """z0: max(0, the mean log-ratio over the responses present), a scalar without gradient.

  log_ratios: (chosen, rejected) r, each (B, P); present: (chosen, rejected), each (B, P), 1 where the row slot
  holds that response.
  """
  total = jnp.sum(log_ratios[0] * present[0] + log_ratios[1] * present[1])
  count = jnp.sum(present[0] + present[1])
  return jax.lax.stop_gradient(jnp.maximum(total / jnp.maximum(count, 1.0), 0.0))


def pair_losses(beta: float, desirable_weight: float, undesirable_weight: float, log_ratios, z0, present):
  """Per-slot loss (B, P): half the sum of the present chosen (desirable) and rejected (undesirable) responses'
  losses (a pair's mean; half an unpaired example's)."""
  chosen, rejected = log_ratios
  desirable = desirable_weight * (1.0 - jax.nn.sigmoid(beta * (chosen - z0)))
  undesirable = undesirable_weight * (1.0 - jax.nn.sigmoid(beta * (z0 - rejected)))
  return 0.5 * (desirable * present[0] + undesirable * present[1])


@dataclasses.dataclass(frozen=True)
class Kto:
  """KTO on pairs read as labelled examples (see the module docstring).

  Attributes:
    apply_fn: the decoder's `apply` ({'params': p}, tokens, positions, segment_ids) → (B, L, V) logits.
    beta: β, the scale of the log-ratio inside the value function (0.1 in the paper and TRL).
    desirable_weight: λ_D, the weight of a desirable (chosen) response's loss.
    undesirable_weight: λ_U, the weight of an undesirable (rejected) response's loss. The paper advises
      λ_D·n_D / (λ_U·n_U) in [1, 4/3]; paired data has n_D = n_U, so 1 and 1 is in range.
    max_pairs: the most pairs a row holds (the DATA_DIR manifest's max_pairs_per_row).
  """
  apply_fn: Callable
  beta: float = 0.1
  desirable_weight: float = 1.0
  undesirable_weight: float = 1.0
  max_pairs: int = 1
  features: tuple = language_model.FEATURES
  needs_reference = True  # `frozen` holds REFERENCE
  loss_type = "kto"

  def __post_init__(self):
    if self.beta <= 0:
      raise ValueError(f"KtoConfig.beta must be > 0, got {self.beta}")
    for name, value in (("desirable_weight", self.desirable_weight), ("undesirable_weight", self.undesirable_weight)):
      if value < 0:
        raise ValueError(f"KtoConfig.{name} must be >= 0, got {value}")
    if self.max_pairs < 1:
      raise ValueError(f"max_pairs must be >= 1, got {self.max_pairs}")

  def loss(self, params, batch, frozen):
    if REFERENCE not in frozen:
      raise ValueError(f"the KTO loss needs the frozen model '{REFERENCE}' (REFERENCE_CHECKPOINT_PATH)")
    policy = preference.sequence_logps(self.apply_fn, params, batch, self.max_pairs)[0]  # (B, P) each
    reference = jax.tree.map(jax.lax.stop_gradient,
                             preference.sequence_logps(self.apply_fn, frozen[REFERENCE], batch, self.max_pairs)[0])
    lengths = logprobs.pair_sums(batch["weights"], batch["segment_ids"], self.max_pairs)
    present = tuple((n > 0).astype(jnp.float32) for n in lengths)  # (chosen, rejected) in each row slot
    paired = present[0] * present[1]
    log_ratios = (policy[0] - reference[0], policy[1] - reference[1])
    z0 = kl_estimate(log_ratios, present)
    losses = pair_losses(self.beta, self.desirable_weight, self.undesirable_weight, log_ratios, z0, present)
    rc, rr = self.beta * log_ratios[0], self.beta * log_ratios[1]
    weight = 0.5 * jnp.sum(present[0] + present[1])  # pairs (paired data); half the examples (unpaired)
    metrics = {
        "kl": z0 * weight, "rewards/chosen": jnp.sum(rc * present[0]), "rewards/rejected": jnp.sum(rr * present[1]),
        "rewards/margins": jnp.sum((rc - rr) * paired), "rewards/accuracies": jnp.sum(logprobs.above(rc, rr) * paired),
        "logps/chosen": jnp.sum(policy[0] * present[0]), "logps/rejected": jnp.sum(policy[1] * present[1]),
    }
    return jnp.sum(losses), weight, metrics
