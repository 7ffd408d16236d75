"""The generic train and eval steps: accumulation, clipping, loss scaling, non-finite guard, for any objective.

An objective (training/objectives/) turns (params, batch, frozen) into sums; everything else a step
does is written here once. Only the trainable leaves (training/trainable.py) are differentiated and
updated; frozen models arrive as `frozen` (parameter trees with no optimizer state).
"""

import functools
from typing import Any, Callable, Mapping, Optional

import jax
import jax.numpy as jnp
import optax

from t5x_like.parallel import offload
from t5x_like.training import precision
from t5x_like.training import trainable as trainable_lib
from t5x_like.training.objectives.base import Objective
from t5x_like.training.train_state import TrainState

Batch = Mapping[str, jax.Array]  # the objective's features, each (B, L)


def split_microbatches(batch: Batch, num_microbatches: int) -> dict:
  """(B, ...) → (M, B/M, ...), microbatch m taking rows m, m+M, ... so every data shard feeds each one."""
  def split(x):
    rows = x.shape[0] // num_microbatches
    return jnp.swapaxes(x.reshape((rows, num_microbatches) + x.shape[1:]), 0, 1)
  return jax.tree.map(split, dict(batch))


def accumulated_grads(loss_fn: Callable, params, batch: Batch, num_microbatches: int,
                      loss_multiplier: Optional[jax.Array] = None):
  """Gradients of the summed loss over `num_microbatches` sequential microbatches.

  Args:
    loss_fn: (params, microbatch) → (Σ loss, Σ weight, {name: Σ value}), an objective's `loss`.
    params: the tree differentiated (the trainable leaves).
    batch: (B, ...) features; B divisible by num_microbatches.
    num_microbatches: accumulated sequentially with lax.scan (1 = no accumulation).
    loss_multiplier: c: the gradients are of c·Σ loss (loss scaling); the returned Σ loss is not scaled.

  Returns:
    (grads of Σ loss, Σ loss, Σ weight, {name: Σ value}); dividing by Σ weight gives the exact
    full-batch mean, whatever the padding in each microbatch.
  """
  def scaled_loss(p, micro):
    loss_sum, weight_sum, metrics = loss_fn(p, micro)
    scaled = loss_sum if loss_multiplier is None else loss_sum * loss_multiplier
    return scaled, (loss_sum, weight_sum, metrics)

  grad_fn = jax.value_and_grad(scaled_loss, has_aux=True)
  if num_microbatches <= 1:
    (_, (loss_sum, weight_sum, metrics)), grads = grad_fn(params, batch)
    return grads, loss_sum, weight_sum, metrics

  micro = split_microbatches(batch, num_microbatches)
  first = jax.tree.map(lambda x: x[0], micro)
  metric_shapes = jax.eval_shape(lambda: loss_fn(params, first)[2])

  def body(carry, micro):
    grads_acc, loss_acc, weight_acc, metrics_acc = carry
    (_, (loss_sum, weight_sum, metrics)), grads = grad_fn(params, micro)
    return (jax.tree.map(jnp.add, grads_acc, grads), loss_acc + loss_sum, weight_acc + weight_sum,
            jax.tree.map(jnp.add, metrics_acc, metrics)), None

  zero = jnp.zeros((), jnp.float32)
  init = (jax.tree.map(jnp.zeros_like, params), zero, zero,
          jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), metric_shapes))
  (grads, loss_sum, weight_sum, metrics), _ = jax.lax.scan(body, init, micro)
  return grads, loss_sum, weight_sum, metrics


