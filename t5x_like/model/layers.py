"""Flax building blocks of the GPT decoder, annotated with logical axis names only."""

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

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
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + self.epsilon)
    return (y * scale + bias).astype(self.dtype)


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
    n_in = len(self.in_shape)
    contract = (tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in)))
    y = jax.lax.dot_general(x.astype(self.dtype), kernel.astype(self.dtype), (contract, ((), ())))
    if self.use_bias:
      bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, self.bias_axes),
                        self.out_shape, jnp.float32)
      y = y + bias.astype(self.dtype)
    return y


def causal_segment_mask(segment_ids: jax.Array) -> jax.Array:
  """(B, L) segment ids → (B, 1, L, L) bool mask: causal and within one document, padding masked."""
  length = segment_ids.shape[-1]
  causal = jnp.tril(jnp.ones((length, length), dtype=jnp.bool_))
  same = segment_ids[:, :, None] == segment_ids[:, None, :]
  valid = (segment_ids != 0)[:, :, None]
  return (causal[None] & same & valid)[:, None]


def reference_attention(q, k, v, mask):
  """Plain softmax attention. q,k,v: (B, L, H, Dh); mask: (B, 1, Lq, Lk) bool. Softmax in float32."""
  depth = q.shape[-1]
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
  logits = logits / jnp.sqrt(depth).astype(jnp.float32)
  logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
  return jnp.einsum("bhqk,bkhd->bqhd", probs, v)  # (B, L, H, Dh)
