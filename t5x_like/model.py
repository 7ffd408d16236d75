"""GPT decoder: config dataclass, one block, and the stacked model (remat and dtype policies)."""

import dataclasses
import functools
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from t5x_like import axis_names as ax
from t5x_like import layers

REMAT_POLICIES = ("none", "full", "save_dots", "save_attention_out", "offload_dots")
ATTENTION_IMPLS = ("reference", "xla", "cudnn")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  """Everything that fixes the model's function and its execution policy."""
  vocab_size: int = 0  # embedding rows; 0 = take the dataset's vocabulary (rounded up to 128)
  max_len: int = 1024  # rows of the learned position table: the longest sequence the model reads
  num_layers: int = 12  # decoder blocks
  num_heads: int = 12  # attention heads per block
  d_model: int = 768  # residual-stream width
  d_ff: int = 3072  # feed-forward hidden width
  tie_embeddings: bool = True  # output projection = token embedding transposed
  layer_norm_epsilon: float = 1e-5  # LayerNorm epsilon
  dtype: str = "bfloat16"  # activation/matmul dtype: float32 | bfloat16 | float16 (params stay float32)
  remat_policy: str = "none"  # per-block rematerialisation: one of REMAT_POLICIES
  attention_impl: str = "reference"  # reference (einsum) | xla / cudnn (jax.nn.dot_product_attention)
  num_stages: int = 1  # pipeline stages the layer stack is split into (set from the mesh)
  pipeline_microbatches: int = 0  # microbatches streamed through the pipeline; 0 = 2 × num_stages

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads

  @property
  def compute_dtype(self):
    return DTYPES[self.dtype]

  def validate(self) -> None:
    """Raises ValueError naming the offending field."""
    if self.d_model % self.num_heads:
      raise ValueError(f"GPTConfig.d_model={self.d_model} is not divisible by num_heads={self.num_heads}")
    if self.remat_policy not in REMAT_POLICIES:
      raise ValueError(f"GPTConfig.remat_policy={self.remat_policy!r}: expected one of {REMAT_POLICIES}")
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ValueError(f"GPTConfig.attention_impl={self.attention_impl!r}: expected one of {ATTENTION_IMPLS}")
    if self.attention_impl == "cudnn" and jax.default_backend() != "gpu":
      raise ValueError(f"GPTConfig.attention_impl='cudnn' needs an NVIDIA GPU (backend is "
                       f"{jax.default_backend()}); use 'xla' (same jax.nn.dot_product_attention, XLA kernels)")
    if self.dtype not in DTYPES:
      raise ValueError(f"GPTConfig.dtype={self.dtype!r}: expected one of {tuple(DTYPES)}")
    if self.remat_policy == "offload_dots" and not _has_host_offload():
      raise ValueError(f"GPTConfig.remat_policy='offload_dots' needs a 'pinned_host' memory space, which the "
                       f"{jax.default_backend()} backend does not have; use 'save_dots' or 'full'")
    if self.num_layers % self.num_stages:
      raise ValueError(f"GPTConfig.num_layers={self.num_layers} is not divisible by "
                       f"{self.num_stages} pipeline stages")


def _has_host_offload() -> bool:
  """Whether the default backend can offload saved activations to host memory ('pinned_host')."""
  return "pinned_host" in {memory.kind for memory in jax.devices()[0].addressable_memories()}


class Attention(nn.Module):
  """Causal multi-head self-attention; optional KV cache for decoding."""
  config: GPTConfig

  @nn.compact
  def __call__(self, x, mask, cache=None, cache_index=None):
    cfg = self.config
    d, h, dh = cfg.d_model, cfg.num_heads, cfg.head_dim
    dense = functools.partial(layers.DenseGeneral, dtype=cfg.compute_dtype)
    qkv = dense((d,), (3, h, dh), (ax.EMBED, None, ax.HEADS, ax.KV), (None, ax.HEADS, ax.KV), name="qkv")(x)
    qkv = layers.constrain(qkv, (ax.BATCH, ax.LENGTH, None, ax.ACT_HEADS, ax.KV))  # (B, T, 3, H, Dh)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    new_cache = None
    if cache is not None:  # decoding: write this chunk's keys/values at cache_index, attend to all
      k = jax.lax.dynamic_update_slice_in_dim(cache[0], k.astype(cache[0].dtype), cache_index, axis=1)
      v = jax.lax.dynamic_update_slice_in_dim(cache[1], v.astype(cache[1].dtype), cache_index, axis=1)
      new_cache = (k, v)
    if cfg.attention_impl == "reference":
      out = layers.reference_attention(q, k, v, mask)
    else:
      out = jax.nn.dot_product_attention(q, k.astype(q.dtype), v.astype(q.dtype), mask=mask,
                                         implementation=None if cfg.attention_impl == "xla" else "cudnn")
    out = layers.constrain(out, (ax.BATCH, ax.LENGTH, ax.ACT_HEADS, ax.KV))
    out = dense((h, dh), (d,), (ax.HEADS, ax.KV, ax.EMBED), (ax.NORM,), name="out")(out)
    return out, new_cache


