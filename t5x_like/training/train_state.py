"""TrainState pytree; abstract init (eval_shape) → shardings → sharded init, so no host holds the whole model."""

from typing import Any

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
                trainable: str = ".*"):
  tokens = jnp.zeros((1, seq_len), jnp.int32)
  params = model.init(rng, tokens)["params"]
  paths = trainable_lib.trainable_paths(params, trainable)
  return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                    opt_state=tx.init(trainable_lib.trainable_part(params, paths)), loss_scale=loss_scale)


def state_shardings(model, tx, mesh, rules=partitioning.DEFAULT_RULES, seq_len: int = 1, loss_scale=None,
                    trainable: str = ".*"):
  """(abstract unboxed TrainState, matching tree of NamedShardings); nothing is allocated.

  The optimizer state inherits its parameter's logical names because optax maps over the boxes.
  `loss_scale`: the initial `precision.LossScaleState` (replicated), or None. `trainable`: the regex of
  the parameters that train (TrainConfig.trainable); only they get optimizer state.
  """
  boxed = jax.eval_shape(lambda: _boxed_init(model, tx, jax.random.key(0), seq_len, loss_scale, trainable))
  shardings = partitioning.shardings_from_boxed(boxed, mesh, rules)
  return partitioning.unbox(boxed), shardings


def init_state(model, tx, rng, mesh, rules=partitioning.DEFAULT_RULES, seq_len: int = 1, loss_scale=None,
               trainable: str = ".*"):
  """Initialises the TrainState directly into its shardings (jit with out_shardings).

  Must run under `jax.set_mesh(mesh)` and `nn.logical_axis_rules(rules)` so the model's activation
  constraints resolve.
  """
  _, shardings = state_shardings(model, tx, mesh, rules, seq_len, loss_scale, trainable)
  init = jax.jit(lambda r: partitioning.unbox(_boxed_init(model, tx, r, seq_len, loss_scale, trainable)),
                 out_shardings=shardings)
  return init(rng), shardings
