"""LoRA: low-rank adapters on chosen kernels of a frozen base model, trained through a wrapped objective.

For a target kernel W of shape (L?, in..., out...) (the stacked-layer axis L kept when it has one) the
adapters are A (L?, in..., r), small random, and B (L?, r, out...), zero, so the first step runs the
base model exactly. The decoder blocks' projections (qkv / query / key_value / out / mlp_*) run their
adapters inside the model, beside the frozen kernel, as PEFT's LoRA layer does:

    y = (x·W + b) + dropout(x)·A·((alpha / r)·B)

so no merged weight is built, W gets no gradient, and `dropout` (PEFT's lora_dropout) applies to the
adapters' input; its masks are seeded by each (micro)batch's tokens, so a resumed run draws the same.
The model knows nothing of this: `attach` puts the adapters beside their kernels in the parameter tree and
`in_model` wraps every model.layers.DenseGeneral call (flax method interception) that finds them, under
the layer scan, remat and the pipeline alike (dropout: not with pipeline stages, `validate`).
Other targets (an embedding table, lm_head) are merged, W' = W + (alpha / r)·A·B, as are all adapters
for sampling, evaluation and `merge_checkpoint`.

The TrainState's params ARE the adapters (the only leaves with optimizer state); the base is a frozen
model (`frozen[BASE]`, laid out like the model, never updated). Adapters carry logical axis names
derived from their kernel's (A: the kernel's input axes + None, B: None + its output axes), so a
tensor-parallel projection's adapter is split with it, and the merged weight is constrained to the
kernel's own layout.

Which axes of a kernel are its input: a kernel writing the residual stream (its last axis is `embed`:
attention `out`, `mlp_out`) contracts all its other axes; any other (qkv, query, key_value, mlp_in,
mlp_gate, lm_head, an embedding table) contracts its first one.

Adapter trees mirror the base's paths: {'blocks': {'attn': {'qkv': {'kernel': {'lora_a': A, 'lora_b': B}}}}}.

Marker rows (LoraConfig.marker_rows, as PEFT's trainable_token_indices): on chat or preference data the rows of
the chat template's marker tokens in the token embedding (and in an untied lm_head) train too, as deltas beside
the adapters ({'token_embedding': {'marker_rows': (n, D)}, 'lm_head': {'kernel': {'marker_rows': (D, n)}}}, zero
at the start), added to those rows only. A base pre-trained on plain text never saw the markers: without this a
LoRA fine-tune can neither read them nor end an answer with `<|end|>` (docs/finetune.md). The rows' token ids
are the run's (`marker_ids`, recorded in the checkpoint's `lora` metadata) and merge with the adapters.
"""

import dataclasses
import functools
import re
import zlib
from typing import Any, Dict, Mapping, Optional, Tuple

from etils import epath
import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from t5x_like.model import cpu_kernels
from t5x_like.model import layers
from t5x_like.model.blocks import DROPOUT_RNG
from t5x_like.model.config import GPTConfig
from t5x_like.parallel import axis_names as ax
from t5x_like.posttrain import marker_rows
from t5x_like.posttrain import quantize
from t5x_like.training import checkpointing
from t5x_like.training.trainable import path_name

BASE = "lora_base"  # the frozen base model's key in the objective's `frozen`
A, B = "lora_a", "lora_b"  # adapter leaf names under their kernel's path

Params = Dict[str, Any]


