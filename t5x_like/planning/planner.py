"""The planner: FLOPs, per-device memory, step time and a ranked list of mesh layouts, before a run.

Step time = compute / (peak × efficiency) + pipeline bubble + communication, with no overlap assumed:
  compute   hardware FLOPs (flops.hardware_flops_per_token: remat recompute included) per device; the
            embedding/logits run on every pipeline stage (they sit outside the pipelined blocks);
  bubble    compute × b/(1 − b), b = (p − 1)/(v·m + p − 1): GPipe (v = 1) or interleaved (v virtual stages);
  fsdp      per accumulation microbatch: all-gather float32 weights (forward, and again for the
            backward under remat) + reduce-scatter float32 gradients, ring volume (f−1)/f;
  tensor    per layer and microbatch: 2 all-reduces of the (rows, T, d_model) bfloat16 activations
            forward, 2 backward, 2 more when the forward is recomputed; plus embedding and logits;
  pipeline  (v·m + p − 1) collective-permutes of one microbatch's activations, forward and backward (with
            v > 1 the trainer holds the block weights in stage order, so none move: pipeline_parallel.py);
  sequence  per layer and microbatch: all-gather of keys and values forward, reduce-scatter of their
            gradients backward, again when remat recomputes the forward; with context_parallelism='ring' the
            keys and values go round the ring forward and backward, their float32 gradients with them (the
            same (s−1)/s volume per pass; counted, not taken as hidden behind the blocks' compute); plus the
            all-reduce of the float32 gradients over `sequence` (parameters are replicated over it);
  expert    per MoE layer and microbatch: 2 all-to-alls of the dispatched bfloat16 tokens (top_k × capacity
            factor slots per token, d_model wide) forward, 2 backward, 2 more when the forward is recomputed,
            each moving (e−1)/e of a device's slots; plus the all-reduce of the non-expert gradients over
            `expert` (a data-parallel axis outside MoE layers);
  data      one all-reduce of the float32 gradients per step (XLA hoists it out of the accumulation loop).
Each mesh axis uses intra-host bandwidth when its devices share a host (tensor innermost, as
mesh.create_mesh lays them out), inter-host bandwidth otherwise, scaled by --comm_efficiency.
"""

import dataclasses
import math
from typing import Optional

from t5x_like.observe import flops
from t5x_like.observe import hardware as hardware_lib
from t5x_like.planning import memory_model
from t5x_like.parallel import mesh as mesh_lib
from t5x_like.model import decoder as model_lib
from t5x_like.model import moe
from t5x_like.model import pipeline_parallel
from t5x_like.posttrain import lora as lora_lib

Layout = memory_model.Layout
REMAT_SEARCH = ("none", "save_dots", "save_attention_out", "full")  # offload_dots: not modelled (host memory)


@dataclasses.dataclass(frozen=True)
class StepTime:
  """Seconds per optimizer step, by cause."""
  compute: float
  bubble: float
  fsdp: float
  tensor: float
  pipeline: float
  data: float
  expert: float = 0.0
  sequence: float = 0.0

  @property
  def total(self) -> float:
    return self.compute + self.bubble + self.communication

  @property
  def communication(self) -> float:
    return self.fsdp + self.tensor + self.pipeline + self.data + self.expert + self.sequence


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
  max_sequence: int = 1  # largest `sequence` (context-parallel) axis searched; 1 = none
  causal_halved: bool = False  # MFU convention (flops.train_flops_per_token)
  lora: Optional[lora_lib.LoraConfig] = None  # a LoRA / QLoRA run (rank > 0): its memory (memory_model.estimate)

  @property
  def host_size(self) -> int:
    return self.devices_per_host or self.hardware.devices_per_host

  @property
  def peak(self) -> float:
    peak = self.hardware.peak_flops.get("bfloat16")
    return peak if peak else hardware_lib.cpu_peak_flops()[0] / max(1, self.host_size)


