"""Fine-tuning: warm start from INITIAL_CHECKPOINT_PATH with shape checks, selective updates, LoRA (first step
equals the base, only adapters train, layout equivalence, merge, exact resume after kill -9)."""

import dataclasses
import functools
import json
import os
import signal
import subprocess
import sys
import time

from absl import logging as absl_logging
import flax
import flax.linen as nn
import jax
import numpy as np
import pytest

from tests import conftest
from tests import test_parallelism as layouts

from t5x_like import checkpoints as checkpoints_cli
from t5x_like import cli
from t5x_like.data import chat
from t5x_like.data import chat_synth
from t5x_like.data import preprocessing
from t5x_like.data import tokenizer as tokenizer_lib
from t5x_like.model import decoder as model_lib
from t5x_like.observe import metrics as metrics_lib
from t5x_like.parallel import global_batch
from t5x_like.parallel import partitioning
from t5x_like.training import checkpointing
from t5x_like.training import chat_eval
from t5x_like.training import config as config_lib
from t5x_like.training import experiment as experiment_lib
from t5x_like.training import lora
from t5x_like.training import optimizer as optimizer_lib
from t5x_like.training import step as step_lib
from t5x_like.training import train_state
from t5x_like.training import trainer
from t5x_like.training.objectives import language_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = model_lib.GPTConfig(num_layers=2, num_heads=2, d_model=32, d_ff=64, max_len=32, dtype="float32")
OPT = optimizer_lib.OptimizerConfig(learning_rate=1e-2, warmup_steps=0)
LORA = config_lib.LoraConfig(rank=4, alpha=8.0)


def run_config(model_dir, data_dir, *, base="", lora_config=config_lib.LoraConfig(), **overrides):
  fields = dict(
      model_dir=str(model_dir), data_dir=data_dir, train_steps=4, batch_size=8, seq_len=16, log_every=1,
      eval_every=0, checkpoint_every=2, mesh_shape={"data": -1}, lora=lora_config,
      data=config_lib.DataConfig(eval_batches=1, shuffle_buffer=64),
      checkpoint=config_lib.CheckpointConfig(async_save=False, warm_start_from=base, warm_start_required=True))
  return config_lib.TrainConfig(**{**fields, **overrides})


def random_params(abstract, seed: int):
  """Random host parameters shaped like `abstract` (a stand-in for a pre-trained base; nothing compiles):
  norm scales around 1, everything else around 0."""
  rng = np.random.RandomState(seed)
  return {k: random_params(v, seed + i + 1) if isinstance(v, dict) else
          ((k == "scale") + rng.normal(0.0, 0.05, v.shape)).astype(np.float32)
          for i, (k, v) in enumerate(sorted(abstract.items()))}


def model_params(exp, seed: int):
  return random_params(partitioning.unbox(exp.boxed_params), seed)


@pytest.fixture(scope="module")
def base(corpus, tmp_path_factory):
  """A base MODEL_DIR holding random TINY parameters at step 0 (a parameters-only checkpoint)."""
  exp = experiment_lib.Experiment(run_config("unused", corpus), TINY, OPT)
  params = model_params(exp, seed=1)
  base_dir = str(tmp_path_factory.mktemp("base"))
  checkpointing.save_params(base_dir, params)
  return base_dir, params


@pytest.fixture(scope="module")
def batch(corpus):
  exp = experiment_lib.Experiment(run_config("unused", corpus), TINY, OPT)
  return global_batch.tf_to_numpy(next(iter(exp.eval_dataset(repeat=False))))


def digest(params) -> str:
  return checkpointing.params_digest(params)


# ----------------------------------------------------------------------------------------------------
# Warm start from INITIAL_CHECKPOINT_PATH; shape checks; resume from the run's own checkpoint.


