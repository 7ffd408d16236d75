"""PPO with a value head (Ouyang et al. 2022, InstructGPT; Schulman et al. 2017): the rollout arithmetic (per-token
rewards with the KL penalty, GAE, whitening) and the clipped policy + clipped value loss the trainer minimises.

The policy is the run's model with a scalar head (model/heads.ScoredGPT): its score at position t is the value
V(s_t) of the state that predicts target t, so the critic shares the policy's trunk (as TRL's value-head models);
posttrain/ppo_rollout.py makes the batches. A rollout row is one prompt followed by one sampled completion;
`weights` is 1 on the positions predicting the completion's tokens (its end marker included), one contiguous
span per row. Per completion token t (rollout time, from the parameters that sampled it):

  r_t  = −kl_coef · (log π_old(t) − log π_ref(t))      + the episode's score at the row's last token
  δ_t  = r_t + γ·V_old(t+1) − V_old(t)                  (V after the last token is 0)
  A_t  = δ_t + γλ·A_(t+1),   R_t = A_t + V_old(t)       (GAE; A then whitened over the rollout's tokens)

and the loss of one update (several epochs over minibatches of the rollout), with ρ = π(t)/π_old(t):

  policy_t = −min(ρ·A_t, clip(ρ, 1 − ε, 1 + ε)·A_t)
  value_t  = ½·max((V(t) − R_t)², (V_old(t) + clip(V(t) − V_old(t), −ε_v, ε_v) − R_t)²)
  loss_t   = policy_t + vf_coef · value_t

The step divides Σ loss_t by the number of completion tokens in the batch. Metrics, per completion token:
policy_loss, value_loss, clip_fraction (the policy's min took the clipped side), value_clip_fraction (the
value loss took the clipped side), entropy (of the policy's next-token distribution), approx_kl (the k3
estimate of KL(π_old ‖ π) over the update), ratio, value (mean V).
"""

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from t5x_like.model import decoder
from t5x_like.model import heads
from t5x_like.training import logprobs
from t5x_like.training.objectives import language_model

FEATURES = language_model.FEATURES + ("old_logps", "old_values", "advantages", "returns")


# ----------------------------------------------------------------------------------------------------
# Rollout arithmetic (host, NumPy, over (rows, L) arrays of one rollout batch).


def token_rewards(logps: np.ndarray, ref_logps: np.ndarray, weights: np.ndarray, scores: np.ndarray,
                  kl_coef: float) -> np.ndarray:
  """r_t: −kl_coef·(log π_old − log π_ref) on the completion's positions, plus each row's score at its last one.

  logps, ref_logps, weights: (N, L); scores: (N,) (a row without weighted positions gets none).
  """
  w = weights > 0
  rewards = np.where(w, -kl_coef * (logps - ref_logps), 0.0)
  has = w.any(axis=1)
  last = w.shape[1] - 1 - np.argmax(w[:, ::-1], axis=1)
  rewards[np.flatnonzero(has), last[has]] += scores[has]
  return rewards


def gae(rewards: np.ndarray, values: np.ndarray, weights: np.ndarray, gamma: float, lam: float):
  """(advantages, returns), each (N, L), by generalised advantage estimation over each row's weighted span;
  0 outside it."""
  w = (weights > 0).astype(np.float64)
  values = values * w
  advantages = np.zeros_like(w)
  carry = np.zeros(w.shape[0])
  for t in range(w.shape[1] - 1, -1, -1):
    next_value = values[:, t + 1] if t + 1 < w.shape[1] else 0.0
    next_w = w[:, t + 1] if t + 1 < w.shape[1] else 0.0
    delta = rewards[:, t] + gamma * next_value - values[:, t]
    carry = (delta + gamma * lam * carry * next_w) * w[:, t]
    advantages[:, t] = carry
  return advantages, (advantages + values) * w


def whiten(x: np.ndarray, weights: np.ndarray, eps: float = 1e-8) -> np.ndarray:
  """(x − mean) / std over the weighted entries (population std), 0 elsewhere."""
  w = weights > 0
  if not w.any():
    return np.zeros_like(x)
  mean, std = x[w].mean(), x[w].std()
  return np.where(w, (x - mean) / (std + eps), 0.0)


def explained_variance(values: np.ndarray, returns: np.ndarray, weights: np.ndarray) -> float:
  """1 − Var(R − V) / Var(R) over the weighted entries (1: the values predict the returns; ≤ 0: no better than
  their mean)."""
  w = weights > 0
  var = returns[w].var() if w.any() else 0.0
  return float(1.0 - (returns[w] - values[w]).var() / var) if var > 0 else 0.0


