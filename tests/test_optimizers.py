"""Optimizers beyond AdamW and the WSD / rsqrt schedules: decay, state size, sharded steps equal to one device."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from t5x_like.model import decoder as model_lib
from t5x_like.parallel import mesh as mesh_lib
from t5x_like.parallel import partitioning
from t5x_like.planning import memory_model
from t5x_like.training import optimizer as opt
from t5x_like.training import step as step_lib
from t5x_like.training import train_state
from t5x_like.training.objectives import language_model

TINY = model_lib.GPTConfig(vocab_size=128, max_len=32, num_layers=2, num_heads=4, d_model=64, d_ff=128,
                           dtype="float32", norm="rmsnorm", mlp_activation="swiglu", position_embedding="rope",
                           use_bias=False, tie_embeddings=False, num_kv_heads=2)
GPT2_SMALL = model_lib.GPTConfig(vocab_size=50304, max_len=1024)


@pytest.fixture(scope="module")
def tiny_params():
  return nn.meta.unbox(model_lib.GPT(TINY).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])


def _flat(tree):
  return {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.mark.parametrize("name", opt.OPTIMIZERS)
def test_weight_decay_is_decoupled_masked_and_scaled_by_the_schedule(name, tiny_params):
  """With zero gradients the update is −lr·wd·p on kernels and nothing on norms, embeddings and biases."""
  config = opt.OptimizerConfig(name=name, learning_rate=0.01, warmup_steps=0, decay="constant", weight_decay=0.5,
                               clip_norm=0.0)
  tx = opt.make_optimizer(config, 10)
  zeros = jax.tree.map(jnp.zeros_like, tiny_params)
  updates, _ = jax.jit(tx.update)(zeros, tx.init(tiny_params), tiny_params)
  mask = _flat(opt.weight_decay_mask(tiny_params))
  for path, update in _flat(updates).items():
    param = _flat(tiny_params)[path]
    expected = -0.01 * 0.5 * param if mask[path] else jnp.zeros_like(param)
    np.testing.assert_allclose(update, expected, rtol=1e-5, atol=1e-9, err_msg=f"{name} {path}")


def test_sgd_momentum_by_hand(tiny_params):
  config = opt.OptimizerConfig(name="sgd", learning_rate=0.1, warmup_steps=0, decay="constant", weight_decay=0.0,
                               clip_norm=0.0, momentum=0.9)
  tx = opt.make_optimizer(config, 10)
  grads = jax.tree.map(jnp.ones_like, tiny_params)
  state = tx.init(tiny_params)
  first, state = tx.update(grads, state, tiny_params)
  second, _ = tx.update(grads, state, tiny_params)
  leaf = lambda t: t["token_embedding"]
  np.testing.assert_allclose(leaf(first), -0.1, rtol=1e-6)
  np.testing.assert_allclose(leaf(second), -0.1 * 1.9, rtol=1e-6)  # the trace: g + 0.9·g


def test_lion_moves_every_weight_by_the_learning_rate(tiny_params):
  config = opt.OptimizerConfig(name="lion", learning_rate=0.01, warmup_steps=0, decay="constant", weight_decay=0.0,
                               clip_norm=0.0)
  tx = opt.make_optimizer(config, 10)
  grads = jax.tree.map(lambda p: jax.random.normal(jax.random.key(1), p.shape), tiny_params)
  updates, _ = tx.update(grads, tx.init(tiny_params), tiny_params)
  for path, update in _flat(updates).items():
    np.testing.assert_allclose(np.abs(update), 0.01, rtol=1e-6, err_msg=path)


def test_muon_orthogonalises_block_kernels_and_adamw_takes_the_rest(tiny_params):
  specs = opt.muon_dimension_numbers(tiny_params)
  assert specs["blocks"]["mlp_in"]["kernel"] == optax.contrib.MuonDimensionNumbers((1,), (2,))
  assert specs["blocks"]["attn"]["out"]["kernel"] == optax.contrib.MuonDimensionNumbers((1, 2), (3,))
  assert specs["token_embedding"] is None and specs["lm_head"]["kernel"] is None
  config = opt.OptimizerConfig(name="muon", learning_rate=1.0, warmup_steps=0, decay="constant", weight_decay=0.0,
                               clip_norm=0.0)
  tx = opt.make_optimizer(config, 10)
  grads = jax.tree.map(lambda p: jax.random.normal(jax.random.key(2), p.shape), tiny_params)
  updates, _ = tx.update(grads, tx.init(tiny_params), tiny_params)
  mlp_in = np.asarray(updates["blocks"]["mlp_in"]["kernel"][0])  # layer 0: (d_model, d_ff)
  singular = np.linalg.svd(mlp_in, compute_uv=False)
  assert singular.max() / singular.min() < 2.0  # Newton–Schulz: all singular values near one scale
  raw = np.linalg.svd(np.asarray(grads["blocks"]["mlp_in"]["kernel"][0]), compute_uv=False)
  assert raw.max() / raw.min() > 3.0  # the gradient itself is far from orthogonal
  # AdamW's first step on the embedding: −lr·g/(|g|+eps) = −sign(g)
  np.testing.assert_allclose(np.abs(updates["token_embedding"]), 1.0, rtol=1e-4)


def test_adafactor_state_is_at_most_a_quarter_of_adamw_for_gpt2_small():
  """XLA's memory analysis of each optimizer's init on gpt2_small's abstract parameters (one device)."""
  boxed = jax.eval_shape(lambda: model_lib.GPT(GPT2_SMALL).init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))
  params = partitioning.unbox(boxed["params"])
  sizes = {}
  for name in ("adamw", "adafactor"):
    tx = opt.make_optimizer(opt.OptimizerConfig(name=name), 1000)
    compiled = jax.jit(tx.init).lower(params).compile()
    sizes[name] = compiled.memory_analysis().output_size_in_bytes
  assert sizes["adafactor"] <= sizes["adamw"] / 4, sizes
  # the planner counts the same state
  layout = memory_model.Layout(data=1)
  for name, size in sizes.items():
    counted = memory_model.optimizer_bytes_per_device(GPT2_SMALL, layout, opt.OptimizerConfig(name=name))
    assert abs(counted - size) <= 1024, (name, counted, size)  # XLA pads each buffer a little


