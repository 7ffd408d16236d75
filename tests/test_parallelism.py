"""Every mesh layout trains exactly like one device: data, fsdp, tensor, pipeline (GPipe and interleaved),
sequence (context parallelism), combined, with
gradient accumulation and remat; parameters and optimizer state are really sharded; bad layouts
are refused up front with errors naming the key.

Tolerance (float32 compute throughout): per-step losses and gradient norms within rtol 1e-5, and every
parameter after 3 AdamW steps within atol 4e-6 + rtol 1e-5 of the single-device run (a step moves a parameter
by up to lr = 1e-3). The only differences left are the order of float32 sums (all-reduces, accumulation,
pipeline microbatches). AdamW's eps is 1e-6 here: the key bias has an exactly zero true gradient (softmax
ignores a shift shared by all keys), and with a tiny eps Adam would turn its float32 noise (~1e-11) into ±lr
steps. Where a gradient is itself near eps (the embedding row of a token absent from the batch, whose gradient
is only the output projection's small softmax terms), Adam still amplifies a 1e-9 difference of sums into
~2.5e-6: the largest seen (pipeline2_fsdp2_tensor2_m8, token_embedding[244, 31]).
"""

import dataclasses
import functools
import os
import re
import subprocess
import sys

import flax.linen as nn
import jax
import numpy as np
import pytest

from t5x_like.parallel import distributed
from t5x_like.parallel import mesh as mesh_lib
from t5x_like.model import config as config_lib
from t5x_like.model import decoder as model_lib
from t5x_like.model import pipeline_parallel
from t5x_like.training import optimizer
from t5x_like.parallel import partitioning
from t5x_like.training import train_state
from t5x_like.training import step as train_step
from t5x_like.training.objectives import language_model

CFG = model_lib.GPTConfig(vocab_size=256, max_len=32, num_layers=4, num_heads=8, d_model=64, d_ff=256,
                          dtype="float32")
BATCH, SEQ, STEPS = 32, 16, 3
LOSS_RTOL = 1e-5
PARAM_ATOL, PARAM_RTOL = 4e-6, 1e-5
# For models whose gradients have elements near zero (Llama's and Gemma's options): AdamW divides each gradient by its
# own RMS, so such an element turns float32 summation-order noise into a larger step. Measured 2.3e-6 (Llama, AVX-512
# EPYC) and 4.1e-6 (Gemma options under the interleaved pipeline, AVX2 EPYC), one of 16k output-projection weights
# each time. A wrong split moves weights by ~lr = 1e-3.
NEAR_ZERO_GRAD_PARAM_ATOL = 6e-6
RULES = partitioning.DEFAULT_RULES
OPT = optimizer.OptimizerConfig(learning_rate=1e-3, warmup_steps=1, eps=1e-6)


def synthetic_batch(seed: int = 0) -> dict:
  """Packed rows (two documents each, some padding) so segment ids and weights matter."""
  rng = np.random.RandomState(seed)
  tokens = rng.randint(0, CFG.vocab_size, (BATCH, SEQ + 1)).astype(np.int32)
  cut = rng.randint(3, SEQ - 3, BATCH)
  col = np.arange(SEQ)[None]
  segment_ids = np.where(col < cut[:, None], 1, 2).astype(np.int32)
  segment_ids[::3, SEQ - 2:] = 0  # padding tails
  positions = np.where(col < cut[:, None], col, col - cut[:, None]).astype(np.int32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": segment_ids,
          "positions": positions, "weights": (segment_ids != 0).astype(np.float32)}


def make_layout(mesh_shape: dict, *, remat: str = "none", pipeline_microbatches: int = 0, pipeline_repeats: int = 1,
                devices=None, base=CFG):
  """(mesh, validated model config, model, optimizer, lr schedule) for a mesh layout of the `base` model."""
  mesh = mesh_lib.create_mesh(mesh_shape, devices)
  cfg = dataclasses.replace(base, remat_policy=remat, num_stages=mesh.shape["pipeline"],
                            pipeline_microbatches=pipeline_microbatches, pipeline_repeats=pipeline_repeats)
  cfg.validate()
  model = model_lib.GPT(cfg)
  return mesh, cfg, model, optimizer.make_optimizer(OPT, 10), optimizer.learning_rate_schedule(OPT, 10)


