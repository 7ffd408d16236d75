"""A LoRA run's frozen base stored in fewer bits (QLoRA): lora.LoraConfig.base_precision.

- `nf4`: 4-bit NormalFloat (Dettmers et al. 2023): each block of BLOCK consecutive weights along a kernel's last axis
  is scaled by its absolute maximum and rounded to the nearest of 16 levels placed at quantiles of N(0, 1)
  (`nf4_levels`); two codes a byte, plus one float32 scale a block: 4.5 bits a weight.
- `int8`: the same blocks, each rounded to 127 · w / absmax: 8.5 bits a weight.
- `bfloat16`: every leaf cast.

Quantised are the decoder blocks' projection kernels (the model.layers.DenseGeneral weights: attention and MLP;
not the experts of an MoE layer): `kernel` becomes `kernel_q` (codes, the kernel's shape with the last axis halved
for nf4) and `kernel_scale` (its shape with the last axis counting blocks). The other leaves (embedding tables,
lm_head, norms, biases) are stored in bfloat16 under nf4 and int8. The forward dequantises each kernel where it is
used (`dense_forward`, called by LoRA's DenseGeneral interceptor: posttrain/lora.py), inside the layer scan, so only
one layer's weights exist in full precision at a time; adapters and their optimizer state stay float32.
"""

import math
from statistics import NormalDist

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from t5x_like.model import cpu_kernels
from t5x_like.parallel import partitioning
from t5x_like.training.trainable import path_name

PRECISIONS = ("float32", "bfloat16", "int8", "nf4")
QUANTISED = ("int8", "nf4")
BLOCK = 64  # weights per scale along a kernel's last axis (the whole axis when it does not divide)
CODES, SCALES = "kernel_q", "kernel_scale"
PROJECTIONS = ("qkv", "query", "key_value", "out", "mlp_gate", "mlp_in", "mlp_out")  # DenseGeneral kernels


def nf4_levels() -> np.ndarray:
  """The 16 NF4 levels in [−1, 1]: 8 positive at the N(0, 1) quantiles of linspace(δ, ½, 9)[:-1], 7 negative at
  those of linspace(δ, ½, 8)[:-1], and 0, divided by the largest (δ = 0.9677083, QLoRA's offset)."""
  normal, offset = NormalDist(), 0.9677083
  positive = [normal.inv_cdf(p) for p in np.linspace(offset, 0.5, 9)[:-1]]
  negative = [-normal.inv_cdf(p) for p in np.linspace(offset, 0.5, 8)[:-1]]
  levels = np.sort(np.array(positive + [0.0] + negative))
  return (levels / levels.max()).astype(np.float32)


NF4 = nf4_levels()


def check_precision(precision: str) -> None:
  if precision not in PRECISIONS:
    raise ValueError(f"LoraConfig.base_precision={precision!r} is not supported; supported: {list(PRECISIONS)}")


def is_projection(path: tuple) -> bool:
  return path[0] == "blocks" and path[-1] == "kernel" and len(path) >= 2 and path[-2] in PROJECTIONS


def block_size(last: int) -> int:
  return BLOCK if last % BLOCK == 0 else last


