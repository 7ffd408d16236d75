"""Flax building blocks of the GPT decoder, annotated with logical axis names only."""

import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from t5x_like.model import cpu_kernels as kernels
from t5x_like.parallel import axis_names as ax

Dtype = Any
_INIT = nn.initializers.normal(stddev=0.02)


def constrain(x: jax.Array, names: tuple) -> jax.Array:
  """Activation sharding constraint by logical names (resolved by partitioning's rules)."""
  return nn.with_logical_constraint(x, names)


def lookup(table: jax.Array, ids: jax.Array, row_axis: str) -> jax.Array:
  """table[ids] for a (rows, D) parameter table; ids (B, T) → (B, T, D).

  The table is first gathered over its width (like any FSDP weight before use), keeping only its
  `row_axis` split: each device then looks up its own batch rows locally and never has to trade a
  width-sharded result for a batch-sharded one (which XLA can only do by full rematerialisation).
  """
  table = constrain(table, (row_axis, ax.ACT_EMBED))
  return constrain(jnp.take(table, ids, axis=0), (ax.BATCH, ax.LENGTH, ax.ACT_EMBED))


class LayerNorm(nn.Module):
  """LayerNorm computed in float32, returned in the compute dtype."""
  dtype: Dtype = jnp.bfloat16
  epsilon: float = 1e-5

  @nn.compact
  def __call__(self, x):
    d = x.shape[-1]
    scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, (ax.NORM,)), (d,))
    bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, (ax.NORM,)), (d,))
    x32, axes = kernels.windowed(x.astype(jnp.float32))  # x32 (..., D) seen as (..., D/32, 32) on XLA:CPU
    mean = x32.mean(axes, keepdims=True)
    var = jnp.square(x32 - mean).mean(axes, keepdims=True)
    y = ((x32 - mean) * jax.lax.rsqrt(var + self.epsilon)).reshape(x.shape)
    return kernels.scale_shift(y, scale, bias).astype(self.dtype)


class RMSNorm(nn.Module):
  """Root-mean-square norm (no centring, no bias) computed in float32, returned in the compute dtype; `axis` is
  the logical name of the normalised axis (the scale's). plus_one (Gemma): the stored scale w starts at 0 and
  multiplies as 1 + w."""
  dtype: Dtype = jnp.bfloat16
  epsilon: float = 1e-5
  axis: str = ax.NORM
  plus_one: bool = False

  @nn.compact
  def __call__(self, x):
    init = nn.initializers.zeros if self.plus_one else nn.initializers.ones
    scale = self.param("scale", nn.with_logical_partitioning(init, (self.axis,)), (x.shape[-1],))
    if self.plus_one:
      scale = 1.0 + scale.astype(jnp.float32)
    x32, axes = kernels.windowed(x.astype(jnp.float32))  # x32 (..., D) seen as (..., D/32, 32) on XLA:CPU
    y = (x32 * jax.lax.rsqrt(jnp.square(x32).mean(axes, keepdims=True) + self.epsilon)).reshape(x.shape)
    return kernels.scale_shift(y, scale, None).astype(self.dtype)


def norm_layer(kind: str):
  """The norm class a GPTConfig.norm names."""
  return {"layernorm": LayerNorm, "rmsnorm": RMSNorm,
          "rmsnorm_plus_one": functools.partial(RMSNorm, plus_one=True)}[kind]


def mlp_hidden(activation: str, project: Callable) -> jax.Array:
  """The MLP's hidden activations for GPTConfig.mlp_activation, `project(name)` giving the input projection `name`:
  gelu(mlp_in); swiglu silu(mlp_gate) · mlp_in; geglu gelu(mlp_gate) · mlp_in (GELU: the tanh approximation)."""
  if activation == "gelu":
    return nn.gelu(project("mlp_in"))
  gate = nn.silu if activation == "swiglu" else nn.gelu
  return gate(project("mlp_gate")) * project("mlp_in")


