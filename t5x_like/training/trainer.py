"""The training loop: resume or initialise, then steps with periodic hooks (log, eval, profile, checkpoint).

`train()` assembles a run from its configs (training/experiment.py builds the mesh, model, objective
and jitted step); `run_loop()` is the loop itself, with every side effect behind a hook or the run
guard, so it can be driven in-process by tests.
"""

import contextlib
import importlib
import time
from typing import Callable, Optional, Sequence

from absl import logging
import gin
import jax
import tensorflow as tf

from t5x_like.data import input_pipeline
from t5x_like.data import mixture as mixture_lib
from t5x_like.model import decoder as model_lib
from t5x_like.observe import flops
from t5x_like.observe import hardware
from t5x_like.observe import metrics as metrics_lib
from t5x_like.observe import profiling
from t5x_like.observe import prometheus
from t5x_like.observe import trackers
from t5x_like.parallel import global_batch
from t5x_like.training import checkpointing as checkpoints
from t5x_like.training import curriculum
from t5x_like.training import fault_tolerance
from t5x_like.training import hooks as hooks_lib
from t5x_like.training import optimizer as optimizer_lib
from t5x_like.training import precision
from t5x_like.training.config import TrainConfig


# What assembles a run (recipes/experiment.py: Experiment, over the recipes) registers itself here: the loop sits
# below the methods and never imports one.
_BUILDERS = {}


def register_experiment(builder: Callable) -> None:
  """builder(config, model_config, optimizer_config, precision_config) → the run's Experiment."""
  _BUILDERS["experiment"] = builder


def experiment_builder() -> Callable:
  if "experiment" not in _BUILDERS:
    importlib.import_module("t5x_like.recipes.experiment")  # it registers itself
  return _BUILDERS["experiment"]


class StepGate:
  """Whether the loop dispatches a step before the last one has finished (`ahead`: TrainConfig.dispatch_ahead; None =
  the backend's default, not on CPU), and one step in flight when not: `wait()` before dispatching a step,
  `dispatched(metrics)` after. XLA:CPU mallocs a step's temporaries (1.7 GiB for gpt_25m float32 at 16 × 256) when it
  starts and frees them on its own thread 0.1–6 ms after the outputs are ready; a step started in that gap, or
  dispatched ahead, holds a second set, and a host allocator that keeps freed pages (jemalloc's settings here) keeps
  both for good. So `wait()` blocks on the last step's metrics, then gives the runtime the smaller of WAIT_SECONDS and
  WAIT_FRACTION of the last step's time. gpt_25m (jemalloc, pages kept): 5.1 GiB resident dispatching ahead or waiting
  for the outputs alone, 3.4 GiB with the pause, at the same speed (docs/performance.md). The host's share of the next
  step (its batch) is prepared before `wait()`, while the last step runs."""
  WAIT_SECONDS = 0.01
  WAIT_FRACTION = 0.01

  def __init__(self, dispatch_ahead: Optional[bool] = None):
    self.ahead = jax.default_backend() != "cpu" if dispatch_ahead is None else bool(dispatch_ahead)
    self.metrics, self.started = None, 0.0

  def wait(self) -> None:
    if self.ahead or self.metrics is None:
      return
    jax.block_until_ready(self.metrics)
    time.sleep(min(self.WAIT_SECONDS, self.WAIT_FRACTION * (time.perf_counter() - self.started)))

  def dispatched(self, metrics) -> None:
    self.metrics, self.started = metrics, time.perf_counter()


