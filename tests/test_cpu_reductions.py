"""cpu_kernels.windowed / softmax_last / sum_rows / scale_shift / add_bias: the reductions XLA:CPU would otherwise rewrite
into unfused reduce-window passes equal the plain ones, values and gradients, and compile without reduce-window."""

import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import forkserver
from t5x_like.model import cpu_kernels
from t5x_like.model import layers
from t5x_like.parallel import distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rand(*shape, seed=0):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


@pytest.mark.parametrize("d, view", [(512, (16, 32)), (8192, (8, 32, 32)), (64, (2, 32)), (1024, (32, 32)),
                                     (32, (32,)), (96, (3, 32)), (100, (100,)), (2048, (2, 32, 32)), (50304, (50304,))])
def test_windowed_view(d, view):
  x = jnp.zeros((3, d))
  v, axes = cpu_kernels.windowed(x)
  assert v.shape == (3,) + view
  assert axes == tuple(range(1, v.ndim))


def _plain_ln(x, scale, bias, eps=1e-5):
  mean = x.mean(-1, keepdims=True)
  var = jnp.square(x - mean).mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + eps) * scale + bias


def _plain_rms(x, scale, eps=1e-5):
  return x * jax.lax.rsqrt(jnp.square(x).mean(-1, keepdims=True) + eps) * scale


def _norm_case(norm):
  x = _rand(4, 16, 512) * 3 + 1
  cot = _rand(4, 16, 512, seed=1)
  module = layers.norm_layer(norm)(dtype=jnp.float32)
  params = nn.meta.unbox(module.init(jax.random.key(0), x)["params"])
  params = jax.tree.map(lambda p: p + _rand(*p.shape, seed=2) * 0.1, params)
  ours = lambda p, x: jnp.sum(module.apply({"params": p}, x) * cot)
  if norm == "layernorm":
    plain = lambda p, x: jnp.sum(_plain_ln(x, p["scale"], p["bias"]) * cot)
  else:
    plain = lambda p, x: jnp.sum(_plain_rms(x, p["scale"]) * cot)
  return ours, plain, params, x


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_norms_equal_the_plain_formula(norm):
  ours, plain, params, x = _norm_case(norm)
  (v1, g1), (v0, g0) = [jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(params, x) for f in (ours, plain)]
  np.testing.assert_allclose(v1, v0, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5 * float(jnp.max(jnp.abs(b))))


@pytest.mark.slow  # a process of its own (forked: tests/forkserver.py), with the entry points' XLA:CPU flags
def test_norm_gradients_compile_with_fewer_reduce_windows():
  env = dict(os.environ, XLA_FLAGS=" ".join(distributed.CPU_XLA_FLAGS), JAX_PLATFORMS="cpu")
  out = forkserver.run([sys.executable, "tests/reduce_window_counts.py"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  ln_plain, ln_ours, bias_plain, bias_ours = map(int, out.stdout.split())
  assert ln_plain > 0 and bias_plain > 0  # what the check would see if the rewrite came back
  assert ln_ours < ln_plain // 2, (ln_ours, ln_plain)  # measured: 1 left of 5


def test_add_bias_gradient():
  bias, y, cot = _rand(2048), _rand(4, 16, 2048, seed=4), _rand(4, 16, 2048, seed=3)
  ours = jax.grad(lambda b: jnp.sum(cpu_kernels.add_bias(y, b) * cot))(bias)
  np.testing.assert_allclose(ours, jnp.sum(cot, axis=(0, 1)), rtol=1e-5, atol=1e-5)


def test_bias_gradient_is_a_product_with_ones_on_cpu():
  """The bias's gradient (add_bias → sum_rows) is a dot_general over the merged rows, not a reduce_sum, which
  XLA:CPU would rewrite into an unfused reduce-window pass."""
  bias, y = _rand(64), _rand(4, 16, 64, seed=4)
  jaxpr = str(jax.make_jaxpr(jax.grad(lambda b: jnp.sum(cpu_kernels.add_bias(y, b) ** 2)))(bias))
  plain = str(jax.make_jaxpr(jax.grad(lambda b: jnp.sum((y + b) ** 2)))(bias))
  assert "dot_general" in jaxpr and "reduce_sum" not in jaxpr.split("dot_general")[-1], jaxpr
  assert "reduce_sum" in plain and "dot_general" not in plain


def test_scale_shift_and_sum_rows_gradients():
  y, scale, shift = _rand(2, 8, 3, 4), _rand(3, 4, seed=1), _rand(3, 4, seed=2)
  cot = _rand(2, 8, 3, 4, seed=3)
  ours = jax.grad(lambda *a: jnp.sum(cpu_kernels.scale_shift(*a) * cot), argnums=(0, 1, 2))(y, scale, shift)
  plain = jax.grad(lambda y, s, b: jnp.sum((y * s + b) * cot), argnums=(0, 1, 2))(y, scale, shift)
  for a, b in zip(ours, plain):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  no_shift = jax.grad(lambda y, s: jnp.sum(cpu_kernels.scale_shift(y, s, None) * cot), argnums=1)(y, scale)
  np.testing.assert_allclose(no_shift, jnp.sum(cot * y, axis=(0, 1)), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(cpu_kernels.sum_rows(cot, 2), jnp.sum(cot, axis=(0, 1)), rtol=1e-5, atol=1e-6)


def test_softmax_last_equals_softmax():
  x = _rand(2, 4, 16, 192) * 4
  x = jnp.where(jnp.arange(192) > 150, jnp.finfo(jnp.float32).min, x)  # masked keys, as attention has them
  cot = _rand(2, 4, 16, 192, seed=1)
  np.testing.assert_allclose(cpu_kernels.softmax_last(x), jax.nn.softmax(x, axis=-1), rtol=1e-6, atol=1e-7)
  g1 = jax.grad(lambda x: jnp.sum(cpu_kernels.softmax_last(x) * cot))(x)
  g0 = jax.grad(lambda x: jnp.sum(jax.nn.softmax(x, axis=-1) * cot))(x)
  np.testing.assert_allclose(g1, g0, rtol=1e-5, atol=1e-6)
