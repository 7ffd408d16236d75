"""Hugging Face `config.json` ↔ GPTConfig for the GPT-2, Llama, Mixtral, Qwen2, Qwen3, Mistral, Gemma 2 and Gemma 3
(text) families, refusing what we cannot represent."""

import dataclasses
import math
from typing import Optional

from t5x_like.model.config import GPTConfig

GPT2, LLAMA, MIXTRAL = "GPT2LMHeadModel", "LlamaForCausalLM", "MixtralForCausalLM"
QWEN2, QWEN3, MISTRAL = "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"
GEMMA2, GEMMA3 = "Gemma2ForCausalLM", "Gemma3ForCausalLM"
SUPPORTED = {GPT2: "gpt2", LLAMA: "llama", MIXTRAL: "mixtral", QWEN2: "qwen2", QWEN3: "qwen3",
             MISTRAL: "mistral", GEMMA2: "gemma2", GEMMA3: "gemma3_text"}  # architecture → model_type
GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_new")  # both the tanh approximation our "geglu" gates with
VOCAB_MULTIPLE = 128  # imported vocabularies are padded to a multiple of this, so the vocab axis shards
GPT2_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")  # both the tanh approximation our "gelu" computes
ROPE_TYPES = ("default", "llama3")  # Llama's (Gemma 3's global layers: default or linear)
# Token ids carried from the imported config.json to the exported one (they live in no GPTConfig field).
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
# The GPTConfig fields a converted model.gin binds: everything that fixes the function, nothing that fixes
# the execution (dtype, remat, attention kernel, pipeline stages come from the run's own gin files).
MODEL_FIELDS = ("vocab_size", "valid_vocab_size", "max_len", "num_layers", "num_heads", "num_kv_heads",
                "attention_head_dim", "d_model", "d_ff", "tie_embeddings", "use_bias", "qkv_bias", "qk_norm",
                "sliding_window", "norm", "layer_norm_epsilon", "mlp_activation", "position_embedding", "rope_theta",
                "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_len",
                "rope_scaling", "post_norms", "scale_embeddings", "sliding_window_pattern", "rope_local_theta",
                "attention_scale_dim", "attention_softcap", "final_logit_softcap")
# ... and, for a mixture-of-experts model (num_experts > 0), these: the routing and the router's training losses.
MOE_FIELDS = ("num_experts", "moe_top_k", "moe_every", "moe_d_ff", "moe_dropless", "moe_load_balancing_weight",
              "moe_router_z_weight")


def padded_vocab(vocab_size: int) -> int:
  return int(math.ceil(vocab_size / VOCAB_MULTIPLE) * VOCAB_MULTIPLE)


def architecture(hf: dict, where: str) -> str:
  """The supported architecture `hf` (a parsed config.json) describes, or a ValueError naming it."""
  archs = hf.get("architectures") or []
  by_type = {t: a for a, t in SUPPORTED.items()}
  name = archs[0] if archs else by_type.get(hf.get("model_type"), hf.get("model_type"))
  if name not in SUPPORTED or len(archs) > 1:
    raise ValueError(f"{where}: architecture {archs or name!r} is not supported; supported: "
                     + ", ".join(f"{a} (model_type {t!r})" for a, t in SUPPORTED.items()))
  return name


def from_hf(hf: dict, where: str) -> tuple:
  """(architecture, GPTConfig) of a parsed config.json; the vocabulary is padded to VOCAB_MULTIPLE.

  Raises:
    ValueError: naming the config key of a feature t5x_like's decoder does not have.
  """
  arch = architecture(hf, where)
  if hf.get("quantization_config"):
    raise ValueError(f"{where}: quantization_config is set: quantized checkpoints are not supported")
  try:
    config = {GPT2: _from_gpt2, LLAMA: _from_llama, MIXTRAL: _from_mixtral, QWEN2: _from_qwen2, QWEN3: _from_qwen3,
              MISTRAL: _from_mistral, GEMMA2: _from_gemma, GEMMA3: _from_gemma}[arch](hf, where)
  except KeyError as e:
    raise ValueError(f"{where}: {arch} needs {e.args[0]!r}, which is missing") from None
  vocab = config.vocab_size
  return arch, dataclasses.replace(config, vocab_size=padded_vocab(vocab), valid_vocab_size=vocab)


