"""Device mesh over (pipeline, data, fsdp, tensor) built from MESH_SHAPE; −1 fills the remaining devices."""

import math
from typing import Mapping, Optional, Sequence

import jax
import numpy as np

AXES = ("pipeline", "data", "fsdp", "tensor")  # outermost first; tensor innermost (fastest links)


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


def create_mesh(mesh_shape: Mapping[str, int], devices: Optional[Sequence[jax.Device]] = None) -> jax.sharding.Mesh:
  """A mesh with Auto axis types, ordered so `tensor` spans the closest devices.

  On one host `jax.make_mesh` orders devices by the physical topology (ICI rings on TPU). With several
  processes, the outer axes (pipeline, data) are laid across hosts and the inner ones (fsdp, tensor)
  within a host where they fit, so the chattiest collectives stay on NVLink/ICI.
  """
  devices = list(devices) if devices is not None else jax.devices()
  shape = resolve_mesh_shape(mesh_shape, len(devices))
  sizes = tuple(shape[name] for name in AXES)
  axis_types = (jax.sharding.AxisType.Auto,) * len(AXES)
  if devices == jax.devices():
    return jax.make_mesh(sizes, AXES, axis_types=axis_types)
  # An explicit device list (tests, sub-meshes): keep the caller's order, process-major.
  ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
  return jax.sharding.Mesh(np.array(ordered).reshape(sizes), AXES, axis_types=axis_types)


def data_parallel_size(mesh: jax.sharding.Mesh) -> int:
  """How many ways the batch is split (data × fsdp)."""
  return mesh.shape["data"] * mesh.shape["fsdp"]
