"""The tensor table: each Hugging Face tensor ↔ the (part of the) t5x_like parameter it fills, both directions.

Our parameters (float32) stack the layers on a leading axis (an MoE layer's experts on the next one); HF
keeps one tensor per layer (Mixtral: per layer and expert). GPT-2's Conv1D weights are stored (in, out),
Llama's nn.Linear weights (out, in); ours are (in..., out...) with the heads split out, e.g. q_proj (H·Dh, D)
→ query/kernel (D, H, Dh). Vocabulary rows past the real vocabulary (padding for sharding) are zero on import
and dropped on export.
"""

import dataclasses
import math
import re
from typing import Optional

import numpy as np

from t5x_like.interop import hf_config
from t5x_like.model.config import GPTConfig

# Buffers some checkpoints carry that are not parameters (GPT-2's causal mask, rotary frequencies).
IGNORED = re.compile(r"(.*\.attn\.(masked_)?bias|.*rotary_emb\.inv_freq)$")


@dataclasses.dataclass(frozen=True)
class Tensor:
  """One HF tensor and where it lives among our parameters.

  hf: its HF key; `{i}` stands for the layer index.
  ours: our parameter path ('blocks/attn/qkv/kernel'); a `blocks/` path is indexed by the layer first.
  part: index into that (per-layer) parameter, e.g. (slice(None), 0) = the query slot of a (D, 3, H, Dh) kernel.
  fan_in: how many leading axes of our slot form the HF matrix's input dimension; 0 = a vector (1-D in HF).
  linear: HF stores the matrix (out, in) (nn.Linear), not (in, out) (Conv1D, embedding tables).
  vocab_axis: the slot axis over the vocabulary, if any: padded rows there have no HF counterpart.
  """
  hf: str
  ours: str
  part: tuple = ()
  fan_in: int = 0
  linear: bool = False
  vocab_axis: Optional[int] = None

  def slot(self, params: dict, layer: int, config: GPTConfig) -> np.ndarray:
    """The view of `params` (a nested dict of numpy arrays) this tensor fills, padding rows excluded."""
    node = params
    for name in self.ours.split("/"):
      node = node[name]
    if self.ours.startswith("blocks/"):
      node = node[layer]
    node = node[self.part]
    if self.vocab_axis is not None:
      valid = config.valid_vocab_size or config.vocab_size
      node = node[(slice(None),) * self.vocab_axis + (slice(0, valid),)]
    return node

  def hf_shape(self, slot_shape: tuple) -> tuple:
    if not self.fan_in:
      return (math.prod(slot_shape),)
    rows, cols = math.prod(slot_shape[:self.fan_in]), math.prod(slot_shape[self.fan_in:])
    return (cols, rows) if self.linear else (rows, cols)

  def to_ours(self, array: np.ndarray, slot_shape: tuple) -> np.ndarray:
    return (array.T if self.linear else array).reshape(slot_shape)

  def to_hf(self, slot: np.ndarray) -> np.ndarray:
    matrix = slot.reshape(self.hf_shape(slot.shape)[::-1] if self.linear else self.hf_shape(slot.shape))
    return matrix.T if self.linear else matrix


def gpt2_table(config: GPTConfig, prefix: str = "transformer.") -> list:
  """GPT2LMHeadModel's tensors (`prefix` '' for checkpoints saved from a bare GPT2Model)."""
  p, h = prefix, f"{prefix}h.{{i}}."
  table = [Tensor(p + "wte.weight", "token_embedding", fan_in=1, vocab_axis=0),
           Tensor(p + "wpe.weight", "position_embedding", fan_in=1)]
  for hf_name, ours in (("ln_1", "ln_1"), ("ln_2", "ln_2")):
    table += [Tensor(f"{h}{hf_name}.weight", f"blocks/{ours}/scale"), Tensor(f"{h}{hf_name}.bias", f"blocks/{ours}/bias")]
  for hf_name, ours, fan_in in (("attn.c_attn", "attn/qkv", 1), ("attn.c_proj", "attn/out", 2),
                                ("mlp.c_fc", "mlp_in", 1), ("mlp.c_proj", "mlp_out", 1)):
    table += [Tensor(f"{h}{hf_name}.weight", f"blocks/{ours}/kernel", fan_in=fan_in),
              Tensor(f"{h}{hf_name}.bias", f"blocks/{ours}/bias")]
  table += [Tensor(p + "ln_f.weight", "ln_f/scale"), Tensor(p + "ln_f.bias", "ln_f/bias")]
  if not config.tie_embeddings:
    table.append(Tensor("lm_head.weight", "lm_head/kernel", fan_in=1, linear=True, vocab_axis=1))
  return table


