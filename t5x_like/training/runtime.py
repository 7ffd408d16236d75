"""A run's runtime: mesh, axis rules, resolved model config, model, parameter layout, restore and tokenizer.

What every use of a trained model needs and nothing a method adds: `train` builds one under its recipe,
`infer`, `evaluate`, `serve` and `convert` build one without an optimizer. Checkpoints whose metadata marks
them as another kind (a LoRA run's adapters: metadata key `lora`) are read by the reader registered for that
key (`register_reader`; posttrain/lora_runs.py registers LoRA's), so a run's own settings come from the run.
"""

import contextlib
import dataclasses
import functools
import math
from typing import Callable, Dict, Optional

import flax.linen as nn
import jax

from t5x_like.data import input_pipeline
from t5x_like.data import mixture as mixture_lib
from t5x_like.data import tokenizer as tokenizer_lib
from t5x_like.model import config as config_lib
from t5x_like.model import decoder as model_lib
from t5x_like.model import heads
from t5x_like.model import pipeline_parallel
from t5x_like.parallel import mesh as mesh_lib
from t5x_like.parallel import partitioning
from t5x_like.training import checkpointing
from t5x_like.training.config import TrainConfig

# {checkpoint metadata key: reader(runtime, step, path, entry) -> (step, model params)}: checkpoints that hold
# something other than the model's parameters (a LoRA run's adapters) and how to read them as the model's.
READERS: Dict[str, Callable] = {}


# The kinds this package writes, and the module whose import registers each one's reader (the entry points import
# them through cli.py; this layer cannot: posttrain/ sits above it). Reading such a checkpoint before its reader is
# registered is an error that names the module, not a restore of the wrong tree.
KINDS = {"lora": "t5x_like.posttrain.lora_runs"}


def register_reader(key: str, reader: Callable) -> None:
  """Reads checkpoints whose metadata has `key` with `reader(runtime, step, path, metadata[key])`."""
  READERS[key] = reader


def padded_vocab_size(vocab_size: int, multiple: int = 128) -> int:
  return int(math.ceil(vocab_size / multiple) * multiple)


def resolve_model_config(model_config: model_lib.GPTConfig, manifest: Optional[dict], mesh, seq_len: int):
  """Fills the dataset's vocabulary and the mesh's stage count into the model config, then validates."""
  if manifest is None and not model_config.vocab_size:
    raise ValueError("GPTConfig.vocab_size is 0 and there is no DATA_DIR to take it from: set DATA_DIR or "
                     "model.GPTConfig.vocab_size (a converted MODEL_DIR's model.gin does)")
  vocab = model_config.vocab_size or padded_vocab_size(manifest["vocab_size"])
  if manifest is not None and vocab < manifest["vocab_size"]:
    raise ValueError(f"GPTConfig.vocab_size={vocab} is smaller than the dataset's tokenizer "
                     f"({manifest['vocab_size']} pieces)")
  cfg = dataclasses.replace(model_config, vocab_size=vocab, num_stages=mesh.shape["pipeline"])
  cfg.validate()
  if seq_len > cfg.max_len:
    raise ValueError(f"SEQ_LEN={seq_len} is larger than the model's max_len={cfg.max_len} "
                     f"(GPTConfig.max_len)")
  return cfg


def validate_layout(config: TrainConfig, mesh, model_config: model_lib.GPTConfig) -> None:
  """Errors a user can act on, raised before anything compiles: the one layout validator under the
  rules in use, and the batch over the processes."""
  if config.batch_size % jax.process_count():
    raise ValueError(f"BATCH_SIZE={config.batch_size} is not divisible by {jax.process_count()} processes")
  config_lib.check_layout(model_config, mesh.shape, config.axis_rules, batch_size=config.batch_size,
                          num_microbatches=config.num_microbatches, seq_len=config.seq_len)


