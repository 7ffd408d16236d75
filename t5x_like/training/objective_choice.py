"""Which objective a run trains (ObjectiveConfig.name), built over the run's model and checked against its DATA_DIR
and settings before anything compiles: language modelling, preference optimisation (DPO / IPO / SimPO), a reward
model (Bradley–Terry), GRPO, or distillation from a frozen teacher whose model config is read from its MODEL_DIR.
"""

import dataclasses
from typing import Any, Optional

from t5x_like.model import decoder as model_lib
from t5x_like.model import heads
from t5x_like.posttrain import rewards
from t5x_like.training.config import TrainConfig
from t5x_like.posttrain import distill
from t5x_like.posttrain import grpo
from t5x_like.training.objectives import language_model
from t5x_like.posttrain import preference
from t5x_like.posttrain import reward


@dataclasses.dataclass(frozen=True)
class Choice:
  """The objective, and for distillation the teacher's model config and the file it was read from."""
  objective: Any
  teacher_config: Optional[model_lib.GPTConfig] = None
  teacher_source: Optional[str] = None


def make_objective(config: TrainConfig, manifest: Optional[dict], model: model_lib.GPT,
                   model_config: model_lib.GPTConfig, *, loss_scaled: bool) -> Choice:
  """The loss over the model's parameters that ObjectiveConfig names.

  Args:
    config: the run; manifest: its DATA_DIR's (None without one); model, model_config: the resolved model.
    loss_scaled: whether the run uses dynamic loss scaling (float16).

  Raises:
    ValueError: one line naming the setting that does not fit the objective.
  """
  name = config.objective.name
  if name == "language_model":
    if manifest is not None and manifest.get("format") == "preference":
      raise ValueError(f"DATA_DIR '{config.data_dir}' holds preference pairs: language modelling would learn the "
                       "rejected answers too; train it with configs/runs/dpo.gin (ObjectiveConfig.name='preference')")
    return Choice(language_model.LanguageModel(
        apply_fn=model.apply, loss_chunk=config.loss_chunk,
        logits_fn=lambda params, hidden: model_lib.project_logits(params, hidden, model_config)))
  if name == "grpo":
    return Choice(_grpo(config, manifest, model))
  if name == "distill":
    return _distill(config, manifest, model, model_config)
  return Choice(_pairs(config, manifest, model, model_config, loss_scaled=loss_scaled))


def _pairs(config, manifest, model, model_config, *, loss_scaled):
  """'preference' or 'reward': both read a preference DATA_DIR's rows of pairs."""
  name = f"ObjectiveConfig.name={config.objective.name!r}"
  if manifest is not None and manifest.get("format") != "preference":
    raise ValueError(f"{name} reads a preference DATA_DIR (python -m t5x_like.preprocess "
                     f"--format=preference): DATA_DIR '{config.data_dir}' has format "
                     f"{manifest.get('format', 'text')!r}")
  if config.curriculum.enabled():
    raise ValueError(f"{name} with a sequence-length warmup (CurriculumConfig): cutting "
                     "rows would split pairs; turn the warmup off")
  if loss_scaled:
    raise ValueError(f"{name} with dynamic loss scaling (float16): not supported, the "
                     "scaled step normalises by tokens, not pairs; use bfloat16 or float32")
  max_pairs = int((manifest or {}).get("max_pairs_per_row") or 1)
  if config.objective.name == "reward":
    if config.lora.rank:
      raise ValueError("ObjectiveConfig.name='reward' with LoRA (LoraConfig.rank > 0): the new score head would not "
                       "train; use full or selective fine-tuning")
    return reward.Reward(model.apply, lambda params, hidden: heads.project_scores(params, hidden, model_config),
                         max_pairs=max_pairs)
  objective = config.objective
  return preference.Preference(model.apply, loss_type=objective.loss_type, beta=objective.beta,
                               gamma=objective.gamma, max_pairs=max_pairs)


def _grpo(config, manifest, model):
  """GRPO over rollouts of a chat DATA_DIR's prompts (posttrain/rollout.py)."""
  objective = config.objective
  if manifest is not None and manifest.get("format") != "chat":
    raise ValueError(f"ObjectiveConfig.name='grpo' samples answers to the prompts of a chat DATA_DIR (python -m "
                     f"t5x_like.preprocess --format=chat): DATA_DIR '{config.data_dir}' has format "
                     f"{manifest.get('format', 'text')!r}")
  if objective.num_generations < 2:
    raise ValueError(f"ObjectiveConfig.num_generations={objective.num_generations}: GRPO compares each sample with "
                     "the others of its group, so a group needs at least 2 samples")
  if config.batch_size % objective.num_generations:
    raise ValueError(f"BATCH_SIZE={config.batch_size} is not a multiple of ObjectiveConfig.num_generations="
                     f"{objective.num_generations} (BATCH_SIZE = prompts per step × samples per prompt)")
  if objective.max_new_tokens < 1 or objective.max_new_tokens > config.seq_len:
    raise ValueError(f"ObjectiveConfig.max_new_tokens={objective.max_new_tokens} must be in [1, SEQ_LEN="
                     f"{config.seq_len}]")
  if config.curriculum.enabled():
    raise ValueError("ObjectiveConfig.name='grpo' with a sequence-length warmup (CurriculumConfig): rollout rows "
                     "are not cut; turn the warmup off")
  rewards.get(objective.reward)  # an unregistered name is an error now, not after the first rollout
  # one update per rollout batch: the sampling policy is the current one (no forward pass for old log-probs)
  return grpo.Grpo(model.apply, clip_epsilon=objective.clip_epsilon, beta=objective.beta, on_policy=True)


def _distill(config, manifest, model, model_config) -> Choice:
  """Distillation from the teacher TEACHER_CHECKPOINT_PATH names: its model config is read from its MODEL_DIR
  (model.gin or config.gin) and checked against this run's (the vocabulary)."""
  path = config.objective.teacher_checkpoint
  if not path:
    raise ValueError("ObjectiveConfig.name='distill' needs a teacher: set TEACHER_CHECKPOINT_PATH "
                     "(ObjectiveConfig.teacher_checkpoint) to its MODEL_DIR, checkpoints/<step> or converted checkpoint")
  if manifest is not None and manifest.get("format") == "preference":
    raise ValueError(f"DATA_DIR '{config.data_dir}' holds preference pairs: distillation would learn the rejected "
                     "answers too; distil on text or chat data")
  teacher_config, source = distill.saved_model_config(path, model_config)
  teacher_config = dataclasses.replace(teacher_config, num_stages=model_config.num_stages)
  distill.check_teacher_config(teacher_config, model_config, source)
  teacher = model_lib.GPT(teacher_config)
  objective = distill.Distill(
      model.apply, lambda params, hidden: model_lib.project_logits(params, hidden, model_config),
      teacher.apply, lambda params, hidden: model_lib.project_logits(params, hidden, teacher_config),
      alpha=config.objective.distill_alpha, temperature=config.objective.distill_temperature,
      loss_chunk=config.loss_chunk)
  return Choice(objective, teacher_config, source)