def llama_table(config: GPTConfig, mixtral: bool = False) -> list:
  """LlamaForCausalLM's tensors: fused qkv slots when num_kv_heads == num_heads, else query + key_value. The
  same names serve Qwen2 (q/k/v biases: qkv_bias), Qwen3 (q_norm / k_norm: qk_norm), Mistral and Gemma 2/3 (two
  more norms a layer: post_norms; Gemma 3's q_norm / k_norm; the (1 + w) norm scales are stored as w, as ours).

  mixtral: MixtralForCausalLM's instead: the same attention, norms and embeddings; the MLP of every layer is
  `block_sparse_moe`: a router `gate` (E, D) and per expert e the SwiGLU matrices w1 (gate), w3 (up) and w2
  (down), which fill expert e's slice of our stacked (E, in, out) `blocks/moe/*` kernels.
  """
  h = "model.layers.{i}."
  all_ = slice(None)
  if config.fused_qkv:
    projections = [("q_proj", "attn/qkv", 0), ("k_proj", "attn/qkv", 1), ("v_proj", "attn/qkv", 2)]
  else:
    projections = [("q_proj", "attn/query", None), ("k_proj", "attn/key_value", 0), ("v_proj", "attn/key_value", 1)]
  if config.post_norms:  # Gemma 2/3: post_attention_layernorm norms the attention's output, not the MLP's input
    norms = (("input_layernorm", "ln_1"), ("post_attention_layernorm", "ln_post_attn"),
             ("pre_feedforward_layernorm", "ln_2"), ("post_feedforward_layernorm", "ln_post_mlp"))
  else:
    norms = (("input_layernorm", "ln_1"), ("post_attention_layernorm", "ln_2"))
  table = [Tensor("model.embed_tokens.weight", "token_embedding", fan_in=1, vocab_axis=0)]
  table += [Tensor(f"{h}{hf_name}.weight", f"blocks/{ours}/scale") for hf_name, ours in norms]
  for hf_name, ours, index in projections:
    table.append(Tensor(f"{h}self_attn.{hf_name}.weight", f"blocks/{ours}/kernel",
                        part=() if index is None else (all_, index), fan_in=1, linear=True))
    if config.use_bias or config.qkv_bias:
      table.append(Tensor(f"{h}self_attn.{hf_name}.bias", f"blocks/{ours}/bias",
                          part=() if index is None else (index,)))
  if config.qk_norm:  # Qwen3: RMSNorm over head_dim, one (Dh,) scale shared by the heads
    table += [Tensor(f"{h}self_attn.q_norm.weight", "blocks/attn/query_norm/scale"),
              Tensor(f"{h}self_attn.k_norm.weight", "blocks/attn/key_norm/scale")]
  mlp = (("mlp.gate_proj", "mlp_gate", 1), ("mlp.up_proj", "mlp_in", 1), ("mlp.down_proj", "mlp_out", 1))
  for hf_name, ours, fan_in in (("self_attn.o_proj", "attn/out", 2),) + (() if mixtral else mlp):
    table.append(Tensor(f"{h}{hf_name}.weight", f"blocks/{ours}/kernel", fan_in=fan_in, linear=True))
    if config.use_bias:
      table.append(Tensor(f"{h}{hf_name}.bias", f"blocks/{ours}/bias"))
  if mixtral:
    moe = h + "block_sparse_moe."
    table.append(Tensor(moe + "gate.weight", "blocks/moe/router/kernel", fan_in=1, linear=True))
    for e in range(config.num_experts):
      table += [Tensor(f"{moe}experts.{e}.{hf_name}.weight", f"blocks/moe/{ours}/kernel", part=(e,), fan_in=1,
                       linear=True) for hf_name, ours in (("w1", "mlp_gate"), ("w3", "mlp_in"), ("w2", "mlp_out"))]
  table.append(Tensor("model.norm.weight", "ln_f/scale"))
  if not config.tie_embeddings:
    table.append(Tensor("lm_head.weight", "lm_head/kernel", fan_in=1, linear=True, vocab_axis=1))
  return table


def table(arch: str, config: GPTConfig, keys=()) -> list:
  """The tensor table of `arch`; for GPT-2 the key prefix is read off `keys` (a checkpoint's tensor names)."""
  if arch == hf_config.GPT2:
    bare = "wte.weight" in keys and "transformer.wte.weight" not in keys
    return gpt2_table(config, prefix="" if bare else "transformer.")
  return llama_table(config, mixtral=arch == hf_config.MIXTRAL)


def zero_leaves(config: GPTConfig) -> tuple:
  """Our parameters HF has no tensor for: an untied lm_head's bias (no family has one). Zero on
  import; export refuses them nonzero."""
  return ("lm_head/bias",) if not config.tie_embeddings and config.use_bias else ()


def expand(entries: list, num_layers: int) -> list:
  """(HF key, Tensor, layer) for every layer of every entry."""
  out = []
  for t in entries:
    layers = range(num_layers) if "{i}" in t.hf else (0,)
    out += [(t.hf.format(i=i), t, i) for i in layers]
  return out