class Block(nn.Module):
  """Pre-LayerNorm decoder block: x + attn(ln(x)); x + mlp(ln(x))."""
  config: GPTConfig

  @nn.compact
  def __call__(self, x, mask, cache=None, cache_index=None):
    cfg = self.config
    norm = functools.partial(layers.LayerNorm, dtype=cfg.compute_dtype, epsilon=cfg.layer_norm_epsilon)
    dense = functools.partial(layers.DenseGeneral, dtype=cfg.compute_dtype)
    act_names = (ax.BATCH, ax.LENGTH, ax.ACT_EMBED)
    x = layers.constrain(x, act_names)
    attn, new_cache = Attention(cfg, name="attn")(norm(name="ln_1")(x), mask, cache, cache_index)
    x = x + checkpoint_name(attn, "attention_out")
    hidden = dense((cfg.d_model,), (cfg.d_ff,), (ax.EMBED, ax.MLP), (ax.MLP,), name="mlp_in")(norm(name="ln_2")(x))
    hidden = layers.constrain(nn.gelu(hidden), (ax.BATCH, ax.LENGTH, ax.ACT_MLP))  # (B, T, F)
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
  """A pure function (block_params, x, mask) → x applying one Block, rematerialised per the config."""
  block = Block(config, parent=None)

  def apply(params, x, mask):
    return block.apply({"params": params}, x, mask)[0]

  policy = remat_policy(config.remat_policy)
  if config.remat_policy == "none":
    return apply
  return jax.checkpoint(apply, policy=policy, prevent_cse=False)


def scan_blocks(config: GPTConfig, stacked_params, x, mask):
  """Runs the stacked blocks (leading LAYERS axis) in order with lax.scan. x: (B, T, D)."""
  fn = block_fn(config)

  def body(carry, params):
    return fn(params, carry, mask), None

  return jax.lax.scan(body, x, stacked_params)[0]


def init_stacked_blocks(config: GPTConfig, rng, num_layers: int):
  """Initialises `num_layers` blocks stacked on a leading LAYERS axis, boxed with logical names."""
  block = Block(config, parent=None)
  dummy = jnp.zeros((1, 1, config.d_model), config.compute_dtype)
  dummy_mask = jnp.ones((1, 1, 1, 1), jnp.bool_)
  # lax.map (a scan), not vmap: the blocks' activation constraints need an unbatched trace.
  stacked = jax.lax.map(lambda r: block.init(r, dummy, dummy_mask)["params"], jax.random.split(rng, num_layers))
  return jax.tree.map(lambda b: b.replace(names=(ax.LAYERS,) + tuple(b.names)), stacked,
                      is_leaf=lambda b: isinstance(b, nn.LogicallyPartitioned))


