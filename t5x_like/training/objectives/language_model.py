"""Language modelling: token-weighted next-token cross-entropy (pre-training, and SFT through `weights`), plus the
auxiliary losses of a mixture-of-experts model (model/moe.py) with their metrics."""

import dataclasses
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from t5x_like.model import decoder as model_lib
from t5x_like.model import moe
from t5x_like.training import logprobs

FEATURES = ("inputs", "targets", "segment_ids", "positions", "weights")


def cross_entropy_sums(logits: jax.Array, targets: jax.Array, weights: jax.Array):
  """(Σ weight·CE, Σ weight) in float32, CE = −log softmax(logits)[target] (logprobs.token_logps).

  logits: (B, L, V), possibly vocab-sharded; targets, weights: (B, L).
  """
  weights = weights.astype(jnp.float32)
  return jnp.sum(-logprobs.token_logps(logits, targets) * weights), jnp.sum(weights)


# The parameters an output projection reads (decoder.project_logits): the tied embedding or the untied head.
HEAD_PARAMS = ("token_embedding", "lm_head")


def head_params(params) -> dict:
  """The subset of the model's parameters the output projection reads (HEAD_PARAMS)."""
  return {k: params[k] for k in HEAD_PARAMS if k in params}


def chunked_cross_entropy_sums(logits_fn: Callable, head: dict, hidden: jax.Array, targets: jax.Array,
                               weights: jax.Array, chunk: int):
  """cross_entropy_sums of logits_fn(head, hidden) without ever holding the (B, L, V) float32 logits.

  The sequence is cut into chunks of `chunk` positions. Under differentiation the gradient is computed in the
  same pass as the loss (a fused linear cross-entropy): each chunk's logits are projected, reduced to the loss,
  turned into the logits gradient (softmax − one-hot, weighted) and contracted at once into the chunk's
  hidden-state gradient and the head's gradient (summed over chunks), while the chunk is still in cache. The
  backward pass only scales those by the loss's cotangent: no logits are recomputed or stored, and XLA never
  materialises or transposes a (B, L, V) array. Without differentiation (evaluation) only the loss is computed.

  Args:
    logits_fn: (head, hidden (B, c, D)) → (B, c, V) float32 logits (decoder.project_logits).
    head: the parameters logits_fn reads (head_params(params)); its gradient is returned through `head`.
    hidden: (B, L, D) final hidden states; L % chunk == 0.
    targets, weights: (B, L).
  Returns:
    (Σ weight·CE, Σ weight) float32, differentiable in `head` and `hidden`.
  """
  zero = jnp.zeros((), jnp.float32)
  hidden_dtype = hidden.dtype

  def chunk_sums(hd, h, t, w):
    return cross_entropy_sums(logits_fn(hd, h), t, w)

  @jax.custom_vjp
  def sums(hd, h, t, w):
    return logprobs.chunked_sums(lambda *xs: chunk_sums(hd, *xs), chunk, h, t, w)

  def forward(hd, h, t, w):
    def body(carry, xs):
      loss_sum, weight_sum, head_grad = carry
      h_c, t_c, w_c = xs
      # the hidden states' gradient stays float32 until the backward pass has scaled it by the loss's cotangent
      # (e.g. 2^15 / Σ weight under float16 loss scaling), then is cast once to the activations' dtype
      (loss, weight), vjp = jax.vjp(lambda p, x: chunk_sums(p, x, t_c, w_c), hd, h_c.astype(jnp.float32))
      d_head, d_hidden = vjp((jnp.ones_like(loss), jnp.zeros_like(weight)))
      return (loss_sum + loss, weight_sum + weight, jax.tree.map(jnp.add, head_grad, d_head)), d_hidden

    init = (zero, zero, jax.tree.map(jnp.zeros_like, hd))
    xs = tuple(logprobs.chunks(x, chunk) for x in (h, t, w))  # (n, B, chunk, ...)
    (loss_sum, weight_sum, head_grad), d_hidden = jax.lax.scan(body, init, xs)
    d_hidden = logprobs.unchunk(d_hidden)  # (B, L, D)
    return (loss_sum, weight_sum), (head_grad, d_hidden)

  def backward(residuals, cotangents):
    head_grad, d_hidden = residuals
    g = cotangents[0]  # Σ weight has no gradient
    return (jax.tree.map(lambda x: (x * g).astype(x.dtype), head_grad), (d_hidden * g).astype(hidden_dtype),
            None, None)

  sums.defvjp(forward, backward)
  return sums(head, hidden, targets, weights)


