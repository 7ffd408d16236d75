"""One pre-LN decoder block (attention + dense or MoE MLP) and the stacked layer scan with its remat policies."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from t5x_like.model import layers
from t5x_like.model import moe
from t5x_like.model import ring
from t5x_like.model import splash
from t5x_like.model.config import GPTConfig
from t5x_like.parallel import axis_names as ax

DROPOUT_RNG = "dropout"  # the rng stream a caller gives `apply` for dropout inside the blocks (e.g. LoRA's)


class Attention(nn.Module):
  """Causal self-attention, multi-head or grouped-query, with optional rotary positions and KV cache."""
  config: GPTConfig

  @nn.compact
  def __call__(self, x, mask, positions=None, cache=None, cache_index=None, local=None):
    """`local`: under GPTConfig.sliding_window_pattern, whether this is a local layer (a traced bool; the mask is
    already the layer's), which picks its rotary frequencies; None = every layer alike."""
    cfg = self.config
    d, h, kvh, dh = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.head_dim
    dense = functools.partial(layers.DenseGeneral, dtype=cfg.compute_dtype, use_bias=cfg.use_bias)
    in_dense = functools.partial(dense, use_bias=cfg.use_bias or cfg.qkv_bias)  # query, key, value projections
    if cfg.fused_qkv:
      qkv = in_dense((d,), (3, h, dh), (ax.EMBED, None, ax.HEADS, ax.KV), (None, ax.HEADS, ax.KV), name="qkv")(x)
      qkv = layers.constrain(qkv, (ax.BATCH, ax.LENGTH, None, ax.ACT_HEADS, ax.KV))  # (B, T, 3, H, Dh)
      q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    else:
      q = in_dense((d,), (h, dh), (ax.EMBED, ax.HEADS, ax.KV), (ax.HEADS, ax.KV), name="query")(x)
      kv = in_dense((d,), (2, kvh, dh), (ax.EMBED, None, ax.KV_HEADS, ax.KV), (None, ax.KV_HEADS, ax.KV),
                    name="key_value")(x)
      kv = layers.constrain(kv, (ax.BATCH, ax.LENGTH, None, ax.ACT_KV_HEADS, ax.KV))  # (B, T, 2, K, Dh)
      k, v = kv[:, :, 0], kv[:, :, 1]
    q = layers.constrain(q, (ax.BATCH, ax.LENGTH, ax.ACT_HEADS, ax.KV))
    if cfg.qk_norm:  # per head, over head_dim, before the rotation (Qwen3; Gemma 3 with its 1 + w scale)
      head_norm = functools.partial(layers.RMSNorm, dtype=cfg.compute_dtype, epsilon=cfg.layer_norm_epsilon,
                                    axis=ax.KV, plus_one=cfg.norm == "rmsnorm_plus_one")
      q, k = head_norm(name="query_norm")(q), head_norm(name="key_norm")(k)
    if cfg.position_embedding == "rope":
      inv_freq = rope_inverse_frequencies(cfg)
      if local is not None:
        inv_freq = jnp.where(local, rope_inverse_frequencies(cfg, local=True), inv_freq)
      q, k = layers.apply_rope(q, positions, inv_freq), layers.apply_rope(k, positions, inv_freq)
    ring_axis = ring.ring_axis(cfg, q.shape[1]) if splash.is_segments(mask) else None
    # Every query reads the whole sequence's keys/values: with `length` split (context parallelism) an all-gather,
    # unless they go round the ring.
    kv_names = (ax.BATCH, ax.LENGTH if ring_axis else ax.KV_LENGTH, ax.ACT_KV_HEADS, ax.KV)
    k, v = layers.constrain(k, kv_names), layers.constrain(v, kv_names)
    new_cache = None
    if cache is not None:  # decoding: write this chunk's keys/values at cache_index, attend to all
      k = jax.lax.dynamic_update_slice_in_dim(cache[0], k.astype(cache[0].dtype), cache_index, axis=1)
      v = jax.lax.dynamic_update_slice_in_dim(cache[1], v.astype(cache[1].dtype), cache_index, axis=1)
      new_cache = (k, v)
    scores = dict(scale_dim=cfg.attention_scale_dim, softcap=cfg.attention_softcap)
    # jax.nn.dot_product_attention has no soft-capping: 'xla' then takes the einsum path (XLA's kernels too)
    impl = cfg.attention_kernel()
    impl = "reference" if impl == "xla" and cfg.attention_softcap else impl
    scale = (cfg.attention_scale_dim or cfg.head_dim) ** -0.5
    if ring_axis:  # attention_masks gave document ids, the length is split: ring attention (training and scoring)
      out = ring.attention(q, k, v, mask, axis=ring_axis, window=cfg.sliding_window, scale=scale,
                           softcap=cfg.attention_softcap)
    elif splash.is_segments(mask):  # attention_masks gave document ids: the splash kernel (training and scoring)
      out = splash.attention(q, k, v, mask, window=cfg.sliding_window, softcap=cfg.attention_softcap,
                             scale=scale)
    elif impl in ("reference", "splash") and cache is None:  # training and scoring: the mask is causal
      # with local and global layers the window is the mask's alone: blocks skip only what every layer skips
      window = 0 if cfg.sliding_window_pattern else cfg.sliding_window
      out = layers.causal_attention(q, k.astype(q.dtype), v.astype(q.dtype), mask, window=window, **scores)
    elif impl in ("reference", "splash"):  # decoding through the KV cache
      out = layers.reference_attention(q, k.astype(q.dtype), v.astype(q.dtype), mask, **scores)
    else:  # attention_softcap is refused with cudnn (GPTConfig.validate)
      scale = cfg.attention_scale_dim ** -0.5 if cfg.attention_scale_dim else None
      out = jax.nn.dot_product_attention(q, k.astype(q.dtype), v.astype(q.dtype), mask=mask, scale=scale,
                                         implementation=None if impl == "xla" else "cudnn")
    out = layers.constrain(out, (ax.BATCH, ax.LENGTH, ax.ACT_HEADS, ax.KV))
    out = dense((h, dh), (d,), (ax.HEADS, ax.KV, ax.EMBED), (ax.NORM,), name="out")(out)
    return out, new_cache


def rope_inverse_frequencies(cfg: GPTConfig, local: bool = False):
  """The rotary inverse frequencies of the global layers, or (`local`) of the local layers under
  sliding_window_pattern: rope_local_theta (or rope_theta), unscaled."""
  if local:
    return layers.rope_frequencies(cfg.head_dim, cfg.rope_local_theta or cfg.rope_theta)
  return layers.rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_factor, cfg.rope_low_freq_factor,
                                 cfg.rope_high_freq_factor, cfg.rope_original_max_len, cfg.rope_scaling)


