"""ORPO (Hong et al. 2024): reference-free preference optimisation, SFT plus an odds-ratio term, on preference pairs.

A batch holds rows of whole pairs (data/preference.py, the layout DPO reads). Per pair, with logp̄(y) the policy's
mean log-probability per response token (Σ log π(y_t|x, y_<t) / |y|) and the odds of y, odds(y) = p̄ / (1 − p̄)
with p̄ = exp(logp̄):

  log odds(y) = logp̄(y) − log(1 − exp(logp̄(y)))          (log1mexp: never 1 − exp rounded to 0)
  loss        = −logp̄(y_c) + λ · (−log σ(log odds(y_c) − log odds(y_r)))

The first term is the SFT negative log-likelihood of the chosen response, a mean per token of each pair (TRL takes
it over all the batch's chosen tokens at once: the same when the responses have one length); the second pushes the
odds of the chosen response above the rejected one's. No reference model (`needs_reference` is False).

Sums over pairs: (Σ loss, number of pairs, metrics), so the step's Σ / Σ weight is a mean per pair, exact under
gradient accumulation. Metrics, TRL's names: nll_loss, log_odds_ratio (log σ of the log odds ratio),
log_odds_chosen (the log odds ratio), rewards/chosen and rewards/rejected (λ·logp̄), rewards/margins,
rewards/accuracies (the chosen reward above the rejected: held-out pairwise accuracy; a tie counts 1/2),
logps/chosen and logps/rejected (logp̄).
"""

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp

from t5x_like.posttrain import preference
from t5x_like.training import logprobs
from t5x_like.training.objectives import language_model

# The largest mean log-prob the odds are taken at: log(1 − exp(x)) → −∞ as x → 0 (a response the policy gives
# probability 1 token by token); clamped there, the log odds stay finite (≈ 13.8) and so does their gradient.
MAX_MEAN_LOGP = -1e-6


def log1mexp(x: jax.Array) -> jax.Array:
  """log(1 − exp(x)) for x < 0, accurate over the whole range (Mächler 2012): log(−expm1(x)) near 0, where
  1 − exp(x) loses its digits, log1p(−exp(x)) below −log 2. Each branch gets inputs where it is finite, so the
  untaken one puts no NaN into the gradient."""
  near_zero = x > -math.log(2.0)
  return jnp.where(near_zero, jnp.log(-jnp.expm1(jnp.minimum(x, MAX_MEAN_LOGP))),
                   jnp.log1p(-jnp.exp(jnp.minimum(x, -math.log(2.0)))))


def log_odds(mean_logp: jax.Array) -> jax.Array:
  """log(p̄ / (1 − p̄)) of mean log-probs logp̄ (≤ 0), clamped at MAX_MEAN_LOGP."""
  mean_logp = jnp.minimum(mean_logp, MAX_MEAN_LOGP)
  return mean_logp - log1mexp(mean_logp)


def pair_losses(lambda_: float, mean_logps):
  """(per-pair loss, NLL, log σ(log odds ratio), log odds ratio), each (B, P), from (chosen, rejected) logp̄."""
  chosen, rejected = mean_logps
  ratio = log_odds(chosen) - log_odds(rejected)
  log_sigmoid = jax.nn.log_sigmoid(ratio)
  nll = -chosen
  return nll - lambda_ * log_sigmoid, nll, log_sigmoid, ratio


@dataclasses.dataclass(frozen=True)
class Orpo:
  """ORPO on pairs (see the module docstring).

  Attributes:
    apply_fn: the decoder's `apply` ({'params': p}, tokens, positions, segment_ids) → (B, L, V) logits.
    lambda_: λ, the weight of the odds-ratio term beside the NLL (TRL's `beta`; 0.1 in the paper and TRL).
    max_pairs: the most pairs a row holds (the DATA_DIR manifest's max_pairs_per_row).
  """
  apply_fn: Callable
  lambda_: float = 0.1
  max_pairs: int = 1
  features: tuple = language_model.FEATURES
  needs_reference = False  # reference-free: `frozen` is not read
  loss_type = "orpo"

  def __post_init__(self):
    if self.lambda_ < 0:
      raise ValueError(f"OrpoConfig.lambda_ must be >= 0, got {self.lambda_}")
    if self.max_pairs < 1:
      raise ValueError(f"max_pairs must be >= 1, got {self.max_pairs}")

  def loss(self, params, batch, frozen):
    del frozen
    sums = preference.sequence_logps(self.apply_fn, params, batch, self.max_pairs)[0]  # (B, P) each
    lengths = logprobs.pair_sums(batch["weights"], batch["segment_ids"], self.max_pairs)
    valid = ((lengths[0] > 0) & (lengths[1] > 0)).astype(jnp.float32)  # a pair present in this row slot
    # logp̄ per response; an empty slot gets −1 (any finite value: it is masked out below, and must not be 0)
    mean = tuple(jnp.where(n > 0, s / jnp.maximum(n, 1.0), -1.0) for s, n in zip(sums, lengths))
    losses, nll, log_sigmoid, ratio = pair_losses(self.lambda_, mean)
    rc, rr = self.lambda_ * mean[0], self.lambda_ * mean[1]
    total = lambda x: jnp.sum(x * valid)
    metrics = {
        "nll_loss": total(nll), "log_odds_ratio": total(log_sigmoid), "log_odds_chosen": total(ratio),
        "rewards/chosen": total(rc), "rewards/rejected": total(rr), "rewards/margins": total(rc - rr),
        "rewards/accuracies": total(logprobs.above(mean[0], mean[1])),
        "logps/chosen": total(mean[0]), "logps/rejected": total(mean[1]),
    }
    return total(losses), jnp.sum(valid), metrics
