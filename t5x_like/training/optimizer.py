"""The optimizers (optax: AdamW, Adafactor, Lion, Muon, SGD) and their learning-rate schedules.

Every optimizer keeps global-norm clipping and decoupled weight decay under one mask (matrices, never
biases, norms or, unless asked, embeddings), scaled by the schedule as AdamW's is: the update of a decayed
leaf p is −lr(t)·(direction + weight_decay·p).
"""

import dataclasses
import math

import flax
import jax
import jax.numpy as jnp
import optax
from optax import contrib as optax_contrib

OPTIMIZERS = ("adamw", "adafactor", "lion", "muon", "sgd")
SCHEDULES = ("cosine", "linear", "constant", "wsd", "rsqrt")
WSD_DECAY_SHAPES = ("linear", "1-sqrt")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """The optimizer and its learning-rate schedule."""
  name: str = "adamw"  # adamw | adafactor | lion | muon (2-D block kernels; AdamW for the rest) | sgd
  learning_rate: float = 6e-4  # peak learning rate, reached at the end of warmup
  warmup_steps: int = 100  # linear warmup from 0 to the peak
  # After warmup: cosine | linear | constant | wsd (constant, then a decay over the last `decay_fraction` of the
  # steps) | rsqrt (T5X's inverse square root: peak·sqrt(warmup / step) after warmup)
  decay: str = "cosine"
  min_lr_ratio: float = 0.1  # final learning rate as a fraction of the peak (cosine, linear, wsd)
  decay_fraction: float = 0.2  # wsd: the last fraction of TRAIN_STEPS over which the learning rate decays
  wsd_decay_shape: str = "linear"  # wsd: linear | 1-sqrt (lr = final + (peak − final)·(1 − sqrt(progress)))
  b1: float = 0.9  # AdamW first-moment decay (also Muon's AdamW part)
  b2: float = 0.95  # AdamW second-moment decay (also Muon's AdamW part)
  eps: float = 1e-8  # AdamW epsilon
  weight_decay: float = 0.1  # decoupled weight decay on decayed leaves (every optimizer)
  decay_embeddings: bool = False  # also decay token/position embeddings
  clip_norm: float = 1.0  # global gradient-norm clip; 0 disables
  momentum: float = 0.9  # sgd: heavy-ball momentum (0 = plain SGD); muon: its momentum β
  nesterov: bool = False  # sgd: Nesterov momentum (Muon always uses it)
  lion_b1: float = 0.9  # lion: interpolation between momentum and gradient for the update's sign
  lion_b2: float = 0.99  # lion: momentum decay
  # adafactor, with T5X's defaults: factored second moments, no momentum, update clipping, parameter scale
  adafactor_decay_rate: float = 0.8  # second-moment decay exponent: β2(t) = 1 − t^(−decay_rate)
  adafactor_clipping_threshold: float = 1.0  # clip each update to this block RMS; 0 disables
  adafactor_min_dim_size_to_factor: int = 128  # only leaves with two dims at least this large are factored
  adafactor_multiply_by_parameter_scale: bool = True  # scale updates by each leaf's RMS (relative step size)
  muon_ns_steps: int = 5  # muon: Newton–Schulz iterations orthogonalising each update

  def __post_init__(self):
    if self.name not in OPTIMIZERS:
      raise ValueError(f"OptimizerConfig.name={self.name!r}: expected one of {OPTIMIZERS}")
    if self.decay not in SCHEDULES:
      raise ValueError(f"OptimizerConfig.decay={self.decay!r}: expected one of {SCHEDULES}")
    if self.wsd_decay_shape not in WSD_DECAY_SHAPES:
      raise ValueError(f"OptimizerConfig.wsd_decay_shape={self.wsd_decay_shape!r}: expected one of "
                       f"{WSD_DECAY_SHAPES}")
    if not 0.0 < self.decay_fraction <= 1.0:
      raise ValueError(f"OptimizerConfig.decay_fraction={self.decay_fraction} must be in (0, 1]")


def _wsd(peak: float, final: float, stable_steps: int, decay_steps: int, shape: str) -> optax.Schedule:
  """Constant at `peak` for `stable_steps`, then down to `final` over `decay_steps` (linear or 1 − sqrt)."""
  def schedule(count):
    progress = jnp.clip((count - stable_steps) / max(1, decay_steps), 0.0, 1.0)
    fall = progress if shape == "linear" else jnp.sqrt(progress)
    return peak - (peak - final) * fall
  return schedule


