"""`python -m t5x_like.plan`: FLOPs, per-device memory, step time and a ranked list of mesh layouts, before a run.

    python -m t5x_like.plan --gin_file=configs/models/gpt2_small.gin --vocab_size=50304 \\
        --hardware=h100 --num_devices=8 --global_batch=512 --tokens=10e9

Step time = compute / (peak × efficiency) + pipeline bubble + communication, with no overlap assumed:
  compute   hardware FLOPs (flops.hardware_flops_per_token: remat recompute included) per device; the
            embedding/logits run on every pipeline stage (they sit outside the pipelined blocks);
  fsdp      per accumulation microbatch: all-gather float32 weights (forward, and again for the
            backward under remat) + reduce-scatter float32 gradients, ring volume (f−1)/f;
  tensor    per layer and microbatch: 2 all-reduces of the (rows, T, d_model) bfloat16 activations
            forward, 2 backward, 2 more when the forward is recomputed; plus embedding and logits;
  pipeline  (m + p − 1) collective-permutes of one microbatch's activations, forward and backward;
  data      one all-reduce of the float32 gradients per step (XLA hoists it out of the accumulation loop).
Each mesh axis uses intra-host bandwidth when its devices share a host (tensor innermost, as
mesh.create_mesh lays them out), inter-host bandwidth otherwise, scaled by --comm_efficiency.
"""

import dataclasses
import math
import os
from typing import Optional

from absl import flags

from t5x_like import flops
from t5x_like import hardware as hardware_lib
from t5x_like import memory_model
from t5x_like import mesh as mesh_lib
from t5x_like import model as model_lib

Layout = memory_model.Layout
REMAT_SEARCH = ("none", "save_dots", "save_attention_out", "full")  # offload_dots needs host memory kinds


@dataclasses.dataclass(frozen=True)
class StepTime:
  """Seconds per optimizer step, by cause."""
  compute: float
  bubble: float
  fsdp: float
  tensor: float
  pipeline: float
  data: float

  @property
  def total(self) -> float:
    return self.compute + self.bubble + self.fsdp + self.tensor + self.pipeline + self.data


@dataclasses.dataclass(frozen=True)
class Candidate:
  layout: Layout
  memory: Optional[memory_model.MemoryEstimate] = None
  time: Optional[StepTime] = None
  mfu: float = 0.0
  days: float = 0.0
  reason: Optional[str] = None  # why the layout was dropped; None = feasible


@dataclasses.dataclass(frozen=True)
class Target:
  """What the run is and what it runs on."""
  hardware: hardware_lib.Hardware
  num_devices: int
  global_batch: int  # sequences per step
  seq_len: int
  tokens: float  # training tokens
  devices_per_host: int = 0  # 0 = the catalogue's
  efficiency: float = 0.6  # fraction of peak FLOP/s the step reaches while computing
  comm_efficiency: float = 0.7  # fraction of nominal bandwidth collectives reach
  memory_fraction: float = 0.9  # usable share of device memory (allocator, fragmentation, runtime)
  causal_halved: bool = False  # MFU convention (flops.train_flops_per_token)

  @property
  def host_size(self) -> int:
    return self.devices_per_host or self.hardware.devices_per_host

  @property
  def peak(self) -> float:
    peak = self.hardware.peak_flops.get("bfloat16")
    return peak if peak else hardware_lib.measure_matmul_peak("float32") / max(1, self.host_size)


def axis_bandwidth(layout: Layout, axis: str, target: Target) -> float:
  """Bytes/s per device for a ring over `axis`: intra-host if its group fits in one host."""
  sizes = layout.mesh_shape
  inner = math.prod(sizes[a] for a in mesh_lib.AXES[mesh_lib.AXES.index(axis) + 1:])
  within = inner * sizes[axis] <= target.host_size
  bw = target.hardware.intra_host_bw if within else target.hardware.inter_host_bw
  return bw * target.comm_efficiency


