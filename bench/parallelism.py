"""Step time per mesh layout on an 8-device CPU mesh, and the measured pipeline bubble vs (p−1)/(v·m+p−1).

    python bench/parallelism.py [--repeats 5] [--skip_layouts] [--skip_bubble] [--bubble_only]

Prints two Markdown tables (copied into docs/parallelism.md).

Bubble method. In `pipeline.pipeline_blocks` every stage computes at every one of the v·m + p − 1
iterations (v = pipeline_repeats: 1 is GPipe, 2 the interleaved schedule with two chunks per device);
the stage-slots that hold no microbatch yet (or any more) compute on stale data whose result is never
read. On accelerators those slots are idle time on the critical path; on this CPU mesh the fake devices
share the cores, so the same slots show up as extra work. Both give the same fraction: bubble =
1 − W_useful / W_pipeline, where W_pipeline is the CPU time (all threads, so it depends little on how
busy the shared machine is) of the forward+backward of the block stack pipelined over p devices (v chunks
each) with m microbatches, and W_useful the CPU time of the same microbatches (same layers, same rows per
microbatch) run one after another through `scan_blocks` on one device. The baseline is microbatched
because XLA:CPU's backward of 8-row microbatches costs 20-40% more CPU time than one 64-row pass (smaller
weight-gradient matmuls, per-microbatch accumulation): that is the price of microbatching, which
gradient accumulation pays too, not idle pipeline slots. What the schedule adds on top of the bubble
(rolling the state buffer, the loop buffer, the CPU collectives) is counted in the measured figure.

The bubble table runs in a process of its own pinned to one core, with XLA:CPU's kernels single-threaded
(--xla_cpu_multi_thread_eigen=false): then CPU time is the kernels' work alone. With both cores and
multi-threaded kernels, a one-device program and a p-device one spend different amounts of CPU time on
threads waiting for each other, which moved the measured bubble by ±0.2 between runs (negative bubbles).
"""


import argparse
import os
import subprocess
import sys

# --bubble_only (the bubble half, in its own process: see the docstring) runs on one core with single-threaded
# XLA:CPU kernels, set before jax starts.
BUBBLE_XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false"
if "--bubble_only" in sys.argv:
  os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + BUBBLE_XLA_FLAGS).strip()
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import dataclasses  # pylint: disable=g-import-not-at-top,g-bad-import-order
import functools
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from t5x_like.model import layers
from t5x_like.parallel import mesh as mesh_lib
from t5x_like.model import blocks
from t5x_like.model import config as config_lib
from t5x_like.model import decoder as model_lib
from t5x_like.training import optimizer
from t5x_like.parallel import partitioning
from t5x_like.model import pipeline_parallel as pipeline
from t5x_like.training import train_state
from t5x_like.training import step as train_step
from t5x_like.training.objectives import language_model

RULES = partitioning.DEFAULT_RULES
LAYOUT_CFG = model_lib.GPTConfig(vocab_size=512, max_len=64, num_layers=4, num_heads=8, d_model=128, d_ff=512,
                                 dtype="float32")
LAYOUT_BATCH, LAYOUT_SEQ = 32, 64
LAYOUTS = (
    ("data 8", {"data": 8}, 0),
    ("fsdp 8", {"fsdp": 8}, 0),
    ("tensor 8", {"tensor": 8}, 0),
    ("data 2 × fsdp 2 × tensor 2", {"data": 2, "fsdp": 2, "tensor": 2}, 0),
    ("pipeline 2 × data 2 × tensor 2 (m=4)", {"pipeline": 2, "data": 2, "tensor": 2}, 4),
    ("pipeline 4 × fsdp 2 (m=8)", {"pipeline": 4, "fsdp": 2}, 8),
    ("pipeline 2 × tensor 4 (m=4)", {"pipeline": 2, "tensor": 4}, 4),
    ("pipeline 2 × fsdp 2 × tensor 2 (m=8)", {"pipeline": 2, "fsdp": 2, "tensor": 2}, 8),
)
BUBBLE_CFG = model_lib.GPTConfig(vocab_size=128, max_len=128, num_layers=8, num_heads=4, d_model=256, d_ff=1024,
                                 dtype="float32")