# LoRA's default targets: the attention projections (fused qkv, or query + key_value under GQA) and out,
# and the MLP's input (and SwiGLU gate) and output kernels.
LORA_TARGETS = r"blocks/attn/(qkv|query|key_value|out)/kernel|blocks/mlp_(in|gate|out)/kernel"


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """Low-rank adapters (gin: `lora.LoraConfig`): W + (alpha/rank)·A·B on each target kernel, the base frozen."""
  rank: int = 0  # adapter rank r; 0 = no LoRA (full or selective fine-tuning)
  alpha: float = 16.0  # the adapters' update is scaled by alpha / rank
  dropout: float = 0.0  # dropout on the adapters' input (the decoder blocks' projections), as in PEFT's lora_dropout
  targets: str = LORA_TARGETS  # regex (re.fullmatch) over parameter paths of the kernels that get adapters
  # On chat / preference data, also train the chat template's marker-token rows of the token embedding and an
  # untied lm_head (deltas stored with the adapters, merged on export; see the module docstring).
  marker_rows: bool = True
  # How the frozen base is stored: float32 | bfloat16 | int8 | nf4 (QLoRA; posttrain/quantize.py): the block
  # projections' kernels quantised and dequantised in the forward, the other leaves bfloat16.
  base_precision: str = "float32"

  def __post_init__(self):
    quantize.check_precision(self.base_precision)
    if self.rank < 0:
      raise ValueError(f"LoraConfig.rank must be >= 0 (0 = no LoRA), got {self.rank}")
    if self.rank and self.alpha <= 0:
      raise ValueError(f"LoraConfig.alpha must be > 0, got {self.alpha}")
    if not 0.0 <= self.dropout < 1.0:
      raise ValueError(f"LoraConfig.dropout={self.dropout} must be in [0, 1)")

  @property
  def scale(self) -> float:
    return self.alpha / self.rank


def kernel_split(names: Tuple[Optional[str], ...], path: str = "") -> Tuple[int, int, int]:
  """(leading layer axes, input axes, output axes) of a kernel with these logical axis names.

  Raises:
    ValueError: the leaf is not a matrix (a bias, a norm scale), naming `path`.
  """
  lead = 1 if names and names[0] == ax.LAYERS else 0
  rest = tuple(names[lead:])
  if len(rest) < 2:
    raise ValueError(f"LoraConfig.targets matches '{path}' with logical axes {tuple(names)}, which is not a "
                     "weight matrix (LoRA adapts kernels and embedding tables, not biases or norms)")
  n_in = len(rest) - 1 if rest[-1] == ax.EMBED else 1
  return lead, n_in, len(rest) - n_in


def target_kernels(boxed_params: Params, targets: str) -> Dict[Tuple[str, ...], Any]:
  """{kernel path: its boxed (LogicallyPartitioned) abstract value} of the leaves `targets` fully matches.

  Raises:
    ValueError: `targets` is not a regex, matches no parameter, or matches a leaf that is no kernel.
  """
  try:
    regex = re.compile(targets)
  except re.error as e:
    raise ValueError(f"LoraConfig.targets={targets!r} is not a regular expression: {e}") from None
  flat = flax.traverse_util.flatten_dict(boxed_params)
  chosen = {path: leaf for path, leaf in flat.items() if regex.fullmatch(path_name(path))}
  if not chosen:
    examples = ", ".join(sorted(path_name(p) for p in flat)[:6])
    raise ValueError(f"LoraConfig.targets={targets!r} matches no parameter (paths look like: {examples}, ...)")
  for path, leaf in chosen.items():
    if path[-1] != "kernel" and not path[-1].endswith("embedding"):
      raise ValueError(f"LoraConfig.targets matches '{path_name(path)}', which is not a weight matrix (LoRA adapts "
                       "kernels and embedding tables, not biases or norms)")
    kernel_split(_names(leaf), path_name(path))
  return chosen


def _names(leaf) -> tuple:
  if isinstance(leaf, nn.LogicallyPartitioned):
    return tuple(leaf.names)
  return (None,) * len(leaf.shape)


def adapter_shapes(shape: tuple, names: tuple, rank: int, path: str = "") -> tuple:
  """((A shape, A names), (B shape, B names)) for a kernel of this shape and these logical names."""
  lead, n_in, _ = kernel_split(names, path)
  cut = lead + n_in
  a = (shape[:cut] + (rank,), names[:cut] + (None,))
  b = (shape[:lead] + (rank,) + shape[cut:], names[:lead] + (None,) + names[cut:])
  return a, b


