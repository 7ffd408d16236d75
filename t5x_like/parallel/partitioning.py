"""Logical→mesh axis rules (the one table) and the shardings of parameters, optimizer state and batches."""

from typing import Any, Mapping, Sequence

import flax.linen as nn
import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from t5x_like.parallel import axis_names as ax

Rules = Sequence[tuple]

# The only place that names mesh axes. Each logical axis maps to a mesh axis, a tuple of them, or None.
DEFAULT_RULES: Rules = (
    # `expert` splits the batch too: outside MoE layers it is one more data-parallel axis, and a
    # dispatch trades the batch split over `expert` for the expert split (an all-to-all).
    (ax.BATCH, ("data", "fsdp", "expert")),
    (ax.EMBED, "fsdp"),
    (ax.MLP, "tensor"),
    (ax.HEADS, "tensor"),
    (ax.KV_HEADS, "tensor"),  # with multi-query (1 kv head) map this to None: the one head is replicated
    (ax.VOCAB, "tensor"),
    (ax.LAYERS, "pipeline"),
    (ax.STAGE, "pipeline"),
    # Context parallelism: activations split along the sequence; attention all-gathers keys and values
    # (kv_length whole), parameters are replicated over `sequence` and their gradients all-reduced over it.
    (ax.LENGTH, "sequence"),
    (ax.KV_LENGTH, None),
    (ax.KV, None),
    (ax.NORM, None),
    (ax.POSITION, None),
    (ax.ACT_EMBED, None),
    (ax.ACT_HEADS, "tensor"),
    (ax.ACT_KV_HEADS, "tensor"),
    (ax.ACT_MLP, "tensor"),
    (ax.ACT_VOCAB, "tensor"),
    (ax.EXPERT, "expert"),
    (ax.ACT_EXPERT, "expert"),
    (ax.EXPERT_GROUPS, ("data", "fsdp")),
)


def logical_to_mesh_spec(logical: P, rules: Rules = DEFAULT_RULES) -> P:
  """PartitionSpec of logical names → PartitionSpec of mesh axes."""
  return nn.logical_to_mesh_axes(tuple(logical), rules)


def shardings_from_boxed(boxed_tree: Any, mesh: jax.sharding.Mesh, rules: Rules = DEFAULT_RULES) -> Any:
  """NamedShardings for a tree whose leaves may be boxed with logical names (unboxed leaves replicate). The
  tree's structure is kept as it is, empty nodes included (optax's MaskedNode of a partitioned optimizer)."""
  def sharding(leaf):
    if isinstance(leaf, nn.meta.AxisMetadata) and not jax.tree.leaves(leaf.value):
      return leaf.value  # a box around an empty node (optax masks boxed leaves through to their values)
    spec = leaf.get_partition_spec() if isinstance(leaf, nn.meta.AxisMetadata) else P()
    return NamedSharding(mesh, logical_to_mesh_spec(spec, rules))
  return jax.tree.map(sharding, boxed_tree, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))


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
