"""Flax building blocks of the GPT decoder, annotated with logical axis names only."""

import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

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


REDUCE_WINDOW = 32  # XLA:CPU rewrites a reduction over any axis longer than this into reduce-window + reduce


def _on_cpu() -> bool:
  return jax.default_backend() == "cpu"


def windowed(x: jax.Array) -> tuple:
  """(x viewed as (..., D/32^k, 32, ..., 32), the axes that view spans) when that keeps a reduction over the last
  axis (D = 512: (16, 32); 8,192: (8, 32, 32)) whole on XLA:CPU, else (x, (x.ndim - 1,)).

  XLA:CPU's tree-reduction rewrite turns a reduction over an axis longer than 32 into an unfused reduce-window pass
  and a second reduce, materialising the reduced operand first; over axes of at most 32 each the reduction stays
  one fused loop (LayerNorm forward + backward over (4096, 512): 7.3 → 4.2 ms). Reduce over the returned axes
  (keepdims to broadcast back) and reshape to x.shape."""
  rest, window = x.shape[-1], ()
  while rest > REDUCE_WINDOW and rest % REDUCE_WINDOW == 0:
    rest, window = rest // REDUCE_WINDOW, window + (REDUCE_WINDOW,)
  if not _on_cpu() or not window or rest > REDUCE_WINDOW:
    return x, (x.ndim - 1,)
  view = x.reshape(x.shape[:-1] + ((rest,) if rest > 1 else ()) + window)
  return view, tuple(range(x.ndim - 1, view.ndim))


def softmax_last(x: jax.Array) -> jax.Array:
  """jax.nn.softmax over the last axis, reduced over the `windowed` view on XLA:CPU."""
  view, axes = windowed(x)
  return jax.nn.softmax(view, axis=axes).reshape(x.shape)


def sum_rows(x: jax.Array, n_trailing: int) -> jax.Array:
  """Σ of x over all but its trailing `n_trailing` axes, in float32: a parameter's gradient summed over tokens.

  On XLA:CPU as a product with a vector of ones, when the leading axes can be merged (`length` not split over
  devices): the plain reduction is rewritten into an unfused reduce-window pass (a (4096, 2048) column sum 24 ms as
  a reduction, 6 ms as the product)."""
  lead = x.ndim - n_trailing
  if not _on_cpu() or _length_is_split():
    return jnp.sum(x.astype(jnp.float32), axis=tuple(range(lead)))
  rows = x.reshape((-1,) + x.shape[lead:])
  ones = jnp.ones((rows.shape[0],), x.dtype)
  return jax.lax.dot_general(ones, rows, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


@jax.custom_vjp
def scale_shift(y: jax.Array, scale: jax.Array, shift) -> jax.Array:
  """y · scale (+ shift) with scale, shift (*trailing) broadcast over y's leading axes; shift may be None. The
  parameters' gradients are summed over the leading axes by sum_rows."""
  out = y * scale.astype(y.dtype)
  return out if shift is None else out + shift.astype(y.dtype)


def _scale_shift_fwd(y, scale, shift):
  return scale_shift(y, scale, shift), (y, scale, shift)


def _scale_shift_bwd(residuals, g):
  y, scale, shift = residuals
  n = scale.ndim
  d_shift = None if shift is None else sum_rows(g, n).astype(shift.dtype)
  return (g * scale.astype(g.dtype)).astype(y.dtype), sum_rows(g * y, n).astype(scale.dtype), d_shift


scale_shift.defvjp(_scale_shift_fwd, _scale_shift_bwd)


@jax.custom_vjp
def add_bias(y: jax.Array, bias: jax.Array) -> jax.Array:
  """y + bias over y's trailing bias.ndim axes, the bias's gradient summed by sum_rows."""
  return y + bias.astype(y.dtype)


def _add_bias_fwd(y, bias):
  return add_bias(y, bias), bias


def _add_bias_bwd(bias, g):
  return g, sum_rows(g, bias.ndim).astype(bias.dtype)


add_bias.defvjp(_add_bias_fwd, _add_bias_bwd)


class LayerNorm(nn.Module):
  """LayerNorm computed in float32, returned in the compute dtype."""
  dtype: Dtype = jnp.bfloat16
  epsilon: float = 1e-5

  @nn.compact
  def __call__(self, x):
    d = x.shape[-1]
    scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, (ax.NORM,)), (d,))
    bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, (ax.NORM,)), (d,))
    x32, axes = windowed(x.astype(jnp.float32))
    mean = x32.mean(axes, keepdims=True)
    var = jnp.square(x32 - mean).mean(axes, keepdims=True)
    y = ((x32 - mean) * jax.lax.rsqrt(var + self.epsilon)).reshape(x.shape)
    return scale_shift(y, scale, bias).astype(self.dtype)


