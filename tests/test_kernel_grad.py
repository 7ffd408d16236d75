"""Dense products' weight gradients on CPU (cpu_kernels.contract_trailing → _gram) equal plain autodiff.

On the CPU backend contract_trailing computes the kernel's gradient as a plain GEMM on an explicitly transposed
operand instead of letting autodiff transpose the dot. These tests compare values and gradients with a plain
lax.dot_general for each kernel orientation the model uses (dense layers: contracted axes leading; the tied
embedding as output projection: trailing), for several output axes (the fused q/k/v kernel), both branches of
_gram (the smaller operand transposed), under jax.checkpoint, and under vmap with either operand batched or both
(the pipeline runs its stages under vmap; a first version once handed the backward the sum of the stages'
cotangents).

Tolerances: float32 within 2e-6 relative (only the order of the sums differs); bfloat16 operands with float32
accumulation within 1e-2 relative (8 mantissa bits).
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5x_like.model import config as model_lib
from t5x_like.model import cpu_kernels
from t5x_like.parallel import mesh as mesh_lib
from t5x_like.parallel import partitioning

B, T = 3, 8


def plain(x, kernel, n_in, kernel_in=None, preferred_element_type=None):
  kernel_in = tuple(range(n_in)) if kernel_in is None else kernel_in
  dims = ((tuple(range(x.ndim - n_in, x.ndim)), kernel_in), ((), ()))
  return jax.lax.dot_general(x, kernel, dims, preferred_element_type=preferred_element_type)


def loss(product, **kw):
  """A scalar whose cotangent differs per output feature (a plain sum would hide a transposed gradient)."""
  def f(x, kernel):
    y = product(x, kernel, **kw)
    return jnp.sum(jnp.sin(y) * jnp.arange(1.0, 1.0 + y.shape[-1]))
  return f


def normal(seed, shape, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def assert_same(got, want, rtol):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.shape == w.shape and g.dtype == w.dtype
    scale = float(jnp.max(jnp.abs(w.astype(jnp.float32))))
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), atol=rtol * scale)


CASES = {  # name: (x shape, kernel shape, n_in, kernel_in)
    "dense_widening": ((B, T, 6), (6, 10), 1, None),  # _gram transposes x (the smaller operand)
    "dense_narrowing": ((B, T, 10), (10, 6), 1, None),  # _gram transposes the output's cotangent
    "qkv": ((B, T, 6), (6, 3, 2, 4), 1, None),
    "attention_out": ((B, T, 2, 4), (2, 4, 6), 2, None),
    "tied_embedding": ((B, T, 6), (20, 6), 1, (1,)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_gradient_equals_autodiff(case):
  x_shape, k_shape, n_in, kernel_in = CASES[case]
  x, kernel = normal(0, x_shape), normal(1, k_shape)
  kw = dict(n_in=n_in, kernel_in=kernel_in)
  assert "custom_vjp_call" in str(jax.make_jaxpr(lambda x, k: cpu_kernels.contract_trailing(x, k, **kw))(x, kernel))
  assert_same(cpu_kernels.contract_trailing(x, kernel, **kw), plain(x, kernel, **kw), 2e-6)
  grad = lambda f: jax.jit(jax.grad(loss(f, **kw), (0, 1)))(x, kernel)
  assert_same(grad(cpu_kernels.contract_trailing), grad(plain), 2e-6)
  rematerialised = jax.checkpoint(functools.partial(cpu_kernels.contract_trailing, **kw))
  assert_same(jax.jit(jax.grad(loss(rematerialised), (0, 1)))(x, kernel), grad(plain), 2e-6)


def test_tied_embedding_bfloat16_with_float32_logits():
  x, kernel = normal(0, (B, T, 16), jnp.bfloat16), normal(1, (32, 16), jnp.bfloat16)
  kw = dict(n_in=1, kernel_in=(1,), preferred_element_type=jnp.float32)
  grad = lambda f: jax.jit(jax.grad(loss(f, **kw), (0, 1)))(x, kernel)
  assert_same(grad(cpu_kernels.contract_trailing), grad(plain), 1e-2)


@pytest.mark.parametrize("batched", ["x", "kernel", "both"])
def test_kernel_gradient_under_vmap(batched):
  stages = 2
  x, kernel = normal(0, (stages, B, T, 6)), normal(1, (stages, 6, 10))
  in_axes = {"x": (0, None), "kernel": (None, 0), "both": (0, 0)}[batched]
  x_in, k_in = (x if in_axes[0] == 0 else x[0]), (kernel if in_axes[1] == 0 else kernel[0])

  def grad(f):
    per_stage = jax.vmap(lambda x, k: f(x, k, 1), in_axes=in_axes)
    return jax.jit(jax.grad(lambda x, k: jnp.sum(jnp.sin(per_stage(x, k)) * jnp.arange(1.0, 11.0)), (0, 1)))(
        x_in, k_in)

  assert_same(grad(cpu_kernels.contract_trailing), grad(plain), 2e-6)


@pytest.mark.parametrize("sequence", [1, 2])
def test_rows_merged_unless_length_is_split(sequence):
  """(batch, length) are merged into one row axis (and the kernel's gradient goes by _gram) unless the logical
  rules put `length` on a mesh axis of more than one device, where the merge would reshuffle the shards."""
  x, kernel = normal(0, (2, T, 6)), normal(1, (6, 10))
  mesh = mesh_lib.create_mesh({"sequence": sequence}, jax.devices()[:sequence])
  with jax.set_mesh(mesh), nn.logical_axis_rules(partitioning.DEFAULT_RULES):
    jaxpr = str(jax.make_jaxpr(jax.grad(loss(cpu_kernels.contract_trailing, n_in=1), (0, 1)))(x, kernel))
    forward = str(jax.make_jaxpr(lambda x, k: cpu_kernels.contract_trailing(x, k, 1))(x, kernel))
  merged = f"f32[{2 * T},6]" in jaxpr
  assert merged == (sequence == 1)
  assert ("custom_vjp_call" in forward) == (sequence == 1)


def contracts_a_leading_axis(product, x, kernel) -> bool:
  """Whether the compiled gradient has a dot contracting its left operand's leading axis (the slow XLA:CPU form)."""
  hlo = jax.jit(jax.grad(loss(product, n_in=1), (0, 1))).lower(x, kernel).compile().as_text()
  return "lhs_contracting_dims={0}" in hlo


@pytest.mark.parametrize("case", ["dense_widening", "dense_narrowing"])
def test_kernel_gradient_is_a_plain_gemm(case):
  x_shape, k_shape, _, _ = CASES[case]
  x, kernel = normal(0, x_shape), normal(1, k_shape)
  assert contracts_a_leading_axis(plain, x, kernel)  # what autodiff of the plain dot compiles to
  assert not contracts_a_leading_axis(cpu_kernels.contract_trailing, x, kernel)


def test_one_switch_turns_the_cpu_forms_off(monkeypatch):
  """T5X_LIKE_CPU_KERNELS=0 gives the plain forms (autodiff's dot, a reduce_sum, a rolled layer scan) on CPU, with
  the same values; 1 and auto give the CPU forms; anything else is a one-line error naming the variable."""
  x, kernel = normal(0, (B, T, 6)), normal(1, (6, 10))
  jaxpr = lambda: str(jax.make_jaxpr(lambda x, k: cpu_kernels.contract_trailing(x, k, 1))(x, kernel))
  bias_grad = lambda: str(jax.make_jaxpr(jax.grad(lambda b: jnp.sum(cpu_kernels.add_bias(x, b) ** 2)))(x[0, 0]))
  config = model_lib.GPTConfig(num_layers=4)
  assert cpu_kernels.enabled() and "custom_vjp_call" in jaxpr() and config.layer_unroll == 4
  on = jax.grad(loss(cpu_kernels.contract_trailing, n_in=1), (0, 1))(x, kernel)
  monkeypatch.setenv(cpu_kernels.ENV_VAR, "0")
  assert not cpu_kernels.enabled() and "custom_vjp_call" not in jaxpr() and config.layer_unroll == 1
  assert "reduce_sum" in bias_grad() and cpu_kernels.windowed(jnp.zeros((2, 512)))[0].shape == (2, 512)
  assert_same(jax.grad(loss(cpu_kernels.contract_trailing, n_in=1), (0, 1))(x, kernel), on, 2e-6)
  monkeypatch.setenv(cpu_kernels.ENV_VAR, "1")
  assert cpu_kernels.enabled() and "custom_vjp_call" in jaxpr()
  monkeypatch.setenv(cpu_kernels.ENV_VAR, "yes")
  with pytest.raises(ValueError, match=r"^T5X_LIKE_CPU_KERNELS='yes': expected auto, 1 or 0$"):
    cpu_kernels.enabled()