@dataclasses.dataclass(frozen=True)
class LanguageModel:
  """Next-token cross-entropy weighted per token by `weights` (0 on padding, and on prompts for SFT).

  Attributes:
    apply_fn: the decoder's `apply` ({'params': p}, tokens, positions, segment_ids) → (B, L, V) logits.
    logits_fn: (params, hidden) → logits (decoder.project_logits), for the chunked loss; it is given only the
      output projection's parameters (head_params).
    loss_chunk: > 0: compute the loss and its gradient over chunks of this many positions (never the full f32
      logits; chunked_cross_entropy_sums).
  """
  apply_fn: Callable
  logits_fn: Optional[Callable] = None
  loss_chunk: int = 0
  features: tuple = FEATURES

  def loss(self, params, batch, frozen=None):
    del frozen  # language modelling uses no frozen model
    # moe=True: an MoE model sows its routing statistics in the state (a dense model sows nothing)
    if self.loss_chunk and self.logits_fn is not None and batch["inputs"].shape[1] > self.loss_chunk:
      hidden, state = forward(self.apply_fn, params, batch, moe=True, return_hidden=True)
      loss_sum, weight_sum = chunked_cross_entropy_sums(self.logits_fn, head_params(params), hidden,
                                                        batch["targets"], batch["weights"], self.loss_chunk)
    else:
      logits, state = forward(self.apply_fn, params, batch, moe=True)
      loss_sum, weight_sum = cross_entropy_sums(logits, batch["targets"], batch["weights"])
    aux_sum, metrics = moe_terms(state, batch["weights"], weight_sum)
    if not metrics:
      return loss_sum, weight_sum, {}
    return loss_sum + aux_sum, weight_sum, {"cross_entropy": loss_sum, **metrics}


def forward(apply_fn: Callable, params, batch, *, moe: bool = False, **kwargs):
  """(apply_fn's output on the batch's inputs, state): with `moe`, the pass runs with mutable intermediates and the
  state holds the MoE statistics it sowed (moe_terms reads them); else the state is {}."""
  args = (batch["inputs"], batch["positions"], batch["segment_ids"])
  if moe:
    return apply_fn({"params": params}, *args, mutable=["intermediates"], **kwargs)
  return apply_fn({"params": params}, *args, **kwargs), {}


def moe_terms(state: dict, weights: jax.Array, weight_sum: jax.Array, units: Optional[jax.Array] = None):
  """(auxiliary loss, metrics) of the MoE statistics a forward pass sowed in `state` (apply(...,
  mutable=["intermediates"])), as sums the step divides by the objective's Σ weight; (0, {}) for a dense model.

  Token-weighted objectives (units None): weight_sum = Σ weights, the terms as moe_sums gives them. Objectives
  normalised per pair or example (DPO, the reward model: units = their Σ weight) get the token-weighted means
  over `weights` times `units`, so that after the step's division they are the same per-token means.
  """
  stats = model_lib.moe_stats(state)
  if stats is None:
    return jnp.zeros((), jnp.float32), {}
  aux_sum, metrics = moe_sums(stats, weights, weight_sum)
  if units is None:
    return aux_sum, metrics
  scale = units / jnp.maximum(weight_sum, 1.0)
  return aux_sum * scale, {k: v * scale for k, v in metrics.items()}


def moe_sums(stats: moe.MoeStats, weights: jax.Array, weight_sum: jax.Array):
  """(Σ weight·aux loss, {metric: sum}) of an MoE forward pass, as sums the step divides by Σ weight.

  Per-token terms (the weighted auxiliary loss, load-balancing loss, router z-loss, dropped fraction) are the
  mean over MoE layers, weighted per token like the cross-entropy, so they add up exactly over microbatches.
  moe/expert_load_min and _max: the least and most loaded expert of any MoE layer, as its share of the
  layer's assignments × num_experts (1 = balanced), scaled by Σ weight (a token-weighted mean over microbatches).
  """
  num_layers, num_experts = stats.load.shape
  per_token = jnp.einsum("btc,bt->c", stats.token, weights.astype(jnp.float32)) / num_layers
  named = dict(zip(moe.TOKEN_STATS, per_token))
  load = stats.load / jnp.maximum(jnp.sum(stats.load, axis=-1, keepdims=True), 1.0) * num_experts
  metrics = {f"moe/{name}": value for name, value in named.items() if name != "aux_loss"}
  metrics["moe/expert_load_min"] = jnp.min(load) * weight_sum
  metrics["moe/expert_load_max"] = jnp.max(load) * weight_sum
  return named["aux_loss"], metrics
