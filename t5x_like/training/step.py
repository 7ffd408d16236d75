"""Pure train and eval steps: token-weighted loss, microbatch gradient accumulation, non-finite guard."""

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax

from t5x_like.training import precision
from t5x_like.training.train_state import TrainState

Batch = dict  # inputs, targets, segment_ids, positions: (B, L) int32; weights: (B, L) float32


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
  b, length, d = hidden.shape
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


def loss_sums(params, apply_fn: Callable, batch: Batch, logits_fn: Optional[Callable] = None,
              loss_chunk: int = 0):
  """Forward pass on one (micro)batch → (loss sum, weight sum).

  With `loss_chunk` > 0 and `logits_fn(params, hidden)` (model.project_logits), the loss is computed
  chunk by chunk over the sequence (chunked_cross_entropy_sums); the result is the same.
  """
  args = (batch["inputs"], batch["positions"], batch["segment_ids"])
  if loss_chunk and logits_fn is not None and batch["inputs"].shape[1] > loss_chunk:
    hidden = apply_fn({"params": params}, *args, return_hidden=True)
    return chunked_cross_entropy_sums(lambda h: logits_fn(params, h), hidden, batch["targets"],
                                      batch["weights"], loss_chunk)
  return cross_entropy_sums(apply_fn({"params": params}, *args), batch["targets"], batch["weights"])


def split_microbatches(batch: Batch, num_microbatches: int) -> Batch:
  """(B, ...) → (M, B/M, ...), microbatch m taking rows m, m+M, ... so every data shard feeds each one."""
  def split(x):
    rows = x.shape[0] // num_microbatches
    return jnp.swapaxes(x.reshape((rows, num_microbatches) + x.shape[1:]), 0, 1)
  return jax.tree.map(split, batch)


def accumulated_grads(params, apply_fn: Callable, batch: Batch, num_microbatches: int,
                      loss_multiplier: Optional[jax.Array] = None, loss_kwargs: Optional[dict] = None):
  """Gradients of the summed loss over `num_microbatches` sequential microbatches.

  Returns (grad of Σ loss, Σ loss, Σ weight); dividing by Σ weight gives the exact full-batch mean,
  whatever the padding in each microbatch. With `loss_multiplier` c the gradients are of c·Σ loss
  (loss scaling); the returned Σ loss is not multiplied. `loss_kwargs` go to loss_sums.
  """
  def scaled_loss(p, micro):
    loss_sum, weight_sum = loss_sums(p, apply_fn, micro, **(loss_kwargs or {}))
    return loss_sum if loss_multiplier is None else loss_sum * loss_multiplier, (loss_sum, weight_sum)

  grad_fn = jax.value_and_grad(scaled_loss, has_aux=True)
  if num_microbatches <= 1:
    (_, (loss_sum, weight_sum)), grads = grad_fn(params, batch)
    return grads, loss_sum, weight_sum

  def body(carry, micro):
    grads_acc, loss_acc, weight_acc = carry
    (_, (loss_sum, weight_sum)), grads = grad_fn(params, micro)
    return (jax.tree.map(jnp.add, grads_acc, grads), loss_acc + loss_sum, weight_acc + weight_sum), None

  zeros = jax.tree.map(jnp.zeros_like, params)
  init = (zeros, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
  (grads, loss_sum, weight_sum), _ = jax.lax.scan(body, init, split_microbatches(batch, num_microbatches))
  return grads, loss_sum, weight_sum


def all_finite(tree: Any) -> jax.Array:
  return jnp.all(jnp.array([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def train_step(state: TrainState, batch: Batch, *, apply_fn: Callable, tx: optax.GradientTransformation,
               lr_fn: Callable, num_microbatches: int = 1,
               precision_config: Optional[precision.PrecisionConfig] = None,
               loss_kwargs: Optional[dict] = None):
  """One optimizer step. A step whose loss or gradients are not finite leaves params and optimizer
  state untouched (the step counter still advances) and reports `nonfinite` = 1.

  With dynamic loss scaling (`state.loss_scale` set) a gradient overflow is expected now and then: the
  step is skipped the same way and the scale backs off, but `nonfinite` = 1 only when the loss itself is
  not finite or the scale is already at `min_scale` (so the run's non-finite patience counts real
  divergence, not scale search); `overflow` and `loss_scale` report the scaling.

  Returns:
    (new state, metrics): loss (token mean), tokens (Σ weight), grad_norm, param_norm, lr, nonfinite
    (+ loss_scale, overflow with loss scaling).
  """
  loss_scale = state.loss_scale
  if loss_scale is None:
    grads, loss_sum, weight_sum = accumulated_grads(state.params, apply_fn, batch, num_microbatches,
                                                    loss_kwargs=loss_kwargs)
    denom = jnp.maximum(weight_sum, 1.0)
    grads = jax.tree.map(lambda g: g / denom, grads)
  else:  # differentiate S·(token mean): a sum over many tokens would overflow float16 weight gradients
    denom = jnp.maximum(jnp.sum(batch["weights"].astype(jnp.float32)), 1.0)
    grads, loss_sum, weight_sum = accumulated_grads(state.params, apply_fn, batch, num_microbatches,
                                                    loss_scale.scale / denom, loss_kwargs)
    grads = precision.unscale_grads(grads, loss_scale)
  loss = loss_sum / denom
  updates, new_opt_state = tx.update(grads, state.opt_state, state.params)
  new_params = optax.apply_updates(state.params, updates)
  grads_finite = all_finite(grads)
  finite = jnp.isfinite(loss) & grads_finite
  keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
  new_scale = None
  if loss_scale is not None:
    new_scale = precision.update_loss_scale(loss_scale, finite, precision_config or precision.PrecisionConfig())
  new_state = TrainState(step=state.step + 1, params=keep(new_params, state.params),
                         opt_state=keep(new_opt_state, state.opt_state), loss_scale=new_scale)
  nonfinite = ~finite
  metrics = {
      "loss": loss,
      "tokens": weight_sum,
      "grad_norm": optax.tree.norm(grads),
      "param_norm": optax.tree.norm(new_state.params),
      "lr": lr_fn(state.step),
  }
  if loss_scale is not None:
    at_floor = loss_scale.scale <= (precision_config or precision.PrecisionConfig()).min_scale
    nonfinite = ~jnp.isfinite(loss) | (~grads_finite & at_floor)
    metrics.update(loss_scale=loss_scale.scale, overflow=(~finite).astype(jnp.int32))
  metrics["nonfinite"] = nonfinite.astype(jnp.int32)
  return new_state, metrics


def eval_step(params, batch: Batch, *, apply_fn: Callable, loss_kwargs: Optional[dict] = None):
  """(Σ loss, Σ weight) over one batch; the caller sums over batches and divides."""
  return loss_sums(params, apply_fn, batch, **(loss_kwargs or {}))