def attention_masks(cfg: GPTConfig, causal_mask, segment_ids=None):
  """`causal_mask(window)` → the mask(s) the blocks take: one for a model whose layers attend alike, or (global,
  local) under sliding_window_pattern, of which each layer picks its own (layer_mask). Under the splash kernel
  (training and scoring: `segment_ids` (B, T) given), or under ring attention with the length split, the document
  ids themselves: the kernel builds no mask."""
  if segment_ids is not None and (cfg.attention_kernel() == "splash" or ring.ring_axis(cfg, segment_ids.shape[1])):
    return segment_ids
  if cfg.layer_is_local(0) is None:
    return causal_mask(cfg.sliding_window)
  return causal_mask(0), causal_mask(cfg.sliding_window)


def layer_mask(cfg: GPTConfig, mask, layer):
  """(the mask layer `layer` attends with, whether it is local or None) from attention_masks' output."""
  if not isinstance(mask, tuple):
    return mask, None
  if layer is None:  # initialisation: shapes only
    return mask[0], None
  local = cfg.layer_is_local(layer)
  return jnp.where(local, mask[1], mask[0]), local


class Block(nn.Module):
  """Pre-norm decoder block: x + attn(norm(x)); x + mlp(norm(x)), the MLP dense or (`moe`) a mixture of experts;
  with post_norms (Gemma) each sublayer's output is normed too before it is added."""
  config: GPTConfig
  moe: bool = False

  @nn.compact
  def __call__(self, x, mask, positions=None, cache=None, cache_index=None, layer=None):
    """Returns (x, new cache or None, the MoE layer's (per-token stats, load) or None). `mask`: attention_masks'
    output; `layer`: the layer's index in the model (an int or a traced scalar; None at initialisation)."""
    cfg = self.config
    norm = functools.partial(layers.norm_layer(cfg.norm), dtype=cfg.compute_dtype, epsilon=cfg.layer_norm_epsilon)
    post = (lambda name: norm(name=name)) if cfg.post_norms else (lambda name: lambda y: y)
    dense = functools.partial(layers.DenseGeneral, dtype=cfg.compute_dtype, use_bias=cfg.use_bias)
    act_names = (ax.BATCH, ax.LENGTH, ax.ACT_EMBED)
    x = layers.constrain(x, act_names)
    mask, local = layer_mask(cfg, mask, layer)
    attn, new_cache = Attention(cfg, name="attn")(norm(name="ln_1")(x), mask, positions, cache, cache_index, local)
    x = x + checkpoint_name(post("ln_post_attn")(attn), "attention_out")
    h = norm(name="ln_2")(x)
    if self.moe:  # a token no query row of the mask admits is padding: not routed
      valid = mask != 0 if splash.is_segments(mask) else jnp.any(mask, axis=(1, 3))
      out, stats = moe.MoeMlp(cfg, name="moe")(h, valid, dropless=cache is not None)
      return layers.constrain(x + post("ln_post_mlp")(out), act_names), new_cache, stats
    mlp_in = functools.partial(dense, (cfg.d_model,), (cfg.d_ff,), (ax.EMBED, ax.MLP), (ax.MLP,))
    hidden = layers.mlp_hidden(cfg.mlp_activation, lambda name: mlp_in(name=name)(h))
    hidden = layers.constrain(hidden, (ax.BATCH, ax.LENGTH, ax.ACT_MLP))  # (B, T, F)
    out = dense((cfg.d_ff,), (cfg.d_model,), (ax.MLP, ax.EMBED), (ax.NORM,), name="mlp_out")(hidden)
    return layers.constrain(x + post("ln_post_mlp")(out), act_names), new_cache, None


