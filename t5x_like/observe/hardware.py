"""Accelerator catalogue (peak FLOP/s, memory, interconnect) as data, and the CPU's theoretical peak.

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

A CPU's peak is its theoretical float32 figure from /proc/cpuinfo (cores XLA may use × clock × FLOPs
per cycle of its widest FMA), not a matmul timed at start-up, which on a busy machine reads several
times too low and inflates MFU. `$T5X_LIKE_CPU_PEAK_FLOPS` (FLOP/s of the whole machine) overrides it.
"""

import dataclasses
import functools
import json
import os
import platform
import re
import time
from typing import Optional

from absl import logging
import jax
import jax.numpy as jnp

_GiB = 2**30
CPU_PEAK_ENV = "T5X_LIKE_CPU_PEAK_FLOPS"  # FLOP/s of the whole machine, overrides the /proc/cpuinfo figure
# float32 FLOPs per cycle per core: FMA units × SIMD lanes × 2, for the widest extension the flags show.
_FLOPS_PER_CYCLE = (("avx512f", 2 * 16 * 2), ("avx2+fma", 2 * 8 * 2), ("avx", 8 * 2), ("sse2", 4 * 2),
                    ("asimd", 2 * 4 * 2))


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
                    device_kinds=("cpu",), source="peak from cpu_peak_flops (/proc/cpuinfo); memory = host RAM"),
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


def cpu_peak_from_cpuinfo(cpuinfo: str, usable_cpus: set) -> tuple:
  """(float32 FLOP/s, how) of the cores in `usable_cpus` described by /proc/cpuinfo text; (None, why) if
  it lacks a figure. Hyper-threads of one core share its FMA units: physical cores are counted."""
  blocks = [dict(re.findall(r"^([^\t:\n]+?)\s*:\s*(.*)$", b, re.M)) for b in cpuinfo.strip().split("\n\n")]
  blocks = [b for b in blocks if "processor" in b and int(b["processor"]) in usable_cpus]
  if not blocks:
    return None, "no usable processor in /proc/cpuinfo"
  cores = len({(b.get("physical id"), b.get("core id", b["processor"])) for b in blocks})
  model = blocks[0].get("model name", "")
  rated = re.search(r"@\s*([\d.]+)\s*GHz", model)
  mhz = [float(b["cpu MHz"]) for b in blocks if "cpu MHz" in b]
  ghz = float(rated.group(1)) if rated else (max(mhz) / 1e3 if mhz else None)
  flags = set((blocks[0].get("flags") or blocks[0].get("Features") or "").split())
  flags |= {"avx2+fma"} if {"avx2", "fma"} <= flags else set()
  ext = next(((name, per) for name, per in _FLOPS_PER_CYCLE if name in flags), None)
  if ghz is None or ext is None:
    return None, f"/proc/cpuinfo has no {'clock' if ghz is None else 'known SIMD flags'}"
  return cores * ghz * 1e9 * ext[1], f"cpuinfo:{cores} cores x {ghz:.2f} GHz x {ext[1]} FLOP/cycle ({ext[0]})"


def cpu_name() -> str:
  """The CPU's model name (/proc/cpuinfo), to print beside every CPU figure."""
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      found = re.search(r"^model name\s*:\s*(.+)$", f.read(), re.M)
  except OSError:
    found = None
  return found.group(1).strip() if found else (platform.processor() or "unknown CPU")


@functools.lru_cache(maxsize=None)
def cpu_peak_flops() -> tuple:
  """(float32 peak FLOP/s of the cores this process may run on, source); logged once.

  `$T5X_LIKE_CPU_PEAK_FLOPS` overrides; without /proc/cpuinfo figures, a 1 s matmul measurement (a
  lower bound: a busy machine reads low, so MFU reads high).
  """
  if os.environ.get(CPU_PEAK_ENV):
    try:
      peak, source = float(os.environ[CPU_PEAK_ENV]), f"${CPU_PEAK_ENV}"
    except ValueError:
      raise ValueError(f"${CPU_PEAK_ENV}={os.environ[CPU_PEAK_ENV]!r} is not a number of FLOP/s "
                       "(e.g. 2e11)") from None
  else:
    try:
      with open("/proc/cpuinfo", encoding="utf-8") as f:
        peak, source = cpu_peak_from_cpuinfo(f.read(), os.sched_getaffinity(0))
    except OSError as e:
      peak, source = None, f"cannot read /proc/cpuinfo ({e.strerror})"
    if peak is None:
      peak, source = measure_matmul_peak("float32"), f"measured:cpu ({source}; set ${CPU_PEAK_ENV})"
  logging.info("CPU peak %.3g FLOP/s float32 (%s)", peak, source)
  return peak, source


def peak_flops_per_device(device=None, dtype: str = "bfloat16") -> tuple:
  """(peak FLOP/s of one device, source), e.g. (9.894e14, 'catalogue:h100').

  GPUs and TPUs come from the catalogue by `device_kind`. On CPU the machine's float32 peak
  (`cpu_peak_flops`; float32 is XLA:CPU's fastest dot) is divided among the emulated CPU devices,
  which share the same cores, unless a hardware file gives the "cpu" entry a float32 peak per device.
  """
  device = device or jax.devices()[0]
  dtype = jnp.dtype(dtype).name
  if device.platform == "cpu":
    if CATALOGUE["cpu"].peak_flops.get("float32"):
      return CATALOGUE["cpu"].peak_flops["float32"], "catalogue:cpu"
    peak, source = cpu_peak_flops()
    return peak / max(1, len(jax.devices("cpu"))), source
  hw = from_device_kind(device.device_kind)
  if hw is None:
    raise ValueError(f"no catalogue entry for device_kind {device.device_kind!r}: add one with a JSON file "
                     f"via $T5X_LIKE_HARDWARE (see t5x_like/observe/hardware.py)")
  peak = hw.peak_flops.get(dtype) or hw.peak_flops["bfloat16"]
  return peak, f"catalogue:{hw.name}"
