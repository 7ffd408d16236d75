"""ORPO on a preference DATA_DIR: SFT plus an odds-ratio term, reference-free (posttrain/orpo.py).

No reference model is loaded: the policy (usually warm-started from an SFT model, INITIAL_CHECKPOINT_PATH, or
from a base model: ORPO's point is that its NLL term does the SFT) is the only model. Gin: configs/runs/orpo.gin.
"""

import dataclasses

from t5x_like.posttrain import orpo
from t5x_like.recipes import base

NAME = "TrainConfig.recipe='orpo'"


@dataclasses.dataclass(frozen=True)
class OrpoConfig(base.Recipe):
  """Odds-ratio preference optimisation (gin: `orpo.OrpoConfig`)."""
  lambda_: float = 0.1  # λ: the weight of the odds-ratio term beside the chosen responses' NLL (TRL's `beta`)

  def make_objective(self, run, *, loss_scaled: bool):
    max_pairs = base.check_pairs(run, loss_scaled, NAME)
    return orpo.Orpo(run.model.apply, lambda_=self.lambda_, max_pairs=max_pairs)


CONFIG = OrpoConfig
