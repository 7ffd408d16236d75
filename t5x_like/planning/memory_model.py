"""Per-device memory of a training layout: sharded state from the rules table, activations from JAX's residuals.

Nothing is allocated: parameter shapes come from an abstract init (`jax.eval_shape`) with their logical
axis names, mapped to mesh axes by `partitioning.DEFAULT_RULES`; activations are the residuals JAX
itself saves for the backward pass (`saved_residuals` of the loss under the remat policy), traced once
per (model, sequence length, policy) with abstract inputs and scaled to the per-device microbatch.
"""

import dataclasses
import functools
import math
from typing import Optional

import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp

from t5x_like.parallel import axis_names as ax
from t5x_like.parallel import mesh as mesh_lib
from t5x_like.model import config as config_lib
from t5x_like.model import decoder as model_lib
from t5x_like.model import layers
from t5x_like.model import moe
from t5x_like.parallel import partitioning
from t5x_like.parallel import offload
from t5x_like.posttrain import lora as lora_lib
from t5x_like.posttrain import quantize
from t5x_like.training import optimizer
from t5x_like.training import precision
from t5x_like.training import step as train_step
from t5x_like.training import train_state
from t5x_like.training.objectives import language_model

# Calibration: a fit (least squares on log ratios, plus the largest) to XLA:CPU's compiled memory analysis over
# 19 points, refitted 1 Dec 2026 after the dense layers merged (batch, length) and causal attention went by blocks:
# 9 layouts of a 3-layer model (data, fsdp, tensor, accumulation, every remat policy, T = 128 and 512) and 10
# long-sequence points (T = 512..2,048, sequence = 1, 4, 8, both attention paths); all within 5%.
# tests/test_plan.py and tests/test_long_sequence.py check layouts stay within 15%.
ACTIVATION_OVERHEAD = 1.27  # XLA's live per-layer activation bytes ÷ JAX's residual bytes (fusion copies)
LOSS_OVERHEAD = 1.33  # embedding/logits/loss live bytes ÷ their residuals (dlogits, softmax in float32)
REMAT_WORKING = 0.21  # share of one un-rematerialised layer live while a remat layer is recomputed
WEIGHT_COPIES = 1.19  # live bytes ÷ bfloat16 weight residuals, which XLA keeps gathered over `fsdp`
UPDATE_TEMPS = 1.94  # float32 parameter-sized buffers of the backward + AdamW update (grads, updates)
ACCUMULATOR_TEMPS = 1.31  # extra float32 parameter-sized buffers when NUM_MICROBATCHES > 1
# float32 attention-score buffers (score_elements per sequence and head) live while a rematerialised layer's
# attention is rebuilt and differentiated (logits, probabilities, their gradients), beyond the loss's working set
# (not live at the same time); fitted to XLA:CPU at T = 512..2048 with sequence = 1, 4, 8, where they dominate
# (tests/test_long_sequence.py); the reference path (head-major, causal blocks) keeps fewer copies than
# jax.nn.dot_product_attention ('xla').
ATTENTION_WORKING = 4.07
REFERENCE_ATTENTION_WORKING = 3.11
# ring attention (context_parallelism='ring'): (T/s)² blocks; fitted 4 Dec 2026 to XLA:CPU at T = 2,048..8,192, s = 2,
# 4, 8, 2..8 heads, full remat (within 15%: 0.85..1.14; the backward's logits, probabilities and their gradients
# plus the checkpointed forward rerun)
RING_ATTENTION_WORKING = 4.5


def score_elements(cfg, seq_len: int, sequence: int) -> float:
  """Attention scores one (sequence, head) holds per device for a layer: (T/s) × T with the length split, else
  what layers.causal_attention computes by blocks of query rows, each against the keys up to its last row (with a
  sliding window W, from W − 1 keys before its first row; under sliding_window_pattern the global layers hold the
  most, and blocks skip only what every layer skips). The flash kernels ('splash', 'cudnn') hold one tile of
  scores at a time: taken as 512 × 512 (splash's largest tile); so does ring attention (context_parallelism='ring'),
  one (T/s) × (T/s) block of its ring."""
  impl = cfg.attention_kernel()
  if sequence > 1 and cfg.context_parallelism == "ring":  # one (T/s) × (T/s) block of the ring at a time
    return (seq_len / sequence) ** 2
  if impl in ("splash", "cudnn"):
    return min(seq_len / sequence, 512) * min(seq_len, 512)
  if sequence > 1 or impl != "reference":
    return seq_len / sequence * seq_len
  window = 0 if cfg.sliding_window_pattern else cfg.sliding_window
  first = lambda start: max(0, start - window + 1) if window else 0
  return sum((end - start) * (end - first(start)) for start, end in layers.causal_blocks(seq_len))