@pytest.mark.slow  # fast subset: the developer loop; CI runs it
def test_warm_start_gives_the_base_then_a_resumed_run_continues_from_its_own_checkpoint(corpus, base, tmp_path):
  base_dir, base_params = base
  exp = experiment_lib.Experiment(run_config(tmp_path / "ft", corpus, base=base_dir), TINY, OPT)
  manager = checkpointing.make_manager(str(tmp_path / "ft"), async_save=False)
  start, state, _, origin = trainer.initial_state(exp, manager, None)
  assert start == 0 and int(state.step) == 0
  assert digest(state.params) == digest(base_params)
  assert origin == {"initial_checkpoint": os.path.join(base_dir, "checkpoints", "0")}
  moved = state.replace(step=state.step + 3, params=jax.tree.map(lambda x: x + 1.0, state.params))
  checkpointing.save(manager, 3, moved, None, {"step": 3})
  manager.wait_until_finished()
  start, state, _, _ = trainer.initial_state(exp, manager, None)
  assert start == 3 and digest(state.params) == digest(moved.params) != digest(base_params)
  manager.close()
  # a frozen model (reference, teacher) from a checkpoints/<step> path, shape-checked the same way
  assert digest(exp.add_frozen("reference", os.path.join(base_dir, "checkpoints", "0"))) == digest(base_params)


def test_empty_initial_checkpoint_path_is_refused(corpus, tmp_path):
  exp = experiment_lib.Experiment(run_config(tmp_path / "ft", corpus), TINY, OPT)
  manager = checkpointing.make_manager(str(tmp_path / "ft"), async_save=False)
  with pytest.raises(ValueError, match="INITIAL_CHECKPOINT_PATH is empty"):
    trainer.initial_state(exp, manager, None)
  manager.close()


@pytest.mark.parametrize("base_change, run_change, message", [
    (dict(vocab_size=1024), {}, r"token_embedding: checkpoint \(1024, 32\) vs model config \(512, 32\) — "
                                r"GPTConfig.vocab_size"),
    (dict(d_ff=128), {}, r"blocks/mlp_in/bias: checkpoint \(2, 128\) vs model config \(2, 64\) — GPTConfig.d_ff"),
    ({}, dict(num_kv_heads=1, use_bias=False), r"blocks/attn/key_value/kernel: missing from the checkpoint"),
    (dict(num_experts=4), dict(num_experts=2), r"blocks/moe/mlp_in/bias: checkpoint \(2, 4, 64\) vs model config "
                                               r"\(2, 2, 64\) — GPTConfig.num_experts$"),
])
def test_base_of_another_shape_is_refused_naming_the_parameter(corpus, tmp_path, base_change, run_change, message):
  """The run's vocabulary (the dataset's 400 pieces, padded to 512) and shapes against a differing base;
  then a GQA run over an MHA base (the base has qkv, the run needs query / key_value), and a 2-expert run
  over a 4-expert base."""
  config, base_config = dataclasses.replace(TINY, **run_change), dataclasses.replace(TINY, **base_change)
  base_dir = str(tmp_path / "base")
  checkpointing.save_params(base_dir, model_params(
      experiment_lib.Experiment(run_config("unused", corpus), base_config, OPT), seed=0))
  for lora_config in (config_lib.LoraConfig(), LORA):  # a full fine-tune's warm start, and a LoRA base
    exp = experiment_lib.Experiment(run_config(tmp_path / "ft", corpus, base=base_dir, lora_config=lora_config),
                                    config, OPT)
    manager = checkpointing.make_manager(str(tmp_path / "ft"), async_save=False)
    with pytest.raises(ValueError, match=message) as raised:
      trainer.initial_state(exp, manager, None)
    assert "\n" not in str(raised.value) and os.path.join(base_dir, "checkpoints", "0") in str(raised.value)
    manager.close()


# ----------------------------------------------------------------------------------------------------
# Selective updates and LoRA on the experiment.