class RMSNorm(nn.Module):
  """Root-mean-square norm (no centring, no bias) computed in float32, returned in the compute dtype."""
  dtype: Dtype = jnp.bfloat16
  epsilon: float = 1e-5

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, (ax.NORM,)), (x.shape[-1],))
    x32, axes = windowed(x.astype(jnp.float32))
    y = (x32 * jax.lax.rsqrt(jnp.square(x32).mean(axes, keepdims=True) + self.epsilon)).reshape(x.shape)
    return scale_shift(y, scale, None).astype(self.dtype)


def norm_layer(kind: str):
  """The norm class a GPTConfig.norm names."""
  return {"layernorm": LayerNorm, "rmsnorm": RMSNorm}[kind]


def rope_frequencies(head_dim: int, theta: float, scaling_factor: float = 1.0, low_freq_factor: float = 1.0,
                     high_freq_factor: float = 4.0, original_max_len: int = 8192) -> np.ndarray:
  """Rotary inverse frequencies (head_dim/2,) float64, with Llama-3's long-wavelength scaling when factor > 1:
  wavelengths longer than original_max_len/low_freq_factor are divided by the factor, those shorter than
  original_max_len/high_freq_factor are kept, and those between are interpolated smoothly."""
  inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  if scaling_factor == 1.0:
    return inv_freq
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


def _length_is_split() -> bool:
  """Whether the current logical-axis rules put activations' `length` on a mesh axis of more than one device."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return False
  spec = nn.logical_to_mesh_axes((ax.LENGTH,))
  axes = spec[0] if spec else None
  axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
  return any(mesh.shape.get(a, 1) > 1 for a in axes)


def _gram(a: jax.Array, b: jax.Array, dtype) -> jax.Array:
  """aᵀ·b for a (R, m), b (R, n) → (m, n) in `dtype`, as a plain GEMM on one explicitly transposed operand.

  XLA:CPU runs a product contracting both operands' leading axis at 30-60% of its plain GEMM's speed (one core,
  the weight gradients of a dense layer: 45 vs 87 GFLOP/s at R = 4,096, m = 512, n = 2,048). Transposing the
  smaller operand first costs a copy of R·min(m, n) elements; the optimisation barriers keep XLA's simplifier from
  folding the transpose back into the product."""
  barrier = jax.lax.optimization_barrier
  if a.shape[1] <= b.shape[1]:
    return jax.lax.dot(barrier(a.T), b, preferred_element_type=dtype)
  return barrier(jax.lax.dot(barrier(b.T), a, preferred_element_type=dtype)).T


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _with_kernel_grad(kernel_leading: bool, kernel_aval: jax.ShapeDtypeStruct, y: jax.Array, x: jax.Array,
                      kernel: jax.Array) -> jax.Array:
  """y = x (R, *in) · kernel, passed through unchanged; its backward gives the kernel's gradient by `_gram`.

  contract_trailing computes y with the kernel's gradient stopped: the forward product (and what rematerialisation
  policies see of it) stays the plain dot, only the kernel's gradient is computed here. The kernel is not a
  residual, so a layer scan does not stack a copy of the weights for the backward pass (`kernel_aval` gives its
  shape and dtype). kernel_leading: the contracted axes are the kernel's leading ones (else its trailing ones)."""
  del kernel_leading, kernel_aval, x, kernel
  return y


