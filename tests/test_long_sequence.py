"""Context parallelism for long sequences: the planner's memory model splits activations over `sequence`, so a
sequence 4× longer than one device's budget holds is planned on a `sequence` mesh, and that plan compiles within
the budget and trains.

The budget is a made-up 70 MiB device. One device fits 512 tokens of LONG (8 layers, d_model 128, full remat, one
sequence per step, `xla` attention) but not 1,024; 2,048 = 4 × 512 fits with `sequence` = 8 (not 4: attention keeps
one layer's (T/s, T) float32 scores while it is recomputed, and those grow with T²/s). XLA:CPU's compiled memory
analysis against the memory model (1 Dec 2026): 512 tokens 44.7 MiB (estimate 49.6); 1,024: 77.4 (79.0); 2,048:
180.7 (186.0); 2,048 over sequence 4: 76.2 (82.8), over 8: 59.8 (65.6). The slow test re-checks the planned layout
and runs two steps.
"""

import dataclasses

import flax.linen as nn
import jax
import numpy as np
import pytest

from t5x_like.model import decoder as model_lib
from t5x_like.observe import hardware
from t5x_like.parallel import mesh as mesh_lib
from t5x_like.parallel import partitioning
from t5x_like.planning import memory_model
from t5x_like.planning import planner
from t5x_like.training import optimizer
from t5x_like.training import precision
from t5x_like.training import train_state

pytestmark = pytest.mark.run_bound  # tests/conftest.py: 12 s longer at level 0 with the cache warm

# jax.nn.dot_product_attention's full (T/s, T) scores: the reference path computes causal attention by blocks of
# query rows (about half the scores), so one device alone would already hold a ~1.4× longer sequence.
LONG = model_lib.GPTConfig(vocab_size=256, max_len=2048, num_layers=8, num_heads=2, d_model=128, d_ff=512,
                           attention_impl="xla")
BUDGET = 70 * 2**20
SHORT, LENGTH = 512, 2048  # LENGTH = 4 × SHORT
DEVICE = dataclasses.replace(hardware.get("h100"), name="70 MiB device", hbm_bytes=BUDGET)


def _target(seq_len: int, max_sequence: int = 1) -> planner.Target:
  return planner.Target(hardware=DEVICE, num_devices=8, global_batch=1, seq_len=seq_len, tokens=1e9,
                        memory_fraction=1.0, max_sequence=max_sequence)


def test_a_sequence_four_times_longer_than_one_device_holds_is_planned_over_sequence():
  one_device = lambda seq_len, **axes: memory_model.estimate(LONG, memory_model.Layout(remat_policy="full", **axes),
                                                             1, seq_len).total
  assert one_device(SHORT) < BUDGET < one_device(2 * SHORT)
  assert one_device(LENGTH, sequence=4) > BUDGET > one_device(LENGTH, sequence=8)
  # One sequence per step: data and fsdp cannot split it, the pipeline has no microbatches to stream; only the
  # length can be split.
  _, feasible, _ = planner.report(LONG, _target(LENGTH), remat_policies=("full",))
  assert not feasible
  _, feasible, _ = planner.report(LONG, _target(LENGTH, max_sequence=8), remat_policies=("full",))
  assert feasible and all(c.layout.sequence > 1 for c in feasible)
  assert any(c.layout == memory_model.Layout(sequence=8, remat_policy="full") for c in feasible)
  best = feasible[0]
  assert best.time.sequence > 0 and best.memory.total < BUDGET


@pytest.mark.slow  # one train-step compile on 8 devices and two steps at 2,048 tokens; CI runs it
def test_the_planned_long_sequence_layout_compiles_within_the_budget_and_trains():
  layout = memory_model.Layout(sequence=8, remat_policy="full")
  opt = optimizer.OptimizerConfig(learning_rate=1e-2, warmup_steps=0)  # no warm-up: the first step already learns
  compiled = memory_model.compile_train_step(LONG, layout, 1, LENGTH, optimizer_config=opt)
  xla = memory_model.xla_bytes_per_device(compiled.memory_analysis())
  assert xla < BUDGET
  assert abs(memory_model.estimate(LONG, layout, 1, LENGTH).total / xla - 1) < 0.15
  mesh = mesh_lib.create_mesh(layout.mesh_shape, jax.devices()[:8])
  cfg = memory_model.layout_config(LONG, layout)
  model = model_lib.GPT(cfg)
  tx = optimizer.make_optimizer(opt, 1000)
  tokens = np.random.RandomState(0).randint(0, LONG.vocab_size, (1, LENGTH + 1)).astype(np.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": np.ones((1, LENGTH), np.int32),
           "positions": np.arange(LENGTH, dtype=np.int32)[None], "weights": np.ones((1, LENGTH), np.float32)}
  with jax.set_mesh(mesh), nn.logical_axis_rules(partitioning.DEFAULT_RULES):
    loss_scale = precision.init_loss_scale(precision.PrecisionConfig(), cfg.dtype)
    state, _ = train_state.init_state(model, tx, jax.random.key(0), mesh, loss_scale=loss_scale)
    sharding = partitioning.batch_sharding(mesh)
    assert sharding.spec == jax.sharding.PartitionSpec(("data", "fsdp", "expert"), "sequence")
    batch = {k: jax.device_put(v, sharding) for k, v in batch.items()}
    losses = []
    for _ in range(2):
      state, metrics = compiled(state, batch, {})
      losses.append(float(metrics["loss"]))
  assert np.isfinite(losses).all() and losses[1] < losses[0] and abs(losses[0] - np.log(LONG.vocab_size)) < 0.5


# Ring attention (context_parallelism='ring') holds one (T/s) × (T/s) block of scores at a time, not (T/s) × T:
# 8 × 512 tokens (one device's 512, eight times over) fit on the 70 MiB device with sequence = 8, where the
# all-gather needs more. Learned positions: max_len 4,096 for both. XLA:CPU's compiled memory analysis (4 Dec
# 2026): ring 52.6 MiB (estimate 60.0), all-gather 114.4 (116.1).
RING_LENGTH = 8 * SHORT
GATHERED = dataclasses.replace(LONG, max_len=RING_LENGTH)
RING = dataclasses.replace(GATHERED, context_parallelism="ring")


@pytest.mark.slow  # two train-step compiles on 8 devices at 4,096 tokens; CI runs them
def test_ring_attention_fits_a_sequence_eight_times_longer_than_one_device_holds():
  layout = memory_model.Layout(sequence=8, remat_policy="full")
  one_device = memory_model.Layout(remat_policy="full")
  assert memory_model.estimate(GATHERED, one_device, 1, SHORT).total < BUDGET
  assert memory_model.estimate(GATHERED, one_device, 1, 2 * SHORT).total > BUDGET
  xla = {}
  for name, cfg in (("ring", RING), ("all_gather", GATHERED)):
    compiled = memory_model.compile_train_step(cfg, layout, 1, RING_LENGTH)
    xla[name] = memory_model.xla_bytes_per_device(compiled.memory_analysis())
    estimate = memory_model.estimate(cfg, layout, 1, RING_LENGTH).total
    assert abs(estimate / xla[name] - 1) < 0.15, (name, estimate / 2**20, xla[name] / 2**20)
    hlo = compiled.as_text()  # the keys/values go round the ring, or are all-gathered: never both
    assert ("collective-permute" in hlo, "all-gather" in hlo) == ((True, False) if name == "ring" else (False, True))
  assert xla["ring"] < BUDGET < xla["all_gather"], {k: v / 2**20 for k, v in xla.items()}