def host_initial_state(base=CFG):
  """The initial TrainState of `base` as host arrays (one init compile; each layout shards it its own way)."""
  mesh, _, model, tx, _ = make_layout({"data": 1}, devices=jax.devices()[:1], base=base)
  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    state, _ = train_state.init_state(model, tx, jax.random.key(0), mesh, RULES)
  return jax.tree.map(np.asarray, state)


@pytest.fixture(scope="module")
def initial_state():
  return host_initial_state()


def train(initial, mesh_shape: dict, *, num_microbatches: int = 1, remat: str = "none",
          pipeline_microbatches: int = 0, pipeline_repeats: int = 1, devices=None, base=CFG, hlo=None):
  """Runs STEPS train steps from `initial` on one batch; returns ([(loss, grad_norm)], params as numpy). With
  `base.blocks_in_stage_order` the state is put in stage order first and its parameters back in layer order after
  (pipeline_parallel.to_stage_order / to_layer_order). `hlo`: a list the compiled step's HLO text is appended to."""
  mesh, cfg, model, tx, lr_fn = make_layout(mesh_shape, remat=remat, pipeline_microbatches=pipeline_microbatches,
                                            pipeline_repeats=pipeline_repeats, devices=devices, base=base)
  config_lib.check_layout(cfg, mesh.shape, batch_size=BATCH, num_microbatches=num_microbatches)
  if cfg.blocks_stage_ordered:
    initial = pipeline_parallel.to_stage_order(cfg, initial)
  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    _, shardings = train_state.state_shardings(model, tx, mesh, RULES)
    state = jax.device_put(initial, shardings)
    batch_sharding = partitioning.batch_sharding(mesh, RULES)
    batch = {k: jax.device_put(v, batch_sharding) for k, v in synthetic_batch().items()}
    step = jax.jit(functools.partial(train_step.train_step, objective=language_model.LanguageModel(model.apply), tx=tx, lr_fn=lr_fn,
                                     num_microbatches=num_microbatches),
                   in_shardings=(shardings, {k: batch_sharding for k in batch}),
                   out_shardings=(shardings, None)).lower(state, batch).compile()
    if hlo is not None:
      hlo.append(step.as_text())
    history = []
    for _ in range(STEPS):
      state, metrics = step(state, batch)
      history.append((float(metrics["loss"]), float(metrics["grad_norm"])))
  params = pipeline_parallel.to_layer_order(cfg, state.params) if cfg.blocks_stage_ordered else state.params
  return np.array(history), jax.tree.map(np.asarray, params)


@pytest.fixture(scope="module")
def reference(initial_state):
  """The single-device run: no sharding, no accumulation, no remat, no pipeline."""
  return train(initial_state, {"data": 1}, devices=jax.devices()[:1])


def assert_same_training(result, reference_run, param_atol=PARAM_ATOL):
  (losses, params), (ref_losses, ref_params) = result, reference_run
  np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
  assert losses[-1, 0] < losses[0, 0]  # it trained
  flat, ref_flat = jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(ref_params)
  for (path, leaf), ref_leaf in zip(flat, ref_flat):
    np.testing.assert_allclose(leaf, ref_leaf, atol=param_atol, rtol=PARAM_RTOL,
                               err_msg=jax.tree_util.keystr(path))


LAYOUTS = {
    "data8": dict(mesh_shape={"data": 8}),
    "fsdp8": dict(mesh_shape={"fsdp": 8}),
    "data2_fsdp2_tensor2": dict(mesh_shape={"data": 2, "fsdp": 2, "tensor": 2}),
    # interleaved: each of the 2 stages holds layers {0, 2} or {1, 3}, 4 microbatches go round twice
    "pipeline2_data2_tensor2_v2": dict(mesh_shape={"pipeline": 2, "data": 2, "tensor": 2}, pipeline_repeats=2),
    "pipeline4_fsdp2": dict(mesh_shape={"pipeline": 4, "fsdp": 2}),
    "pipeline2_fsdp2_tensor2_m8": dict(mesh_shape={"pipeline": 2, "fsdp": 2, "tensor": 2},
                                       pipeline_microbatches=8),
    # context parallelism: activations split along the sequence, keys/values all-gathered per layer
    "sequence2_data2_tensor2": dict(mesh_shape={"sequence": 2, "data": 2, "tensor": 2}),
    "sequence4_tensor2": dict(mesh_shape={"sequence": 4, "tensor": 2}),
    # ring attention: key/value blocks pass around the sequence axis (model/ring.py)
    "sequence4_data2_ring": dict(mesh_shape={"sequence": 4, "data": 2},
                                 base=dataclasses.replace(CFG, context_parallelism="ring")),
}


