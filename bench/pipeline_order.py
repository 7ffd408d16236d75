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

import numpy as np

from t5x_like.observe import hardware

CFG = dataclasses.replace(bench_parallelism.LAYOUT_CFG, num_layers=8, pipeline_repeats=2)
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
  hlo = []
  seconds = bench_parallelism.layout_step_seconds(mesh_shape, microbatches, repeats, hlo=hlo,
                                                  base=dataclasses.replace(CFG, blocks_in_stage_order=stage_order))
  return (*all_to_all_bytes(hlo[0]), seconds)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--repeats", type=int, default=10)
  args = parser.parse_args()
  print(f"{hardware.cpu_name()}, {os.cpu_count()} cores; {CFG.num_layers} layers, d_model {CFG.d_model}, "
        f"{bench_parallelism.LAYOUT_BATCH} × {bench_parallelism.LAYOUT_SEQ} tokens, float32; best of {args.repeats} steps")
  print("| layout | weights | all-to-alls per step | their bytes per device | step (ms) |")
  print("|---|---|---:|---:|---:|")
  for name, mesh_shape, microbatches in LAYOUTS:
    for stage_order in (False, True):
      count, nbytes, seconds = step_of(mesh_shape, microbatches, stage_order, args.repeats)
      print(f"| {name} | {'stage order' if stage_order else 'layer order'} | {count} | {nbytes / 2**10:,.1f} KiB "
            f"| {seconds * 1e3:.1f} |", flush=True)


if __name__ == "__main__":
  main()