def test_wsd_schedule_by_hand():
  config = opt.OptimizerConfig(learning_rate=1.0, warmup_steps=10, decay="wsd", decay_fraction=0.25,
                               min_lr_ratio=0.0)
  lr = opt.learning_rate_schedule(config, 100)
  np.testing.assert_allclose([lr(5), lr(10), lr(50), lr(75)], [0.5, 1.0, 1.0, 1.0], rtol=1e-6)
  np.testing.assert_allclose([lr(85), lr(100)], [1 - 10 / 25, 0.0], atol=1e-6)
  root = opt.learning_rate_schedule(dataclasses.replace(config, wsd_decay_shape="1-sqrt"), 100)
  np.testing.assert_allclose(root(81.25), 1 - 0.5, rtol=1e-6)  # a quarter of the way: 1 − sqrt(1/4)


def test_wsd_resumed_with_more_steps_keeps_its_rate_until_the_new_decay():
  config = opt.OptimizerConfig(learning_rate=1.0, warmup_steps=5, decay="wsd", decay_fraction=0.5)
  short, long = opt.learning_rate_schedule(config, 40), opt.learning_rate_schedule(config, 80)
  steps = np.arange(0, 20)
  np.testing.assert_array_equal([short(s) for s in steps], [long(s) for s in steps])  # warmup and constant
  assert float(short(30)) < 1.0 and float(long(30)) == 1.0 and float(long(60)) < 1.0


def test_rsqrt_schedule_is_t5x_inverse_square_root():
  lr = opt.learning_rate_schedule(opt.OptimizerConfig(learning_rate=0.01, warmup_steps=100, decay="rsqrt"), 10_000)
  np.testing.assert_allclose([lr(50), lr(100), lr(400), lr(10_000)], [0.005, 0.01, 0.005, 0.001], rtol=1e-5)


@pytest.mark.parametrize("key, value, message", [
    ("name", "adam", "OptimizerConfig.name='adam'"),
    ("decay", "step", "OptimizerConfig.decay='step'"),
    ("wsd_decay_shape", "cosine", "OptimizerConfig.wsd_decay_shape='cosine'"),
])
def test_bad_settings_are_one_line_errors_naming_the_key(key, value, message):
  with pytest.raises(ValueError, match=message.replace("(", r"\(")) as e:
    opt.OptimizerConfig(**{key: value})
  assert "\n" not in str(e.value)


def _two_steps(config: opt.OptimizerConfig, mesh_shape: dict):
  """Loss and parameters after two steps of the language-model objective on `mesh_shape`."""
  model = model_lib.GPT(TINY)
  objective = language_model.LanguageModel(apply_fn=model.apply,
                                           logits_fn=lambda p, h: model_lib.project_logits(p, h, TINY))
  tx, lr_fn = opt.make_optimizer(config, 10), opt.learning_rate_schedule(config, 10)
  mesh = mesh_lib.create_mesh(mesh_shape, jax.devices()[:int(np.prod(list(mesh_shape.values())))])
  rules = partitioning.DEFAULT_RULES
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, TINY.vocab_size, (8, 17)).astype(np.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": np.ones((8, 16), np.float32),
           "segment_ids": np.ones((8, 16), np.int32),
           "positions": np.tile(np.arange(16, dtype=np.int32), (8, 1))}
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    state, shardings = train_state.init_state(model, tx, jax.random.key(0), mesh, rules)
    batch_sharding = partitioning.batch_sharding(mesh, rules)
    step = step_lib.jit_train_step(step_lib.make_train_step(objective, tx, lr_fn), shardings, batch_sharding,
                                   objective.features)
    batch = {k: jax.device_put(batch[k], batch_sharding) for k in objective.features}
    losses = []
    for _ in range(2):
      state, metrics = step(state, batch, {})
      losses.append(float(metrics["loss"]))
  return losses, jax.device_get(state.params)


@pytest.mark.parametrize("name", ["adafactor", "lion", "muon", "sgd"])
def test_sharded_layout_equals_one_device(name):
  config = opt.OptimizerConfig(name=name, learning_rate=3e-3, warmup_steps=0)
  one_losses, one_params = _two_steps(config, {"data": 1})
  many_losses, many_params = _two_steps(config, {"data": 2, "fsdp": 2, "tensor": 2})
  np.testing.assert_allclose(many_losses, one_losses, rtol=2e-5)
  assert one_losses[1] < one_losses[0]  # the step trained
  for path, value in _flat(one_params).items():
    np.testing.assert_allclose(_flat(many_params)[path], value, rtol=2e-4, atol=2e-5, err_msg=f"{name} {path}")