class Runtime:
  """A run's mesh, rules, model and parameter layout, and restoring its checkpoints onto them.

  Attributes:
    config: the TrainConfig (MODEL_DIR, DATA_DIR, layout, batch).
    mixture: the data mixture (DataConfig.mixture / mixture_stages), else None.
    manifest: DATA_DIR's (or the mixture's) manifest; None without a DATA_DIR (sampling with --tokenizer).
    mesh, rules: the device mesh and the logical-axis rules table.
    model_config: the model config with the dataset's vocabulary and the mesh's stage count filled in.
    model: the flax module (the decoder, or the decoder with a score head when `scored`).
  """

  def __init__(self, config: TrainConfig, model_config: model_lib.GPTConfig, *, scored: bool = False,
               stage_order: bool = False):
    """`stage_order`: hold the stacked blocks in stage order under an interleaved pipeline (the trainer's state;
    GPTConfig.blocks_stage_ordered): what this runtime restores is converted on the way in (`stage_order_of`)."""
    self.config = config
    self.mixture = (mixture_lib.Mixture.create(config.data.mixture, config.data.mixture_stages)
                    if config.data.mixture or config.data.mixture_stages else None)
    self.manifest = (self.mixture.manifest if self.mixture else
                     input_pipeline.load_manifest(config.data_dir) if config.data_dir else None)
    self.mesh = mesh_lib.create_mesh(config.mesh_shape)
    self.model_config = resolve_model_config(model_config, self.manifest, self.mesh, config.seq_len)
    if stage_order:
      self.model_config = dataclasses.replace(self.model_config, blocks_in_stage_order=True)
    validate_layout(config, self.mesh, self.model_config)  # before anything compiles
    self.rules = tuple(config.axis_rules or partitioning.DEFAULT_RULES)
    self.model = heads.model_for(self.model_config, scored=scored)

  def context(self):
    """Mesh + logical rules: entered before any trace, or sharding constraints silently vanish."""
    stack = contextlib.ExitStack()
    stack.enter_context(jax.set_mesh(self.mesh))
    stack.enter_context(nn.logical_axis_rules(self.rules))
    return stack

  @functools.cached_property
  def boxed_params(self):
    """The model's abstract parameters, boxed with their logical axis names (nothing allocated)."""
    return self.boxed_params_of(self.model)

  def boxed_params_of(self, model):
    """A model's abstract parameters on this mesh, boxed with their logical axis names (nothing allocated)."""
    if type(model) is model_lib.GPT:  # pylint: disable=unidiomatic-typecheck  (a head or wrapper adds parameters)
      return model_lib.abstract_params(model.config, self.mesh, self.rules)  # traced once per config and mesh
    with self.context():
      return jax.eval_shape(lambda: model.init(jax.random.key(0), jax.numpy.zeros((1, 1), "int32")))["params"]

  @functools.cached_property
  def model_shardings(self):
    """NamedShardings of the model's parameters on this mesh."""
    return partitioning.shardings_from_boxed(self.boxed_params, self.mesh, self.rules)

  def abstract_model_params(self):
    """The model's parameters as ShapeDtypeStructs with this run's shardings (a restore target)."""
    return checkpointing.abstract_with_shardings(partitioning.unbox(self.boxed_params), self.model_shardings)

  def stage_order_of(self, tree, donate: bool = True):
    """`tree`'s block arrays (parameters, optimizer state, adapters) from layer order, as checkpoints hold them,
    into this model's order (a no-op unless GPTConfig.blocks_stage_ordered); by default consuming the input."""
    return pipeline_parallel.reorder_blocks(self.model_config, tree, to_stage=True, donate=donate)

  def layer_order_of(self, tree):
    """The inverse of `stage_order_of`, keeping the input (a checkpoint's copy of the training state)."""
    return pipeline_parallel.reorder_blocks(self.model_config, tree, to_stage=False)

  def checkpoint_kind(self, step: Optional[int] = None) -> Optional[tuple]:
    """(metadata key, its entry, checkpoint path) when MODEL_DIR's checkpoint (newest, or `step`) is of a
    registered kind (READERS, e.g. a LoRA run's adapters), else None; ValueError for a kind of KINDS whose reader
    is not registered."""
    try:
      _, path = checkpointing.step_dir(self.config.model_dir, step)
      meta = checkpointing.read_metadata(path)
    except Exception:  # pylint: disable=broad-except  # no or unreadable checkpoint: the restore says so
      return None
    for key in READERS:
      if meta.get(key):
        return key, meta[key], path
    for key, module in KINDS.items():
      if meta.get(key):
        raise ValueError(f"{path}: a checkpoint with '{key}' metadata, whose reader is not registered: import {module} "
                         "first (the entry points do)")
    return None

  def restore_params(self, step: Optional[int] = None):
    """(step, params) of MODEL_DIR's newest readable checkpoint (or `step`) on this mesh; no optimizer state.

    A checkpoint of a registered kind is read by its reader: a LoRA run's gives its base merged with its
    adapters, with the rank, alpha, targets and base its metadata records.
    """
    kind = self.checkpoint_kind(step)
    if kind is not None:
      key, entry, path = kind
      found, params = READERS[key](self, step, path, entry)
    else:
      found, params = checkpointing.restore_newest_params(self.config.model_dir, self.abstract_model_params(), step)
    return found, self.stage_order_of(params)

  def load_tokenizer(self, tokenizer: Optional[str] = None):
    """The tokenizer prompts are encoded with: `tokenizer` (a .model, tokenizer.json or HF folder) if given,
    else DATA_DIR's; refused when it has more ids than the model's vocabulary has rows."""
    if tokenizer is None and self.manifest is None:
      raise ValueError("no tokenizer to encode the prompts: set DATA_DIR or pass --tokenizer=PATH "
                       "(a .model, tokenizer.json or an HF folder)")
    tok = tokenizer_lib.load(tokenizer or input_pipeline.resolve_path(self.config.data_dir, self.manifest["tokenizer"]))
    if max(tok.vocab_size, tok.pad_id + 1) > self.model_config.vocab_size:
      raise ValueError(f"Tokenizer '{tok.path}' has {tok.vocab_size} ids (pad id {tok.pad_id}) but the model's "
                       f"vocabulary has {self.model_config.vocab_size} rows: not this model's tokenizer")
    return tok