def step_time(cfg: model_lib.GPTConfig, layout: Layout, target: Target) -> StepTime:
  """Estimated seconds per step for `layout` (see the module docstring for the terms)."""
  from t5x_like import pipeline  # pylint: disable=g-import-not-at-top
  p, d, f, t, k = layout.pipeline, layout.data, layout.fsdp, layout.tensor, layout.num_microbatches
  tokens = target.global_batch * target.seq_len
  head_flops = 6.0 * cfg.vocab_size * cfg.d_model  # tied logits, forward + backward, per token
  block_flops = flops.hardware_flops_per_token(cfg, target.seq_len, layout.remat_policy) - head_flops
  per_device = block_flops * tokens / layout.num_devices + head_flops * tokens / (d * f * t)
  compute = per_device / (target.peak * target.efficiency)
  bubble = 0.0
  if p > 1:
    m = layout.stage_microbatches
    frac = pipeline.bubble_fraction(p, m)
    bubble = compute * frac / (1 - frac)
  gathered = memory_model.param_elements_per_device(cfg, dataclasses.replace(layout, fsdp=1))
  ring = lambda n: (n - 1) / n
  fsdp = 0.0
  if f > 1:
    gathers = 1 if layout.remat_policy == "none" else 2
    fsdp = k * (gathers + 1) * 4.0 * gathered * ring(f) / axis_bandwidth(layout, "fsdp", target)
  data = 0.0
  if d > 1:
    data = 2 * 4.0 * (gathered / f) * ring(d) / axis_bandwidth(layout, "data", target)
  rows = target.global_batch / (d * f * k)  # sequences per device per accumulation microbatch
  act_bytes = rows * target.seq_len * cfg.d_model * 2.0
  tensor = 0.0
  if t > 1:
    per_layer = 4 + (2 if layout.remat_policy in ("full", "save_attention_out") else 0)
    n_reduce = per_layer * cfg.num_layers / p + 4
    tensor = k * n_reduce * 2 * act_bytes * ring(t) / axis_bandwidth(layout, "tensor", target)
  pipe = 0.0
  if p > 1:
    m = layout.stage_microbatches
    pipe = k * 2 * (m + p - 1) * (act_bytes / m) / axis_bandwidth(layout, "pipeline", target)
  return StepTime(compute=compute, bubble=bubble, fsdp=fsdp, tensor=tensor, pipeline=pipe, data=data)


def divisors(n: int) -> list:
  return [i for i in range(1, n + 1) if n % i == 0]