def test_attention_preset_trains_only_attention_and_reports_its_optimizer_bytes(corpus, tmp_path):
  exp = experiment_lib.Experiment(run_config(tmp_path, corpus, trainable="attention"), TINY, OPT)
  names = {lora.path_name(p) for p in exp.trainable_paths}
  assert names == {"blocks/attn/qkv/kernel", "blocks/attn/qkv/bias", "blocks/attn/out/kernel",
                   "blocks/attn/out/bias"}
  report = exp.startup_report()
  d, layers = TINY.d_model, TINY.num_layers
  attention = layers * (d * 3 * d + 3 * d + d * d + d)
  assert report["params/trainable"] == attention
  assert report["params/total"] == lora.count(exp.abstract_state.params)
  # AdamW's two moments of the trainable leaves (replicated over the data-parallel mesh), plus step counters
  assert 8 * attention <= report["memory/opt_state_bytes_per_device"] <= 8 * attention + 64
  fsdp = experiment_lib.Experiment(run_config(tmp_path, corpus, trainable="attention", mesh_shape={"fsdp": 8}),
                                   TINY, OPT).startup_report()
  kernels = layers * (d * 3 * d + d * d)  # split 8 ways on their embed axis; the biases are replicated
  assert 8 * (kernels // 8 + attention - kernels) <= fsdp["memory/opt_state_bytes_per_device"] <= (
      8 * (kernels // 8 + attention - kernels) + 64)
  mu_shapes = [x.shape for x in jax.tree.leaves(exp.abstract_state.opt_state) if x.ndim]
  assert sorted(mu_shapes) == sorted(2 * [(layers, d, 3, 2, d // 2), (layers, 3, 2, d // 2), (layers, 2, d // 2, d),
                                          (layers, d)])


def test_regex_matching_nothing_is_a_one_line_error(corpus, tmp_path):
  with pytest.raises(ValueError, match=r"LoraConfig.targets='blocks/attn/qkvz/kernel' matches no parameter"):
    experiment_lib.Experiment(run_config(tmp_path, corpus, lora_config=dataclasses.replace(
        LORA, targets="blocks/attn/qkvz/kernel")), TINY, OPT)
  with pytest.raises(ValueError, match=r"LoraConfig.targets matches 'blocks/attn/qkv/bias'.*not a weight matrix"):
    experiment_lib.Experiment(run_config(tmp_path, corpus, lora_config=dataclasses.replace(
        LORA, targets="blocks/attn/qkv/.*")), TINY, OPT)
  with pytest.raises(ValueError, match=r"TrainConfig.trainable='blocks/atn/.\*' matches no parameter"):
    experiment_lib.Experiment(run_config(tmp_path, corpus, trainable="blocks/atn/.*"), TINY, OPT)
  with pytest.raises(ValueError, match=r"LoraConfig.dropout=1.0 must be in \[0, 1\)"):
    config_lib.LoraConfig(rank=4, dropout=1.0)
  with pytest.raises(ValueError, match="LoraConfig.dropout=0.1 with 2 pipeline stages"):
    dataclasses.replace(TINY, lora_dropout=0.1, num_stages=2).validate()


@pytest.fixture(scope="module")
def lora_run(corpus, base, tmp_path_factory):
  """A LoRA experiment over the base, its initial adapters, and two train steps from them."""
  base_dir, _ = base
  model_dir = tmp_path_factory.mktemp("lora")
  exp = experiment_lib.Experiment(run_config(model_dir, corpus, base=base_dir, lora_config=LORA), TINY, OPT)
  manager = checkpointing.make_manager(str(model_dir), async_save=False)
  start, state, _, origin = trainer.initial_state(exp, manager, None)
  initial = jax.tree.map(np.asarray, state)
  step = exp.jit_train_step()
  history = []
  with exp.context():
    for _ in range(2):
      state, metrics = step(state, exp.global_batch(batch_of(exp, len(history))), exp.frozen)
      history.append(jax.tree.map(np.asarray, metrics))
  return {"exp": exp, "manager": manager, "start": start, "initial": initial, "state": state,
          "history": history, "origin": origin}


def batch_of(exp, index: int) -> dict:
  it = iter(exp.eval_dataset(repeat=True))
  for _ in range(index):
    next(it)
  return global_batch.tf_to_numpy(next(it))


def test_lora_first_step_is_the_base_model_exactly(lora_run, base):
  exp, initial = lora_run["exp"], lora_run["initial"]
  _, base_params = base
  assert lora_run["start"] == 0
  assert lora_run["origin"]["lora"] == {"base": os.path.join(base[0], "checkpoints", "0"), "rank": 4, "alpha": 8.0,
                                        "targets": config_lib.LORA_TARGETS}
  # B = 0: W + (α/r)·A·0 is W bit for bit, so the merged model's logits are the base's, exactly
  assert digest(lora.merge(base_params, initial.params, LORA.scale)) == digest(base_params)
  with exp.context():
    base_loss, base_weight, _ = jax.jit(exp.model_objective.loss)(base_params, exp.global_batch(batch_of(exp, 0)), {})
  # the LoRA train step's loss (the merge inside the wrapped objective) is the base model's, bit for bit
  assert float(lora_run["history"][0]["loss"]) == float(base_loss / base_weight)
  assert float(lora_run["history"][1]["loss"]) != float(lora_run["history"][0]["loss"])


@pytest.mark.slow  # fast subset: the developer loop; CI runs it
def test_lora_adapters_run_in_the_model_like_merged_weights_and_dropout_is_seeded_by_the_batch(lora_run, base):
  """After two steps (B ≠ 0): x·W + x·A·(sB) in the model equals the loss on W + sA·B within float32 rounding;
  with dropout 0.5 the loss moves, the same batch draws the same masks and another batch other masks."""
  exp, state = lora_run["exp"], lora_run["state"]
  with exp.context():
    batches = [exp.global_batch(batch_of(exp, i)) for i in (0, 1)]
    in_model = jax.jit(exp.objective.loss)(state.params, batches[0], exp.frozen)
    merged = jax.jit(exp.model_objective.loss)(lora.merge(base[1], state.params, LORA.scale), batches[0], {})
    np.testing.assert_allclose(float(in_model[0]), float(merged[0]), rtol=2e-6)
    assert float(in_model[0]) != float(exp.model_objective.loss(base[1], batches[0], {})[0])  # adapters act
    model = model_lib.GPT(dataclasses.replace(exp.model_config, lora_dropout=0.5))
    dropped = dataclasses.replace(exp.objective, dropout=0.5,
                                  inner=dataclasses.replace(exp.model_objective, apply_fn=model.apply))
    loss = jax.jit(dropped.loss)
    first, again = loss(state.params, batches[0], exp.frozen), loss(state.params, batches[0], exp.frozen)
    assert float(first[0]) == float(again[0]) and abs(float(first[0]) - float(in_model[0])) > 1e-4
    keys = [jax.random.key_data(lora.dropout_key(b)) for b in batches]
    assert not np.array_equal(np.asarray(keys[0]), np.asarray(keys[1]))
    # with B = 0 (the first step) dropout cannot move the base model's loss
    np.testing.assert_array_equal(np.asarray(loss(lora_run["initial"].params, batches[0], exp.frozen)[0]),
                                  np.asarray(exp.model_objective.loss(base[1], batches[0], {})[0]))


def test_lora_trains_only_the_adapters_and_never_moves_the_base(lora_run, base):
  exp, initial, state = lora_run["exp"], lora_run["initial"], lora_run["state"]
  flat = flax.traverse_util.flatten_dict(state.params)
  assert {lora.path_name(p[:-1]) for p in flat} == {"blocks/attn/qkv/kernel", "blocks/attn/out/kernel",
                                                    "blocks/mlp_in/kernel", "blocks/mlp_out/kernel"}
  d, f, layers, r = TINY.d_model, TINY.d_ff, TINY.num_layers, LORA.rank
  assert flat[("blocks", "attn", "qkv", "kernel", "lora_a")].shape == (layers, d, r)
  assert flat[("blocks", "attn", "qkv", "kernel", "lora_b")].shape == (layers, r, 3, 2, d // 2)
  assert flat[("blocks", "attn", "out", "kernel", "lora_a")].shape == (layers, 2, d // 2, r)
  assert flat[("blocks", "mlp_out", "kernel", "lora_b")].shape == (layers, r, d)
  adapter_shapes = sorted(x.shape for x in jax.tree.leaves(state.params))
  assert sorted(x.shape for x in jax.tree.leaves(state.opt_state) if x.ndim) == sorted(2 * adapter_shapes)
  assert lora.count(state.params) == layers * (d * r + r * 3 * d + d * r + r * d + d * r + r * f + f * r + r * d)
  b_before = initial.params["blocks"]["mlp_in"]["kernel"]["lora_b"]
  assert not np.any(b_before) and np.any(np.asarray(state.params["blocks"]["mlp_in"]["kernel"]["lora_b"]))
  assert digest(exp.frozen[lora.BASE]) == digest(base[1])  # the base never moved
  report = exp.startup_report()
  assert report["params/trainable"] == lora.count(state.params)
  assert report["params/total"] == lora.count(state.params) + lora.count(base[1])


@pytest.mark.slow  # fast subset: the developer loop; CI runs it
def test_lora_checkpoint_restores_base_plus_adapters_and_merges_to_a_plain_checkpoint(lora_run, corpus, base,
                                                                                       tmp_path):
  exp, state, manager = lora_run["exp"], lora_run["state"], lora_run["manager"]
  metadata = {"step": 2, **lora_run["origin"]}
  checkpointing.save(manager, 2, state, None, metadata)
  manager.wait_until_finished()
  expected = lora.merge(base[1], jax.tree.map(np.asarray, state.params), LORA.scale)
  assert digest(expected) != digest(base[1])
  # infer/evaluate in the LoRA run's config: base (from the checkpoint's metadata) + adapters, merged
  fresh = experiment_lib.Experiment(dataclasses.replace(exp.config, checkpoint=config_lib.CheckpointConfig()),
                                    TINY, OPT)
  step, merged = fresh.restore_params()
  assert step == 2 and fresh.lora_base == os.path.join(base[0], "checkpoints", "0")
  for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(merged), jax.tree.leaves(expected)):
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-7, err_msg=jax.tree_util.keystr(path))
  lora_eval = fresh.evaluate_checkpoint()
  # merge_lora → a plain checkpoint that a plain config evaluates to the same loss
  written = lora.merge_checkpoint(str(exp.config.model_dir), str(tmp_path / "merged"))
  assert written == os.path.join(tmp_path / "merged", "checkpoints", "0")
  plain = experiment_lib.Experiment(run_config(tmp_path / "merged", corpus), TINY, OPT)
  _, plain_params = plain.restore_params()
  for got, want in zip(jax.tree.leaves(plain_params), jax.tree.leaves(expected)):
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-7)
  with exp.context():  # the merged model's loss on the evaluation batch is the LoRA evaluation's
    loss, weight, _ = jax.jit(exp.model_objective.loss)(plain_params, exp.global_batch(batch_of(exp, 0)), {})
  assert float(loss / weight) == pytest.approx(lora_eval["eval/loss"], rel=1e-6)
  # a plain config pointed at the LoRA run says what to do instead of failing inside orbax
  with pytest.raises(ValueError, match="holds LoRA adapters.*LoraConfig.rank=4.*merge_lora"):
    experiment_lib.Experiment(run_config(exp.config.model_dir, corpus), TINY, OPT).restore_params()


def test_lora_trainable_fraction_on_gpt2_small_is_below_one_percent():
  cli.parse_gin(["configs/models/gpt2_small.gin", "configs/runs/finetune.gin"],
                ["MODEL_DIR='/tmp/x'", "DATA_DIR='/tmp/d'", "lora.LoraConfig.rank=8",
                 "model.GPTConfig.vocab_size=50304"])
  try:
    config, model_config = cli.train_config(), cli.configured(model_lib.GPTConfig, "model")
  finally:
    import gin  # pylint: disable=g-import-not-at-top
    gin.clear_config()
  boxed = jax.eval_shape(lambda: model_lib.GPT(model_config).init(jax.random.key(0), np.zeros((1, 1), np.int32)))
  total = lora.count(partitioning.unbox(boxed["params"]))
  kernels = lora.target_kernels(boxed["params"], config.lora.targets)
  adapters = jax.eval_shape(lambda: lora.init_adapters(jax.random.key(0), kernels, config.lora))
  trainable = lora.count(partitioning.unbox(adapters))
  assert total == 124_475_904 and trainable == 12 * 8 * (768 + 3 * 768 + 768 + 768 + 768 + 3072 + 3072 + 768)
  assert trainable / total < 0.01, trainable / total


# ----------------------------------------------------------------------------------------------------
# LoRA on mesh layouts: the same losses and adapters as one device (tests/test_parallelism.py's tolerances).
# A Llama-shaped base: grouped-query attention (query + key_value adapters), SwiGLU (mlp_gate), no biases.

LLAMA = dataclasses.replace(layouts.CFG, num_layers=2, num_heads=4, num_kv_heads=2, d_model=32, d_ff=64, norm="rmsnorm",
                            mlp_activation="swiglu", position_embedding="rope", use_bias=False, tie_embeddings=False)


def lora_train(initial, base_params, mesh_shape: dict, devices=None):
  """STEPS LoRA steps from `initial` adapters over `base_params` on a layout: ([(loss, grad_norm)], adapters)."""
  mesh, _, model, tx, lr_fn = layouts.make_layout(mesh_shape, devices=devices, base=LLAMA)
  rules = layouts.RULES
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), np.zeros((1, 1), np.int32)))["params"]
    base_shardings = partitioning.shardings_from_boxed(boxed, mesh, rules)
    objective = lora.objective(language_model.LanguageModel(model.apply), boxed, LORA)
    params_fn = functools.partial(lora.init_adapters, kernels=lora.target_kernels(boxed, LORA.targets), config=LORA)
    _, shardings = train_state.state_shardings(model, tx, mesh, rules, params_fn=params_fn)
    state = jax.device_put(initial, shardings)
    frozen = {lora.BASE: jax.device_put(base_params, base_shardings)}
    batch_sharding = partitioning.batch_sharding(mesh, rules)
    batch = {k: jax.device_put(v, batch_sharding) for k, v in layouts.synthetic_batch().items()}
    step = step_lib.jit_train_step(step_lib.make_train_step(objective, tx, lr_fn), shardings, batch_sharding,
                                   objective.features, {lora.BASE: base_shardings})
    history = []
    for _ in range(layouts.STEPS):
      state, metrics = step(state, batch, frozen)
      history.append((float(metrics["loss"]), float(metrics["grad_norm"])))
  return np.array(history), state


