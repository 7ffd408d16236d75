"""Preference data and DPO: pair records (never split across rows), DPO / IPO / SimPO losses against NumPy,
a generated preference task learnt (held-out pairwise accuracy from ≈50% to ≥90%), the DPO step on mesh
layouts equal to one device, and bad input named by file:line or parameter."""

import dataclasses
import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow as tf

from tests import conftest
from tests import test_parallelism as layouts

from t5x_like.data import input_pipeline
from t5x_like.data import packing
from t5x_like.data import preference as preference_data
from t5x_like.data import preference_synth
from t5x_like.data import preprocessing
from t5x_like.data import tokenizer as tokenizer_lib
from t5x_like.model import decoder as model_lib
from t5x_like.parallel import partitioning
from t5x_like.training import checkpointing
from t5x_like.training import config as config_lib
from t5x_like.recipes import dpo as dpo_recipe
from t5x_like import data as data_lib
from t5x_like.recipes import experiment as experiment_lib
from t5x_like.training import optimizer as optimizer_lib
from t5x_like.training import step as step_lib
from t5x_like.training import train_state
from t5x_like.training import trainer
from t5x_like.posttrain import preference

pytestmark = pytest.mark.run_bound  # tests/conftest.py: 11 s longer at level 0 with the cache warm

TINY = model_lib.GPTConfig(num_layers=2, num_heads=4, d_model=64, d_ff=256, max_len=64, dtype="float32")
SEQ = 64
# Words of the shared corpus (tests/conftest.py's grammar) that its tokenizer encodes alike: one piece after a
# space, three at the start of a turn. A wrong word then costs a random model no more tokens than a right one, so
# the base model prefers neither answer. 7 prompt words (4 per prompt: 840 prompts), 3 distractors.
WORDS = ("trainer", "shard", "shards", "restores", "streams", "tokens", "parameters", "batches", "gradients",
         "layers")


@pytest.fixture(scope="module")
def prefs(corpus, tmp_path_factory):
  """A preference DATA_DIR of the generated reversal task over the corpus's tokenizer, and its report; made once per
  test run (conftest.built_once: test_reward and test_rl_resume read it too)."""

  def build(root):
    path = preference_synth.write_synthetic_preferences(str(root / "raw"), count=600, words=WORDS, distractors=3,
                                                        num_words=4)
    report = preprocessing.preprocess([path], str(root / "ds"), data_format="preference", tokenizer=corpus,
                                      pack_length=SEQ + 1, validation_fraction=0.25, num_train_shards=2)
    return str(root / "ds"), report

  return tuple(conftest.built_once(tmp_path_factory, "prefs", build))


# ----------------------------------------------------------------------------------------------------
# Records: pairs rendered with the chat template, whole pairs per row, the pipeline reads them unchanged.


def test_pairs_are_rendered_like_chat_sft_and_never_split_across_rows(prefs, corpus):
  data_dir, report = prefs
  assert report["documents_out"] == 600 and report["dropped"] == {}
  manifest = input_pipeline.load_manifest(data_dir)
  assert manifest["format"] == "preference" and manifest["packed_length"] == SEQ + 1
  assert manifest["max_pairs_per_row"] == report["max_pairs_per_row"] >= 1
  ds = input_pipeline.make_dataset(data_dir, "validation", batch_size=8, seq_len=SEQ, shuffle=False, repeat=False,
                                   process_index=0, process_count=1)
  tok = tokenizer_lib.load(input_pipeline.resolve_path(data_dir, manifest["tokenizer"]))
  pairs = 0
  for batch in ds:
    batch = {k: v.numpy() for k, v in batch.items()}
    for row in range(batch["inputs"].shape[0]):
      seg = batch["segment_ids"][row]
      if not seg.any():
        continue
      assert seg.max() % 2 == 0  # chosen and rejected of every pair in the same row
      for s in range(1, seg.max() + 1, 2):
        sides = []
        for side in (s, s + 1):
          mask = seg == side
          learned = batch["targets"][row][mask & (batch["weights"][row] > 0)]
          sides.append(tok.decode([int(t) for t in learned]))
          assert batch["positions"][row][mask][0] == 0
        prompt = [tok.decode([int(t) for t in batch["inputs"][row][seg == side][:6]]) for side in (s, s + 1)]
        assert prompt[0] == prompt[1] and "reverse:" in prompt[0]
        chosen, rejected = sides  # the response content and the end marker (weight 1), not the prompt
        assert chosen != rejected and chosen.split()[:1] != [] and "reverse" not in chosen
        pairs += 1
  assert pairs == manifest["splits"]["validation"]["num_documents"]