class BlockGroup(nn.Module):
  """moe_every consecutive layers, `layer_0` .. `layer_{N-2}` dense and `layer_{N-1}` MoE: the element the layer
  scan stacks when only every N-th layer is MoE, so the scan (and pipeline stages) still repeat one structure."""
  config: GPTConfig

  @nn.compact
  def __call__(self, x, mask, positions=None, cache=None, cache_index=None, unit=None):
    """Like Block; `cache` holds (k, v) with a leading (moe_every,) layer axis; `unit`: this group's index."""
    n = self.config.moe_every
    keys, values, stats = [], [], None
    for j in range(n):
      layer_cache = None if cache is None else (cache[0][j], cache[1][j])
      x, new_cache, layer_stats = Block(self.config, moe=j == n - 1, name=f"layer_{j}")(
          x, mask, positions, layer_cache, cache_index, None if unit is None else unit * n + j)
      stats = layer_stats if layer_stats is not None else stats
      if new_cache is not None:
        keys.append(new_cache[0])
        values.append(new_cache[1])
    return x, ((jnp.stack(keys), jnp.stack(values)) if cache is not None else None), stats


def unit_module(config: GPTConfig) -> nn.Module:
  """The unbound module of one element of the stacked layers: a Block, or a BlockGroup of moe_every layers."""
  if config.layers_per_unit > 1:
    return BlockGroup(config, parent=None)
  return Block(config, moe=bool(config.num_experts), parent=None)


def remat_policy(name: str):
  """Maps a REMAT_POLICIES name to a jax.checkpoint policy (None = no remat)."""
  cp = jax.checkpoint_policies
  return {
      "none": None,
      "full": cp.nothing_saveable,  # keep only each block's input (the scan carry)
      "save_dots": cp.dots_with_no_batch_dims_saveable,
      "save_attention_out": cp.save_only_these_names("attention_out"),
      "offload_dots": cp.offload_dot_with_no_batch_dims("device", "pinned_host"),
  }[name]


