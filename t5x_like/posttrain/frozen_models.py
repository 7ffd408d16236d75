"""The frozen models a run restores beside its own state, each on the run's mesh by the same rules table and with
every parameter shape checked first: the models a recipe declares (`Frozen`: a DPO/GRPO reference, a distillation
teacher with its own model config), a LoRA base; and the warm start of a reward model from a checkpoint without its
score head.

`FrozenModels` is a part of `Experiment` (recipes/experiment.py): it reads the run's config, mesh, rules, model
config, boxed parameters and the recipe's `Frozen` declarations from it. It knows no method by name.
"""

import dataclasses
import functools
from typing import Optional

from absl import logging

import flax
import flax.linen as nn
import jax

from t5x_like.model import decoder as model_lib
from t5x_like.model import heads
from t5x_like.model import pipeline_parallel
from t5x_like.parallel import axis_names as ax
from t5x_like.parallel import partitioning
from t5x_like.training import checkpointing
from t5x_like.training import fault_tolerance
from t5x_like.training import train_state as train_state_lib
from t5x_like.posttrain import lora as lora_lib
from t5x_like.posttrain import quantize

# The model config field each logical parameter axis comes from (named in shape-mismatch errors).
AXIS_FIELDS = {ax.VOCAB: "GPTConfig.vocab_size", ax.EMBED: "GPTConfig.d_model", ax.MLP: "GPTConfig.d_ff",
               ax.HEADS: "GPTConfig.num_heads", ax.KV_HEADS: "GPTConfig.num_kv_heads",
               ax.KV: "GPTConfig.attention_head_dim (head_dim; 0: d_model / num_heads)",
               ax.LAYERS: "GPTConfig.num_layers",
               ax.POSITION: "GPTConfig.max_len", ax.NORM: "GPTConfig.d_model", ax.EXPERT: "GPTConfig.num_experts"}


NO_LORA_BASE = ("LoRA (LoraConfig.rank > 0) needs a base model: set INITIAL_CHECKPOINT_PATH "
                "(CheckpointConfig.warm_start_from) to its MODEL_DIR or checkpoints/<step>")


@dataclasses.dataclass(frozen=True)
class Frozen:
  """A frozen model a recipe's objective reads as `frozen[name]` (recipe.frozen_models(run) declares it)."""
  name: str  # its key in the objective's `frozen` ('reference', 'teacher'); also its start-up report line
  path: str  # the configured checkpoint: a MODEL_DIR, checkpoints/<step> or converted checkpoint ('' = none set)
  what: str  # in errors and logs: "reference model (REFERENCE_CHECKPOINT_PATH)"
  missing: str  # the one-line error when `path` is empty
  # None: the run's own model (under LoRA, the base itself when `path` is the base: the adapters switched off,
  # no second copy); else its own model config (a larger teacher), laid out by the same rules
  model_config: Optional[model_lib.GPTConfig] = None

  @property
  def record(self) -> str:
    """The metadata key the run's checkpoints pin it under, so that a resumed run keeps it."""
    return f"{self.name}_checkpoint"


