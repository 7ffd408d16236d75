"""The training loop: mesh → sharded state → jit once (shardings, donation) → steps, eval, checkpoints, metrics."""

import dataclasses
import functools
import math
import time
from typing import Mapping, Optional

from absl import logging
import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np
import tensorflow as tf

from t5x_like import checkpoints
from t5x_like import flops
from t5x_like import global_batch
from t5x_like import hardware
from t5x_like import input_pipeline
from t5x_like import mesh as mesh_lib
from t5x_like import metrics as metrics_lib
from t5x_like import model as model_lib
from t5x_like import optimizer as optimizer_lib
from t5x_like import partitioning
from t5x_like import train_state as train_state_lib
from t5x_like import train_step as train_step_lib


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
  shuffle_buffer: int = 1024  # rows in the training shuffle buffer
  axis_rules: Optional[tuple] = None  # logical→mesh rules; None = partitioning.DEFAULT_RULES


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


def validate_layout(config: TrainConfig, mesh) -> None:
  """Errors a user can act on, raised before anything compiles."""
  rows = mesh_lib.data_parallel_size(mesh) * config.num_microbatches
  if config.batch_size % rows:
    raise ValueError(f"BATCH_SIZE={config.batch_size} is not divisible by data×fsdp×NUM_MICROBATCHES = "
                     f"{mesh.shape['data']}×{mesh.shape['fsdp']}×{config.num_microbatches} = {rows}")
  if config.batch_size % jax.process_count():
    raise ValueError(f"BATCH_SIZE={config.batch_size} is not divisible by {jax.process_count()} processes")