def unit_fn(config: GPTConfig):
  """A pure function (unit_params, x, mask, positions, rng=None, unit=None) → (x, MoE (token stats, load) or None)
  applying one stacked element (unit_module), rematerialised per the config; `rng` (optional) is the element's
  DROPOUT_RNG stream (e.g. LoRA dropout, posttrain/lora.py); `unit` the element's index in the stack (it fixes a
  layer's kind under sliding_window_pattern)."""
  module = unit_module(config)

  def apply(params, x, mask, positions, rng=None, unit=None):
    rngs = None if rng is None else {DROPOUT_RNG: rng}
    out, _, stats = module.apply({"params": params}, x, mask, positions, None, None, unit, rngs=rngs)
    return out, stats

  if config.remat_policy == "none":
    return apply
  return jax.checkpoint(apply, policy=remat_policy(config.remat_policy), prevent_cse=False)


def block_fn(config: GPTConfig):
  """A pure function (block_params, x, mask, positions) → x applying one stacked element (see unit_fn)."""
  fn = unit_fn(config)
  return lambda params, x, mask, positions: fn(params, x, mask, positions)[0]


def run_blocks(config: GPTConfig, stacked_params, x, mask, positions, token_stats=None, rng=None, first_unit=0):
  """Runs the stacked blocks (leading LAYERS axis) in order with lax.scan (unrolled per GPTConfig.layer_unroll).
  x: (B, T, D); mask: attention_masks' output; positions (B, T); first_unit: the stack index of the first element
  (a pipeline stage's chunk starts past 0; an int or a traced scalar).

  Returns (x, None) for a dense model; with experts (x, moe.MoeStats): per-token statistics summed over the
  layers (added to `token_stats` when given, as a pipeline stage continues its predecessor's) and the expert
  load of each MoE layer. `rng` (optional) is split into one DROPOUT_RNG key per stacked element.
  """
  fn = unit_fn(config)
  count = jax.tree.leaves(stacked_params)[0].shape[0]
  keys = None if rng is None else jax.random.split(rng, count)
  units = first_unit + jnp.arange(count)
  if not config.num_experts:
    return jax.lax.scan(lambda h, xs: (fn(xs[0], h, mask, positions, xs[1], xs[2])[0], None), x,
                        (stacked_params, keys, units), unroll=config.layer_unroll)[0], None
  if token_stats is None:
    token_stats = jnp.zeros(x.shape[:2] + (len(moe.TOKEN_STATS),), jnp.float32)

  def body(carry, xs):
    h, acc = carry
    h, (token, load) = fn(xs[0], h, mask, positions, xs[1], xs[2])
    return (h, acc + token), load

  (x, token_stats), loads = jax.lax.scan(body, (x, token_stats), (stacked_params, keys, units),
                                         unroll=config.layer_unroll)
  return x, moe.MoeStats(token=token_stats, load=loads)


def scan_blocks(config: GPTConfig, stacked_params, x, mask, positions):
  """run_blocks without the MoE statistics: (B, T, D) → (B, T, D)."""
  return run_blocks(config, stacked_params, x, mask, positions)[0]


def init_stacked_blocks(config: GPTConfig, rng, num_layers: int):
  """Initialises `num_layers` layers as num_layers / layers_per_unit stacked elements (unit_module) on a leading
  LAYERS axis, boxed with logical names."""
  unit = unit_module(config)
  dummy = jnp.zeros((1, 1, config.d_model), config.compute_dtype)
  dummy_mask = jnp.ones((1, 1, 1, 1), jnp.bool_)
  dummy_positions = jnp.zeros((1, 1), jnp.int32)
  # lax.map (a scan), not vmap: the blocks' activation constraints need an unbatched trace.
  stacked = jax.lax.map(lambda r: unit.init(r, dummy, dummy_mask, dummy_positions)["params"],
                        jax.random.split(rng, num_layers // config.layers_per_unit))
  return jax.tree.map(lambda b: b.replace(names=(ax.LAYERS,) + tuple(b.names)), stacked,
                      is_leaf=lambda b: isinstance(b, nn.LogicallyPartitioned))
