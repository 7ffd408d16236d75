"""Hugging Face `config.json` ↔ GPTConfig for the GPT-2, Llama, Mixtral, Qwen2, Qwen3 and Mistral families,
refusing what we cannot represent."""

import dataclasses
import math
from typing import Optional

from t5x_like.model.config import GPTConfig

GPT2, LLAMA, MIXTRAL = "GPT2LMHeadModel", "LlamaForCausalLM", "MixtralForCausalLM"
QWEN2, QWEN3, MISTRAL = "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"
SUPPORTED = {GPT2: "gpt2", LLAMA: "llama", MIXTRAL: "mixtral", QWEN2: "qwen2", QWEN3: "qwen3",
             MISTRAL: "mistral"}  # architecture → model_type
VOCAB_MULTIPLE = 128  # imported vocabularies are padded to a multiple of this, so the vocab axis shards
GPT2_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")  # both the tanh approximation our "gelu" computes
ROPE_TYPES = ("default", "llama3")
# Token ids carried from the imported config.json to the exported one (they live in no GPTConfig field).
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
# The GPTConfig fields a converted model.gin binds: everything that fixes the function, nothing that fixes
# the execution (dtype, remat, attention kernel, pipeline stages come from the run's own gin files).
MODEL_FIELDS = ("vocab_size", "valid_vocab_size", "max_len", "num_layers", "num_heads", "num_kv_heads",
                "attention_head_dim", "d_model", "d_ff", "tie_embeddings", "use_bias", "qkv_bias", "qk_norm",
                "sliding_window", "norm", "layer_norm_epsilon", "mlp_activation", "position_embedding", "rope_theta",
                "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_len")
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
              MISTRAL: _from_mistral}[arch](hf, where)
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


def rope_settings(hf: dict, where: str) -> dict:
  """rope_theta and Llama-3 scaling from transformers 5's `rope_parameters` or 4.x's `rope_theta` + `rope_scaling`."""
  params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
  theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
  kind = params.get("rope_type", params.get("type", "default"))
  key = "rope_parameters" if "rope_parameters" in hf else "rope_scaling"
  if kind not in ROPE_TYPES:
    raise ValueError(f"{where}: {key} rope_type={kind!r} is not supported; supported: {list(ROPE_TYPES)}")
  out = {"rope_theta": float(theta)}
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


def model_gin(config: GPTConfig, source: str) -> str:
  """model.gin text binding `config`'s MODEL_FIELDS, for `--gin_file=MODEL_DIR/model.gin`."""
  lines = [f"# {source}", "# Model only: add a run config (configs/runs/...) for dtype, remat and the mesh."]
  for name in MODEL_FIELDS + (MOE_FIELDS if config.num_experts else ()):
    lines.append(f"model.GPTConfig.{name} = {getattr(config, name)!r}")
  return "\n".join(lines) + "\n"