def axis_bandwidth(layout: Layout, axis: str, target: Target) -> float:
  """Bytes/s per device for a ring over `axis`: intra-host if its group fits in one host."""
  sizes = layout.mesh_shape
  inner = math.prod(sizes[a] for a in mesh_lib.AXES[mesh_lib.AXES.index(axis) + 1:])
  within = inner * sizes[axis] <= target.host_size
  bw = target.hardware.intra_host_bw if within else target.hardware.inter_host_bw
  return bw * target.comm_efficiency


def step_time(cfg: model_lib.GPTConfig, layout: Layout, target: Target) -> StepTime:
  """Estimated seconds per step for `layout` (see the module docstring for the terms)."""
  p, d, f, t, k = layout.pipeline, layout.data, layout.fsdp, layout.tensor, layout.num_microbatches
  e, s, v = layout.expert, layout.sequence, layout.pipeline_repeats
  tokens = target.global_batch * target.seq_len
  head_flops = 6.0 * cfg.vocab_size * cfg.d_model  # tied logits, forward + backward, per token
  block_flops = flops.hardware_flops_per_token(cfg, target.seq_len, layout.remat_policy) - head_flops
  per_device = block_flops * tokens / layout.num_devices + head_flops * tokens / (d * f * s * e * t)
  compute = per_device / (target.peak * target.efficiency)
  bubble = 0.0
  if p > 1:
    m = layout.stage_microbatches
    frac = pipeline_parallel.bubble_fraction(p, m, v)
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
  rows = target.global_batch / (d * f * e * k)  # sequences per device per accumulation microbatch
  act_bytes = rows * target.seq_len / s * cfg.d_model * 2.0  # one (rows, T/s, d_model) bfloat16 activation
  sequence = 0.0
  if s > 1:
    per_layer = (8 if cfg.context_parallelism == "ring" else 4) + (2 if layout.remat_policy != "none" else 0)
    kv_bytes = rows * target.seq_len * cfg.kv_heads * cfg.head_dim / t * 2.0  # gathered keys (or values)
    sequence = (k * per_layer * kv_bytes * ring(s) * cfg.num_layers / p / axis_bandwidth(layout, "sequence", target)
                + 2 * 4.0 * (gathered / f) * ring(s) / axis_bandwidth(layout, "sequence", target))
  expert = 0.0
  if e > 1:
    recompute = 2 if layout.remat_policy in ("full", "save_dots", "save_attention_out") else 0
    group = moe.routing_group_size(cfg, target.seq_len)
    slots = cfg.num_experts * moe.capacity(cfg, group) / group  # dispatched slots per token
    per_layer = (4 + recompute) * act_bytes * slots * ring(e) / axis_bandwidth(layout, "expert", target)
    dense_grads = memory_model.param_elements_per_device(cfg, dataclasses.replace(layout, fsdp=1), experts=False)
    expert = (k * per_layer * cfg.num_moe_layers / p
              + 2 * 4.0 * (dense_grads / f) * ring(e) / axis_bandwidth(layout, "expert", target))
  tensor = 0.0
  if t > 1:
    per_layer = 4 + (2 if layout.remat_policy in ("full", "save_attention_out") else 0)
    n_reduce = per_layer * cfg.num_layers / p + 4
    tensor = k * n_reduce * 2 * act_bytes * ring(t) / axis_bandwidth(layout, "tensor", target)
  pipe = 0.0
  if p > 1:
    m = layout.stage_microbatches
    pipe = k * 2 * (v * m + p - 1) * (act_bytes / m) / axis_bandwidth(layout, "pipeline", target)
  return StepTime(compute=compute, bubble=bubble, fsdp=fsdp, tensor=tensor, pipeline=pipe, data=data, expert=expert,
                  sequence=sequence)


def divisors(n: int) -> list:
  return [i for i in range(1, n + 1) if n % i == 0]