def rope_frequencies(head_dim: int, theta: float, scaling_factor: float = 1.0, low_freq_factor: float = 1.0,
                     high_freq_factor: float = 4.0, original_max_len: int = 8192, scaling: str = "llama3"
                     ) -> np.ndarray:
  """Rotary inverse frequencies (head_dim/2,) float64, scaled when scaling_factor > 1: `linear` divides every
  frequency by the factor; `llama3` (Llama-3's long-wavelength scaling) divides wavelengths longer than
  original_max_len/low_freq_factor, keeps those shorter than original_max_len/high_freq_factor, and interpolates
  those between smoothly."""
  inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  if scaling_factor == 1.0:
    return inv_freq
  if scaling == "linear":
    return inv_freq / scaling_factor
  wavelen = 2 * np.pi / inv_freq
  smooth = (original_max_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
  interpolated = (1 - smooth) * inv_freq / scaling_factor + smooth * inv_freq
  out = np.where(wavelen > original_max_len / low_freq_factor, inv_freq / scaling_factor, inv_freq)
  middle = (wavelen <= original_max_len / low_freq_factor) & (wavelen >= original_max_len / high_freq_factor)
  return np.where(middle, interpolated, out)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
  """Rotates (B, T, heads, Dh) by each token's position: the two halves of the head (not interleaved pairs) form
  the complex pairs, as in Hugging Face's Llama. Angles in float32; returned in x's dtype."""
  angles = positions.astype(jnp.float32)[:, :, None] * jnp.asarray(inv_freq, jnp.float32)  # (B, T, Dh/2)
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class DenseGeneral(nn.Module):
  """y = x @ kernel (+ bias) over the trailing `len(in_shape)` axes, weights cast to `dtype`."""
  in_shape: tuple
  out_shape: tuple
  kernel_axes: tuple
  bias_axes: tuple
  dtype: Dtype = jnp.bfloat16
  kernel_init: Callable = _INIT
  use_bias: bool = True

  @nn.compact
  def __call__(self, x):
    kernel = self.param("kernel", nn.with_logical_partitioning(self.kernel_init, self.kernel_axes),
                        self.in_shape + self.out_shape, jnp.float32)
    y = kernels.contract_trailing(x.astype(self.dtype), kernel.astype(self.dtype), len(self.in_shape))
    if self.use_bias:
      bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, self.bias_axes),
                        self.out_shape, jnp.float32)
      y = kernels.add_bias(y, bias)
    return y


def causal_segment_mask(segment_ids: jax.Array, window: int = 0) -> jax.Array:
  """(B, L) segment ids → (B, 1, L, L) bool mask: causal and within one document, padding masked; with a
  `window` W > 0 each query also sees only the W keys ending at its own (sliding-window attention)."""
  length = segment_ids.shape[-1]
  causal = window_mask(jnp.arange(length), jnp.arange(length), window)
  same = segment_ids[:, :, None] == segment_ids[:, None, :]
  valid = (segment_ids != 0)[:, :, None]
  return (causal[None] & same & valid)[:, None]


def window_mask(query_slots: jax.Array, key_slots: jax.Array, window: int = 0) -> jax.Array:
  """(L,) query and (S,) key slots → (L, S) bool: key at or before the query and, with window W > 0, fewer than
  W slots behind it (as Hugging Face's sliding window: key > query − W)."""
  mask = key_slots[None, :] <= query_slots[:, None]
  if window:
    mask &= key_slots[None, :] > query_slots[:, None] - window
  return mask


def _heads_first(q, k, v):
  """(B, L, H, Dh) queries, (B, S, K, Dh) keys/values → head-major operands, the layout XLA's batched GEMMs want
  (with the heads between batch and length, XLA:CPU's attention runs 13–20% slower, forward + backward): (B, H, L, Dh) and
  (B, H, S, Dh) for multi-head attention; grouped-query (K < H) queries become (B, K, H/K, L, Dh)."""
  b, length, h, depth = q.shape
  kv_heads = k.shape[2]
  q = jnp.swapaxes(q, 1, 2)
  if kv_heads != h:
    q = q.reshape(b, kv_heads, h // kv_heads, length, depth)
  return q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)


