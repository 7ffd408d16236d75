"""GRPO: G samples per prompt of a chat DATA_DIR, rewarded by a registered function, group-relative advantages,
a clipped policy ratio and a KL term to a frozen reference (posttrain/grpo.py, rollouts in posttrain/rollout.py).
Gin: configs/runs/grpo.gin.
"""

import dataclasses
import functools

from t5x_like.posttrain import grpo
from t5x_like.posttrain import rollout
from t5x_like.recipes import base

NAME = "TrainConfig.recipe='grpo'"


@dataclasses.dataclass(frozen=True)
class GrpoConfig(base.RolloutConfig):
  """GRPO (gin: `grpo.GrpoConfig`); BATCH_SIZE = prompts per step × num_generations."""
  kl_beta: float = 0.1  # weight of the KL term to the frozen reference (0 = no reference loaded)
  num_generations: int = 8  # G: samples per prompt (a group)
  clip_epsilon: float = 0.2  # the policy ratio is clipped to [1 − ε, 1 + ε]

  def make_objective(self, run, *, loss_scaled: bool):
    del loss_scaled
    if self.num_generations < 2:
      raise ValueError(f"GrpoConfig.num_generations={self.num_generations}: GRPO compares each sample with the "
                       "others of its group, so a group needs at least 2 samples")
    self.check_rollouts(run, NAME, run.config.batch_size)
    # one update per rollout batch: the sampling policy is the current one (no forward pass for old log-probs)
    return grpo.Grpo(run.model.apply, clip_epsilon=self.clip_epsilon, beta=self.kl_beta, on_policy=True)

  def rollouts(self, run) -> rollout.Rollouts:
    """The run's prompts, sampler and rewards, built once per run (they read the DATA_DIR's prompts)."""
    return run.part("rollouts", lambda: rollout.Rollouts(run, play=self.play_fn()))

  def batches(self, run, next_batch):
    """Each step's batch is sampled from the parameters it starts from: (batch, host metrics)."""
    del next_batch
    rollouts = self.rollouts(run)
    return lambda step: functools.partial(rollouts.batch, step=step)

  def evaluate(self, run, params) -> dict:
    """Greedy answers to the validation prompts, scored by the reward function."""
    return self.rollouts(run).evaluate(params)


CONFIG = GrpoConfig
