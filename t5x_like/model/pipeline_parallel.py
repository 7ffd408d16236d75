"""Pipeline parallelism: the stacked decoder blocks split into stages, microbatches streamed through them.

The stacked block parameters (L, ...) are cut into P·V chunks of L/(P·V) layers; chunk r·P + s runs on
stage s (device s of the `pipeline` mesh axis) as its virtual stage r. V = GPTConfig.pipeline_repeats:
V = 1 is GPipe (each device one contiguous stage; since LAYERS maps to `pipeline`, the reshape moves no
data); V > 1 is the interleaved (circular) schedule of Megatron-LM / MaxText, where each device holds V
non-adjacent chunks and every microbatch goes round the ring of stages V times.

The batch is cut into M microbatches. At iteration i stage s runs its chunk of repeat (i − s) // M on
microbatch (i − s) mod M (one jax.vmap over stages, spmd_axis_name = the stage's mesh axis); then the state
buffer (P, mb, T, D) rolls one stage forward (jnp.roll on a sharded axis → collective-permute). What leaves
the last stage goes back into a loop buffer (M, mb, T, D), which stage 0 reads when that microbatch starts
its next repeat (M ≥ P keeps it from being read before it is written). After V·M + P − 1 iterations the
loop buffer holds every microbatch's output. Each microbatch's segment ids and positions are looked up per
stage, so its attention mask (and rotary angles) are rebuilt on whichever stage holds it.

Stage order (V > 1): a trainer's state holds the stacked blocks as device s's chunks s, P + s, 2P + s, ... side by
side (`to_stage_order`, GPTConfig.blocks_stage_ordered), so LAYERS' contiguous split over `pipeline` already gives
each device its own chunks and no step regroups the weights or their gradients. Checkpoints, exports and the
engine keep layer order: the trainer converts once where its state meets them (`reorder_blocks`).

Idle stage-iterations (the "bubble") are a fraction (P − 1)/(V·M + P − 1) of the schedule: they compute on
stale data whose results are never read, so they cost time but not correctness.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from t5x_like.parallel import axis_names as ax
from t5x_like.model import layers
from t5x_like.model import blocks as blocks_lib
from t5x_like.model import moe
from t5x_like.model.config import GPTConfig, pipeline_microbatches

_ACT = (ax.BATCH, ax.LENGTH, ax.ACT_EMBED)
_CHUNK = "pipeline_chunk"  # name of a stage's per-iteration weight slice (recomputed, never saved: see below)


def bubble_fraction(num_stages: int, microbatches: int, repeats: int = 1) -> float:
  """Idle fraction (p − 1)/(v·m + p − 1) of the stage-iterations in one pass (v = 1: GPipe's)."""
  return (num_stages - 1) / (repeats * microbatches + num_stages - 1)


@functools.lru_cache(maxsize=None)
def _block_param_names(config: GPTConfig):
  """Logical names of one stacked element's parameters (no LAYERS axis), as a params-shaped tree of tuples."""
  block = blocks_lib.unit_module(config)
  shapes = jax.eval_shape(lambda: block.init(jax.random.key(0), jnp.zeros((1, 1, config.d_model), config.compute_dtype),
                                             jnp.ones((1, 1, 1, 1), jnp.bool_), jnp.zeros((1, 1), jnp.int32))["params"])
  return jax.tree.map(lambda b: tuple(b.names), shapes, is_leaf=lambda b: isinstance(b, nn.LogicallyPartitioned))


def stage_params(config: GPTConfig, stacked_params):
  """(U, ...) stacked block parameters → (P, V, U/(P·V), ...): [s, r] is chunk r·P + s, the stage axis constrained
  to STAGE's mesh axis. V = 1, or blocks already in stage order (GPTConfig.blocks_stage_ordered), moves no data;
  V > 1 in layer order regroups each device's contiguous U/P elements (an all-to-all of the block weights over
  `pipeline`, and of their gradients in the backward pass).

  Leaves the model does not declare (LoRA adapters beside a kernel) keep their own layout past the stage axis."""
  p, v = config.num_stages, config.pipeline_repeats
  names = {path: leaf for path, leaf in jax.tree_util.tree_leaves_with_path(
      _block_param_names(config), is_leaf=lambda x: isinstance(x, tuple))}
  order = (lambda w: w) if config.blocks_stage_ordered else functools.partial(_regroup, v, p)

  def split(path, w):
    w = order(w).reshape((p, v, w.shape[0] // (p * v)) + w.shape[1:])  # (P, V, U/(P·V), ...)
    return layers.constrain(w, (ax.STAGE, None, None) + names.get(path, (None,) * (w.ndim - 3)))

  return jax.tree_util.tree_map_with_path(split, stacked_params)


def _regroup(outer: int, inner: int, w):
  """(U, ...) read as (outer, inner, U/(outer·inner), ...) chunks → the same with the two chunk axes swapped."""
  chunks = w.reshape((outer, inner, w.shape[0] // (outer * inner)) + w.shape[1:])
  return jnp.swapaxes(chunks, 0, 1).reshape(w.shape)


def _in_blocks(path) -> bool:
  return any(getattr(key, "key", None) == "blocks" for key in path)


def _reorder(config: GPTConfig, to_stage: bool, path, w):
  if w.ndim == 0 or w.shape[0] != config.num_units:
    raise ValueError(f"{jax.tree_util.keystr(path)}: shape {tuple(w.shape)} has no leading axis of the "
                     f"{config.num_units} stacked elements, so it cannot be put in "
                     f"{'stage' if to_stage else 'layer'} order")
  p, v = config.num_stages, config.pipeline_repeats
  return _regroup(v, p, w) if to_stage else _regroup(p, v, w)


def _reorder_tree(config: GPTConfig, to_stage: bool, tree):
  return jax.tree_util.tree_map_with_path(
      lambda path, w: _reorder(config, to_stage, path, w) if _in_blocks(path) else w, tree)


def to_stage_order(config: GPTConfig, tree):
  """Every array under a `blocks` key of `tree` (parameters, optimizer state, LoRA adapters), layer order → stage
  order: row s·(V·C) + r·C + c holds layer row (r·P + s)·C + c (C = U/(P·V)), so the contiguous split of LAYERS over
  `pipeline` puts chunk r·P + s on device s. Traceable; other leaves pass through."""
  return _reorder_tree(config, True, tree)


def to_layer_order(config: GPTConfig, tree):
  """The inverse of `to_stage_order`."""
  return _reorder_tree(config, False, tree)


_REORDERS = {}


def reorder_blocks(config: GPTConfig, tree, *, to_stage: bool, donate: bool = False):
  """`to_stage_order` / `to_layer_order` of sharded arrays, each block leaf keeping its sharding (one jit per
  layout, cached); `tree` unchanged unless config.blocks_stage_ordered. `donate`: the input's block arrays are
  consumed (a restore's), so the device never holds both orders of them."""
  if not config.blocks_stage_ordered:
    return tree
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
  picked = [(path, leaf) for path, leaf in flat if _in_blocks(path)]  # only these move, so only these are donated
  if not picked:
    return tree
  paths, shardings = tuple(path for path, _ in picked), tuple(leaf.sharding for _, leaf in picked)
  key = (config, to_stage, donate, paths, shardings)
  if key not in _REORDERS:
    _REORDERS[key] = jax.jit(lambda xs: [_reorder(config, to_stage, path, x) for path, x in zip(paths, xs)],
                             out_shardings=list(shardings), donate_argnums=(0,) if donate else ())
  moved = dict(zip(paths, _REORDERS[key]([leaf for _, leaf in picked])))
  return jax.tree_util.tree_unflatten(treedef, [moved.get(path, leaf) for path, leaf in flat])


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
  """Applies the stacked blocks like `blocks.run_blocks`, split into `num_stages` × `pipeline_repeats` chunks.

  Args:
    config: the model config; `num_stages` > 1 and `num_stages × pipeline_repeats` divides the stacked elements.
    stacked_params: block parameters with a leading (L, ...) LAYERS axis.
    x: (B, T, D) block-stack input.
    segment_ids: (B, T) document ids, 0 = padding (the attention mask is built per microbatch).
    positions: (B, T) position of each token in its document (rotary embeddings).

  Returns:
    (B, T, D), equal to the sequential run, and like `blocks.run_blocks` its moe.MoeStats (None if dense):
    each microbatch's per-token statistics travel through the stages (and repeats) with it, and each chunk's
    expert loads count only the iterations where its stage holds a real microbatch.
  """
  p, v = config.num_stages, config.pipeline_repeats
  m = pipeline_microbatches(config)
  b, t, d = x.shape
  if b % m:
    raise ValueError(f"pipeline: {b} rows per (gradient-accumulation) microbatch are not divisible by "
                     f"GPTConfig.pipeline_microbatches={m}")
  if v > 1 and m < p:
    raise ValueError(f"GPTConfig.pipeline_microbatches={m} < num_stages={p}: the interleaved schedule "
                     f"(pipeline_repeats={v}) needs at least one microbatch per stage")
  mb, stages = b // m, jnp.arange(p)
  params = stage_params(config, stacked_params)  # (P, V, C, ...)
  if v == 1:
    params = jax.tree.map(lambda w: w[:, 0], params)  # (P, C, ...): loop-invariant, saved once for the backward
  loop = layers.constrain(_split(x, m), (None,) + _ACT)  # (M, mb, T, D): each microbatch between passes
  segments, pos = _split(segment_ids, m), _split(positions, m)  # (M, mb, T)
  first = lambda new, old: jnp.where((stages == 0).reshape((p,) + (1,) * (old.ndim - 1)), new, old)

  chunk = config.num_units // (p * v)  # stacked elements per chunk

  def run_stage(stage_weights, stage, repeat, h, seg, stage_pos, stats):  # one stage: one chunk on one microbatch
    if v > 1:  # this iteration's chunk; named so the checkpoint below recomputes the slice instead of saving it
      stage_weights = jax.tree.map(lambda w: checkpoint_name(w[repeat], _CHUNK), stage_weights)
    mask = blocks_lib.attention_masks(config, functools.partial(layers.causal_segment_mask, seg), seg)
    return blocks_lib.run_blocks(config, stage_weights, h, mask, stage_pos, stats,
                                 first_unit=(repeat * p + stage) * chunk)

  if v > 1:  # without this, the backward would keep a copy of the chunk's weights for every iteration
    run_stage = jax.checkpoint(run_stage, policy=jax.checkpoint_policies.save_anything_except_these_names(_CHUNK),
                               prevent_cse=False)
  run_stages = jax.vmap(run_stage, spmd_axis_name=_stage_axis_name())

  def iteration(carry, i):
    # (P, mb, T, D), (M, mb, T, D); with experts the (P, mb, T, S) token stats in the stages, the same between
    # passes (M, mb, T, S), and the (P, V, C, E) expert loads
    state, loop, state_stats, loop_stats, loads = carry
    held = i - stages  # (P,): stage s holds pass `held // M` of microbatch `held mod M`
    micro, repeat = held % m, jnp.clip(held // m, 0, v - 1)
    state = first(loop[i % m][None], state)  # stage 0 takes microbatch i mod M, for its next repeat
    seg = layers.constrain(segments[micro], (ax.STAGE, ax.BATCH, ax.LENGTH))  # (P, mb, T)
    stage_pos = layers.constrain(pos[micro], (ax.STAGE, ax.BATCH, ax.LENGTH))
    if state_stats is not None:  # statistics travel with their microbatch, like its activations
      state_stats = first(loop_stats[i % m][None], state_stats)
    out, stats = run_stages(params, stages, repeat, state, seg, stage_pos, state_stats)
    out = layers.constrain(out, (ax.STAGE,) + _ACT)
    done = i - (p - 1)  # the microbatch pass leaving the last stage (none while done < 0)
    keep = lambda buffer, new: buffer.at[done % m].set(jnp.where(done >= 0, new, buffer[done % m]))
    loop = keep(loop, out[p - 1])
    if stats is not None:
      real = (held >= 0) & (held < v * m)  # (P,)
      at = real[:, None] & (jnp.arange(v)[None] == repeat[:, None])  # (P, V): the chunk that ran
      loads = loads + jnp.where(at[:, :, None, None], stats.load[:, None], 0.0)
      loop_stats = keep(loop_stats, stats.token[p - 1])
      state_stats = jnp.roll(stats.token, 1, axis=0)
    return (jnp.roll(out, 1, axis=0), loop, state_stats, loop_stats, loads), None

  state = layers.constrain(jnp.zeros((p, mb, t, d), x.dtype), (ax.STAGE,) + _ACT)
  state_stats = loop_stats = loads = None
  if config.num_experts:
    state_stats = jnp.zeros((p, mb, t, len(moe.TOKEN_STATS)), jnp.float32)
    loop_stats = jnp.zeros((m, mb, t, len(moe.TOKEN_STATS)), jnp.float32)
    loads = jnp.zeros((p, v, config.num_units // (p * v), config.num_experts), jnp.float32)
  (_, loop, _, loop_stats, loads), _ = jax.lax.scan(iteration, (state, loop, state_stats, loop_stats, loads),
                                                    jnp.arange(v * m + p - 1))
  if not config.num_experts:
    return _merge(loop), None  # (B, T, D)
  loads = jnp.swapaxes(loads, 0, 1).reshape(-1, config.num_experts)  # chunk r·P + s, in layer order
  return _merge(loop), moe.MoeStats(token=_merge(loop_stats), load=loads)
