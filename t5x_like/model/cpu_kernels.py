"""The model's dense products and reductions, with XLA:CPU variants behind one switch (`enabled`).

XLA:CPU runs some of the forms autodiff and the plain formulas produce slowly: a weight gradient that contracts
both operands' leading axis, and any reduction over an axis longer than 32 (rewritten into an unfused
reduce-window pass). docs/performance.md has the measurements. The layers call the ops below, which are the plain
math when the switch is off and the equal-valued CPU forms when it is on:

  contract_trailing  x · kernel over x's trailing axes (dense layers, the output projection)
  add_bias, scale_shift  y + bias, y · scale (+ shift), with float32 parameter gradients summed by sum_rows
  windowed, softmax_last  a view of the last axis for the norms' means; a softmax over it (attention)

The switch: `enabled()` is True on the CPU backend; the environment variable T5X_LIKE_CPU_KERNELS = 1 / 0 forces
the CPU forms on / off on any backend (auto, the default, follows the backend). GPTConfig.layer_unroll's CPU
default follows the same switch.
"""

import functools
import os

import jax
import jax.numpy as jnp

from t5x_like.model import ring

ENV_VAR = "T5X_LIKE_CPU_KERNELS"  # auto (default: on for the CPU backend) | 1 (always on) | 0 (always off)
REDUCE_WINDOW = 32  # XLA:CPU rewrites a reduction over any axis longer than this into reduce-window + reduce


def enabled() -> bool:
  """Whether the model uses the XLA:CPU forms of its products and reductions (read at trace time).

  Raises:
    ValueError: T5X_LIKE_CPU_KERNELS is set to something else than auto, 1 or 0.
  """
  value = os.environ.get(ENV_VAR, "auto").strip().lower()
  if value in ("", "auto"):
    return jax.default_backend() == "cpu"
  if value in ("1", "0"):
    return value == "1"
  raise ValueError(f"{ENV_VAR}={value!r}: expected auto, 1 or 0")


def length_is_split() -> bool:
  """Whether the current logical-axis rules put activations' `length` on a mesh axis of more than one device."""
  return bool(ring.split_length_axes())


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
  if not enabled() or not window or rest > REDUCE_WINDOW:
    return x, (x.ndim - 1,)
  view = x.reshape(x.shape[:-1] + ((rest,) if rest > 1 else ()) + window)
  return view, tuple(range(x.ndim - 1, view.ndim))


def softmax_last(x: jax.Array) -> jax.Array:
  """jax.nn.softmax over the last axis, reduced over the `windowed` view."""
  view, axes = windowed(x)
  return jax.nn.softmax(view, axis=axes).reshape(x.shape)


def sum_rows(x: jax.Array, n_trailing: int) -> jax.Array:
  """Σ of x over all but its trailing `n_trailing` axes, in float32: a parameter's gradient summed over tokens.

  CPU form: a product with a vector of ones, when the leading axes can be merged (`length` not split over
  devices): the plain reduction is rewritten into an unfused reduce-window pass (a (4096, 2048) column sum 24 ms as
  a reduction, 6 ms as the product)."""
  lead = x.ndim - n_trailing
  if not enabled() or length_is_split():
    return jnp.sum(x.astype(jnp.float32), axis=tuple(range(lead)))
  rows = x.reshape((-1,) + x.shape[lead:])
  ones = jnp.ones((rows.shape[0],), x.dtype)
  return jax.lax.dot_general(ones, rows, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


@jax.custom_vjp
def scale_shift(y: jax.Array, scale: jax.Array, shift) -> jax.Array:
  """y · scale (+ shift) with scale, shift (*trailing) broadcast over y's leading axes; shift may be None. The
  parameters' gradients are summed over the leading axes by sum_rows (float32 on every backend)."""
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
  gradient for the output projection). CPU form: the weight gradient of the merged product is computed by `_gram`
  (see there)."""
  kernel_in = tuple(range(n_in)) if kernel_in is None else tuple(kernel_in)
  lead = x.shape[:x.ndim - n_in]
  flat = len(lead) > 1 and not length_is_split()
  if flat:
    x = x.reshape((-1,) + x.shape[x.ndim - n_in:])
  dims = ((tuple(range(x.ndim - n_in, x.ndim)), kernel_in), ((), ()))
  leading, trailing = tuple(range(n_in)), tuple(range(kernel.ndim - n_in, kernel.ndim))
  if x.ndim == n_in + 1 and kernel_in in (leading, trailing) and enabled():
    y = jax.lax.dot_general(x, jax.lax.stop_gradient(kernel), dims, preferred_element_type=preferred_element_type)
    y = _with_kernel_grad(kernel_in == leading, jax.ShapeDtypeStruct(kernel.shape, kernel.dtype), y, x, kernel)
  else:
    y = jax.lax.dot_general(x, kernel, dims, preferred_element_type=preferred_element_type)
  return y.reshape(lead + y.shape[1:]) if flat else y