def _require(hf: dict, key: str, default, allowed: tuple, where: str, why: str):
  value = hf.get(key, default)
  if value not in allowed:
    raise ValueError(f"{where}: {key}={value!r} is not supported ({why}); supported: {list(allowed)}")
  return value


def _from_gpt2(hf: dict, where: str) -> GPTConfig:
  _require(hf, "activation_function", "gelu_new", GPT2_ACTIVATIONS, where, "our GELU is the tanh approximation")
  _require(hf, "scale_attn_weights", True, (True,), where, "attention logits are always scaled by 1/sqrt(head_dim)")
  _require(hf, "scale_attn_by_inverse_layer_idx", False, (False,), where, "no per-layer attention scaling")
  _require(hf, "add_cross_attention", False, (False,), where, "a decoder-only model has no cross-attention")
  d_model = hf["n_embd"]
  return GPTConfig(vocab_size=hf["vocab_size"], max_len=hf["n_positions"], num_layers=hf["n_layer"],
                   num_heads=hf["n_head"], d_model=d_model, d_ff=hf.get("n_inner") or 4 * d_model,
                   tie_embeddings=hf.get("tie_word_embeddings", True),
                   layer_norm_epsilon=hf.get("layer_norm_epsilon", 1e-5))


def rope_settings(hf: dict, where: str, params: Optional[dict] = None, key: str = "", default_theta=10000.0,
                  allowed: tuple = ROPE_TYPES) -> dict:
  """rope_theta and scaling from transformers 5's `rope_parameters` or 4.x's `rope_theta` + `rope_scaling` (or from
  `params`, one layer kind's entry, named `key`)."""
  if params is None:
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    key = "rope_parameters" if "rope_parameters" in hf else "rope_scaling"
  theta = params.get("rope_theta", hf.get("rope_theta", default_theta))
  kind = params.get("rope_type", params.get("type", "default"))
  if kind not in allowed:
    raise ValueError(f"{where}: {key} rope_type={kind!r} is not supported; supported: {list(allowed)}")
  out = {"rope_theta": float(theta)}
  if kind == "linear":
    out.update(rope_scaling_factor=float(params["factor"]), rope_scaling="linear")
  if kind == "llama3":
    out.update(rope_scaling_factor=float(params["factor"]), rope_low_freq_factor=float(params["low_freq_factor"]),
               rope_high_freq_factor=float(params["high_freq_factor"]),
               rope_original_max_len=int(params["original_max_position_embeddings"]))
  return out


def _from_llama(hf: dict, where: str) -> GPTConfig:
  _require(hf, "hidden_act", "silu", ("silu",), where, "the SwiGLU MLP gates with SiLU")
  if hf.get("use_sliding_window"):
    raise ValueError(f"{where}: use_sliding_window={hf['use_sliding_window']!r} is not supported (attention is "
                     f"full causal)")
  window, max_len = hf.get("sliding_window"), hf.get("max_position_embeddings", 2048)
  if window and window < max_len:  # a window spanning every position is full causal attention
    raise ValueError(f"{where}: sliding_window={window!r} is not supported (attention is full causal; a window "
                     f"of at least max_position_embeddings={max_len} is)")
  attention_bias, mlp_bias = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
  if attention_bias != mlp_bias:
    raise ValueError(f"{where}: attention_bias={attention_bias} but mlp_bias={mlp_bias}: t5x_like has one "
                     f"use_bias for both")
  d_model, heads = hf["hidden_size"], hf["num_attention_heads"]
  head_dim = hf.get("head_dim") or d_model // heads
  if head_dim * heads != d_model and head_dim % 2:
    raise ValueError(f"{where}: head_dim={head_dim} is odd: rotary positions need an even head width")
  kv_heads = hf.get("num_key_value_heads") or heads
  return GPTConfig(vocab_size=hf["vocab_size"], max_len=max_len,
                   num_layers=hf["num_hidden_layers"], num_heads=heads, d_model=d_model,
                   d_ff=hf["intermediate_size"], tie_embeddings=hf.get("tie_word_embeddings", False),
                   layer_norm_epsilon=hf.get("rms_norm_eps", 1e-6), norm="rmsnorm", mlp_activation="swiglu",
                   position_embedding="rope", num_kv_heads=0 if kv_heads == heads else kv_heads,
                   attention_head_dim=0 if head_dim * heads == d_model else head_dim,
                   use_bias=attention_bias, **rope_settings(hf, where))


