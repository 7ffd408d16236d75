"""Pipeline parallelism: the stacked decoder blocks split into stages, microbatches streamed GPipe-style.

The stacked block parameters (L, ...) are viewed as (P, L/P, ...) with the stage axis on the
`pipeline` mesh axis; since LAYERS already maps to `pipeline`, the reshape moves no data. The batch is
cut into M microbatches and pushed through a state buffer (P, mb, T, D): at iteration i every stage s
runs its L/P layers on microbatch i − s (one jax.vmap over stages, spmd_axis_name = the stage's mesh
axis), then the buffer rolls one stage forward (jnp.roll on a sharded axis → collective-permute).
After M + P − 1 iterations every microbatch has left the last stage. Each microbatch's segment ids
and positions travel with it through the buffer, so its attention mask (and rotary angles) are rebuilt on
whichever stage holds it.

Idle stage-iterations (the "bubble") are a fraction (P − 1)/(M + P − 1) of the schedule: they compute
on stale data whose results are never read, so they cost time but not correctness.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from t5x_like.parallel import axis_names as ax
from t5x_like.model import layers
from t5x_like.model import blocks as blocks_lib
from t5x_like.model.config import GPTConfig, pipeline_microbatches

_ACT = (ax.BATCH, ax.LENGTH, ax.ACT_EMBED)


def bubble_fraction(num_stages: int, microbatches: int) -> float:
  """GPipe's idle fraction (p − 1)/(m + p − 1) of the stage-iterations in one pass."""
  return (num_stages - 1) / (microbatches + num_stages - 1)


@functools.lru_cache(maxsize=None)
def _block_param_names(config: GPTConfig):
  """Logical names of one Block's parameters (no LAYERS axis), as a params-shaped tree of tuples."""
  block = blocks_lib.Block(config, parent=None)
  shapes = jax.eval_shape(lambda: block.init(jax.random.key(0), jnp.zeros((1, 1, config.d_model), config.compute_dtype),
                                             jnp.ones((1, 1, 1, 1), jnp.bool_), jnp.zeros((1, 1), jnp.int32))["params"])
  return jax.tree.map(lambda b: tuple(b.names), shapes, is_leaf=lambda b: isinstance(b, nn.LogicallyPartitioned))


def stage_params(config: GPTConfig, stacked_params):
  """(L, ...) stacked block parameters → (P, L/P, ...), stage axis constrained to STAGE's mesh axis."""
  p = config.num_stages
  names = _block_param_names(config)

  def split(w, leaf_names):
    w = w.reshape((p, w.shape[0] // p) + w.shape[1:])
    return layers.constrain(w, (ax.STAGE, None) + leaf_names)

  return jax.tree.map(split, stacked_params, names, is_leaf=lambda x: isinstance(x, tuple))


def _stage_axis_name():
  """The mesh axis STAGE maps to under the active logical rules (None outside them)."""
  try:
    spec = nn.logical_to_mesh_axes((ax.STAGE,))
  except ValueError:
    return None
  return spec[0] if spec else None


def _split(x, m):
  """(B, ...) → (M, B/M, ...): microbatch k takes rows k, k+M, ... so each data shard feeds every one."""
  return jnp.swapaxes(x.reshape((x.shape[0] // m, m) + x.shape[1:]), 0, 1)


def _merge(x):
  """Inverse of `_split`: (M, B/M, ...) → (B, ...)."""
  return jnp.swapaxes(x, 0, 1).reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def pipeline_blocks(config: GPTConfig, stacked_params, x, segment_ids, positions):
  """Applies the stacked blocks like `model.scan_blocks`, split into `num_stages` pipelined stages.

  Args:
    config: the model config; `num_stages` > 1 divides `num_layers`.
    stacked_params: block parameters with a leading (L, ...) LAYERS axis.
    x: (B, T, D) block-stack input.
    segment_ids: (B, T) document ids, 0 = padding (the attention mask is built per microbatch).
    positions: (B, T) position of each token in its document (rotary embeddings), carried like segment_ids.

  Returns:
    (B, T, D), equal to the sequential run.
  """
  p = config.num_stages
  m = pipeline_microbatches(config)
  b, t, d = x.shape
  if b % m:
    raise ValueError(f"pipeline: {b} rows per (gradient-accumulation) microbatch are not divisible by "
                     f"GPTConfig.pipeline_microbatches={m}")
  mb = b // m
  params = stage_params(config, stacked_params)
  inputs = layers.constrain(_split(x, m), (None,) + _ACT)  # (M, mb, T, D)
  segments = _split(segment_ids, m)  # (M, mb, T)
  pos = _split(positions, m)  # (M, mb, T)
  is_first = (jnp.arange(p) == 0)  # (P,)

  def run_stage(stage_weights, h, seg, stage_pos):  # one stage: its L/P layers on one microbatch
    return blocks_lib.scan_blocks(config, stage_weights, h, layers.causal_segment_mask(seg), stage_pos)

  run_stages = jax.vmap(run_stage, spmd_axis_name=_stage_axis_name())

  def iteration(carry, i):
    state, state_seg, state_pos = carry  # (P, mb, T, D), (P, mb, T), (P, mb, T)
    state = jnp.where(is_first[:, None, None, None], inputs[i % m][None], state)  # stage 0 takes microbatch i
    state_seg = jnp.where(is_first[:, None, None], segments[i % m][None], state_seg)
    state_pos = jnp.where(is_first[:, None, None], pos[i % m][None], state_pos)
    out = layers.constrain(run_stages(params, state, state_seg, state_pos), (ax.STAGE,) + _ACT)
    last = out[p - 1]  # microbatch i − (P − 1), valid once i ≥ P − 1
    return (jnp.roll(out, 1, axis=0), jnp.roll(state_seg, 1, axis=0), jnp.roll(state_pos, 1, axis=0)), last

  state = layers.constrain(jnp.zeros((p, mb, t, d), x.dtype), (ax.STAGE,) + _ACT)
  state_seg = jnp.ones((p, mb, t), segment_ids.dtype)
  state_pos = jnp.zeros((p, mb, t), positions.dtype)
  _, outs = jax.lax.scan(iteration, (state, state_seg, state_pos), jnp.arange(m + p - 1))
  return _merge(outs[p - 1:])  # (B, T, D)