def _attend(q, k, v, mask, scale_dim: int = 0, softcap: float = 0.0):
  """Softmax attention (float32 softmax) on _heads_first operands; mask (B, 1, L, S). Logits are q·k / √scale_dim
  (0: the head width), soft-capped to (−softcap, softcap) by softcap · tanh(· / softcap) when softcap > 0. Returns
  q's layout."""
  grouped = q.ndim == 5
  logits = jnp.einsum("bkgqd,bksd->bkgqs" if grouped else "bhqd,bhsd->bhqs", q, k,
                      preferred_element_type=jnp.float32)
  logits = logits / jnp.sqrt(scale_dim or q.shape[-1]).astype(jnp.float32)
  if softcap:
    logits = softcap * jnp.tanh(logits / softcap)
  logits = jnp.where(mask[:, :, None] if grouped else mask, logits, jnp.finfo(jnp.float32).min)
  probs = kernels.softmax_last(logits).astype(v.dtype)
  return jnp.einsum("bkgqs,bksd->bkgqd" if grouped else "bhqs,bhsd->bhqd", probs, v)


def _heads_last(out):
  """_attend's output → (B, L, H, Dh)."""
  if out.ndim == 5:
    out = out.reshape((out.shape[0], out.shape[1] * out.shape[2]) + out.shape[3:])
  return jnp.swapaxes(out, 1, 2)


def reference_attention(q, k, v, mask, scale_dim: int = 0, softcap: float = 0.0):
  """Plain softmax attention. q: (B, L, H, Dh); k, v: (B, S, K, Dh) with K dividing H (grouped-query: query head h
  reads key/value head h // (H/K)); mask: (B, 1, L, S) bool. Softmax in float32; scale_dim, softcap: see _attend."""
  return _heads_last(_attend(*_heads_first(q, k, v), mask, scale_dim, softcap))


def causal_block_size(length: int) -> int:
  """Query rows per block of causal_attention: 4–8 blocks, at least 64 rows."""
  return max(64, -(-length // 8))


def causal_blocks(length: int, block: int = 0) -> list:
  """The (start, end) query rows of causal_attention's blocks; block 0 = causal_block_size(length)."""
  block = block or causal_block_size(length)
  return [(start, min(start + block, length)) for start in range(0, length, block)]


def causal_attention(q, k, v, mask, block: int = 0, window: int = 0, scale_dim: int = 0, softcap: float = 0.0):
  """reference_attention for a causal mask (query i never reads a key after position i; q and k the same length),
  computed by blocks of `block` query rows (default causal_block_size), each against only the keys up to its
  last row. Equal to reference_attention(q, k, v, mask); it skips the masked upper triangle, 3/8 to 7/16 of the
  scores' products and memory with 4–8 blocks, and each block's scores stay small. A row whose mask admits no key
  (padding) gets a uniform softmax over the keys up to its block's end instead of all keys; such outputs are never
  read. With a sliding `window` W (the mask's), a block also skips the keys more than W − 1 before its first row.
  When `length` is split over devices (context parallelism) slicing it would reshuffle the shards, so the full
  product is used. scale_dim, softcap: see _attend."""
  blocks = causal_blocks(q.shape[1], block)
  if len(blocks) == 1 or kernels.length_is_split():
    return reference_attention(q, k, v, mask, scale_dim, softcap)
  q, k, v = _heads_first(q, k, v)
  first = lambda start: max(0, start - window + 1) if window else 0  # the block's first key
  outs = [_attend(q[..., start:end, :], k[:, :, first(start):end], v[:, :, first(start):end],
                  mask[:, :, start:end, first(start):end], scale_dim, softcap) for start, end in blocks]
  return _heads_last(jnp.concatenate(outs, axis=-2))
