"""The frozen models a run restores beside its own state, each on the run's mesh by the same rules table and with
every parameter shape checked first: a DPO/GRPO reference, a distillation teacher (its own model config), a LoRA
base; and the warm start of a reward model from a checkpoint without its score head.

`FrozenModels` is a part of `Experiment` (recipes/experiment.py): it reads the run's config, mesh, rules, model
config and boxed parameters from it.
"""

import functools
from typing import Optional

from absl import logging

import flax
import flax.linen as nn
import jax

from t5x_like.model import decoder as model_lib
from t5x_like.model import heads
from t5x_like.parallel import axis_names as ax
from t5x_like.parallel import partitioning
from t5x_like.training import checkpointing
from t5x_like.training import fault_tolerance
from t5x_like.posttrain import lora as lora_lib
from t5x_like.posttrain import distill
from t5x_like.posttrain import preference

# The model config field each logical parameter axis comes from (named in shape-mismatch errors).
AXIS_FIELDS = {ax.VOCAB: "GPTConfig.vocab_size", ax.EMBED: "GPTConfig.d_model", ax.MLP: "GPTConfig.d_ff",
               ax.HEADS: "GPTConfig.num_heads", ax.KV_HEADS: "GPTConfig.num_kv_heads",
               ax.KV: "GPTConfig.d_model / num_heads (head_dim)", ax.LAYERS: "GPTConfig.num_layers",
               ax.POSITION: "GPTConfig.max_len", ax.NORM: "GPTConfig.d_model", ax.EXPERT: "GPTConfig.num_experts"}


