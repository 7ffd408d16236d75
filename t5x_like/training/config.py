"""A training run's configuration: the run itself, plus one frozen dataclass per concern.

Gin binds each class under its own name (`trainer.TrainConfig`, `data.DataConfig`,
`checkpointing.CheckpointConfig`, `fault_tolerance.FaultToleranceConfig`, `observe.ObserveConfig`,
`lora.LoraConfig`); `cli.train_config()` builds the nested ones and puts them into the TrainConfig. The run macros of
DESIGN.md (MODEL_DIR, DATA_DIR, TRAIN_STEPS, BATCH_SIZE, SEQ_LEN, NUM_MICROBATCHES, MESH_SHAPE, SEED,
LOG_EVERY, EVAL_EVERY, CHECKPOINT_EVERY) stay on TrainConfig, where configs/runs/pretrain.gin binds them.
"""

import dataclasses
from typing import Mapping, Optional
from t5x_like.observe import trackers
from t5x_like.training.curriculum import CurriculumConfig  # re-exported: nested in TrainConfig


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """How the training and evaluation batches are read."""
  shuffle_buffer: int = 1024  # rows permuted together in the training stream
  # An ordered DATA_DIR (preprocess --order_by) is read in its easy-to-hard order, never shuffled across
  # it (shuffle_buffer does not apply): rows are permuted only within blocks of this many; 0 = strict order.
  order_window: int = 0
  # Readers the global batch is drawn from. The batches depend on this number only, never on the
  # process count: 1 (default) → identical batches on any number of hosts, each host reading the
  # whole stream and keeping its rows; a multiple of the host count (e.g. 32) → each host reads only
  # its own streams. 0 = one stream per process (batches then change with the process count).
  data_streams: int = 1
  eval_batches: int = 0  # validation batches per evaluation; 0 = the whole validation split
  # A weighted mixture of DATA_DIRs read instead of DATA_DIR, e.g. {'/data/web': 0.8, '/data/code': 0.2}
  # (weights normalised; every source preprocessed with one tokenizer); None = DATA_DIR alone. Each batch
  # holds each source's share of rows, give or take one (data/mixture.py); eval reports each source's loss.
  mixture: Optional[Mapping[str, float]] = None
  # Weights that change during training instead: ((first step, {DATA_DIR: weight}), ...), from step 0, the
  # first stage naming every DATA_DIR (weight 0 allowed).
  mixture_stages: tuple = ()
  report_unigram_baseline: bool = False  # with the final eval, log the context-free unigram loss to beat


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """Which checkpoints are written and kept, and where a fresh run takes its first parameters from."""
  keep: int = 3  # newest checkpoints kept
  keep_period: int = 0  # also keep every checkpoint whose step is a multiple of this; 0 = none
  async_save: bool = True  # write checkpoints in the background while training continues
  warm_start_from: str = ""  # another run's MODEL_DIR or checkpoints/<step>: initial params when MODEL_DIR has none
  warm_start_optimizer: bool = False  # also take its optimizer state (same optimizer); False = fresh, step 0
  # Fine-tuning (configs/runs/finetune.gin): refuse to start a fresh run from random parameters when
  # warm_start_from (INITIAL_CHECKPOINT_PATH) is empty.
  warm_start_required: bool = False


@dataclasses.dataclass(frozen=True)
class FaultToleranceConfig:
  """What a run does about failed saves and non-finite steps."""
  max_failed_saves: int = 2  # consecutive failed checkpoint saves tolerated; one more stops the run (exit 74)
  nonfinite_patience: int = 5  # consecutive non-finite steps (each skipped) that trigger nonfinite_action; 0 = never
  nonfinite_action: str = "stop"  # 'stop' (exit 65) or 'rollback' (to the last checkpoint, skipping the batches since)
  debug_nan_steps: tuple = ()  # fault injection for tests and drills: steps (1-based) whose batch gets NaN weights


@dataclasses.dataclass(frozen=True)
class ObserveConfig:
  """Live figures and traces beyond metrics.jsonl / TensorBoard."""
  prometheus_port: int = 0  # serve the logged figures at http://prometheus_host:PORT/metrics; 0 = off
  prometheus_host: str = "127.0.0.1"  # address the Prometheus endpoint binds; '0.0.0.0' exposes it
  profile_steps: Optional[tuple] = None  # (first, last): jax.profiler trace of these steps to MODEL_DIR/profile
  trackers: tuple = ("tensorboard",)  # also 'mlflow' (MODEL_DIR/mlruns or tracking_uri), 'wandb' (offline unless logged in)
  tracking_uri: str = ""  # MLflow server or database, e.g. 'http://host:5000'; '' = MODEL_DIR/mlruns
  experiment: str = ""  # MLflow experiment / W&B project grouping runs ('' = t5x_like; a sweep sets its folder's name)

  def __post_init__(self):
    trackers.validate(self.trackers)


