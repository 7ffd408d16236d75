"""Training-step throughput: tokens/s, step time, MFU vs this machine's measured matmul peak and the catalogue.

    python bench/train_throughput.py                                   # quick CPU grid (a few minutes)
    python bench/train_throughput.py --models=gpt2_small --batch_sizes=1 --seq_lens=256 --steps=1
    python bench/train_throughput.py --models=gpt2_small --batch_sizes=16 --seq_lens=1024 \
        --dtypes=bfloat16 --attention_impls=cudnn --steps=300 --warmup=5   # one GPU (bench/gpu.sh)

The run first measures the device's own matmul peak (`hardware.measure_matmul_peak`, float32 and
bfloat16), then for every point of the grid (model × batch × seq × dtype × remat × attention) builds a
TrainState, jits `train_step` exactly as the trainer does (in/out shardings, donated state) and times
`--steps` steps on one synthetic batch kept on the device (the input pipeline has its own bench).

Columns: MFU = model FLOPs (`flops.train_flops_per_token`, PaLM 6N + 12LTd) per second over the peak
(measured here, and the catalogue's; on CPU the theoretical peak `hardware.cpu_peak_flops` the trainer uses);
HFU counts rematerialisation's recomputed forward too (`flops.hardware_flops_per_token`). On a shared
CPU wall time is noisy, so `cpu eff.` reports model FLOPs per CPU-second of this process over the
matmul's FLOPs per CPU-second: what the step reaches per core it actually got. Prints Markdown.
"""

import argparse
import dataclasses
import functools
import json
import os
import sys
import time

from t5x_like import jemalloc  # pylint: disable=g-import-not-at-top,g-bad-import-order
from t5x_like.parallel import distributed  # pylint: disable=g-import-not-at-top,g-bad-import-order
from t5x_like.parallel import host_allocator  # pylint: disable=g-import-not-at-top,g-bad-import-order

if os.path.dirname(os.path.abspath(sys.argv[0])) == os.path.dirname(os.path.abspath(__file__)):  # a bench script
  jemalloc.preload_jemalloc()  # restarts on the host allocator of every entry point (where libjemalloc2 is installed)
distributed.set_cpu_xla_flags()  # the XLA:CPU flags the trainer runs with (before jax starts its backend)
host_allocator.keep_freed_memory()  # without jemalloc, as every entry point (cli.run) sets it

import flax.linen as nn  # pylint: disable=g-import-not-at-top,g-bad-import-order
import jax
import jax.numpy as jnp
import numpy as np

from t5x_like.observe import flops
from t5x_like import cli as gin_utils
from t5x_like.observe import hardware
from t5x_like.parallel import mesh as mesh_lib
from t5x_like.model import config as config_lib
from t5x_like.model import decoder as model_lib
from t5x_like.training import optimizer
from t5x_like.parallel import partitioning
from t5x_like.training import precision
from t5x_like.training import train_state
from t5x_like.training import trainer
from t5x_like.training import step as train_step
from t5x_like.training.objectives import language_model

MODELS = {  # name → (gin file, vocabulary used for the synthetic tokens)
    "gpt_tiny": ("configs/models/gpt_tiny.gin", 4096),
    "gpt_25m": ("configs/models/gpt_25m.gin", 8192),
    "gpt2_small": ("configs/models/gpt2_small.gin", 50304),
}
RULES = partitioning.DEFAULT_RULES


def model_config(name: str, **overrides) -> model_lib.GPTConfig:
  """The GPTConfig a model gin file defines, with the bench's vocabulary and `overrides`."""
  import gin  # pylint: disable=g-import-not-at-top
  path, vocab = MODELS[name]
  gin.clear_config()
  gin_utils.parse_gin([path])
  cfg = gin_utils.configured(model_lib.GPTConfig, "model")
  gin.clear_config()
  cfg = dataclasses.replace(cfg, **{"vocab_size": vocab, **overrides})
  cfg.validate()
  return cfg


def synthetic_batch(batch: int, seq: int, vocab: int, seed: int = 0) -> dict:
  rng = np.random.RandomState(seed)
  tokens = rng.randint(0, vocab, (batch, seq + 1)).astype(np.int32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": np.ones((batch, seq), np.int32),
          "positions": np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq)).copy(),
          "weights": np.ones((batch, seq), np.float32)}