def _from_mixtral(hf: dict, where: str) -> GPTConfig:
  """Llama's attention, norms and positions; every layer's MLP is num_local_experts SwiGLU experts (no biases:
  Mixtral has no attention_bias / mlp_bias), each token routed dropless to its num_experts_per_tok most
  probable, as transformers computes it."""
  top_k = hf.get("num_experts_per_tok", 2)
  if top_k == 1:
    raise ValueError(f"{where}: num_experts_per_tok=1 is not supported (Mixtral renormalises the top-1 gate to 1, "
                     f"t5x_like's top-1 gate is the router probability)")
  dense = _from_llama({k: v for k, v in hf.items() if k not in ("attention_bias", "mlp_bias")}, where)
  # transformers' Mixtral loss is router_aux_loss_coef × E·Σ_e f_e·P_e with f_e summed over the k choices (k when
  # balanced); ours averages them (1 when balanced): the same gradient takes a weight k times the coefficient.
  return dataclasses.replace(dense, num_experts=hf["num_local_experts"], moe_top_k=top_k, moe_every=1,
                             moe_dropless=True, moe_router_z_weight=0.0,
                             moe_load_balancing_weight=hf.get("router_aux_loss_coef", 0.001) * top_k)


def _without(hf: dict, *keys) -> dict:
  return {k: v for k, v in hf.items() if k not in keys}


def _window(window, max_len: int) -> int:
  """GPTConfig.sliding_window of an HF window: 0 (full causal) for none or one spanning every position."""
  return window if window and window < max_len else 0


def _from_mistral(hf: dict, where: str) -> GPTConfig:
  """Llama without biases, each query reading only the last `sliding_window` keys (None = all)."""
  dense = _from_llama(_without(hf, "sliding_window"), where)
  return dataclasses.replace(dense, sliding_window=_window(hf.get("sliding_window"), dense.max_len))


def _qwen_window(hf: dict, where: str, max_len: int) -> int:
  """Qwen's window: with use_sliding_window, layers from max_window_layers on (or those `layer_types` names
  'sliding_attention') use it; t5x_like's one window is either every layer's or none's."""
  if not hf.get("use_sliding_window"):
    return 0
  layers, first = hf["num_hidden_layers"], hf.get("max_window_layers", 0)
  kinds = hf.get("layer_types") or ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
  if len(set(kinds)) > 1:
    key = "layer_types" if hf.get("layer_types") else f"max_window_layers={first}"
    raise ValueError(f"{where}: {key} mixes sliding-window and full-attention layers, which is not supported "
                     f"(one sliding_window for every layer)")
  return _window(hf.get("sliding_window"), max_len) if kinds[0] == "sliding_attention" else 0


def _from_qwen2(hf: dict, where: str) -> GPTConfig:
  """Llama with biases on the query, key and value projections only (no attention_bias / mlp_bias keys)."""
  dense = _from_llama(_without(hf, "use_sliding_window", "sliding_window", "attention_bias", "mlp_bias"), where)
  return dataclasses.replace(dense, use_bias=False, qkv_bias=True,
                             sliding_window=_qwen_window(hf, where, dense.max_len))


