"""Model FLOPs per token (PaLM appendix B) and model FLOPs utilisation (MFU).

Convention (the same as nanoGPT's `estimate_mfu` and PaLM appendix B):

    train FLOPs/token = 6·N + 12·L·T·d      (attention term: 6·L·T·d with `causal_halved`)
    forward FLOPs/token = 2·N + 4·L·T·d     (2·L·T·d with `causal_halved`)

N counts the parameters that take part in a matmul-like op once per token: every parameter except
the learned position table (a gather) and, for untied embeddings, the input token table (a gather).
The tied token embedding is counted once, as the output projection it also is. LayerNorm and bias
parameters are included (a rounding error at these sizes). L·T·d = L·H·Q·T: per token, QKᵀ and
attention·V are 2·T·d multiply-adds each in the forward pass, ×3 for forward + backward. PaLM does
not halve it for causal masking; `causal_halved=True` counts only the unmasked half. These are *model*
FLOPs: rematerialisation's recomputed forward is not counted (see `hardware_flops_per_token`).
"""

from t5x_like.model import decoder as model_lib


def matmul_params(cfg: model_lib.GPTConfig) -> int:
  """N of the formula: all parameters minus those only gathered (position table, untied input table)."""
  n = model_lib.count_params(cfg)
  if cfg.position_embedding == "learned":
    n -= cfg.max_len * cfg.d_model
  if not cfg.tie_embeddings:
    n -= cfg.vocab_size * cfg.d_model
  return n


def block_projection_params(cfg: model_lib.GPTConfig) -> int:
  """Weights of one block's projections: query, keys/values (grouped-query: K heads), output, and the MLP's two
  (GELU) or three (SwiGLU) matrices; biases and norms left out."""
  d, f = cfg.d_model, cfg.d_ff
  kv = 2 * d * cfg.kv_heads * cfg.head_dim
  mlp = (3 if cfg.mlp_activation == "swiglu" else 2) * d * f
  return 2 * d * d + kv + mlp


def _attention_flops(cfg: model_lib.GPTConfig, seq_len: int, causal_halved: bool) -> float:
  """Forward attention FLOPs per token: QKᵀ and probs·V, 2·T·d each per layer."""
  full = 4.0 * cfg.num_layers * seq_len * cfg.d_model
  return full / 2 if causal_halved else full


def forward_flops_per_token(cfg: model_lib.GPTConfig, seq_len: int, causal_halved: bool = False) -> float:
  """Forward-only model FLOPs per token (evaluation, prefill): 2·N + 4·L·T·d."""
  return 2.0 * matmul_params(cfg) + _attention_flops(cfg, seq_len, causal_halved)


def train_flops_per_token(cfg: model_lib.GPTConfig, seq_len: int, causal_halved: bool = False) -> float:
  """Training model FLOPs per token (forward + backward): 6·N + 12·L·T·d (PaLM appendix B)."""
  return 3.0 * forward_flops_per_token(cfg, seq_len, causal_halved)


def hardware_flops_per_token(cfg: model_lib.GPTConfig, seq_len: int, remat_policy: str = None,
                             causal_halved: bool = False) -> float:
  """FLOPs the device actually executes per training token, rematerialisation included.

  'full' recomputes each block's forward (Megatron's 8·N accounting); 'save_dots' recomputes only
  attention's two batched matmuls; 'save_attention_out' recomputes qkv, attention and the MLP input
  projection; 'offload_dots' reloads the dots from host memory instead. Embedding and logits sit
  outside the remat scope and are never recomputed.
  """
  policy = cfg.remat_policy if remat_policy is None else remat_policy
  d, f = cfg.d_model, cfg.d_ff
  block_matmul = 2.0 * block_projection_params(cfg)  # forward FLOPs/token of one block's projections
  qkv_and_mlp_in = block_projection_params(cfg) - d * d - d * f  # recomputed under save_attention_out
  attn = _attention_flops(cfg, seq_len, causal_halved) / cfg.num_layers  # per layer, forward
  per_layer_fwd = {
      "none": 0.0,
      "offload_dots": 0.0,
      "full": block_matmul + attn,
      "save_dots": attn,
      "save_attention_out": 2.0 * qkv_and_mlp_in + attn,
  }[policy]
  return train_flops_per_token(cfg, seq_len, causal_halved) + cfg.num_layers * per_layer_fwd


def mfu(tokens_per_sec: float, flops_per_token: float, num_devices: int, peak_per_device: float) -> float:
  """Model FLOPs utilisation: achieved model FLOP/s over the devices' summed peak (0..1)."""
  if num_devices <= 0 or peak_per_device <= 0:
    raise ValueError(f"mfu needs num_devices > 0 and peak_per_device > 0, got {num_devices}, {peak_per_device}")
  return tokens_per_sec * flops_per_token / (num_devices * peak_per_device)