@dataclasses.dataclass(frozen=True)
class Layout:
  """A mesh shape plus how a step is cut up and rematerialised."""
  pipeline: int = 1  # pipeline stages (mesh axis `pipeline`)
  data: int = 1  # pure data parallelism (mesh axis `data`)
  fsdp: int = 1  # data parallelism with sharded params/grads/optimizer state (mesh axis `fsdp`)
  sequence: int = 1  # context parallelism: activations split along the sequence (mesh axis `sequence`)
  expert: int = 1  # experts split over it in MoE layers, the batch elsewhere (mesh axis `expert`)
  tensor: int = 1  # Megatron tensor parallelism over heads / d_ff / vocab (mesh axis `tensor`)
  num_microbatches: int = 1  # gradient-accumulation microbatches per step (NUM_MICROBATCHES)
  remat_policy: str = "none"  # GPTConfig.remat_policy
  pipeline_microbatches: int = 0  # pipeline microbatches per accumulation microbatch; 0 = 2 × pipeline
  pipeline_repeats: int = 1  # virtual stages per pipeline device (interleaved schedule); 1 = GPipe

  @property
  def num_devices(self) -> int:
    return self.pipeline * self.data * self.fsdp * self.sequence * self.expert * self.tensor

  @property
  def batch_ways(self) -> int:
    """How many ways the batch is split: data × fsdp × expert (the rules' `batch`)."""
    return self.data * self.fsdp * self.expert

  @property
  def mesh_shape(self) -> dict:
    return {name: getattr(self, name) for name in mesh_lib.AXES}

  @property
  def stage_microbatches(self) -> int:
    return (self.pipeline_microbatches or 2 * self.pipeline) if self.pipeline > 1 else 1

  def describe(self) -> str:
    mesh = "×".join(f"{n[0]}{getattr(self, n)}" for n in mesh_lib.AXES
                    if n not in ("expert", "sequence") or getattr(self, n) > 1)
    pipe = f" m{self.stage_microbatches}" if self.pipeline > 1 else ""
    pipe += f" v{self.pipeline_repeats}" if self.pipeline > 1 and self.pipeline_repeats > 1 else ""
    return f"{mesh} k{self.num_microbatches}{pipe} {self.remat_policy}"


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
  """Bytes per device."""
  params: float  # float32 parameters
  optimizer: float  # optimizer state (AdamW: 2 × float32 moments; see optimizer_bytes_per_device)
  grads: float  # float32 gradients (+ accumulator) and update temporaries
  activations: float  # residuals kept for the backward pass, all layers and in-flight microbatches
  working: float  # transient of one layer's (re)computed backward, logits and loss
  inputs: float  # the batch arrays

  @property
  def total(self) -> float:
    return self.params + self.optimizer + self.grads + self.activations + self.working + self.inputs


def _boxed_params(cfg: model_lib.GPTConfig):
  return model_lib.abstract_params(model_lib.shape_only(cfg))


def layout_config(cfg: model_lib.GPTConfig, layout: Layout) -> model_lib.GPTConfig:
  """The model config as `layout` runs it: its remat policy, pipeline stages and pipeline microbatches."""
  return dataclasses.replace(cfg, remat_policy=layout.remat_policy, num_stages=layout.pipeline,
                             pipeline_microbatches=layout.pipeline_microbatches if layout.pipeline > 1 else 0,
                             pipeline_repeats=layout.pipeline_repeats if layout.pipeline > 1 else 1)


def layout_reason(cfg: model_lib.GPTConfig, layout: Layout, global_batch: int,
                  rules=partitioning.DEFAULT_RULES, seq_len: int = 0) -> Optional[str]:
  """The model's and the layout validator's reason why `layout` cannot run this model and batch (None if it can)."""
  try:
    run_cfg = layout_config(cfg, layout)
    config_lib.check_layout(run_cfg, layout.mesh_shape, rules, batch_size=global_batch,
                            num_microbatches=layout.num_microbatches, seq_len=seq_len)
    run_cfg.validate()  # what the mesh alone does not decide (pipeline repeats against layers and microbatches)
  except ValueError as e:
    return str(e)
  return None