def _from_qwen3(hf: dict, where: str) -> GPTConfig:
  """Llama with RMSNorm over head_dim on queries and keys; attention_bias would bias q, k, v and o (refused)."""
  _require(hf, "attention_bias", False, (False,), where, "qkv_bias biases q, k and v, not the output projection")
  dense = _from_llama(_without(hf, "use_sliding_window", "sliding_window", "attention_bias", "mlp_bias"), where)
  return dataclasses.replace(dense, qk_norm=True, sliding_window=_qwen_window(hf, where, dense.max_len))


def _layer_pattern(kinds: list, key: str, where: str) -> int:
  """GPTConfig.sliding_window_pattern of per-layer 'sliding_attention' / 'full_attention' kinds: 0 when every
  layer slides, N when exactly every N-th layer is full; a ValueError naming `key` for any other mix."""
  if all(k == "sliding_attention" for k in kinds):
    return 0
  for n in range(2, len(kinds) + 1):
    if kinds == ["full_attention" if (i + 1) % n == 0 else "sliding_attention" for i in range(len(kinds))]:
      return n
  raise ValueError(f"{where}: {key}={kinds} is not supported (local layers with every N-th layer global, as "
                   f"sliding_window_pattern N, or one kind for every layer)")


def _from_gemma(hf: dict, where: str) -> GPTConfig:
  """Gemma 2 / Gemma 3 (text): norms before and after each sublayer with (1 + w) scales, GeGLU, embeddings × √d,
  a query scale of query_pre_attn_scalar^−½, local sliding-window layers between global ones (layer_types), and
  Gemma 2's attention and final soft-capping; Gemma 3 adds query/key norms and its own rotary base (and scaling)
  per layer kind. transformers' Gemma 3 does not apply attn_logit_softcapping, so neither do we."""
  gemma3 = architecture(hf, where) == GEMMA3
  _require(hf, "hidden_activation", hf.get("hidden_act", "gelu_pytorch_tanh"), GEMMA_ACTIVATIONS, where,
           "GeGLU gates with the tanh approximation of GELU")
  _require(hf, "attention_bias", False, (False,), where, "Gemma's projections have no biases here")
  _require(hf, "use_bidirectional_attention", False, (False, None), where, "attention is causal")
  layers, d_model, heads = hf["num_hidden_layers"], hf["hidden_size"], hf["num_attention_heads"]
  head_dim = hf.get("head_dim") or d_model // heads
  if head_dim % 2:
    raise ValueError(f"{where}: head_dim={head_dim} is odd: rotary positions need an even head width")
  legacy = hf.get("sliding_window_pattern", 6 if gemma3 else 2)
  kinds = hf.get("layer_types") or ["full_attention" if (i + 1) % legacy == 0 else "sliding_attention"
                                    for i in range(layers)]
  if len(kinds) != layers:
    raise ValueError(f"{where}: layer_types has {len(kinds)} entries for num_hidden_layers={layers}")
  window = hf.get("sliding_window") or 0
  sliding = "sliding_attention" in kinds
  if sliding and not window:
    raise ValueError(f"{where}: layer_types has sliding_attention layers but sliding_window={window!r}")
  pattern = _layer_pattern(kinds, "layer_types", where) if sliding and "full_attention" in kinds else 0
  if gemma3:
    rope = hf.get("rope_parameters") or {}
    if "full_attention" in rope or "sliding_attention" in rope:  # transformers 5: one entry per layer kind
      full = rope_settings(hf, where, rope.get("full_attention") or {}, "rope_parameters['full_attention']",
                           1_000_000.0, ("default", "linear"))
      local = rope.get("sliding_attention") or {}
      local_theta = float(rope_settings(hf, where, local, "rope_parameters['sliding_attention']", 10_000.0,
                                        ("default",))["rope_theta"])
    else:  # 4.x / the hub: rope_theta, rope_local_base_freq and rope_scaling of the global layers
      full = rope_settings(hf, where, dict(hf.get("rope_scaling") or {}), "rope_scaling", 1_000_000.0,
                           ("default", "linear"))
      local_theta = float(hf.get("rope_local_base_freq", 10_000.0))
  else:
    full, local_theta = rope_settings(hf, where, allowed=("default",)), 0.0
  if not pattern:  # one kind of layer: the local base is the base of every sliding layer
    if sliding and gemma3:
      full = {"rope_theta": local_theta}
    local_theta = 0.0
  scalar = hf.get("query_pre_attn_scalar", head_dim)
  if scalar != int(scalar) or scalar <= 0:
    raise ValueError(f"{where}: query_pre_attn_scalar={scalar!r} is not supported (a positive integer)")
  kv_heads = hf.get("num_key_value_heads") or heads
  return GPTConfig(vocab_size=hf["vocab_size"], max_len=hf.get("max_position_embeddings", 8192),
                   num_layers=layers, num_heads=heads, d_model=d_model, d_ff=hf["intermediate_size"],
                   tie_embeddings=hf.get("tie_word_embeddings", True), layer_norm_epsilon=hf.get("rms_norm_eps", 1e-6),
                   norm="rmsnorm_plus_one", post_norms=True, mlp_activation="geglu", scale_embeddings=True,
                   position_embedding="rope", num_kv_heads=0 if kv_heads == heads else kv_heads,
                   attention_head_dim=0 if head_dim * heads == d_model else head_dim, use_bias=False,
                   qk_norm=gemma3, sliding_window=window if sliding else 0, sliding_window_pattern=pattern,
                   rope_local_theta=local_theta if pattern else 0.0,
                   attention_scale_dim=0 if int(scalar) == head_dim else int(scalar),
                   attention_softcap=0.0 if gemma3 else float(hf.get("attn_logit_softcapping") or 0.0),
                   final_logit_softcap=float(hf.get("final_logit_softcapping") or 0.0), **full)