# The fast subset keeps one layout per kind (pure data; data×fsdp×tensor; pipelines are slow-marked);
# the full suite (CI) runs all nine.
FAST_LAYOUTS = ("data8", "data2_fsdp2_tensor2")


@pytest.mark.parametrize("layout", [l if l in FAST_LAYOUTS else pytest.param(l, marks=pytest.mark.slow)
                                    for l in LAYOUTS])
def test_layout_trains_like_one_device(layout, initial_state, reference):
  assert_same_training(train(initial_state, **LAYOUTS[layout]), reference)


def _all_to_alls(hlo_text: str) -> list:
  return [line.strip()[:160] for line in hlo_text.splitlines() if re.search(r"\ball-to-all(-start)?\(", line)]


@pytest.mark.slow  # two compiles of the interleaved pipeline; CI runs it
def test_interleaved_pipeline_in_stage_order_trains_like_one_device_and_never_regroups_its_weights(
    initial_state, reference):
  """The trainer's interleaved pipeline holds its blocks in stage order (GPTConfig.blocks_in_stage_order): its
  compiled step has no all-to-all (in layer order, the same layout's step regroups every block weight and gradient
  through one), and it trains like one device once its parameters are put back in layer order."""
  layout = LAYOUTS["pipeline2_data2_tensor2_v2"]
  texts = []
  result = train(initial_state, **layout, base=dataclasses.replace(CFG, blocks_in_stage_order=True), hlo=texts)
  assert _all_to_alls(texts[0]) == []
  assert_same_training(result, reference)
  mesh, cfg, model, tx, lr_fn = make_layout(layout["mesh_shape"], pipeline_repeats=2)  # layer order: regroups
  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    abstract, shardings = train_state.state_shardings(model, tx, mesh, RULES)
    batch_sharding = partitioning.batch_sharding(mesh, RULES)
    step = jax.jit(functools.partial(train_step.train_step, objective=language_model.LanguageModel(model.apply),
                                     tx=tx, lr_fn=lr_fn, num_microbatches=1), out_shardings=(shardings, None))
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=batch_sharding) for k, v in synthetic_batch().items()}
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    regrouped = _all_to_alls(step.lower(state, batch).compile().as_text())
  assert len(regrouped) >= 2 * len(jax.tree.leaves(abstract.params["blocks"])), regrouped  # forward + backward


# Accumulation + full remat on two layouts that between them split over every axis (data, fsdp, tensor,
# pipeline with 8 pipeline microbatches); the plain variant above covers all nine layouts.
ACCUMULATION_LAYOUTS = ("data2_fsdp2_tensor2", "pipeline2_fsdp2_tensor2_m8")


@pytest.mark.slow  # a second compile per layout; CI runs it
@pytest.mark.parametrize("layout", ACCUMULATION_LAYOUTS)
def test_layout_with_accumulation_and_remat_trains_like_one_device(layout, initial_state, reference):
  assert_same_training(train(initial_state, **LAYOUTS[layout], num_microbatches=2, remat="full"), reference)


