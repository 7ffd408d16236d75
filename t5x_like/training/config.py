"""A training run's configuration: the run itself, its recipe's config, and the per-concern configs it nests.

Each nested config lives in the module its gin name points to: `data.DataConfig` (t5x_like/data),
`checkpointing.CheckpointConfig`, `fault_tolerance.FaultToleranceConfig` (training/), `observe.ObserveConfig`
(t5x_like/observe), `lora.LoraConfig` (posttrain/lora.py), `curriculum.CurriculumConfig`; `cli.train_config()`
builds them and puts them into the TrainConfig. The run macros of DESIGN.md (MODEL_DIR, DATA_DIR, TRAIN_STEPS,
BATCH_SIZE, SEQ_LEN, NUM_MICROBATCHES, MESH_SHAPE, SEED, LOG_EVERY, EVAL_EVERY, CHECKPOINT_EVERY) stay on
TrainConfig, where configs/runs/pretrain.gin binds them.
"""

import dataclasses
from typing import Any, Mapping, Optional

from t5x_like.data import DataConfig
from t5x_like.model import decoder
from t5x_like.observe import ObserveConfig
from t5x_like.training.checkpointing import CheckpointConfig
from t5x_like.training.curriculum import CurriculumConfig
from t5x_like.training.fault_tolerance import FaultToleranceConfig
from t5x_like.training.objectives import language_model


class Recipe:
  """What a method's config (its recipe: t5x_like/recipes/<name>.py) gives a run besides its objective,
  `make_objective(run, *, loss_scaled)`. The defaults are language modelling's; a recipe overrides what its method
  needs, so that the assembly (recipes/experiment.py) and the loop never name a method."""
  scored_model = False  # the model carries the reward head (model/heads.py): a class constant, not a gin setting

  def frozen_models(self, run) -> tuple:
    """The frozen models (posttrain/frozen_models.Frozen) the objective reads, besides a LoRA base."""
    del run
    return ()

  def batches(self, run, next_batch):
    """step → that step's batch: the data pipeline's `next_batch`; an on-policy method returns, per step, a
    function of the parameters the step starts from giving (batch, host metrics)."""
    del run
    return next_batch

  def evaluate(self, run, params) -> Optional[dict]:
    """The method's own evaluation of `params`, or None: the objective's loss over the validation split."""
    del run, params
    return None

  def initial_params(self, run, params):
    """The parameters a fresh run starts from (after initialisation or the warm start; never on resume): a
    method may fill some from elsewhere. Default: unchanged."""
    del run
    return params


@dataclasses.dataclass(frozen=True)
class LanguageModelConfig(Recipe):
  """The default recipe, language modelling (pre-training, SFT; gin: `language_model.LanguageModelConfig`):
  its settings are the run's own (TrainConfig.loss_chunk, .trainable, lora.LoraConfig). Other recipes'
  configs live in t5x_like/recipes/<name>.py; this one is here because every run can use it."""

  def make_objective(self, run, *, loss_scaled: bool):
    """The next-token objective over `run`'s model (a Runtime); refuses a preference DATA_DIR."""
    del loss_scaled  # token-normalised: loss scaling applies as is
    if run.manifest is not None and run.manifest.get("format") == "preference":
      raise ValueError(f"DATA_DIR '{run.config.data_dir}' holds preference pairs: language modelling would learn the "
                       "rejected answers too; train it with configs/runs/dpo.gin (TrainConfig.recipe='dpo')")
    return language_model.LanguageModel(apply_fn=run.model.apply, loss_chunk=run.config.loss_chunk,
                                        logits_fn=decoder.logits_projection(run.model_config))


