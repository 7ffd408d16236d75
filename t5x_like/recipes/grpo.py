"""GRPO: G samples per prompt of a chat DATA_DIR, rewarded by a registered function, group-relative advantages,
a clipped policy ratio and a KL term to a frozen reference (posttrain/grpo.py, rollouts in posttrain/rollout.py).
Gin: configs/runs/grpo.gin.
"""

import dataclasses
import functools

from t5x_like.posttrain import grpo
from t5x_like.posttrain import rewards
from t5x_like.posttrain import rollout
from t5x_like.recipes import base

NAME = "TrainConfig.recipe='grpo'"


@dataclasses.dataclass(frozen=True)
class GrpoConfig(base.ReferenceConfig):
  """GRPO (gin: `grpo.GrpoConfig`); BATCH_SIZE = prompts per step × num_generations."""
  kl_beta: float = 0.1  # weight of the KL term to the frozen reference (0 = no reference loaded)
  num_generations: int = 8  # G: samples per prompt (a group)
  clip_epsilon: float = 0.2  # the policy ratio is clipped to [1 − ε, 1 + ε]
  reward: str = "exact_match"  # a registered reward function (posttrain/rewards.py): exact_match, format, reward_model
  reward_format: str = ""  # the `format` reward's regex: 1 when the whole completion matches it
  reward_checkpoint: str = ""  # the `reward_model` reward: a reward model's MODEL_DIR (configs/runs/reward.gin)
  max_new_tokens: int = 16  # rollout length budget per completion
  temperature: float = 1.0  # rollout sampling temperature (evaluation is greedy)
  top_k: int = 0  # rollout sampling: only the k most likely tokens (0 = all)

  def make_objective(self, run, *, loss_scaled: bool):
    del loss_scaled
    config = run.config
    if run.manifest is not None and run.manifest.get("format") != "chat":
      raise ValueError(f"{NAME} samples answers to the prompts of a chat DATA_DIR (python -m t5x_like.preprocess "
                       f"--format=chat): DATA_DIR '{config.data_dir}' has format "
                       f"{run.manifest.get('format', 'text')!r}")
    if self.num_generations < 2:
      raise ValueError(f"GrpoConfig.num_generations={self.num_generations}: GRPO compares each sample with the "
                       "others of its group, so a group needs at least 2 samples")
    if config.batch_size % self.num_generations:
      raise ValueError(f"BATCH_SIZE={config.batch_size} is not a multiple of GrpoConfig.num_generations="
                       f"{self.num_generations} (BATCH_SIZE = prompts per step × samples per prompt)")
    if self.max_new_tokens < 1 or self.max_new_tokens > config.seq_len:
      raise ValueError(f"GrpoConfig.max_new_tokens={self.max_new_tokens} must be in [1, SEQ_LEN={config.seq_len}]")
    if config.curriculum.enabled():
      raise ValueError(f"{NAME} with a sequence-length warmup (CurriculumConfig): rollout rows are not cut; turn "
                       "the warmup off")
    rewards.get(self.reward)  # an unregistered name is an error now, not after the first rollout
    # one update per rollout batch: the sampling policy is the current one (no forward pass for old log-probs)
    return grpo.Grpo(run.model.apply, clip_epsilon=self.clip_epsilon, beta=self.kl_beta, on_policy=True)

  def rollouts(self, run) -> rollout.Rollouts:
    """The run's prompts, sampler and rewards, built once per run (they read the DATA_DIR's prompts)."""
    return run.part("rollouts", lambda: rollout.Rollouts(run))

  def batches(self, run, next_batch):
    """Each step's batch is sampled from the parameters it starts from: (batch, host metrics)."""
    del next_batch
    rollouts = self.rollouts(run)
    return lambda step: functools.partial(rollouts.batch, step=step)

  def evaluate(self, run, params) -> dict:
    """Greedy answers to the validation prompts, scored by the reward function."""
    return self.rollouts(run).evaluate(params)


CONFIG = GrpoConfig
