"""Mixture of experts: expert-parallel layouts train like one device (with and without dropped tokens);
routing does what it says (a router forced to one expert is that expert's dense MLP, dropped tokens pass through
the residual, the auxiliary losses equal a NumPy reference); the dispatch is an all-to-all; KV-cache decoding;
metrics reach metrics.jsonl and Prometheus; parameter and FLOP counts of a Mixtral-8x7B shape; bad configs.

Equivalence tolerances are test_parallelism's (3 AdamW steps, float32). Routing decisions are discrete: a layout
that changed one top-k choice or capacity drop would change some expert's gradient, which AdamW turns into a
step of about lr = 1e-3 on its weights, far above the 2e-6 parameter tolerance.
"""

import dataclasses
import functools
import json
import os

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np
import prometheus_client
import pytest

from t5x_like import cli
from t5x_like.model import blocks
from t5x_like.model import config as config_lib
from t5x_like.model import decoder as model_lib
from t5x_like.model import moe
from t5x_like.observe import flops
from t5x_like.observe import metrics as metrics_lib
from t5x_like.observe import prometheus
from t5x_like.parallel import mesh as mesh_lib
from t5x_like.parallel import partitioning
from t5x_like.planning import planner
from t5x_like.training.objectives import language_model
from tests import test_parallelism
from tests.decode_reference import engine_tokens, generate_by_recompute

# 8 experts (so `expert` can be 8), top-2, capacity factor 1: 4 slots per expert for a 16-token sequence, so
# ~10% of the assignments are dropped at initialisation. Every layer MoE; moe_every = 2 is covered by the
# pipeline layout and the decoding test.
MOE = dataclasses.replace(test_parallelism.CFG, num_layers=2, num_heads=4, d_model=32, d_ff=64, num_experts=8,
                          moe_top_k=2, moe_capacity_factor=1.0)
DROPLESS = dataclasses.replace(MOE, moe_dropless=True)
GROUPED = dataclasses.replace(MOE, num_layers=4, moe_every=2)  # layers 1 and 3 MoE: 2 stacked (dense, MoE) pairs

# Each layout is one more ~15 s compile on 2 cores, so the file keeps three, one per routing behaviour: expert 2
# with fsdp and tensor (dropping), expert 4 with data (dropless), and expert 2 under pipeline × tensor with
# accumulation and remat (moe_every = 2). Every other expert × data/fsdp/tensor layout (expert 8 too) passed when
# written; the generic layout machinery is tests/test_parallelism.py's.
LAYOUTS = {
    "fsdp2_expert2_tensor2": dict(mesh_shape={"fsdp": 2, "expert": 2, "tensor": 2}),
    "data2_expert4": dict(mesh_shape={"data": 2, "expert": 4}),
}


@pytest.fixture(scope="module")
def initial_state():
  return test_parallelism.host_initial_state(MOE)


@pytest.fixture(scope="module")
def reference(initial_state):
  return test_parallelism.train(initial_state, {"data": 1}, devices=jax.devices()[:1], base=MOE)


@pytest.fixture(scope="module")
def dropless_reference(initial_state):
  return test_parallelism.train(initial_state, {"data": 1}, devices=jax.devices()[:1], base=DROPLESS)


@pytest.mark.slow  # a sharded step's compile: the full suite (CI) runs it
def test_expert_layout_trains_like_one_device(initial_state, reference):
  """Tokens dropped at capacity (the same ones on every layout), experts split over `expert`, with fsdp and
  tensor."""
  result = test_parallelism.train(initial_state, **LAYOUTS["fsdp2_expert2_tensor2"], base=MOE)
  test_parallelism.assert_same_training(result, reference)


@pytest.mark.slow
def test_dropless_expert_layout_trains_like_one_device(initial_state, dropless_reference):
  result = test_parallelism.train(initial_state, **LAYOUTS["data2_expert4"], base=DROPLESS)
  test_parallelism.assert_same_training(result, dropless_reference)


