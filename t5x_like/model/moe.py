"""Mixture-of-experts MLP: a float32 top-k router, capacity-limited (or dropless) dispatch to experts that the
`expert` mesh axis splits, and the auxiliary losses (Switch/GShard load balancing, ST-MoE router z-loss).

Tokens are routed in groups (one sequence, or GPTConfig.moe_group_size tokens of one): within a group each
expert takes at most C = ceil(top_k · S · capacity_factor / E) of its S tokens, all first choices before any
second choice and earlier tokens first (GShard). A (token, expert) pair past capacity is dropped; a token whose
choices are all dropped gets a zero MLP output and passes through the residual unchanged. Padding tokens
(segment id 0) are not routed. Dispatch and combine are einsums with one-hot (G, S, E, C) masks: the
dispatched tokens (E, G, C, D) are constrained to experts over `expert` and groups over the other batch axes,
a change of split that XLA lowers to an all-to-all over `expert` (and another one back after the experts).
"""

import math
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from t5x_like.model import layers
from t5x_like.model.config import GPTConfig
from t5x_like.parallel import axis_names as ax

# Per-token statistics each MoE layer adds up (channels of MoeStats.token), in this order.
TOKEN_STATS = ("aux_loss", "load_balancing_loss", "router_z_loss", "dropped_fraction")
_DISPATCHED = (ax.ACT_EXPERT, ax.EXPERT_GROUPS, None)  # leading axes of (E, G, C, ...) dispatched tokens


class MoeStats(NamedTuple):
  """What the MoE layers of one forward pass report; the objective turns it into losses and metrics."""
  token: jax.Array  # (B, T, len(TOKEN_STATS)) float32: each token's statistics summed over the MoE layers
  load: jax.Array  # (MoE layers, E) float32: (token, choice) assignments per expert, before capacity


def routing_group_size(cfg: GPTConfig, length: int) -> int:
  """Tokens per routing group for sequences of `length` tokens (GPTConfig.moe_group_size, 0 = the sequence)."""
  size = min(cfg.moe_group_size or length, length)
  if length % size:
    raise ValueError(f"GPTConfig.moe_group_size={cfg.moe_group_size} does not divide the sequence length {length}")
  return size


def capacity(cfg: GPTConfig, group_size: int, dropless: bool = False) -> int:
  """Buffer slots per expert and group: ceil(top_k · S · capacity_factor / E), at most S (= dropless)."""
  if dropless or cfg.moe_dropless:
    return group_size
  wanted = math.ceil(cfg.moe_top_k * group_size * cfg.moe_capacity_factor / cfg.num_experts)
  return max(1, min(group_size, wanted))


def route(logits: jax.Array, valid: jax.Array, top_k: int, expert_capacity: int):
  """Top-k routing with a capacity per expert and group.

  Args:
    logits: (G, S, E) float32 router logits.
    valid: (G, S) bool: tokens to route (padding is not).
    top_k: experts per token. One expert: its gate is its router probability (Switch); more: the top-k
      probabilities renormalised to sum to 1 (GShard, Mixtral).
    expert_capacity: C, slots per expert and group.

  Returns:
    dispatch (G, S, E, C) float32 0/1: token s goes to slot c of expert e; combine (G, S, E, C) float32: the same
    entries times their gates; per-token stats (G, S, 3): load-balancing term E·Σ_e f_e·p_e (f_e: the group's
    share of assignments to e, p_e: the token's router probability), router z-loss logsumexp(logits)², fraction
    of the token's choices dropped (all 0 on padding); load (E,): assignments per expert before capacity.
  """
  g, s, e = logits.shape
  probs = jax.nn.softmax(logits, axis=-1)  # (G, S, E)
  top_probs, top_index = jax.lax.top_k(probs, top_k)  # (G, S, K)
  gates = top_probs if top_k == 1 else top_probs / jnp.sum(top_probs, axis=-1, keepdims=True)
  choice = jax.nn.one_hot(top_index, e, dtype=jnp.int32) * valid[:, :, None, None]  # (G, S, K, E)
  # Slots fill choice by choice, then token by token: cumsum over the (K, S) order of the group.
  queue = jnp.swapaxes(choice, 1, 2).reshape(g, top_k * s, e)  # (G, K·S, E)
  filled = jnp.swapaxes((jnp.cumsum(queue, axis=1) - 1).reshape(g, top_k, s, e), 1, 2)  # (G, S, K, E)
  slot = jnp.sum(filled * choice, axis=-1)  # (G, S, K): the slot each choice takes in its expert's buffer
  kept = choice * (slot < expert_capacity)[..., None]  # (G, S, K, E)
  slot_one_hot = jax.nn.one_hot(slot, expert_capacity, dtype=jnp.float32)  # (G, S, K, C)
  dispatch = jnp.einsum("gske,gskc->gsec", kept.astype(jnp.float32), slot_one_hot)
  combine = jnp.einsum("gske,gskc->gsec", kept * gates[..., None], slot_one_hot)
  valid_f = valid.astype(jnp.float32)
  assigned = jnp.sum(choice, axis=(1, 2)).astype(jnp.float32)  # (G, E)
  share = assigned / (top_k * jnp.maximum(jnp.sum(valid_f, axis=1), 1.0))[:, None]  # f_e per group
  load_balancing = e * jnp.einsum("ge,gse->gs", share, probs) * valid_f
  router_z = jnp.square(jax.nn.logsumexp(logits, axis=-1)) * valid_f
  dropped = jnp.sum(choice - kept, axis=(2, 3)).astype(jnp.float32) / top_k
  return dispatch, combine, jnp.stack([load_balancing, router_z, dropped], axis=-1), jnp.sum(assigned, axis=0)


