"""What the recipes share: the recipe protocol, the reference model of DPO and GRPO, the DATA_DIR format check,
the pair checks."""

import dataclasses

from t5x_like.posttrain import frozen_models
from t5x_like.posttrain import preference
from t5x_like.training import config as config_lib

Recipe = config_lib.Recipe  # the protocol every recipe config follows (defaults: language modelling's)


@dataclasses.dataclass(frozen=True)
class ReferenceConfig(Recipe):
  """Methods trained against a frozen reference model (DPO/IPO, GRPO's KL term), when their objective reads one
  (`needs_reference`: not SimPO, not GRPO without its KL term)."""
  # the frozen reference model (REFERENCE_CHECKPOINT_PATH): a MODEL_DIR, checkpoints/<step> or converted checkpoint;
  # '' = CheckpointConfig.warm_start_from (INITIAL_CHECKPOINT_PATH)
  reference_checkpoint: str = ""

  def frozen_models(self, run) -> tuple:
    if not getattr(run.model_objective, "needs_reference", False):
      return ()
    loss = getattr(run.model_objective, "loss_type", run.config.recipe)
    return (frozen_models.Frozen(
        name=preference.REFERENCE, path=self.reference_checkpoint or run.config.checkpoint.warm_start_from,
        what="reference model (REFERENCE_CHECKPOINT_PATH)",
        missing=f"the {loss} loss needs a reference model: set REFERENCE_CHECKPOINT_PATH "
                f"({type(self).__name__}.reference_checkpoint) or INITIAL_CHECKPOINT_PATH"),)


def check_format(run, expected: str, what: str) -> None:
  """A one-line error when the run's DATA_DIR is not of format `expected` (`what` names the setting)."""
  manifest = run.manifest
  if manifest is not None and manifest.get("format", "text") != expected:
    raise ValueError(f"{what} reads a {expected} DATA_DIR (python -m t5x_like.preprocess --format={expected}): "
                     f"DATA_DIR '{run.config.data_dir}' has format {manifest.get('format', 'text')!r}")


def check_pairs(run, loss_scaled: bool, what: str) -> int:
  """The checks of a method trained on preference pairs (DPO family, reward model); returns the pairs a row holds.

  Raises:
    ValueError: one line naming the setting that does not fit pairs.
  """
  check_format(run, "preference", what)
  if run.config.curriculum.enabled():
    raise ValueError(f"{what} with a sequence-length warmup (CurriculumConfig): cutting rows would split pairs; "
                     "turn the warmup off")
  if loss_scaled:
    raise ValueError(f"{what} with dynamic loss scaling (float16): not supported, the scaled step normalises by "
                     "tokens, not pairs; use bfloat16 or float32")
  return int((run.manifest or {}).get("max_pairs_per_row") or 1)