def _factorizations(n: int):
  for p in divisors(n):
    for t in divisors(n // p):
      for f in divisors(n // (p * t)):
        yield Layout(pipeline=p, data=n // (p * t * f), fsdp=f, tensor=t)


def structural_reason(cfg: model_lib.GPTConfig, layout: Layout, target: Target) -> Optional[str]:
  """Why a mesh shape cannot run this model/batch at all (None if it can)."""
  if cfg.num_heads % layout.tensor or cfg.d_ff % layout.tensor:
    return f"tensor={layout.tensor} does not divide num_heads={cfg.num_heads} and d_ff={cfg.d_ff}"
  if layout.tensor > target.host_size:
    return f"tensor={layout.tensor} spans hosts ({target.host_size} devices per host)"
  if cfg.num_layers % layout.pipeline:
    return f"pipeline={layout.pipeline} does not divide num_layers={cfg.num_layers}"
  if target.global_batch % (layout.data * layout.fsdp):
    return f"global batch {target.global_batch} not divisible by data×fsdp={layout.data * layout.fsdp}"
  return None


def evaluate(cfg: model_lib.GPTConfig, layout: Layout, target: Target) -> Candidate:
  """Memory, step time, MFU and days for one layout, or the reason it cannot run."""
  rows = target.global_batch // (layout.data * layout.fsdp)
  if rows % layout.num_microbatches:
    return Candidate(layout, reason=f"{rows} sequences per data shard not divisible by "
                                    f"NUM_MICROBATCHES={layout.num_microbatches}")
  if layout.pipeline > 1 and (rows // layout.num_microbatches) % layout.stage_microbatches:
    return Candidate(layout, reason=f"{rows // layout.num_microbatches} sequence(s) per microbatch cannot be "
                                    f"split into {layout.stage_microbatches} pipeline microbatches")
  memory = memory_model.estimate(cfg, layout, target.global_batch, target.seq_len)
  budget = target.hardware.hbm_bytes * target.memory_fraction
  time = step_time(cfg, layout, target)
  model_flops = flops.train_flops_per_token(cfg, target.seq_len, target.causal_halved)
  tokens_per_step = target.global_batch * target.seq_len
  mfu = flops.mfu(tokens_per_step / time.total, model_flops, layout.num_devices, target.peak)
  days = target.tokens / tokens_per_step * time.total / 86400
  reason = None
  if memory.total > budget:
    reason = (f"needs {memory_model.gib(memory.total)} GiB per device > {memory_model.gib(budget)} GiB "
              f"({target.memory_fraction:.0%} of {target.hardware.name})")
  return Candidate(layout, memory, time, mfu, days, reason)


def search(cfg: model_lib.GPTConfig, target: Target, remat_policies=REMAT_SEARCH):
  """All mesh shapes × remat policies; for each, the fewest accumulation microbatches that fit.

  Returns (feasible candidates fastest first, dropped candidates with reasons).
  """
  feasible, dropped = [], []
  for mesh in _factorizations(target.num_devices):
    why = structural_reason(cfg, mesh, target)
    if why:
      dropped.append(Candidate(mesh, reason=why))
      continue
    rows = target.global_batch // (mesh.data * mesh.fsdp)
    stage_options = [2 * mesh.pipeline, 4 * mesh.pipeline, mesh.pipeline] if mesh.pipeline > 1 else [0]
    for policy in remat_policies:
      last = None
      for k in divisors(rows):
        options = [evaluate(cfg, dataclasses.replace(mesh, num_microbatches=k, remat_policy=policy,
                                                     pipeline_microbatches=m), target) for m in stage_options]
        ok = [c for c in options if c.reason is None]
        if ok:
          feasible.append(min(ok, key=lambda c: c.time.total))
          break
        last = options[0]
      else:
        if last is not None:
          dropped.append(last)
  feasible.sort(key=lambda c: c.time.total)
  return feasible, dropped


def _fmt_days(days: float) -> str:
  return f"{days * 24:.2f} h" if days < 2 else f"{days:.1f} d"


def format_table(candidates, top: int) -> str:
  lines = [f"{'#':>3} {'layout (pipeline×data×fsdp×tensor, k accum, m pipe, remat)':<44} {'GiB/dev':>8} "
           f"{'step s':>8} {'comm s':>8} {'bubble s':>8} {'MFU':>6} {'time':>9}"]
  for i, c in enumerate(candidates[:top], 1):
    comm = c.time.fsdp + c.time.tensor + c.time.pipeline + c.time.data
    lines.append(f"{i:>3} {c.layout.describe():<44} {memory_model.gib(c.memory.total):>8} {c.time.total:>8.3f} "
                 f"{comm:>8.3f} {c.time.bubble:>8.3f} {c.mfu:>6.1%} {_fmt_days(c.days):>9}")
  return "\n".join(lines)


def format_memory(m: memory_model.MemoryEstimate) -> str:
  parts = [("params", m.params), ("optimizer", m.optimizer), ("grads+update", m.grads),
           ("activations", m.activations), ("working", m.working), ("inputs", m.inputs)]
  return ", ".join(f"{name} {memory_model.gib(v)}" for name, v in parts) + f" → {memory_model.gib(m.total)} GiB"


def report(cfg: model_lib.GPTConfig, target: Target, top: int = 10, remat_policies=REMAT_SEARCH) -> tuple:
  """The plan as text, and the candidates (feasible fastest first, dropped)."""
  n_params = memory_model.param_count(cfg)
  per_token = flops.train_flops_per_token(cfg, target.seq_len, target.causal_halved)
  tokens_per_step = target.global_batch * target.seq_len
  hw = target.hardware
  out = [
      f"model: {n_params:,} parameters ({n_params / 1e9:.3f} B; {flops.matmul_params(cfg):,} in matmuls), "
      f"L={cfg.num_layers} H={cfg.num_heads} d_model={cfg.d_model} d_ff={cfg.d_ff} vocab={cfg.vocab_size}",
      f"FLOPs/token: {per_token:.4g} (6N + 12·L·T·d, attention {'halved' if target.causal_halved else 'not halved'}"
      f"); per step ({target.global_batch} × {target.seq_len} = {tokens_per_step:,} tokens): "
      f"{per_token * tokens_per_step:.4g}; total for {target.tokens:.4g} tokens: {per_token * target.tokens:.4g}",
      f"hardware: {target.num_devices} × {hw.name} ({target.peak / 1e12:.1f} TFLOP/s bf16, "
      f"{memory_model.gib(hw.hbm_bytes)} GiB, {target.host_size}/host, {hw.intra_host_bw / 1e9:.0f} GB/s intra, "
      f"{hw.inter_host_bw / 1e9:.1f} GB/s inter); efficiency {target.efficiency:.0%} compute, "
      f"{target.comm_efficiency:.0%} links; ideal time at 100% MFU: "
      f"{_fmt_days(per_token * target.tokens / (target.num_devices * target.peak) / 86400)}",
  ]
  feasible, dropped = search(cfg, target, remat_policies)
  out.append(f"\n{len(feasible)} feasible layouts (fastest first):")
  out.append(format_table(feasible, top) if feasible else "  none")
  if feasible:
    best = feasible[0]
    out.append(f"\nbest: {best.layout.describe()}: {format_memory(best.memory)}")
    t = best.time
    out.append(f"      step {t.total:.3f} s = compute {t.compute:.3f} + bubble {t.bubble:.3f} + fsdp {t.fsdp:.3f} "
               f"+ tensor {t.tensor:.3f} + pipeline {t.pipeline:.3f} + data {t.data:.3f}")
  out.append(f"\n{len(dropped)} dropped:")
  counts = {}
  for c in dropped:
    key = "over memory" if c.reason.startswith("needs") else c.reason
    counts.setdefault(key, []).append(c)
  for key, group in sorted(counts.items(), key=lambda kv: -len(kv[1])):
    out.append(f"  {len(group):>4} × {group[0].reason}   e.g. {group[0].layout.describe()}")
  return "\n".join(out), feasible, dropped


def _define_flags():
  from t5x_like import gin_utils  # pylint: disable=g-import-not-at-top
  gin_utils.define_gin_flags()
  flags.DEFINE_string("hardware", "h100", f"catalogue entry: {', '.join(hardware_lib.CATALOGUE)}")
  flags.DEFINE_string("hardware_file", None, "JSON file of extra catalogue entries (see t5x_like/hardware.py)")
  flags.DEFINE_integer("num_devices", None, "accelerators in the run")
  flags.DEFINE_integer("hosts", None, "hosts the devices are spread over (default: the catalogue's devices/host)")
  flags.DEFINE_float("tokens", None, "training tokens (default TRAIN_STEPS×BATCH_SIZE×SEQ_LEN, else 20 × params)")
  flags.DEFINE_integer("seq_len", None, "tokens per sequence (default SEQ_LEN, else GPTConfig.max_len)")
  flags.DEFINE_integer("global_batch", None, "sequences per step (default BATCH_SIZE, else ≈0.5M tokens)")
  flags.DEFINE_integer("vocab_size", None, "vocabulary when GPTConfig.vocab_size is 0 (dataset-sized), e.g. 50304")
  flags.DEFINE_float("efficiency", 0.6, "fraction of peak FLOP/s reached while computing")
  flags.DEFINE_float("comm_efficiency", 0.7, "fraction of nominal link bandwidth reached by collectives")
  flags.DEFINE_float("memory_fraction", 0.9, "usable fraction of device memory")
  flags.DEFINE_bool("causal_halved", False, "count only the unmasked half of causal attention in FLOPs/MFU")
  flags.DEFINE_integer("top", 10, "rows of the ranked table")
  flags.DEFINE_bool("compile", False, "AOT-compile the best layout's train step on a CPU-emulated mesh and "
                    "print XLA's memory analysis next to the estimate")
  flags.DEFINE_integer("compile_devices", 64, "largest CPU mesh --compile emulates (memory/time bound)")


def _gin_macro(name: str):
  import gin  # pylint: disable=g-import-not-at-top
  try:
    return gin.query_parameter(f"%{name}")
  except ValueError:
    return None


def _target_from_flags(cfg: model_lib.GPTConfig) -> Target:
  f = flags.FLAGS
  if not f.num_devices or f.num_devices < 1:
    raise ValueError(f"--num_devices must be a positive integer, got {f.num_devices}")
  hw = hardware_lib.get(f.hardware)
  per_host = 0
  if f.hosts:
    if f.num_devices % f.hosts:
      raise ValueError(f"--num_devices={f.num_devices} is not divisible by --hosts={f.hosts}")
    per_host = f.num_devices // f.hosts
  seq_len = f.seq_len or _gin_macro("SEQ_LEN") or cfg.max_len
  if seq_len > cfg.max_len:
    raise ValueError(f"sequence length {seq_len} exceeds GPTConfig.max_len={cfg.max_len}")
  batch = f.global_batch or _gin_macro("BATCH_SIZE") or max(1, 2**19 // seq_len)
  tokens = f.tokens
  if tokens is None:
    steps = _gin_macro("TRAIN_STEPS")
    tokens = steps * batch * seq_len if steps else 20.0 * memory_model.param_count(cfg)
  if tokens <= 0 or batch <= 0:
    raise ValueError(f"--tokens and --global_batch must be positive, got {tokens}, {batch}")
  return Target(hardware=hw, num_devices=f.num_devices, global_batch=int(batch), seq_len=int(seq_len),
                tokens=float(tokens), devices_per_host=per_host, efficiency=f.efficiency,
                comm_efficiency=f.comm_efficiency, memory_fraction=f.memory_fraction,
                causal_halved=f.causal_halved)


def _model_from_gin() -> model_lib.GPTConfig:
  from t5x_like import gin_utils  # pylint: disable=g-import-not-at-top
  gin_utils.parse_gin_flags()
  cfg = gin_utils.configured(model_lib.GPTConfig, "model")
  vocab = flags.FLAGS.vocab_size or cfg.vocab_size
  if not vocab:
    raise ValueError("GPTConfig.vocab_size is 0 (taken from the dataset at train time): pass --vocab_size=N "
                     "(e.g. 50304 for GPT-2's BPE)")
  cfg = dataclasses.replace(cfg, vocab_size=vocab)
  cfg.validate()
  return cfg


def compile_check(cfg: model_lib.GPTConfig, layout: Layout, target: Target) -> str:
  """XLA's per-device memory for `layout` next to the estimate (CPU mesh of layout.num_devices)."""
  try:
    compiled = memory_model.compile_train_step(cfg, layout, target.global_batch, target.seq_len)
  except Exception as e:  # pylint: disable=broad-except
    return f"compile failed for {layout.describe()}: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
  xla = memory_model.xla_bytes_per_device(compiled.memory_analysis())
  est = memory_model.estimate(cfg, layout, target.global_batch, target.seq_len).total
  return (f"--compile {layout.describe()} on {layout.num_devices} CPU devices: XLA {memory_model.gib(xla)} GiB "
          f"per device, estimate {memory_model.gib(est)} GiB ({est / xla - 1:+.1%})")


def main(argv):
  if len(argv) > 1:
    raise ValueError(f"unexpected arguments {argv[1:]}")
  f = flags.FLAGS
  if f.compile:  # must precede any use of a jax backend
    import jax  # pylint: disable=g-import-not-at-top
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", min(f.num_devices or 1, f.compile_devices))
  if f.hardware_file:
    hardware_lib.load_file(f.hardware_file)
  cfg = _model_from_gin()
  target = _target_from_flags(cfg)
  text, feasible, _ = report(cfg, target, f.top)
  print(text, flush=True)
  if f.compile:
    if not feasible:
      raise ValueError("--compile: no feasible layout to compile")
    best = feasible[0].layout
    if best.num_devices > f.compile_devices:
      print(f"\n--compile: {best.num_devices} devices exceed --compile_devices={f.compile_devices}; "
            "raise it if host memory allows", flush=True)
      return
    print("\n" + compile_check(cfg, best, target), flush=True)


if __name__ == "__main__":
  from t5x_like import gin_utils as _gin_utils  # pylint: disable=g-import-not-at-top
  _define_flags()
  _gin_utils.run(main)
