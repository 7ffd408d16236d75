"""The training loop: mesh → sharded state → jit once (shardings, donation) → steps, eval, checkpoints, metrics."""

import dataclasses
import functools
import math
from typing import Mapping, Optional

from absl import logging
import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import tensorflow as tf

from t5x_like.training import checkpointing as checkpoints
from t5x_like.training import fault_tolerance
from t5x_like.observe import flops
from t5x_like.parallel import global_batch
from t5x_like.observe import hardware
from t5x_like.data import input_pipeline
from t5x_like.parallel import mesh as mesh_lib
from t5x_like.observe import metrics as metrics_lib
from t5x_like.model import config as config_lib
from t5x_like.model import decoder as model_lib
from t5x_like.observe import prometheus as monitoring
from t5x_like.parallel import offload
from t5x_like.training import optimizer as optimizer_lib
from t5x_like.parallel import partitioning
from t5x_like.training import precision
from t5x_like.observe import profiling
from t5x_like.training import train_state as train_state_lib
from t5x_like.training import step as train_step_lib


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """One training run: where, what data, how long, how big, how it is laid out and observed."""
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
  eval_batches: int = 0  # validation batches per pass; 0 = the whole validation split
  checkpoint_every: int = 200  # steps between checkpoints; one is always written at the end
  keep_checkpoints: int = 3  # newest checkpoints kept
  keep_period: int = 0  # also keep every checkpoint whose step is a multiple of this; 0 = none
  async_checkpoints: bool = True  # write checkpoints in the background while training continues
  max_failed_saves: int = 2  # consecutive failed checkpoint saves tolerated; one more stops the run (exit 74)
  nonfinite_patience: int = 5  # consecutive non-finite steps (each skipped) that trigger nonfinite_action; 0 = never
  nonfinite_action: str = "stop"  # 'stop' (exit 65) or 'rollback' (to the last checkpoint, skipping the batches since)
  warm_start_from: str = ""  # another run's MODEL_DIR or checkpoints/<step>: initial params when MODEL_DIR has none
  warm_start_optimizer: bool = False  # also take its optimizer state (same optimizer); False = fresh, step 0
  debug_nan_steps: tuple = ()  # tests only: steps (1-based) whose batch gets NaN loss weights
  shuffle_buffer: int = 1024  # rows in the training shuffle buffer
  report_unigram_baseline: bool = False  # with the final eval, log the context-free unigram loss to beat
  loss_chunk: int = 0  # >0: loss over sequence chunks of this many positions, never the full (B,L,V) logits
  data_streams: int = 0  # data readers; fixed → same batches on any process count; 0 = one per process
  axis_rules: Optional[tuple] = None  # logical→mesh rules; None = partitioning.DEFAULT_RULES
  offload_optimizer: bool = False  # ZeRO-Offload: AdamW state in pinned host memory (GPU/TPU; refused on CPU)
  prometheus_port: int = 0  # serve the logged figures at http://prometheus_host:PORT/metrics; 0 = off
  prometheus_host: str = "127.0.0.1"  # address the Prometheus endpoint binds; '0.0.0.0' exposes it
  profile_steps: Optional[tuple] = None  # (first, last): jax.profiler trace of these steps to MODEL_DIR/profile


def padded_vocab_size(vocab_size: int, multiple: int = 128) -> int:
  return int(math.ceil(vocab_size / multiple) * multiple)


def resolve_model_config(model_config: model_lib.GPTConfig, manifest: dict, mesh, seq_len: int):
  """Fills the dataset's vocabulary and the mesh's stage count into the model config, then validates."""
  vocab = model_config.vocab_size or padded_vocab_size(manifest["vocab_size"])
  if vocab < manifest["vocab_size"]:
    raise ValueError(f"GPTConfig.vocab_size={vocab} is smaller than the dataset's tokenizer "
                     f"({manifest['vocab_size']} pieces)")
  cfg = dataclasses.replace(model_config, vocab_size=vocab, num_stages=mesh.shape["pipeline"])
  cfg.validate()
  if seq_len > cfg.max_len:
    raise ValueError(f"SEQ_LEN={seq_len} is larger than the model's max_len={cfg.max_len} "
                     f"(GPTConfig.max_len)")
  return cfg


