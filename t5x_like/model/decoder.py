"""The decoder: embeddings → stacked blocks (scanned or pipelined) → final norm → float32 logits.

One model file for GPT-2 and Llama-family architectures: the config picks the norm, MLP, position
encoding, key/value heads, biases and output head (see GPTConfig)."""

import contextlib
import dataclasses
import functools
import math
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from t5x_like.model import cpu_kernels as kernels
from t5x_like.model import layers
from t5x_like.model import pipeline_parallel
from t5x_like.model import moe
from t5x_like.model.blocks import DROPOUT_RNG, attention_masks, init_stacked_blocks, run_blocks, unit_module
from t5x_like.model.config import GPTConfig  # re-exported: decoder.GPTConfig is the config most callers name
from t5x_like.parallel import axis_names as ax


MOE_STATS = "moe_stats"  # the "intermediates" entry holding the MoE layers' moe.MoeStats (a 1-tuple, as sown)


class GPT(nn.Module):
  """Token (+ learned position) embeddings → stacked blocks → final norm → float32 logits."""
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
    x = layers.lookup(embedding, tokens, ax.VOCAB)
    if cfg.position_embedding == "learned":
      pos_table = self.param("position_embedding",
                             nn.with_logical_partitioning(layers._INIT, (ax.POSITION, ax.EMBED)),
                             (cfg.max_len, cfg.d_model), jnp.float32)
      x = x + layers.lookup(pos_table, positions, ax.POSITION)
    if self.has_variable("params", "blocks"):  # read as given: it may carry extra leaves (LoRA adapters)
      blocks = nn.meta.unbox(self.get_variable("params", "blocks"))
    else:
      blocks = self.param("blocks", lambda r: init_stacked_blocks(cfg, r, cfg.num_layers))
    if cfg.scale_embeddings:  # √d in float32 (Gemma's normalizer, in the embedding table's dtype)
      x = x * jnp.float32(math.sqrt(cfg.d_model))
    x = layers.constrain(x.astype(cfg.compute_dtype), (ax.BATCH, ax.LENGTH, ax.ACT_EMBED))  # (B, T, D)
    new_cache = moe_stats = None
    if cache is not None:
      x, new_cache = self._decode_blocks(blocks, x, segment_ids, positions, cache, cache_index)
    elif cfg.num_stages > 1 and not self.is_initializing():  # init only needs shapes: run sequentially
      if self.has_rng(DROPOUT_RNG):
        raise ValueError(f"a '{DROPOUT_RNG}' rng with GPTConfig.num_stages={cfg.num_stages}: dropout runs on the "
                         "scanned layer stack only; use a mesh without 'pipeline' or no dropout")
      x, moe_stats = pipeline_parallel.run_pipeline_blocks(cfg, blocks, x, segment_ids, positions)
    else:
      rng = self.make_rng(DROPOUT_RNG) if self.has_rng(DROPOUT_RNG) else None
      mask = attention_masks(cfg, functools.partial(layers.causal_segment_mask, segment_ids), segment_ids)
      x, moe_stats = run_blocks(cfg, blocks, x, mask, positions, rng=rng)
    if moe_stats is not None and not self.is_initializing():  # kept when "intermediates" is mutable
      self.sow("intermediates", MOE_STATS, moe_stats)
    x = layers.norm_layer(cfg.norm)(dtype=cfg.compute_dtype, epsilon=cfg.layer_norm_epsilon, name="ln_f")(x)
    if not cfg.tie_embeddings:  # created here so init makes it; applied by project_logits
      layers.DenseGeneral((cfg.d_model,), (cfg.vocab_size,), (ax.EMBED, ax.VOCAB), (ax.VOCAB,),
                          dtype=cfg.compute_dtype, use_bias=cfg.use_bias, name="lm_head")(x[:, :1])
    if return_hidden and not self.is_initializing():
      return x
    logits = project_logits(nn.meta.unbox(self.variables["params"]), x, cfg)  # (B, T, V) float32
    return logits if cache is None else (logits, new_cache)

  def _decode_blocks(self, blocks, x, segment_ids, positions, cache, cache_index):
    """Blocks over a KV cache: this chunk's keys/values are written at slots cache_index.., and each
    query attends to the filled, non-padding slots at or before its own (with GPTConfig.sliding_window W, only
    the last W of them)."""
    unit, n = unit_module(self.config), self.config.layers_per_unit
    seg = jax.lax.dynamic_update_slice_in_dim(cache["segment_ids"], segment_ids, cache_index, axis=1)
    query_slots = cache_index + jnp.arange(x.shape[1])  # (T,)
    key_slots = jnp.arange(seg.shape[1])  # (S,)
    # a sequence's tokens fill consecutive slots, so the sliding window counts slots: (B, 1, T, S)
    causal = lambda window: (layers.window_mask(query_slots, key_slots, window)[None]
                             & (seg[:, None, :] != 0))[:, None]
    mask = attention_masks(self.config, causal)

    def body(h, layer):
      params, k_cache, v_cache, index = layer
      h, (k_new, v_new), _ = unit.apply({"params": params}, h, mask, positions, (k_cache, v_cache), cache_index,
                                        index)
      return h, (k_new, v_new)

    by_unit = lambda c: c.reshape((c.shape[0] // n, n) + c.shape[1:]) if n > 1 else c  # (L/N, N, ...) per unit
    x, (k, v) = jax.lax.scan(body, x, (blocks, by_unit(cache["k"]), by_unit(cache["v"]),
                                       jnp.arange(self.config.num_units)), unroll=self.config.layer_unroll)
    by_layer = lambda c: c.reshape((-1,) + c.shape[2:]) if n > 1 else c
    return x, {"k": by_layer(k), "v": by_layer(v), "segment_ids": seg}


def logits_projection(config: GPTConfig) -> Callable:
  """(params, hidden) → project_logits(params, hidden, config): the projection the chunked losses take."""
  return functools.partial(project_logits, config=config)


def project_logits(params, hidden: jax.Array, config: GPTConfig) -> jax.Array:
  """Final hidden states (B, T, D) → float32 logits (B, T, V) with the model's output projection
  (the tied token embedding, or the untied `lm_head`), vocabulary-sharded like the full model's, soft-capped
  with final_logit_softcap. Padding rows (≥ valid_vocab_size) get the float32 minimum, so the softmax never picks
  them."""
  dtype = config.compute_dtype
  if config.tie_embeddings:
    logits = kernels.contract_trailing(hidden.astype(dtype), params["token_embedding"].astype(dtype), 1, (1,),
                                      preferred_element_type=jnp.float32)
  else:
    head = params["lm_head"]
    logits = kernels.contract_trailing(hidden.astype(dtype), head["kernel"].astype(dtype), 1)
    if "bias" in head:
      logits = logits + head["bias"].astype(dtype)
    logits = logits.astype(jnp.float32)
  if config.final_logit_softcap:
    logits = config.final_logit_softcap * jnp.tanh(logits / config.final_logit_softcap)
  if config.valid_vocab_size and config.valid_vocab_size < config.vocab_size:
    valid = jnp.arange(config.vocab_size) < config.valid_vocab_size
    logits = jnp.where(valid, logits, jnp.finfo(jnp.float32).min)
  return layers.constrain(logits, (ax.BATCH, ax.LENGTH, ax.ACT_VOCAB))


def init_cache(config: GPTConfig, batch: int, length: int, dtype=None) -> dict:
  """Empty KV cache: k, v (LAYERS, B, length, K, Dh) for the K key/value heads, and the slots' segment ids
  (B, length), 0 = empty."""
  shape = (config.num_layers, batch, length, config.kv_heads, config.head_dim)
  dtype = dtype or config.compute_dtype
  return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype),
          "segment_ids": jnp.zeros((batch, length), jnp.int32)}