def learning_rate_schedule(config: OptimizerConfig, total_steps: int) -> optax.Schedule:
  """Linear warmup to the peak, then the configured decay until `total_steps`.

  WSD's constant stage does not depend on `total_steps`: a run resumed with a larger or smaller TRAIN_STEPS
  keeps its learning rate until the new decay starts, at (1 − decay_fraction)·TRAIN_STEPS.
  """
  warmup = max(0, min(config.warmup_steps, total_steps))
  peak, final = config.learning_rate, config.learning_rate * config.min_lr_ratio
  decay_steps = max(1, total_steps - warmup)
  if config.decay == "cosine":
    after = optax.cosine_decay_schedule(peak, decay_steps, alpha=config.min_lr_ratio)
  elif config.decay == "linear":
    after = optax.linear_schedule(peak, final, decay_steps)
  elif config.decay == "constant":
    after = optax.constant_schedule(peak)
  elif config.decay == "wsd":
    wsd_decay = max(1, math.ceil(config.decay_fraction * total_steps))
    after = _wsd(peak, final, max(0, total_steps - wsd_decay - warmup), wsd_decay, config.wsd_decay_shape)
  else:  # rsqrt: count is the step after warmup; 1/sqrt(steps so far), equal to the peak where warmup ends
    start = max(1, warmup)
    after = lambda count: peak * jnp.sqrt(start / jnp.maximum(count + start, start))
  if warmup == 0:
    return after
  return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup])


def weight_decay_mask(params, decay_embeddings: bool = False):
  """True for leaves the optimizer decays: matrices, never biases or norms; embeddings only if asked."""
  flat = flax.traverse_util.flatten_dict(params)

  def decays(path, leaf):
    name = path[-1]
    if name in ("token_embedding", "position_embedding"):
      return decay_embeddings
    return name == "kernel"

  return flax.traverse_util.unflatten_dict({path: decays(path, leaf) for path, leaf in flat.items()})


# Muon's matrices: the decoder blocks' projection kernels, as (reduction axes, output axes) counted from the end
# (leading stacked axes — layers, experts, q/k/v — are batch axes). Every other leaf trains with AdamW.
MUON_KERNELS = {
    "qkv": ((-4,), (-2, -1)), "key_value": ((-4,), (-2, -1)), "query": ((-3,), (-2, -1)),
    "out": ((-3, -2), (-1,)), "mlp_in": ((-2,), (-1,)), "mlp_gate": ((-2,), (-1,)), "mlp_out": ((-2,), (-1,)),
}


def muon_dimension_numbers(params):
  """A tree like `params`: MuonDimensionNumbers for the blocks' projection kernels, None (AdamW) elsewhere."""
  def spec(path, leaf):
    names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
    if len(names) < 2 or names[-1] != "kernel" or "blocks" not in names or names[-2] not in MUON_KERNELS:
      return None
    reduction, output = MUON_KERNELS[names[-2]]
    ndim = len(leaf.shape)
    return optax_contrib.MuonDimensionNumbers(tuple(ndim + a for a in reduction), tuple(ndim + a for a in output))
  return jax.tree_util.tree_map_with_path(spec, params)


def _direction(config: OptimizerConfig, schedule, mask) -> optax.GradientTransformation:
  """The named optimizer (after clipping) with decoupled, schedule-scaled weight decay on `mask`."""
  wd = config.weight_decay
  if config.name == "adamw":
    return optax.adamw(schedule, b1=config.b1, b2=config.b2, eps=config.eps, weight_decay=wd, mask=mask)
  if config.name == "lion":
    return optax.lion(schedule, b1=config.lion_b1, b2=config.lion_b2, weight_decay=wd, mask=mask)
  if config.name == "adafactor":  # no learning rate inside: decay is added before the schedule scales the update
    return optax.chain(
        optax.adafactor(None, min_dim_size_to_factor=config.adafactor_min_dim_size_to_factor,
                        decay_rate=config.adafactor_decay_rate,
                        multiply_by_parameter_scale=config.adafactor_multiply_by_parameter_scale,
                        clipping_threshold=config.adafactor_clipping_threshold or None, momentum=None,
                        weight_decay_rate=wd or None, weight_decay_mask=mask),
        optax.scale_by_learning_rate(schedule, flip_sign=False))
  if config.name == "sgd":
    chain = [optax.trace(decay=config.momentum, nesterov=config.nesterov)] if config.momentum else []
    return optax.chain(*chain, optax.add_decayed_weights(wd, mask), optax.scale_by_learning_rate(schedule))
  # muon: the blocks' kernels orthogonalised (optax.contrib), every other leaf AdamW with the same mask
  is_spec = lambda x: x is None or isinstance(x, optax_contrib.MuonDimensionNumbers)
  labels = lambda params: jax.tree.map(lambda s: "adam" if s is None else "muon", muon_dimension_numbers(params),
                                       is_leaf=is_spec)
  return optax.partition({
      "muon": optax_contrib.muon(schedule, ns_steps=config.muon_ns_steps, beta=config.momentum, eps=config.eps,
                                 weight_decay=wd, weight_decay_mask=mask, adam_weight_decay=0.0,
                                 muon_weight_dimension_numbers=muon_dimension_numbers),
      "adam": optax.adamw(schedule, b1=config.b1, b2=config.b2, eps=config.eps, weight_decay=wd, mask=mask),
  }, labels)


def make_optimizer(config: OptimizerConfig, total_steps: int) -> optax.GradientTransformation:
  """clip_by_global_norm → the named optimizer (masked decoupled weight decay) under the schedule."""
  schedule = learning_rate_schedule(config, total_steps)
  chain = [optax.clip_by_global_norm(config.clip_norm)] if config.clip_norm > 0 else []
  chain.append(_direction(config, schedule, lambda p: weight_decay_mask(p, config.decay_embeddings)))
  return optax.chain(*chain)
