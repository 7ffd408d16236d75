"""What the recipes share: the reference-model setting of DPO and GRPO, and the DATA_DIR format check."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class ReferenceConfig:
  """Methods trained against a frozen reference model (DPO/IPO, GRPO's KL term)."""
  # the frozen reference model (REFERENCE_CHECKPOINT_PATH): a MODEL_DIR, checkpoints/<step> or converted checkpoint;
  # '' = CheckpointConfig.warm_start_from (INITIAL_CHECKPOINT_PATH)
  reference_checkpoint: str = ""


def check_format(run, expected: str, what: str) -> None:
  """A one-line error when the run's DATA_DIR is not of format `expected` (`what` names the setting)."""
  manifest = run.manifest
  if manifest is not None and manifest.get("format", "text") != expected:
    raise ValueError(f"{what} reads a {expected} DATA_DIR (python -m t5x_like.preprocess --format={expected}): "
                     f"DATA_DIR '{run.config.data_dir}' has format {manifest.get('format', 'text')!r}")
