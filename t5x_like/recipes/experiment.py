"""The pieces a run, an evaluation or a sampler need, built once under the mesh and the axis rules.

mesh → resolved model config → layout check → sharded abstract state → objective → jitted steps;
plus the data streams, evaluation over the objective, and frozen models on the same mesh. Under LoRA
(TrainConfig.lora.rank > 0) the state's parameters are the adapters, the base model is the frozen
model `lora.BASE`, and the objective is wrapped to merge them (posttrain/lora.py).

It never names a method: what a method needs beyond its objective (frozen models, its own batches or evaluation,
the reward head) its recipe says (training/config.Recipe, t5x_like/recipes/<name>.py).
"""

import functools
from typing import Optional

import jax

from t5x_like.data import chat
from t5x_like.data import input_pipeline
from t5x_like.data import mixture as mixture_lib
from t5x_like.model import decoder as model_lib
from t5x_like.observe import metrics as metrics_lib
from t5x_like.parallel import global_batch
from t5x_like.parallel import offload
from t5x_like.parallel import partitioning
from t5x_like.posttrain import frozen_models
from t5x_like.posttrain import lora as lora_lib
from t5x_like.posttrain import marker_rows
from t5x_like.posttrain import quantize
from t5x_like.training import checkpointing
from t5x_like.training import optimizer as optimizer_lib
from t5x_like.training import precision
from t5x_like.training import runtime as runtime_lib
from t5x_like.training import step as step_lib
from t5x_like.training import train_state as train_state_lib
from t5x_like.training import trainable as trainable_lib
from t5x_like.training import trainer
from t5x_like.training.config import TrainConfig


_NO_DATA_DIR = "DATA_DIR is not set: training and evaluation read a prepared dataset (python -m t5x_like.preprocess)"


# re-exported for the tests that check them here until this module is gone (training/runtime.py)
resolve_model_config = runtime_lib.resolve_model_config
validate_layout = runtime_lib.validate_layout