@pytest.fixture(scope="module")
def lora_initial():
  """(initial adapters TrainState, base parameters) on host, B of the adapters random too (so every
  adapter has a gradient from the first step)."""
  _, _, model, tx, _ = layouts.make_layout({"data": 1}, devices=jax.devices()[:1], base=LLAMA)
  boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), np.zeros((1, 1), np.int32)))["params"]
  adapters = random_params(partitioning.unbox(jax.eval_shape(
      lambda: lora.init_adapters(jax.random.key(0), lora.target_kernels(boxed, LORA.targets), LORA))), seed=7)
  state = train_state.TrainState(step=np.zeros((), np.int32), params=adapters,
                                 opt_state=jax.tree.map(np.asarray, tx.init(adapters)))
  return state, random_params(partitioning.unbox(boxed), seed=3)


@pytest.fixture(scope="module")
def lora_reference(lora_initial):
  return lora_train(*lora_initial, {"data": 1}, devices=jax.devices()[:1])


@pytest.mark.slow  # fast subset: the developer loop; CI runs it
@pytest.mark.parametrize("mesh_shape", [{"data": 2, "fsdp": 2, "tensor": 2}, {"pipeline": 2, "fsdp": 2, "tensor": 2}],
    ids=["data2_fsdp2_tensor2", "pipeline2_fsdp2_tensor2"])
