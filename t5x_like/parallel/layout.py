"""The one layout validator: does a model and a batch split evenly over a mesh under the rules in use?

Each sharded dimension is described by the code that owns it (the model config names its widths with
logical axis names, the run names its batch), and the rules table in use says which mesh axes split
that logical axis. So a custom `axis_rules` is checked as it will run, and no module but the rules
table knows which mesh axis splits what. Called by the trainer, the planner and the memory model
before anything is traced or compiled.
"""

import dataclasses
import math
from typing import Iterable, Mapping, Optional

from t5x_like.parallel import axis_names as ax
from t5x_like.parallel import partitioning


@dataclasses.dataclass(frozen=True)
class Dim:
  """A dimension that must split evenly: `key` is what the user sets (e.g. 'GPTConfig.num_heads')."""
  key: str
  size: int
  logical_axis: str


def mesh_axes(logical_axis: str, rules: partitioning.Rules) -> tuple:
  """The mesh axes that split `logical_axis` under `rules` (first matching rule, as flax resolves them)."""
  for name, target in rules:
    if name == logical_axis:
      if target is None:
        return ()
      return tuple(target) if isinstance(target, (tuple, list)) else (target,)
  return ()


def ways(logical_axis: str, mesh_shape: Mapping[str, int], rules: partitioning.Rules) -> tuple:
  """(number of shards, 'MESH_SHAPE[a]×...' description) of `logical_axis` on this mesh."""
  axes = mesh_axes(logical_axis, rules)
  n = math.prod(int(mesh_shape.get(a, 1)) for a in axes)
  return n, "×".join(f"MESH_SHAPE['{a}']" for a in axes) or "1"


def check(mesh_shape: Mapping[str, int], rules: Optional[partitioning.Rules] = None, *,
          dims: Iterable[Dim] = (), batch_size: int, num_microbatches: int = 1, num_stages: int = 1,
          pipeline_microbatches: int = 0, seq_len: int = 0) -> None:
  """Raises ValueError naming the key, its value and the mesh axes, for a layout that cannot run.

  Args:
    mesh_shape: the resolved MESH_SHAPE (or `mesh.shape`).
    rules: the logical→mesh rules the run uses (default partitioning.DEFAULT_RULES).
    dims: the model's sharded dimensions (`GPTConfig.sharded_dims()`).
    batch_size: BATCH_SIZE, global sequences per optimizer step.
    num_microbatches: NUM_MICROBATCHES (gradient accumulation).
    num_stages: the model's pipeline stages; must equal the shards of the STAGE axis.
    pipeline_microbatches: microbatches streamed through the pipeline per accumulation microbatch.
    seq_len: SEQ_LEN, tokens per sequence, split over the mesh axes of `length` (context parallelism); 0 = unchecked.
  """
  rules = tuple(rules or partitioning.DEFAULT_RULES)
  for dim in dims:
    n, desc = ways(dim.logical_axis, mesh_shape, rules)
    if dim.size % n:
      raise ValueError(f"{dim.key}={dim.size} is not divisible by {desc}={n} "
                       f"(logical axis '{dim.logical_axis}' under the axis rules in use)")
  stages, stage_desc = ways(ax.STAGE, mesh_shape, rules)
  if num_stages != stages:
    raise ValueError(f"GPTConfig.num_stages={num_stages} differs from {stage_desc}={stages}")
  positions, length_desc = ways(ax.LENGTH, mesh_shape, rules)
  if seq_len and seq_len % positions:
    raise ValueError(f"SEQ_LEN={seq_len} is not divisible by {length_desc}={positions} (logical axis "
                     f"'{ax.LENGTH}' under the axis rules in use)")
  rows, row_desc = ways(ax.BATCH, mesh_shape, rules)
  if num_microbatches < 1 or batch_size % (rows * num_microbatches):
    raise ValueError(f"BATCH_SIZE={batch_size} is not divisible by {row_desc}×NUM_MICROBATCHES = "
                     f"{rows}×{num_microbatches}")
  if stages > 1:
    per_step = batch_size // num_microbatches
    if per_step % (pipeline_microbatches * rows):
      raise ValueError(f"GPTConfig.pipeline_microbatches={pipeline_microbatches} (pipeline microbatches; 0 means "
                       f"2 × stages): "
                       f"BATCH_SIZE/NUM_MICROBATCHES = {per_step} rows are not divisible by "
                       f"{pipeline_microbatches} microbatches × {row_desc}={rows}")