def validate_layout(config: TrainConfig, mesh, model_config: Optional[model_lib.GPTConfig] = None) -> None:
  """Errors a user can act on, raised before anything compiles.

  Given the resolved model config it also checks that heads, MLP width, vocabulary and d_model split
  over `tensor`/`fsdp`, layers over `pipeline`, and each step's rows into pipeline microbatches.
  """
  rows = mesh_lib.data_parallel_size(mesh) * config.num_microbatches
  if config.batch_size % rows:
    raise ValueError(f"BATCH_SIZE={config.batch_size} is not divisible by data×fsdp×NUM_MICROBATCHES = "
                     f"{mesh.shape['data']}×{mesh.shape['fsdp']}×{config.num_microbatches} = {rows}")
  if config.batch_size % jax.process_count():
    raise ValueError(f"BATCH_SIZE={config.batch_size} is not divisible by {jax.process_count()} processes")
  if model_config is not None:
    config_lib.check_layout(model_config, mesh.shape, config.axis_rules, batch_size=config.batch_size,
                            num_microbatches=config.num_microbatches)


class Experiment:
  """The pieces a run, an eval or a sampler need, built once under the mesh and the axis rules."""

  def __init__(self, config: TrainConfig, model_config: model_lib.GPTConfig,
               optimizer_config: optimizer_lib.OptimizerConfig,
               precision_config: Optional[precision.PrecisionConfig] = None):
    self.config = config
    self.precision_config = precision_config or precision.PrecisionConfig()
    self.manifest = input_pipeline.load_manifest(config.data_dir)
    self.mesh = mesh_lib.create_mesh(config.mesh_shape)
    self.model_config = resolve_model_config(model_config, self.manifest, self.mesh, config.seq_len)
    validate_layout(config, self.mesh, self.model_config)  # before anything compiles
    self.rules = tuple(config.axis_rules or partitioning.DEFAULT_RULES)
    self.model = model_lib.GPT(self.model_config)
    self.lr_fn = optimizer_lib.learning_rate_schedule(optimizer_config, config.train_steps)
    self.tx = optimizer_lib.make_optimizer(optimizer_config, config.train_steps)
    self.batch_sharding = partitioning.batch_sharding(self.mesh, self.rules)
    with self.context():
      self.abstract_state, self.state_shardings = train_state_lib.state_shardings(
          self.model, self.tx, self.mesh, self.rules, loss_scale=self.initial_loss_scale())
    if config.offload_optimizer:
      self.state_shardings = offload.offload_shardings(self.state_shardings)

  def context(self):
    """Mesh + logical rules: entered before any trace, or sharding constraints silently vanish."""
    return _Context(self.mesh, self.rules)

  def initial_loss_scale(self):
    """The dynamic loss-scale state a fresh TrainState starts with (None without loss scaling)."""
    return precision.init_loss_scale(self.precision_config, self.model_config.dtype)

  def init_state(self):
    with self.context():
      state, _ = train_state_lib.init_state(self.model, self.tx, jax.random.key(self.config.seed),
                                            self.mesh, self.rules, loss_scale=self.initial_loss_scale())
    return jax.device_put(state, self.state_shardings)  # a no-op unless the optimizer state is offloaded

  def dataset(self, split: str, *, shuffle: bool, repeat: bool):
    """This process's rows of every global batch (see global_batch.process_rows)."""
    num_streams = self.config.data_streams or jax.process_count()
    for s in range(num_streams):
      shards, _ = input_pipeline.host_shards(self.manifest, self.config.data_dir, split, s, num_streams)
      if not sum(records for _, records in shards):
        raise ValueError(f"DATA_DIR '{self.config.data_dir}' split '{split}' has too few records for "
                         f"{num_streams} data streams: stream {s} would read nothing (lower "
                         f"TrainConfig.data_streams or write more shards)")

    def stream(stream_index, num_streams, batch_size):
      return input_pipeline.make_dataset(
          self.config.data_dir, split, batch_size=batch_size, seq_len=self.config.seq_len,
          seed=self.config.seed, shuffle=shuffle, repeat=repeat, shuffle_buffer=self.config.shuffle_buffer,
          process_index=stream_index, process_count=num_streams)
    return global_batch.process_rows(stream, num_streams=num_streams, global_batch_size=self.config.batch_size,
                                     process_index=jax.process_index(), process_count=jax.process_count())

  def eval_dataset(self, split: str = "validation", repeat: bool = True):
    """Evaluation batches, identical on any process layout (and the same count on every process): each
    process reads the whole (small) split in one fixed order and keeps its own rows of each global batch."""
    rows = self.config.batch_size // jax.process_count()
    first = jax.process_index() * rows
    ds = input_pipeline.make_dataset(self.config.data_dir, split, batch_size=self.config.batch_size,
                                     seq_len=self.config.seq_len, seed=self.config.seed, shuffle=False,
                                     repeat=repeat, process_index=0, process_count=1)
    return ds.map(lambda batch: {key: value[first:first + rows] for key, value in batch.items()})

  def loss_kwargs(self) -> dict:
    """How the loss is computed: chunked over the sequence when TrainConfig.loss_chunk is set."""
    return {"logits_fn": functools.partial(model_lib.project_logits, config=self.model_config),
            "loss_chunk": self.config.loss_chunk}

  def jit_train_step(self):
    step = functools.partial(train_step_lib.train_step, apply_fn=self.model.apply, tx=self.tx,
                             lr_fn=self.lr_fn, num_microbatches=self.config.num_microbatches,
                             precision_config=self.precision_config, loss_kwargs=self.loss_kwargs())
    if self.config.offload_optimizer:
      step = offload.with_device_opt_state(step, self.state_shardings)
    batch_sh = {k: self.batch_sharding for k in ("inputs", "targets", "segment_ids", "positions", "weights")}
    return jax.jit(step, in_shardings=(self.state_shardings, batch_sh),
                   out_shardings=(self.state_shardings, None), donate_argnums=(0,))

  def jit_eval_step(self):
    return jax.jit(functools.partial(train_step_lib.eval_step, apply_fn=self.model.apply,
                                     loss_kwargs=self.loss_kwargs()),
                   in_shardings=(self.state_shardings.params, self.batch_sharding))

  def num_eval_batches(self, split: str = "validation") -> Optional[int]:
    """config.eval_batches, else None (one pass over the split) on one process; several processes
    need the same count everywhere, so they use the split's tokens over the tokens per batch."""
    if self.config.eval_batches:
      return self.config.eval_batches
    if jax.process_count() == 1:
      return None
    tokens = self.manifest["splits"][split]["num_tokens"]
    return max(1, tokens // (self.config.batch_size * (self.config.seq_len + 1)))

  def evaluate(self, params, eval_step=None, split: str = "validation") -> dict:
    """Token-weighted loss over `split` (the whole split, or config.eval_batches batches; the same
    batches every time), and its perplexity exp(loss)."""
    eval_step = eval_step or self.jit_eval_step()
    num_batches = self.num_eval_batches(split)
    batches = self.eval_dataset(split, repeat=num_batches is not None)
    if num_batches is not None:
      batches = batches.take(num_batches)
    loss_sum, weight_sum, count = 0.0, 0.0, 0
    with self.context():
      for tf_batch in batches:  # padding rows of the last batch carry weight 0
        batch = global_batch.to_global(global_batch.tf_to_numpy(tf_batch), self.batch_sharding)
        loss, weight = eval_step(params, batch)
        loss_sum, weight_sum, count = loss_sum + float(loss), weight_sum + float(weight), count + 1
    loss = loss_sum / max(weight_sum, 1.0)
    return {"eval/loss": loss, "eval/perplexity": metrics_lib.perplexity(loss), "eval/tokens": weight_sum,
            "eval/batches": count}


  def restore_params(self, step: Optional[int] = None):
    """(step, params) of MODEL_DIR's newest readable checkpoint (or `step`), on this mesh; no optimizer state."""
    abstract = checkpoints.abstract_with_shardings(self.abstract_state, self.state_shardings).params
    return checkpoints.restore_newest_params(self.config.model_dir, abstract, step)

  def evaluate_checkpoint(self, step: Optional[int] = None, split: str = "validation") -> dict:
    """Restores a checkpoint onto this mesh and evaluates it on `split` of DATA_DIR.

    Returns:
      {"step", "split", "eval/loss", "eval/perplexity", "eval/tokens", "eval/batches"}.
    """
    if split not in self.manifest["splits"]:
      raise ValueError(f"DATA_DIR '{self.config.data_dir}' has no split '{split}' "
                       f"(available: {sorted(self.manifest['splits'])})")
    with self.context():
      found, params = self.restore_params(step)
    return {"step": int(found), "split": split, **self.evaluate(params, split=split)}


class _Context:
  def __init__(self, mesh, rules):
    self._mesh, self._rules = mesh, rules
    self._stack = []

  def __enter__(self):
    for ctx in (jax.set_mesh(self._mesh), nn.logical_axis_rules(self._rules)):
      ctx.__enter__()
      self._stack.append(ctx)
    return self

  def __exit__(self, *exc):
    while self._stack:
      self._stack.pop().__exit__(*exc)


def train(config: TrainConfig, model_config: model_lib.GPTConfig,
          optimizer_config: optimizer_lib.OptimizerConfig,
          precision_config: Optional[precision.PrecisionConfig] = None) -> dict:
  """Trains until `config.train_steps`, resuming from the newest good checkpoint in MODEL_DIR.

  Returns:
    The last logged training metrics and the final evaluation.
  """
  if not config.model_dir:
    raise ValueError("MODEL_DIR is not set: pass --gin.MODEL_DIR=\"'/path/to/run'\"")
  exp = Experiment(config, model_config, optimizer_config, precision_config)
  is_primary = jax.process_index() == 0
  fault_tolerance.check_writable(config.model_dir)
  tf.io.gfile.makedirs(config.model_dir)
  if is_primary:
    with tf.io.gfile.GFile(f"{config.model_dir}/config.gin", "w") as f:
      f.write(gin.operative_config_str())
  logger = metrics_lib.MetricsLogger(config.model_dir, is_primary)
  manager = checkpoints.make_manager(config.model_dir, max_to_keep=config.keep_checkpoints,
                                     keep_period=config.keep_period, async_save=config.async_checkpoints)
  train_iter = iter(exp.dataset("train", shuffle=True, repeat=True))

  abstract = checkpoints.abstract_with_shardings(exp.abstract_state, exp.state_shardings)
  restored_step, state, saved_metadata = checkpoints.restore_latest(manager, abstract, train_iter,
                                                                    quarantine=True)
  if state is None:
    state = exp.init_state()
    if config.warm_start_from:
      state = fault_tolerance.warm_start(state, config.warm_start_from, abstract, config.warm_start_optimizer)
    start = 0
  else:
    start = int(restored_step)
    logging.info("resumed from %s at step %d", checkpoints.checkpoint_dir(config.model_dir), start)
  n_params = sum(int(x.size) for x in jax.tree.leaves(state.params))
  flops_per_token = flops.train_flops_per_token(exp.model_config, config.seq_len)
  peak, peak_source = hardware.peak_flops_per_device()
  logging.info("model: %s parameters; %.3g train FLOPs/token (PaLM 6N + 12LTd, causal attention not "
               "halved); peak %.3g FLOP/s/device (%s); mesh %s",
               f"{n_params:,}", flops_per_token, peak, peak_source, dict(exp.mesh.shape))
  metadata = checkpoints.run_metadata(mesh_shape=exp.mesh.shape, data_dir=config.data_dir,
                                      gin_config=gin.operative_config_str(), seq_len=config.seq_len,
                                      batch_size=config.batch_size, num_params=n_params)
  checkpoints.check_resume_metadata(saved_metadata, metadata)
  guard = fault_tolerance.RunGuard(manager, abstract, nonfinite_patience=config.nonfinite_patience,
                                   nonfinite_action=config.nonfinite_action,
                                   max_failed_saves=config.max_failed_saves,
                                   debug_nan_steps=config.debug_nan_steps)

  step_fn = exp.jit_train_step()
  eval_fn = exp.jit_eval_step()
  meter = metrics_lib.IntervalMeter(config.batch_size * config.seq_len, jax.device_count(),
                                    flops_per_token, peak)
  exporter = monitoring.start(config.prometheus_port, config.prometheus_host, is_primary)
  profiler = profiling.StepProfiler(config.model_dir, config.profile_steps, is_primary)
  exporter.update({}, step=start, train_steps=config.train_steps)
  last = {}
  step = start
  with exp.context(), guard:
    while step < config.train_steps:
      profiler.before_step(step + 1)
      meter.begin_step()
      batch = guard.poison(global_batch.tf_to_numpy(next(train_iter)), step + 1)  # debug_nan_steps only
      batch = global_batch.to_global(batch, exp.batch_sharding)
      meter.data_ready()
      state, step_metrics = step_fn(state, batch)
      meter.end_step(step_metrics, compiling=step == start, sync=profiler.stops_after(step + 1))
      step += 1
      profiler.after_step(step, step_metrics)
      if step % config.log_every == 0 or step == config.train_steps:
        scalars = meter.summary(train_iter)  # the only device→host fetch of step metrics
        logger.write(step, scalars)
        exporter.update(scalars, step=step, train_steps=config.train_steps)
        logging.info("%s", metrics_lib.progress_line(step, config.train_steps, scalars["loss"],
                                                     scalars.get("tokens_per_sec"), scalars.get("mfu"),
                                                     scalars.get("step_seconds")))
        last.update(scalars)
      if (config.eval_every and step % config.eval_every == 0) or step == config.train_steps:
        with meter.excluded():
          result = exp.evaluate(state.params, eval_fn)
          if config.report_unigram_baseline and step == config.train_steps:
            result["eval/unigram_baseline"] = input_pipeline.unigram_baseline(config.data_dir)
        logger.write(step, result)
        exporter.update(result, step=step, train_steps=config.train_steps)
        logging.info("step %d: eval loss %.4f perplexity %.2f%s", step, result["eval/loss"],
                     result["eval/perplexity"],
                     f" (unigram baseline {result['eval/unigram_baseline']:.4f})"
                     if "eval/unigram_baseline" in result else "")
        last.update(result)
      if guard.after_step(step, step_metrics):  # non-finite streak under nonfinite_action='rollback'
        step, state = guard.rollback()
        continue
      preempted = guard.preempted(step)  # SIGTERM/SIGINT: checkpoint now, then exit 75
      if step % config.checkpoint_every == 0 or step == config.train_steps or preempted:
        with meter.excluded():
          guard.save(step, state, train_iter, {**metadata, "step": step})
      if preempted:
        break
    guard.finish(step)  # waits for the last save; the final one must have committed
  profiler.stop(state)
  manager.close()
  logger.close()
  exporter.close()
  if is_primary:
    with tf.io.gfile.GFile(f"{config.model_dir}/config.gin", "w") as f:
      f.write(gin.operative_config_str())
  guard.raise_if_preempted(step, config.train_steps)
  return last
