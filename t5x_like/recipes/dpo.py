"""The DPO family on a preference DATA_DIR: DPO (sigmoid), IPO and the reference-free SimPO (posttrain/preference.py).

DPO and IPO train the policy against a frozen reference (REFERENCE_CHECKPOINT_PATH, default the
INITIAL_CHECKPOINT_PATH the policy starts from); a resumed run keeps the reference its checkpoints name.
Gin: configs/runs/dpo.gin.
"""

import dataclasses

from t5x_like.model import decoder
from t5x_like.posttrain import preference
from t5x_like.recipes import base

NAME = "TrainConfig.recipe='dpo'"


@dataclasses.dataclass(frozen=True)
class DpoConfig(base.ReferenceConfig):
  """Preference optimisation (gin: `dpo.DpoConfig`)."""
  loss_type: str = "sigmoid"  # 'sigmoid' (DPO), 'ipo', 'simpo' (reference-free)
  beta: float = 0.1  # β: DPO/IPO: strength of the implicit KL to the reference; SimPO: reward scale
  gamma: float = 0.5  # SimPO's target reward margin γ

  def make_objective(self, run, *, loss_scaled: bool):
    max_pairs = base.check_pairs(run, loss_scaled, NAME)
    return preference.Preference(run.model.apply, loss_type=self.loss_type, beta=self.beta, gamma=self.gamma,
                                 max_pairs=max_pairs, logits_fn=decoder.logits_projection(run.model_config),
                                 loss_chunk=run.config.loss_chunk, moe=run.model_config.num_experts > 0)


CONFIG = DpoConfig