class Experiment(runtime_lib.Runtime, frozen_models.FrozenModels):
  """A run's runtime (mesh, model, restore) with its objective, optimizer and shardings, built once."""

  def __init__(self, config: TrainConfig, model_config: model_lib.GPTConfig,
               optimizer_config: optimizer_lib.OptimizerConfig,
               precision_config: Optional[precision.PrecisionConfig] = None):
    self.recipe = recipe = config.recipe_config  # the method's config (t5x_like/recipes/<TrainConfig.recipe>.py)
    # the state's blocks in stage order under an interleaved pipeline (no per-step regrouping of the weights);
    # not with the optimizer state offloaded to the host, which a conversion on the device cannot reach
    super().__init__(config, model_config, scored=recipe.scored_model,  # reward: the score head
                     stage_order=not config.offload_optimizer)
    self.precision_config = precision_config or precision.PrecisionConfig()
    if config.use_lora:
      lora_lib.validate(config.lora, self.model_config)  # LoRA dropout: not with pipeline stages
    # The objective over the model's parameters; under LoRA, `objective` wraps it to take adapters.
    self.model_objective = recipe.make_objective(self, loss_scaled=self.initial_loss_scale() is not None)
    self.objective = self.model_objective
    self.lr_fn = optimizer_lib.learning_rate_schedule(optimizer_config, config.train_steps)
    self.tx = optimizer_lib.make_optimizer(optimizer_config, config.train_steps)
    self.batch_sharding = partitioning.batch_sharding(self.mesh, self.rules)
    self.frozen, self.frozen_shardings = {}, {}
    self._eval_datasets = {}  # (split, repeat, data_dir) → its tf.data pipeline, built (traced) once per run
    self._datasets = {}  # (split, shuffle, repeat) → this process's training-data pipeline, built once per run
    self.loaded = {}  # {frozen model name: the checkpoints/<step> directory it was read from}
    self._frozen_layouts, self._parts = {}, {}
    self.lora = config.lora if config.use_lora else None
    self.lora_base = None  # under LoRA: the base's checkpoints/<step> directory, once loaded
    self.params_fn = None  # rng → the state's boxed parameters when they are not the model's (LoRA adapters)
    self.marker_ids = ()  # under LoRA on chat data: the chat template's marker tokens, whose rows train too
    if self.lora:
      self.marker_ids = self._marker_ids()
      self.objective = lora_lib.objective(self.model_objective, self.boxed_params, self.lora, self.marker_ids)
      self.params_fn = functools.partial(lora_lib.init_run_adapters, boxed_params=self.boxed_params,
                                         config=self.lora, marker_ids=self.marker_ids)
      self.frozen_shardings[lora_lib.BASE] = partitioning.shardings_from_boxed(
          quantize.boxed_stored(self.boxed_params, self.lora.base_precision), self.mesh, self.rules)
    self.frozen_specs = tuple(recipe.frozen_models(self))  # a reference, a teacher (posttrain/frozen_models.py)
    for spec in self.frozen_specs:
      self.frozen_shardings[spec.name] = self.frozen_layout(spec)[1]
    with self.context():
      self.abstract_state, self.state_shardings = train_state_lib.state_shardings(
          self.model, self.tx, self.mesh, self.rules, loss_scale=self.initial_loss_scale(),
          trainable=config.trainable_regex, params_fn=self.params_fn,
          boxed_params=None if self.params_fn else self.boxed_params)
    self.trainable_paths = trainable_lib.trainable_paths(self.abstract_state.params, config.trainable_regex)
    self.device_state_shardings = self.state_shardings  # where a fresh state is built (then moved, if offloaded)
    if config.offload_optimizer:
      self.state_shardings = offload.offload_shardings(self.state_shardings)

  def _marker_ids(self) -> tuple:
    """The token ids of the chat template's markers when the data is chat or preference data (its manifest
    records a template) and LoraConfig.marker_rows is on; else (). A run resuming from its own checkpoints keeps
    the ids they record (none for a run started before marker rows existed, so it still resumes)."""
    if self.config.model_dir and checkpointing.committed_steps(self.config.model_dir):
      saved = checkpointing.read_metadata(checkpointing.step_dir(self.config.model_dir)[1]).get("lora")
      if saved is not None:
        return tuple(saved.get("marker_ids") or ())
    template = (self.manifest or {}).get("chat_template")
    if not self.lora.marker_rows or template is None:
      return ()
    tokenizer = self.load_tokenizer()
    return tuple(sorted(set(chat.marker_pieces(tokenizer, chat.ChatTemplate(**template)).values())))

  @property
  def state_holds_model_params(self) -> bool:
    """Whether the TrainState's parameters are the model's (not LoRA's adapters over a frozen base)."""
    return self.params_fn is None

  def batches(self, next_batch):
    """step → that step's batch: `next_batch` (the data pipeline's), or what the recipe makes instead (an
    on-policy method samples each step's from the parameters it starts from: posttrain/rollout.py)."""
    return self.recipe.batches(self, next_batch)

  def part(self, key: str, build):
    """A recipe's per-run object (GRPO's rollouts), built by `build()` on first use, then kept."""
    if key not in self._parts:
      self._parts[key] = build()
    return self._parts[key]

  def startup_report(self) -> dict:
    """What trains and what it costs: parameter counts and bytes per device of the parameters that
    train, their optimizer state and (under LoRA) the frozen base."""
    state_params = self.abstract_state.params
    trainable = lora_lib.count(trainable_lib.trainable_part(state_params, self.trainable_paths))
    total = lora_lib.count(state_params) + (lora_lib.count(partitioning.unbox(self.boxed_params)) if self.lora else 0)
    report = {
        "params/total": total, "params/trainable": trainable, "params/trainable_fraction": trainable / total,
        "memory/opt_state_bytes_per_device": train_state_lib.bytes_per_device(self.abstract_state.opt_state,
                                                                               self.state_shardings.opt_state),
        "memory/params_bytes_per_device": train_state_lib.bytes_per_device(state_params,
                                                                            self.state_shardings.params),
    }
    if self.lora:
      stored = quantize.boxed_stored(self.boxed_params, self.lora.base_precision)  # QLoRA: the quantised bytes
      report["memory/frozen_base_bytes_per_device"] = train_state_lib.bytes_per_device(
          partitioning.unbox(stored), self.frozen_shardings[lora_lib.BASE])
      report["params/marker_rows"] = lora_lib.count(marker_rows.deltas(state_params))
    report.update(self.frozen_report())  # a reference, a teacher: laid out by the same rules, no optimizer state
    return report

  def validate(self, *, resuming: bool = False) -> dict:
    """The checks of the whole run that need no compile, in one pass, before anything compiles: the config,
    layout and recipe were checked when this was built; here the training data streams of every process, and
    (for a fresh run) the shapes of every checkpoint it will read: INITIAL_CHECKPOINT_PATH or the LoRA base, and
    each frozen model the recipe declares. A resumed run reads those its checkpoints name, checked on load.

    Returns:
      the start-up report (what trains and what it costs).
    Raises:
      ValueError: the first problem, in one line naming the file, key or value.
    """
    self.dataset("train", shuffle=True, repeat=True)  # every stream has records; the pipeline train() reads
    ckpt = self.config.checkpoint
    if not resuming:
      if ckpt.warm_start_required and not ckpt.warm_start_from:
        raise ValueError("INITIAL_CHECKPOINT_PATH is empty: a fine-tuning run (configs/runs/finetune.gin) starts "
                         "from a base model's MODEL_DIR or checkpoints/<step>")
      if self.lora and not ckpt.warm_start_from:
        raise ValueError(frozen_models.NO_LORA_BASE)
      if ckpt.warm_start_from:
        self.check_checkpoint_shapes(ckpt.warm_start_from, "LoRA base checkpoint" if self.lora else
                                     "initial checkpoint (INITIAL_CHECKPOINT_PATH)")
      for spec in self.frozen_specs:
        if not spec.path:
          raise ValueError(spec.missing)
        self.check_checkpoint_shapes(spec.path, spec.what, boxed=self.frozen_layout(spec)[0])
    return self.startup_report()

  def initial_loss_scale(self):
    """The dynamic loss-scale state a fresh TrainState starts with (None without loss scaling)."""
    return precision.init_loss_scale(self.precision_config, self.model_config.dtype)

  def init_state(self):
    with self.context():
      state, _ = train_state_lib.init_state(self.model, self.tx, jax.random.key(self.config.seed), self.mesh,
                                            self.rules, loss_scale=self.initial_loss_scale(),
                                            trainable=self.config.trainable_regex, params_fn=self.params_fn,
                                            shardings=self.device_state_shardings)
    return jax.device_put(state, self.state_shardings)  # a no-op unless the optimizer state is offloaded

  def state_around(self, params):
    """The fresh TrainState holding `params` (the state's parameters, laid out as it lays them out; consumed):
    init_state's, without its random initialisation (train_state.state_around)."""
    with self.context():
      state = train_state_lib.state_around(params, self.tx, self.device_state_shardings, self.initial_loss_scale(),
                                           self.config.trainable_regex)
    return jax.device_put(state, self.state_shardings)

  def fresh_state(self, warm_start_path: str = "", with_optimizer: bool = False):
    """The state a fresh run starts from: initialised, or warm-started from `warm_start_path`; then the parameters
    the recipe fills (Recipe.initial_params: PPO's value head from a reward model); its blocks in this model's
    order (`stage_order_of`)."""
    if warm_start_path:
      state = self.warm_start(warm_start_path, self.abstract_with_shardings(), with_optimizer)
    else:
      state = self.init_state()
    with self.context():
      return self.stage_order_of(state.replace(params=self.recipe.initial_params(self, state.params)))

  def abstract_with_shardings(self):
    """The TrainState's ShapeDtypeStructs carrying this run's shardings (restore/reshard target)."""
    return checkpointing.abstract_with_shardings(self.abstract_state, self.state_shardings)

  def dataset(self, split: str, *, shuffle: bool, repeat: bool):
    """This process's rows of every global batch (see global_batch.process_rows). Built (its functions traced) once
    per run: each iter() of it starts a fresh iterator, as a new pipeline's would."""
    key = (split, shuffle, repeat)
    if key not in self._datasets:
      self._datasets[key] = self._make_dataset(split, shuffle, repeat)
    return self._datasets[key]

  def _make_dataset(self, split: str, shuffle: bool, repeat: bool):
    if self.manifest is None:
      raise ValueError(_NO_DATA_DIR)
    num_streams = self.config.data.data_streams or jax.process_count()
    sources = zip(self.mixture.paths, self.mixture.manifests) if self.mixture else [(self.config.data_dir, self.manifest)]
    for data_dir, manifest in sources:
      for s in range(num_streams):
        shards, _ = input_pipeline.host_shards(manifest, data_dir, split, s, num_streams)
        if not sum(records for _, records in shards):
          raise ValueError(f"DATA_DIR '{data_dir}' split '{split}' has too few records for "
                           f"{num_streams} data streams: stream {s} would read nothing (lower "
                           f"DataConfig.data_streams or write more shards)")

    def stream(stream_index, num_streams, batch_size):
      if self.mixture:  # every source's rows, mixed by weight (repeating)
        return self.mixture.make_dataset(
            split, batch_size=batch_size, seq_len=self.config.seq_len, seed=self.config.seed, shuffle=shuffle,
            shuffle_buffer=self.config.data.shuffle_buffer, order_window=self.config.data.order_window,
            process_index=stream_index, process_count=num_streams)
      return input_pipeline.make_dataset(
          self.config.data_dir, split, batch_size=batch_size, seq_len=self.config.seq_len,
          seed=self.config.seed, shuffle=shuffle, repeat=repeat, shuffle_buffer=self.config.data.shuffle_buffer,
          order_window=self.config.data.order_window,
          process_index=stream_index, process_count=num_streams)
    return global_batch.process_rows(stream, num_streams=num_streams, global_batch_size=self.config.batch_size,
                                     process_index=jax.process_index(), process_count=jax.process_count())

  def eval_dataset(self, split: str = "validation", repeat: bool = True, data_dir: Optional[str] = None):
    """Evaluation batches, identical on any process layout (and the same count on every process): each
    process reads the whole (small) split in one fixed order and keeps its own rows of each global batch.
    `data_dir`: a mixture source's (default DATA_DIR). Built once per run: each evaluation iterates the same
    pipeline again from its start (tf.data restarts an unshuffled dataset in the same order), without tracing
    its functions again."""
    key = (split, repeat, data_dir)
    if key not in self._eval_datasets:
      rows = self.config.batch_size // jax.process_count()
      first = jax.process_index() * rows
      ds = input_pipeline.make_dataset(data_dir or self.config.data_dir, split, batch_size=self.config.batch_size,
                                       seq_len=self.config.seq_len, seed=self.config.seed, shuffle=False,
                                       repeat=repeat, process_index=0, process_count=1)
      self._eval_datasets[key] = global_batch.keep_rows(ds, first, first + rows)
    return self._eval_datasets[key]

  def train_step_fn(self):
    """The pure step of this run (before jit): the objective under the generic step."""
    return step_lib.make_train_step(
        self.objective, self.tx, self.lr_fn, num_microbatches=self.config.num_microbatches,
        precision_config=self.precision_config, trainable_paths=self.trainable_paths,
        offloaded_shardings=self.state_shardings if self.config.offload_optimizer else None)

  def jit_train_step(self):
    """jit once: state donated, batch and frozen models on their shardings. Call as step(state, batch, frozen)."""
    return step_lib.jit_train_step(self.train_step_fn(), self.state_shardings, self.batch_sharding,
                                   self.objective.features, self.frozen_shardings)

  def jit_eval_step(self):
    return jax.jit(lambda params, batch, frozen: step_lib.eval_step(params, batch, frozen, objective=self.objective),
                   in_shardings=(self.state_shardings.params, {k: self.batch_sharding for k in self.objective.features},
                                 self.frozen_shardings))

  def num_eval_batches(self, split: str = "validation", data_dir: Optional[str] = None) -> Optional[int]:
    """DataConfig.eval_batches, else None (one pass over the split) on one process; several processes
    need the same count everywhere, so they use the split's tokens over the tokens per batch."""
    if self.config.data.eval_batches:
      return self.config.data.eval_batches
    if jax.process_count() == 1:
      return None
    manifest = self.mixture.manifests[self.mixture.paths.index(data_dir)] if data_dir else self.manifest
    tokens = manifest["splits"][split]["num_tokens"]
    return max(1, tokens // (self.config.batch_size * (self.config.seq_len + 1)))

  def global_batch(self, local: dict) -> dict:
    """This process's rows (numpy) → the objective's features as global jax.Arrays on the batch sharding."""
    return global_batch.to_global({k: local[k] for k in self.objective.features}, self.batch_sharding)

  def evaluate(self, params, eval_step=None, split: str = "validation", data_dir: Optional[str] = None) -> dict:
    """The objective's weighted loss over `split` (the whole split, or DataConfig.eval_batches batches;
    the same batches every time), its perplexity exp(loss), and the objective's metrics. A mixture's:
    eval/<source>/* of each source's split, and eval/* over all of them (token-weighted)."""
    own = self.recipe.evaluate(self, params)  # a method's own evaluation (GRPO: rewards of greedy answers)
    if own is not None:
      return own
    eval_step = eval_step or self.jit_eval_step()
    if self.mixture and data_dir is None:
      combined = mixture_lib.combine_evaluations(
          {name: self.evaluate(params, eval_step, split, data_dir=path)
           for name, path in zip(self.mixture.names, self.mixture.paths)})
      return {**combined, "eval/perplexity": metrics_lib.perplexity(combined["eval/loss"])}
    num_batches = self.num_eval_batches(split, data_dir)
    batches = self.eval_dataset(split, repeat=num_batches is not None, data_dir=data_dir)
    if num_batches is not None:
      batches = batches.take(num_batches)
    loss_sum, weight_sum, count, metric_sums = 0.0, 0.0, 0, {}
    with self.context():
      for tf_batch in batches:  # padding rows of the last batch carry weight 0
        batch = self.global_batch(global_batch.tf_to_numpy(tf_batch))
        loss, weight, metrics = eval_step(params, batch, self.frozen)
        loss_sum, weight_sum, count = loss_sum + float(loss), weight_sum + float(weight), count + 1
        for name, value in metrics.items():
          metric_sums[name] = metric_sums.get(name, 0.0) + float(value)
    denom = max(weight_sum, 1.0)
    loss = loss_sum / denom
    return {"eval/loss": loss, "eval/perplexity": metrics_lib.perplexity(loss), "eval/tokens": weight_sum,
            "eval/batches": count, **{f"eval/{name}": value / denom for name, value in metric_sums.items()}}

  def restore_params(self, step: Optional[int] = None):
    """(step, params) of MODEL_DIR's newest readable checkpoint (or `step`), on this mesh; no optimizer state.

    Under this config's LoRA: the base the checkpoint refers to merged with its adapters (the model's
    parameters); without, a LoRA run's checkpoint is read with the settings it records (Runtime.restore_params).
    """
    if self.lora:
      found, adapters = self.restore_adapters(step)
      merge = jax.jit(lambda base, a: lora_lib.merge(quantize.dequantize_params(base), a, self.lora.scale,
                                                     self.objective.kernel_names, self.objective.marker_ids),
                      out_shardings=self.model_shardings)
      with self.context():
        return found, merge(self.frozen[lora_lib.BASE], adapters)
    return super().restore_params(step)

  def restore_adapters(self, step: Optional[int] = None):
    """(step, adapters) of a LoRA run's checkpoint, with the base it names (its metadata) loaded as the
    frozen model `lora.BASE`."""
    found, adapters = checkpointing.restore_newest_params(self.config.model_dir, self.abstract_with_shardings().params,
                                                          step)
    _, path = checkpointing.step_dir(self.config.model_dir, found)
    base = checkpointing.read_metadata(path).get("lora", {}).get("base")
    if not base:
      raise ValueError(f"{path}: the checkpoint's metadata names no LoRA base (metadata key lora.base)")
    self.load_lora_base(base)
    return found, self.stage_order_of(adapters)

  def evaluate_checkpoint(self, step: Optional[int] = None, split: str = "validation") -> dict:
    """Restores a checkpoint onto this mesh and evaluates it on `split` of DATA_DIR.

    Returns:
      {"step", "split", "eval/loss", "eval/perplexity", "eval/tokens", "eval/batches"}.
    """
    if self.manifest is None:
      raise ValueError(_NO_DATA_DIR)
    if split not in self.manifest["splits"]:
      raise ValueError(f"DATA_DIR '{self.config.data_dir}' has no split '{split}' "
                       f"(available: {sorted(self.manifest['splits'])})")
    with self.context():
      found, params = self.restore_adapters(step) if self.lora else self.restore_params(step)
    own = self.recipe.evaluate(self, params)  # a method's own evaluation needs no frozen model
    if own is None:  # the frozen models the run trained against (its checkpoint's metadata), else the config's
      self.load_pinned_frozen(str(checkpointing.step_dir(self.config.model_dir, found)[1]))
      own = self.evaluate(params, split=split)
    return {"step": int(found), "split": split, **own}


trainer.register_experiment(Experiment)