class FrozenModels:
  """Restoring frozen models (parameters only, no optimizer state) into an Experiment's `frozen` dict."""

  def load_frozen(self, saved_metadata: Optional[dict], restored_step: Optional[int]) -> dict:
    """Loads the frozen models this run's method reads, before training starts; returns what its checkpoints
    record about them ({'lora': {...}}, {'reference_checkpoint': path}, {'teacher_checkpoint': path}).

    Under LoRA the base: on resume (`saved_metadata` of checkpoint `restored_step`) the one the checkpoint names,
    else INITIAL_CHECKPOINT_PATH's newest step. A DPO/IPO/GRPO reference (REFERENCE_CHECKPOINT_PATH, default
    INITIAL_CHECKPOINT_PATH) and a distillation teacher (TEACHER_CHECKPOINT_PATH) likewise: a resumed run keeps
    those its checkpoints name.
    """
    resumed = saved_metadata is not None or restored_step is not None
    saved = saved_metadata or {}
    ckpt, origin = self.config.checkpoint, {}
    if self.lora:
      base = saved.get("lora", {}).get("base") if resumed else None
      if resumed and not base:
        raise ValueError(f"{checkpointing.checkpoint_dir(self.config.model_dir)}/{restored_step}: a LoRA run's "
                         "checkpoint without the base model's path in its metadata (lora.base)")
      if not resumed and not ckpt.warm_start_from:
        raise ValueError("LoRA (LoraConfig.rank > 0) needs a base model: set INITIAL_CHECKPOINT_PATH "
                         "(CheckpointConfig.warm_start_from) to its MODEL_DIR or checkpoints/<step>")
      pinned = self.load_lora_base(base or ckpt.warm_start_from)
      if resumed and ckpt.warm_start_from and _newest(ckpt.warm_start_from) != pinned:
        logging.warning("resuming a LoRA run over the base its checkpoints name (%s), not INITIAL_CHECKPOINT_PATH's "
                        "newest step (%s)", pinned, _newest(ckpt.warm_start_from))
      origin["lora"] = {"base": pinned, "rank": self.lora.rank, "alpha": self.lora.alpha, "targets": self.lora.targets}
      logging.info("LoRA rank %d (alpha %g) on %d kernels over the frozen base %s", self.lora.rank, self.lora.alpha,
                   len(self.objective.kernel_names), pinned)
    if self.needs_reference:
      origin["reference_checkpoint"] = self.load_reference(saved.get("reference_checkpoint") if resumed else None)
      logging.info("frozen reference model %s", origin["reference_checkpoint"])
    if self.needs_teacher:
      origin["teacher_checkpoint"] = self.load_teacher(saved.get("teacher_checkpoint") if resumed else None)
      logging.info("frozen teacher model %s", origin["teacher_checkpoint"])
    return origin

  @property
  def needs_teacher(self) -> bool:
    """Whether the objective reads the frozen teacher (distillation)."""
    return isinstance(self.model_objective, distill.Distill)

  @functools.cached_property
  def teacher_boxed_params(self):
    """The teacher's abstract parameters, boxed with their logical axis names (nothing allocated)."""
    return self.boxed_params_of(model_lib.GPT(self.teacher_config))

  @functools.cached_property
  def teacher_shardings(self):
    """NamedShardings of the teacher's parameters on this mesh (the same rules table as the model's)."""
    return partitioning.shardings_from_boxed(self.teacher_boxed_params, self.mesh, self.rules)

  def load_teacher(self, path: Optional[str] = None) -> str:
    """Restores the frozen teacher `distill.TEACHER` from `path`, else DistillConfig.teacher_checkpoint
    (TEACHER_CHECKPOINT_PATH), after checking every parameter shape against the teacher's model config;
    returns the checkpoints/<step> read."""
    path = path or self.config.recipe_config.teacher_checkpoint
    what = f"teacher model (TEACHER_CHECKPOINT_PATH, model config {self.teacher_source})"
    pinned = self.check_checkpoint_shapes(path, what, boxed=self.teacher_boxed_params)
    if self.teacher != pinned:
      self.add_frozen(distill.TEACHER, pinned, self.teacher_boxed_params, self.teacher_shardings)
      self.teacher = pinned
    return pinned

  def missing_score_head(self, path: str) -> bool:
    """Whether the checkpoint at `path` lacks the score head this model has: a reward model warm-started from an
    SFT or pre-trained model, whose head then starts fresh (zeros)."""
    if not isinstance(self.model, heads.ScoredGPT):
      return False
    return not heads.has_score_head(checkpointing.state_tree_metadata(
        str(checkpointing.resolve_checkpoint(path)[1])).get("params", {}))

  def warm_start(self, path: str, abstract, with_optimizer: bool):
    """A fresh TrainState with the parameters (and optionally optimizer state) of checkpoint `path`; a score
    head the checkpoint lacks keeps its fresh value."""
    state = self.init_state()
    if not self.missing_score_head(path):
      return fault_tolerance.warm_start(state, path, abstract, with_optimizer)
    if with_optimizer:
      raise ValueError(f"CheckpointConfig.warm_start_optimizer=True with {path}, which has no score head: its "
                       "optimizer state does not fit a reward model; set it False")
    body = {k: v for k, v in abstract.params.items() if k != heads.SCORE_HEAD}
    _, params = checkpointing.restore_params(path, abstract_params=body)
    return state.replace(params={**params, heads.SCORE_HEAD: state.params[heads.SCORE_HEAD]})

  @property
  def needs_reference(self) -> bool:
    """Whether the objective reads the frozen reference model (DPO, IPO; not SimPO or language modelling)."""
    return bool(getattr(self.model_objective, "needs_reference", False))

  def load_reference(self, path: Optional[str] = None) -> str:
    """Restores the frozen reference model `preference.REFERENCE` from `path`, else the recipe's
    reference_checkpoint (REFERENCE_CHECKPOINT_PATH), else CheckpointConfig.warm_start_from
    (INITIAL_CHECKPOINT_PATH), after checking every parameter shape; returns the checkpoints/<step> read."""
    path = path or self.config.recipe_config.reference_checkpoint or self.config.checkpoint.warm_start_from
    if not path:
      raise ValueError(f"the {self.model_objective.loss_type} loss needs a reference model: set "
                       "REFERENCE_CHECKPOINT_PATH (DpoConfig.reference_checkpoint) or INITIAL_CHECKPOINT_PATH")
    pinned = self.check_checkpoint_shapes(path, "reference model (REFERENCE_CHECKPOINT_PATH)")
    if self.reference != pinned and self.shares_lora_base(pinned):
      # under LoRA the reference is the base with the adapters switched off: the same arrays, no second copy
      self.frozen[preference.REFERENCE] = self.frozen[lora_lib.BASE]
      self.frozen_shardings[preference.REFERENCE] = self.frozen_shardings[lora_lib.BASE]
      self.reference = pinned
    elif self.reference != pinned:
      self.add_frozen(preference.REFERENCE, pinned)
      self.reference = pinned
    return pinned

  def shares_lora_base(self, path: Optional[str] = None) -> bool:
    """Whether the reference (at `path`, default the loaded one) is the loaded LoRA base itself."""
    path = path or self.reference
    return bool(self.lora and path and path == self.lora_base)

  def check_checkpoint_shapes(self, path: str, what: str = "initial checkpoint", boxed=None) -> str:
    """Checks every parameter shape of the checkpoint at `path` (a MODEL_DIR or checkpoints/<step>)
    against this model config, before anything restores; returns the checkpoints/<step> checked.

    Raises:
      ValueError: one line naming the parameter path, both shapes and the GPTConfig field.
    """
    boxed = self.boxed_params if boxed is None else boxed  # `boxed`: another model's (a teacher's)
    if boxed is self.boxed_params and self.missing_score_head(path):  # a reward model's head starts fresh
      boxed = {k: v for k, v in boxed.items() if k != heads.SCORE_HEAD}
    flat = flax.traverse_util.flatten_dict(boxed)
    names = {lora_lib.path_name(p): tuple(AXIS_FIELDS.get(n, "") for n in leaf.names)
             for p, leaf in flat.items() if isinstance(leaf, nn.LogicallyPartitioned)}
    return checkpointing.check_param_shapes(path, partitioning.unbox(boxed), names, what)

  def load_lora_base(self, path: str) -> str:
    """Restores the LoRA base model (a MODEL_DIR, checkpoints/<step> or converted checkpoint) as the frozen
    model `lora.BASE`, after checking its shapes; returns the checkpoints/<step> directory it read."""
    pinned = self.check_checkpoint_shapes(path, "LoRA base checkpoint")
    if pinned != self.lora_base:
      _, params = checkpointing.restore_params(pinned, abstract_params=self.abstract_model_params())
      self.frozen[lora_lib.BASE], self.lora_base = params, pinned
    return pinned

  def add_frozen(self, name: str, path: str, boxed=None, shardings=None):
    """Restores a frozen model (a reference or a teacher: parameters only, no optimizer state) from a
    MODEL_DIR or a `checkpoints/<step>` directory onto this mesh, laid out by the same rules table.

    By default it is this run's model, its shapes checked first; a teacher passes its own `boxed` parameters and
    their `shardings` (its config was checked against this run's when the objective was chosen). The parameters
    reach the objective as `frozen[name]`.
    """
    if boxed is None:
      self.check_checkpoint_shapes(path, f"frozen model {name!r}")
      boxed, shardings = self.boxed_params, self.model_shardings
    abstract = checkpointing.abstract_with_shardings(partitioning.unbox(boxed), shardings)
    with self.context():
      _, params = checkpointing.restore_newest_params(path, abstract)
    self.frozen[name], self.frozen_shardings[name] = params, shardings
    return params


def _newest(path: str):
  try:
    return checkpointing.resolve_checkpoint(path)[1]
  except (OSError, ValueError):
    return None