def _rules_dict(rules) -> dict:
  return {name: (target if isinstance(target, tuple) else (target,) if target else ()) for name, target in rules}


def param_elements_per_device(cfg: model_lib.GPTConfig, layout: Layout, rules=partitioning.DEFAULT_RULES,
                              experts: Optional[bool] = None) -> int:
  """Parameter elements one device holds under `rules` (uneven shards round up, as XLA pads them); only the
  experts' weights (`experts`=True) or only the others (False)."""
  return int(_bytes_per_device(_boxed_params(cfg), layout, rules, experts, itemsize=False))


def _bytes_per_device(boxed_tree, layout: Layout, rules, experts: Optional[bool] = None,
                      itemsize: bool = True) -> float:
  """Bytes (or, with itemsize=False, elements) one device holds of an abstract tree whose leaves may be boxed
  with logical names; unboxed leaves are replicated."""
  mapping, sizes = _rules_dict(rules), layout.mesh_shape
  total = 0
  for leaf in jax.tree.leaves(boxed_tree, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned)):
    boxed = isinstance(leaf, nn.LogicallyPartitioned)
    value = leaf.value if boxed else leaf
    names = leaf.names if boxed else (None,) * len(value.shape)
    if experts is not None and (ax.EXPERT in names) != experts:
      continue
    elems = 1
    for dim, name in zip(value.shape, names):
      ways = math.prod(sizes[a] for a in mapping.get(name, ())) if name else 1
      elems *= math.ceil(dim / ways)
    total += elems * (jnp.dtype(value.dtype).itemsize if itemsize else 1)
  return total


def optimizer_bytes_per_device(cfg: model_lib.GPTConfig, layout: Layout,
                               optimizer_config: Optional[optimizer.OptimizerConfig] = None,
                               rules=partitioning.DEFAULT_RULES) -> float:
  """Bytes of optimizer state one device holds, from the optimizer's own abstract init (AdamW: two float32
  moments; Lion, SGD: one; Muon: one for the blocks' kernels, two for the rest; Adafactor: factored row and
  column moments, replicated), laid out as the trainer lays it out (train_state.replicate_reshaped)."""
  return _bytes_per_device(_abstract_optimizer_state(model_lib.shape_only(cfg),
                                                     optimizer_config or optimizer.OptimizerConfig()), layout, rules)


@dataclasses.dataclass(frozen=True)
class LoraBytes:
  """Per-device bytes of a LoRA / QLoRA run's state, laid out as the trainer lays it out."""
  base: float  # the frozen base as stored: quantised kernels (codes + scales) and bfloat16 rest, or float32 / bfloat16
  adapters: float  # the float32 adapters (they train)
  optimizer: float  # the adapters' optimizer state


def lora_bytes_per_device(cfg: model_lib.GPTConfig, layout: Layout, config: lora_lib.LoraConfig,
                          optimizer_config: Optional[optimizer.OptimizerConfig] = None,
                          rules=partitioning.DEFAULT_RULES) -> LoraBytes:
  """The frozen base (`quantize.boxed_stored` at config.base_precision), the adapters on config.targets and their
  optimizer state, per device (without the template's marker rows, which depend on the data: 4 × d_model
  elements per table)."""
  return _lora_bytes(model_lib.shape_only(cfg), layout, config, optimizer_config or optimizer.OptimizerConfig(),
                     tuple(rules))


@functools.lru_cache(maxsize=32)
def _lora_bytes(cfg, layout, config, optimizer_config, rules) -> LoraBytes:
  boxed = _boxed_params(cfg)
  adapters = jax.eval_shape(lambda: lora_lib.init_run_adapters(jax.random.key(0), boxed, config))
  tx = optimizer.make_optimizer(optimizer_config, 1000)
  opt_state = jax.eval_shape(lambda: train_state.replicate_reshaped(tx.init(adapters)))
  return LoraBytes(base=_bytes_per_device(quantize.boxed_stored(boxed, config.base_precision), layout, rules),
                   adapters=_bytes_per_device(adapters, layout, rules),
                   optimizer=_bytes_per_device(opt_state, layout, rules))