BUBBLE_ROWS_PER_MICROBATCH, BUBBLE_SEQ = 8, 128


def best_time(fn, *args, repeats: int, clock=time.perf_counter) -> float:
  """Minimum `clock` time of `fn(*args)` over `repeats` runs after one warm-up (compile) run."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = clock()
    jax.block_until_ready(fn(*args))
    times.append(clock() - start)
  return min(times)


def synthetic_batch(batch: int, seq: int, vocab: int) -> dict:
  tokens = np.random.RandomState(0).randint(0, vocab, (batch, seq + 1)).astype(np.int32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": np.ones((batch, seq), np.int32),
          "positions": np.tile(np.arange(seq, dtype=np.int32), (batch, 1)),
          "weights": np.ones((batch, seq), np.float32)}


def layout_step_seconds(mesh_shape: dict, pipeline_microbatches: int, repeats: int, base=None, hlo=None) -> float:
  """Best wall time of one jitted AdamW train step (sharded state, donated) on the layout, of `base` (default
  LAYOUT_CFG; with blocks_in_stage_order the state is put in stage order first, as the trainer does). `hlo`: a list
  the compiled step's HLO text is appended to."""
  mesh = mesh_lib.create_mesh(mesh_shape)
  cfg = dataclasses.replace(base or LAYOUT_CFG, num_stages=mesh.shape["pipeline"],
                            pipeline_microbatches=pipeline_microbatches)
  cfg.validate()
  config_lib.check_layout(cfg, mesh.shape, batch_size=LAYOUT_BATCH)
  model = model_lib.GPT(cfg)
  opt = optimizer.OptimizerConfig(warmup_steps=1)
  tx, lr_fn = optimizer.make_optimizer(opt, 100), optimizer.learning_rate_schedule(opt, 100)
  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    state, shardings = train_state.init_state(model, tx, jax.random.key(0), mesh, RULES)
    state = pipeline.reorder_blocks(cfg, state, to_stage=True, donate=True)  # a no-op unless stage-ordered
    batch_sharding = partitioning.batch_sharding(mesh, RULES)
    batch = {k: jax.device_put(v, batch_sharding)
             for k, v in synthetic_batch(LAYOUT_BATCH, LAYOUT_SEQ, cfg.vocab_size).items()}
    step = jax.jit(functools.partial(train_step.train_step, objective=language_model.LanguageModel(model.apply), tx=tx, lr_fn=lr_fn),
                   in_shardings=(shardings, {k: batch_sharding for k in batch}), out_shardings=(shardings, None),
                   donate_argnums=(0,)).lower(state, batch).compile()
    if hlo is not None:
      hlo.append(step.as_text())
    holder = [state]

    def run():
      holder[0], metrics = step(holder[0], batch)
      return metrics["loss"]

    return best_time(run, repeats=repeats)


@functools.lru_cache(maxsize=None)
def block_stack_seconds(stages: int, microbatches: int, repeats: int, virtual: int = 1,
                        scan: bool = False) -> float:
  """Best CPU time (all threads) of forward+backward through the block stack with `microbatches` microbatches:
  pipelined over `stages` devices, `virtual` chunks each (stages == 1: the same schedule on one device, so
  `virtual` chunks one after another for each microbatch, v·m iterations, no bubble); or, with `scan`, the
  microbatches one after another through one `scan_blocks` over all layers."""
  rows = BUBBLE_ROWS_PER_MICROBATCH * microbatches
  cfg = dataclasses.replace(BUBBLE_CFG, num_stages=stages, pipeline_microbatches=microbatches,
                            pipeline_repeats=virtual)
  cfg.validate()
  mesh = mesh_lib.create_mesh({"pipeline": stages}, jax.devices()[:stages])
  params = partitioning.unbox(blocks.init_stacked_blocks(cfg, jax.random.key(0), cfg.num_layers))
  x = jax.random.normal(jax.random.key(1), (rows, BUBBLE_SEQ, cfg.d_model), jnp.float32)
  segment_ids = jnp.ones((rows, BUBBLE_SEQ), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(BUBBLE_SEQ, dtype=jnp.int32), (rows, BUBBLE_SEQ))

  def loss(p, h):
    if not scan:
      out = pipeline.pipeline_blocks(cfg, p, h, segment_ids, positions)
    else:  # the same microbatches, one after another
      mask = layers.causal_segment_mask(segment_ids[:BUBBLE_ROWS_PER_MICROBATCH])
      out = jax.lax.map(lambda mb: blocks.scan_blocks(cfg, p, mb, mask, positions[:BUBBLE_ROWS_PER_MICROBATCH]),
                        h.reshape((microbatches, BUBBLE_ROWS_PER_MICROBATCH) + h.shape[1:]))
    return jnp.mean(jnp.square(out))

  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    shardings = jax.tree.map(lambda w: jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec("pipeline" if stages > 1 else None)), params)
    params = jax.device_put(params, shardings)
    grad = jax.jit(jax.grad(loss))
    return best_time(grad, params, x, repeats=repeats, clock=time.process_time)


