"""Checkpoint cost: how long the training loop is blocked by an async vs a synchronous save, and MB/s.

  python bench/checkpoint.py [--dir /tmp/ckpt_bench] [--repeats 2] [--num_layers 12 --d_model 768
                             --num_heads 12 --d_ff 3072 --vocab_size 50304 --max_len 1024]

The state is the full TrainState of a GPT-2-small-shaped model (124.5M parameters; float32 params and
AdamW moments, ≈1.5 GB), initialised on the CPU into its shardings: no training. For each mode the
same `checkpoints.save` the trainer calls is timed:
  blocked   the time `save()` holds the caller (the loop's stall): device→host copy + directory set-up
            for async; everything for sync
  total     until the step is committed on disk (`wait_until_finished`)
  MB/s      state bytes / total
then restore (onto the same shardings) is timed the same way. Prints one table row per measurement.
"""

import argparse
import os
import shutil
import tempfile
import time

import flax.linen as nn
import jax
import numpy as np

from t5x_like.training import checkpointing as checkpoints
from t5x_like.parallel import mesh as mesh_lib
from t5x_like.model import decoder as model_lib
from t5x_like.training import optimizer as optimizer_lib
from t5x_like.parallel import partitioning
from t5x_like.training import train_state as train_state_lib


def make_state(config: model_lib.GPTConfig):
  mesh = mesh_lib.create_mesh({"pipeline": 1, "data": -1, "fsdp": 1, "tensor": 1})
  model = model_lib.GPT(config)
  tx = optimizer_lib.make_optimizer(optimizer_lib.OptimizerConfig(), 1000)
  with jax.set_mesh(mesh), nn.logical_axis_rules(partitioning.DEFAULT_RULES):
    abstract, shardings = train_state_lib.state_shardings(model, tx, mesh)
    state, _ = train_state_lib.init_state(model, tx, jax.random.key(0), mesh)
  return jax.block_until_ready(state), checkpoints.abstract_with_shardings(abstract, shardings)


def time_save(directory: str, state, step: int, async_save: bool) -> tuple:
  """(blocked seconds, total seconds) of one save into a fresh manager."""
  manager = checkpoints.make_manager(directory, max_to_keep=None, async_save=async_save)
  t0 = time.perf_counter()
  checkpoints.save(manager, step, state, metadata={"step": step})
  blocked = time.perf_counter() - t0
  manager.wait_until_finished()
  total = time.perf_counter() - t0
  manager.close()
  return blocked, total


def time_restore(directory: str, abstract, step: int) -> float:
  manager = checkpoints.make_manager(directory, max_to_keep=None, async_save=False)
  t0 = time.perf_counter()
  found, state, _ = checkpoints.restore_latest(manager, abstract, step=step)
  jax.block_until_ready(state)
  seconds = time.perf_counter() - t0
  assert found == step
  manager.close()
  return seconds


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dir", default=None, help="scratch directory (default: a new temp dir, removed)")
  parser.add_argument("--repeats", type=int, default=2, help="saves per mode; the best is reported")
  for name, default in (("num_layers", 12), ("d_model", 768), ("num_heads", 12), ("d_ff", 3072),
                        ("vocab_size", 50304), ("max_len", 1024)):
    parser.add_argument(f"--{name}", type=int, default=default)
  args = parser.parse_args()
  config = model_lib.GPTConfig(**{k: getattr(args, k) for k in ("num_layers", "d_model", "num_heads",
                                                                "d_ff", "vocab_size", "max_len")})
  root = args.dir or tempfile.mkdtemp(prefix="ckpt_bench_")
  os.makedirs(root, exist_ok=True)
  try:
    t0 = time.perf_counter()
    state, abstract = make_state(config)
    n_params = sum(int(x.size) for x in jax.tree.leaves(state.params))
    n_bytes = sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(state))
    mb = n_bytes / 2**20
    print(f"state: {n_params / 1e6:.1f}M parameters, {mb:,.0f} MiB with AdamW moments "
          f"(init {time.perf_counter() - t0:.1f} s on {jax.device_count()} {jax.devices()[0].platform} "
          f"device(s)); disk: {root}")
    print(f"| {'measurement':<24} | {'blocked s':>9} | {'total s':>8} | {'MiB/s':>7} |")
    print(f"|{'-' * 26}|{'-' * 11}|{'-' * 10}|{'-' * 9}|")
    step, blocked = 0, {}
    for mode, async_save in (("sync", False), ("async", True)):
      results = []
      for _ in range(args.repeats):
        step += 1
        results.append(time_save(os.path.join(root, f"run{step}"), state, step, async_save))
      blocked[mode], total = min(results)
      print(f"| {'save, ' + mode:<24} | {blocked[mode]:9.2f} | {total:8.2f} | {mb / total:7.0f} |", flush=True)
    seconds = min(time_restore(os.path.join(root, f"run{s}"), abstract, s) for s in range(1, step + 1))
    print(f"| {'restore, same layout':<24} | {seconds:9.2f} | {seconds:8.2f} | {mb / seconds:7.0f} |")
    print(f"the loop stalls {blocked['async']:.2f} s per async checkpoint vs {blocked['sync']:.2f} s per "
          f"synchronous one ({blocked['sync'] / max(blocked['async'], 1e-9):.1f}x less)")
  finally:
    if args.dir is None:
      shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
  main()