def quantize_kernel(w: jax.Array, precision: str, path: str = "") -> dict:
  """{CODES: codes, SCALES: per-block scales} of kernel `w` (nf4: the last axis must be even)."""
  last = w.shape[-1]
  if precision == "nf4" and last % 2:
    raise ValueError(f"LoraConfig.base_precision='nf4': '{path}' has an odd last axis ({last}); nf4 packs two "
                     "codes a byte along it (use int8)")
  block = block_size(last)
  blocks = w.astype(jnp.float32).reshape(w.shape[:-1] + (last // block, block))
  absmax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
  absmax = jnp.where(absmax == 0, 1.0, absmax)
  x = blocks / absmax
  if precision == "int8":
    return {CODES: jnp.round(x * 127.0).astype(jnp.int8).reshape(w.shape), SCALES: absmax[..., 0] / 127.0}
  codes = jnp.argmin(jnp.abs(x[..., None] - jnp.asarray(NF4)), axis=-1).astype(jnp.uint8).reshape(w.shape)
  return {CODES: (codes[..., 0::2] << 4) | codes[..., 1::2], SCALES: absmax[..., 0]}


def dequantize_kernel(codes: jax.Array, scales: jax.Array, dtype=jnp.float32) -> jax.Array:
  """The kernel `quantize_kernel` stored (int8 codes: int8; uint8: nf4), in `dtype`."""
  if codes.dtype == jnp.int8:
    values = codes.astype(jnp.float32)
  else:
    pairs = jnp.stack([codes >> 4, codes & 15], axis=-1)
    values = jnp.asarray(NF4)[pairs.reshape(codes.shape[:-1] + (2 * codes.shape[-1],)).astype(jnp.int32)]
  last = values.shape[-1]
  block = block_size(last)
  blocks = values.reshape(values.shape[:-1] + (last // block, block)) * scales[..., None]
  return blocks.reshape(values.shape).astype(dtype)


def quantize_params(params: dict, precision: str) -> dict:
  """The base parameters as `precision` stores them (module docstring); float32: unchanged."""
  check_precision(precision)
  if precision == "float32":
    return params
  out = {}
  for path, leaf in flax.traverse_util.flatten_dict(params).items():
    if precision in QUANTISED and is_projection(path):
      for key, value in quantize_kernel(leaf, precision, path_name(path)).items():
        out[path[:-1] + (key,)] = value
    else:
      out[path] = jnp.asarray(leaf).astype(jnp.bfloat16)
  return flax.traverse_util.unflatten_dict(out)


def dequantize_params(stored: dict) -> dict:
  """The base parameters a stored (quantize_params) tree computes with: each quantised kernel dequantised, every
  leaf float32 (what the forward reads, up to its compute dtype)."""
  out = {}
  for path, leaf in flax.traverse_util.flatten_dict(stored).items():
    if path[-1] == CODES:
      continue
    if path[-1] == SCALES:
      out[path[:-1] + ("kernel",)] = dequantize_kernel(stored_at(stored, path[:-1] + (CODES,)), leaf)
    else:
      out[path] = jnp.asarray(leaf).astype(jnp.float32)
  return flax.traverse_util.unflatten_dict(out)


def stored_at(tree: dict, path: tuple):
  for key in path:
    tree = tree[key]
  return tree


def boxed_stored(boxed_params: dict, precision: str) -> dict:
  """The abstract stored tree of a model's boxed parameters, each leaf boxed with logical names for the rules:
  codes as their kernel's; scales their kernel's with the last axis unsharded; everything else as before."""
  check_precision(precision)
  if precision == "float32":
    return boxed_params
  shapes = jax.eval_shape(lambda p: quantize_params(p, precision), partitioning.unbox(boxed_params))
  flat_boxed = flax.traverse_util.flatten_dict(boxed_params)
  out = {}
  for path, shape in flax.traverse_util.flatten_dict(shapes).items():
    if path[-1] in (CODES, SCALES):
      names = tuple(flat_boxed[path[:-1] + ("kernel",)].names)
      names = names if path[-1] == CODES else names[:-1] + (None,)
    else:
      names = tuple(flat_boxed[path].names)
    out[path] = nn.LogicallyPartitioned(shape, names)
  return flax.traverse_util.unflatten_dict(out)


def dense_forward(dense, x: jax.Array) -> jax.Array:
  """model.layers.DenseGeneral's output for a quantised kernel (CODES, SCALES beside it): dequantised in the
  module's dtype, then x · kernel (+ bias) as DenseGeneral computes it."""
  kernel = dequantize_kernel(dense.get_variable("params", CODES), dense.get_variable("params", SCALES), dense.dtype)
  y = cpu_kernels.contract_trailing(x.astype(dense.dtype), kernel, len(dense.in_shape))
  if dense.use_bias:
    y = cpu_kernels.add_bias(y, dense.get_variable("params", "bias"))
  return y


def stored_bytes(abstract: dict) -> int:
  """Bytes of a (stored) parameter tree, all devices together."""
  return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(abstract))