@functools.lru_cache(maxsize=32)
def _abstract_optimizer_state(cfg: model_lib.GPTConfig, optimizer_config: optimizer.OptimizerConfig):
  tx = optimizer.make_optimizer(optimizer_config, 1000)
  return jax.eval_shape(lambda: train_state.replicate_reshaped(tx.init(_boxed_params(cfg))))


@dataclasses.dataclass(frozen=True)
class ResidualProfile:
  """Bytes of JAX's saved residuals for ONE sequence, split by how they shard."""
  layer: float  # per layer, replicated over `tensor` (d_model-wide activations)
  layer_tensor: float  # per layer, split over `tensor` (heads / d_ff activations)
  head: float  # embedding, final norm, logits, loss: replicated over `tensor`
  head_tensor: float  # ... split over `tensor` (vocab-wide)
  weights: float  # parameter-derived residuals (bfloat16 weight copies), whole model, unsharded


def _trace_rows(cfg: model_lib.GPTConfig, seq_len: int) -> int:
  taken = {cfg.num_layers, cfg.num_units, cfg.num_heads, cfg.kv_heads, cfg.d_model, cfg.d_ff, cfg.vocab_size, seq_len,
           cfg.head_dim, cfg.num_experts, cfg.expert_d_ff, 3, 2, 1}
  return next(p for p in (7, 11, 13, 17, 19, 23, 29, 31) if p not in taken)


def _saved_residuals(f, *args) -> list:
  """Avals of what JAX saves for `f`'s backward pass, `f`'s own arguments left out (they are counted as
  state and inputs): the public-API form of `jax.ad_checkpoint.print_saved_residuals`' list."""
  leaves, tree = jax.tree.flatten(args)
  closed, shapes = jax.make_jaxpr(lambda *xs: jax.vjp(lambda *a: f(*jax.tree.unflatten(tree, a)), *xs),
                                  return_shape=True)(*leaves)
  jaxpr = closed.jaxpr
  num_residuals = len(jax.tree.leaves(shapes[1]))  # the vjp function's leaves are the residuals
  through = {e.outvars[0]: e.invars[0] for e in jaxpr.eqns if e.primitive.name == "reduce_precision"}
  arguments, seen, out = set(jaxpr.invars), set(), []
  for v in jaxpr.outvars[len(jaxpr.outvars) - num_residuals:]:
    if isinstance(v, jax.extend.core.Literal):
      out.append(v.aval)
      continue
    v = through.get(v, v)
    if v not in arguments and v not in seen:
      seen.add(v)
      out.append(v.aval)
  return out


@functools.lru_cache(maxsize=64)
def residual_profile(cfg: model_lib.GPTConfig, seq_len: int) -> ResidualProfile:
  """Traces the loss's vjp abstractly (no FLOPs, no memory) and sorts its residuals.

  A residual is per-layer when its leading axes are (LAYERS, rows), or (LAYERS, routing groups) or (LAYERS,
  experts, routing groups) for tokens an MoE layer dispatches (those split over `expert` and the other batch
  axes: per device, as many as rows/(data·fsdp·expert) sequences hold); tensor-split when one of its
  trailing axes is the head count, d_ff (or an expert's) or the vocabulary; parameter-derived when it has no
  row axis. "Per layer" is per stacked element of the layer scan (moe_every layers with MoE groups).
  """
  cfg = dataclasses.replace(cfg, num_stages=1)
  rows = _trace_rows(cfg, seq_len)
  units = cfg.num_units
  groups = rows * seq_len // moe.routing_group_size(cfg, seq_len) if cfg.num_experts else -1
  params = nn.meta.unbox(_boxed_params(cfg))
  batch = {k: jax.ShapeDtypeStruct((rows, seq_len), jnp.int32) for k in ("inputs", "targets", "segment_ids", "positions")}
  batch["weights"] = jax.ShapeDtypeStruct((rows, seq_len), jnp.float32)
  gpt = model_lib.GPT(cfg)
  residuals = _saved_residuals(lambda p, b: language_model.LanguageModel(gpt.apply).loss(p, b)[0], params, batch)
  split_dims = {cfg.num_heads, cfg.kv_heads, cfg.d_ff, cfg.vocab_size, cfg.expert_d_ff}
  out = dict(layer=0.0, layer_tensor=0.0, head=0.0, head_tensor=0.0, weights=0.0)
  for aval in residuals:
    nbytes = aval.size * aval.dtype.itemsize
    shape = aval.shape
    per_row = len(shape) >= 2 and shape[0] == units and (
        shape[1] in (rows, groups) or (len(shape) >= 3 and shape[1] == cfg.num_experts and shape[2] == groups))
    if per_row:
      key = "layer_tensor" if split_dims & set(shape[2:]) else "layer"
      out[key] += nbytes / rows / units
    elif rows in shape[:1]:
      key = "head_tensor" if cfg.vocab_size in shape[1:] else "head"
      out[key] += nbytes / rows
    else:
      out["weights"] += nbytes
  return ResidualProfile(**out)


