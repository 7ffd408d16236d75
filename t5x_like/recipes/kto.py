"""KTO against a frozen reference (posttrain/kto.py), on an unpaired DATA_DIR (`preprocess --format=unpaired`:
prompt, completion and a true/false label per line) or a preference DATA_DIR, each pair read as a desirable
(chosen) and an undesirable (rejected) example.

The reference is REFERENCE_CHECKPOINT_PATH, default the INITIAL_CHECKPOINT_PATH the policy starts from; a resumed
run keeps the reference its checkpoints name. Gin: configs/runs/kto.gin.
"""

import dataclasses

from t5x_like.posttrain import kto
from t5x_like.recipes import base

NAME = "TrainConfig.recipe='kto'"


@dataclasses.dataclass(frozen=True)
class KtoConfig(base.ReferenceConfig):
  """Kahneman–Tversky optimisation (gin: `kto.KtoConfig`)."""
  beta: float = 0.1  # β: the scale of the policy/reference log-ratio in the value function
  desirable_weight: float = 1.0  # λ_D: the weight of a desirable (chosen) response's loss
  undesirable_weight: float = 1.0  # λ_U: the weight of an undesirable (rejected) response's loss

  def make_objective(self, run, *, loss_scaled: bool):
    max_pairs = base.check_pairs(run, loss_scaled, NAME, unpaired_ok=True)
    return kto.Kto(run.model.apply, beta=self.beta, desirable_weight=self.desirable_weight,
                   undesirable_weight=self.undesirable_weight, max_pairs=max_pairs)


CONFIG = KtoConfig