def _factorizations(n: int, num_experts: int = 0, max_sequence: int = 1):
  """Every (pipeline, data, fsdp, sequence, expert, tensor) over n devices; `expert` > 1 only when it divides
  num_experts, `sequence` up to max_sequence."""
  for p in divisors(n):
    for t in divisors(n // p):
      for e in [x for x in divisors(n // (p * t)) if num_experts and num_experts % x == 0] or [1]:
        for s in [x for x in divisors(n // (p * t * e)) if x <= max_sequence]:
          for f in divisors(n // (p * t * e * s)):
            yield Layout(pipeline=p, data=n // (p * t * e * s * f), fsdp=f, sequence=s, expert=e, tensor=t)


def pipeline_options(cfg: model_lib.GPTConfig, layout: Layout, rows: int) -> list:
  """(pipeline microbatches m, repeats v) to try for `rows` sequences per replica and accumulation microbatch:
  m = p, 2p, 4p, ... up to all the rows (one row per microbatch), v = 1, 2, 4, ... virtual stages per device
  while p·v divides the stacked layers. [(0, 1)] without a pipeline."""
  p = layout.pipeline
  if p == 1:
    return [(0, 1)]
  ms = sorted({p * 2**i for i in range(32) if p * 2**i <= rows and rows % (p * 2**i) == 0} | ({rows} if rows >= p else set()))
  vs = [2**i for i in range(8) if cfg.num_units % (p * 2**i) == 0]
  return [(m, v) for m in ms for v in vs] or [(p, 1)]


def structural_reason(cfg: model_lib.GPTConfig, layout: Layout, target: Target) -> Optional[str]:
  """Why a mesh shape cannot run this model/batch at all (None if it can): the layout validator's
  reason with one accumulation microbatch, or a tensor axis that would span hosts."""
  if layout.tensor > target.host_size:
    return f"tensor={layout.tensor} spans hosts ({target.host_size} devices per host)"
  return memory_model.layout_reason(cfg, dataclasses.replace(layout, num_microbatches=1, pipeline_microbatches=1,
                                                             pipeline_repeats=1), target.global_batch,
                                    seq_len=target.seq_len)


def evaluate(cfg: model_lib.GPTConfig, layout: Layout, target: Target) -> Candidate:
  """Memory, step time, MFU and days for one layout, or the reason it cannot run."""
  reason = memory_model.layout_reason(cfg, layout, target.global_batch, seq_len=target.seq_len)
  if reason:
    return Candidate(layout, reason=reason)
  memory = memory_model.estimate(cfg, layout, target.global_batch, target.seq_len, lora=target.lora)
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
  """All mesh shapes × remat policies; for each, the fewest accumulation microbatches that fit, with the
  fastest pipeline schedule (microbatches, virtual stages) that fits at that accumulation.

  Returns (feasible candidates fastest first, dropped candidates with reasons).
  """
  feasible, dropped = [], []
  for mesh in _factorizations(target.num_devices, cfg.num_experts, target.max_sequence):
    why = structural_reason(cfg, mesh, target)
    if why:
      dropped.append(Candidate(mesh, reason=why))
      continue
    rows = target.global_batch // mesh.batch_ways
    for policy in remat_policies:
      last = None
      for k in divisors(rows):
        options = [evaluate(cfg, dataclasses.replace(mesh, num_microbatches=k, remat_policy=policy,
                                                     pipeline_microbatches=m, pipeline_repeats=v), target)
                   for m, v in pipeline_options(cfg, mesh, rows // k)]
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
  lines = [f"{'#':>3} {'layout (pipeline×data×fsdp×tensor, k accum, m pipe, v, remat)':<44} {'GiB/dev':>8} "
           f"{'step s':>8} {'comm s':>8} {'bubble s':>8} {'MFU':>6} {'time':>9}"]
  for i, c in enumerate(candidates[:top], 1):
    comm = c.time.communication
    lines.append(f"{i:>3} {c.layout.describe():<44} {memory_model.gib(c.memory.total):>8} {c.time.total:>8.3f} "
                 f"{comm:>8.3f} {c.time.bubble:>8.3f} {c.mfu:>6.1%} {_fmt_days(c.days):>9}")
  return "\n".join(lines)


def format_memory(m: memory_model.MemoryEstimate) -> str:
  parts = [("params", m.params), ("optimizer", m.optimizer), ("grads+update", m.grads),
           ("activations", m.activations), ("working", m.working), ("inputs", m.inputs)]
  return ", ".join(f"{name} {memory_model.gib(v)}" for name, v in parts) + f" → {memory_model.gib(m.total)} GiB"


def report(cfg: model_lib.GPTConfig, target: Target, top: int = 10, remat_policies=REMAT_SEARCH) -> tuple:
  """The plan as text, and the candidates (feasible fastest first, dropped)."""
  n_params = model_lib.count_params(cfg)
  n_active = flops.active_params(cfg)
  per_token = flops.train_flops_per_token(cfg, target.seq_len, target.causal_halved)
  tokens_per_step = target.global_batch * target.seq_len
  hw = target.hardware
  out = [
      f"model: {n_params:,} parameters ({n_params / 1e9:.3f} B; {flops.matmul_params(cfg):,} in matmuls), "
      f"L={cfg.num_layers} H={cfg.num_heads}" + (f" KV={cfg.kv_heads}" if not cfg.fused_qkv else "")
      + f" d_model={cfg.d_model} d_ff={cfg.d_ff} vocab={cfg.vocab_size}"
      + f" ({cfg.norm}, {cfg.mlp_activation}, {cfg.position_embedding} positions)",
  ]
  if target.lora is not None and target.lora.rank > 0:
    out.append(f"LoRA rank {target.lora.rank} on '{target.lora.targets}' over a frozen {target.lora.base_precision} "
               "base: parameters = the stored base + float32 adapters; optimizer state and gradients the adapters' "
               "(step time as for full training)")
  if cfg.num_experts:
    out.append(f"experts: {cfg.num_experts} per MoE layer (every {cfg.moe_every}), top-{cfg.moe_top_k}, d_ff "
               f"{cfg.expert_d_ff}, capacity factor {'dropless' if cfg.moe_dropless else cfg.moe_capacity_factor}; "
               f"{n_active:,} parameters active per token ({n_active / 1e9:.3f} B active); routing adds "
               f"{3 * flops.moe_dispatch_flops_per_token(cfg, target.seq_len):.4g} hardware FLOPs/token")
  out += [
      f"6·N·D (N = {'active' if cfg.num_experts else 'all'} parameters, D = tokens): "
      f"{6 * n_active * target.tokens:.4g}",
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
               f"+ tensor {t.tensor:.3f} + pipeline {t.pipeline:.3f} + data {t.data:.3f}"
               + (f" + expert all-to-all {t.expert:.3f}" if cfg.num_experts else "")
               + (f" + sequence {t.sequence:.3f}" if best.layout.sequence > 1 else ""))
  out.append(f"\n{len(dropped)} dropped:")
  counts = {}
  for c in dropped:
    key = "over memory" if c.reason.startswith("needs") else c.reason
    counts.setdefault(key, []).append(c)
  for key, group in sorted(counts.items(), key=lambda kv: -len(kv[1])):
    out.append(f"  {len(group):>4} × {group[0].reason}   e.g. {group[0].layout.describe()}")
  return "\n".join(out), feasible, dropped


def compile_check(cfg: model_lib.GPTConfig, layout: Layout, target: Target) -> str:
  """XLA's per-device memory for `layout` next to the estimate (CPU mesh of layout.num_devices)."""
  if target.lora is not None and target.lora.rank > 0:
    return "--compile compiles full training only; the LoRA estimate above is not compared with XLA's"
  try:
    compiled = memory_model.compile_train_step(cfg, layout, target.global_batch, target.seq_len)
  except Exception as e:  # pylint: disable=broad-except
    return f"compile failed for {layout.describe()}: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
  xla = memory_model.xla_bytes_per_device(compiled.memory_analysis())
  est = memory_model.estimate(cfg, layout, target.global_batch, target.seq_len).total
  return (f"--compile {layout.describe()} on {layout.num_devices} CPU devices: XLA {memory_model.gib(xla)} GiB "
          f"per device, estimate {memory_model.gib(est)} GiB ({est / xla - 1:+.1%})")
