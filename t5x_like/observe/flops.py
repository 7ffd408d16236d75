"""Model FLOPs per token (PaLM appendix B) and model FLOPs utilisation (MFU).

Convention (the same as nanoGPT's `estimate_mfu` and PaLM appendix B):

    train FLOPs/token = 6·N + 12·L·T·d      (attention term: 6·L·T·d with `causal_halved`)
    forward FLOPs/token = 2·N + 4·L·T·d     (2·L·T·d with `causal_halved`)

N counts the parameters that take part in a matmul-like op once per token: every parameter except
the learned position table (a gather) and, for untied embeddings, the input token table (a gather).
The tied token embedding is counted once, as the output projection it also is. LayerNorm and bias
parameters are included (a rounding error at these sizes). L·T·d = L·H·Q·T: per token, QKᵀ and
attention·V are 2·T·d multiply-adds each in the forward pass, ×3 for forward + backward. PaLM does
not halve it for causal masking; `causal_halved=True` counts only the unmasked half. A sliding window W < T
(GPTConfig.sliding_window) replaces T by W (`attended_keys`). These are *model*
FLOPs: rematerialisation's recomputed forward is not counted (see `hardware_flops_per_token`).

Mixture of experts: N counts the *active* parameters, those one token meets: the router and top_k of the
num_experts experts of each MoE layer (`active_params`); the other experts' weights are stored, not used. What
routing adds on the device (the one-hot dispatch/combine einsums, and the experts' MLPs run over every buffer
slot, empty ones included) is hardware FLOPs only (`moe_dispatch_flops_per_token`, `hardware_flops_per_token`).
"""

from t5x_like.model import decoder as model_lib
from t5x_like.model import moe


def expert_params(cfg: model_lib.GPTConfig) -> int:
  """Parameters of one expert: its two (GELU) or three (gated: SwiGLU, GeGLU) matrices and their biases."""
  d, f = cfg.d_model, cfg.expert_d_ff
  mats = 3 if cfg.gated_mlp else 2
  biases = ((mats - 1) * f + d) if cfg.use_bias else 0
  return mats * d * f + biases


def inactive_params(cfg: model_lib.GPTConfig) -> int:
  """Expert parameters a token does not meet: (num_experts − top_k) experts in each MoE layer (0 if dense)."""
  if not cfg.num_experts:
    return 0
  return cfg.num_moe_layers * (cfg.num_experts - cfg.moe_top_k) * expert_params(cfg)


def active_params(cfg: model_lib.GPTConfig) -> int:
  """All parameters less the experts a token is not routed to (= count_params for a dense model)."""
  return model_lib.count_params(cfg) - inactive_params(cfg)


def matmul_params(cfg: model_lib.GPTConfig) -> int:
  """N of the formula: the active parameters minus those only gathered (position table, untied input table)."""
  n = active_params(cfg)
  if cfg.position_embedding == "learned":
    n -= cfg.max_len * cfg.d_model
  if not cfg.tie_embeddings:
    n -= cfg.vocab_size * cfg.d_model
  return n


def _projection_split(cfg: model_lib.GPTConfig) -> tuple:
  """Per layer (the mean over layers when only some are MoE), the active projection weights a token meets, as
  (query + keys/values, attention output, MLP input side (+ router), MLP output); biases and norms left out."""
  d, inner = cfg.d_model, cfg.num_heads * cfg.head_dim  # inner = d unless attention_head_dim sets another width
  qkv = d * inner + 2 * d * cfg.kv_heads * cfg.head_dim
  ins = 2 if cfg.gated_mlp else 1
  dense_in, dense_out = ins * d * cfg.d_ff, d * cfg.d_ff
  if not cfg.num_experts:
    return qkv, inner * d, dense_in, dense_out
  moe_share = cfg.num_moe_layers / cfg.num_layers
  moe_in = cfg.moe_top_k * ins * d * cfg.expert_d_ff + d * cfg.num_experts
  moe_out = cfg.moe_top_k * d * cfg.expert_d_ff
  mix = lambda dense, sparse: (1 - moe_share) * dense + moe_share * sparse
  return qkv, inner * d, mix(dense_in, moe_in), mix(dense_out, moe_out)


def block_projection_params(cfg: model_lib.GPTConfig) -> int:
  """Weights of one block's projections a token meets: query, keys/values (grouped-query: K heads), output, and
  the MLP's two (GELU) or three (SwiGLU) matrices (an MoE layer: top_k experts' and the router); biases and
  norms left out. With MoE layers only every moe_every-th, the mean over layers."""
  return round(sum(_projection_split(cfg)))


