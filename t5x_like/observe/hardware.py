"""Accelerator catalogue (peak FLOP/s, memory, interconnect) as data, and a measured CPU matmul peak.

The catalogue is a plain dict of `Hardware` records. Add or override entries from a JSON file named
by `$T5X_LIKE_HARDWARE` (read on import) or passed to `load_file` / `plan --hardware_file`:

    {"my_gpu": {"peak_flops": {"bfloat16": 5e14, "float32": 6e13}, "hbm_bytes": 4.8e10,
                "intra_host_bw": 2e11, "inter_host_bw": 2.5e10, "devices_per_host": 8,
                "device_kinds": ["My GPU"]}}

Units: FLOP/s per device (dense, no sparsity); bytes; bytes/s per device per direction as one ring
along one mesh axis sees it (NVLink: half the bidirectional figure; InfiniBand: one NIC per GPU;
TPU ICI: two links of one torus axis, one way). TPU hosts of one slice share ICI, so their
`inter_host_bw` is the ICI figure too. `float32` peaks are what `jnp.dot` runs at by default:
TF32 tensor cores on NVIDIA (XLA's default precision), one bfloat16 pass on TPU.
"""

import dataclasses
import functools
import json
import os
import time
from typing import Optional

import jax
import jax.numpy as jnp

_GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Hardware:
  """One accelerator type, per device."""
  name: str
  peak_flops: dict  # dtype name → dense FLOP/s; None values (CPU) mean "measure"
  hbm_bytes: float  # device memory
  intra_host_bw: float  # bytes/s per device per direction between devices of one host
  inter_host_bw: float  # bytes/s per device per direction across hosts
  devices_per_host: int  # devices behind one host (one NVLink/ICI island for GPUs)
  device_kinds: tuple = ()  # substrings of jax's `device_kind`, any of which identifies this hardware
  source: str = ""  # where the figures come from


def _gpu(name, bf16, tf32, hbm_gib, nvlink_bidir, ib_gbit, kinds, source):
  return Hardware(name=name, peak_flops={"bfloat16": bf16, "float16": bf16, "float32": tf32},
                  hbm_bytes=hbm_gib * _GiB, intra_host_bw=nvlink_bidir / 2, inter_host_bw=ib_gbit / 8 * 1e9,
                  devices_per_host=8, device_kinds=tuple(kinds), source=source)


def _tpu(name, bf16, hbm_gib, link_one_way, per_host, kinds, source):
  ring = 2 * link_one_way
  return Hardware(name=name, peak_flops={"bfloat16": bf16, "float16": bf16, "float32": bf16},
                  hbm_bytes=hbm_gib * _GiB, intra_host_bw=ring, inter_host_bw=ring, devices_per_host=per_host,
                  device_kinds=tuple(kinds), source=source)


# Order matters for device_kind matching: the first entry with a substring in device_kind wins.
CATALOGUE = {
    "a100-40gb": _gpu("a100-40gb", 312e12, 156e12, 40, 600e9, 200, ["A100-SXM4-40GB", "A100-PCIE-40GB", "A100 40GB"],
                      "NVIDIA A100 datasheet (SXM); DGX A100: 8x HDR 200 Gb/s"),
    "a100-80gb": _gpu("a100-80gb", 312e12, 156e12, 80, 600e9, 200, ["A100"],
                      "NVIDIA A100 datasheet (SXM); DGX A100: 8x HDR 200 Gb/s"),
    "h200": _gpu("h200", 989.4e12, 494.7e12, 140.4, 900e9, 400, ["H200"],
                 "NVIDIA H200 datasheet (SXM); 8x NDR 400 Gb/s"),
    "h100": _gpu("h100", 989.4e12, 494.7e12, 79.6, 900e9, 400, ["H100"],
                 "NVIDIA H100 datasheet (SXM); DGX H100: 8x NDR 400 Gb/s"),
    "tpu_v4": _tpu("tpu_v4", 275e12, 32, 45e9, 4, ["TPU v4"], "cloud.google.com/tpu/docs/v4"),
    "tpu_v5e": _tpu("tpu_v5e", 197e12, 16, 50e9, 8, ["TPU v5 lite", "TPU v5e"], "cloud.google.com/tpu/docs/v5e"),
    "tpu_v6e": _tpu("tpu_v6e", 918e12, 32, 100e9, 8, ["TPU v6"], "cloud.google.com/tpu/docs/v6e"),
    "tpu_v5p": _tpu("tpu_v5p", 459e12, 95, 100e9, 4, ["TPU v5p", "TPU v5"], "cloud.google.com/tpu/docs/v5p"),
    "cpu": Hardware(name="cpu", peak_flops={"bfloat16": None, "float16": None, "float32": None},
                    hbm_bytes=float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")), intra_host_bw=10e9, inter_host_bw=1.25e9, devices_per_host=8,
                    device_kinds=("cpu",), source="peak measured by measure_matmul_peak; memory = host RAM"),
}
ALIASES = {"a100": "a100-80gb", "h100-sxm": "h100", "v4": "tpu_v4", "v5e": "tpu_v5e", "v5p": "tpu_v5p",
           "v6e": "tpu_v6e", "tpu-v4": "tpu_v4", "tpu-v5e": "tpu_v5e", "tpu-v5p": "tpu_v5p", "tpu-v6e": "tpu_v6e"}


