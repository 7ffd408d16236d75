"""GRPO (Shao et al. 2024, DeepSeekMath): a clipped policy-gradient loss over rollout batches with group-relative
advantages and a KL penalty to a frozen reference (posttrain/rollout.py makes the batches).

A rollout row is one prompt followed by one sampled completion; `weights` is 1 on the completion's tokens (its
end marker included), `advantages` holds the row's advantage A = (r − mean of its group) / (std of its group + ε)
on every position, and `old_logps` the log-probability each target token had under the policy that sampled it
(on-policy — one update per rollout batch, as the trainer runs it — that is log π itself, held constant).
Per completion token t, with ρ = π(t)/π_old(t) and δ = log π_ref(t) − log π(t):

  loss_t = −min(ρ·A, clip(ρ, 1 − ε, 1 + ε)·A) + β·(exp(δ) − δ − 1)

(the KL term is the unbiased, always non-negative k3 estimator of KL(π ‖ π_ref)). The step divides Σ loss_t by
the number of completion tokens in the batch (a token-level mean, exact over microbatches and devices).
Metrics, per completion token: kl (the k3 estimate), clip_fraction (tokens whose ratio left the clip range on
the side that matters for their advantage's sign), policy_logp (mean log π of the sampled tokens).
"""

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from t5x_like.posttrain import preference
from t5x_like.training import logprobs
from t5x_like.training.objectives import language_model

REFERENCE = preference.REFERENCE  # the frozen reference model's key in `frozen`, as for DPO
FEATURES = language_model.FEATURES + ("advantages", "old_logps")
ON_POLICY_FEATURES = language_model.FEATURES + ("advantages",)


def token_losses(logps, old_logps, ref_logps, advantages, clip_epsilon: float, beta: float):
  """(per-token loss, per-token k3 KL, clipped indicator), each (B, L); ref_logps None = no KL term."""
  ratio = jnp.exp(logps - old_logps)
  unclipped = ratio * advantages
  clipped = jnp.clip(ratio, 1.0 - clip_epsilon, 1.0 + clip_epsilon) * advantages
  surrogate = jnp.minimum(unclipped, clipped)
  was_clipped = (clipped < unclipped).astype(jnp.float32)  # the min picked the clipped side
  if ref_logps is None:
    kl = jnp.zeros_like(logps)
  else:
    delta = ref_logps - logps
    kl = jnp.exp(delta) - delta - 1.0
  return -surrogate + beta * kl, kl, was_clipped


@dataclasses.dataclass(frozen=True)
class Grpo:
  """The GRPO loss over rollout rows (see the module docstring).

  Attributes:
    apply_fn: the decoder's `apply` ({'params': p}, tokens, positions, segment_ids) → (B, L, V) logits.
    clip_epsilon: ε of the clipped ratio.
    beta: β, the KL coefficient; 0 = no reference model.
    on_policy: one update per rollout batch, from the parameters that sampled it (posttrain/rollout.py): the ratio
      is 1 and its gradient ∇log π, so the batch needs no `old_logps` (a forward pass saved per step).
  """
  apply_fn: Callable
  clip_epsilon: float = 0.2
  beta: float = 0.04
  on_policy: bool = False  # the batch was sampled from these parameters: π_old = stop_gradient(π), no `old_logps`
  loss_type: str = "grpo"  # named in the reference-loading errors shared with DPO

  def __post_init__(self):
    if not 0 < self.clip_epsilon < 1:
      raise ValueError(f"GrpoConfig.clip_epsilon must be in (0, 1), got {self.clip_epsilon}")
    if self.beta < 0:
      raise ValueError(f"GrpoConfig.kl_beta must be >= 0, got {self.beta}")

  @property
  def features(self) -> tuple:
    return ON_POLICY_FEATURES if self.on_policy else FEATURES

  @property
  def needs_reference(self) -> bool:
    return self.beta > 0

  def loss(self, params, batch, frozen):
    logps = logprobs.model_token_logps(self.apply_fn, params, batch)
    ref = None
    if self.needs_reference:
      if REFERENCE not in frozen:
        raise ValueError(f"GRPO with a KL term (beta={self.beta}) needs the frozen model '{REFERENCE}' "
                         "(REFERENCE_CHECKPOINT_PATH)")
      ref = jax.lax.stop_gradient(logprobs.model_token_logps(self.apply_fn, frozen[REFERENCE], batch))
    weights = batch["weights"].astype(jnp.float32)
    old = jax.lax.stop_gradient(logps) if self.on_policy else batch["old_logps"].astype(jnp.float32)
    losses, kl, clipped = token_losses(logps, old, ref,
                                       batch["advantages"].astype(jnp.float32), self.clip_epsilon, self.beta)
    total = lambda x: jnp.sum(x * weights)
    return total(losses), jnp.sum(weights), {"kl": total(kl), "clip_fraction": total(clipped),
                                             "policy_logp": total(logps)}
