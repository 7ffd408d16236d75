"""LoRA: the first step equals the base, only adapters train (in the model, like merged weights), checkpoints of
adapters plus the base's path and their merge, layout equivalence, exact resume after kill -9 through the CLI.
The tiny base, configs and helpers are tests/test_finetune.py's."""

import dataclasses
import functools
import os
import signal
import subprocess
import sys

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import conftest
from tests import forkserver
from tests import interrupt
from tests import test_parallelism as layouts
from tests.test_finetune import LORA, OPT, REPO, TINY, digest, model_params, random_params, run_config
from tests.test_finetune import base  # pylint: disable=unused-import  (a fixture this file's tests take)

from t5x_like import checkpoints as checkpoints_cli
from t5x_like import cli
from t5x_like.model import decoder as model_lib
from t5x_like.observe import metrics as metrics_lib
from t5x_like.parallel import global_batch
from t5x_like.parallel import partitioning
from t5x_like.training import checkpointing
from t5x_like.recipes import experiment as experiment_lib
from t5x_like.inference import text as text_lib
from t5x_like.posttrain import lora
from t5x_like.posttrain import quantize
from t5x_like.training import runtime as runtime_lib
from t5x_like.training import step as step_lib
from t5x_like.training import train_state
from t5x_like.training import trainer
from t5x_like.training.objectives import language_model


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
                                        "targets": lora.LORA_TARGETS, "marker_ids": [],  # text data: no markers
                                        "base_precision": "float32"}
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
    dropped = dataclasses.replace(exp.objective, dropout=0.5)
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
  fresh = experiment_lib.Experiment(dataclasses.replace(exp.config, checkpoint=checkpointing.CheckpointConfig()),
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
  # a plain config pointed at the LoRA run reads it with the settings its checkpoint records (runtime.py)
  _, unflagged = experiment_lib.Experiment(run_config(exp.config.model_dir, corpus), TINY, OPT).restore_params()
  for got, want in zip(jax.tree.leaves(unflagged), jax.tree.leaves(expected)):
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-7)


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


def lora_train(initial, base_params, mesh_shape: dict, devices=None, base_precision="float32"):
  """STEPS LoRA steps from `initial` adapters over `base_params` (stored in `base_precision`) on a layout:
  ([(loss, grad_norm)], adapters[, the stored base as placed])."""
  mesh, _, model, tx, lr_fn = layouts.make_layout(mesh_shape, devices=devices, base=LLAMA)
  rules = layouts.RULES
  stored = jax.tree.map(np.asarray, quantize.quantize_params(base_params, base_precision))  # on host
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), np.zeros((1, 1), np.int32)))["params"]
    base_shardings = partitioning.shardings_from_boxed(quantize.boxed_stored(boxed, base_precision), mesh, rules)
    objective = lora.objective(language_model.LanguageModel(model.apply), boxed, LORA)
    params_fn = functools.partial(lora.init_adapters, kernels=lora.target_kernels(boxed, LORA.targets), config=LORA)
    _, shardings = train_state.state_shardings(model, tx, mesh, rules, params_fn=params_fn)
    state = jax.device_put(initial, shardings)
    frozen = {lora.BASE: jax.device_put(stored, base_shardings)}
    batch_sharding = partitioning.batch_sharding(mesh, rules)
    batch = {k: jax.device_put(v, batch_sharding) for k, v in layouts.synthetic_batch().items()}
    step = step_lib.jit_train_step(step_lib.make_train_step(objective, tx, lr_fn), shardings, batch_sharding,
                                   objective.features, {lora.BASE: base_shardings})
    history = []
    for _ in range(layouts.STEPS):
      state, metrics = step(state, batch, frozen)
      history.append((float(metrics["loss"]), float(metrics["grad_norm"])))
  if base_precision != "float32":
    return np.array(history), state, frozen[lora.BASE]
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