def estimate(cfg: model_lib.GPTConfig, layout: Layout, global_batch: int, seq_len: int,
             rules=partitioning.DEFAULT_RULES,
             optimizer_config: Optional[optimizer.OptimizerConfig] = None,
             lora: Optional[lora_lib.LoraConfig] = None) -> MemoryEstimate:
  """Per-device memory of one training step (the peak, at the start of the backward pass).

  Args:
    cfg: the model (vocab_size filled in); its remat_policy is overridden by the layout's.
    layout: mesh shape, gradient-accumulation microbatches, remat policy, pipeline microbatches.
    global_batch: sequences per optimizer step (BATCH_SIZE).
    seq_len: tokens per sequence (SEQ_LEN).
    optimizer_config: the optimizer whose state is counted (default AdamW).
    lora: a LoRA run (rank > 0): parameters are the stored frozen base (QLoRA: quantised) plus the adapters, and
      the optimizer state and gradients are the adapters' (`lora_bytes_per_device`); activations as for full
      training (the gradient still flows through every layer).
  """
  cfg = dataclasses.replace(cfg, remat_policy=layout.remat_policy)
  p_dev = param_elements_per_device(cfg, layout, rules)
  p_total = model_lib.count_params(cfg)
  batch_ways = layout.batch_ways
  rows = global_batch / (batch_ways * layout.num_microbatches)  # sequences per device per accumulation microbatch
  t = layout.tensor
  layers = cfg.num_units / layout.pipeline  # stacked elements (layers, or moe_every-layer groups) per stage
  in_flight = 1.0
  if layout.pipeline > 1:  # every microbatch's chunk activations are kept, plus the fill/drain iterations'
    vm = layout.pipeline_repeats * layout.stage_microbatches
    in_flight = (vm + layout.pipeline - 1) / vm
  s = layout.sequence  # context parallelism splits every activation along the length, except gathered keys/values
  if layout.remat_policy == "offload_dots":  # the saved dots live in host memory: 'full' stays on device
    cfg = dataclasses.replace(cfg, remat_policy="full")
  prof = residual_profile(cfg, seq_len)
  per_layer = _per_layer(cfg, seq_len, t) / s
  ring = s > 1 and cfg.context_parallelism == "ring"
  if s > 1 and cfg.remat_policy == "none" and not ring:  # the backward keeps the gathered keys and values whole
    itemsize = jnp.dtype(cfg.compute_dtype).itemsize
    per_layer += 2 * itemsize * seq_len * cfg.kv_heads * cfg.head_dim / t * cfg.layers_per_unit * (1 - 1 / s)
  activations = ACTIVATION_OVERHEAD * rows * in_flight * layers * per_layer
  p_gathered = param_elements_per_device(cfg, dataclasses.replace(layout, fsdp=1), rules)
  loss_working = LOSS_OVERHEAD * rows * (prof.head + prof.head_tensor / t) / s
  working = loss_working + WEIGHT_COPIES * prof.weights * p_gathered / p_total
  if cfg.remat_policy != "none":  # one layer's forward is rebuilt during its backward
    stage_rows = rows / layout.stage_microbatches  # a pipeline stage recomputes one pipeline microbatch
    working += REMAT_WORKING * stage_rows * _per_layer(dataclasses.replace(cfg, remat_policy="none"), seq_len, t) / s
    copies = (RING_ATTENTION_WORKING if ring else REFERENCE_ATTENTION_WORKING
              if cfg.attention_kernel() == "reference" else ATTENTION_WORKING)
    scores = copies * stage_rows * cfg.num_heads / t * score_elements(cfg, seq_len, s) * 4.0
    working += max(0.0, scores - loss_working)  # the loss's buffers and the scores are not live at once
  inputs = 5 * 4.0 * global_batch * seq_len / (batch_ways * s)
  temps = UPDATE_TEMPS + (ACCUMULATOR_TEMPS if layout.num_microbatches > 1 else 0.0)
  if lora is not None and lora.rank > 0:
    part = lora_bytes_per_device(cfg, layout, lora, optimizer_config, rules)
    return MemoryEstimate(params=part.base + part.adapters, optimizer=part.optimizer, grads=part.adapters * temps,
                          activations=activations, working=working, inputs=inputs)
  return MemoryEstimate(params=4.0 * p_dev, optimizer=optimizer_bytes_per_device(cfg, layout, optimizer_config, rules),
                        grads=4.0 * p_dev * temps, activations=activations, working=working, inputs=inputs)


