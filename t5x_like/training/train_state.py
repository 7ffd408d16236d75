"""TrainState pytree; abstract init (eval_shape) → shardings → sharded init, so no host holds the whole model."""

import math
from typing import Any, Callable, Optional

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from t5x_like.parallel import partitioning
from t5x_like.training import trainable as trainable_lib


@flax.struct.dataclass
class TrainState:
  """Everything a step updates: step counter, float32 parameters, optimizer state of the trainable
  parameters (training/trainable.py; all of them by default), all unboxed, and the dynamic loss-scale
  state (`precision.LossScaleState`; None, i.e. no leaves, without loss scaling)."""
  step: jax.Array
  params: Any
  opt_state: Any
  loss_scale: Any = None


def _boxed_init(model: nn.Module, tx: optax.GradientTransformation, rng, seq_len: int, loss_scale=None,
                trainable: str = ".*", params_fn: Optional[Callable] = None):
  if params_fn is not None:
    params = params_fn(rng)
  else:
    params = model.init(rng, jnp.zeros((1, seq_len), jnp.int32))["params"]
  return _boxed_state(params, tx, loss_scale, trainable)


def _boxed_state(params, tx: optax.GradientTransformation, loss_scale=None, trainable: str = ".*"):
  paths = trainable_lib.trainable_paths(params, trainable)
  opt_state = replicate_reshaped(tx.init(trainable_lib.trainable_part(params, paths)))
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state, loss_scale=loss_scale)


def replicate_reshaped(opt_state):
  """Optimizer state inherits its parameter's logical axis names (optax maps over the boxes); a leaf whose rank
  differs from its parameter's (Adafactor's factored row/column moments, its (1,) placeholders) is unboxed,
  so it is replicated: it holds rows + columns of a matrix, not the matrix."""
  is_box = lambda x: isinstance(x, nn.meta.AxisMetadata)
  fit = lambda x: x if not is_box(x) or (jax.tree.leaves(x.value) and len(x.names) == jnp.ndim(x.value)) else x.value
  return jax.tree.map(fit, opt_state, is_leaf=is_box)


def state_shardings(model, tx, mesh, rules=partitioning.DEFAULT_RULES, seq_len: int = 1, loss_scale=None,
                    trainable: str = ".*", params_fn: Optional[Callable] = None, boxed_params=None):
  """(abstract unboxed TrainState, matching tree of NamedShardings); nothing is allocated.

  The optimizer state inherits its parameter's logical names because optax maps over the boxes.
  `loss_scale`: the initial `precision.LossScaleState` (replicated), or None. `trainable`: the regex of
  the parameters that train (TrainConfig.trainable); only they get optimizer state. `params_fn`: rng →
  boxed parameters, instead of `model.init` (LoRA: the adapters are the state's parameters). `boxed_params`:
  `model`'s abstract boxed parameters, if the caller has them (Runtime.boxed_params; not with `params_fn`): the
  model is not traced again.
  """
  if boxed_params is not None and params_fn is None:
    boxed = jax.eval_shape(lambda params: _boxed_state(params, tx, loss_scale, trainable), boxed_params)
  else:
    boxed = jax.eval_shape(lambda: _boxed_init(model, tx, jax.random.key(0), seq_len, loss_scale, trainable,
                                               params_fn))
  shardings = partitioning.shardings_from_boxed(boxed, mesh, rules)
  return partitioning.unbox(boxed), shardings


def init_state(model, tx, rng, mesh, rules=partitioning.DEFAULT_RULES, seq_len: int = 1, loss_scale=None,
               trainable: str = ".*", params_fn: Optional[Callable] = None, shardings=None):
  """Initialises the TrainState directly into its shardings (jit with out_shardings).

  Must run under `jax.set_mesh(mesh)` and `nn.logical_axis_rules(rules)` so the model's activation
  constraints resolve. `shardings`: what `state_shardings` gave for the same arguments, if the caller has it
  (it is not traced again).
  """
  if shardings is None:
    _, shardings = state_shardings(model, tx, mesh, rules, seq_len, loss_scale, trainable, params_fn)
  init = jax.jit(lambda r: partitioning.unbox(_boxed_init(model, tx, r, seq_len, loss_scale, trainable, params_fn)),
                 out_shardings=shardings)
  return init(rng), shardings


def state_around(params, tx, shardings, loss_scale=None, trainable: str = ".*"):
  """The fresh TrainState (step 0, a fresh optimizer state, `loss_scale`) holding `params`, laid out by
  `shardings` (state_shardings'): a warm start's, without the random initialisation it would replace (the model
  is not traced; `params` are consumed). Equal to init_state's with its parameters replaced by `params`, as no
  optimizer of optimizer.OPTIMIZERS starts from its parameters' values (one that did would start from these)."""
  fresh = lambda params: _boxed_state(params, tx, loss_scale, trainable)  # unboxed params: replicate_reshaped no-op
  return jax.jit(fresh, out_shardings=shardings, donate_argnums=0)(params)


def bytes_per_device(abstract_tree, shardings) -> int:
  """Bytes one device holds of `abstract_tree` (ShapeDtypeStructs or arrays) laid out by `shardings`
  (the largest over devices: a shard's shape is the same on every device of a NamedSharding)."""
  total = 0
  for leaf, sharding in zip(jax.tree.leaves(abstract_tree), jax.tree.leaves(shardings)):
    shape = sharding.shard_shape(tuple(leaf.shape))
    total += math.prod(shape) * jnp.dtype(leaf.dtype).itemsize
  return total
