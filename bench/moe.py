"""Mixture of experts vs the dense model of equal active parameters: quality in the same steps, step time, and
the all-to-all share of an expert-parallel step.

    python bench/moe.py speed                     # CPU: 1-device step times, then an 8-device expert=8 mesh
    python bench/moe.py quality --data_dir=data/pystdlib/prepared --steps=300
    python bench/moe.py speed --devices=1 --dtype=bfloat16 --batch=32 --seq=1024   # one GPU

speed: gpt_tiny (dense) and moe_tiny (8 experts of d_ff 256, top-2: the same 512 hidden units per token) at
the same batch and sequence; the train step jitted as the trainer does (sharded, donated state) on one device,
timed over --steps steps. Then on an `expert` mesh of --devices devices: the step time, the all-to-all ops in
the compiled step's HLO (those inside the layer scan run once per layer), and one all-to-all of the dispatched
tokens timed alone; share = 4 per MoE layer (dispatch, combine and their transposes in the backward pass, as
the HLO of one layer's forward + backward has) × that time / step time. On a CPU the "devices" are threads
of one process, so the all-to-all is a memory copy; on accelerators the planner's `expert` term
(docs/moe.md) models the link.

quality: `python -m t5x_like.train` of configs/experiments/pystdlib_demo.gin as it is (gpt_tiny), and again
with configs/models/moe_tiny.gin on top, same data, seed, steps and learning rate; reads each run's
metrics.jsonl and prints the final evaluation: loss (for the MoE run: cross-entropy + the auxiliary losses)
and cross-entropy alone, which is what compares with the dense model's loss.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "speed":
  _DEVICES = next((a.split("=")[1] for a in sys.argv if a.startswith("--devices=")), "8")
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + f" --xla_force_host_platform_device_count={_DEVICES}").strip()
import dataclasses  # pylint: disable=g-import-not-at-top,g-bad-import-order
import functools
import time

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np

from t5x_like import cli
from t5x_like.model import decoder as model_lib
from t5x_like.model import moe
from t5x_like.observe import flops
from t5x_like.parallel import mesh as mesh_lib
from t5x_like.parallel import partitioning
from t5x_like.parallel import axis_names as ax
from t5x_like.training import optimizer
from t5x_like.training import step as train_step
from t5x_like.training import train_state
from t5x_like.training.objectives import language_model

RULES = partitioning.DEFAULT_RULES
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def model_config(name: str, **overrides) -> model_lib.GPTConfig:
  gin.clear_config()
  cli.parse_gin([os.path.join(ROOT, "configs", "models", f"{name}.gin")], [])
  cfg = cli.configured(model_lib.GPTConfig, "model")
  gin.clear_config()
  cfg = dataclasses.replace(cfg, **overrides)
  cfg.validate()
  return cfg


def synthetic_batch(batch: int, seq: int, vocab: int) -> dict:
  tokens = np.random.RandomState(0).randint(0, vocab, (batch, seq + 1)).astype(np.int32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": np.ones((batch, seq), np.int32),
          "positions": np.tile(np.arange(seq, dtype=np.int32), (batch, 1)),
          "weights": np.ones((batch, seq), np.float32)}


def step_timing(cfg, mesh_shape: dict, batch: int, seq: int, steps: int) -> dict:
  """Mean wall time of the jitted train step on `mesh_shape` after a warm-up, and its all-to-all count."""
  mesh = mesh_lib.create_mesh(mesh_shape, jax.devices()[:int(np.prod(list(mesh_shape.values())))])
  model = model_lib.GPT(cfg)
  opt = optimizer.OptimizerConfig(warmup_steps=1)
  tx, lr_fn = optimizer.make_optimizer(opt, 1000), optimizer.learning_rate_schedule(opt, 1000)
  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    state, shardings = train_state.init_state(model, tx, jax.random.key(0), mesh, RULES)
    batch_sharding = partitioning.batch_sharding(mesh, RULES)
    data = {k: jax.device_put(v, batch_sharding) for k, v in synthetic_batch(batch, seq, cfg.vocab_size).items()}
    fn = functools.partial(train_step.train_step, objective=language_model.LanguageModel(model.apply), tx=tx,
                           lr_fn=lr_fn)
    step = jax.jit(fn, in_shardings=(shardings, {k: batch_sharding for k in data}), out_shardings=(shardings, None),
                   donate_argnums=(0,))
    compiled = step.lower(state, data).compile()
    for _ in range(2):
      state, metrics = compiled(state, data)
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for _ in range(steps):
      state, metrics = compiled(state, data)
    jax.block_until_ready(metrics)
    seconds = (time.perf_counter() - start) / steps
  return {"step_seconds": seconds, "all_to_alls": compiled.as_text().count(" all-to-all("),
          "loss": float(metrics["loss"])}


def all_to_all_seconds(cfg, mesh_shape: dict, batch: int, seq: int, repeats: int = 20) -> float:
  """Best wall time of one dispatch all-to-all: (E, G, C, D) tokens split by group → split by expert."""
  mesh = mesh_lib.create_mesh(mesh_shape, jax.devices()[:int(np.prod(list(mesh_shape.values())))])
  group = moe.routing_group_size(cfg, seq)
  shape = (cfg.num_experts, batch * seq // group, moe.capacity(cfg, group), cfg.d_model)
  spec = lambda names: jax.sharding.NamedSharding(mesh, partitioning.logical_to_mesh_spec(
      jax.sharding.PartitionSpec(*names), RULES))
  by_group, by_expert = spec((None, ax.BATCH, None, None)), spec((ax.ACT_EXPERT, ax.EXPERT_GROUPS, None, None))
  with jax.set_mesh(mesh):
    x = jax.device_put(jnp.ones(shape, cfg.compute_dtype), by_group)
    move = jax.jit(lambda a: a * 1, out_shardings=by_expert)
    compiled = move.lower(x).compile()
    assert " all-to-all(" in compiled.as_text(), "the reshard did not lower to an all-to-all"
    jax.block_until_ready(compiled(x))
    times = []
    for _ in range(repeats):
      start = time.perf_counter()
      jax.block_until_ready(compiled(x))
      times.append(time.perf_counter() - start)
  return min(times)


def speed(args) -> None:
  dense = model_config("gpt_tiny", vocab_size=4096, dtype=args.dtype)
  sparse = model_config("moe_tiny", vocab_size=4096, dtype=args.dtype)
  print(f"device: {jax.devices()[0].device_kind} × {len(jax.devices())}; batch {args.batch} × seq {args.seq}, "
        f"{args.dtype}, {args.steps} timed steps")
  print("| model | params | active | train GFLOP/step (model) | hardware GFLOP/step | mesh | step s | tokens/s |"
        " all-to-all ops in HLO | all-to-all share |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  tokens = args.batch * args.seq
  rows = [("gpt_tiny", dense, {"data": 1}), ("moe_tiny", sparse, {"data": 1})]
  if args.devices > 1:
    rows += [("gpt_tiny", dense, {"data": args.devices}), ("moe_tiny", sparse, {"data": args.devices}),
             ("moe_tiny", sparse, {"expert": min(args.devices, sparse.num_experts),
                                   "data": max(1, args.devices // sparse.num_experts)})]
  for name, cfg, mesh_shape in rows:
    r = step_timing(cfg, mesh_shape, args.batch, args.seq, args.steps)
    share = "-"
    if r["all_to_alls"]:
      one = all_to_all_seconds(cfg, mesh_shape, args.batch, args.seq)
      executed = 4 * cfg.num_moe_layers
      share = f"{executed * one / r['step_seconds']:.1%} ({executed} × {one * 1e3:.2f} ms)"
    mesh = "×".join(f"{k} {v}" for k, v in mesh_shape.items())
    print(f"| {name} | {model_lib.count_params(cfg) / 1e6:.2f}M | {flops.active_params(cfg) / 1e6:.2f}M | "
          f"{flops.train_flops_per_token(cfg, args.seq) * tokens / 1e9:.1f} | "
          f"{flops.hardware_flops_per_token(cfg, args.seq) * tokens / 1e9:.1f} | {mesh} | "
          f"{r['step_seconds']:.3f} | {tokens / r['step_seconds']:,.0f} | {r['all_to_alls']} | {share} |", flush=True)


def final_eval(model_dir: str) -> dict:
  with open(os.path.join(model_dir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f if line.strip()]
  evals = [r for r in records if "eval/loss" in r]
  last_train = [r for r in records if "loss" in r and "eval/loss" not in r][-1]
  return {**evals[-1], "train_loss": last_train["loss"], "step_seconds": last_train.get("step_seconds")}


def quality(args) -> None:
  out = args.output_dir or tempfile.mkdtemp(prefix="moe_bench_")
  common = [f"--gin.DATA_DIR='{args.data_dir}'", f"--gin.TRAIN_STEPS={args.steps}", f"--gin.EVAL_EVERY={args.steps}",
            f"--gin.CHECKPOINT_EVERY={args.steps}", f"--gin.LOG_EVERY={args.steps // 4 or 1}",
            f"--gin.SEED={args.seed}", f"--gin.data.DataConfig.eval_batches={args.eval_batches}",
            "--gin.data.DataConfig.report_unigram_baseline=False"]
  results = {}
  moe_name = "moe_tiny (8 experts, top-2" + "".join(f", {b}" for b in args.moe_gin) + ")"
  runs = {"dense": ("gpt_tiny (dense)", [], []),
          "moe": (moe_name, ["configs/models/moe_tiny.gin"], [f"--gin.{b}" for b in args.moe_gin])}
  for key in args.models.split(","):
    name, files, bindings = runs[key]
    model_dir = os.path.join(out, key)
    cmd = [sys.executable, "-m", "t5x_like.train", "--gin_file=configs/experiments/pystdlib_demo.gin",
           *[f"--gin_file={f}" for f in files], f"--gin.MODEL_DIR='{model_dir}'", *common, *bindings]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    results[name] = {**final_eval(model_dir), "wall_seconds": time.perf_counter() - start}
  print(f"{args.steps} steps of the pystdlib demo (batch 16 × 128 tokens), seed {args.seed}, eval on "
        f"{args.eval_batches} validation batches:")
  print("| model | eval loss | eval cross-entropy | eval perplexity (CE) | final train loss | step s | run s |")
  print("|---|---|---|---|---|---|---|")
  for name, r in results.items():
    ce = r.get("eval/cross_entropy", r["eval/loss"])
    print(f"| {name} | {r['eval/loss']:.4f} | {ce:.4f} | {np.exp(ce):.2f} | {r['train_loss']:.4f} | "
          f"{r['step_seconds'] or float('nan'):.3f} | {r['wall_seconds']:.0f} |")
  if moe_name in results:
    print("MoE routing at the end: " + ", ".join(f"{k.removeprefix('eval/moe/')} {v:.4f}"
                                                 for k, v in results[moe_name].items() if k.startswith("eval/moe/")))


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("what", choices=("speed", "quality"))
  parser.add_argument("--devices", type=int, default=8, help="speed: devices of the expert-parallel mesh")
  parser.add_argument("--batch", type=int, default=16, help="speed: sequences per step")
  parser.add_argument("--seq", type=int, default=128, help="speed: tokens per sequence")
  parser.add_argument("--dtype", default="float32", help="speed: compute dtype")
  parser.add_argument("--steps", type=int, default=None, help="speed: timed steps (5); quality: train steps (300)")
  parser.add_argument("--data_dir", default="data/pystdlib/prepared", help="quality: prepared dataset")
  parser.add_argument("--output_dir", default="", help="quality: where the two runs go (default: a temp dir)")
  parser.add_argument("--eval_batches", type=int, default=20, help="quality: validation batches per evaluation")
  parser.add_argument("--seed", type=int, default=0, help="quality: SEED of both runs")
  parser.add_argument("--models", default="dense,moe", help="quality: which runs (dense, moe)")
  parser.add_argument("--moe_gin", action="append", default=[],
                      help="quality: extra binding of the MoE run, e.g. model.GPTConfig.moe_dropless=True")
  args = parser.parse_args()
  if args.what == "speed":
    args.steps = args.steps or 5
    speed(args)
  else:
    args.steps = args.steps or 300
    quality(args)


if __name__ == "__main__":
  main()
