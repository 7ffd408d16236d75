"""Mixed-precision policy: which loss scaling a compute dtype gets, and dynamic loss scaling as pure functions.

The compute dtype itself is `GPTConfig.dtype` (parameters and optimizer state stay float32, logits
and loss float32). float16 has 5 exponent bits: gradients of activations below ~6e-8 flush to zero,
so the loss (a token mean, not a sum: float16 weight gradients summed over thousands of tokens would
overflow) is multiplied by a large scale S before the backward pass and the float32 gradients are
divided by S afterwards. Dynamic scaling (what AMP's GradScaler does):

    grads finite     → apply the update; after `growth_interval` such steps in a row, S ← S·growth_factor
    grads not finite → skip the update (params and optimizer state unchanged), S ← max(S·backoff_factor, min_scale)

The scale state lives in `TrainState.loss_scale`, so checkpoints carry it and a resumed run scales
exactly as an uninterrupted one.
"""

import dataclasses
from typing import Any, Optional

import flax
import jax
import jax.numpy as jnp

LOSS_SCALING = ("auto", "none", "dynamic")


@dataclasses.dataclass(frozen=True)
class PrecisionConfig:
  """Loss scaling for the compute dtype chosen by GPTConfig.dtype."""
  loss_scaling: str = "auto"  # auto (dynamic for float16, none otherwise) | none | dynamic
  initial_scale: float = 2.0**15  # S at step 0 (GradScaler: 2**16; one halving is cheaper than a NaN hunt)
  growth_interval: int = 2000  # finite steps in a row before S doubles
  growth_factor: float = 2.0  # S multiplier after growth_interval good steps
  backoff_factor: float = 0.5  # S multiplier on a step whose gradients overflowed
  min_scale: float = 1.0  # S never drops below this

  def validate(self) -> None:
    if self.loss_scaling not in LOSS_SCALING:
      raise ValueError(f"PrecisionConfig.loss_scaling={self.loss_scaling!r}: expected one of {LOSS_SCALING}")
    if not (self.growth_factor >= 1.0 and 0.0 < self.backoff_factor <= 1.0 and self.growth_interval >= 1):
      raise ValueError(f"PrecisionConfig: need growth_factor ≥ 1, 0 < backoff_factor ≤ 1, growth_interval ≥ 1; "
                       f"got {self.growth_factor}, {self.backoff_factor}, {self.growth_interval}")

  def uses_loss_scaling(self, compute_dtype: str) -> bool:
    """Whether runs with GPTConfig.dtype=`compute_dtype` scale their loss."""
    self.validate()
    return self.loss_scaling == "dynamic" or (self.loss_scaling == "auto" and compute_dtype == "float16")


@flax.struct.dataclass
class LossScaleState:
  """Dynamic loss-scale state: the current scale and the finite steps since it last changed."""
  scale: jax.Array  # () float32
  good_steps: jax.Array  # () int32


def init_loss_scale(config: Optional[PrecisionConfig], compute_dtype: str) -> Optional[LossScaleState]:
  """The initial state, or None when this dtype/config does no loss scaling (TrainState then has no leaves
  for it and checkpoints look exactly as without loss scaling)."""
  if config is None or not config.uses_loss_scaling(compute_dtype):
    return None
  return LossScaleState(scale=jnp.asarray(config.initial_scale, jnp.float32),
                        good_steps=jnp.zeros((), jnp.int32))


def unscale_grads(grads: Any, state: Optional[LossScaleState]) -> Any:
  """grads / S in float32 (the grads of float32 parameters are float32 already)."""
  if state is None:
    return grads
  inv = 1.0 / state.scale
  return jax.tree.map(lambda g: g * inv.astype(g.dtype), grads)


def update_loss_scale(state: Optional[LossScaleState], grads_finite: jax.Array,
                      config: PrecisionConfig) -> Optional[LossScaleState]:
  """Next scale after a step whose (unscaled) gradients were finite or not (see module docstring)."""
  if state is None:
    return None
  good = state.good_steps + 1
  grow = grads_finite & (good >= config.growth_interval)
  scale = jnp.where(grads_finite, jnp.where(grow, state.scale * config.growth_factor, state.scale),
                    jnp.maximum(state.scale * config.backoff_factor, config.min_scale))
  good = jnp.where(grads_finite & ~grow, good, 0)
  return LossScaleState(scale=scale.astype(jnp.float32), good_steps=good.astype(jnp.int32))
