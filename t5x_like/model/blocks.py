"""One pre-LN decoder block (attention + dense or MoE MLP) and the stacked layer scan with its remat policies."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from t5x_like.model import layers
from t5x_like.model import moe
from t5x_like.model.config import GPTConfig
from t5x_like.parallel import axis_names as ax

DROPOUT_RNG = "dropout"  # the rng stream a caller gives `apply` for dropout inside the blocks (e.g. LoRA's)


class Attention(nn.Module):
  """Causal self-attention, multi-head or grouped-query, with optional rotary positions and KV cache."""
  config: GPTConfig

  @nn.compact
  def __call__(self, x, mask, positions=None, cache=None, cache_index=None):
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
    if cfg.qk_norm:  # per head, over head_dim, before the rotation (Qwen3)
      head_norm = functools.partial(layers.RMSNorm, dtype=cfg.compute_dtype, epsilon=cfg.layer_norm_epsilon,
                                    axis=ax.KV)
      q, k = head_norm(name="query_norm")(q), head_norm(name="key_norm")(k)
    if cfg.position_embedding == "rope":
      inv_freq = rope_inverse_frequencies(cfg)
      q, k = layers.apply_rope(q, positions, inv_freq), layers.apply_rope(k, positions, inv_freq)
    # Every query reads the whole sequence's keys/values: with `length` split (context parallelism) an all-gather.
    k = layers.constrain(k, (ax.BATCH, ax.KV_LENGTH, ax.ACT_KV_HEADS, ax.KV))
    v = layers.constrain(v, (ax.BATCH, ax.KV_LENGTH, ax.ACT_KV_HEADS, ax.KV))
    new_cache = None
    if cache is not None:  # decoding: write this chunk's keys/values at cache_index, attend to all
      k = jax.lax.dynamic_update_slice_in_dim(cache[0], k.astype(cache[0].dtype), cache_index, axis=1)
      v = jax.lax.dynamic_update_slice_in_dim(cache[1], v.astype(cache[1].dtype), cache_index, axis=1)
      new_cache = (k, v)
    if cfg.attention_impl == "reference" and cache is None:  # training and scoring: the mask is causal
      out = layers.causal_attention(q, k.astype(q.dtype), v.astype(q.dtype), mask, window=cfg.sliding_window)
    elif cfg.attention_impl == "reference":
      out = layers.reference_attention(q, k.astype(q.dtype), v.astype(q.dtype), mask)
    else:
      out = jax.nn.dot_product_attention(q, k.astype(q.dtype), v.astype(q.dtype), mask=mask,
                                         implementation=None if cfg.attention_impl == "xla" else "cudnn")
    out = layers.constrain(out, (ax.BATCH, ax.LENGTH, ax.ACT_HEADS, ax.KV))
    out = dense((h, dh), (d,), (ax.HEADS, ax.KV, ax.EMBED), (ax.NORM,), name="out")(out)
    return out, new_cache


def rope_inverse_frequencies(cfg: GPTConfig):
  return layers.rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_factor, cfg.rope_low_freq_factor,
                                 cfg.rope_high_freq_factor, cfg.rope_original_max_len)


class Block(nn.Module):
  """Pre-norm decoder block: x + attn(norm(x)); x + mlp(norm(x)), the MLP dense or (`moe`) a mixture of experts."""
  config: GPTConfig
  moe: bool = False

  @nn.compact
  def __call__(self, x, mask, positions=None, cache=None, cache_index=None):
    """Returns (x, new cache or None, the MoE layer's (per-token stats, load) or None)."""
    cfg = self.config
    norm = functools.partial(layers.norm_layer(cfg.norm), dtype=cfg.compute_dtype, epsilon=cfg.layer_norm_epsilon)
    dense = functools.partial(layers.DenseGeneral, dtype=cfg.compute_dtype, use_bias=cfg.use_bias)
    act_names = (ax.BATCH, ax.LENGTH, ax.ACT_EMBED)
    x = layers.constrain(x, act_names)
    attn, new_cache = Attention(cfg, name="attn")(norm(name="ln_1")(x), mask, positions, cache, cache_index)
    x = x + checkpoint_name(attn, "attention_out")
    h = norm(name="ln_2")(x)
    if self.moe:  # a token no query row of the mask admits is padding: not routed
      out, stats = moe.MoeMlp(cfg, name="moe")(h, jnp.any(mask, axis=(1, 3)), dropless=cache is not None)
      return layers.constrain(x + out, act_names), new_cache, stats
    mlp_in = functools.partial(dense, (cfg.d_model,), (cfg.d_ff,), (ax.EMBED, ax.MLP), (ax.MLP,))
    if cfg.mlp_activation == "swiglu":
      hidden = nn.silu(mlp_in(name="mlp_gate")(h)) * mlp_in(name="mlp_in")(h)
    else:
      hidden = nn.gelu(mlp_in(name="mlp_in")(h))
    hidden = layers.constrain(hidden, (ax.BATCH, ax.LENGTH, ax.ACT_MLP))  # (B, T, F)
    x = x + dense((cfg.d_ff,), (cfg.d_model,), (ax.MLP, ax.EMBED), (ax.NORM,), name="mlp_out")(hidden)
    return layers.constrain(x, act_names), new_cache, None


class BlockGroup(nn.Module):
  """moe_every consecutive layers, `layer_0` .. `layer_{N-2}` dense and `layer_{N-1}` MoE: the element the layer
  scan stacks when only every N-th layer is MoE, so the scan (and pipeline stages) still repeat one structure."""
  config: GPTConfig

  @nn.compact
  def __call__(self, x, mask, positions=None, cache=None, cache_index=None):
    """Like Block; `cache` holds (k, v) with a leading (moe_every,) layer axis."""
    n = self.config.moe_every
    keys, values, stats = [], [], None
    for j in range(n):
      layer_cache = None if cache is None else (cache[0][j], cache[1][j])
      x, new_cache, layer_stats = Block(self.config, moe=j == n - 1, name=f"layer_{j}")(
          x, mask, positions, layer_cache, cache_index)
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
  """A pure function (unit_params, x, mask, positions, rng=None) → (x, MoE (token stats, load) or None) applying one
  stacked element (unit_module), rematerialised per the config; `rng` (optional) is the element's DROPOUT_RNG
  stream (e.g. LoRA dropout, posttrain/lora.py)."""
  unit = unit_module(config)

  def apply(params, x, mask, positions, rng=None):
    rngs = None if rng is None else {DROPOUT_RNG: rng}
    out, _, stats = unit.apply({"params": params}, x, mask, positions, rngs=rngs)
    return out, stats

  if config.remat_policy == "none":
    return apply
  return jax.checkpoint(apply, policy=remat_policy(config.remat_policy), prevent_cse=False)


def block_fn(config: GPTConfig):
  """A pure function (block_params, x, mask, positions) → x applying one stacked element (see unit_fn)."""
  fn = unit_fn(config)
  return lambda params, x, mask, positions: fn(params, x, mask, positions)[0]


def run_blocks(config: GPTConfig, stacked_params, x, mask, positions, token_stats=None, rng=None):
  """Runs the stacked blocks (leading LAYERS axis) in order with lax.scan (unrolled per GPTConfig.layer_unroll).
  x: (B, T, D); positions (B, T).

  Returns (x, None) for a dense model; with experts (x, moe.MoeStats): per-token statistics summed over the
  layers (added to `token_stats` when given, as a pipeline stage continues its predecessor's) and the expert
  load of each MoE layer. `rng` (optional) is split into one DROPOUT_RNG key per stacked element.
  """
  fn = unit_fn(config)
  keys = None if rng is None else jax.random.split(rng, jax.tree.leaves(stacked_params)[0].shape[0])
  if not config.num_experts:
    return jax.lax.scan(lambda h, xs: (fn(xs[0], h, mask, positions, xs[1])[0], None), x,
                        (stacked_params, keys), unroll=config.layer_unroll)[0], None
  if token_stats is None:
    token_stats = jnp.zeros(x.shape[:2] + (len(moe.TOKEN_STATS),), jnp.float32)

  def body(carry, xs):
    h, acc = carry
    h, (token, load) = fn(xs[0], h, mask, positions, xs[1])
    return (h, acc + token), load

  (x, token_stats), loads = jax.lax.scan(body, (x, token_stats), (stacked_params, keys), unroll=config.layer_unroll)
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