def test_lora_layout_trains_like_one_device(mesh_shape, lora_initial, lora_reference):
  history, state = lora_train(*lora_initial, mesh_shape)
  ref_history, ref_state = lora_reference
  layouts.assert_same_training((history, jax.tree.map(np.asarray, state.params)),
                               (ref_history, jax.tree.map(np.asarray, ref_state.params)))
  adapters = state.params["blocks"]
  spec = lambda x: tuple(x.sharding.spec)
  # a tensor-parallel projection's adapter is split with it: heads / kv heads / mlp on 'tensor'
  assert "tensor" in spec(adapters["attn"]["query"]["kernel"]["lora_b"])
  assert "tensor" in spec(adapters["attn"]["key_value"]["kernel"]["lora_b"])
  assert "tensor" in spec(adapters["attn"]["out"]["kernel"]["lora_a"])
  assert "tensor" in spec(adapters["mlp_gate"]["kernel"]["lora_b"])
  assert "fsdp" in spec(adapters["mlp_in"]["kernel"]["lora_a"])  # the embed axis, as its kernel's
  if mesh_shape.get("pipeline", 1) > 1:
    assert spec(adapters["mlp_out"]["kernel"]["lora_b"])[0] == "pipeline"


# ----------------------------------------------------------------------------------------------------
# End to end: a LoRA fine-tune through `python -m t5x_like.train` killed with -9 and relaunched redoes the steps
# after its last checkpoint bit for bit (the killed process had logged them); merge_lora through its CLI.