def test_bad_lines_are_counted_and_named_by_file_and_line(corpus, tmp_path):
  good = {"prompt": "reverse: mesh host", "chosen": "host mesh", "rejected": "mesh host"}
  lines = [json.dumps(good), "{not json", json.dumps({**good, "rejected": "host mesh"}),
           json.dumps({"prompt": "x", "chosen": "y"}), json.dumps({**good, "chosen": " "}),
           json.dumps({"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
                       "chosen": [{"role": "assistant", "content": "host"}], "rejected": "mesh"})]
  path = tmp_path / "p.jsonl"
  path.write_text("\n".join(lines) + "\n")
  report = preprocessing.preprocess([str(path)], str(tmp_path / "ds"), data_format="preference", tokenizer=corpus,
                                    pack_length=SEQ + 1, validation_fraction=0.0, num_train_shards=1)
  assert report["documents_in"] == 6 and report["documents_out"] == 2
  assert report["dropped"] == {"malformed_bad_json": 1, "malformed_same_response": 1, "malformed_missing_key": 1,
                               "malformed_empty_content": 1}
  named = report["malformed_lines"]
  assert any(m.startswith(f"{path}:3: same_response") for m in named), named
  assert [m.split(": ")[0] for m in named] == [f"{path}:{i}" for i in (2, 3, 4, 5)]
  with pytest.raises(ValueError, match="needs --pack_length"):
    preprocessing.preprocess([str(path)], str(tmp_path / "x"), data_format="preference", tokenizer=corpus)


# ----------------------------------------------------------------------------------------------------
# The losses against a direct NumPy computation: a bigram "model" (logits = table[token]), pairs packed by
# the writer and turned into features by the pipeline's own row_features.

V, L_SMALL = 11, 24


def side(rng, prompt, response_len):
  response = rng.randint(2, V, response_len)
  ids = np.concatenate([prompt, response, [1]]).astype(np.int32)  # EOS = 1
  weights = np.concatenate([np.zeros(len(prompt)), np.ones(response_len), [0]]).astype(np.int32)
  return ids, weights


def tiny_pairs(seed=0):
  rng = np.random.RandomState(seed)
  out = []
  for _ in range(5):
    prompt = rng.randint(2, V, rng.randint(1, 4))
    out.append(preference_data.Pair(side(rng, prompt, rng.randint(1, 4)), side(rng, prompt, rng.randint(1, 4))))
  return out


def bigram(variables, tokens, *_):
  """A stand-in model: the logits after token t are row t of the table."""
  return jnp.asarray(variables["params"]["table"])[tokens]


def numpy_logps(table, ids, weights):
  logits = table[ids[:-1]].astype(np.float64)
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  return float(np.sum(logp[np.arange(len(ids) - 1), ids[1:]] * weights[1:])), float(weights[1:].sum())