def run_loop(*, state, start: int, train_steps: int, next_batch: Callable[[int], dict], step_fn: Callable,
             hooks: Sequence[Callable], checkpoint: hooks_lib.CheckpointHook, guard, meter,
             profile: Optional[hooks_lib.ProfileHook] = None, dispatch_ahead: Optional[bool] = True):
  """Runs optimizer steps start+1..train_steps.

  After each step: `hooks` (log, eval, ...) in order; then the run guard's non-finite policy (a
  rollback restarts from the checkpoint it returns, without saving); then the checkpoint hook, forced
  when the guard saw a preemption signal, after which the loop stops.

  Args:
    state: the TrainState to continue from (donated to `step_fn`).
    start: its step number.
    train_steps: the step to reach.
    next_batch: step number → that step's global batch.
    step_fn: (state, batch) → (state, step metrics), dispatched asynchronously.
    hooks: callables (step, state, step_metrics).
    checkpoint: the checkpoint hook.
    guard: fault_tolerance.RunGuard (after_step / rollback / preempted).
    meter: metrics.IntervalMeter timing the steps.
    profile: the profile hook, if any (it starts traces before a step).
    dispatch_ahead: False keeps one step in flight (StepGate): the next batch is fetched while the last step runs,
      the step dispatched once it has finished; None = the backend's default.

  Returns:
    (last step run, state).
  """
  step, gate = start, StepGate(dispatch_ahead)
  while step < train_steps:
    if profile is not None:
      profile.before_step(step + 1)
    meter.begin_step()
    batch = next_batch(step + 1)
    meter.data_ready()
    gate.wait()
    state, step_metrics = step_fn(state, batch)
    gate.dispatched(step_metrics)
    meter.end_step(step_metrics, compiling=step == start,
                   sync=profile is not None and profile.syncs_after(step + 1))
    step += 1
    for hook in hooks:
      hook(step, state, step_metrics)
    if guard.after_step(step, step_metrics):  # non-finite streak under nonfinite_action='rollback'
      step, state = guard.rollback()
      continue
    preempted = guard.preempted(step)  # SIGTERM/SIGINT: checkpoint now, then stop
    checkpoint(step, state, step_metrics, force=preempted)
    if preempted:
      break
  return step, state


class _PrometheusSink:
  """The Prometheus exporter as a metric sink of the log and eval hooks."""

  def __init__(self, exporter, train_steps: int):
    self.exporter, self.train_steps = exporter, train_steps

  def write(self, step: int, scalars) -> None:
    self.exporter.update(scalars, step=step, train_steps=self.train_steps)


def initial_state(exp, manager, train_iter) -> tuple:
  """Where a launch starts: MODEL_DIR's newest good checkpoint (a resumed fine-tune continues from its own
  checkpoint, never the base), else a fresh state, warm-started from CheckpointConfig.warm_start_from
  (INITIAL_CHECKPOINT_PATH) after checking its shapes. Under LoRA the base is loaded as the frozen model:
  on resume the one the checkpoint's metadata names, else INITIAL_CHECKPOINT_PATH's newest step. A DPO/IPO
  objective's frozen reference is loaded the same way (REFERENCE_CHECKPOINT_PATH, default INITIAL_CHECKPOINT_PATH),
  and a distillation teacher (TEACHER_CHECKPOINT_PATH). A reward model warm-started from a checkpoint without a
  score head keeps its fresh (zero) head.

  Returns:
    (start step, state, the restored checkpoint's metadata or None, metadata to record in this run's
    checkpoints: {'lora': {...}} or {'initial_checkpoint': path}, {'reference_checkpoint': path} and
    {'teacher_checkpoint': path}).
  """
  config, ckpt = exp.config, exp.config.checkpoint
  abstract = exp.abstract_with_shardings()
  restored_step, state, saved_metadata = checkpoints.restore_latest(manager, abstract, train_iter, quarantine=True)
  resumed = state is not None
  # the frozen models the method reads (a LoRA base, a reference, a teacher): a resumed run keeps those its
  # checkpoints name; `origin` is what this run's checkpoints record about them
  origin = exp.load_frozen(saved_metadata if resumed else None, restored_step if resumed else None)
  if resumed:
    logging.info("resumed from %s at step %d", checkpoints.checkpoint_dir(config.model_dir), int(restored_step))
    return int(restored_step), exp.stage_order_of(state), saved_metadata, origin  # checkpoints hold layer order
  if ckpt.warm_start_from and exp.state_holds_model_params:  # (LoRA's state holds adapters; its base is frozen)
    pinned = exp.check_checkpoint_shapes(ckpt.warm_start_from)  # before anything compiles
    state = exp.fresh_state(pinned, ckpt.warm_start_optimizer)  # a reward model's new head stays fresh
    origin["initial_checkpoint"] = pinned
  else:
    state = exp.fresh_state()
  return 0, state, None, origin


