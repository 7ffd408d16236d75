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
from t5x_like.model import moe
from t5x_like.model.config import GPTConfig, pipeline_microbatches

_ACT = (ax.BATCH, ax.LENGTH, ax.ACT_EMBED)


def bubble_fraction(num_stages: int, microbatches: int) -> float:
  """GPipe's idle fraction (p − 1)/(m + p − 1) of the stage-iterations in one pass."""
  return (num_stages - 1) / (microbatches + num_stages - 1)


@functools.lru_cache(maxsize=None)
def _block_param_names(config: GPTConfig):
  """Logical names of one stacked element's parameters (no LAYERS axis), as a params-shaped tree of tuples."""
  block = blocks_lib.unit_module(config)
  shapes = jax.eval_shape(lambda: block.init(jax.random.key(0), jnp.zeros((1, 1, config.d_model), config.compute_dtype),
                                             jnp.ones((1, 1, 1, 1), jnp.bool_), jnp.zeros((1, 1), jnp.int32))["params"])
  return jax.tree.map(lambda b: tuple(b.names), shapes, is_leaf=lambda b: isinstance(b, nn.LogicallyPartitioned))


def stage_params(config: GPTConfig, stacked_params):
  """(U, ...) stacked block parameters → (P, U/P, ...), stage axis constrained to STAGE's mesh axis.

  Leaves the model does not declare (LoRA adapters beside a kernel) keep their own layout past the stage axis."""
  p = config.num_stages
  names = {path: leaf for path, leaf in jax.tree_util.tree_leaves_with_path(
      _block_param_names(config), is_leaf=lambda x: isinstance(x, tuple))}

  def split(path, w):
    w = w.reshape((p, w.shape[0] // p) + w.shape[1:])
    return layers.constrain(w, (ax.STAGE, None) + names.get(path, (None,) * (w.ndim - 2)))

  return jax.tree_util.tree_map_with_path(split, stacked_params)


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
  """run_pipeline_blocks without the MoE statistics: (B, T, D) → (B, T, D)."""
  return run_pipeline_blocks(config, stacked_params, x, segment_ids, positions)[0]


def run_pipeline_blocks(config: GPTConfig, stacked_params, x, segment_ids, positions):
  """Applies the stacked blocks like `blocks.run_blocks`, split into `num_stages` pipelined stages.

  Args:
    config: the model config; `num_stages` > 1 divides `num_layers`.
    stacked_params: block parameters with a leading (L, ...) LAYERS axis.
    x: (B, T, D) block-stack input.
    segment_ids: (B, T) document ids, 0 = padding (the attention mask is built per microbatch).
    positions: (B, T) position of each token in its document (rotary embeddings), carried like segment_ids.

  Returns:
    (B, T, D), equal to the sequential run, and like `blocks.run_blocks` its moe.MoeStats (None if dense):
    each microbatch's per-token statistics travel through the stages with it (each stage adds its layers'),
    and each stage's expert loads count only the iterations where it holds a real microbatch.
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
  real = lambda i: (i >= jnp.arange(p)) & (i - jnp.arange(p) < m)  # (P,): stage s holds microbatch i − s
  first = lambda new, old: jnp.where(is_first.reshape((p,) + (1,) * (old.ndim - 1)), new, old)

  def run_stage(stage_weights, h, seg, stage_pos, stats):  # one stage: its U/P stacked elements on one microbatch
    return blocks_lib.run_blocks(config, stage_weights, h, layers.causal_segment_mask(seg), stage_pos, stats)

  run_stages = jax.vmap(run_stage, spmd_axis_name=_stage_axis_name())

  def iteration(carry, i):
    # (P, mb, T, D), (P, mb, T), (P, mb, T); with experts (P, mb, T, S) token stats and (P, U/P, E) loads
    state, state_seg, state_pos, state_stats, loads = carry
    state = first(inputs[i % m][None], state)  # stage 0 takes microbatch i
    state_seg = first(segments[i % m][None], state_seg)
    state_pos = first(pos[i % m][None], state_pos)
    if state_stats is not None:
      state_stats = first(jnp.zeros_like(state_stats), state_stats)  # a new microbatch's statistics start at 0
    out, stats = run_stages(params, state, state_seg, state_pos, state_stats)
    out = layers.constrain(out, (ax.STAGE,) + _ACT)
    if stats is not None:
      loads = loads + jnp.where(real(i)[:, None, None], stats.load, 0.0)
      state_stats = stats.token
    roll = lambda a: None if a is None else jnp.roll(a, 1, axis=0)
    last = (out[p - 1], None if stats is None else stats.token[p - 1])  # microbatch i − (P − 1), once i ≥ P − 1
    return (roll(out), roll(state_seg), roll(state_pos), roll(state_stats), loads), last

  state = layers.constrain(jnp.zeros((p, mb, t, d), x.dtype), (ax.STAGE,) + _ACT)
  state_stats = loads = None
  if config.num_experts:
    state_stats = jnp.zeros((p, mb, t, len(moe.TOKEN_STATS)), jnp.float32)
    loads = jnp.zeros((p, config.num_units // p, config.num_experts), jnp.float32)
  init = (state, jnp.ones((p, mb, t), segment_ids.dtype), jnp.zeros((p, mb, t), positions.dtype), state_stats, loads)
  (*_, loads), (outs, token_stats) = jax.lax.scan(iteration, init, jnp.arange(m + p - 1))
  if not config.num_experts:
    return _merge(outs[p - 1:]), None  # (B, T, D)
  stats = moe.MoeStats(token=_merge(token_stats[p - 1:]), load=loads.reshape(-1, config.num_experts))
  return _merge(outs[p - 1:]), stats