def numpy_losses(loss_type, beta, gamma, policy, reference, pairs):
  out = {k: [] for k in ("loss", "rc", "rr", "pc", "pr")}
  for p in pairs:
    (pc, nc), (pr, nr) = numpy_logps(policy, *p.chosen), numpy_logps(policy, *p.rejected)
    (qc, _), (qr, _) = numpy_logps(reference, *p.chosen), numpy_logps(reference, *p.rejected)
    if loss_type == "simpo":
      rc, rr = beta * pc / nc, beta * pr / nr
      loss = np.log1p(np.exp(-(rc - rr - gamma)))
    else:
      rc, rr = beta * (pc - qc), beta * (pr - qr)
      h = (pc - qc) - (pr - qr)
      loss = np.log1p(np.exp(-beta * h)) if loss_type == "sigmoid" else (h - 1 / (2 * beta)) ** 2
    for k, v in zip(out, (loss, rc, rr, pc, pr)):
      out[k].append(v)
  return {k: np.array(v) for k, v in out.items()}


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "simpo"])
def test_losses_equal_a_direct_numpy_computation(loss_type):
  pairs = tiny_pairs()
  rows = preference_data.pack_pairs_np(pairs, L_SMALL + 1, pad_id=0)
  assert len(rows) >= 2 and rows[:, packing.SEGMENTS].max() >= 4  # several pairs per row, and padding
  batch = {k: v.numpy() for k, v in packing.row_features(tf.constant(rows)).items()}
  batch = {k: np.concatenate([v, np.zeros_like(v[:1])]) for k, v in batch.items()}  # + an all-padding row
  rng = np.random.RandomState(1)
  policy, reference = rng.normal(0, 1.5, (V, V)), rng.normal(0, 1.5, (V, V))
  beta, gamma = 0.7, 0.3
  objective = preference.Preference(bigram, loss_type=loss_type,
                                    beta=beta, gamma=gamma, max_pairs=int(rows[:, packing.SEGMENTS].max() // 2))
  loss_sum, weight_sum, metrics = jax.jit(objective.loss)(
      {"table": policy.astype(np.float32)}, batch, {preference.REFERENCE: {"table": reference.astype(np.float32)}})
  want = numpy_losses(loss_type, beta, gamma, policy, reference, pairs)
  assert float(weight_sum) == len(pairs)
  np.testing.assert_allclose(float(loss_sum), want["loss"].sum(), rtol=2e-6)
  np.testing.assert_allclose(float(metrics["rewards/chosen"]), want["rc"].sum(), rtol=2e-6, atol=1e-6)
  np.testing.assert_allclose(float(metrics["rewards/rejected"]), want["rr"].sum(), rtol=2e-6, atol=1e-6)
  np.testing.assert_allclose(float(metrics["rewards/margin"]), (want["rc"] - want["rr"]).sum(), rtol=2e-6, atol=1e-6)
  np.testing.assert_allclose(float(metrics["logps/chosen"]), want["pc"].sum(), rtol=2e-6)
  np.testing.assert_allclose(float(metrics["logps/rejected"]), want["pr"].sum(), rtol=2e-6)
  assert float(metrics["rewards/accuracy"]) == np.sum(want["rc"] > want["rr"])
  assert float(metrics["logps/accuracy"]) == np.sum(want["pc"] > want["pr"])
  # two gradient-accumulation microbatches give the same sums (pairs never straddle rows)
  fn = lambda p, micro: objective.loss(p, micro, {preference.REFERENCE: {"table": reference.astype(np.float32)}})
  one = step_lib.accumulated_grads(fn, {"table": policy.astype(np.float32)}, batch, 1)
  two = step_lib.accumulated_grads(fn, {"table": policy.astype(np.float32)}, batch, 2)
  np.testing.assert_allclose(float(two[1]), float(one[1]), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(two[0]["table"]), np.asarray(one[0]["table"]), rtol=1e-5, atol=1e-7)


def test_policy_equal_to_reference_scores_half_and_the_dpo_loss_is_log_2():
  pairs = tiny_pairs(seed=3)
  rows = preference_data.pack_pairs_np(pairs, L_SMALL + 1, pad_id=0)
  batch = {k: v.numpy() for k, v in packing.row_features(tf.constant(rows)).items()}
  table = {"table": np.random.RandomState(0).normal(size=(V, V)).astype(np.float32)}
  objective = preference.Preference(bigram, max_pairs=4)
  loss_sum, weight_sum, metrics = objective.loss(table, batch, {preference.REFERENCE: table})
  assert float(metrics["rewards/accuracy"]) == 0.5 * len(pairs) and float(metrics["rewards/margin"]) == 0.0
  np.testing.assert_allclose(float(loss_sum / weight_sum), np.log(2.0), rtol=1e-6)


# ----------------------------------------------------------------------------------------------------
# Bad input: the reference's shapes, a non-preference DATA_DIR, a missing reference.


def run_config(model_dir, data_dir, *, base="", reference="", loss_type="sigmoid", **overrides):
  fields = dict(
      model_dir=str(model_dir), data_dir=data_dir, train_steps=20, batch_size=16, seq_len=SEQ, log_every=1,
      eval_every=0, checkpoint_every=100, mesh_shape={"data": -1}, data=data_lib.DataConfig(shuffle_buffer=64),
      checkpoint=checkpointing.CheckpointConfig(async_save=False, warm_start_from=base, warm_start_required=True),
      recipe="dpo", recipe_config=dpo_recipe.DpoConfig(loss_type=loss_type, beta=0.1, reference_checkpoint=reference))
  return config_lib.TrainConfig(**{**fields, **overrides})


OPT = optimizer_lib.OptimizerConfig(learning_rate=1e-2, warmup_steps=5, weight_decay=0.0)


def host_params(model_config, seed):
  """Random parameters of `model_config` (vocabulary 0: the corpus's, padded to 512) on host; nothing compiles.
  Norm scales around 1, everything else around 0."""
  vocab = model_config.vocab_size or 512
  boxed = jax.eval_shape(lambda: model_lib.GPT(dataclasses.replace(model_config, vocab_size=vocab)).init(
      jax.random.key(0), np.zeros((1, 1), np.int32)))["params"]
  rng = np.random.RandomState(seed)
  return jax.tree_util.tree_map_with_path(
      lambda path, x: ((jax.tree_util.keystr(path).endswith("['scale']")) + rng.normal(0.0, 0.05, x.shape)).astype(
          np.float32), partitioning.unbox(boxed))


@pytest.mark.parametrize("change, message", [
    (dict(vocab_size=1024), r"token_embedding: checkpoint \(1024, 64\) vs model config \(512, 64\) — "
                            r"GPTConfig.vocab_size"),
    (dict(d_ff=128), r"blocks/mlp_in/bias: checkpoint \(2, 128\) vs model config \(2, 256\) — GPTConfig.d_ff"),
])
def test_reference_of_another_shape_is_a_one_line_error_naming_the_parameter(prefs, tmp_path, change, message):
  ref_dir = str(tmp_path / "ref")
  boxed = jax.eval_shape(lambda: model_lib.GPT(dataclasses.replace(TINY, **{"vocab_size": 512, **change})).init(
      jax.random.key(0), np.zeros((1, 1), np.int32)))["params"]
  checkpointing.save_params(ref_dir, jax.tree.map(lambda x: np.zeros(x.shape, np.float32), partitioning.unbox(boxed)))
  exp = experiment_lib.Experiment(run_config(tmp_path / "run", prefs[0], base="unused", reference=ref_dir), TINY, OPT)
  with pytest.raises(ValueError, match=message) as raised:
    exp.load_frozen_model(preference.REFERENCE)
  assert "\n" not in str(raised.value) and "reference model" in str(raised.value) and ref_dir in str(raised.value)


def test_preference_objective_refuses_other_data_and_a_missing_reference(prefs, corpus, tmp_path):
  with pytest.raises(ValueError, match=r"reads a preference DATA_DIR.*has format 'text'"):
    experiment_lib.Experiment(run_config(tmp_path / "r", corpus), TINY, OPT)
  exp = experiment_lib.Experiment(run_config(tmp_path / "r", prefs[0]), TINY, OPT)
  with pytest.raises(ValueError, match="needs a reference model: set REFERENCE_CHECKPOINT_PATH"):
    exp.load_frozen_model(preference.REFERENCE)
  assert not experiment_lib.Experiment(run_config(tmp_path / "r", prefs[0], loss_type="simpo"), TINY,
                                       OPT).frozen_specs
  with pytest.raises(ValueError, match="holds preference pairs: language modelling would learn the rejected"):
    experiment_lib.Experiment(run_config(tmp_path / "r", prefs[0], recipe_config=config_lib.LanguageModelConfig()), TINY,
                              OPT)
  with pytest.raises(ValueError, match="loss_type must be one of"):
    experiment_lib.Experiment(run_config(tmp_path / "r", prefs[0], loss_type="hinge"), TINY, OPT)


# ----------------------------------------------------------------------------------------------------
# The DPO step on mesh layouts equals one device (tests/test_parallelism.py's tolerances).

SMALL = dataclasses.replace(layouts.CFG, num_layers=2)


def synthetic_pair_batch(seed=0):
  """BATCH rows of SEQ tokens, each holding two random pairs (and some padding)."""
  rng = np.random.RandomState(seed)
  rows = []
  for _ in range(layouts.BATCH):
    pairs = []
    for _ in range(2):
      prompt = rng.randint(2, SMALL.vocab_size, rng.randint(1, 3))
      pairs.append(preference_data.Pair(*(side_of(rng, prompt) for _ in range(2))))
    rows.append(preference_data.pack_pairs_np(pairs, layouts.SEQ + 1, pad_id=0)[0])
  return {k: v.numpy() for k, v in packing.row_features(tf.constant(np.stack(rows))).items()}


def side_of(rng, prompt):
  response = rng.randint(2, SMALL.vocab_size, rng.randint(1, 2))
  return (np.concatenate([prompt, response, [1]]).astype(np.int32),
          np.concatenate([np.zeros(len(prompt)), np.ones(len(response)), [0]]).astype(np.int32))


def dpo_train(initial, reference_params, mesh_shape, *, num_microbatches=1, devices=None):
  mesh, _, model, tx, lr_fn = layouts.make_layout(mesh_shape, devices=devices, base=SMALL)
  rules = layouts.RULES
  objective = preference.Preference(model.apply, beta=0.5, max_pairs=2)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    _, shardings = train_state.state_shardings(model, tx, mesh, rules)
    state = jax.device_put(initial, shardings)
    frozen = {preference.REFERENCE: jax.device_put(reference_params, shardings.params)}
    batch_sharding = partitioning.batch_sharding(mesh, rules)
    batch = {k: jax.device_put(v, batch_sharding) for k, v in synthetic_pair_batch().items()}
    step = step_lib.jit_train_step(step_lib.make_train_step(objective, tx, lr_fn, num_microbatches=num_microbatches),
                                   shardings, batch_sharding, objective.features,
                                   {preference.REFERENCE: shardings.params})
    history = []
    for _ in range(layouts.STEPS):
      state, metrics = step(state, batch, frozen)
      history.append((float(metrics["loss"]), float(metrics["grad_norm"])))
      assert float(metrics["tokens"]) == 2 * layouts.BATCH  # pairs
  return np.array(history), jax.tree.map(np.asarray, state.params)


@pytest.mark.parametrize("loss_type", ["sigmoid", "simpo"])
def test_chunked_log_probs_give_the_losses_metrics_and_gradients_of_the_full_logits(loss_type):
  """TrainConfig.loss_chunk under DPO (and SimPO): the policy's and the reference's log-probs projected four
  positions at a time (logprobs.chunked_pair_sums) give the same loss, metrics and gradients as the full
  (B, L, V) logits, on rows of two pairs with padding."""
  model = model_lib.GPT(SMALL)
  params = jax.tree.map(lambda x: x.value, model.init(jax.random.key(0), jnp.zeros((1, layouts.SEQ), jnp.int32)),
                        is_leaf=lambda x: hasattr(x, "value"))["params"]
  rng = np.random.RandomState(1)
  frozen = {preference.REFERENCE: jax.tree.map(lambda x: x + rng.normal(0.0, 0.02, x.shape).astype(x.dtype), params)}
  batch = synthetic_pair_batch()

  def loss_and_grads(**chunking):
    objective = preference.Preference(model.apply, loss_type=loss_type, beta=0.5, max_pairs=2, **chunking)
    fn = lambda p: (lambda out: (out[0], out[2]))(objective.loss(p, batch, frozen))
    return jax.jit(jax.value_and_grad(fn, has_aux=True))(params)

  (full, full_metrics), full_grads = loss_and_grads()
  chunked_objective = dict(logits_fn=model_lib.logits_projection(SMALL), loss_chunk=layouts.SEQ // 4)
  (loss, metrics), grads = loss_and_grads(**chunked_objective)
  np.testing.assert_allclose(loss, full, rtol=1e-6)
  for key, value in full_metrics.items():
    np.testing.assert_allclose(metrics[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
  scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(full_grads))
  jax.tree.map(lambda g, r: np.testing.assert_allclose(g, r, atol=1e-5 * scale), grads, full_grads)
  assert scale > 0

  def full_logits_in(**chunking):  # a (B, L, V) value in the loss's program, outside the chunks' scan body
    objective = preference.Preference(model.apply, loss_type=loss_type, beta=0.5, max_pairs=2, **chunking)
    jaxpr = jax.make_jaxpr(lambda p: objective.loss(p, batch, frozen)[0])(params)
    shape = (layouts.BATCH, layouts.SEQ, SMALL.vocab_size)
    return any(tuple(v.aval.shape) == shape for e in jaxpr.eqns for v in e.outvars)

  assert full_logits_in() and not full_logits_in(**chunked_objective)


@pytest.fixture(scope="module")
def dpo_initial():
  initial = layouts.host_initial_state(base=SMALL)
  rng = np.random.RandomState(5)
  reference = jax.tree.map(lambda x: (x + rng.normal(0.0, 0.02, x.shape)).astype(x.dtype), initial.params)
  return initial, reference, dpo_train(initial, reference, {"data": 1}, devices=jax.devices()[:1])


@pytest.mark.slow  # fast subset: the developer loop; CI runs it
def test_dpo_step_on_a_layout_equals_one_device(dpo_initial):
  """One layout (the generic layouts are tests/test_parallelism.py's): the policy and the reference both split
  over pipeline stages and tensor, the pairs over data, and two accumulation microbatches (pairs never straddle
  one)."""
  initial, reference, single = dpo_initial
  layouts.assert_same_training(dpo_train(initial, reference, {"pipeline": 2, "data": 2, "tensor": 2},
                                         num_microbatches=2), single)


# ----------------------------------------------------------------------------------------------------
# The generated task learnt: held-out pairwise accuracy from ≈50% to ≥90%, the chosen log-prob not collapsing.


@pytest.mark.slow  # a 20-DPO-step run and a copy of it resumed for its last two steps (≈ 40 s on 2 loaded cores)
def test_dpo_learns_the_generated_preference_and_a_resumed_run_repeats_the_same_steps_bit_for_bit(prefs, tmp_path):
  """20 DPO steps through trainer.train: held-out pairwise accuracy from chance to ≥ 90%, `evaluate` on the run's
  checkpoint gives it again against the reference its metadata names; a copy of the run rewound to its step-18
  checkpoint and resumed logs steps 19 and 20 with the same losses and metrics, bit for bit (data position,
  optimizer state and the pinned reference restored)."""
  data_dir, _ = prefs
  base_dir = str(tmp_path / "base")
  checkpointing.save_params(base_dir, host_params(TINY, seed=0))
  steps = 20
  config = run_config(tmp_path / "dpo", data_dir, base=base_dir, train_steps=steps, checkpoint_every=steps - 2)
  exp = experiment_lib.Experiment(config, TINY, OPT)
  manager = checkpointing.make_manager(str(tmp_path / "dpo"), async_save=False)
  start, state, _, origin = trainer.initial_state(exp, manager, None)
  manager.close()
  assert start == 0 and origin["reference_checkpoint"] == origin["initial_checkpoint"]  # the default reference
  report = exp.startup_report()  # the reference costs its parameters' bytes (data parallel: all of them per device)
  assert report["memory/frozen_reference_bytes_per_device"] == report["memory/params_bytes_per_device"] == 4 * sum(
      x.size for x in jax.tree.leaves(exp.frozen[preference.REFERENCE]))
  before = exp.evaluate(state.params)
  after = trainer.train(config, TINY, OPT)  # the same warm start, then 20 steps; evaluates at its last step
  print({k: (round(before[k], 3), round(after[k], 3)) for k in before})
  assert before["eval/rewards/accuracy"] == 0.5 and before["eval/loss"] == pytest.approx(np.log(2), rel=1e-6)
  # the base's own preference (its log-probs alone) is near chance, not the task's: 0.40 for this random base
  assert 0.3 <= before["eval/logps/accuracy"] <= 0.75
  assert after["eval/rewards/accuracy"] >= 0.9 and after["eval/logps/accuracy"] >= 0.9
  assert after["eval/logps/chosen"] >= before["eval/logps/chosen"]  # the chosen answers became likelier
  assert after["eval/rewards/margin"] > 0.1
  # `evaluate` on the run's checkpoint: the same held-out accuracy, against the reference its metadata names
  fresh = experiment_lib.Experiment(run_config(tmp_path / "dpo", data_dir), TINY, OPT)
  result = fresh.evaluate_checkpoint()
  assert fresh.loaded[preference.REFERENCE] == origin["reference_checkpoint"]
  assert result["eval/rewards/accuracy"] == pytest.approx(after["eval/rewards/accuracy"], abs=1e-9)
  # rewound to step 18 and resumed: steps 19 and 20 repeat bit for bit
  rewound = conftest.rewind(tmp_path / "dpo", tmp_path / "resumed", steps - 2)
  trainer.train(dataclasses.replace(config, model_dir=rewound, data=data_lib.DataConfig(shuffle_buffer=64,
                                                                                          eval_batches=1)), TINY, OPT)
  logged = lambda d: {r["step"]: r for r in map(json.loads, open(os.path.join(d, "metrics.jsonl"))) if "loss" in r}
  first, second = logged(tmp_path / "dpo"), logged(rewound)
  assert sorted(second) == [steps - 1, steps]
  for step in (steps - 1, steps):
    for key in ("loss", "grad_norm", "rewards/accuracy", "rewards/margin", "logps/chosen", "logps/rejected"):
      assert second[step][key] == first[step][key], (step, key)
  meta = checkpointing.read_metadata(os.path.join(rewound, "checkpoints", str(steps)))
  assert meta["reference_checkpoint"] == os.path.join(base_dir, "checkpoints", "0")
