"""Distillation: α·T²·KL(teacher_T ‖ student_T) + (1 − α)·CE from a frozen teacher (posttrain/distill.py).

The teacher (TEACHER_CHECKPOINT_PATH) may be larger: its model config is read from its MODEL_DIR (model.gin or
config.gin) and checked against this run's (the vocabulary); it is laid out on the run's mesh by the same
rules. A resumed run keeps the teacher its checkpoints name. Gin: configs/runs/distill.gin.
"""

import dataclasses

from t5x_like.model import decoder as model_lib
from t5x_like.posttrain import distill
from t5x_like.posttrain import frozen_models
from t5x_like.recipes import base


@dataclasses.dataclass(frozen=True)
class DistillConfig(base.Recipe):
  """Distillation (gin: `distill.DistillConfig`)."""
  # the frozen teacher (TEACHER_CHECKPOINT_PATH): a MODEL_DIR, checkpoints/<step> or converted checkpoint
  teacher_checkpoint: str = ""
  alpha: float = 0.5  # α: weight of the KL term (1 − α on cross-entropy)
  temperature: float = 2.0  # T: both distributions are softened by it

  def make_objective(self, run, *, loss_scaled: bool):
    del loss_scaled
    if not self.teacher_checkpoint:
      raise ValueError("TrainConfig.recipe='distill' needs a teacher: set TEACHER_CHECKPOINT_PATH "
                       "(DistillConfig.teacher_checkpoint) to its MODEL_DIR, checkpoints/<step> or converted checkpoint")
    if run.manifest is not None and run.manifest.get("format") == "preference":
      raise ValueError(f"DATA_DIR '{run.config.data_dir}' holds preference pairs: distillation would learn the "
                       "rejected answers too; distil on text or chat data")
    teacher_config, _ = self.teacher(run)
    teacher = model_lib.GPT(teacher_config)
    objective = distill.Distill(
        run.model.apply, model_lib.logits_projection(run.model_config),
        teacher.apply, model_lib.logits_projection(teacher_config),
        alpha=self.alpha, temperature=self.temperature, loss_chunk=run.config.loss_chunk,
        moe=run.model_config.num_experts > 0)
    return objective

  def frozen_models(self, run) -> tuple:
    teacher_config, source = self.teacher(run)
    return (frozen_models.Frozen(
        name=distill.TEACHER, path=self.teacher_checkpoint, model_config=teacher_config,
        what=f"teacher model (TEACHER_CHECKPOINT_PATH, model config {source})",
        missing="TrainConfig.recipe='distill' needs a teacher: set TEACHER_CHECKPOINT_PATH "
                "(DistillConfig.teacher_checkpoint) to its MODEL_DIR, checkpoints/<step> or converted checkpoint"),)

  def teacher(self, run):
    """(the teacher's model config, the file it was read from), checked against `run`'s model config."""
    teacher_config, source = distill.saved_model_config(self.teacher_checkpoint, run.model_config)
    teacher_config = dataclasses.replace(teacher_config, num_stages=run.model_config.num_stages)
    distill.check_teacher_config(teacher_config, run.model_config, source)
    return teacher_config, source


CONFIG = DistillConfig
