"""Logical→mesh axis rules (the one table) and the shardings of parameters, optimizer state and batches."""

from typing import Any, Mapping, Sequence

import flax.linen as nn
import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from t5x_like import axis_names as ax

Rules = Sequence[tuple]

# The only place that names mesh axes. Each logical axis maps to a mesh axis, a tuple of them, or None.
DEFAULT_RULES: Rules = (
    (ax.BATCH, ("data", "fsdp")),
    (ax.EMBED, "fsdp"),
    (ax.MLP, "tensor"),
    (ax.HEADS, "tensor"),
    (ax.VOCAB, "tensor"),
    (ax.LAYERS, "pipeline"),
    (ax.STAGE, "pipeline"),
    (ax.LENGTH, None),
    (ax.KV, None),
    (ax.NORM, None),
    (ax.POSITION, None),
    (ax.ACT_EMBED, None),
    (ax.ACT_HEADS, "tensor"),
    (ax.ACT_MLP, "tensor"),
    (ax.ACT_VOCAB, "tensor"),
)


def logical_to_mesh_spec(logical: P, rules: Rules = DEFAULT_RULES) -> P:
  """PartitionSpec of logical names → PartitionSpec of mesh axes."""
  return nn.logical_to_mesh_axes(tuple(logical), rules)


def shardings_from_boxed(boxed_tree: Any, mesh: jax.sharding.Mesh, rules: Rules = DEFAULT_RULES) -> Any:
  """NamedShardings for a tree whose leaves may be boxed with logical names (unboxed leaves replicate)."""
  logical = nn.get_partition_spec(boxed_tree)
  return jax.tree.map(lambda spec: NamedSharding(mesh, logical_to_mesh_spec(spec, rules)), logical,
                      is_leaf=lambda x: isinstance(x, P))


def unbox(tree: Any) -> Any:
  """Strips logical-axis boxes without adding sharding constraints (safe outside jit, on abstract values)."""
  return jax.tree.map(lambda x: x.value if isinstance(x, nn.meta.AxisMetadata) else x, tree,
                      is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))


def batch_sharding(mesh: jax.sharding.Mesh, rules: Rules = DEFAULT_RULES) -> NamedSharding:
  """Sharding of a (batch, length) input array."""
  return NamedSharding(mesh, logical_to_mesh_spec(P(ax.BATCH, ax.LENGTH), rules))


def replicated(mesh: jax.sharding.Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def bytes_per_device(tree: Any) -> dict:
  """{device: bytes held} over all addressable shards of the arrays in `tree`."""
  held = {}
  for leaf in jax.tree.leaves(tree):
    for shard in leaf.addressable_shards:
      held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
  return held


def check_layout(model_config, mesh_shape: Mapping[str, int], batch_size: int, num_microbatches: int) -> None:
  """Raises ValueError, naming the config key, for a model/batch that the mesh cannot split evenly.

  Runs before anything is traced or compiled. `mesh_shape` is the resolved MESH_SHAPE (or mesh.shape).
  """
  from t5x_like import pipeline  # pylint: disable=g-import-not-at-top  (pipeline imports the model)
  size = lambda axis: int(mesh_shape.get(axis, 1))
  cfg, tensor, stages = model_config, size("tensor"), size("pipeline")
  for key, value in (("num_heads", cfg.num_heads), ("d_ff", cfg.d_ff), ("vocab_size", cfg.vocab_size)):
    if value % tensor:
      raise ValueError(f"GPTConfig.{key}={value} is not divisible by MESH_SHAPE['tensor']={tensor}")
  if cfg.d_model % size("fsdp"):
    raise ValueError(f"GPTConfig.d_model={cfg.d_model} is not divisible by MESH_SHAPE['fsdp']={size('fsdp')}")
  if cfg.num_stages != stages:
    raise ValueError(f"GPTConfig.num_stages={cfg.num_stages} differs from MESH_SHAPE['pipeline']={stages}")
  if cfg.num_layers % stages:
    raise ValueError(f"GPTConfig.num_layers={cfg.num_layers} is not divisible by MESH_SHAPE['pipeline']={stages}")
  rows = size("data") * size("fsdp")
  if num_microbatches < 1 or batch_size % (rows * num_microbatches):
    raise ValueError(f"BATCH_SIZE={batch_size} is not divisible by data×fsdp×NUM_MICROBATCHES = "
                     f"{size('data')}×{size('fsdp')}×{num_microbatches}")
  if stages > 1:
    m = pipeline.num_microbatches(cfg)
    per_step = batch_size // num_microbatches
    if per_step % (m * rows):
      raise ValueError(f"GPTConfig.pipeline_microbatches={cfg.pipeline_microbatches} (→ {m} pipeline microbatches): "
                       f"BATCH_SIZE/NUM_MICROBATCHES = {per_step} rows are not divisible by "
                       f"{m} microbatches × data×fsdp={rows}")