def _per_layer(cfg: model_lib.GPTConfig, seq_len: int, tensor: int) -> float:
  prof = residual_profile(cfg, seq_len)
  return prof.layer + prof.layer_tensor / tensor


def compile_train_step(cfg: model_lib.GPTConfig, layout: Layout, global_batch: int, seq_len: int,
                       devices=None, rules=partitioning.DEFAULT_RULES, *,
                       optimizer_config: Optional[optimizer.OptimizerConfig] = None,
                       precision_config: Optional[precision.PrecisionConfig] = None, loss_chunk: int = 0,
                       offload_optimizer: bool = False):
  """AOT-compiles the trainer's train step (step.make_train_step + step.jit_train_step: the same
  objective, loss options, precision, shardings, donation, optimizer offload and block order) for abstract inputs.

  Needs `layout.num_devices` devices (on CPU: `jax_num_cpu_devices` / XLA_FLAGS set before jax starts).
  The CPU mesh stands in for the accelerators: GPTConfig.scan_unroll's auto (every layer unrolled on CPU) is
  compiled as the rolled layer loop an accelerator runs, which `estimate` models. Returns the `jax.stages.Compiled`;
  nothing is allocated.
  """
  devices = list(devices if devices is not None else jax.devices())[:layout.num_devices]
  if len(devices) < layout.num_devices:
    raise ValueError(f"layout {layout.describe()} needs {layout.num_devices} devices, {len(devices)} available")
  mesh = mesh_lib.create_mesh(layout.mesh_shape, devices)
  cfg = layout_config(cfg, layout)
  # the trainer's layer stack: the interleaved pipeline's blocks in stage order, unless the optimizer is offloaded
  cfg = dataclasses.replace(cfg, scan_unroll=cfg.scan_unroll or 1, blocks_in_stage_order=not offload_optimizer)
  cfg.validate()
  config_lib.check_layout(cfg, layout.mesh_shape, rules, batch_size=global_batch,
                          num_microbatches=layout.num_microbatches)
  model = model_lib.GPT(cfg)
  optimizer_config = optimizer_config or optimizer.OptimizerConfig()
  precision_config = precision_config or precision.PrecisionConfig()
  tx = optimizer.make_optimizer(optimizer_config, 1000)
  lr_fn = optimizer.learning_rate_schedule(optimizer_config, 1000)
  objective = language_model.LanguageModel(model.apply, loss_chunk=loss_chunk,
                                           logits_fn=lambda p, h: model_lib.project_logits(p, h, cfg))
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    loss_scale = precision.init_loss_scale(precision_config, cfg.dtype)
    abstract_state, state_shardings = train_state.state_shardings(model, tx, mesh, rules, loss_scale=loss_scale)
    if offload_optimizer:
      state_shardings = offload.offload_shardings(state_shardings)
    batch_sharding = partitioning.batch_sharding(mesh, rules)
    batch = {k: jax.ShapeDtypeStruct((global_batch, seq_len), jnp.float32 if k == "weights" else jnp.int32,
                                     sharding=batch_sharding) for k in objective.features}
    step = train_step.make_train_step(objective, tx, lr_fn, num_microbatches=layout.num_microbatches,
                                      precision_config=precision_config,
                                      offloaded_shardings=state_shardings if offload_optimizer else None)
    jitted = train_step.jit_train_step(step, state_shardings, batch_sharding, objective.features)
    return jitted.lower(abstract_state, batch, {}).compile()


def xla_bytes_per_device(memory_analysis) -> float:
  """Peak bytes per device from `compiled.memory_analysis()`: arguments + outputs − aliased + temporaries."""
  m = memory_analysis
  return float(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes)


def gib(nbytes: Optional[float]) -> str:
  return "-" if nbytes is None else f"{nbytes / 2**30:.2f}"