def cpu_matmul_rate(dtype: str = "float32", size: int = 1024, calls: int = 6) -> float:
  """Matmul FLOPs per CPU-second of this process (robust to other processes sharing the cores)."""
  b = jnp.ones((size, size), dtype) / size
  run = jax.jit(lambda x: functools.reduce(lambda acc, _: acc @ b, range(8), x))
  x = jnp.ones((size, size), dtype)
  run(x).block_until_ready()
  c0 = time.process_time()
  for _ in range(calls):
    run(x).block_until_ready()
  return 2.0 * size**3 * 8 * calls / (time.process_time() - c0)


def compiled_step(cfg, batch: int, seq: int, loss_scaling: str = "auto", offload_optimizer: bool = False,
                  loss_chunk: int = 0) -> tuple:
  """(compiled train step, initial state, batch on the device, compile seconds, compile CPU seconds): the trainer's
  jitted train_step (shardings, donated state) for `cfg` on one device."""
  mesh = mesh_lib.create_mesh({"data": 1}, jax.devices()[:1])
  model = model_lib.GPT(cfg)
  tx = optimizer.make_optimizer(optimizer.OptimizerConfig(), 1000)
  lr_fn = optimizer.learning_rate_schedule(optimizer.OptimizerConfig(), 1000)
  prec = precision.PrecisionConfig(loss_scaling=loss_scaling)
  loss_scale = precision.init_loss_scale(prec, cfg.dtype)
  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    state, shardings = train_state.init_state(model, tx, jax.random.key(0), mesh, RULES, loss_scale=loss_scale)
    if offload_optimizer:
      from t5x_like.parallel import offload  # pylint: disable=g-import-not-at-top
      shardings = offload.offload_shardings(shardings, params=False)
      state = jax.device_put(state, shardings)
    batch_sh = partitioning.batch_sharding(mesh, RULES)
    data = {k: jax.device_put(v, batch_sh) for k, v in synthetic_batch(batch, seq, cfg.vocab_size).items()}
    objective = language_model.LanguageModel(model.apply, loss_chunk=loss_chunk,
                                             logits_fn=functools.partial(model_lib.project_logits, config=cfg))
    fn = functools.partial(train_step.train_step, objective=objective, tx=tx, lr_fn=lr_fn,
                           precision_config=prec)
    if offload_optimizer:
      fn = offload.with_device_opt_state(fn, shardings)
    step = jax.jit(fn, in_shardings=(shardings, {k: batch_sh for k in data}), out_shardings=(shardings, None),
                   donate_argnums=(0,))
    t0, c0 = time.perf_counter(), time.process_time()
    compiled = step.lower(state, data).compile()
  return compiled, state, data, time.perf_counter() - t0, time.process_time() - c0


def run_steps(compiled, state, data, steps: int) -> tuple:
  """(state, last loss) after `steps` steps dispatched as the trainer's loop does: ahead of the last one's end
  except on CPU (trainer.StepGate), no host transfer until the last."""
  gate = trainer.StepGate()
  for _ in range(steps):
    gate.wait()
    state, metrics = compiled(state, data)
    gate.dispatched(metrics)
  gate.wait()  # the last step's temporaries freed too: the next call's first step starts without a pause
  return state, float(metrics["loss"])