# ----------------------------------------------------------------------------------------------------
# The update.


def token_losses(logps, values, batch, clip_epsilon: float, value_clip: float, vf_coef: float):
  """(per-token loss, {metric name: per-token value}), each (B, L) float32, of the formulas above."""
  f32 = lambda k: batch[k].astype(jnp.float32)
  old_logps, old_values, advantages, returns = (f32(k) for k in ("old_logps", "old_values", "advantages", "returns"))
  log_ratio = logps - old_logps
  ratio = jnp.exp(log_ratio)
  unclipped = ratio * advantages
  clipped = jnp.clip(ratio, 1.0 - clip_epsilon, 1.0 + clip_epsilon) * advantages
  policy = -jnp.minimum(unclipped, clipped)
  value_clipped = old_values + jnp.clip(values - old_values, -value_clip, value_clip)
  value_err, clipped_err = jnp.square(values - returns), jnp.square(value_clipped - returns)
  value = 0.5 * jnp.maximum(value_err, clipped_err)
  metrics = {"policy_loss": policy, "value_loss": value,
             "clip_fraction": (clipped < unclipped).astype(jnp.float32),
             "value_clip_fraction": (clipped_err > value_err).astype(jnp.float32),
             "approx_kl": jnp.exp(-log_ratio) - 1.0 + log_ratio, "ratio": ratio, "value": values}
  return policy + vf_coef * value, metrics


def entropy(logits: jax.Array) -> jax.Array:
  """The entropy of softmax(logits) per position, (B, L) float32 (padding vocabulary rows hold the float32 minimum:
  probability 0, no contribution)."""
  logits = logits.astype(jnp.float32)
  log_p = jax.nn.log_softmax(logits, axis=-1)
  return -jnp.sum(jnp.exp(log_p) * jnp.where(jnp.isfinite(log_p), log_p, 0.0), axis=-1)


def value_head_forward(apply_fn: Callable, config) -> Callable:
  """(params, batch) → (logits, values, MoE state): a ScoredGPT's policy logits and its head's values, one forward
  pass (`apply_fn` the ScoredGPT's apply, `config` its GPTConfig)."""
  def forward(params, batch):
    hidden, state = language_model.forward(apply_fn, params, batch, moe=config.num_experts > 0, return_hidden=True)
    return decoder.project_logits(params, hidden, config), heads.project_scores(params, hidden, config), state
  return forward


@dataclasses.dataclass(frozen=True)
class Ppo:
  """The PPO loss over rollout minibatches (see the module docstring).

  Attributes:
    forward_fn: (params, batch) → (logits (B, L, V), values (B, L) float32, MoE state or {}): the policy and its
      value head on the batch's inputs (an MoE policy's auxiliary losses are added, token-weighted).
    clip_epsilon: ε of the policy ratio's clip.
    value_clip: ε_v: a value moves at most this far from the one the rollout saw before its loss stops counting it.
    vf_coef: the value loss's weight beside the policy loss (they share the trunk).
  """
  forward_fn: Callable
  clip_epsilon: float = 0.2
  value_clip: float = 0.2
  vf_coef: float = 0.1
  features: tuple = FEATURES
  loss_type = "ppo"  # named in the reference-loading errors shared with DPO and GRPO
  needs_reference = False  # the KL penalty is in the rollout's rewards: the update reads no frozen model

  def __post_init__(self):
    if not 0 < self.clip_epsilon < 1:
      raise ValueError(f"PpoConfig.clip_epsilon must be in (0, 1), got {self.clip_epsilon}")
    if self.value_clip <= 0:
      raise ValueError(f"PpoConfig.value_clip must be > 0, got {self.value_clip}")
    if self.vf_coef < 0:
      raise ValueError(f"PpoConfig.vf_coef must be >= 0, got {self.vf_coef}")

  def loss(self, params, batch, frozen=None):
    del frozen
    logits, values, state = self.forward_fn(params, batch)
    logps = logprobs.token_logps(logits, batch["targets"])
    losses, per_token = token_losses(logps, values.astype(jnp.float32), batch, self.clip_epsilon, self.value_clip,
                                     self.vf_coef)
    weights = batch["weights"].astype(jnp.float32)
    total = lambda x: jnp.sum(x * weights)
    weight_sum = jnp.sum(weights)
    metrics = {name: total(value) for name, value in per_token.items()}
    metrics["entropy"] = total(jax.lax.stop_gradient(entropy(logits)))
    aux, moe_metrics = language_model.moe_terms(state, weights, weight_sum)  # (0, {}) for a dense policy
    return total(losses) + aux, weight_sum, {**metrics, **moe_metrics}