def init_adapters(rng: jax.Array, kernels: Mapping[Tuple[str, ...], Any], config: LoraConfig) -> Params:
  """Boxed adapters for `kernels` (from `target_kernels`): A ~ U(±1/√fan_in), B = 0, float32.

  Each kernel's A draws from `rng` folded with a hash of its path, so adding a target never changes
  the others' initial values.
  """
  out = {}
  for path, leaf in kernels.items():
    names, value = _names(leaf), leaf.value if isinstance(leaf, nn.LogicallyPartitioned) else leaf
    (a_shape, a_names), (b_shape, b_names) = adapter_shapes(tuple(value.shape), names, config.rank, path_name(path))
    lead, n_in, _ = kernel_split(names)
    fan_in = 1
    for size in value.shape[lead:lead + n_in]:
      fan_in *= size
    bound = 1.0 / fan_in ** 0.5
    key = jax.random.fold_in(rng, zlib.crc32(path_name(path).encode()) & 0x7FFFFFFF)
    a = jax.random.uniform(key, a_shape, jnp.float32, -bound, bound)
    out[path + (A,)] = nn.LogicallyPartitioned(a, a_names)
    out[path + (B,)] = nn.LogicallyPartitioned(jnp.zeros(b_shape, jnp.float32), b_names)
  return flax.traverse_util.unflatten_dict(out)


def adapter_pairs(adapters: Params) -> Dict[Tuple[str, ...], Tuple[Any, Any]]:
  """{kernel path: (A, B)} of an adapter tree (marker rows left out: marker_rows.deltas)."""
  flat = {path: leaf for path, leaf in flax.traverse_util.flatten_dict(adapters).items()
          if path[-1] != marker_rows.MARKERS}
  pairs = {}
  for path in flat:
    kernel = path[:-1]
    if path[-1] not in (A, B) or kernel + (A,) not in flat or kernel + (B,) not in flat:
      raise ValueError(f"'{path_name(path)}' is not half of a LoRA pair (expected '<kernel path>/{A}' and "
                       f"'<kernel path>/{B}')")
    pairs[kernel] = (flat[kernel + (A,)], flat[kernel + (B,)])
  return pairs


def check_fits(a, b, kernel_shape: tuple, path: str = "") -> tuple:
  """(leading layer axes, input axes) of A (L?, in..., r) and B (L?, r, out...) over a kernel (L?, in..., out...).

  Raises:
    ValueError: A and B do not fit the kernel (adapters of another base), naming `path`.
  """
  lead = a.ndim + b.ndim - 2 - len(kernel_shape)
  n_in = a.ndim - 1 - lead
  fits = (lead >= 0 and n_in >= 1 and b.ndim - 1 - lead >= 1 and a.shape[-1] == b.shape[lead]
          and tuple(a.shape[:-1]) + tuple(b.shape[lead + 1:]) == tuple(kernel_shape)
          and a.shape[:lead] == b.shape[:lead])
  if not fits:
    raise ValueError(f"{path}: adapters A {tuple(a.shape)} and B {tuple(b.shape)} do not fit the base kernel "
                     f"{tuple(kernel_shape)} (adapters of another base model?)")
  return lead, n_in