# Named TrainConfig.trainable values (any other value is a regex over parameter paths).
TRAINABLE_PRESETS = {
    "all": ".*",
    "attention": "blocks/attn/.*",  # only the attention layers: qkv (or query, key_value) and out, kernels and biases
    "mlp": "blocks/mlp_.*",  # only the feed-forward layers: mlp_in (mlp_gate) and mlp_out
    "norms": "(blocks/ln_[12]|ln_f)/.*",  # only the layer-norm scales (and biases)
}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """One training run: where, what data, how long, how big, how it is laid out; one config per concern."""
  model_dir: str = ""  # run directory: config.gin, checkpoints/, events, metrics.jsonl (MODEL_DIR)
  data_dir: str = ""  # prepared dataset: manifest.json, shards, tokenizer.model (DATA_DIR)
  train_steps: int = 1000  # optimizer steps to reach (TRAIN_STEPS)
  batch_size: int = 32  # global sequences per optimizer step (BATCH_SIZE)
  seq_len: int = 256  # tokens per sequence (SEQ_LEN)
  num_microbatches: int = 1  # gradient-accumulation microbatches per step (NUM_MICROBATCHES)
  mesh_shape: Mapping[str, int] = dataclasses.field(
      default_factory=lambda: {"pipeline": 1, "data": -1, "fsdp": 1, "tensor": 1})  # MESH_SHAPE
  seed: int = 0  # parameter init and data order (SEED)
  log_every: int = 10  # steps between metric records (LOG_EVERY)
  eval_every: int = 200  # steps between validation passes; 0 = only at the end (EVAL_EVERY)
  checkpoint_every: int = 200  # steps between checkpoints; one is always written at the end (CHECKPOINT_EVERY)
  loss_chunk: int = 0  # >0: loss over sequence chunks of this many positions, never the full (B,L,V) logits
  # Regex over parameter paths ('blocks/attn/qkv/kernel') or a TRAINABLE_PRESETS name ('attention'); the other
  # leaves are frozen, with no optimizer state. Under LoRA the paths are the adapters' ('.../kernel/lora_a').
  trainable: str = ".*"
  axis_rules: Optional[tuple] = None  # logical→mesh rules; None = partitioning.DEFAULT_RULES
  offload_optimizer: bool = False  # ZeRO-Offload: AdamW state in pinned host memory
  # Dispatch step N+1 before step N has finished. None = not on the CPU backend, where each step in flight holds
  # its temporaries in host memory (trainer.StepGate, docs/performance.md), yes elsewhere.
  dispatch_ahead: Optional[bool] = None
  data: DataConfig = DataConfig()  # built from data.DataConfig bindings by cli.train_config()
  checkpoint: CheckpointConfig = CheckpointConfig()  # checkpointing.CheckpointConfig
  fault_tolerance: FaultToleranceConfig = FaultToleranceConfig()  # fault_tolerance.FaultToleranceConfig
  observe: ObserveConfig = ObserveConfig()  # observe.ObserveConfig
  # lora.LoraConfig (posttrain/lora.py, built by cli.train_config()); None or rank 0 = no LoRA. Untyped here: the
  # core does not import post-training (TrainConfig.use_lora reads it).
  lora: Any = None
  curriculum: CurriculumConfig = CurriculumConfig()  # curriculum.CurriculumConfig; sequence-length warmup
  recipe: str = "language_model"  # the method: a module of t5x_like/recipes/ (dpo, reward, grpo, distill, ...)
  # the recipe's config (dpo.DpoConfig, ...), built by cli.train_config() from its gin bindings
  recipe_config: Any = LanguageModelConfig()

  def __post_init__(self):
    if self.fault_tolerance.nonfinite_action not in ("stop", "rollback"):
      raise ValueError(f"FaultToleranceConfig.nonfinite_action must be 'stop' or 'rollback', "
                       f"got {self.fault_tolerance.nonfinite_action!r}")
    for key in ("train_steps", "batch_size", "seq_len", "num_microbatches", "log_every"):
      if getattr(self, key) < 1:
        raise ValueError(f"TrainConfig.{key} must be >= 1, got {getattr(self, key)}")
    for key in ("eval_every", "checkpoint_every"):
      if getattr(self, key) < 0:
        raise ValueError(f"TrainConfig.{key} must be >= 0, got {getattr(self, key)}")
    if self.loss_chunk < 0 or (self.loss_chunk and self.loss_chunk < self.seq_len
                               and self.seq_len % self.loss_chunk):
      raise ValueError(f"TrainConfig.loss_chunk={self.loss_chunk} must be 0 (off) or divide SEQ_LEN={self.seq_len} "
                       "(the chunked loss cuts each sequence into equal chunks)")
    if self.use_lora and self.offload_optimizer:
      raise ValueError("TrainConfig.offload_optimizer with LoRA (LoraConfig.rank > 0): the adapters' optimizer "
                       "state is tiny; turn offloading off")

  @property
  def use_lora(self) -> bool:
    """Whether the run trains LoRA adapters (a lora.LoraConfig with rank > 0)."""
    return self.lora is not None and bool(self.lora.rank)

  @property
  def trainable_regex(self) -> str:
    """`trainable` with a TRAINABLE_PRESETS name replaced by its regex."""
    return TRAINABLE_PRESETS.get(self.trainable, self.trainable)