def _with_kernel_grad_fwd(kernel_leading, kernel_aval, y, x, kernel):
  del kernel_leading, kernel_aval, kernel
  return y, x


def _with_kernel_grad_bwd(kernel_leading, kernel_aval, x, g):
  rows = x.shape[0]
  x2, g2 = x.reshape(rows, -1), g.reshape(rows, -1)
  grad = _gram(x2, g2, kernel_aval.dtype) if kernel_leading else _gram(g2, x2, kernel_aval.dtype)
  return g, jnp.zeros_like(x), grad.reshape(kernel_aval.shape)


_with_kernel_grad.defvjp(_with_kernel_grad_fwd, _with_kernel_grad_bwd)


def contract_trailing(x: jax.Array, kernel: jax.Array, n_in: int, kernel_in: tuple = None,
                      preferred_element_type=None) -> jax.Array:
  """x (..., *in) · kernel over x's trailing `n_in` axes and kernel's axes `kernel_in` (default its leading n_in).

  The leading (batch, length) axes of x are merged into one before the product (unless `length` is split over
  devices, where merging would reshuffle the shards). The weight gradient then contracts over a single axis;
  contracting over (batch, length) makes XLA:CPU copy a transposed operand first (the whole (B, T, V) logits
  gradient for the output projection). On the CPU backend the weight gradient of the merged product is computed
  by `_gram` (see there)."""
  kernel_in = tuple(range(n_in)) if kernel_in is None else tuple(kernel_in)
  lead = x.shape[:x.ndim - n_in]
  flat = len(lead) > 1 and not _length_is_split()
  if flat:
    x = x.reshape((-1,) + x.shape[x.ndim - n_in:])
  dims = ((tuple(range(x.ndim - n_in, x.ndim)), kernel_in), ((), ()))
  leading, trailing = tuple(range(n_in)), tuple(range(kernel.ndim - n_in, kernel.ndim))
  if x.ndim == n_in + 1 and kernel_in in (leading, trailing) and _on_cpu():
    y = jax.lax.dot_general(x, jax.lax.stop_gradient(kernel), dims, preferred_element_type=preferred_element_type)
    y = _with_kernel_grad(kernel_in == leading, jax.ShapeDtypeStruct(kernel.shape, kernel.dtype), y, x, kernel)
  else:
    y = jax.lax.dot_general(x, kernel, dims, preferred_element_type=preferred_element_type)
  return y.reshape(lead + y.shape[1:]) if flat else y


class DenseGeneral(nn.Module):
  """y = x @ kernel (+ bias) over the trailing `len(in_shape)` axes, weights cast to `dtype`."""
  in_shape: tuple
  out_shape: tuple
  kernel_axes: tuple
  bias_axes: tuple
  dtype: Dtype = jnp.bfloat16
  kernel_init: Callable = _INIT
  use_bias: bool = True
  lora_dropout: float = 0.0  # dropout on the input of LoRA adapters, when present and a 'lora_dropout' rng is given

  @nn.compact
  def __call__(self, x):
    kernel = self.param("kernel", nn.with_logical_partitioning(self.kernel_init, self.kernel_axes),
                        self.in_shape + self.out_shape, jnp.float32)
    n_in = len(self.in_shape)
    y = contract_trailing(x.astype(self.dtype), kernel.astype(self.dtype), n_in)
    if self.has_variable("params", "lora_a"):  # LoRA: + dropout(x)·A·B, A (in..., r), B (r, out...) pre-scaled
      h = x.astype(self.dtype)
      if self.lora_dropout and self.has_rng("lora_dropout"):
        keep = jax.random.bernoulli(self.make_rng("lora_dropout"), 1.0 - self.lora_dropout, h.shape)
        h = jnp.where(keep, h / (1.0 - self.lora_dropout), 0).astype(self.dtype)
      low = contract_trailing(h, self.get_variable("params", "lora_a").astype(self.dtype), n_in)
      y = y + jnp.tensordot(low, self.get_variable("params", "lora_b").astype(self.dtype), axes=1)
    if self.use_bias:
      bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, self.bias_axes),
                        self.out_shape, jnp.float32)
      y = add_bias(y, bias)
    return y