class GPT(nn.Module):
  """Token + learned position embeddings → stacked blocks → LayerNorm → float32 logits."""
  config: GPTConfig

  @nn.compact
  def __call__(self, tokens, positions=None, segment_ids=None, cache=None, cache_index=None,
               return_hidden: bool = False):
    """Forward pass.

    Args:
      tokens: (B, T) int token ids.
      positions: (B, T) position of each token in its document; default arange(T).
      segment_ids: (B, T) document ids, 0 = padding; default all ones.
      cache: decoding only: `init_cache(...)`, the keys/values of earlier chunks.
      cache_index: decoding only: the cache slot of this chunk's first token (scalar int).
      return_hidden: return the final LayerNorm's output (B, T, D) instead of logits, for a loss that
        projects it chunk by chunk (`project_logits`).

    Returns:
      (B, T, V) float32 logits, and the updated cache when `cache` was given.
    """
    cfg = self.config
    b, t = tokens.shape
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
    if segment_ids is None:
      segment_ids = jnp.ones((b, t), jnp.int32)
    embedding = self.param("token_embedding", nn.with_logical_partitioning(layers._INIT, (ax.VOCAB, ax.EMBED)),
                           (cfg.vocab_size, cfg.d_model), jnp.float32)
    pos_table = self.param("position_embedding",
                           nn.with_logical_partitioning(layers._INIT, (ax.POSITION, ax.EMBED)),
                           (cfg.max_len, cfg.d_model), jnp.float32)
    blocks = self.param("blocks", lambda r: init_stacked_blocks(cfg, r, cfg.num_layers))
    x = (layers.lookup(embedding, tokens, ax.VOCAB) + layers.lookup(pos_table, positions, ax.POSITION)
         ).astype(cfg.compute_dtype)
    x = layers.constrain(x, (ax.BATCH, ax.LENGTH, ax.ACT_EMBED))  # (B, T, D)
    new_cache = None
    if cache is not None:
      x, new_cache = self._decode_blocks(blocks, x, segment_ids, cache, cache_index)
    elif cfg.num_stages > 1 and not self.is_initializing():  # init only needs shapes: run sequentially
      from t5x_like import pipeline  # pylint: disable=g-import-not-at-top
      x = pipeline.pipeline_blocks(cfg, blocks, x, segment_ids)
    else:
      x = scan_blocks(cfg, blocks, x, layers.causal_segment_mask(segment_ids))
    x = layers.LayerNorm(dtype=cfg.compute_dtype, epsilon=cfg.layer_norm_epsilon, name="ln_f")(x)
    if return_hidden and not self.is_initializing():
      return x
    if cfg.tie_embeddings:
      logits = project_logits({"token_embedding": embedding}, x, cfg)
    else:
      logits = layers.DenseGeneral((cfg.d_model,), (cfg.vocab_size,), (ax.EMBED, ax.VOCAB), (ax.VOCAB,),
                                   dtype=cfg.compute_dtype, name="lm_head")(x).astype(jnp.float32)
    logits = layers.constrain(logits, (ax.BATCH, ax.LENGTH, ax.ACT_VOCAB))  # (B, T, V) float32
    return logits if cache is None else (logits, new_cache)

  def _decode_blocks(self, blocks, x, segment_ids, cache, cache_index):
    """Blocks over a KV cache: this chunk's keys/values are written at slots cache_index.., and each
    query attends to the filled, non-padding slots at or before its own."""
    block = Block(self.config, parent=None)
    seg = jax.lax.dynamic_update_slice_in_dim(cache["segment_ids"], segment_ids, cache_index, axis=1)
    query_slots = cache_index + jnp.arange(x.shape[1])  # (T,)
    key_slots = jnp.arange(seg.shape[1])  # (S,)
    mask = (key_slots[None, None, :] <= query_slots[None, :, None]) & (seg[:, None, :] != 0)  # (B, T, S)

    def body(h, layer):
      params, k_cache, v_cache = layer
      h, (k_new, v_new) = block.apply({"params": params}, h, mask[:, None], (k_cache, v_cache), cache_index)
      return h, (k_new, v_new)

    x, (k, v) = jax.lax.scan(body, x, (blocks, cache["k"], cache["v"]))
    return x, {"k": k, "v": v, "segment_ids": seg}


def project_logits(params, hidden: jax.Array, config: GPTConfig) -> jax.Array:
  """Final hidden states (B, T, D) → float32 logits (B, T, V) with the model's output projection
  (the tied token embedding, or the untied `lm_head`), vocabulary-sharded like the full model's."""
  dtype = config.compute_dtype
  if config.tie_embeddings:
    logits = jnp.einsum("btd,vd->btv", hidden.astype(dtype), params["token_embedding"].astype(dtype),
                        preferred_element_type=jnp.float32)
  else:
    head = params["lm_head"]
    logits = (jnp.einsum("btd,dv->btv", hidden.astype(dtype), head["kernel"].astype(dtype))
              + head["bias"].astype(dtype)).astype(jnp.float32)
  return layers.constrain(logits, (ax.BATCH, ax.LENGTH, ax.ACT_VOCAB))


def init_cache(config: GPTConfig, batch: int, length: int, dtype=None) -> dict:
  """Empty KV cache: k, v (LAYERS, B, length, H, Dh) and the slots' segment ids (B, length), 0 = empty."""
  shape = (config.num_layers, batch, length, config.num_heads, config.head_dim)
  dtype = dtype or config.compute_dtype
  return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype),
          "segment_ids": jnp.zeros((batch, length), jnp.int32)}


def count_params(config: GPTConfig) -> int:
  """Exact parameter count from an abstract init (no memory is allocated)."""
  shapes = jax.eval_shape(lambda: GPT(config).init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))
  return sum(int(x.size) for x in jax.tree.leaves(nn.meta.unbox(shapes)))
