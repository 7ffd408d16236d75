"""GPT decoder configuration: the dataclass that fixes the model's function and its execution policy."""

import dataclasses

import jax
import jax.numpy as jnp

from t5x_like.model import cpu_kernels
from t5x_like.parallel import axis_names as ax
from t5x_like.parallel import layout

REMAT_POLICIES = ("none", "full", "save_dots", "save_attention_out", "offload_dots")
ATTENTION_IMPLS = ("reference", "xla", "cudnn", "splash", "auto")
CONTEXT_PARALLELISMS = ("all_gather", "ring")
NORMS = ("layernorm", "rmsnorm", "rmsnorm_plus_one")
MLP_ACTIVATIONS = ("gelu", "swiglu", "geglu")
ROPE_SCALINGS = ("llama3", "linear")
POSITION_EMBEDDINGS = ("learned", "rope")
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
  # Stacked elements of the layer scan run per loop iteration (lax.scan's unroll). 1 = a rolled loop: compile time
  # independent of depth, and rematerialisation's memory bound kept by the loop (accelerators; any remat_policy).
  # 0 = auto: with the CPU kernels (cpu_kernels.enabled: XLA:CPU) and no remat, every layer unrolled (a rolled loop's
  # per-layer dynamic slices of the stacked parameters and updates of their gradients cost ~12% of a gpt_25m float32
  # step); else 1.
  scan_unroll: int = 0
  # reference (einsum, causal blocks) | xla / cudnn (jax.nn.dot_product_attention) | splash (JAX's Pallas splash
  # attention kernel: TPU; interpret mode on CPU, for checking numerics) | auto (attention_kernel(): cudnn on GPU,
  # splash on TPU, xla elsewhere and where the chosen kernel lacks a feature the model uses)
  attention_impl: str = "reference"
  # How attention reads the keys/values when activations' length is split over a mesh axis (context parallelism,
  # mesh axis `sequence`): all_gather (each device gathers the whole sequence's keys/values and holds (T/s) × T
  # scores) | ring (model/ring.py: key/value blocks pass around the ring, (T/s) × (T/s) scores per step; training
  # and scoring, not pipeline stages or sliding_window_pattern). Without a split length both are plain attention.
  context_parallelism: str = "all_gather"
  num_stages: int = 1  # pipeline stages the layer stack is split into (set from the mesh)
  pipeline_microbatches: int = 0  # microbatches streamed through the pipeline; 0 = 2 × num_stages
  # Virtual stages per pipeline device (interleaved/circular schedule): each device runs this many non-adjacent
  # chunks of layers, cutting the bubble to (p − 1)/(repeats·m + p − 1); needs pipeline_microbatches ≥ num_stages.
  pipeline_repeats: int = 1
  # Whether the stacked blocks arrive in stage order when pipeline_repeats > 1 (pipeline_parallel.to_stage_order:
  # each pipeline device's chunks contiguous, so no step regroups the weights). The trainer sets it for the state it
  # holds; checkpoints, exports and the engine keep layer order. Nothing else needs to set it.
  blocks_in_stage_order: bool = False
  # Architecture options (the defaults are GPT-2; Llama = rmsnorm, swiglu, rope, num_kv_heads, no biases, untied head).
  # layernorm (scale and bias) | rmsnorm (scale only) | rmsnorm_plus_one (Gemma: the stored scale w starts at 0 and
  # multiplies as 1 + w, in float32; also the query/key norms'); epsilon = layer_norm_epsilon
  norm: str = "layernorm"
  post_norms: bool = False  # also norm each sublayer's output before the residual add (Gemma 2/3: 4 norms a block)
  # gelu (tanh approximation, GPT-2) | swiglu (silu(mlp_gate(x)) * mlp_in(x)) | geglu (gelu(mlp_gate(x)) * mlp_in(x),
  # tanh approximation: Gemma)
  mlp_activation: str = "gelu"
  scale_embeddings: bool = False  # token embeddings × √d_model before the first block (Gemma)
  position_embedding: str = "learned"  # learned (a max_len × d_model table) | rope (rotary, no parameters)
  rope_theta: float = 10000.0  # rotary base period
  rope_scaling_factor: float = 1.0  # rotary frequency scaling (see rope_scaling); 1.0 = none
  # llama3: only long wavelengths are divided by the factor (the three fields below) | linear: every frequency is
  # (positions interpolated; Gemma 3's global layers)
  rope_scaling: str = "llama3"
  rope_low_freq_factor: float = 1.0  # Llama-3 scaling: wavelengths above original_max_len / this are scaled
  rope_high_freq_factor: float = 4.0  # Llama-3 scaling: wavelengths below original_max_len / this are kept
  rope_original_max_len: int = 8192  # Llama-3 scaling: the context length the frequencies were trained for
  num_kv_heads: int = 0  # key/value heads: 0 = num_heads (multi-head); fewer = grouped-query; 1 = multi-query
  attention_head_dim: int = 0  # per-head width; 0 = d_model / num_heads (Qwen3-0.6B..4B set 128 apart from d_model)
  use_bias: bool = True  # biases on the attention and MLP projections and on an untied lm_head
  qkv_bias: bool = False  # biases on the query, key and value projections even when use_bias is off (Qwen2/2.5)
  qk_norm: bool = False  # RMSNorm (scale only, over head_dim) on queries and keys before rotary positions (Qwen3)
  sliding_window: int = 0  # each query reads only the last W keys, itself included (Mistral); 0 = full causal
  # With sliding_window: 0 = every layer slides; N ≥ 2 = layer i (from 0) is global (full causal) when (i + 1) % N
  # == 0 and local (windowed) otherwise (Gemma 2: 2, Gemma 3: 6).
  sliding_window_pattern: int = 0
  # Rotary base of the local layers under sliding_window_pattern, which take no rope scaling; 0 = rope_theta
  # (Gemma 3: 10,000 while the global layers use rope_theta 1,000,000 and a linear factor of 8).
  rope_local_theta: float = 0.0
  attention_scale_dim: int = 0  # attention logits are q·k / √this; 0 = head_dim (Gemma: query_pre_attn_scalar)
  # > 0: attention logits become cap · tanh(logits / cap) before the mask (Gemma 2); attention_impl 'xla' then
  # computes attention with the 'reference' einsums (jax.nn.dot_product_attention has no cap), 'cudnn' is refused
  attention_softcap: float = 0.0
  final_logit_softcap: float = 0.0  # > 0: output logits become cap · tanh(logits / cap) (Gemma 2)
  valid_vocab_size: int = 0  # 0 = all rows; else rows ≥ this are padding (for sharding) and masked out of the softmax
  # Mixture of experts (model/moe.py): the MLP of every moe_every-th layer becomes num_experts experts of the model's
  # MLP kind, each token sent to its moe_top_k most probable by a float32 router. 0 experts = a dense model.
  num_experts: int = 0  # experts per MoE layer; 0 = no MoE layers
  moe_top_k: int = 2  # experts each token is sent to (1: Switch, gate = router probability; ≥ 2: gates renormalised)
  moe_every: int = 1  # layers N, 2N, ... are MoE (the others dense); 1 = every layer (Mixtral), 2 = GShard / Switch
  moe_d_ff: int = 0  # hidden width of one expert; 0 = d_ff
  moe_capacity_factor: float = 1.25  # each expert takes ≤ ceil(top_k × group tokens × this / num_experts) per group
  moe_dropless: bool = False  # capacity = the whole group: no token dropped (num_experts / top_k × the expert FLOPs)
  moe_group_size: int = 0  # tokens per routing group (capacity is per group); 0 = one sequence
  moe_load_balancing_weight: float = 0.01  # weight of the Switch/GShard load-balancing loss (mean over MoE layers)
  moe_router_z_weight: float = 0.001  # weight of the ST-MoE router z-loss (mean over MoE layers)

  @property
  def kv_heads(self) -> int:
    return self.num_kv_heads or self.num_heads

  @property
  def fused_qkv(self) -> bool:
    """Multi-head attention keeps one fused (D, 3, H, Dh) projection; grouped-query splits query and key_value."""
    return self.kv_heads == self.num_heads

  @property
  def gated_mlp(self) -> bool:
    """The MLP has a gate projection beside its input one (swiglu, geglu): three matrices, not two."""
    return self.mlp_activation != "gelu"

  @property
  def expert_d_ff(self) -> int:
    return self.moe_d_ff or self.d_ff

  @property
  def layers_per_unit(self) -> int:
    """Layers per element of the stacked layer scan: moe_every (moe_every − 1 dense + 1 MoE) with experts, else 1."""
    return self.moe_every if self.num_experts else 1

  @property
  def num_units(self) -> int:
    """Elements of the stacked layer scan (the LAYERS axis of `blocks`, split over pipeline stages)."""
    return self.num_layers // self.layers_per_unit

  @property
  def num_moe_layers(self) -> int:
    return self.num_units if self.num_experts else 0

  @property
  def layer_unroll(self) -> int:
    """lax.scan's unroll for the stacked layers: scan_unroll, or for 0 (auto) every element with the CPU kernels
    (cpu_kernels.enabled) and no remat, else 1."""
    if self.scan_unroll:
      return self.scan_unroll
    return max(self.num_units, 1) if self.remat_policy == "none" and cpu_kernels.enabled() else 1

  @property
  def blocks_stage_ordered(self) -> bool:
    """Whether the stacked blocks this config runs on are in stage order (interleaved pipeline, set by the trainer)."""
    return self.blocks_in_stage_order and self.num_stages > 1 and self.pipeline_repeats > 1

  @property
  def head_dim(self) -> int:
    return self.attention_head_dim or self.d_model // self.num_heads

  @property
  def compute_dtype(self):
    return DTYPES[self.dtype]

  def validate(self) -> None:
    """Raises ValueError naming the offending field."""
    if self.attention_head_dim < 0:
      raise ValueError(f"GPTConfig.attention_head_dim={self.attention_head_dim} must be >= 0 (0 = d_model / "
                       f"num_heads)")
    if self.d_model % self.num_heads and not self.attention_head_dim:
      raise ValueError(f"GPTConfig.d_model={self.d_model} is not divisible by num_heads={self.num_heads} (or set "
                       f"attention_head_dim)")
    if self.scan_unroll < 0:
      raise ValueError(f"GPTConfig.scan_unroll={self.scan_unroll} must be >= 0 (0 = auto, 1 = a rolled loop)")
    if self.remat_policy not in REMAT_POLICIES:
      raise ValueError(f"GPTConfig.remat_policy={self.remat_policy!r}: expected one of {REMAT_POLICIES}")
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ValueError(f"GPTConfig.attention_impl={self.attention_impl!r}: expected one of {ATTENTION_IMPLS}")
    if self.context_parallelism not in CONTEXT_PARALLELISMS:
      raise ValueError(f"GPTConfig.context_parallelism={self.context_parallelism!r}: expected one of "
                       f"{CONTEXT_PARALLELISMS}")
    if self.context_parallelism == "ring" and (self.num_stages > 1 or self.sliding_window_pattern):
      why = (f"num_stages={self.num_stages} (pipeline stages)" if self.num_stages > 1 else
             f"sliding_window_pattern={self.sliding_window_pattern} (local and global layers in one layer scan)")
      raise ValueError(f"GPTConfig.context_parallelism='ring' does not support {why}; use 'all_gather'")
    self._validate_gemma_options()  # before the backend check: a cudnn refusal for soft-capping holds on any backend
    if self.attention_impl == "cudnn" and jax.default_backend() != "gpu":
      raise ValueError(f"GPTConfig.attention_impl='cudnn' needs an NVIDIA GPU (backend is "
                       f"{jax.default_backend()}); use 'xla' (same jax.nn.dot_product_attention, XLA kernels)")
    if self.attention_impl == "splash":
      why = self._splash_lacks()
      if why:
        raise ValueError(f"GPTConfig.attention_impl='splash' does not support {why}; use 'reference' or 'auto'")
      if jax.default_backend() == "gpu":
        raise ValueError("GPTConfig.attention_impl='splash' is a TPU kernel (Pallas/Mosaic); on a GPU use 'cudnn' "
                         "or 'auto'")
    if self.dtype not in DTYPES:
      raise ValueError(f"GPTConfig.dtype={self.dtype!r}: expected one of {tuple(DTYPES)}")
    if self.remat_policy == "offload_dots" and not _has_host_offload():
      raise ValueError(f"GPTConfig.remat_policy='offload_dots' needs a 'pinned_host' memory space, which the "
                       f"{jax.default_backend()} backend does not have; use 'save_dots' or 'full'")
    for name, value, allowed in (("norm", self.norm, NORMS), ("mlp_activation", self.mlp_activation, MLP_ACTIVATIONS),
                                 ("position_embedding", self.position_embedding, POSITION_EMBEDDINGS)):
      if value not in allowed:
        raise ValueError(f"GPTConfig.{name}={value!r}: expected one of {allowed}")
    if self.num_kv_heads < 0 or self.num_heads % self.kv_heads:
      raise ValueError(f"GPTConfig.num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads} "
                       f"(0 = num_heads)")
    if self.position_embedding == "rope" and self.head_dim % 2:
      raise ValueError(f"GPTConfig.position_embedding='rope' needs an even head_dim, got {self.head_dim} "
                       f"(d_model={self.d_model} / num_heads={self.num_heads})")
    if self.rope_scaling_factor < 1.0 or self.rope_high_freq_factor <= self.rope_low_freq_factor:
      raise ValueError(f"GPTConfig rope scaling: need rope_scaling_factor >= 1 and rope_high_freq_factor > "
                       f"rope_low_freq_factor, got {self.rope_scaling_factor}, {self.rope_high_freq_factor}, "
                       f"{self.rope_low_freq_factor}")
    if self.sliding_window < 0:
      raise ValueError(f"GPTConfig.sliding_window={self.sliding_window} must be >= 0 (0 = full causal attention)")
    if self.valid_vocab_size < 0 or self.valid_vocab_size > self.vocab_size:
      raise ValueError(f"GPTConfig.valid_vocab_size={self.valid_vocab_size} must be in [0, vocab_size="
                       f"{self.vocab_size}]")
    self._validate_moe()
    if self.num_units % self.num_stages:
      raise ValueError(f"{self._layers_key}={self.num_units} is not divisible by "
                       f"{self.num_stages} pipeline stages")
    if self.pipeline_repeats < 1 or self.num_units % (self.num_stages * self.pipeline_repeats):
      raise ValueError(f"GPTConfig.pipeline_repeats={self.pipeline_repeats}: {self._layers_key}={self.num_units} "
                       f"must be divisible by num_stages × pipeline_repeats = {self.num_stages} × "
                       f"{self.pipeline_repeats}")
    if self.num_stages > 1 and self.pipeline_repeats > 1 and pipeline_microbatches(self) < self.num_stages:
      raise ValueError(f"GPTConfig.pipeline_microbatches={self.pipeline_microbatches} < num_stages="
                       f"{self.num_stages}: the interleaved schedule (pipeline_repeats={self.pipeline_repeats}) "
                       f"needs at least one microbatch per stage")

  def _validate_gemma_options(self) -> None:
    if self.rope_scaling not in ROPE_SCALINGS:
      raise ValueError(f"GPTConfig.rope_scaling={self.rope_scaling!r}: expected one of {ROPE_SCALINGS}")
    if self.sliding_window_pattern < 0 or self.sliding_window_pattern == 1:
      raise ValueError(f"GPTConfig.sliding_window_pattern={self.sliding_window_pattern} must be 0 (every layer "
                       f"slides) or ≥ 2 (every N-th layer global)")
    if self.sliding_window_pattern and not self.sliding_window:
      raise ValueError(f"GPTConfig.sliding_window_pattern={self.sliding_window_pattern} needs a sliding_window > 0")
    if self.rope_local_theta < 0 or (self.rope_local_theta and not self.sliding_window_pattern):
      raise ValueError(f"GPTConfig.rope_local_theta={self.rope_local_theta} needs sliding_window_pattern ≥ 2 (it is "
                       f"the local layers' rotary base) and must be ≥ 0")
    for key in ("attention_scale_dim", "attention_softcap", "final_logit_softcap"):
      if getattr(self, key) < 0:
        raise ValueError(f"GPTConfig.{key}={getattr(self, key)} must be ≥ 0 (0 = off)")
    if self.attention_softcap and self.attention_impl == "cudnn":
      raise ValueError(f"GPTConfig.attention_softcap={self.attention_softcap} is not supported by attention_impl="
                       f"'cudnn' (cuDNN's flash attention has no logit soft-capping); use 'xla' or 'reference'")

  def _splash_lacks(self) -> str:
    """What the model uses that attention_impl='splash' cannot do here ("" for nothing)."""
    if self.sliding_window_pattern:
      return (f"sliding_window_pattern={self.sliding_window_pattern} (local and global layers in one layer scan "
              "need two kernels)")
    return ""

  def attention_kernel(self) -> str:
    """The attention implementation the model runs: attention_impl, with 'auto' resolved for the backend (cudnn
    on GPU unless soft-capping, splash on TPU unless _splash_lacks, else xla)."""
    if self.attention_impl != "auto":
      return self.attention_impl
    backend = jax.default_backend()
    if backend == "gpu" and not self.attention_softcap:
      return "cudnn"
    if backend == "tpu" and not self._splash_lacks():
      return "splash"
    return "xla"

  def layer_is_local(self, layer):
    """Whether layer `layer` (an int or a traced scalar) slides under sliding_window_pattern (a bool of its kind);
    None when every layer attends alike (no pattern)."""
    if not (self.sliding_window and self.sliding_window_pattern):
      return None
    return (layer + 1) % self.sliding_window_pattern != 0

  @property
  def _layers_key(self) -> str:
    return "GPTConfig.num_layers" if self.layers_per_unit == 1 else "GPTConfig.num_layers / moe_every"

  def _validate_moe(self) -> None:
    if self.num_experts < 0:
      raise ValueError(f"GPTConfig.num_experts={self.num_experts} must be ≥ 0 (0 = a dense model)")
    if not self.num_experts:
      return
    checks = (
        ("moe_top_k", self.moe_top_k, 1 <= self.moe_top_k <= self.num_experts,
         f"must be in [1, num_experts={self.num_experts}]"),
        ("moe_capacity_factor", self.moe_capacity_factor, self.moe_capacity_factor > 0,
         "must be > 0 (moe_dropless=True for no capacity limit)"),
        ("moe_every", self.moe_every, self.moe_every >= 1 and self.num_layers % self.moe_every == 0,
         f"must be ≥ 1 and divide num_layers={self.num_layers}"),
        ("moe_d_ff", self.moe_d_ff, self.moe_d_ff >= 0, "must be ≥ 0 (0 = d_ff)"),
        ("moe_group_size", self.moe_group_size, self.moe_group_size >= 0, "must be ≥ 0 (0 = one sequence)"),
        ("moe_load_balancing_weight", self.moe_load_balancing_weight, self.moe_load_balancing_weight >= 0,
         "must be ≥ 0"),
        ("moe_router_z_weight", self.moe_router_z_weight, self.moe_router_z_weight >= 0, "must be ≥ 0"),
    )
    for key, value, ok, expected in checks:
      if not ok:
        raise ValueError(f"GPTConfig.{key}={value} {expected}")

  def sharded_dims(self) -> tuple:
    """The widths the rules table shards, with the logical axis that splits each (parallel.layout.check)."""
    return (layout.Dim("GPTConfig.num_heads", self.num_heads, ax.HEADS),
            layout.Dim("GPTConfig.d_ff", self.d_ff, ax.MLP),
            layout.Dim("GPTConfig.vocab_size", self.vocab_size, ax.VOCAB),
            layout.Dim("GPTConfig.d_model", self.d_model, ax.EMBED),
            layout.Dim(self._layers_key, self.num_units, ax.LAYERS)) + (
                (layout.Dim("GPTConfig.num_experts", self.num_experts, ax.EXPERT),
                 layout.Dim("GPTConfig.moe_d_ff", self.expert_d_ff, ax.MLP)) if self.num_experts else ()) + (
                # grouped-query key/value heads (a multi-head model has none apart from its heads)
                (layout.Dim("GPTConfig.num_kv_heads", self.kv_heads, ax.KV_HEADS),) if not self.fused_qkv else ())


def _has_host_offload() -> bool:
  """Whether the default backend can offload saved activations to host memory ('pinned_host')."""
  return "pinned_host" in {memory.kind for memory in jax.devices()[0].addressable_memories()}


def pipeline_microbatches(config: GPTConfig) -> int:
  """Pipeline microbatches per forward pass: `pipeline_microbatches`, or 2 × stages when it is 0."""
  return config.pipeline_microbatches or 2 * config.num_stages


def check_layout(config: GPTConfig, mesh_shape, rules=None, *, batch_size: int, num_microbatches: int = 1,
                 seq_len: int = 0) -> None:
  """parallel.layout.check for this model: its widths, stages and pipeline microbatches, the batch and the length."""
  layout.check(mesh_shape, rules, dims=config.sharded_dims(), batch_size=batch_size,
               num_microbatches=num_microbatches, num_stages=config.num_stages,
               pipeline_microbatches=pipeline_microbatches(config), seq_len=seq_len)