def layout_table(repeats: int) -> None:
  c = LAYOUT_CFG
  print(f"Train step (AdamW, float32), {c.num_layers} layers, d_model {c.d_model}, {c.num_heads} heads, "
        f"d_ff {c.d_ff}, vocab {c.vocab_size}; batch {LAYOUT_BATCH} × {LAYOUT_SEQ} tokens; best of {repeats}\n")
  print("| layout | step ms | tokens/s |\n|---|---:|---:|")
  for name, shape, m in LAYOUTS:
    seconds = layout_step_seconds(shape, m, repeats)
    print(f"| {name} | {seconds * 1e3:.1f} | {LAYOUT_BATCH * LAYOUT_SEQ / seconds:,.0f} |", flush=True)
  print()


def bubble_table(repeats: int, microbatches: list) -> None:
  c = BUBBLE_CFG
  print(f"Pipeline bubble: forward+backward of {c.num_layers} blocks (d_model {c.d_model}, d_ff {c.d_ff}), "
        f"{BUBBLE_ROWS_PER_MICROBATCH} rows × {BUBBLE_SEQ} tokens per microbatch; CPU seconds on one core "
        f"(single-threaded kernels), best of {repeats}. Baseline: the same chunks (L/(p·v) layers) one after "
        f"another on one device (p·v·m iterations, no bubble); also against one scan over all layers\n")
  print("| p | v | m | baseline CPU ms | pipelined CPU ms | measured bubble | (p−1)/(v·m+p−1) | difference | "
        "vs one scan (ms: bubble) |\n|---:|---:|---:|---:|---:|---:|---:|---:|---|")
  for stages in (2, 4):
    for virtual in (1, 2):
      for m in microbatches:
        useful = block_stack_seconds(1, m, repeats, stages * virtual)
        piped = block_stack_seconds(stages, m, repeats, virtual)
        scanned = block_stack_seconds(1, m, repeats, scan=True)
        theory = pipeline.bubble_fraction(stages, m, virtual)
        print(f"| {stages} | {virtual} | {m} | {useful * 1e3:.1f} | {piped * 1e3:.1f} | {1 - useful / piped:.3f} | "
              f"{theory:.3f} | {1 - useful / piped - theory:+.3f} | {scanned * 1e3:.0f}: {1 - scanned / piped:.3f} |",
              flush=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--skip_layouts", action="store_true")
  parser.add_argument("--skip_bubble", action="store_true")
  parser.add_argument("--microbatches", type=int, nargs="+", default=[8, 16], help="pipeline microbatches m")
  parser.add_argument("--bubble_only", action="store_true",
                      help="the bubble table alone, in this process (on one core, single-threaded XLA:CPU kernels)")
  args = parser.parse_args()
  print(f"jax {jax.__version__}, {jax.device_count()} CPU devices, {len(os.sched_getaffinity(0))} of "
        f"{os.cpu_count()} cores in use\n", flush=True)
  if args.bubble_only:
    bubble_table(args.repeats, args.microbatches)
    return
  if not args.skip_layouts:
    layout_table(args.repeats)
  if not args.skip_bubble:  # its own process: the core and the XLA flags are set before jax starts
    sys.exit(subprocess.call([sys.executable, __file__, "--bubble_only", "--repeats", str(args.repeats),
                              "--microbatches", *map(str, args.microbatches)]))


if __name__ == "__main__":
  main()