@pytest.mark.slow
def test_pipelined_moe_groups_with_accumulation_train_like_one_device():
  """moe_every = 2 (stacked (dense, MoE) pairs) over pipeline × expert × tensor, with gradient accumulation and
  remat: the routing statistics travel through the stages with their microbatch."""
  initial = test_parallelism.host_initial_state(GROUPED)
  ref = test_parallelism.train(initial, {"data": 1}, devices=jax.devices()[:1], base=GROUPED)
  result = test_parallelism.train(initial, {"pipeline": 2, "expert": 2, "tensor": 2}, base=GROUPED,
                                  num_microbatches=2, remat="full")
  test_parallelism.assert_same_training(result, ref)


# ----------------------------------------------------------------------------------------------------------
# Expert parallelism compiles to all-to-all.


def _moe_layer_hlo(mesh_shape: dict) -> str:
  """Compiled HLO of one MoE MLP's forward and backward on 8 devices under the default rules."""
  mesh = mesh_lib.create_mesh(mesh_shape)
  layer = moe.MoeMlp(MOE)
  x = jnp.zeros((16, 16, MOE.d_model), jnp.float32)
  valid = jnp.ones((16, 16), jnp.bool_)
  with jax.set_mesh(mesh), nn.logical_axis_rules(partitioning.DEFAULT_RULES):
    params = partitioning.unbox(jax.eval_shape(lambda: layer.init(jax.random.key(0), x, valid)["params"]))
    loss = lambda p, h: jnp.sum(layer.apply({"params": p}, h, valid)[0] ** 2)
    batch = jax.sharding.NamedSharding(mesh, partitioning.logical_to_mesh_spec(
        jax.sharding.PartitionSpec("batch", None, None)))
    return jax.jit(jax.grad(loss), in_shardings=(None, batch)).lower(params, x).compile().as_text()


def test_expert_axis_dispatches_with_all_to_all():
  with_experts = _moe_layer_hlo({"expert": 8})
  assert with_experts.count(" all-to-all(") >= 2  # dispatch and combine (and their transposes in the backward)
  assert " all-to-all(" not in _moe_layer_hlo({"data": 8})  # experts replicated: nothing to exchange


# ----------------------------------------------------------------------------------------------------------
# Routing.


def _block_params(cfg, moe_layer: bool, seed: int = 0):
  block = blocks.Block(cfg, moe=moe_layer)
  init = jax.jit(lambda: block.init(jax.random.key(seed), jnp.zeros((1, 1, cfg.d_model)),
                                    jnp.ones((1, 1, 1, 1), jnp.bool_), jnp.zeros((1, 1), jnp.int32)))()
  return partitioning.unbox(init["params"])


def _block_inputs(cfg, rows: int = 2, length: int = 16):
  """(x, mask, positions): feature 0 of x is 10 for every token, so the normalised input's feature 0 is > 0."""
  x = jax.random.normal(jax.random.key(7), (rows, length, cfg.d_model), jnp.float32).at[..., 0].add(10.0)
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((length, length), jnp.bool_)), (rows, 1, length, length))
  return x, mask, jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (rows, length))


@functools.partial(jax.jit, static_argnames=("cfg", "moe_layer"))
def _apply_block(params, x, mask, positions, *, cfg, moe_layer):
  out, _, stats = blocks.Block(cfg, moe=moe_layer).apply({"params": params}, x, mask, positions)
  return out, stats


def _dense_twin(cfg, moe_params, expert: int):
  """A dense Block's parameters: the MoE block's attention and norms, and expert `expert`'s MLP."""
  params = {k: v for k, v in moe_params.items() if k != "moe"}
  for name in ("mlp_in", "mlp_gate", "mlp_out"):
    if name in moe_params["moe"]:
      params[name] = jax.tree.map(lambda w: w[expert], moe_params["moe"][name])
  return params


@pytest.mark.parametrize("top_k, kind", [(1, dict(mlp_activation="gelu", use_bias=True)),
                                         (2, dict(mlp_activation="swiglu", use_bias=False, norm="rmsnorm"))])