def test_adapters_run_in_the_model_only_under_the_wrapper(lora_initial):
  """lora.in_model adds dropout(x)·A·(sB) to each block projection that finds adapters beside its kernel
  (lora.attach), under the layer scan with or without remat: logits and the adapters' gradients equal those of
  the merged weights W + sA·B within float32 rounding; outside the wrapper the model ignores the adapters (the
  base's logits, exactly); LoRA dropout (the apply's 'dropout' rng) draws the same masks when remat recomputes."""
  state, base_params = lora_initial
  tokens = layouts.synthetic_batch()["inputs"][:4, :16]
  sums = lambda f: lambda a: jnp.sum(jnp.sin(f(a)) * jnp.arange(1.0, 1.0 + f(a).shape[-1]))
  close = lambda got, want: [np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * float(np.max(np.abs(w))))
                             for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want))]
  dropped_grads = []
  for remat in ("none", "full"):
    model = model_lib.GPT(dataclasses.replace(LLAMA, remat_policy=remat))

    def in_model(adapters, dropout=0.0, rng=None, model=model):
      with lora.in_model(dropout):
        return model.apply({"params": lora.attach(base_params, adapters, LORA.scale)}, tokens,
                           rngs=None if rng is None else {"dropout": rng})

    merged = lambda a, model=model: model.apply({"params": lora.merge(base_params, a, LORA.scale)}, tokens)
    dropped = lambda a, in_model=in_model: in_model(a, 0.5, jax.random.key(1))
    if remat == "none":  # forward values: remat does not change them
      outside = lambda a: model.apply({"params": lora.attach(base_params, a, LORA.scale)}, tokens)
      base = lambda: model.apply({"params": base_params}, tokens)
      got, want, ignored, drop, base_logits = jax.jit(
          lambda a: (in_model(a), merged(a), outside(a), dropped(a), base()))(state.params)
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
      assert np.max(np.abs(np.asarray(got) - np.asarray(base_logits))) > 1e-2  # the adapters act
      np.testing.assert_array_equal(np.asarray(ignored), np.asarray(base_logits))
      assert np.max(np.abs(np.asarray(drop) - np.asarray(got))) > 1e-2  # dropout acts
    grads = jax.jit(lambda a: (jax.grad(sums(in_model))(a), jax.grad(sums(merged))(a), jax.grad(sums(dropped))(a)))
    in_grad, merged_grad, dropped_grad = grads(state.params)
    close(in_grad, merged_grad)
    dropped_grads.append(dropped_grad)
  close(*dropped_grads)


@pytest.fixture(scope="module")
def lora_reference(lora_initial):
  return lora_train(*lora_initial, {"data": 1}, devices=jax.devices()[:1])


@pytest.mark.slow  # fast subset: the developer loop; CI runs it
def test_lora_layout_trains_like_one_device(lora_initial, lora_reference):
  """One layout splitting over pipeline, fsdp and tensor (the generic layouts are tests/test_parallelism.py's)."""
  mesh_shape = {"pipeline": 2, "fsdp": 2, "tensor": 2}
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
  assert spec(adapters["mlp_out"]["kernel"]["lora_b"])[0] == "pipeline"


@pytest.mark.slow  # two 3-step runs (≈ 15 s on 2 cores)
def test_qlora_layout_trains_like_one_device_with_the_codes_split_like_their_kernels(lora_initial):
  """An nf4 base (QLoRA) on pipeline × fsdp × tensor trains like one device over the same nf4 base; the codes are
  laid out by the rules as their kernels are (the MLP's hidden axis on 'tensor', the layers on 'pipeline')."""
  reference = lora_train(*lora_initial, {"data": 1}, devices=jax.devices()[:1], base_precision="nf4")
  history, state, stored = lora_train(*lora_initial, {"pipeline": 2, "fsdp": 2, "tensor": 2}, base_precision="nf4")
  layouts.assert_same_training((history, jax.tree.map(np.asarray, state.params)),
                               (reference[0], jax.tree.map(np.asarray, reference[1].params)))
  codes = stored["blocks"]["mlp_in"][quantize.CODES]
  assert codes.dtype == jnp.uint8 and tuple(codes.sharding.spec)[0] == "pipeline"
  assert "tensor" in tuple(codes.sharding.spec)