# LoRA's default targets: the attention projections (fused qkv, or query + key_value under GQA) and out,
# and the MLP's input (and SwiGLU gate) and output kernels.
LORA_TARGETS = r"blocks/attn/(qkv|query|key_value|out)/kernel|blocks/mlp_(in|gate|out)/kernel"


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """Low-rank adapters (posttrain/lora.py): W + (alpha/rank)·A·B on each target kernel, the base frozen."""
  rank: int = 0  # adapter rank r; 0 = no LoRA (full or selective fine-tuning)
  alpha: float = 16.0  # the adapters' update is scaled by alpha / rank
  dropout: float = 0.0  # dropout on the adapters' input (the decoder blocks' projections), as in PEFT's lora_dropout
  targets: str = LORA_TARGETS  # regex (re.fullmatch) over parameter paths of the kernels that get adapters

  def __post_init__(self):
    if self.rank < 0:
      raise ValueError(f"LoraConfig.rank must be >= 0 (0 = no LoRA), got {self.rank}")
    if self.rank and self.alpha <= 0:
      raise ValueError(f"LoraConfig.alpha must be > 0, got {self.alpha}")
    if not 0.0 <= self.dropout < 1.0:
      raise ValueError(f"LoraConfig.dropout={self.dropout} must be in [0, 1)")

  @property
  def scale(self) -> float:
    return self.alpha / self.rank


# ObjectiveConfig.name values: training/objectives/<name>.py (see training/objective_choice.py).
OBJECTIVES = ("language_model", "preference", "reward", "distill", "grpo")


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
  """Which loss trains the model (training/objectives/), bound as `objective.ObjectiveConfig.<field>`."""
  name: str = "language_model"  # 'language_model' (pre-training, SFT) or 'preference' (DPO/IPO/SimPO on pairs)
  loss_type: str = "sigmoid"  # preference: 'sigmoid' (DPO), 'ipo', 'simpo' (reference-free)
  beta: float = 0.1  # preference: β (DPO/IPO: strength of the implicit KL to the reference; SimPO: reward scale)
  gamma: float = 0.5  # simpo: the target reward margin γ
  # preference: the frozen reference model (REFERENCE_CHECKPOINT_PATH): a MODEL_DIR, checkpoints/<step> or
  # converted checkpoint; '' = CheckpointConfig.warm_start_from (INITIAL_CHECKPOINT_PATH)
  reference_checkpoint: str = ""
  # grpo (configs/runs/grpo.gin): `beta` is the KL coefficient to the frozen reference (0 = no reference loaded)
  num_generations: int = 8  # G: samples per prompt (a group); BATCH_SIZE = prompts per step × G
  clip_epsilon: float = 0.2  # the policy ratio is clipped to [1 − ε, 1 + ε]
  reward: str = "exact_match"  # a registered reward function (posttrain/rewards.py): exact_match, format, reward_model
  reward_format: str = ""  # the `format` reward's regex: 1 when the whole completion matches it
  max_new_tokens: int = 16  # rollout length budget per completion
  temperature: float = 1.0  # rollout sampling temperature (top_k below; evaluation is greedy)
  top_k: int = 0
  reward_checkpoint: str = ""  # the `reward_model` reward: a reward model's MODEL_DIR (configs/runs/reward.gin)
  # distill (configs/runs/distill.gin): the frozen teacher (TEACHER_CHECKPOINT_PATH), a MODEL_DIR, checkpoints/<step>
  # or converted checkpoint whose model.gin / config.gin gives its (possibly larger) model config; the loss is
  # distill_alpha · T² · KL(teacher_T ‖ student_T) + (1 − distill_alpha) · CE with T = distill_temperature.
  teacher_checkpoint: str = ""
  distill_alpha: float = 0.5
  distill_temperature: float = 2.0

  def __post_init__(self):
    if self.name not in OBJECTIVES:
      raise ValueError(f"ObjectiveConfig.name must be one of {OBJECTIVES}, got {self.name!r}")


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
  data: DataConfig = DataConfig()  # built from data.DataConfig bindings by cli.train_config()
  checkpoint: CheckpointConfig = CheckpointConfig()  # checkpointing.CheckpointConfig
  fault_tolerance: FaultToleranceConfig = FaultToleranceConfig()  # fault_tolerance.FaultToleranceConfig
  observe: ObserveConfig = ObserveConfig()  # observe.ObserveConfig
  lora: LoraConfig = LoraConfig()  # lora.LoraConfig; rank 0 = off
  curriculum: CurriculumConfig = CurriculumConfig()  # curriculum.CurriculumConfig; sequence-length warmup
  objective: ObjectiveConfig = ObjectiveConfig()  # objective.ObjectiveConfig; the loss

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
    if self.lora.rank and self.offload_optimizer:
      raise ValueError("TrainConfig.offload_optimizer with LoRA (LoraConfig.rank > 0): the adapters' optimizer "
                       "state is tiny; turn offloading off")

  @property
  def trainable_regex(self) -> str:
    """`trainable` with a TRAINABLE_PRESETS name replaced by its regex."""
    return TRAINABLE_PRESETS.get(self.trainable, self.trainable)