class Experiment:
  """The pieces a run, an eval or a sampler need, built once under the mesh and the axis rules."""

  def __init__(self, config: TrainConfig, model_config: model_lib.GPTConfig,
               optimizer_config: optimizer_lib.OptimizerConfig):
    self.config = config
    self.manifest = input_pipeline.load_manifest(config.data_dir)
    self.mesh = mesh_lib.create_mesh(config.mesh_shape)
    validate_layout(config, self.mesh)
    self.model_config = resolve_model_config(model_config, self.manifest, self.mesh, config.seq_len)
    self.rules = tuple(config.axis_rules or partitioning.DEFAULT_RULES)
    self.model = model_lib.GPT(self.model_config)
    self.lr_fn = optimizer_lib.learning_rate_schedule(optimizer_config, config.train_steps)
    self.tx = optimizer_lib.make_optimizer(optimizer_config, config.train_steps)
    self.batch_sharding = partitioning.batch_sharding(self.mesh, self.rules)
    with self.context():
      self.abstract_state, self.state_shardings = train_state_lib.state_shardings(
          self.model, self.tx, self.mesh, self.rules)

  def context(self):
    """Mesh + logical rules: entered before any trace, or sharding constraints silently vanish."""
    return _Context(self.mesh, self.rules)

  def init_state(self):
    with self.context():
      state, _ = train_state_lib.init_state(self.model, self.tx, jax.random.key(self.config.seed),
                                            self.mesh, self.rules)
    return state

  def dataset(self, split: str, *, shuffle: bool, repeat: bool):
    return input_pipeline.make_dataset(
        self.config.data_dir, split, batch_size=self.config.batch_size // jax.process_count(),
        seq_len=self.config.seq_len, seed=self.config.seed, shuffle=shuffle, repeat=repeat,
        shuffle_buffer=self.config.shuffle_buffer)

  def jit_train_step(self):
    step = functools.partial(train_step_lib.train_step, apply_fn=self.model.apply, tx=self.tx,
                             lr_fn=self.lr_fn, num_microbatches=self.config.num_microbatches)
    batch_sh = {k: self.batch_sharding for k in ("inputs", "targets", "segment_ids", "positions", "weights")}
    return jax.jit(step, in_shardings=(self.state_shardings, batch_sh),
                   out_shardings=(self.state_shardings, None), donate_argnums=(0,))

  def jit_eval_step(self):
    return jax.jit(functools.partial(train_step_lib.eval_step, apply_fn=self.model.apply),
                   in_shardings=(self.state_shardings.params, self.batch_sharding))

  def num_eval_batches(self) -> int:
    if self.config.eval_batches:
      return self.config.eval_batches
    tokens = self.manifest["splits"]["validation"]["num_tokens"]
    return max(1, tokens // (self.config.batch_size * self.config.seq_len))

  def evaluate(self, params, eval_step=None) -> dict:
    """Token-weighted loss over the validation split (same batches every time), and its perplexity."""
    eval_step = eval_step or self.jit_eval_step()
    iterator = iter(self.dataset("validation", shuffle=False, repeat=True))
    loss_sum, weight_sum = 0.0, 0.0
    with self.context():
      for _ in range(self.num_eval_batches()):
        batch = global_batch.to_global(global_batch.tf_to_numpy(next(iterator)), self.batch_sharding)
        loss, weight = eval_step(params, batch)
        loss_sum, weight_sum = loss_sum + float(loss), weight_sum + float(weight)
    loss = loss_sum / max(weight_sum, 1.0)
    return {"eval/loss": loss, "eval/perplexity": float(np.exp(loss)), "eval/tokens": weight_sum}


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


def _mean_metrics(records: list) -> dict:
  """Averages per-step device metrics over a log interval; loss weighted by tokens."""
  fetched = jax.device_get(records)
  tokens = np.array([r["tokens"] for r in fetched], np.float64)
  out = {
      "loss": float(np.sum(tokens * np.array([r["loss"] for r in fetched], np.float64)) / max(tokens.sum(), 1)),
      "grad_norm": float(np.mean([r["grad_norm"] for r in fetched])),
      "param_norm": float(fetched[-1]["param_norm"]),
      "lr": float(fetched[-1]["lr"]),
      "nonfinite_steps": int(sum(int(r["nonfinite"]) for r in fetched)),
  }
  out["perplexity"] = float(np.exp(min(out["loss"], 50.0)))
  if len(fetched) == 1:  # one step: keep the loss exactly as the device computed it
    out["loss"] = float(fetched[0]["loss"])
  return out, float(tokens.sum())


def train(config: TrainConfig, model_config: model_lib.GPTConfig,
          optimizer_config: optimizer_lib.OptimizerConfig) -> dict:
  """Trains until `config.train_steps`, resuming from the newest good checkpoint in MODEL_DIR.

  Returns:
    The last logged training metrics and the final evaluation.
  """
  if not config.model_dir:
    raise ValueError("MODEL_DIR is not set: pass --gin.MODEL_DIR=\"'/path/to/run'\"")
  exp = Experiment(config, model_config, optimizer_config)
  is_primary = jax.process_index() == 0
  tf.io.gfile.makedirs(config.model_dir)
  if is_primary:
    with tf.io.gfile.GFile(f"{config.model_dir}/config.gin", "w") as f:
      f.write(gin.operative_config_str())
  logger = metrics_lib.MetricsLogger(config.model_dir, is_primary)
  manager = checkpoints.make_manager(config.model_dir, max_to_keep=config.keep_checkpoints)
  train_iter = iter(exp.dataset("train", shuffle=True, repeat=True))

  restored_step, state, _ = checkpoints.restore_latest(
      manager, checkpoints.abstract_with_shardings(exp.abstract_state, exp.state_shardings), train_iter)
  if state is None:
    state = exp.init_state()
    start = 0
  else:
    start = int(restored_step)
    logging.info("resumed from %s at step %d", checkpoints.checkpoint_dir(config.model_dir), start)
  n_params = sum(int(x.size) for x in jax.tree.leaves(state.params))
  flops_per_token = flops.train_flops_per_token(exp.model_config, config.seq_len)
  peak, peak_source = hardware.peak_flops_per_device()
  logging.info("model: %s parameters; %.3g train FLOPs/token; peak %.3g FLOP/s/device (%s); mesh %s",
               f"{n_params:,}", flops_per_token, peak, peak_source, dict(exp.mesh.shape))
  metadata = {"mesh_shape": dict(exp.mesh.shape), "seq_len": config.seq_len,
              "batch_size": config.batch_size, "num_params": n_params}

  step_fn = exp.jit_train_step()
  eval_fn = exp.jit_eval_step()
  watch = metrics_lib.Stopwatch()
  records, last, compile_seconds = [], {}, None
  step = start
  with exp.context():
    while step < config.train_steps:
      t0 = time.perf_counter()
      batch = global_batch.to_global(global_batch.tf_to_numpy(next(train_iter)), exp.batch_sharding)
      watch.add("data_wait", time.perf_counter() - t0)
      if step == start:
        t_compile = time.perf_counter()
        state, step_metrics = step_fn(state, batch)
        jax.block_until_ready(step_metrics)
        compile_seconds = time.perf_counter() - t_compile
      else:
        state, step_metrics = step_fn(state, batch)
      step += 1
      records.append(step_metrics)
      if step % config.log_every == 0 or step == config.train_steps:
        scalars, tokens = _mean_metrics(records)
        elapsed = watch.elapsed()
        scalars["tokens_per_sec"] = tokens / elapsed
        scalars["tokens_per_sec_per_device"] = scalars["tokens_per_sec"] / jax.device_count()
        scalars["mfu"] = flops.mfu(scalars["tokens_per_sec"], flops_per_token, jax.device_count(), peak)
        scalars["step_seconds"] = elapsed / len(records)
        scalars["data_wait_seconds"] = watch.totals.get("data_wait", 0.0) / len(records)
        scalars.update(metrics_lib.device_memory())
        if compile_seconds is not None:  # first step of this launch: trace + compile + run
          scalars["compile_seconds"], compile_seconds = compile_seconds, None
        logger.write(step, scalars)
        logging.info("%s", metrics_lib.progress_line(step, config.train_steps, scalars["loss"],
                                                     scalars["tokens_per_sec"], scalars["mfu"],
                                                     scalars["step_seconds"]))
        last.update(scalars)
        records = []
        watch.reset()
      if (config.eval_every and step % config.eval_every == 0) or step == config.train_steps:
        result = exp.evaluate(state.params, eval_fn)
        logger.write(step, result)
        logging.info("step %d: eval loss %.4f perplexity %.2f", step, result["eval/loss"],
                     result["eval/perplexity"])
        last.update(result)
        watch.reset()
      if step % config.checkpoint_every == 0 or step == config.train_steps:
        checkpoints.save(manager, step, state, train_iter, {**metadata, "step": step})
  manager.wait_until_finished()
  manager.close()
  logger.close()
  if is_primary:
    with tf.io.gfile.GFile(f"{config.model_dir}/config.gin", "w") as f:
      f.write(gin.operative_config_str())
  return last