def _gemma_family(config: GPTConfig) -> str:
  """Gemma2ForCausalLM or Gemma3ForCausalLM for a rmsnorm_plus_one config, or a ValueError naming the field."""
  gemma3 = config.qk_norm
  arch = GEMMA3 if gemma3 else GEMMA2
  needs = {"post_norms": (config.post_norms, True), "mlp_activation": (config.mlp_activation, "geglu"),
           "scale_embeddings": (config.scale_embeddings, True),
           "position_embedding": (config.position_embedding, "rope"),
           "use_bias": (config.use_bias, False), "qkv_bias": (config.qkv_bias, False)}
  if not gemma3:
    needs.update(rope_local_theta=(config.rope_local_theta, 0.0), rope_scaling_factor=(config.rope_scaling_factor, 1.0))
  else:
    needs.update(attention_softcap=(config.attention_softcap, 0.0))
    if config.rope_scaling_factor != 1.0:
      needs.update(rope_scaling=(config.rope_scaling, "linear"))
  for key, (value, wanted) in needs.items():
    if value != wanted:
      raise ValueError(f"GPTConfig.{key}={value!r}: this rmsnorm_plus_one (Gemma) model does not export ({arch} "
                       f"needs {key}={wanted!r})")
  return arch


def _llama_family(config: GPTConfig) -> str:
  """Which rmsnorm / swiglu / rope architecture computes `config`, or a ValueError naming the field."""
  biases = f"use_bias={config.use_bias}, qkv_bias={config.qkv_bias}"
  if config.qk_norm:
    if config.use_bias or config.qkv_bias:
      raise ValueError(f"GPTConfig.qk_norm with {biases}: {QWEN3} has no biases")
    return QWEN3
  if config.qkv_bias and not config.use_bias:
    return QWEN2
  if config.sliding_window:
    if config.use_bias:
      raise ValueError(f"GPTConfig.sliding_window={config.sliding_window} with use_bias=True: {MISTRAL} has no "
                       f"biases")
    return MISTRAL
  return LLAMA


