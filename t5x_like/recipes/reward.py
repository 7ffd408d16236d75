"""Reward model: the decoder with a scalar score head (model/heads.py), trained with the Bradley–Terry loss
on a preference DATA_DIR's chosen/rejected pairs (posttrain/reward.py). Gin: configs/runs/reward.gin.

The model is `heads.ScoredGPT` (the runtime builds it when `scored_model` is set); warm-started from a checkpoint
without a score head (an SFT model), the head starts at zero (posttrain/frozen_models.py).
"""

import dataclasses

from t5x_like.model import heads
from t5x_like.posttrain import reward
from t5x_like.recipes import base

NAME = "TrainConfig.recipe='reward'"


@dataclasses.dataclass(frozen=True)
class RewardConfig(base.Recipe):
  """The reward model (gin: `reward.RewardConfig`): no settings beyond the run's."""
  scored_model = True  # the model carries the score head (a class constant, not a gin setting)

  def make_objective(self, run, *, loss_scaled: bool):
    max_pairs = base.check_pairs(run, loss_scaled, NAME)
    if run.config.use_lora:
      raise ValueError(f"{NAME} with LoRA (LoraConfig.rank > 0): the new score head would not train; use full or "
                       "selective fine-tuning")
    cfg = run.model_config
    return reward.Reward(run.model.apply, lambda params, hidden: heads.project_scores(params, hidden, cfg),
                         max_pairs=max_pairs, moe=cfg.num_experts > 0)


CONFIG = RewardConfig
