"""The interleaved pipeline's train step with its weights in layer order (regrouped by an all-to-all every step)
against stage order (the trainer's: GPTConfig.blocks_in_stage_order), on an 8-device CPU mesh, in one run.

    python bench/pipeline_order.py [--repeats 10]

For each layout: the all-to-alls in the compiled step (count and the bytes of their results per device) and the
best wall time of one AdamW step over `--repeats` (after a warm-up). On this CPU mesh an all-to-all is a copy
between the fake devices' buffers, so the time saved is a floor of what real links would save. Prints a Markdown
table (docs/parallelism.md).
"""

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import parallelism as bench_parallelism  # sets the 8-device XLA flag before jax starts

import dataclasses  # pylint: disable=g-import-not-at-top,g-bad-import-order
import functools

import flax.linen as nn
import jax
import numpy as np

from t5x_like.model import decoder as model_lib
from t5x_like.model import pipeline_parallel
from t5x_like.observe import hardware
from t5x_like.parallel import mesh as mesh_lib
from t5x_like.parallel import partitioning
from t5x_like.training import optimizer
from t5x_like.training import step as train_step
from t5x_like.training import train_state
from t5x_like.training.objectives import language_model

RULES = partitioning.DEFAULT_RULES
CFG = dataclasses.replace(bench_parallelism.LAYOUT_CFG, num_layers=8, pipeline_repeats=2)
BATCH, SEQ = bench_parallelism.LAYOUT_BATCH, bench_parallelism.LAYOUT_SEQ
LAYOUTS = (
    ("pipeline 2 × data 2 × tensor 2, v = 2, m = 4", {"pipeline": 2, "data": 2, "tensor": 2}, 4),
    ("pipeline 4 × fsdp 2, v = 2, m = 8", {"pipeline": 4, "fsdp": 2}, 8),
)
_BYTES = {"f32": 4, "bf16": 2, "s32": 4, "f16": 2}


def all_to_all_bytes(hlo: str) -> tuple:
  """(count, bytes of their results per device) of the all-to-alls in compiled HLO text."""
  count, total = 0, 0
  for line in hlo.splitlines():
    match = re.search(r"= (.*?) all-to-all(-start)?\(", line)
    if not match:
      continue
    count += 1
    for dtype, dims in re.findall(r"(f32|bf16|s32|f16)\[([\d,]*)\]", match.group(1)):
      total += _BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
  return count, total


def step_of(mesh_shape: dict, microbatches: int, stage_order: bool, repeats: int) -> tuple:
  """(all-to-alls, their bytes, best step seconds) of the layout's AdamW step."""
  mesh = mesh_lib.create_mesh(mesh_shape)
  cfg = dataclasses.replace(CFG, num_stages=mesh.shape["pipeline"], pipeline_microbatches=microbatches,
                            blocks_in_stage_order=stage_order)
  cfg.validate()
  model = model_lib.GPT(cfg)
  opt = optimizer.OptimizerConfig(warmup_steps=1)
  tx, lr_fn = optimizer.make_optimizer(opt, 100), optimizer.learning_rate_schedule(opt, 100)
  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    state, shardings = train_state.init_state(model, tx, jax.random.key(0), mesh, RULES)
    state = pipeline_parallel.reorder_blocks(cfg, state, to_stage=True, donate=True)
    batch_sharding = partitioning.batch_sharding(mesh, RULES)
    batch = {k: jax.device_put(v, batch_sharding)
             for k, v in bench_parallelism.synthetic_batch(BATCH, SEQ, cfg.vocab_size).items()}
    step = jax.jit(functools.partial(train_step.train_step, objective=language_model.LanguageModel(model.apply),
                                     tx=tx, lr_fn=lr_fn),
                   in_shardings=(shardings, {k: batch_sharding for k in batch}), out_shardings=(shardings, None),
                   donate_argnums=(0,)).lower(state, batch).compile()
    count, nbytes = all_to_all_bytes(step.as_text())
    holder = [state]

    def run():
      holder[0], metrics = step(holder[0], batch)
      return metrics["loss"]

    return count, nbytes, bench_parallelism.best_time(run, repeats=repeats)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--repeats", type=int, default=10)
  args = parser.parse_args()
  print(f"{hardware.cpu_name()}, {os.cpu_count()} cores; {CFG.num_layers} layers, d_model {CFG.d_model}, "
        f"{BATCH} × {SEQ} tokens, float32; best of {args.repeats} steps")
  print("| layout | weights | all-to-alls per step | their bytes per device | step (ms) |")
  print("|---|---|---:|---:|---:|")
  for name, mesh_shape, microbatches in LAYOUTS:
    for stage_order in (False, True):
      count, nbytes, seconds = step_of(mesh_shape, microbatches, stage_order, args.repeats)
      print(f"| {name} | {'stage order' if stage_order else 'layer order'} | {count} | {nbytes / 2**10:,.1f} KiB "
            f"| {seconds * 1e3:.1f} |", flush=True)


if __name__ == "__main__":
  main()
