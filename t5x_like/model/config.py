"""GPT decoder configuration: the dataclass that fixes the model's function and its execution policy."""

import dataclasses

import jax
import jax.numpy as jnp

from t5x_like.parallel import axis_names as ax
from t5x_like.parallel import layout

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

  def sharded_dims(self) -> tuple:
    """The widths the rules table shards, with the logical axis that splits each (parallel.layout.check)."""
    return (layout.Dim("GPTConfig.num_heads", self.num_heads, ax.HEADS),
            layout.Dim("GPTConfig.d_ff", self.d_ff, ax.MLP),
            layout.Dim("GPTConfig.vocab_size", self.vocab_size, ax.VOCAB),
            layout.Dim("GPTConfig.d_model", self.d_model, ax.EMBED),
            layout.Dim("GPTConfig.num_layers", self.num_layers, ax.LAYERS))


def _has_host_offload() -> bool:
  """Whether the default backend can offload saved activations to host memory ('pinned_host')."""
  return "pinned_host" in {memory.kind for memory in jax.devices()[0].addressable_memories()}


def pipeline_microbatches(config: GPTConfig) -> int:
  """Pipeline microbatches per forward pass: `pipeline_microbatches`, or 2 × stages when it is 0."""
  return config.pipeline_microbatches or 2 * config.num_stages


def check_layout(config: GPTConfig, mesh_shape, rules=None, *, batch_size: int, num_microbatches: int = 1) -> None:
  """parallel.layout.check for this model: its widths, stages and pipeline microbatches, and the batch."""
  layout.check(mesh_shape, rules, dims=config.sharded_dims(), batch_size=batch_size,
               num_microbatches=num_microbatches, num_stages=config.num_stages,
               pipeline_microbatches=pipeline_microbatches(config))