def _expert_matmul_flops(cfg: model_lib.GPTConfig) -> float:
  """Forward FLOPs per token of the top_k experts' matmuls, the mean over layers."""
  if not cfg.num_experts:
    return 0.0
  ins = 2 if cfg.gated_mlp else 1
  return 2.0 * cfg.num_moe_layers / cfg.num_layers * cfg.moe_top_k * (ins + 1) * cfg.d_model * cfg.expert_d_ff


def moe_dispatch_flops_per_token(cfg: model_lib.GPTConfig, seq_len: int) -> float:
  """Forward FLOPs per token that routing adds on the device, summed over the MoE layers: the dispatch and
  combine einsums (2·E·C·d each, C = capacity of a group) and the experts' MLPs over the empty buffer slots
  (E·C slots per group of S tokens instead of top_k·S)."""
  if not cfg.num_experts:
    return 0.0
  group = moe.routing_group_size(cfg, seq_len)
  slots = cfg.num_experts * moe.capacity(cfg, group) / group  # expert buffer slots per token
  ins = 2 if cfg.gated_mlp else 1
  per_slot = 2.0 * (ins + 1) * cfg.d_model * cfg.expert_d_ff
  padding = max(0.0, slots - cfg.moe_top_k) * per_slot
  return cfg.num_moe_layers * (2 * 2.0 * slots * cfg.d_model + padding)


def attended_keys(cfg: model_lib.GPTConfig, seq_len: int, causal_halved: bool) -> float:
  """Keys each query is counted against, the mean over the layers: T (PaLM), T/2 with `causal_halved`; in a layer
  with a sliding window W < T, W, or halved the mean of min(i + 1, W) over the T queries, ≈ W − W²/(2T) (equal to
  T/2 at W = T). Under sliding_window_pattern only the local layers have the window."""
  def keys(window):
    if not window or window >= seq_len:
      return seq_len / 2 if causal_halved else float(seq_len)
    return window - window * window / (2.0 * seq_len) if causal_halved else float(window)
  if cfg.layer_is_local(0) is None:
    return keys(cfg.sliding_window)
  local = sum(bool(cfg.layer_is_local(i)) for i in range(cfg.num_layers))
  return (local * keys(cfg.sliding_window) + (cfg.num_layers - local) * keys(0)) / cfg.num_layers


def _attention_flops(cfg: model_lib.GPTConfig, seq_len: int, causal_halved: bool) -> float:
  """Forward attention FLOPs per token: QKᵀ and probs·V, 2·T·H·Dh each per layer (T: attended_keys; H·Dh = d
  unless attention_head_dim sets another head width)."""
  return 4.0 * cfg.num_layers * attended_keys(cfg, seq_len, causal_halved) * (cfg.num_heads * cfg.head_dim)


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
  qkv, _, mlp_in, _ = _projection_split(cfg)
  block_matmul = 2.0 * sum(_projection_split(cfg))  # forward FLOPs/token of one block's projections
  attn = _attention_flops(cfg, seq_len, causal_halved) / cfg.num_layers  # per layer, forward
  routing = moe_dispatch_flops_per_token(cfg, seq_len) / cfg.num_layers  # per layer, forward
  per_layer_fwd = {
      "none": 0.0,
      "offload_dots": 0.0,
      "full": block_matmul + attn + routing,
      "save_dots": attn + routing + _expert_matmul_flops(cfg),  # the experts' einsums have a batch (expert) dim
      "save_attention_out": 2.0 * (qkv + mlp_in) + attn + routing,
  }[policy]
  return (train_flops_per_token(cfg, seq_len, causal_halved) + 3.0 * moe_dispatch_flops_per_token(cfg, seq_len)
          + cfg.num_layers * per_layer_fwd)


def mfu(tokens_per_sec: float, flops_per_token: float, num_devices: int, peak_per_device: float) -> float:
  """Model FLOPs utilisation: achieved model FLOP/s over the devices' summed peak (0..1)."""
  if num_devices <= 0 or peak_per_device <= 0:
    raise ValueError(f"mfu needs num_devices > 0 and peak_per_device > 0, got {num_devices}, {peak_per_device}")
  return tokens_per_sec * flops_per_token / (num_devices * peak_per_device)