def test_router_forced_to_one_expert_equals_that_experts_dense_mlp(top_k, kind):
  cfg = dataclasses.replace(MOE, moe_top_k=top_k, moe_dropless=True, **kind)
  dense_cfg = dataclasses.replace(cfg, num_experts=0, d_ff=cfg.expert_d_ff)
  params = _block_params(cfg, True)
  # experts 5× their initial scale (an MLP output as large as the residual's) and non-zero, distinct biases
  params["moe"] = jax.tree.map(lambda w: 5 * w + 0.1 * np.arange(w.size).reshape(w.shape) / w.size, params["moe"])
  expert = 5
  router = np.zeros((cfg.d_model, cfg.num_experts), np.float32)
  router[0, expert] = 1000.0  # logit_5 = 1000 × (normalised feature 0 > 0): probability 1.0 in float32
  params["moe"]["router"]["kernel"] = jnp.asarray(router)
  x, mask, positions = _block_inputs(cfg)
  out, (token, load) = _apply_block(params, x, mask, positions, cfg=cfg, moe_layer=True)
  want, _ = _apply_block(_dense_twin(cfg, params, expert), x, mask, positions, cfg=dense_cfg, moe_layer=False)
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
  other, _ = _apply_block(_dense_twin(cfg, params, expert - 1), x, mask, positions, cfg=dense_cfg, moe_layer=False)
  assert np.abs(np.asarray(out) - np.asarray(other)).max() > 0.1  # the choice of expert shows
  assert float(load[expert]) == x.shape[0] * x.shape[1]  # every token's first choice
  assert float(np.asarray(token)[..., moe.TOKEN_STATS.index("dropped_fraction")].max()) == 0.0


def test_dropped_tokens_pass_through_the_residual_unchanged():
  """Top-1 with one slot per expert and sequence: all but ≤ 8 tokens of each row are dropped; their block output
  is exactly x + attention (a dense twin whose MLP outputs zero), the kept tokens' is not."""
  cfg = dataclasses.replace(MOE, moe_top_k=1, moe_capacity_factor=0.5)  # ceil(1 × 16 × 0.5 / 8) = 1 slot
  assert moe.capacity(cfg, 16) == 1
  params = _block_params(cfg, True, seed=3)
  x, mask, positions = _block_inputs(cfg)
  out, (token, load) = _apply_block(params, x, mask, positions, cfg=cfg, moe_layer=True)
  no_mlp = _dense_twin(cfg, params, 0)
  no_mlp["mlp_out"] = jax.tree.map(jnp.zeros_like, no_mlp["mlp_out"])
  residual, _ = _apply_block(no_mlp, x, mask, positions, cfg=dataclasses.replace(cfg, num_experts=0,
                                                                                  d_ff=cfg.expert_d_ff),
                             moe_layer=False)
  dropped = np.asarray(token)[..., moe.TOKEN_STATS.index("dropped_fraction")] == 1.0  # (B, T)
  kept_per_row = (~dropped).sum(axis=1)
  used_experts = [len(set(np.asarray(load).nonzero()[0]))]
  assert (kept_per_row >= 1).all() and (kept_per_row <= cfg.num_experts).all() and used_experts[0] > 1
  np.testing.assert_array_equal(np.asarray(out)[dropped], np.asarray(residual)[dropped])
  assert (np.abs(np.asarray(out)[~dropped] - np.asarray(residual)[~dropped]).max(axis=-1) > 1e-3).all()