def test_sharded_init_equals_host_init_and_is_really_sharded(initial_state):
  """jit(init, out_shardings) on pipeline2×fsdp2×tensor2 gives the same values, and each device holds
  1/(pipeline×fsdp×tensor) of every leaf split over all three axes (blocks' kernels and their Adam
  moments), and exactly 1/(product of its axes) of every other leaf."""
  mesh, _, model, tx, _ = make_layout({"pipeline": 2, "fsdp": 2, "tensor": 2})
  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    state, shardings = train_state.init_state(model, tx, jax.random.key(0), mesh, RULES)
  for leaf, ref in zip(jax.tree.leaves(state), jax.tree.leaves(initial_state)):
    np.testing.assert_allclose(np.asarray(leaf), ref, rtol=1e-6, atol=1e-7)
  fully_sharded_total, fully_sharded_held = 0, None
  for leaf, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(shardings)):
    axes = {a for entry in sharding.spec if entry for a in (entry if isinstance(entry, tuple) else (entry,))}
    ways = int(np.prod([mesh.shape[a] for a in axes]))
    held = partitioning.bytes_per_device(leaf)
    assert set(held.values()) == {leaf.nbytes // ways}, (sharding.spec, leaf.shape)
    if axes == {"pipeline", "fsdp", "tensor"}:
      fully_sharded_total += leaf.nbytes
      fully_sharded_held = {d: (fully_sharded_held or {}).get(d, 0) + b for d, b in held.items()}
  assert fully_sharded_total > 0.8 * sum(x.nbytes for x in jax.tree.leaves(state))  # most of the bytes
  assert set(fully_sharded_held.values()) == {fully_sharded_total // 8}


def test_rules_give_megatron_tensor_parallelism_and_fsdp():
  """Attention heads, MLP units and the vocabulary split over `tensor`; d_model over `fsdp`;
  layers over `pipeline`; Adam moments sharded exactly like their parameters."""
  mesh, _, model, tx, _ = make_layout({"pipeline": 2, "fsdp": 2, "tensor": 2})
  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    _, shardings = train_state.state_shardings(model, tx, mesh, RULES)
  spec = lambda tree, *path: tuple(functools.reduce(lambda t, k: t[k], path, tree).spec)
  params = shardings.params
  assert spec(params, "blocks", "attn", "qkv", "kernel") == ("pipeline", "fsdp", None, "tensor", None)
  assert spec(params, "blocks", "attn", "out", "kernel") == ("pipeline", "tensor", None, "fsdp")
  assert spec(params, "blocks", "mlp_in", "kernel") == ("pipeline", "fsdp", "tensor")
  assert spec(params, "blocks", "mlp_out", "kernel") == ("pipeline", "tensor", "fsdp")
  assert spec(params, "token_embedding") == ("tensor", "fsdp")
  adam = shardings.opt_state[-1][0]  # clip → (adamw: scale_by_adam state, ...)
  assert jax.tree.map(lambda s: s.spec, adam.mu) == jax.tree.map(lambda s: s.spec, params)
  assert jax.tree.map(lambda s: s.spec, adam.nu) == jax.tree.map(lambda s: s.spec, params)


def test_cross_entropy_is_vocab_parallel(initial_state):
  """With tensor=8 the compiled loss never materialises full-vocabulary logits on a device."""
  mesh, _, model, _, _ = make_layout({"tensor": 8})
  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    _, shardings = train_state.state_shardings(model, optimizer.make_optimizer(OPT, 10), mesh, RULES)
    loss = jax.jit(lambda p, b: language_model.LanguageModel(model.apply).loss(p, b)[:2], in_shardings=(shardings.params, None))
    hlo = loss.lower(initial_state.params, synthetic_batch()).compile().as_text()
  assert f"[{BATCH},{SEQ},{CFG.vocab_size // 8}]" in hlo
  assert f"[{BATCH},{SEQ},{CFG.vocab_size}]" not in hlo


def test_sequence_axis_splits_activations_along_the_length(initial_state):
  """With sequence=4 the compiled loss holds (B, T/4, V) logits and (B, H, T/4, T) attention scores per device:
  queries split along the length, keys and values gathered whole; never the full (B, T, V) logits."""
  mesh, _, model, _, _ = make_layout({"sequence": 4}, devices=jax.devices()[:4])
  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    _, shardings = train_state.state_shardings(model, optimizer.make_optimizer(OPT, 10), mesh, RULES)
    loss = jax.jit(lambda p, b: language_model.LanguageModel(model.apply).loss(p, b)[:2],
                   in_shardings=(shardings.params, partitioning.batch_sharding(mesh, RULES)))
    hlo = loss.lower(initial_state.params, synthetic_batch()).compile().as_text()
  assert f"[{BATCH},{SEQ // 4},{CFG.vocab_size}]" in hlo
  assert f"[{BATCH},{CFG.num_heads},{SEQ // 4},{SEQ}]" in hlo
  assert f"[{BATCH},{SEQ},{CFG.vocab_size}]" not in hlo


def loss_grads(cfg: model_lib.GPTConfig, params) -> list:
  batch = synthetic_batch()
  grad = jax.jit(jax.grad(lambda p: language_model.LanguageModel(model_lib.GPT(cfg).apply).loss(p, batch)[0]))
  return [np.asarray(g) for g in jax.tree.leaves(grad(params))]


@pytest.fixture(scope="module")
def no_remat_grads(initial_state):
  # The rolled layer loop, as every remat policy runs it (scan_unroll's auto unrolls only without remat).
  return loss_grads(dataclasses.replace(CFG, scan_unroll=1), initial_state.params)


@pytest.mark.parametrize("policy", [p for p in config_lib.REMAT_POLICIES if p != "none"])
def test_remat_policy_keeps_gradients(policy, initial_state, no_remat_grads):
  """Every remat policy gives the gradients of no remat (offload_dots included: this CPU backend
  has a pinned_host memory space, so it runs here too)."""
  cfg = dataclasses.replace(CFG, remat_policy=policy)
  cfg.validate()
  # atol 1e-6 of the leaf's largest gradient: the recomputed forward's dots are library (YNN) calls of their own,
  # summed in another order (up to 1e-5 apart on gradients of magnitude 55); a wrong residual is off by O(1).
  for leaf, ref_leaf in zip(loss_grads(cfg, initial_state.params), no_remat_grads):
    np.testing.assert_allclose(leaf, ref_leaf, rtol=1e-5, atol=1e-6 * np.abs(ref_leaf).max())


def check(model_overrides: dict, mesh_shape: dict, batch_size: int = BATCH, num_microbatches: int = 1):
  cfg = dataclasses.replace(CFG, **model_overrides)
  cfg.validate()
  config_lib.check_layout(cfg, mesh_lib.resolve_mesh_shape(mesh_shape, 8), batch_size=batch_size,
                          num_microbatches=num_microbatches)


@pytest.mark.parametrize("model_overrides, mesh_shape, batch_size, num_microbatches, message", [
    ({}, {"data": 3}, BATCH, 1, "MESH_SHAPE"),
    ({}, {"data": 2, "tensor": -1, "fsdp": -1}, BATCH, 1, "only one axis may be -1"),
    ({"num_heads": 4, "d_model": 64}, {"tensor": 8}, BATCH, 1, "GPTConfig.num_heads=4"),
    ({"d_ff": 258}, {"tensor": 4, "data": 2}, BATCH, 1, "GPTConfig.d_ff=258"),
    ({"vocab_size": 250}, {"tensor": 4, "data": 2}, BATCH, 1, "GPTConfig.vocab_size=250"),
    ({"d_model": 68, "num_heads": 4}, {"fsdp": 8}, BATCH, 1, "GPTConfig.d_model=68"),
    ({"num_layers": 6, "num_stages": 4}, {"pipeline": 4, "data": 2}, BATCH, 1, "GPTConfig.num_layers=6"),
    ({"num_stages": 1}, {"pipeline": 2, "data": 4}, BATCH, 1, "GPTConfig.num_stages=1"),
    ({}, {"data": 8}, 12, 1, "BATCH_SIZE=12"),
    ({}, {"data": 8}, BATCH, 8, "NUM_MICROBATCHES"),
    ({"num_stages": 2, "pipeline_microbatches": 8}, {"pipeline": 2, "data": 4}, 16, 1,
     "GPTConfig.pipeline_microbatches=8"),
    ({"remat_policy": "everything"}, {"data": 8}, BATCH, 1, "GPTConfig.remat_policy"),
    ({"num_stages": 2, "pipeline_repeats": 3}, {"pipeline": 2, "data": 4}, BATCH, 1, "GPTConfig.pipeline_repeats=3"),
    ({"num_stages": 4, "pipeline_repeats": 2}, {"pipeline": 4, "data": 2}, BATCH, 1, "GPTConfig.pipeline_repeats=2"),
    ({"num_stages": 2, "pipeline_repeats": 2, "pipeline_microbatches": 1}, {"pipeline": 2, "data": 4}, BATCH, 1,
     "needs at least one microbatch per stage"),
])
def test_bad_layouts_are_refused_before_compiling(model_overrides, mesh_shape, batch_size, num_microbatches,
                                                  message):
  with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
    check(model_overrides, mesh_shape, batch_size, num_microbatches)


def test_sequence_length_must_split_over_the_sequence_axis():
  config_lib.check_layout(CFG, mesh_lib.resolve_mesh_shape({"sequence": 4, "data": 2}, 8), batch_size=BATCH,
                          seq_len=16)
  with pytest.raises(ValueError, match=r"SEQ_LEN=18 is not divisible by MESH_SHAPE\['sequence'\]=4"):
    config_lib.check_layout(CFG, mesh_lib.resolve_mesh_shape({"sequence": 4, "data": 2}, 8), batch_size=BATCH,
                            seq_len=18)


def test_offload_is_refused_where_the_backend_has_no_host_memory(monkeypatch):
  monkeypatch.setattr(config_lib, "_has_host_offload", lambda: False)
  with pytest.raises(ValueError, match="GPTConfig.remat_policy='offload_dots' needs a 'pinned_host'"):
    dataclasses.replace(CFG, remat_policy="offload_dots").validate()


def test_trainer_validate_layout_applies_the_model_checks():
  from t5x_like.training import config as config_lib  # pylint: disable=g-import-not-at-top
  from t5x_like.recipes import experiment  # pylint: disable=g-import-not-at-top  (imports TensorFlow)
  mesh = mesh_lib.create_mesh({"tensor": 8})
  config = config_lib.TrainConfig(batch_size=BATCH, mesh_shape={"tensor": 8})
  experiment.validate_layout(config, mesh, CFG)
  with pytest.raises(ValueError, match="GPTConfig.num_heads=4 is not divisible by MESH_SHAPE"):
    experiment.validate_layout(config, mesh, dataclasses.replace(CFG, num_heads=4))
  rules = tuple((name, None if name == "heads" else target) for name, target in partitioning.DEFAULT_RULES)
  experiment.validate_layout(dataclasses.replace(config, axis_rules=rules), mesh,  # the rules in use decide:
                             dataclasses.replace(CFG, num_heads=4))  # heads unsharded → no constraint


@pytest.mark.parametrize("shape, granules, within, across", [
    ({"pipeline": 2, "data": 4, "fsdp": 2, "tensor": 8}, 4, (1, 2, 2, 8), (2, 2, 1, 1)),
    ({"pipeline": 1, "data": 1, "fsdp": 16, "tensor": 8}, 2, (1, 1, 8, 8), (1, 1, 2, 1)),
    ({"pipeline": 1, "data": 6, "fsdp": 4, "tensor": 8}, 4, (1, 3, 2, 8), (1, 2, 2, 1)),
])
def test_slow_links_go_to_the_outer_axes(shape, granules, within, across):
  inner, outer = mesh_lib.split_over_granules(shape, granules)
  assert tuple(inner.values()) == within and tuple(outer.values()) == across


def test_tensor_is_never_split_over_slices():
  with pytest.raises(ValueError, match="cannot spread 4 slices"):
    mesh_lib.split_over_granules({"pipeline": 1, "data": 2, "fsdp": 1, "tensor": 8}, 4)


def test_cpu_xla_flags_are_added_once_and_never_override_the_users(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
  distributed.set_cpu_xla_flags()
  distributed.set_cpu_xla_flags()
  assert os.environ["XLA_FLAGS"].split() == ["--xla_force_host_platform_device_count=2",
                                             *distributed.CPU_XLA_FLAGS]
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_experimental_ynn_fusion_type=individual_dot")
  distributed.set_cpu_xla_flags()
  assert os.environ["XLA_FLAGS"] == "--xla_cpu_experimental_ynn_fusion_type=individual_dot"


def test_cpu_xla_flags_only_under_a_jaxlib_that_knows_them(monkeypatch):
  """XLA aborts on a flag it does not know: a jaxlib outside CPU_XLA_FLAGS_JAXLIB (or none) starts without them."""
  import importlib.metadata  # pylint: disable=g-import-not-at-top
  assert distributed.cpu_xla_flags() == distributed.CPU_XLA_FLAGS  # this machine's jaxlib 0.10.x
  monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.11.0")
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
  distributed.set_cpu_xla_flags()
  assert distributed.cpu_xla_flags() == () and os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"


@pytest.mark.slow  # a Python process importing every entry point
def test_every_entry_point_starts_with_the_cpu_xla_flags():
  """cli.run (every `python -m t5x_like.*`) appends cpu_xla_flags() to XLA_FLAGS before anything starts the backend."""
  script = ("import atexit, os, sys\n"
            "atexit.register(lambda: print('XLA_FLAGS=' + os.environ.get('XLA_FLAGS', '')))\n"
            "from t5x_like import cli\n"
            "sys.argv = ['prog', '--help']\n"
            "cli.run(lambda argv: None)\n")
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  flags_line = [line for line in out.stdout.splitlines() if line.startswith("XLA_FLAGS=")][-1]
  assert flags_line.split("=", 1)[1].split() == ["--xla_force_host_platform_device_count=1",
                                                  *distributed.cpu_xla_flags()]