def load_file(path: str) -> list:
  """Adds (or overrides) catalogue entries from a JSON file; returns the names it defined."""
  try:
    with open(path) as f:
      entries = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise ValueError(f"hardware file {path}: {e}") from e
  if not isinstance(entries, dict):
    raise ValueError(f"hardware file {path}: expected a JSON object of name → fields")
  fields = {f.name for f in dataclasses.fields(Hardware)} - {"name"}
  for name, spec in entries.items():
    unknown = set(spec) - fields
    missing = fields - set(spec) - {"device_kinds", "source"}
    if unknown or missing:
      raise ValueError(f"hardware file {path}: entry {name!r}: unknown fields {sorted(unknown)}, "
                       f"missing {sorted(missing)}")
    spec = dict(spec, device_kinds=tuple(spec.get("device_kinds", ())), source=spec.get("source", path))
    CATALOGUE[name.lower()] = Hardware(name=name.lower(), **spec)
  return [n.lower() for n in entries]


if os.environ.get("T5X_LIKE_HARDWARE"):
  load_file(os.environ["T5X_LIKE_HARDWARE"])


def get(name: str) -> Hardware:
  """Catalogue entry by name (case-insensitive; aliases like 'v5e', 'a100' accepted)."""
  key = ALIASES.get(name.lower(), name.lower())
  if key not in CATALOGUE:
    raise ValueError(f"unknown hardware {name!r}: expected one of {sorted(CATALOGUE)} "
                     f"(or add it with a JSON file, see t5x_like/observe/hardware.py)")
  return CATALOGUE[key]


def from_device_kind(device_kind: str) -> Optional[Hardware]:
  """The catalogue entry matching jax's `device.device_kind`, e.g. 'NVIDIA H100 80GB HBM3' → h100."""
  kind = device_kind.lower()
  for hw in CATALOGUE.values():
    if any(s.lower() in kind for s in hw.device_kinds):
      return hw
  return None


@functools.lru_cache(maxsize=None)
def measure_matmul_peak(dtype: str = "float32", size: int = 1024, seconds: float = 1.0) -> float:
  """FLOP/s of a jitted square matmul on the default device (all its cores), best of a short run.

  Chains 8 matmuls per call so dispatch overhead is amortised; cached per (dtype, size, seconds).
  """
  dt = jnp.dtype(dtype)
  a = jax.random.normal(jax.random.key(0), (size, size), jnp.float32).astype(dt)
  b = jax.random.normal(jax.random.key(1), (size, size), jnp.float32).astype(dt) / size**0.5
  chain = 8

  @jax.jit
  def run(x):
    for _ in range(chain):
      x = jnp.dot(x, b)
    return x

  run(a).block_until_ready()  # compile
  flops = 2.0 * size**3 * chain
  best, start = 0.0, time.perf_counter()
  while True:
    t0 = time.perf_counter()
    run(a).block_until_ready()
    best = max(best, flops / (time.perf_counter() - t0))
    if time.perf_counter() - start > seconds:
      return best


def peak_flops_per_device(device=None, dtype: str = "bfloat16") -> tuple:
  """(peak FLOP/s of one device, source), e.g. (9.894e14, 'catalogue:h100').

  GPUs and TPUs come from the catalogue by `device_kind`. On CPU the machine's own matmul peak is
  measured once (float32: XLA:CPU's fastest dot) and divided among the emulated CPU devices, which
  share the same cores: (8 devices × per-device peak) is the machine peak.
  """
  device = device or jax.devices()[0]
  dtype = jnp.dtype(dtype).name
  if device.platform == "cpu":
    n = max(1, len(jax.devices("cpu")))
    return measure_matmul_peak("float32") / n, "measured:cpu"
  hw = from_device_kind(device.device_kind)
  if hw is None:
    raise ValueError(f"no catalogue entry for device_kind {device.device_kind!r}: add one with a JSON file "
                     f"via $T5X_LIKE_HARDWARE (see t5x_like/observe/hardware.py)")
  peak = hw.peak_flops.get(dtype) or hw.peak_flops["bfloat16"]
  return peak, f"catalogue:{hw.name}"