def numpy_route(logits, valid, top_k, capacity):
  """The GShard routing of moe.route, written with loops: choices queue by rank, then position."""
  g, s, e = logits.shape
  z = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  probs = np.exp(logits - z[..., None])
  dispatch, combine = np.zeros((g, s, e, capacity)), np.zeros((g, s, e, capacity))
  stats, load = np.zeros((g, s, 3)), np.zeros(e)
  for gi in range(g):
    top = np.argsort(-probs[gi], axis=-1, kind="stable")[:, :top_k]  # (S, K), ties to the lower index
    gates = np.take_along_axis(probs[gi], top, -1)
    gates = gates if top_k == 1 else gates / gates.sum(-1, keepdims=True)
    fill, counts = np.zeros(e, int), np.zeros(e)
    for rank in range(top_k):
      for si in range(s):
        if not valid[gi, si]:
          continue
        ex = top[si, rank]
        counts[ex] += 1
        if fill[ex] < capacity:
          dispatch[gi, si, ex, fill[ex]] = 1.0
          combine[gi, si, ex, fill[ex]] = gates[si, rank]
          fill[ex] += 1
        else:
          stats[gi, si, 2] += 1.0 / top_k
    share = counts / (top_k * max(valid[gi].sum(), 1))
    stats[gi, :, 0] = e * (probs[gi] * share).sum(-1) * valid[gi]
    stats[gi, :, 1] = z[gi] ** 2 * valid[gi]
    load += counts
  return dispatch, combine, stats, load


@pytest.mark.parametrize("top_k, capacity", [(1, 2), (2, 3), (2, 12)])
def test_routing_and_auxiliary_losses_equal_a_numpy_reference(top_k, capacity):
  rng = np.random.RandomState(top_k * 10 + capacity)
  logits = rng.normal(0, 2.0, (3, 12, 4)).astype(np.float32)
  valid = rng.rand(3, 12) > 0.2
  valid[2] = False  # a group of padding only
  got = jax.jit(moe.route, static_argnums=(2, 3))(logits, valid, top_k, capacity)
  want = numpy_route(logits.astype(np.float64), valid, top_k, capacity)
  for name, a, b in zip(("dispatch", "combine", "stats", "load"), got, want):
    np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-6, err_msg=name)
  assert want[2][..., 2].sum() > 0 if capacity < 12 else want[2][..., 2].sum() == 0  # drops iff capacity binds


def test_objective_adds_the_weighted_auxiliary_losses_and_reports_them(initial_state):
  """loss = cross-entropy + lb_weight · load-balancing + z_weight · z-loss, each a token-weighted mean over
  tokens and MoE layers; equal to moe_sums of the sown statistics, whose terms equal a NumPy reference."""
  cfg = dataclasses.replace(MOE, moe_load_balancing_weight=0.1, moe_router_z_weight=0.01)
  batch = test_parallelism.synthetic_batch()
  params = initial_state.params  # MOE's, initialised once for the layout tests
  objective = language_model.LanguageModel(model_lib.GPT(cfg).apply)
  loss_sum, weight_sum, m = jax.jit(objective.loss)(params, batch)
  lb, z = float(m["moe/load_balancing_loss"]), float(m["moe/router_z_loss"])
  np.testing.assert_allclose(float(loss_sum), float(m["cross_entropy"]) + 0.1 * lb + 0.01 * z, rtol=1e-6)
  w = float(weight_sum)
  assert 1.0 <= lb / w < 1.5 and 0 < z / w and 0.01 < float(m["moe/dropped_fraction"]) / w < 0.5
  assert float(m["moe/expert_load_min"]) / w < 1.0 < float(m["moe/expert_load_max"]) / w
  # moe_sums on synthetic statistics against NumPy
  rng = np.random.RandomState(0)
  stats = moe.MoeStats(token=rng.rand(4, 6, 4).astype(np.float32), load=rng.randint(0, 9, (3, 8)).astype(np.float32))
  weights = (rng.rand(4, 6) > 0.3).astype(np.float32)
  aux, metrics = language_model.moe_sums(stats, jnp.asarray(weights), jnp.float32(weights.sum()))
  per_token = (stats.token * weights[..., None]).sum((0, 1)) / 3
  np.testing.assert_allclose(float(aux), per_token[0], rtol=1e-6)
  np.testing.assert_allclose([float(metrics[f"moe/{n}"]) for n in moe.TOKEN_STATS[1:]], per_token[1:], rtol=1e-6)
  share = stats.load / stats.load.sum(-1, keepdims=True) * 8
  np.testing.assert_allclose(float(metrics["moe/expert_load_max"]), share.max() * weights.sum(), rtol=1e-6)
  np.testing.assert_allclose(float(metrics["moe/expert_load_min"]), share.min() * weights.sum(), rtol=1e-6)


