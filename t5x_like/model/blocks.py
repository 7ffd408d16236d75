"""One pre-LN decoder block (attention + MLP) and the stacked layer scan with its remat policies."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from t5x_like.model import layers
from t5x_like.model.config import GPTConfig
from t5x_like.parallel import axis_names as ax


class Attention(nn.Module):
  """Causal self-attention, multi-head or grouped-query, with optional rotary positions and KV cache."""
  config: GPTConfig

  @nn.compact
  def __call__(self, x, mask, positions=None, cache=None, cache_index=None):
    cfg = self.config
    d, h, kvh, dh = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.head_dim
    dense = functools.partial(layers.DenseGeneral, dtype=cfg.compute_dtype, use_bias=cfg.use_bias)
    if cfg.fused_qkv:
      qkv = dense((d,), (3, h, dh), (ax.EMBED, None, ax.HEADS, ax.KV), (None, ax.HEADS, ax.KV), name="qkv")(x)
      qkv = layers.constrain(qkv, (ax.BATCH, ax.LENGTH, None, ax.ACT_HEADS, ax.KV))  # (B, T, 3, H, Dh)
      q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    else:
      q = dense((d,), (h, dh), (ax.EMBED, ax.HEADS, ax.KV), (ax.HEADS, ax.KV), name="query")(x)
      kv = dense((d,), (2, kvh, dh), (ax.EMBED, None, ax.KV_HEADS, ax.KV), (None, ax.KV_HEADS, ax.KV),
                 name="key_value")(x)
      kv = layers.constrain(kv, (ax.BATCH, ax.LENGTH, None, ax.ACT_KV_HEADS, ax.KV))  # (B, T, 2, K, Dh)
      k, v = kv[:, :, 0], kv[:, :, 1]
    q = layers.constrain(q, (ax.BATCH, ax.LENGTH, ax.ACT_HEADS, ax.KV))
    if cfg.position_embedding == "rope":
      inv_freq = rope_inverse_frequencies(cfg)
      q, k = layers.apply_rope(q, positions, inv_freq), layers.apply_rope(k, positions, inv_freq)
    new_cache = None
    if cache is not None:  # decoding: write this chunk's keys/values at cache_index, attend to all
      k = jax.lax.dynamic_update_slice_in_dim(cache[0], k.astype(cache[0].dtype), cache_index, axis=1)
      v = jax.lax.dynamic_update_slice_in_dim(cache[1], v.astype(cache[1].dtype), cache_index, axis=1)
      new_cache = (k, v)
    if cfg.attention_impl == "reference":
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
  """Pre-norm decoder block: x + attn(norm(x)); x + mlp(norm(x))."""
  config: GPTConfig

  @nn.compact
  def __call__(self, x, mask, positions=None, cache=None, cache_index=None):
    cfg = self.config
    norm = functools.partial(layers.norm_layer(cfg.norm), dtype=cfg.compute_dtype, epsilon=cfg.layer_norm_epsilon)
    dense = functools.partial(layers.DenseGeneral, dtype=cfg.compute_dtype, use_bias=cfg.use_bias)
    act_names = (ax.BATCH, ax.LENGTH, ax.ACT_EMBED)
    x = layers.constrain(x, act_names)
    attn, new_cache = Attention(cfg, name="attn")(norm(name="ln_1")(x), mask, positions, cache, cache_index)
    x = x + checkpoint_name(attn, "attention_out")
    h = norm(name="ln_2")(x)
    mlp_in = functools.partial(dense, (cfg.d_model,), (cfg.d_ff,), (ax.EMBED, ax.MLP), (ax.MLP,))
    if cfg.mlp_activation == "swiglu":
      hidden = nn.silu(mlp_in(name="mlp_gate")(h)) * mlp_in(name="mlp_in")(h)
    else:
      hidden = nn.gelu(mlp_in(name="mlp_in")(h))
    hidden = layers.constrain(hidden, (ax.BATCH, ax.LENGTH, ax.ACT_MLP))  # (B, T, F)
    x = x + dense((cfg.d_ff,), (cfg.d_model,), (ax.MLP, ax.EMBED), (ax.NORM,), name="mlp_out")(hidden)
    return layers.constrain(x, act_names), new_cache


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


def block_fn(config: GPTConfig):
  """A pure function (block_params, x, mask, positions) → x applying one Block, rematerialised per the config."""
  block = Block(config, parent=None)

  def apply(params, x, mask, positions):
    return block.apply({"params": params}, x, mask, positions)[0]

  policy = remat_policy(config.remat_policy)
  if config.remat_policy == "none":
    return apply
  return jax.checkpoint(apply, policy=policy, prevent_cse=False)


def scan_blocks(config: GPTConfig, stacked_params, x, mask, positions):
  """Runs the stacked blocks (leading LAYERS axis) in order with lax.scan. x: (B, T, D); positions (B, T)."""
  fn = block_fn(config)

  def body(carry, params):
    return fn(params, carry, mask, positions), None

  return jax.lax.scan(body, x, stacked_params)[0]


def init_stacked_blocks(config: GPTConfig, rng, num_layers: int):
  """Initialises `num_layers` blocks stacked on a leading LAYERS axis, boxed with logical names."""
  block = Block(config, parent=None)
  dummy = jnp.zeros((1, 1, config.d_model), config.compute_dtype)
  dummy_mask = jnp.ones((1, 1, 1, 1), jnp.bool_)
  dummy_positions = jnp.zeros((1, 1), jnp.int32)
  # lax.map (a scan), not vmap: the blocks' activation constraints need an unbatched trace.
  stacked = jax.lax.map(lambda r: block.init(r, dummy, dummy_mask, dummy_positions)["params"],
                        jax.random.split(rng, num_layers))
  return jax.tree.map(lambda b: b.replace(names=(ax.LAYERS,) + tuple(b.names)), stacked,
                      is_leaf=lambda b: isinstance(b, nn.LogicallyPartitioned))