# ----------------------------------------------------------------------------------------------------
# End to end: a LoRA fine-tune through `python -m t5x_like.train` killed with -9 and relaunched redoes the steps
# after its last checkpoint bit for bit (the killed process had logged them); merge_lora through its CLI.

CLI_TINY = {"model.GPTConfig.num_layers": 1, "model.GPTConfig.d_model": 32, "model.GPTConfig.num_heads": 2,
            "model.GPTConfig.d_ff": 64, "model.GPTConfig.max_len": 32}
CLI_STEPS = 24  # the kill lands after step 6 or so, long before the run ends


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
  return forkserver.Popen(args, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


@pytest.mark.slow  # end to end: launches the CLI three times (train, train again, merge)
def test_lora_kill_9_then_resume_is_bit_identical_and_merges_through_the_cli(corpus, tmp_path, monkeypatch,
                                                                                 capsys):
  exp = experiment_lib.Experiment(run_config("unused", corpus), dataclasses.replace(
      TINY, **{k.split(".")[-1]: v for k, v in CLI_TINY.items()}), OPT)
  base_dir = str(tmp_path / "base")
  checkpointing.save_params(base_dir, model_params(exp, seed=5))
  killed = str(tmp_path / "killed")
  proc = _launch(killed, corpus, base_dir)

  def replayable() -> bool:  # a committed checkpoint and >= 2 steps logged after it: the relaunch redoes them
    logged = max(interrupt.losses(killed), default=0)
    if logged < 6 or not os.path.isdir(checkpointing.checkpoint_dir(killed)):  # 6: CHECKPOINT_EVERY=4, then 2 more
      return False
    steps = checkpointing.committed_steps(killed)
    return bool(steps) and logged >= steps[-1] + 2

  interrupt.signal_when(proc, replayable, signal.SIGKILL, what="a checkpoint with 2 steps logged after it",
                        log=killed + ".log")
  assert proc.wait(timeout=60) == -signal.SIGKILL, open(killed + ".log").read()[-2000:]
  before = interrupt.losses(killed)
  assert _launch(killed, corpus, base_dir).wait(timeout=300) == 0, open(killed + ".log").read()[-3000:]
  losses = interrupt.losses(killed)
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
  code = conftest.run_cli_in_process(monkeypatch, checkpoints_cli.run,
                                     ["checkpoints", "merge_lora", killed, f"--output_dir={tmp_path / 'merged'}"])
  assert code in (None, 0), capsys.readouterr().err[-2000:]
  assert f"into {tmp_path / 'merged'}/checkpoints/0" in capsys.readouterr().out
  merged_params = checkpointing.restore_params(str(tmp_path / "merged"))[1]
  expected = lora.merge(checkpointing.restore_params(base_dir)[1], saved, 4.0)  # finetune.gin's alpha 16 / rank 4
  for got, want in zip(jax.tree.leaves(merged_params), jax.tree.leaves(expected)):
    np.testing.assert_allclose(got, np.asarray(want), rtol=1e-6, atol=1e-7)
  # infer: the LoRA run (base + adapters) and its merged checkpoint continue a prompt with the same tokens
  cfg = dataclasses.replace(TINY, **{k.split(".")[-1]: v for k, v in CLI_TINY.items()}, dtype="bfloat16")
  # (no LoRA setting given: the runtime reads the LoRA run with the settings its checkpoint records)
  samples = [text_lib.sample(runtime_lib.Runtime(run_config(d, corpus), cfg), ["the trainer reads", "a shard"],
                             max_new_tokens=6) for d in (killed, str(tmp_path / "merged"))]
  assert samples[0] == (CLI_STEPS, samples[1][1]) and samples[1][0] == 0 and all(samples[0][1])