def test_moe_metrics_reach_metrics_jsonl_and_prometheus(tmp_path):
  """The objective's metrics are averaged over the log interval (token-weighted, like the loss) and written."""
  base = dict(grad_norm=1.0, param_norm=2.0, lr=1e-3, nonfinite=0)
  records = [dict(base, loss=3.0, tokens=100.0, **{"moe/dropped_fraction": 0.1, "moe/expert_load_max": 1.5}),
             dict(base, loss=2.0, tokens=300.0, **{"moe/dropped_fraction": 0.3, "moe/expert_load_max": 2.5})]
  scalars = metrics_lib.mean_step_metrics(records)
  assert scalars["moe/dropped_fraction"] == pytest.approx((0.1 * 100 + 0.3 * 300) / 400, rel=1e-12)
  assert scalars["moe/expert_load_max"] == pytest.approx((1.5 * 100 + 2.5 * 300) / 400, rel=1e-12)
  logger = metrics_lib.MetricsLogger(str(tmp_path), is_primary=True)
  logger.write(10, scalars)
  logger.close()
  with open(os.path.join(tmp_path, "metrics.jsonl")) as f:
    assert json.loads(f.readline())["moe/dropped_fraction"] == scalars["moe/dropped_fraction"]
  exporter = prometheus.PrometheusExporter(0)
  try:
    exporter.update(scalars, step=10)
    text = prometheus_client.generate_latest(exporter.registry).decode()
  finally:
    exporter.close()
  assert f"t5x_like_moe_dropped_ratio {scalars['moe/dropped_fraction']}" in text
  assert "t5x_like_moe_expert_load_max_ratio 2.25" in text


# ----------------------------------------------------------------------------------------------------------
# Decoding, configs, planner, bad input.


@pytest.mark.slow  # fast subset: the developer loop; CI runs it
def test_kv_cache_decoding_of_moe_groups_equals_recompute():
  """moe_every = 2 (a (dense, MoE) pair per stacked element, the cache split per layer): cached greedy decoding
  of the capacity-limited model gives the tokens of re-running the whole sequence without a capacity limit
  (decoding routes dropless: the 5-token prompt would otherwise have 2 slots per expert)."""
  init = jax.jit(lambda: model_lib.GPT(GROUPED).init(jax.random.key(1), jnp.zeros((1, 8), jnp.int32))["params"])
  params = partitioning.unbox(init())
  assert set(params["blocks"]) == {"layer_0", "layer_1"} and "moe" in params["blocks"]["layer_1"]
  params = jax.tree.map(lambda w: 10 * w, params)  # a sharper model: dropped tokens would change its predictions
  prompts = np.random.RandomState(2).randint(1, GROUPED.vocab_size, (2, 5)).astype(np.int32)
  cached = engine_tokens(GROUPED, params, prompts, 2)
  recomputed = generate_by_recompute(params, prompts, config=dataclasses.replace(GROUPED, moe_dropless=True),
                                     max_new_tokens=2)
  np.testing.assert_array_equal(np.asarray(cached), np.asarray(recomputed))


def _gin_model(name: str) -> model_lib.GPTConfig:
  gin.clear_config()
  try:
    cli.parse_gin([f"configs/models/{name}.gin"], [])
    return cli.configured(model_lib.GPTConfig, "model")
  finally:
    gin.clear_config()