def export_architecture(config: GPTConfig) -> str:
  """The Hugging Face architecture that computes what `config` does, or a ValueError saying why none does."""
  if config.num_experts:
    mixtral = {"moe_every": (config.moe_every, config.moe_every == 1, "every layer is MoE"),
               "moe_top_k": (config.moe_top_k, config.moe_top_k >= 2, "top-1 gates are renormalised to 1"),
               "use_bias": (config.use_bias, not config.use_bias, "no biases"),
               "qkv_bias": (config.qkv_bias, not config.qkv_bias, "no biases"),
               "qk_norm": (config.qk_norm, not config.qk_norm, "no query/key norm"),
               "sliding_window": (config.sliding_window, not config.sliding_window, "full causal attention here"),
               "norm": (config.norm, config.norm == "rmsnorm", "rmsnorm"),
               "mlp_activation": (config.mlp_activation, config.mlp_activation == "swiglu", "swiglu"),
               "position_embedding": (config.position_embedding, config.position_embedding == "rope", "rope")}
    for key, (value, ok, why) in mixtral.items():
      if not ok:
        raise ValueError(f"GPTConfig.{key}={value!r}: this mixture-of-experts model does not export ({MIXTRAL} "
                         f"needs {why})")
    return MIXTRAL
  gpt2 = (config.norm == "layernorm" and config.mlp_activation == "gelu" and config.position_embedding == "learned"
          and config.use_bias and config.kv_heads == config.num_heads and not config.qk_norm
          and not config.sliding_window and not config.attention_head_dim)
  if gpt2:
    return GPT2
  if config.norm == "rmsnorm_plus_one":
    return _gemma_family(config)
  gemma_only = {"post_norms": config.post_norms, "scale_embeddings": config.scale_embeddings,
                "sliding_window_pattern": config.sliding_window_pattern,
                "attention_scale_dim": config.attention_scale_dim,
                "attention_softcap": config.attention_softcap, "final_logit_softcap": config.final_logit_softcap}
  for key, value in gemma_only.items():
    if value:
      raise ValueError(f"GPTConfig.{key}={value!r} with norm={config.norm!r}: only the Gemma families "
                       f"({GEMMA2}, {GEMMA3}: norm='rmsnorm_plus_one') export it")
  if config.rope_scaling_factor != 1.0 and config.rope_scaling != "llama3":
    raise ValueError(f"GPTConfig.rope_scaling={config.rope_scaling!r}: only {GEMMA3} exports linear rope scaling")
  if config.norm == "rmsnorm" and config.mlp_activation == "swiglu" and config.position_embedding == "rope":
    return _llama_family(config)
  raise ValueError(f"no Hugging Face architecture computes this model (norm={config.norm!r}, "
                   f"mlp_activation={config.mlp_activation!r}, position_embedding={config.position_embedding!r}, "
                   f"use_bias={config.use_bias}, num_kv_heads={config.num_kv_heads}): {GPT2} needs layernorm, "
                   f"gelu, learned, use_bias, no GQA; {LLAMA} needs rmsnorm, swiglu, rope")