class ExpertDense(nn.Module):
  """One projection per expert: (E, G, C, in) @ (E, in, out) kernel (+ (E, out) bias) → (E, G, C, out)."""
  in_dim: int
  out_dim: int
  kernel_axes: tuple
  bias_axes: tuple
  dtype: jnp.dtype = jnp.bfloat16
  use_bias: bool = True

  @nn.compact
  def __call__(self, x):
    e = x.shape[0]
    kernel = self.param("kernel", nn.with_logical_partitioning(layers._INIT, self.kernel_axes),
                        (e, self.in_dim, self.out_dim), jnp.float32)
    y = jnp.einsum("egci,eio->egco", x.astype(self.dtype), kernel.astype(self.dtype))
    if self.use_bias:
      bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, self.bias_axes),
                        (e, self.out_dim), jnp.float32)
      y = y + bias.astype(self.dtype)[:, None, None, :]
    return y


class MoeMlp(nn.Module):
  """The MLP of an MoE layer: router → dispatch (all-to-all) → per-expert MLP → combine (all-to-all back)."""
  config: GPTConfig

  @nn.compact
  def __call__(self, x, valid, dropless: bool = False):
    """x: (B, T, D) normalised block input; valid: (B, T) bool, False on padding; dropless: ignore capacity.

    Returns (B, T, D) in the compute dtype, and (per-token stats (B, T, len(TOKEN_STATS)), load (E,)).
    """
    cfg = self.config
    b, t, d = x.shape
    e, f, dtype = cfg.num_experts, cfg.expert_d_ff, cfg.compute_dtype
    size = routing_group_size(cfg, t)
    g = b * t // size
    x = layers.constrain(x.reshape(g, size, d), (ax.BATCH, None, ax.ACT_EMBED))  # (G, S, D)
    logits = layers.DenseGeneral((d,), (e,), (ax.EMBED, None), (None,), dtype=jnp.float32, use_bias=False,
                                 name="router")(x.astype(jnp.float32))  # (G, S, E) float32
    dispatch, combine, stats, load = route(logits, valid.reshape(g, size), cfg.moe_top_k,
                                           capacity(cfg, size, dropless))
    dispatch = layers.constrain(dispatch.astype(dtype), (ax.BATCH, None, None, None))
    expert_in = jnp.einsum("gsec,gsd->egcd", dispatch, x.astype(dtype))
    expert_in = layers.constrain(expert_in, _DISPATCHED + (ax.ACT_EMBED,))  # (E, G, C, D): all-to-all
    dense = lambda i, o, axes, bias_axes, name: ExpertDense(i, o, axes, bias_axes, dtype, cfg.use_bias, name=name)
    mlp_in = lambda name: dense(d, f, (ax.EXPERT, ax.EMBED, ax.MLP), (ax.EXPERT, ax.MLP), name)(expert_in)
    hidden = layers.mlp_hidden(cfg.mlp_activation, mlp_in)
    hidden = layers.constrain(hidden, _DISPATCHED + (ax.ACT_MLP,))  # (E, G, C, F)
    out = dense(f, d, (ax.EXPERT, ax.MLP, ax.EMBED), (ax.EXPERT, ax.NORM), "mlp_out")(hidden)
    out = layers.constrain(out, _DISPATCHED + (ax.ACT_EMBED,))  # (E, G, C, D)
    y = jnp.einsum("egcd,gsec->gsd", out, combine.astype(dtype))  # all-to-all back to the batch split
    y = layers.constrain(y, (ax.BATCH, None, ax.ACT_EMBED)).reshape(b, t, d)
    aux = cfg.moe_load_balancing_weight * stats[..., 0] + cfg.moe_router_z_weight * stats[..., 1]
    token = jnp.concatenate([aux[..., None], stats], axis=-1).reshape(b, t, len(TOKEN_STATS))
    return y, (token, load)
