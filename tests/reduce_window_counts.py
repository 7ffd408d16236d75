"""`python tests/reduce_window_counts.py`, run with the XLA:CPU flags every entry point sets (distributed.CPU_XLA_FLAGS):
only with YNN's reduction fusions off does XLA:CPU rewrite reductions into reduce-window. Prints the reduce-window
counts of the compiled gradients: LayerNorm plain / ours, a bias plain / ours (tests/test_cpu_reductions.py)."""

import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository, for `tests`

import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position

from tests import test_cpu_reductions as t  # pylint: disable=wrong-import-position
from t5x_like.model import cpu_kernels  # pylint: disable=wrong-import-position


def count(f, *args) -> int:
  return jax.jit(f).lower(*args).compile().as_text().count("reduce-window(")


def main():
  ours, plain, params, x = t._norm_case("layernorm")  # pylint: disable=protected-access
  grad = lambda f: jax.grad(f, argnums=(0, 1))
  bias, y, cot = t._rand(256), t._rand(2, 64, 256, seed=4), t._rand(2, 64, 256, seed=3)  # 64 rows > 32
  plain_bias = lambda b, y, c: jax.grad(lambda b: jnp.sum((y + b) * c))(b)
  our_bias = lambda b, y, c: jax.grad(lambda b: jnp.sum(cpu_kernels.add_bias(y, b) * c))(b)
  print(count(grad(plain), params, x), count(grad(ours), params, x), count(plain_bias, bias, y, cot),
        count(our_bias, bias, y, cot))


if __name__ == "__main__":
  main()