def to_hf(config: GPTConfig, token_ids: Optional[dict] = None, dtype: str = "float32") -> dict:
  """The config.json of `config` (transformers ≥ 4.45 and 5.x read it); `token_ids` adds bos/eos/pad ids."""
  arch = export_architecture(config)
  vocab = config.valid_vocab_size or config.vocab_size
  common = {"architectures": [arch], "model_type": SUPPORTED[arch], "vocab_size": vocab,
            "tie_word_embeddings": config.tie_embeddings, "torch_dtype": dtype,
            # written even when unknown: GPT2Config would otherwise default them to GPT-2's 50256
            **{k: (token_ids or {}).get(k) for k in TOKEN_ID_KEYS}}
  if arch in (GEMMA2, GEMMA3):
    return {**common, **_gemma_to_hf(config, arch)}
  if arch == GPT2:
    return {**common, "n_positions": config.max_len, "n_embd": config.d_model, "n_layer": config.num_layers,
            "n_head": config.num_heads, "n_inner": config.d_ff, "activation_function": "gelu_new",
            "layer_norm_epsilon": config.layer_norm_epsilon, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
            "attn_pdrop": 0.0, "scale_attn_weights": True}
  out = {**common, "hidden_size": config.d_model, "intermediate_size": config.d_ff,
         "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
         "num_key_value_heads": config.kv_heads, "head_dim": config.head_dim, "hidden_act": "silu",
         "max_position_embeddings": config.max_len, "rms_norm_eps": config.layer_norm_epsilon,
         "rope_theta": config.rope_theta, "attention_bias": config.use_bias, "mlp_bias": config.use_bias,
         "attention_dropout": 0.0}
  if arch == MIXTRAL:
    del out["attention_bias"], out["mlp_bias"]  # Mixtral has neither
    out.update(intermediate_size=config.expert_d_ff, num_local_experts=config.num_experts,
               num_experts_per_tok=config.moe_top_k, sliding_window=None, output_router_logits=False,
               router_aux_loss_coef=config.moe_load_balancing_weight / config.moe_top_k, router_jitter_noise=0.0)
  if arch in (QWEN2, QWEN3):  # every layer slides, or none does
    del out["mlp_bias"]
    if arch == QWEN2:
      del out["attention_bias"]  # always on q, k, v; never on o
    out.update(use_sliding_window=bool(config.sliding_window), sliding_window=config.sliding_window or None,
               max_window_layers=0, layer_types=[("sliding" if config.sliding_window else "full") + "_attention"]
               * config.num_layers)
  if arch == MISTRAL:
    del out["attention_bias"], out["mlp_bias"]
    out["sliding_window"] = config.sliding_window
  if config.rope_scaling_factor != 1.0:
    out["rope_scaling"] = {"rope_type": "llama3", "factor": config.rope_scaling_factor,
                           "low_freq_factor": config.rope_low_freq_factor,
                           "high_freq_factor": config.rope_high_freq_factor,
                           "original_max_position_embeddings": config.rope_original_max_len}
  return out


def _gemma_to_hf(config: GPTConfig, arch: str) -> dict:
  """The Gemma 2 / 3 keys of to_hf (transformers 5's names; every layer's kind written out in layer_types)."""
  kinds = ["sliding_attention" if config.sliding_window and config.layer_is_local(i) is not False else "full_attention"
           for i in range(config.num_layers)]
  out = {"hidden_size": config.d_model, "intermediate_size": config.d_ff, "num_hidden_layers": config.num_layers,
         "num_attention_heads": config.num_heads, "num_key_value_heads": config.kv_heads, "head_dim": config.head_dim,
         "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": config.max_len,
         "rms_norm_eps": config.layer_norm_epsilon, "attention_bias": False, "attention_dropout": 0.0,
         "query_pre_attn_scalar": config.attention_scale_dim or config.head_dim,
         "sliding_window": config.sliding_window or None, "layer_types": kinds,
         "final_logit_softcapping": config.final_logit_softcap or None,
         "attn_logit_softcapping": config.attention_softcap or None}
  if arch == GEMMA2:
    out["rope_parameters"] = {"rope_type": "default", "rope_theta": config.rope_theta}
    return out
  full = {"rope_type": "default", "rope_theta": config.rope_theta}
  if config.rope_scaling_factor != 1.0:
    full.update(rope_type="linear", factor=config.rope_scaling_factor)
  local = {"rope_type": "default", "rope_theta": config.rope_local_theta or config.rope_theta}
  out["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
  return out


def model_gin(config: GPTConfig, source: str) -> str:
  """model.gin text binding `config`'s MODEL_FIELDS, for `--gin_file=MODEL_DIR/model.gin`."""
  lines = [f"# {source}", "# Model only: add a run config (configs/runs/...) for dtype, remat and the mesh."]
  for name in MODEL_FIELDS + (MOE_FIELDS if config.num_experts else ()):
    lines.append(f"model.GPTConfig.{name} = {getattr(config, name)!r}")
  return "\n".join(lines) + "\n"