def bench_point(cfg, batch: int, seq: int, steps: int, warmup: int, loss_scaling: str = "auto",
                offload_optimizer: bool = False) -> dict:
  """Compile time, mean step time and CPU seconds per step of the jitted train_step on one device."""
  compiled, state, data, compile_seconds, compile_cpu_seconds = compiled_step(cfg, batch, seq, loss_scaling,
                                                                              offload_optimizer)
  t0 = time.perf_counter()
  state, metrics = compiled(state, data)
  jax.block_until_ready(metrics)
  first_step_seconds = time.perf_counter() - t0
  for _ in range(warmup):
    state, metrics = compiled(state, data)
  jax.block_until_ready(metrics)
  t0, c0 = time.perf_counter(), time.process_time()
  state, loss = run_steps(compiled, state, data, steps)
  wall, cpu = time.perf_counter() - t0, time.process_time() - c0
  return {"compile_seconds": compile_seconds, "compile_cpu_seconds": compile_cpu_seconds,
          "first_step_seconds": first_step_seconds, "step_seconds": wall / steps, "cpu_seconds": cpu / steps,
          "loss": loss}


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--models", default="gpt_tiny,gpt_25m", help=f"comma list of {sorted(MODELS)}")
  parser.add_argument("--batch_sizes", default="8", help="comma list of sequences per step")
  parser.add_argument("--seq_lens", default="256", help="comma list of tokens per sequence")
  parser.add_argument("--dtypes", default="float32,bfloat16", help="comma list of compute dtypes")
  parser.add_argument("--remat_policies", default="none", help=f"comma list of {config_lib.REMAT_POLICIES}")
  parser.add_argument("--attention_impls", default="xla", help="comma list of reference, xla, cudnn")
  parser.add_argument("--steps", type=int, default=3, help="timed steps per point")
  parser.add_argument("--warmup", type=int, default=1, help="untimed steps after the first (compiling) one")
  parser.add_argument("--loss_scaling", default="auto", help="PrecisionConfig.loss_scaling")
  parser.add_argument("--offload_optimizer", action="store_true",
                      help="ZeRO-Offload: optimizer state in pinned host memory (GPU/TPU only)")
  parser.add_argument("--json", default="", help="also write the rows to this JSON file")
  args = parser.parse_args()
  split = lambda s: [x for x in s.split(",") if x]
  device = jax.devices()[0]
  peak32 = hardware.measure_matmul_peak("float32", size=8192 if device.platform != "cpu" else 1024)
  peak16 = hardware.measure_matmul_peak("bfloat16", size=8192 if device.platform != "cpu" else 1024)
  rate32 = cpu_matmul_rate("float32") if device.platform == "cpu" else None
  print(f"device: {device.device_kind} ({device.platform}, {os.cpu_count()} host cores); measured matmul peak "
        f"float32 {peak32 / 1e9:.1f} GFLOP/s, bfloat16 {peak16 / 1e9:.1f} GFLOP/s"
        + (f"; float32 {rate32 / 1e9:.1f} GFLOP per CPU-second" if rate32 else ""), flush=True)
  rows = []
  header = ("| model | params | batch | seq | dtype | remat | attention | compile s (CPU s) | step s | tokens/s | "
            "MFU (measured peak) | MFU (catalogue/cpuinfo peak) | HFU | cpu eff. | loss |")
  print(header, flush=True)
  print("|" + "---|" * (header.count("|") - 1), flush=True)
  for name in split(args.models):
    for dtype in split(args.dtypes):
      for remat in split(args.remat_policies):
        for impl in split(args.attention_impls):
          cfg = model_config(name, dtype=dtype, remat_policy=remat, attention_impl=impl)
          n_params = model_lib.count_params(cfg)
          for seq in split(args.seq_lens):
            for batch in split(args.batch_sizes):
              seq_i, batch_i = int(seq), int(batch)
              if seq_i > cfg.max_len:
                continue
              r = bench_point(cfg, batch_i, seq_i, args.steps, args.warmup, args.loss_scaling,
                              args.offload_optimizer)
              model_flops = flops.train_flops_per_token(cfg, seq_i) * batch_i * seq_i
              hw_flops = flops.hardware_flops_per_token(cfg, seq_i) * batch_i * seq_i
              # CPU: the machine's fastest matmul; GPU/TPU: the matmul peak of this dtype.
              measured = max(peak32, peak16) if device.platform == "cpu" else (
                  peak32 if dtype == "float32" else peak16)
              try:  # CPU: the theoretical peak of the cores XLA uses (/proc/cpuinfo), as the trainer's MFU
                catalogue = (hardware.cpu_peak_flops()[0] if device.platform == "cpu"
                             else hardware.peak_flops_per_device(device, dtype)[0])
              except ValueError:
                catalogue = None
              row = dict(model=name, params=n_params, batch=batch_i, seq=seq_i, dtype=dtype, remat=remat,
                         attention=impl, tokens_per_sec=batch_i * seq_i / r["step_seconds"],
                         mfu_measured=model_flops / r["step_seconds"] / measured,
                         mfu_catalogue=(model_flops / r["step_seconds"] / catalogue) if catalogue else None,
                         hfu_measured=hw_flops / r["step_seconds"] / measured,
                         cpu_efficiency=(model_flops / r["cpu_seconds"] / rate32) if rate32 else None, **r)
              rows.append(row)
              fmt = lambda x, f: "n/a" if x is None else format(x, f)
              print(f"| {name} | {n_params / 1e6:.1f}M | {batch_i} | {seq_i} | {dtype} | {remat} | {impl} | "
                    f"{r['compile_seconds']:.1f} ({r['compile_cpu_seconds']:.1f}) | {r['step_seconds']:.3f} | {row['tokens_per_sec']:,.0f} | "
                    f"{row['mfu_measured']:.1%} | {fmt(row['mfu_catalogue'], '.1%')} | "
                    f"{row['hfu_measured']:.1%} | {fmt(row['cpu_efficiency'], '.1%')} | {r['loss']:.3f} |",
                    flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"device": device.device_kind, "peak_float32": peak32, "peak_bfloat16": peak16,
                 "cpu_matmul_rate_float32": rate32, "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