def _write_operative_config(model_dir: str) -> None:
  with tf.io.gfile.GFile(f"{model_dir}/config.gin", "w") as f:
    f.write(gin.operative_config_str())


def check(config: TrainConfig, model_config: model_lib.GPTConfig,
          optimizer_config: optimizer_lib.OptimizerConfig,
          precision_config: Optional[precision.PrecisionConfig] = None) -> dict:
  """`train --check`: the run's whole configuration checked in the one pass train() starts with (layout, recipe,
  data streams, the shapes of every checkpoint it reads), without compiling, allocating or writing anything.

  Returns:
    the start-up report (parameters, trainable fraction, bytes per device of parameters and optimizer state).
  """
  exp = experiment_builder()(config, model_config, optimizer_config, precision_config)
  resuming = bool(config.model_dir) and bool(checkpoints.committed_steps(config.model_dir))
  return exp.validate(resuming=resuming)


def train(config: TrainConfig, model_config: model_lib.GPTConfig,
          optimizer_config: optimizer_lib.OptimizerConfig,
          precision_config: Optional[precision.PrecisionConfig] = None,
          hook_factories: Sequence[Callable] = ()) -> dict:
  """Trains until `config.train_steps`, resuming from the newest good checkpoint in MODEL_DIR.

  `hook_factories`: each called as factory(runtime, sinks, train_steps) once the metric sinks exist (before the
  first step compiles); the hooks they return run after the evaluation hook, as hook(step, state, step_metrics).

  Returns:
    The last logged training metrics and the final evaluation.
  """
  if not config.model_dir:
    raise ValueError("MODEL_DIR is not set: pass --gin.MODEL_DIR=\"'/path/to/run'\"")
  if config.curriculum.enabled():  # validates the settings before anything is built
    logging.info("sequence-length warmup over %d steps through lengths %s",
                 config.curriculum.seq_len_warmup_steps,
                 curriculum.lengths(config.curriculum, config.seq_len, config.loss_chunk))
  exp = experiment_builder()(config, model_config, optimizer_config, precision_config)
  is_primary = jax.process_index() == 0
  fault_tolerance.check_writable(config.model_dir)
  tf.io.gfile.makedirs(config.model_dir)
  if is_primary:
    _write_operative_config(config.model_dir)
  ckpt, ft = config.checkpoint, config.fault_tolerance
  manager = checkpoints.make_manager(config.model_dir, max_to_keep=ckpt.keep, keep_period=ckpt.keep_period,
                                     async_save=ckpt.async_save)
  exp.validate(resuming=manager.latest_step() is not None)  # the whole run's checks in one pass, before anything
  train_iter = iter(exp.dataset("train", shuffle=True, repeat=True))
  abstract = exp.abstract_with_shardings()
  start, state, saved_metadata, origin = initial_state(exp, manager, train_iter)
  n_params = sum(int(x.size) for x in jax.tree.leaves(state.params))
  flops_per_token = flops.train_flops_per_token(exp.model_config, config.seq_len)
  peak, peak_source = hardware.peak_flops_per_device()
  report = exp.startup_report()
  logging.info("model: %s parameters, %s trainable (%.4g%%); optimizer state %s bytes per device; %.3g train "
               "FLOPs/token (PaLM 6N + 12LTd, causal attention not halved); peak %.3g FLOP/s/device (%s); mesh %s",
               f"{report['params/total']:,}", f"{report['params/trainable']:,}",
               100 * report["params/trainable_fraction"], f"{report['memory/opt_state_bytes_per_device']:,}",
               flops_per_token, peak, peak_source, dict(exp.mesh.shape))
  metadata = checkpoints.run_metadata(mesh_shape=exp.mesh.shape, data_dir=config.data_dir,
                                      gin_config=gin.operative_config_str(), seq_len=config.seq_len,
                                      batch_size=config.batch_size, num_params=n_params, **origin)
  checkpoints.check_resume_metadata(saved_metadata, metadata)
  guard = fault_tolerance.RunGuard(manager, abstract, nonfinite_patience=ft.nonfinite_patience,
                                   nonfinite_action=ft.nonfinite_action, max_failed_saves=ft.max_failed_saves,
                                   debug_nan_steps=ft.debug_nan_steps, restored=exp.stage_order_of)
  jitted_step = exp.jit_train_step()
  eval_fn = exp.jit_eval_step()
  meter = metrics_lib.IntervalMeter(config.batch_size * config.seq_len, jax.device_count(), flops_per_token, peak)
  profile = hooks_lib.ProfileHook(profiling.StepProfiler(config.model_dir, config.observe.profile_steps, is_primary))

  def next_batch(step: int):
    local = guard.poison(global_batch.tf_to_numpy(next(train_iter)), step)  # debug_nan_steps only
    length = curriculum.length_at(config.curriculum, step - 1, config.seq_len, config.loss_chunk)
    return exp.global_batch(curriculum.cut_rows(local, length))

  next_batch = exp.batches(next_batch)  # an on-policy method (GRPO) samples its own from the current parameters

  def step_fn(state, batch):
    host = {}
    if callable(batch):  # a batch made from the parameters the step starts from: (batch, host metrics)
      batch, host = batch(state.params)
    state, step_metrics = jitted_step(state, batch, exp.frozen)
    return state, {**step_metrics, **host}

  def save(step: int, state) -> None:  # in layer order, whatever the layout (Runtime.layer_order_of)
    guard.save(step, exp.layer_order_of(state), train_iter, {**metadata, "step": step})

  with contextlib.ExitStack() as stack:
    logger = stack.enter_context(contextlib.closing(metrics_lib.MetricsLogger(config.model_dir, is_primary)))
    exporter = prometheus.start(config.observe.prometheus_port, config.observe.prometheus_host, is_primary)
    stack.callback(exporter.close)
    stack.callback(manager.close)
    exporter.update({}, step=start, train_steps=config.train_steps)
    logger.write(start, report)  # what trains and what its optimizer state costs, once per launch
    if exp.mixture:  # data/tokens/<source>: the training tokens each mixture source gave so far
      logger = mixture_lib.TokensSeen(logger, exp.mixture, batch_size=config.batch_size, seq_len=config.seq_len,
                                      num_streams=config.data.data_streams or jax.process_count(), seed=config.seed)
    tracked = trackers.open_trackers(config.observe.trackers, config.model_dir, gin.operative_config_str(),
                                     config.observe.tracking_uri, config.observe.experiment, is_primary=is_primary)
    for tracker in tracked:  # MLflow / W&B: the start-up report, then what the logger gets
      stack.callback(tracker.close)
      tracker.write(start, report)
    sinks = [logger, _PrometheusSink(exporter, config.train_steps)] + tracked
    last_step = config.train_steps
    log = hooks_lib.LogHook(hooks_lib.Every(config.log_every, last_step), meter, sinks, train_iter)
    evaluate = hooks_lib.EvalHook(
        hooks_lib.Every(config.eval_every, last_step), lambda params: exp.evaluate(params, eval_fn), meter, sinks,
        final_extra=(lambda: {"eval/unigram_baseline": input_pipeline.unigram_baseline(config.data_dir)})
        if config.data.report_unigram_baseline else None)
    extra_hooks = [factory(exp, sinks, config.train_steps) for factory in hook_factories]
    checkpoint = hooks_lib.CheckpointHook(hooks_lib.Every(config.checkpoint_every, last_step), save, meter)
    with exp.context(), guard:
      step, state = run_loop(state=state, start=start, train_steps=config.train_steps, next_batch=next_batch,
                             step_fn=step_fn, hooks=[profile, log, evaluate, *extra_hooks],
                             checkpoint=checkpoint, guard=guard, meter=meter, profile=profile,
                             dispatch_ahead=config.dispatch_ahead)
      guard.finish(step)  # waits for the last save; the final one must have committed
    profile.profiler.stop(state)
  if is_primary:
    _write_operative_config(config.model_dir)
  guard.raise_if_preempted(step, config.train_steps)
  log.data_iterator = None
  input_pipeline.release(train_iter)  # freed on its own thread once this frame is gone (tf.data's teardown can wait)
  return {**log.last, **evaluate.last}
