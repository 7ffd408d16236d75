"""Device mesh over (pipeline, data, fsdp, sequence, expert, tensor) built from MESH_SHAPE; −1 fills the rest."""

import math
from typing import Mapping, Optional, Sequence

import jax
from jax.experimental import mesh_utils
import numpy as np

# Outermost first; tensor innermost (fastest links), expert next to it (its all-to-alls are the next chattiest),
# then sequence (context parallelism: an all-gather of keys and values per layer).
AXES = ("pipeline", "data", "fsdp", "sequence", "expert", "tensor")


def resolve_mesh_shape(mesh_shape: Mapping[str, int], num_devices: int) -> dict:
  """Validates MESH_SHAPE and replaces a single −1 with whatever fills `num_devices`.

  Example: {'pipeline': 1, 'data': -1, 'fsdp': 2, 'tensor': 2} on 8 devices → data = 2.

  Raises:
    ValueError: naming MESH_SHAPE, the offending key or value and the device count.
  """
  unknown = set(mesh_shape) - set(AXES)
  if unknown:
    raise ValueError(f"MESH_SHAPE has unknown axes {sorted(unknown)}; expected keys {list(AXES)}")
  shape = {name: int(mesh_shape.get(name, 1)) for name in AXES}
  fills = [name for name, size in shape.items() if size == -1]
  bad = [f"{name}={size}" for name, size in shape.items() if size == 0 or size < -1]
  if bad:
    raise ValueError(f"MESH_SHAPE {dict(mesh_shape)}: sizes must be positive or -1, found {', '.join(bad)}")
  if len(fills) > 1:
    raise ValueError(f"MESH_SHAPE {dict(mesh_shape)}: only one axis may be -1, found {fills}")
  fixed = math.prod(size for size in shape.values() if size != -1)
  if fills:
    if num_devices % fixed:
      raise ValueError(f"MESH_SHAPE {dict(mesh_shape)}: the fixed axes multiply to {fixed}, which does not "
                       f"divide the {num_devices} available devices")
    shape[fills[0]] = num_devices // fixed
  if math.prod(shape.values()) != num_devices:
    raise ValueError(f"MESH_SHAPE {dict(mesh_shape)} needs {math.prod(shape.values())} devices but "
                     f"{num_devices} are available")
  return shape


def split_over_granules(shape: Mapping[str, int], num_granules: int) -> tuple:
  """(per-granule shape, across-granule shape), each a dict over the AXES `shape` names: the slower links between
  granules (slices over DCN, or hosts over the network) go to the outermost axes first.

  Example: {'pipeline': 2, 'data': 4, 'fsdp': 2, 'expert': 1, 'tensor': 8} over 4 slices → across:
  pipeline 2, data 2; within a slice: data 2, fsdp 2, tensor 8. `expert` crosses granules only when
  the axes outside it cannot absorb them (its all-to-alls would then run over the slow links).

  Raises:
    ValueError: when the outer axes cannot absorb `num_granules` (it would split `tensor` over DCN).
  """
  across, left = {}, num_granules
  names = [name for name in AXES if name in shape]
  for name in names:
    across[name] = math.gcd(shape[name], left) if name != "tensor" else 1
    left //= across[name]
  if left != 1:
    raise ValueError(f"MESH_SHAPE {dict(shape)} cannot spread {num_granules} slices/hosts over its outer axes "
                     f"(pipeline, data, fsdp, expert): make their product a multiple of {num_granules}")
  return {name: shape[name] // across[name] for name in names}, across


def _num_granules(devices: Sequence[jax.Device]) -> tuple:
  """(granules, process_is_granule): TPU slices, or GPU hosts; 1 where one fast fabric joins all."""
  slices = {getattr(d, "slice_index", 0) for d in devices}
  if len(slices) > 1:
    return len(slices), False
  processes = {d.process_index for d in devices}
  if len(processes) > 1 and devices[0].platform == "gpu":
    return len(processes), True
  return 1, False


def create_mesh(mesh_shape: Mapping[str, int], devices: Optional[Sequence[jax.Device]] = None) -> jax.sharding.Mesh:
  """A mesh with Auto axis types, ordered so `tensor` spans the closest devices.

  Within one slice (any number of TPU hosts) `jax.make_mesh` orders devices by the physical topology
  (ICI rings). Across TPU slices, or GPU hosts, `create_hybrid_device_mesh` puts the outer axes
  (pipeline, then data, then fsdp) over the slow DCN/network links and keeps `tensor` and the rest
  within a slice/host (`split_over_granules`), so the chattiest collectives stay on ICI/NVLink.
  """
  devices = list(devices) if devices is not None else jax.devices()
  shape = resolve_mesh_shape(mesh_shape, len(devices))
  sizes = tuple(shape[name] for name in AXES)
  axis_types = (jax.sharding.AxisType.Auto,) * len(AXES)
  if devices == jax.devices():
    granules, process_is_granule = _num_granules(devices)
    if granules > 1:  # multi-slice TPU / multi-node GPU: DCN axes outermost, ICI/NVLink inside
      within, across = split_over_granules(shape, granules)
      ordered = mesh_utils.create_hybrid_device_mesh([within[n] for n in AXES], [across[n] for n in AXES],
                                                     devices, process_is_granule=process_is_granule)
      return jax.sharding.Mesh(ordered, AXES, axis_types=axis_types)
    return jax.make_mesh(sizes, AXES, axis_types=axis_types)
  # An explicit device list (tests, sub-meshes): keep the caller's order, process-major.
  ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
  return jax.sharding.Mesh(np.array(ordered).reshape(sizes), AXES, axis_types=axis_types)


def data_parallel_size(mesh: jax.sharding.Mesh) -> int:
  """How many ways the batch is split (data × fsdp × expert)."""
  return mesh.shape["data"] * mesh.shape["fsdp"] * mesh.shape["expert"]