def moe_stats(state: dict):
  """The moe.MoeStats an `apply(..., mutable=["intermediates"])` returned in its state; None for a dense model."""
  sown = state.get("intermediates", {}).get(MOE_STATS)
  return moe.MoeStats(*sown[0]) if sown else None


def count_params(config: GPTConfig) -> int:
  """Exact parameter count from an abstract init (no memory is allocated; once per process for the fields that fix
  parameter shapes, and none at all after `abstract_params` of a config with the same shapes)."""
  key = shape_only(config)
  if key not in _PARAM_COUNTS:
    abstract_params(key)
  return _PARAM_COUNTS[key]


def shape_only(config: GPTConfig) -> GPTConfig:
  """The config with only the fields that fix parameter shapes kept (a cache key for abstract inits)."""
  return dataclasses.replace(config, remat_policy="none", scan_unroll=1, num_stages=1, pipeline_microbatches=0,
                             pipeline_repeats=1, attention_impl="reference", dtype="bfloat16")


_PARAM_COUNTS = {}  # shape_only(config) → its parameter count (the stage layout of a pipeline reshapes, not adds)


def abstract_params(config: GPTConfig, mesh=None, rules=None):
  """GPT(config)'s parameters as ShapeDtypeStructs boxed with their logical axis names (nothing allocated), traced
  on `mesh` under logical axis `rules` when given (a runtime's), once per (config, mesh, rules) and process: a
  run's runtime, its frozen models of the same config and its FLOPs count (`count_params`) share one trace."""
  boxed = _abstract_params_cached(config, mesh, None if rules is None else tuple(rules))
  return jax.tree.map(lambda x: x, boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))  # the caller's own dicts


@functools.lru_cache(maxsize=32)
def _abstract_params_cached(config: GPTConfig, mesh, rules):
  with contextlib.ExitStack() as stack:
    if mesh is not None:
      stack.enter_context(jax.set_mesh(mesh))
    if rules is not None:
      stack.enter_context(nn.logical_axis_rules(rules))
    boxed = jax.eval_shape(lambda: GPT(config).init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))["params"]
  _PARAM_COUNTS.setdefault(shape_only(config), sum(int(x.size) for x in jax.tree.leaves(boxed)))  # (boxes are nodes)
  return boxed