class FrozenModels:
  """Restoring frozen models (parameters only, no optimizer state) into an Experiment's `frozen` dict.

  The Experiment sets `frozen_specs` (its recipe's `Frozen` declarations), `frozen`, `frozen_shardings`, `loaded`
  ({name: the checkpoints/<step> read}), `lora` and `lora_base`.
  """

  def load_frozen(self, saved_metadata: Optional[dict], restored_step: Optional[int]) -> dict:
    """Loads the frozen models this run's method reads, before training starts; returns what its checkpoints
    record about them ({'lora': {...}}, {'reference_checkpoint': path}, {'teacher_checkpoint': path}).

    Under LoRA the base: on resume (`saved_metadata` of checkpoint `restored_step`) the one the checkpoint names,
    else INITIAL_CHECKPOINT_PATH's newest step. Each model the recipe declares likewise: a resumed run keeps the
    one its checkpoints name, a fresh run reads the configured path.
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
        raise ValueError(NO_LORA_BASE)
      pinned = self.load_lora_base(base or ckpt.warm_start_from)
      if resumed and ckpt.warm_start_from and _newest(ckpt.warm_start_from) != pinned:
        logging.warning("resuming a LoRA run over the base its checkpoints name (%s), not INITIAL_CHECKPOINT_PATH's "
                        "newest step (%s)", pinned, _newest(ckpt.warm_start_from))
      origin["lora"] = {"base": pinned, "rank": self.lora.rank, "alpha": self.lora.alpha, "targets": self.lora.targets,
                        "marker_ids": list(self.objective.marker_ids), "base_precision": self.lora.base_precision}
      logging.info("LoRA rank %d (alpha %g) on %d kernels over the frozen base %s", self.lora.rank, self.lora.alpha,
                   len(self.objective.kernel_names), pinned)
      if self.objective.marker_ids:
        logging.info("LoRA also trains the embedding/output rows of the chat template's marker tokens %s "
                     "(LoraConfig.marker_rows)", list(self.objective.marker_ids))
    for spec in self.frozen_specs:
      origin[spec.record] = self.load_frozen_model(spec.name, saved.get(spec.record) if resumed else None)
      logging.info("frozen %s %s", spec.what, origin[spec.record])
    return origin

  def frozen_spec(self, name: str) -> Frozen:
    """The recipe's declaration of frozen model `name`."""
    for spec in self.frozen_specs:
      if spec.name == name:
        return spec
    raise ValueError(f"this run's method reads no frozen model {name!r} (it reads: "
                     f"{', '.join(s.name for s in self.frozen_specs) or 'none'})")

  def frozen_layout(self, spec: Frozen):
    """(boxed abstract parameters, shardings) of a declared frozen model: the run's own, or its model config's
    laid out by the same rules table (nothing allocated)."""
    if spec.model_config is None:
      return self.boxed_params, self.model_shardings
    if spec.name not in self._frozen_layouts:
      boxed = self.boxed_params_of(model_lib.GPT(spec.model_config))
      self._frozen_layouts[spec.name] = boxed, partitioning.shardings_from_boxed(boxed, self.mesh, self.rules)
    return self._frozen_layouts[spec.name]

  def load_frozen_model(self, name: str, path: Optional[str] = None) -> str:
    """Restores the declared frozen model `name` from `path`, else its configured path, after checking every
    parameter shape; returns the checkpoints/<step> read. The run's own model at the LoRA base's path is the base
    itself (the adapters switched off): the same arrays, no second copy."""
    spec = self.frozen_spec(name)
    path = path or spec.path
    if not path:
      raise ValueError(spec.missing)
    boxed, shardings = self.frozen_layout(spec)
    pinned = self.check_checkpoint_shapes(path, spec.what, boxed=boxed)
    if self.loaded.get(name) == pinned:
      return pinned
    if spec.model_config is None and self.lora and pinned == self.lora_base:
      self.frozen[name], self.frozen_shardings[name] = self.frozen[lora_lib.BASE], self.frozen_shardings[lora_lib.BASE]
    else:
      self.add_frozen(name, pinned, boxed, shardings, spec.model_config)
    self.loaded[name] = pinned
    return pinned

  def shares_lora_base(self, name: str) -> bool:
    """Whether frozen model `name` is loaded as the LoRA base itself (no bytes of its own)."""
    return bool(self.lora and self.loaded.get(name) and self.loaded[name] == self.lora_base)

  def frozen_report(self) -> dict:
    """memory/frozen_<name>_bytes_per_device of each declared frozen model with arrays of its own."""
    report = {}
    for spec in self.frozen_specs:
      if not self.shares_lora_base(spec.name):
        boxed, shardings = self.frozen_layout(spec)
        report[f"memory/frozen_{spec.name}_bytes_per_device"] = train_state_lib.bytes_per_device(
            partitioning.unbox(boxed), shardings)
    return report

  def load_pinned_frozen(self, checkpoint_path: str) -> None:
    """Loads each declared frozen model that the checkpoint at `checkpoint_path` names in its metadata (the ones
    its run trained against), else the configured one."""
    try:
      saved = checkpointing.read_metadata(checkpoint_path)
    except Exception:  # pylint: disable=broad-except  # a parameters-only checkpoint may have no metadata
      saved = {}
    for spec in self.frozen_specs:
      self.load_frozen_model(spec.name, saved.get(spec.record))

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
    if not self.missing_score_head(path):
      return fault_tolerance.warm_start(path, abstract, with_optimizer, self.state_around)
    state = self.init_state()
    if with_optimizer:
      raise ValueError(f"CheckpointConfig.warm_start_optimizer=True with {path}, which has no score head: its "
                       "optimizer state does not fit a reward model; set it False")
    body = {k: v for k, v in abstract.params.items() if k != heads.SCORE_HEAD}
    _, params = checkpointing.restore_params(path, abstract_params=body)
    return state.replace(params={**params, heads.SCORE_HEAD: state.params[heads.SCORE_HEAD]})

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
      params = self.stage_order_of(params)  # the state's adapters are in the model's order
      if self.lora.base_precision != "float32":  # stored in fewer bits (QLoRA), laid out by the same rules
        store = jax.jit(functools.partial(quantize.quantize_params, precision=self.lora.base_precision),
                        out_shardings=self.frozen_shardings[lora_lib.BASE])
        with self.context():
          params = store(params)
      self.frozen[lora_lib.BASE], self.lora_base = params, pinned
    return pinned

  def add_frozen(self, name: str, path: str, boxed=None, shardings=None, model_config=None):
    """Restores a frozen model (a reference or a teacher: parameters only, no optimizer state) from a
    MODEL_DIR or a `checkpoints/<step>` directory onto this mesh, laid out by the same rules table.

    By default it is this run's model, its shapes checked first; a teacher passes its own `boxed` parameters and
    their `shardings` (its config was checked against this run's when the objective was chosen). The parameters
    reach the objective as `frozen[name]`, their blocks in the order of the model that runs them (`model_config`,
    default this run's: stage order under its interleaved pipeline).
    """
    if boxed is None:
      self.check_checkpoint_shapes(path, f"frozen model {name!r}")
      boxed, shardings = self.boxed_params, self.model_shardings
    abstract = checkpointing.abstract_with_shardings(partitioning.unbox(boxed), shardings)
    with self.context():
      _, params = checkpointing.restore_newest_params(path, abstract)
    params = pipeline_parallel.reorder_blocks(model_config or self.model_config, params, to_stage=True, donate=True)
    self.frozen[name], self.frozen_shardings[name] = params, shardings
    return params


def _newest(path: str):
  try:
    return checkpointing.resolve_checkpoint(path)[1]
  except (OSError, ValueError):
    return None