def all_finite(tree: Any) -> jax.Array:
  return jnp.all(jnp.array([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def train_step(state: TrainState, batch: Batch, frozen: Optional[Mapping[str, Any]] = None, *,
               objective: Objective, tx: optax.GradientTransformation, lr_fn: Callable,
               num_microbatches: int = 1, precision_config: Optional[precision.PrecisionConfig] = None,
               trainable_paths: Optional[frozenset] = None):
  """One optimizer step of `objective`. A step whose loss or gradients are not finite leaves params and
  optimizer state untouched (the step counter still advances) and reports `nonfinite` = 1.

  With dynamic loss scaling (`state.loss_scale` set) a gradient overflow is expected now and then: the
  step is skipped the same way and the scale backs off, but `nonfinite` = 1 only when the loss itself is
  not finite or the scale is already at `min_scale` (so the run's non-finite patience counts real
  divergence, not scale search); `overflow` and `loss_scale` report the scaling.

  Args:
    state: params (all leaves), opt_state (of the trainable leaves only), step, loss scale.
    batch: the objective's features.
    frozen: frozen models' parameters, passed to the objective untouched.
    objective: what the loss is (training/objectives/).
    tx, lr_fn: the optimizer (over the trainable leaves) and its schedule (for the `lr` metric).
    num_microbatches: gradient-accumulation microbatches.
    precision_config: loss-scaling settings (with `state.loss_scale`).
    trainable_paths: the leaves that train (training/trainable.py); None = all.

  Returns:
    (new state, metrics): loss (mean per unit of weight), tokens (Σ weight), grad_norm, param_norm, lr,
    nonfinite, the objective's own metrics (each Σ / Σ weight), + loss_scale, overflow with loss scaling.
  """
  frozen = frozen or {}
  precision_config = precision_config or precision.PrecisionConfig()
  params = state.params
  train_params = trainable_lib.trainable_part(params, trainable_paths) if trainable_paths else params
  loss_fn = lambda p, micro: objective.loss(trainable_lib.merge(params, p), micro, frozen)
  loss_scale = state.loss_scale
  if loss_scale is None:
    grads, loss_sum, weight_sum, metric_sums = accumulated_grads(loss_fn, train_params, batch, num_microbatches)
    denom = jnp.maximum(weight_sum, 1.0)
    grads = jax.tree.map(lambda g: g / denom, grads)
  else:  # differentiate S·(mean): a sum over many tokens would overflow float16 weight gradients
    denom = jnp.maximum(jnp.sum(batch["weights"].astype(jnp.float32)), 1.0)
    grads, loss_sum, weight_sum, metric_sums = accumulated_grads(loss_fn, train_params, batch, num_microbatches,
                                                                 loss_scale.scale / denom)
    grads = precision.unscale_grads(grads, loss_scale)
  loss = loss_sum / denom
  updates, new_opt_state = tx.update(grads, state.opt_state, train_params)
  new_train_params = optax.apply_updates(train_params, updates)
  grads_finite = all_finite(grads)
  finite = jnp.isfinite(loss) & grads_finite
  keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
  new_scale = None
  if loss_scale is not None:
    new_scale = precision.update_loss_scale(loss_scale, finite, precision_config)
  new_params = trainable_lib.merge(params, keep(new_train_params, train_params))
  new_state = TrainState(step=state.step + 1, params=new_params,
                         opt_state=keep(new_opt_state, state.opt_state), loss_scale=new_scale)
  nonfinite = ~finite
  metrics = {
      "loss": loss,
      "tokens": weight_sum,
      "grad_norm": optax.tree.norm(grads),
      "param_norm": optax.tree.norm(new_state.params),
      "lr": lr_fn(state.step),
      **{name: value / denom for name, value in metric_sums.items()},
  }
  if loss_scale is not None:
    at_floor = loss_scale.scale <= precision_config.min_scale
    nonfinite = ~jnp.isfinite(loss) | (~grads_finite & at_floor)
    metrics.update(loss_scale=loss_scale.scale, overflow=(~finite).astype(jnp.int32))
  metrics["nonfinite"] = nonfinite.astype(jnp.int32)
  return new_state, metrics


def eval_step(params, batch: Batch, frozen: Optional[Mapping[str, Any]] = None, *, objective: Objective):
  """(Σ loss, Σ weight, {name: Σ value}) over one batch; the caller sums over batches and divides."""
  return objective.loss(params, batch, frozen or {})


def make_train_step(objective: Objective, tx: optax.GradientTransformation, lr_fn: Callable, *,
                    num_microbatches: int = 1, precision_config: Optional[precision.PrecisionConfig] = None,
                    trainable_paths: Optional[frozenset] = None, offloaded_shardings=None) -> Callable:
  """`train_step` with everything but (state, batch, frozen) bound: the pure function a run jits.

  `offloaded_shardings`: the state shardings from `offload.offload_shardings` (ZeRO-Offload); the host-
  resident state is then moved to the device inside the step. None = nothing offloaded.
  """
  step = functools.partial(train_step, objective=objective, tx=tx, lr_fn=lr_fn, num_microbatches=num_microbatches,
                           precision_config=precision_config, trainable_paths=trainable_paths)
  if offloaded_shardings is not None:
    step = offload.with_device_opt_state(step, offloaded_shardings)
  return step


def jit_train_step(step_fn: Callable, state_shardings, batch_sharding, features, frozen_shardings=None):
  """jax.jit of a `make_train_step` function: state and batch laid out by their shardings, the state
  donated (updated in place), frozen models passed through on their own shardings."""
  return jax.jit(step_fn, in_shardings=(state_shardings, {k: batch_sharding for k in features},
                                        frozen_shardings if frozen_shardings is not None else {}),
                 out_shardings=(state_shardings, None), donate_argnums=(0,))