CLI_TINY = {"model.GPTConfig.num_layers": 1, "model.GPTConfig.d_model": 32, "model.GPTConfig.num_heads": 2,
            "model.GPTConfig.d_ff": 64, "model.GPTConfig.max_len": 32}
CLI_STEPS = 16


def _launch(model_dir, data_dir, base_dir):
  args = [sys.executable, "-m", "t5x_like.train", "--gin_file=configs/models/gpt_tiny.gin",
          "--gin_file=configs/runs/finetune.gin", f"--gin.MODEL_DIR='{model_dir}'", f"--gin.DATA_DIR='{data_dir}'",
          f"--gin.INITIAL_CHECKPOINT_PATH='{base_dir}'", f"--gin.TRAIN_STEPS={CLI_STEPS}", "--gin.LOG_EVERY=1",
          "--gin.EVAL_EVERY=0", "--gin.CHECKPOINT_EVERY=4", "--gin.BATCH_SIZE=8", "--gin.SEQ_LEN=16",
          "--gin.MESH_SHAPE={'pipeline': 1, 'data': 1, 'fsdp': 1, 'tensor': 2}", "--gin.lora.LoraConfig.rank=4",
          "--gin.data.DataConfig.eval_batches=1", "--gin.data.DataConfig.shuffle_buffer=64",
          "--gin.optimizer.OptimizerConfig.learning_rate=1e-3"]
  args += [f"--gin.{k}={v}" for k, v in CLI_TINY.items()]
  env = dict(os.environ, XLA_FLAGS=conftest.xla_flags(2), JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
  log = open(f"{model_dir}.log", "ab")
  return subprocess.Popen(args, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def _losses(model_dir) -> dict:
  out = {}
  if not os.path.exists(os.path.join(model_dir, "metrics.jsonl")):
    return out
  for r in metrics_lib.read_metrics(str(model_dir)):
    if "loss" in r:
      out.setdefault(r["step"], []).append(r["loss"])
  return out


@pytest.mark.slow  # end to end: launches the CLI three times (train, train again, merge)
def test_lora_kill_9_then_resume_is_bit_identical_and_merges_through_the_cli(corpus, tmp_path, monkeypatch,
                                                                                 capsys):
  exp = experiment_lib.Experiment(run_config("unused", corpus), dataclasses.replace(
      TINY, **{k.split(".")[-1]: v for k, v in CLI_TINY.items()}), OPT)
  base_dir = str(tmp_path / "base")
  checkpointing.save_params(base_dir, model_params(exp, seed=5))
  killed = str(tmp_path / "killed")
  proc = _launch(killed, corpus, base_dir)
  deadline = time.time() + 240

  def replayable() -> bool:  # a committed checkpoint and >= 2 steps logged after it: the relaunch redoes them
    if not os.path.isdir(checkpointing.checkpoint_dir(killed)) or not checkpointing.committed_steps(killed):
      return False
    return max(_losses(killed), default=0) >= checkpointing.committed_steps(killed)[-1] + 2

  while not replayable() and proc.poll() is None:
    assert time.time() < deadline, "the run made no progress"
    time.sleep(0.01)
  proc.send_signal(signal.SIGKILL)
  assert proc.wait(timeout=60) == -signal.SIGKILL, open(killed + ".log").read()[-2000:]  # it finished first?
  before = _losses(killed)
  assert _launch(killed, corpus, base_dir).wait(timeout=300) == 0, open(killed + ".log").read()[-3000:]
  losses = _losses(killed)
  assert sorted(losses) == list(range(1, CLI_STEPS + 1))
  replayed = [step for step, values in losses.items() if len(values) == 2]
  assert len(replayed) >= 2 and max(replayed) == max(before), (replayed, sorted(before))
  for step in replayed:  # the resumed run redoes the killed run's last steps bit for bit
    assert losses[step][0] == losses[step][1], (step, losses[step])
  assert losses[CLI_STEPS][0] < losses[1][0]
  # the checkpoints hold the adapters only, plus the base's path
  meta = checkpointing.read_metadata(checkpointing.step_dir(killed)[1])
  assert meta["lora"]["base"] == os.path.join(base_dir, "checkpoints", "0")
  saved = checkpointing.restore_params(killed)[1]
  assert all(p[-1].key in (lora.A, lora.B) for p, _ in jax.tree_util.tree_flatten_with_path(saved)[0])
  # each launch reports what trains at its start step
  starts = [r for r in metrics_lib.read_metrics(killed) if "params/trainable" in r]
  assert [r["step"] for r in starts] == [0, min(replayed) - 1]
  assert starts[0]["params/trainable"] == lora.count(saved) and starts[0]["params/trainable_fraction"] < 0.1
  # the merge CLI, in this process (its flags parsed by absl as a launch would)
  monkeypatch.setattr(sys, "argv", ["checkpoints", "merge_lora", killed, f"--output_dir={tmp_path / 'merged'}"])
  verbosity = absl_logging.get_verbosity()
  try:
    with pytest.raises(SystemExit) as exit_info:
      checkpoints_cli.run()
  finally:
    absl_logging.set_verbosity(verbosity)  # run() quiets absl for the CLI
  assert exit_info.value.code in (None, 0), capsys.readouterr().err[-2000:]
  assert f"into {tmp_path / 'merged'}/checkpoints/0" in capsys.readouterr().out
  merged_params = checkpointing.restore_params(str(tmp_path / "merged"))[1]
  expected = lora.merge(checkpointing.restore_params(base_dir)[1], saved, 4.0)  # finetune.gin's alpha 16 / rank 4
  for got, want in zip(jax.tree.leaves(merged_params), jax.tree.leaves(expected)):
    np.testing.assert_allclose(got, np.asarray(want), rtol=1e-6, atol=1e-7)
  # infer: the LoRA run (base + adapters) and its merged checkpoint continue a prompt with the same tokens
  cfg = dataclasses.replace(TINY, **{k.split(".")[-1]: v for k, v in CLI_TINY.items()}, dtype="bfloat16")
  samples = [experiment_lib.Experiment(run_config(d, corpus, lora_config=c), cfg, OPT).sample(
      ["the trainer reads", "a shard"], max_new_tokens=6) for d, c in ((killed, config_lib.LoraConfig(rank=4)),
                                                                       (str(tmp_path / "merged"), config_lib.LoraConfig()))]
  assert samples[0] == (CLI_STEPS, samples[1][1]) and samples[1][0] == 0 and all(samples[0][1])


# ----------------------------------------------------------------------------------------------------
# A generated task the base cannot do and the fine-tuned model can.


@pytest.mark.slow  # 150 fine-tuning steps and two generations (≈ 25 s)
def test_fine_tuning_teaches_a_generated_chat_task_the_base_cannot_do(tmp_path):
  """Reverse two words, asked in a chat (t5x_like/data/chat_synth.py): the base answers none of 40 held-out
  conversations; fine-tuned from it (INITIAL_CHECKPOINT_PATH) on 600 others, loss on the answers only, it
  answers most exactly. (bench/finetune_task.py measures full / LoRA / attention-only from a pre-trained base.)"""
  texts = [" ".join(chat_synth.WORDS) + "\nreverse: value of\n"] * 20
  tok = tokenizer_lib.train_tokenizer(texts, str(tmp_path / "tok.model"), vocab_size=360, num_threads=1)
  train_file, test_file = chat_synth.write_synthetic_chat(str(tmp_path / "task"), "reverse", 600, 40,
                                                         min_words=2, max_words=2)
  data_dir = str(tmp_path / "data")
  preprocessing.preprocess([train_file], data_dir, tokenizer=tok.path, data_format="chat", num_train_shards=1,
                           validation_fraction=0.0, progress=False, cache_dir=None)
  config = model_lib.GPTConfig(num_layers=2, num_heads=2, d_model=32, d_ff=64, max_len=32, dtype="float32",
                               tie_embeddings=False, position_embedding="rope", norm="rmsnorm",
                               mlp_activation="swiglu", use_bias=False)
  steps, base_dir, model_dir = 150, str(tmp_path / "base"), str(tmp_path / "sft")
  run = config_lib.TrainConfig(
      model_dir=model_dir, data_dir=data_dir, train_steps=steps, batch_size=16, seq_len=32, log_every=50,
      eval_every=0, checkpoint_every=steps, mesh_shape={"data": -1},
      data=config_lib.DataConfig(eval_batches=0, shuffle_buffer=256),
      checkpoint=config_lib.CheckpointConfig(async_save=False, warm_start_from=base_dir, warm_start_required=True))
  opt = optimizer_lib.OptimizerConfig(learning_rate=1e-2, warmup_steps=10, decay="constant")
  exp = experiment_lib.Experiment(run, config, opt)
  checkpointing.save_params(base_dir, model_params(exp, seed=0))
  lines = chat_eval.read_chat_lines(test_file, require_reference=True)
  encoder = chat_eval.encoder_for(exp, chat.ChatTemplate())

  def exact_match(params) -> float:
    with exp.context():
      return chat_eval.evaluate(params, encoder, lines, objective=exp.model_objective, config=exp.model_config,
                                batch_size=40, max_new_tokens=6)["generate/exact_match"]

  assert exact_match(checkpointing.restore_params(base_dir)[1]) == 0.0
  trainer.train(run, config, opt)
  with exp.context():
    step, tuned = exp.restore_params(None)
  assert step == steps and exact_match(tuned) >= 0.5
