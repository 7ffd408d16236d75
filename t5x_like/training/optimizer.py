"""optax AdamW with warmup + decay schedules, global-norm clipping and a weight-decay mask."""

import dataclasses

import flax
import optax

SCHEDULES = ("cosine", "linear", "constant")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """AdamW and its learning-rate schedule."""
  learning_rate: float = 6e-4  # peak learning rate, reached at the end of warmup
  warmup_steps: int = 100  # linear warmup from 0 to the peak
  decay: str = "cosine"  # after warmup: cosine | linear | constant
  min_lr_ratio: float = 0.1  # final learning rate as a fraction of the peak (cosine/linear)
  b1: float = 0.9  # AdamW first-moment decay
  b2: float = 0.95  # AdamW second-moment decay
  eps: float = 1e-8  # AdamW epsilon
  weight_decay: float = 0.1  # decoupled weight decay on decayed leaves
  decay_embeddings: bool = False  # also decay token/position embeddings
  clip_norm: float = 1.0  # global gradient-norm clip; 0 disables


def learning_rate_schedule(config: OptimizerConfig, total_steps: int) -> optax.Schedule:
  """Linear warmup to the peak, then the configured decay until `total_steps`."""
  if config.decay not in SCHEDULES:
    raise ValueError(f"OptimizerConfig.decay={config.decay!r}: expected one of {SCHEDULES}")
  warmup = max(0, min(config.warmup_steps, total_steps))
  peak, final = config.learning_rate, config.learning_rate * config.min_lr_ratio
  decay_steps = max(1, total_steps - warmup)
  after = {
      "cosine": optax.cosine_decay_schedule(peak, decay_steps, alpha=config.min_lr_ratio),
      "linear": optax.linear_schedule(peak, final, decay_steps),
      "constant": optax.constant_schedule(peak),
  }[config.decay]
  if warmup == 0:
    return after
  return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup])


def weight_decay_mask(params, decay_embeddings: bool = False):
  """True for leaves AdamW decays: matrices, never biases or norms; embeddings only if asked."""
  flat = flax.traverse_util.flatten_dict(params)

  def decays(path, leaf):
    name = path[-1]
    if name in ("token_embedding", "position_embedding"):
      return decay_embeddings
    return name == "kernel"

  return flax.traverse_util.unflatten_dict({path: decays(path, leaf) for path, leaf in flat.items()})


def make_optimizer(config: OptimizerConfig, total_steps: int) -> optax.GradientTransformation:
  """clip_by_global_norm → AdamW (masked weight decay) under the schedule."""
  schedule = learning_rate_schedule(config, total_steps)
  chain = []
  if config.clip_norm > 0:
    chain.append(optax.clip_by_global_norm(config.clip_norm))
  chain.append(optax.adamw(schedule, b1=config.b1, b2=config.b2, eps=config.eps,
                           weight_decay=config.weight_decay,
                           mask=lambda p: weight_decay_mask(p, config.decay_embeddings)))
  return optax.chain(*chain)