def causal_segment_mask(segment_ids: jax.Array) -> jax.Array:
  """(B, L) segment ids → (B, 1, L, L) bool mask: causal and within one document, padding masked."""
  length = segment_ids.shape[-1]
  causal = jnp.tril(jnp.ones((length, length), dtype=jnp.bool_))
  same = segment_ids[:, :, None] == segment_ids[:, None, :]
  valid = (segment_ids != 0)[:, :, None]
  return (causal[None] & same & valid)[:, None]


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


def _attend(q, k, v, mask):
  """Softmax attention (float32 softmax) on _heads_first operands; mask (B, 1, L, S). Returns q's layout."""
  grouped = q.ndim == 5
  logits = jnp.einsum("bkgqd,bksd->bkgqs" if grouped else "bhqd,bhsd->bhqs", q, k,
                      preferred_element_type=jnp.float32)
  logits = logits / jnp.sqrt(q.shape[-1]).astype(jnp.float32)
  logits = jnp.where(mask[:, :, None] if grouped else mask, logits, jnp.finfo(jnp.float32).min)
  probs = softmax_last(logits).astype(v.dtype)
  return jnp.einsum("bkgqs,bksd->bkgqd" if grouped else "bhqs,bhsd->bhqd", probs, v)


def _heads_last(out):
  """_attend's output → (B, L, H, Dh)."""
  if out.ndim == 5:
    out = out.reshape((out.shape[0], out.shape[1] * out.shape[2]) + out.shape[3:])
  return jnp.swapaxes(out, 1, 2)


def reference_attention(q, k, v, mask):
  """Plain softmax attention. q: (B, L, H, Dh); k, v: (B, S, K, Dh) with K dividing H (grouped-query: query head h
  reads key/value head h // (H/K)); mask: (B, 1, L, S) bool. Softmax in float32."""
  return _heads_last(_attend(*_heads_first(q, k, v), mask))


def causal_block_size(length: int) -> int:
  """Query rows per block of causal_attention: 4–8 blocks, at least 64 rows."""
  return max(64, -(-length // 8))


def causal_blocks(length: int, block: int = 0) -> list:
  """The (start, end) query rows of causal_attention's blocks; block 0 = causal_block_size(length)."""
  block = block or causal_block_size(length)
  return [(start, min(start + block, length)) for start in range(0, length, block)]


def causal_attention(q, k, v, mask, block: int = 0):
  """reference_attention for a causal mask (query i never reads a key after position i; q and k the same length),
  computed by blocks of `block` query rows (default causal_block_size), each against only the keys up to its
  last row. Equal to reference_attention(q, k, v, mask); it skips the masked upper triangle, 3/8 to 7/16 of the
  scores' products and memory with 4–8 blocks, and each block's scores stay small. A row whose mask admits no key
  (padding) gets a uniform softmax over the keys up to its block's end instead of all keys; such outputs are never
  read. When `length` is split over devices (context parallelism) slicing it would reshuffle the shards, so the
  full product is used."""
  blocks = causal_blocks(q.shape[1], block)
  if len(blocks) == 1 or _length_is_split():
    return reference_attention(q, k, v, mask)
  q, k, v = _heads_first(q, k, v)
  outs = [_attend(q[..., start:end, :], k[:, :, :end], v[:, :, :end], mask[:, :, start:end, :end])
          for start, end in blocks]
  return _heads_last(jnp.concatenate(outs, axis=-2))