def delta(a, b, kernel_shape: tuple, path: str = "") -> jax.Array:
  """A·B (float32) contracting the rank axis only; its shape is `kernel_shape` (L?, in..., out...).

  Raises:
    ValueError: A and B do not fit the kernel (adapters of another base), naming `path`.
  """
  lead, n_in = check_fits(a, b, kernel_shape, path)
  letters = "abcdefghijklmnopqrstuvwxy"
  n_out = len(kernel_shape) - lead - n_in
  lead_s, in_s, out_s = letters[:lead], letters[lead:lead + n_in], letters[lead + n_in:lead + n_in + n_out]
  return jnp.einsum(f"{lead_s}{in_s}z,{lead_s}z{out_s}->{lead_s}{in_s}{out_s}", a, b,
                    precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def merge(base: Params, adapters: Params, scale: float,
          kernel_names: Optional[Mapping[str, tuple]] = None, marker_ids: tuple = ()) -> Params:
  """The base parameters with W + scale·A·B on every adapted kernel and the marker-row deltas added.

  Args:
    base: the base model's (unboxed) parameters.
    adapters: an adapter tree (`init_adapters`, unboxed).
    scale: alpha / rank.
    kernel_names: {kernel path name: logical axis names}: under jit, each update is constrained to its
      kernel's layout (needs the mesh and axis rules in context). None = no constraint.
    marker_ids: the token ids of the adapters' marker rows (`marker_rows.init`), if it has any.

  Raises:
    ValueError: an adapter names a kernel the base lacks, or does not fit its shape.
  """
  flat = flax.traverse_util.flatten_dict(marker_rows.add(base, adapters, marker_ids))
  for path, (a, b) in (adapter_pairs(adapters) if adapters else {}).items():
    if path not in flat:
      raise ValueError(f"LoRA adapters for '{path_name(path)}', which the base model does not have")
    w = flat[path]
    update = delta(a, b, tuple(w.shape), path_name(path)) * scale
    if kernel_names is not None:
      update = nn.with_logical_constraint(update, kernel_names[path_name(path)])
    flat[path] = w + update.astype(w.dtype)
  return flax.traverse_util.unflatten_dict(flat)


# The decoder blocks' projections (model.layers.DenseGeneral): their adapters run inside the model, beside
# the kernel, as x·W + dropout(x)·A·(scale·B) — no merged weight, no gradient for W, LoRA dropout.
IN_MODEL = ("qkv", "query", "key_value", "out", "mlp_gate", "mlp_in", "mlp_out")


def runs_in_model(path: Tuple[str, ...]) -> bool:
  return path[0] == "blocks" and path[-1] == "kernel" and path[-2] in IN_MODEL


def attach(base: Params, adapters: Params, scale: float,
           kernel_names: Optional[Mapping[str, tuple]] = None, marker_ids: tuple = ()) -> Params:
  """The base parameters with each block projection's adapters beside its kernel (`lora_a`, `lora_b` × scale),
  for the model to apply; other targets (embedding tables, lm_head) and the marker rows are merged into their
  weights.

  Raises:
    ValueError: an adapter names a kernel the base lacks, or does not fit its shape.
  """
  pairs = adapter_pairs(adapters)
  merged = merge(marker_rows.add(base, adapters, marker_ids),
                 _subtree(adapters, [p for p in pairs if not runs_in_model(p)]), scale, kernel_names)
  flat = flax.traverse_util.flatten_dict(merged)
  for path, (a, b) in pairs.items():
    if not runs_in_model(path):
      continue
    check_fits(a, b, _kernel_shape(flat, path), path_name(path))
    flat[path[:-1] + (A,)] = a
    flat[path[:-1] + (B,)] = b * scale
  return flax.traverse_util.unflatten_dict(flat)


def _kernel_shape(flat: dict, path: tuple) -> tuple:
  """The shape of kernel `path` in a flat base tree, stored as it is or quantised (quantize.CODES)."""
  if path in flat:
    return tuple(flat[path].shape)
  codes = flat.get(path[:-1] + (quantize.CODES,))
  if codes is None:
    raise ValueError(f"LoRA adapters for '{path_name(path)}', which the base model does not have")
  return tuple(codes.shape[:-1]) + (codes.shape[-1] * (2 if codes.dtype == jnp.uint8 else 1),)


def computed_base(base: Params, precision: str) -> Params:
  """The base a run with LoraConfig.base_precision `precision` computed with: stored that way, read back float32."""
  return base if precision == "float32" else quantize.dequantize_params(quantize.quantize_params(base, precision))


def in_model(dropout: float = 0.0):
  """A context in which every model.layers.DenseGeneral call that finds `lora_a`, `lora_b` beside its kernel
  (parameters from `attach`) returns its output + dropout(x)·A·B, and one whose kernel is stored quantised
  (quantize.CODES, SCALES) computes with it dequantised. The dropout masks draw from the apply's
  blocks.DROPOUT_RNG stream (`rngs=`); without it (or at rate 0) the adapters read x itself. Enter it around
  the trace of the model's apply."""
  return nn.intercept_methods(functools.partial(_dense_with_adapters, dropout))


def _dense_with_adapters(dropout: float, next_fun, args, kwargs, context):
  """flax interceptor: DenseGeneral's y (x (..., *in) → (..., *out)) + dropout(x)·A (in..., r)·B (r, out...)."""
  dense = context.module
  if not isinstance(dense, layers.DenseGeneral) or context.method_name != "__call__":
    return next_fun(*args, **kwargs)
  if dense.has_variable("params", quantize.CODES):  # a quantised base kernel (QLoRA)
    y = quantize.dense_forward(dense, args[0])
  else:
    y = next_fun(*args, **kwargs)
  if not dense.has_variable("params", A):
    return y
  h = args[0].astype(dense.dtype)
  if dropout and dense.has_rng(DROPOUT_RNG):
    keep = jax.random.bernoulli(dense.make_rng(DROPOUT_RNG), 1.0 - dropout, h.shape)
    h = jnp.where(keep, h / (1.0 - dropout), 0).astype(dense.dtype)
  low = cpu_kernels.contract_trailing(h, dense.get_variable("params", A).astype(dense.dtype), len(dense.in_shape))
  return y + jnp.tensordot(low, dense.get_variable("params", B).astype(dense.dtype), axes=1)  # (..., *out)


def validate(config: LoraConfig, model_config: GPTConfig) -> None:
  """Raises ValueError for LoRA settings the model cannot run: dropout with pipeline stages (the pipelined
  layer stack takes no dropout rng)."""
  if config.rank and config.dropout and model_config.num_stages > 1:
    raise ValueError(f"LoraConfig.dropout={config.dropout} with {model_config.num_stages} pipeline stages: LoRA "
                     "dropout runs on the scanned layer stack only; use a mesh without 'pipeline' or dropout 0")


def _subtree(adapters: Params, kernels) -> Params:
  flat = flax.traverse_util.flatten_dict(adapters)
  return flax.traverse_util.unflatten_dict({k: v for k, v in flat.items()
                                            if k[:-1] in set(kernels) and k[-1] != marker_rows.MARKERS})


def dropout_key(batch) -> jax.Array:
  """The LoRA-dropout key of a (micro)batch: seeded by its tokens, so a resumed run draws the same masks."""
  tokens = batch["inputs"].astype(jnp.uint32)
  digest = jnp.sum(tokens * jnp.arange(1, tokens.shape[-1] + 1, dtype=jnp.uint32)[None], dtype=jnp.uint32)
  return jax.random.fold_in(jax.random.key(0), digest)


@dataclasses.dataclass(frozen=True)
class LoraObjective:
  """An objective over adapters: `inner` evaluated on the frozen base (frozen[BASE]) with them attached.

  Attributes:
    inner: the objective of the full model (e.g. LanguageModel, whose `apply_fn` gets the dropout rng).
    scale: alpha / rank.
    kernel_names: {kernel path name: logical axis names} of the adapted kernels (layout of a merge).
    dropout: dropout rate on the adapters' input (block projections only).
    marker_ids: the token ids of the marker rows the adapters carry (LoraConfig.marker_rows), or ().
  """
  inner: Any
  scale: float
  kernel_names: Mapping[str, tuple]
  dropout: float = 0.0
  marker_ids: tuple = ()

  @property
  def features(self) -> tuple:
    return self.inner.features

  def loss(self, adapters, batch, frozen):
    others = {name: tree for name, tree in frozen.items() if name != BASE}
    if BASE not in frozen:
      raise ValueError(f"the LoRA objective needs the base model's parameters as frozen['{BASE}']")
    params = attach(frozen[BASE], adapters, self.scale, self.kernel_names, self.marker_ids)
    inner = self.inner
    if self.dropout:
      inner = dataclasses.replace(inner, apply_fn=functools.partial(inner.apply_fn,
                                                                    rngs={DROPOUT_RNG: dropout_key(batch)}))
    with in_model(self.dropout):
      return inner.loss(params, batch, others)


def objective(inner, boxed_params: Params, config: LoraConfig, marker_ids: tuple = ()) -> LoraObjective:
  """`inner` wrapped for the adapters of `config.targets` (and the rows of `marker_ids`) over a base with these
  boxed parameters."""
  kernels = target_kernels(boxed_params, config.targets)
  if config.dropout and not hasattr(inner, "apply_fn"):
    raise ValueError(f"LoraConfig.dropout={config.dropout} needs an objective that runs the model through "
                     f"`apply_fn`; {type(inner).__name__} does not")
  return LoraObjective(inner=inner, scale=config.scale, dropout=config.dropout, marker_ids=tuple(marker_ids),
                       kernel_names={path_name(p): _names(leaf) for p, leaf in kernels.items()})


def init_run_adapters(rng: jax.Array, boxed_params: Params, config: LoraConfig, marker_ids: tuple = ()) -> Params:
  """A run's boxed adapters: `init_adapters` on config.targets, plus zero marker rows for `marker_ids`."""
  adapters = init_adapters(rng, target_kernels(boxed_params, config.targets), config)
  if marker_ids:
    adapters = _merge_trees(adapters, marker_rows.init(marker_rows.tables(boxed_params), len(marker_ids)))
  return adapters


def _merge_trees(a: Params, b: Params) -> Params:
  return flax.traverse_util.unflatten_dict({**flax.traverse_util.flatten_dict(a),
                                            **flax.traverse_util.flatten_dict(b)})


def count(params: Params) -> int:
  return sum(int(x.size) for x in jax.tree.leaves(params))


def merge_checkpoint(model_dir: str, output_dir: str, step: Optional[int] = None) -> str:
  """Writes a LoRA run's checkpoint merged with its base as a plain parameters-only checkpoint.

  The output (OUTPUT_DIR/checkpoints/0, {'params': ...}) is what `restore_params`, infer/evaluate and
  INITIAL_CHECKPOINT_PATH read; a model.gin next to the base's checkpoints (a converted base) is copied.

  Args:
    model_dir: the LoRA run's MODEL_DIR (newest step, or `step`) or one of its checkpoints/<step>.
    output_dir: a new directory (an existing step 0 there is refused).

  Returns:
    The checkpoint directory written.
  """
  found, path = checkpointing.resolve_checkpoint(model_dir, step)
  meta = checkpointing.read_metadata(path)
  info = meta.get("lora")
  if not info or not info.get("base"):
    raise ValueError(f"{path} is not a LoRA run's checkpoint (its metadata has no 'lora.base' entry)")
  _, adapters = checkpointing.restore_params(path)
  _, base = checkpointing.restore_params(info["base"])
  base = computed_base(base, info.get("base_precision", "float32"))
  merged = jax.tree.map(np.asarray, merge(base, adapters, info["alpha"] / info["rank"],
                                          marker_ids=tuple(info.get("marker_ids") or ())))
  written = checkpointing.save_params(output_dir, merged, 0, {
      "merged_from": path, "step": int(found), "merged_lora": info, "gin_config": meta.get("gin_config", ""),
      "code_version": checkpointing.code_version()})
  model_gin = epath.Path(info["base"]).parent.parent / "model.gin"
  if model_gin.exists():
    model_gin.copy(epath.Path(output_dir) / "model.gin", overwrite=True)
  return written