def test_mixtral_shape_has_the_published_parameter_counts_and_plans_with_experts():
  cfg = _gin_model("mixtral_8x7b")
  cfg.validate()
  v, d, l, f, e = cfg.vocab_size, cfg.d_model, cfg.num_layers, cfg.d_ff, cfg.num_experts
  attention = 2 * d * d + 2 * d * cfg.num_kv_heads * cfg.head_dim
  total = 2 * v * d + l * (attention + d * e + e * 3 * d * f + 2 * d) + d
  assert model_lib.count_params(cfg) == total == 46_702_792_704  # Mixtral 8x7B's published count
  assert flops.active_params(cfg) == total - l * 6 * 3 * d * f == 12_879_925_248  # "12.9B active"
  assert flops.matmul_params(cfg) == flops.active_params(cfg) - v * d
  target = planner.Target(hardware=planner.hardware_lib.get("h100"), num_devices=64, global_batch=256,
                          seq_len=4096, tokens=1e12)
  layout = planner.Layout(fsdp=8, expert=8, remat_policy="full")
  plain = planner.Layout(fsdp=64, remat_policy="full")
  assert planner.step_time(cfg, layout, target).expert > 0 == planner.step_time(cfg, plain, target).expert
  held = lambda lay: planner.memory_model.param_elements_per_device(cfg, lay)
  assert held(layout) < held(dataclasses.replace(layout, expert=1, fsdp=8))  # experts split over `expert`
  text, feasible, _ = planner.report(cfg, target, top=5, remat_policies=("full",))
  assert "12.880 B active" in text and any(c.layout.expert > 1 for c in feasible)


def test_moe_tiny_matches_gpt_tiny_active_size():
  moe_tiny, gpt_tiny = _gin_model("moe_tiny"), _gin_model("gpt_tiny")
  moe_tiny, gpt_tiny = (dataclasses.replace(c, vocab_size=4096) for c in (moe_tiny, gpt_tiny))
  routers = moe_tiny.num_layers * moe_tiny.d_model * moe_tiny.num_experts
  second_output_bias = moe_tiny.num_layers * moe_tiny.d_model  # each of the 2 experts adds its own mlp_out bias
  assert flops.active_params(moe_tiny) == model_lib.count_params(gpt_tiny) + routers + second_output_bias
  assert model_lib.count_params(moe_tiny) > 2 * model_lib.count_params(gpt_tiny)


@pytest.mark.parametrize("change, message", [
    (dict(moe_top_k=9), r"^GPTConfig.moe_top_k=9 must be in \[1, num_experts=8\]$"),
    (dict(moe_capacity_factor=0.0), r"^GPTConfig.moe_capacity_factor=0.0 must be > 0"),
    (dict(moe_capacity_factor=-1.0), r"^GPTConfig.moe_capacity_factor=-1.0 must be > 0"),
    (dict(moe_every=3), r"^GPTConfig.moe_every=3 must be ≥ 1 and divide num_layers=2$"),
    (dict(num_experts=-1), r"^GPTConfig.num_experts=-1 must be ≥ 0"),
])
def test_bad_moe_configs_name_the_key(change, message):
  with pytest.raises(ValueError, match=message) as error:
    dataclasses.replace(MOE, **change).validate()
  assert "\n" not in str(error.value)


def test_experts_not_divisible_by_the_expert_axis_is_refused_in_one_line():
  cfg = dataclasses.replace(MOE, num_experts=6)
  with pytest.raises(ValueError, match=r"^GPTConfig.num_experts=6 is not divisible by MESH_SHAPE\['expert'\]=4 "
                                       r"\(logical axis 'expert'") as error:
    config_lib.check_layout(cfg, {"expert": 4, "data": 2}, batch_size=32)
  assert "\n" not in str(error.value)
  with pytest.raises(ValueError, match=r"BATCH_SIZE=12 is not divisible by MESH_SHAPE\['data'\]×MESH_SHAPE\['fsdp'\]"
                                       r"×MESH_SHAPE\['expert'\]×NUM_MICROBATCHES = 8×1"):
    config_lib.check_layout(MOE, {"expert": 4, "data": 2}, batch_size=12)  # `expert` splits the batch too
