"""ORPO and KTO, two preference methods added on the recipe seam (an objective, a recipe and a gin file each): their
losses and gradients against NumPy, data×fsdp×tensor and pipeline layouts equal to one device, the generated
preference task learnt (held-out pairwise accuracy raised), and bad input named in one line."""

import dataclasses
import json
import math
import os

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow as tf

from tests import test_parallelism as layouts
from tests.test_dpo import L_SMALL, OPT, SEQ, SMALL, TINY, WORDS, bigram, host_params, numpy_logps, prefs, run_config, \
  synthetic_pair_batch, tiny_pairs  # pylint: disable=unused-import  (prefs: a fixture)

from t5x_like import cli
from t5x_like import recipes
from t5x_like.data import packing
from t5x_like.data import preference_synth
from t5x_like.data import preprocessing
from t5x_like.data import preference as preference_data
from t5x_like.parallel import partitioning
from t5x_like.posttrain import kto
from t5x_like.posttrain import orpo
from t5x_like.recipes import experiment as experiment_lib
from t5x_like.recipes import kto as kto_recipe
from t5x_like.recipes import orpo as orpo_recipe
from t5x_like.training import checkpointing
from t5x_like.training import step as step_lib
from t5x_like.training import train_state
from t5x_like.training import trainer

V = 11  # test_dpo's bigram vocabulary
LAMBDA, BETA, LAMBDA_D, LAMBDA_U = 0.6, 0.7, 1.3, 0.7


def pair_batch(seed=0):
  """test_dpo's tiny pairs packed by the writer (several per row, padding) + an all-padding row, as features."""
  pairs = tiny_pairs(seed)
  rows = preference_data.pack_pairs_np(pairs, L_SMALL + 1, pad_id=0)
  assert len(rows) >= 2 and rows[:, packing.SEGMENTS].max() >= 4
  batch = {k: v.numpy() for k, v in packing.row_features(tf.constant(rows)).items()}
  batch = {k: np.concatenate([v, np.zeros_like(v[:1])]) for k, v in batch.items()}
  return pairs, batch, int(rows[:, packing.SEGMENTS].max() // 2)


def tables(seed=1):
  rng = np.random.RandomState(seed)
  return rng.normal(0, 1.5, (V, V)), rng.normal(0, 1.5, (V, V))


def numpy_orpo(policy, pairs):
  """{loss, nll, log_sigmoid, ratio, mean_c, mean_r} per pair, float64, straight from the paper's formula."""
  out = {k: [] for k in ("loss", "nll", "log_sigmoid", "ratio", "mean_c", "mean_r")}
  for p in pairs:
    (pc, nc), (pr, nr) = numpy_logps(policy, *p.chosen), numpy_logps(policy, *p.rejected)
    mc, mr = pc / nc, pr / nr
    ratio = (mc - np.log(1 - np.exp(mc))) - (mr - np.log(1 - np.exp(mr)))
    log_sigmoid = -np.log1p(np.exp(-ratio))
    for k, v in zip(out, (-mc - LAMBDA * log_sigmoid, -mc, log_sigmoid, ratio, mc, mr)):
      out[k].append(v)
  return {k: np.array(v) for k, v in out.items()}


def numpy_kto(policy, reference, pairs, z0=None):
  """{loss, rc, rr, pc, pr} per pair and z0 (the batch's mean log-ratio, floored at 0, unless given)."""
  logps = [[numpy_logps(t, *side)[0] for side in (p.chosen, p.rejected)] for p in pairs for t in (policy, reference)]
  pc, pr = np.array(logps[0::2]).T
  qc, qr = np.array(logps[1::2]).T
  rc, rr = pc - qc, pr - qr
  if z0 is None:
    z0 = max(0.0, float(np.mean(np.concatenate([rc, rr]))))
  sig = lambda x: 1 / (1 + np.exp(-x))
  loss = 0.5 * (LAMBDA_D * (1 - sig(BETA * (rc - z0))) + LAMBDA_U * (1 - sig(BETA * (z0 - rr))))
  return {"loss": loss, "rc": BETA * rc, "rr": BETA * rr, "pc": pc, "pr": pr}, z0


def directional_derivative(fn, table, direction, eps=1e-5):
  return (fn(table + eps * direction) - fn(table - eps * direction)) / (2 * eps)


# ----------------------------------------------------------------------------------------------------
# The losses and their gradients against a direct NumPy computation (test_dpo's bigram model and pairs).


def test_orpo_loss_metrics_and_gradient_equal_numpy_and_accumulation_is_exact():
  pairs, batch, max_pairs = pair_batch()
  policy, _ = tables()
  objective = orpo.Orpo(bigram, lambda_=LAMBDA, max_pairs=max_pairs)
  assert not objective.needs_reference
  params = {"table": policy.astype(np.float32)}
  loss_sum, weight_sum, metrics = jax.jit(objective.loss)(params, batch, {})
  want = numpy_orpo(policy, pairs)
  assert float(weight_sum) == len(pairs)
  np.testing.assert_allclose(float(loss_sum), want["loss"].sum(), rtol=2e-6)
  for key, value in (("nll_loss", want["nll"]), ("log_odds_ratio", want["log_sigmoid"]),
                     ("log_odds_chosen", want["ratio"]), ("logps/chosen", want["mean_c"]),
                     ("logps/rejected", want["mean_r"]), ("rewards/chosen", LAMBDA * want["mean_c"]),
                     ("rewards/margins", LAMBDA * (want["mean_c"] - want["mean_r"]))):
    np.testing.assert_allclose(float(metrics[key]), value.sum(), rtol=2e-6, atol=1e-6, err_msg=key)
  assert float(metrics["rewards/accuracies"]) == np.sum(want["mean_c"] > want["mean_r"])
  # the gradient: directional derivatives of the NumPy loss (float64 central differences)
  grad = jax.grad(lambda p: objective.loss(p, batch, {})[0])(params)["table"]
  rng = np.random.RandomState(2)
  for _ in range(3):
    direction = rng.normal(size=(V, V))
    expected = directional_derivative(lambda t: numpy_orpo(t, pairs)["loss"].sum(), policy, direction)
    np.testing.assert_allclose(float(np.sum(np.asarray(grad) * direction)), expected, rtol=1e-4)
  # two gradient-accumulation microbatches give the same sums (pairs never straddle rows)
  fn = lambda p, micro: objective.loss(p, micro, {})
  one, two = (step_lib.accumulated_grads(fn, params, batch, n) for n in (1, 2))
  np.testing.assert_allclose(float(two[1]), float(one[1]), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(two[0]["table"]), np.asarray(one[0]["table"]), rtol=1e-5, atol=1e-7)


def test_log_odds_stay_finite_where_one_minus_exp_rounds_to_zero():
  x = np.array([-1e-30, -1e-7, -1e-3, -0.5, -math.log(2.0), -3.0, -50.0, -1e4], np.float32)
  got = np.asarray(orpo.log1mexp(jnp.asarray(x)))
  # float64 references, each where it is exact; a float32 log(1 − exp(x)) would give −inf, −16 and 0
  want = [math.log(-math.expm1(min(v, orpo.MAX_MEAN_LOGP))) if v > -0.5 else math.log1p(-math.exp(v))
          for v in x.astype(np.float64)]
  np.testing.assert_allclose(got, want, rtol=1e-6)
  grads = np.asarray(jax.vmap(jax.grad(lambda v: orpo.log_odds(v)))(jnp.asarray(x)))
  assert np.all(np.isfinite(grads)) and np.all(grads[2:] > 0)  # log odds rise with the mean log-prob
  # a policy certain of every chosen token: a finite loss and gradient (the odds clamped, not infinite)
  pairs, batch, max_pairs = pair_batch()
  certain = np.full((V, V), -30.0, np.float32)
  for p in pairs:
    ids, weights = p.chosen
    for t in np.nonzero(weights[1:])[0]:
      certain[ids[t], ids[t + 1]] = 30.0
  objective = orpo.Orpo(bigram, lambda_=LAMBDA, max_pairs=max_pairs)
  loss, grad = jax.value_and_grad(lambda p: objective.loss(p, batch, {})[0])({"table": certain})
  assert np.isfinite(float(loss)) and np.all(np.isfinite(np.asarray(grad["table"])))


@pytest.mark.parametrize("swap", [False, True])  # the batch's mean log-ratio below 0 (z0 floored) and above
def test_kto_loss_metrics_and_gradient_equal_numpy_with_the_reference_point(swap):
  pairs, batch, max_pairs = pair_batch()
  policy, reference = tables()[::-1] if swap else tables()
  objective = kto.Kto(bigram, beta=BETA, desirable_weight=LAMBDA_D, undesirable_weight=LAMBDA_U, max_pairs=max_pairs)
  assert objective.needs_reference
  params, frozen = {"table": policy.astype(np.float32)}, {kto.REFERENCE: {"table": reference.astype(np.float32)}}
  loss_sum, weight_sum, metrics = jax.jit(objective.loss)(params, batch, frozen)
  want, z0 = numpy_kto(policy, reference, pairs)
  assert (z0 > 0.1) == swap and (z0 == 0.0) == (not swap)  # this seed: one side of the floor each
  assert float(weight_sum) == len(pairs)
  np.testing.assert_allclose(float(loss_sum), want["loss"].sum(), rtol=2e-6)
  np.testing.assert_allclose(float(metrics["kl"]), z0 * len(pairs), rtol=2e-6, atol=1e-6)
  for key, value in (("rewards/chosen", want["rc"]), ("rewards/rejected", want["rr"]),
                     ("rewards/margins", want["rc"] - want["rr"]), ("logps/chosen", want["pc"]),
                     ("logps/rejected", want["pr"])):
    np.testing.assert_allclose(float(metrics[key]), value.sum(), rtol=2e-6, atol=1e-5, err_msg=key)
  assert float(metrics["rewards/accuracies"]) == np.sum(want["rc"] > want["rr"])
  # the gradient treats z0 as a constant (the paper's and TRL's reference point carries none)
  grad = jax.grad(lambda p: objective.loss(p, batch, frozen)[0])(params)["table"]
  rng = np.random.RandomState(3)
  for _ in range(3):
    direction = rng.normal(size=(V, V))
    expected = directional_derivative(lambda t: numpy_kto(t, reference, pairs, z0=z0)[0]["loss"].sum(), policy,
                                      direction)
    np.testing.assert_allclose(float(np.sum(np.asarray(grad) * direction)), expected, rtol=1e-4, atol=1e-7)


def test_kto_policy_equal_to_reference_scores_half_with_no_kl():
  pairs, batch, max_pairs = pair_batch(seed=3)
  table = {"table": np.random.RandomState(0).normal(size=(V, V)).astype(np.float32)}
  objective = kto.Kto(bigram, beta=BETA, max_pairs=max_pairs)
  loss_sum, weight_sum, metrics = objective.loss(table, batch, {kto.REFERENCE: table})
  assert float(metrics["kl"]) == 0.0 and float(metrics["rewards/accuracies"]) == 0.5 * len(pairs)
  np.testing.assert_allclose(float(loss_sum / weight_sum), 0.5, rtol=1e-6)  # 1 − σ(0) for each label


# ----------------------------------------------------------------------------------------------------
# Mesh layouts equal one device (test_parallelism's tolerances; test_dpo's pair batch): data×fsdp×tensor, pipeline.


def train_on_layout(method, initial, reference_params, mesh_shape, *, num_microbatches=1, devices=None):
  mesh, _, model, tx, lr_fn = layouts.make_layout(mesh_shape, devices=devices, base=SMALL)
  objective = (orpo.Orpo(model.apply, lambda_=0.5, max_pairs=2) if method == "orpo" else
               kto.Kto(model.apply, beta=0.5, desirable_weight=LAMBDA_D, undesirable_weight=LAMBDA_U, max_pairs=2))
  with jax.set_mesh(mesh), nn.logical_axis_rules(layouts.RULES):
    _, shardings = train_state.state_shardings(model, tx, mesh, layouts.RULES)
    state = jax.device_put(initial, shardings)
    frozen_shardings = {kto.REFERENCE: shardings.params} if objective.needs_reference else {}
    frozen = {k: jax.device_put(reference_params, s) for k, s in frozen_shardings.items()}
    batch_sharding = partitioning.batch_sharding(mesh, layouts.RULES)
    batch = {k: jax.device_put(v, batch_sharding) for k, v in synthetic_pair_batch().items()}
    step = step_lib.jit_train_step(step_lib.make_train_step(objective, tx, lr_fn, num_microbatches=num_microbatches),
                                   shardings, batch_sharding, objective.features, frozen_shardings)
    history = []
    for _ in range(layouts.STEPS):
      state, metrics = step(state, batch, frozen)
      history.append((float(metrics["loss"]), float(metrics["grad_norm"])))
      assert float(metrics["tokens"]) == 2 * layouts.BATCH  # pairs
  return np.array(history), jax.tree.map(np.asarray, state.params)


@pytest.fixture(scope="module")
def layout_runs():
  """(initial state, reference parameters, {method: its single-device run}), the runs made on first use."""
  initial = layouts.host_initial_state(base=SMALL)
  rng = np.random.RandomState(5)
  reference = jax.tree.map(lambda x: (x + rng.normal(0.0, 0.02, x.shape)).astype(x.dtype), initial.params)
  return initial, reference, {}


@pytest.mark.slow  # ≈ 15-25 s each on 2 loaded cores (compiling a layout, and the one-device run once per method)
@pytest.mark.parametrize("method, mesh_shape, microbatches", [
    ("orpo", {"data": 2, "fsdp": 2, "tensor": 2}, 2), ("kto", {"data": 2, "fsdp": 2, "tensor": 2}, 1),
    ("orpo", {"pipeline": 2, "data": 2, "tensor": 2}, 2), ("kto", {"pipeline": 2, "data": 2, "tensor": 2}, 1)])
def test_step_on_a_layout_equals_one_device(method, mesh_shape, microbatches, layout_runs):
  """ORPO with two accumulation microbatches too (its sums are exact); KTO with one: its reference point z0 is a
  mean over the batch the loss sees, so microbatches would each have their own (as TRL's accumulation steps)."""
  initial, reference, single = layout_runs
  if method not in single:
    single[method] = train_on_layout(method, initial, reference, {"data": 1}, devices=jax.devices()[:1])
  layouts.assert_same_training(train_on_layout(method, initial, reference, mesh_shape, num_microbatches=microbatches),
                               single[method])


# ----------------------------------------------------------------------------------------------------
# The recipes: gin files pick them, bad input is one line, and the generated preference task is learnt.

RUN = ["MODEL_DIR = '/m'", "DATA_DIR = '/d'", "INITIAL_CHECKPOINT_PATH = '/b'"]


@pytest.mark.parametrize("gin_file, bindings, expected", [
    ("orpo.gin", ["orpo.OrpoConfig.lambda_ = 0.3"], orpo_recipe.OrpoConfig(lambda_=0.3)),
    ("kto.gin", ["REFERENCE_CHECKPOINT_PATH = '/r'", "kto.KtoConfig.undesirable_weight = 1.2"],
     kto_recipe.KtoConfig(reference_checkpoint="/r", undesirable_weight=1.2)),
])
def test_the_run_file_picks_the_recipe(gin_file, bindings, expected):
  gin.clear_config()
  try:
    cli.parse_gin([f"{cli.REPO_ROOT}/configs/models/gpt_tiny.gin", f"{cli.REPO_ROOT}/configs/runs/{gin_file}"],
                  RUN + bindings)
    config = cli.train_config()
  finally:
    gin.clear_config()
  assert config.recipe_config == expected and recipes.get(config.recipe).CONFIG is type(expected)


def recipe_run(model_dir, data_dir, method, **overrides):
  config = orpo_recipe.OrpoConfig(lambda_=0.5) if method == "orpo" else kto_recipe.KtoConfig(beta=0.1)
  return run_config(model_dir, data_dir, recipe=method, recipe_config=config, **overrides)


@pytest.mark.parametrize("method", ["orpo", "kto"])
def test_bad_input_is_one_line(method, prefs, corpus, tmp_path):
  wrong_format = (rf"TrainConfig.recipe='{method}' reads a preference DATA_DIR "
                  r"\(python -m t5x_like.preprocess --format=preference\).*has format 'text'")
  with pytest.raises(ValueError, match=wrong_format) as raised:
    experiment_lib.Experiment(recipe_run(tmp_path / "r", corpus, method), TINY, OPT)
  assert "\n" not in str(raised.value)
  exp = experiment_lib.Experiment(recipe_run(tmp_path / "r", prefs[0], method), TINY, OPT)
  if method == "orpo":
    assert not exp.frozen_specs  # reference-free: nothing to load
    with pytest.raises(ValueError, match="OrpoConfig.lambda_ must be >= 0, got -0.1"):
      orpo.Orpo(bigram, lambda_=-0.1)
  else:
    with pytest.raises(ValueError, match="the kto loss needs a reference model: set REFERENCE_CHECKPOINT_PATH "
                                         r"\(KtoConfig.reference_checkpoint\)"):
      exp.load_frozen_model(kto.REFERENCE)
    with pytest.raises(ValueError, match="KtoConfig.undesirable_weight must be >= 0, got -1"):
      kto.Kto(bigram, undesirable_weight=-1)


@pytest.mark.slow  # two 10-step runs through trainer.train (≈ 30-40 s each on 2 loaded cores)
@pytest.mark.parametrize("method", ["orpo", "kto"])
def test_training_raises_held_out_pairwise_accuracy(method, prefs, tmp_path):
  """10 steps from a random base on the generated reversal task (test_dpo's): held-out pairwise accuracy (the
  method's own reward: ORPO's length-normalised log-prob, KTO's log-ratio to the reference) from about chance to
  ≥ 0.85, and the chosen answers made likelier."""
  base_dir = str(tmp_path / "base")
  checkpointing.save_params(base_dir, host_params(TINY, seed=0))
  config = recipe_run(tmp_path / method, prefs[0], method, base=base_dir, train_steps=10)
  exp = experiment_lib.Experiment(config, TINY, OPT)
  manager = checkpointing.make_manager(str(tmp_path / method), async_save=False)
  _, state, _, _ = trainer.initial_state(exp, manager, None)
  manager.close()
  before = exp.evaluate(state.params)
  after = trainer.train(config, TINY, OPT)
  print(method, {k: (round(before[k], 3), round(after[k], 3)) for k in before})
  if method == "kto":
    assert before["eval/rewards/accuracies"] == 0.5 and before["eval/kl"] == 0.0  # the policy is its reference
  assert before["eval/rewards/accuracies"] <= 0.75
  assert after["eval/rewards/accuracies"] >= 0.85
  assert after["eval/logps/chosen"] > before["eval/logps/chosen"]
  assert after["eval/rewards/margins"] > before["eval/rewards/margins"]


# ----------------------------------------------------------------------------------------------------
# KTO on unpaired thumbs-up / thumbs-down data (preprocess --format=unpaired).

EMPTY = (np.zeros(0, np.int32), np.zeros(0, np.int32))


def test_kto_on_unpaired_examples_equals_numpy_over_the_examples_present():
  """Each example sits in its label's slot of a pair (desirable: chosen, undesirable: rejected, the other empty);
  the loss is the mean over the examples of their value-function losses, z0 their mean log-ratio."""
  sides = [side for pair in tiny_pairs(3) for side in (pair.chosen, pair.rejected)][:7]
  labels = [True, False, False, True, True, False, True]
  examples = [preference_data.Pair(s, EMPTY) if good else preference_data.Pair(EMPTY, s)
              for s, good in zip(sides, labels)]
  rows = preference_data.pack_pairs_np(examples, L_SMALL + 1, pad_id=0)
  batch = {k: v.numpy() for k, v in packing.row_features(tf.constant(rows)).items()}
  max_pairs = int(rows[:, packing.SEGMENTS].max() + 1) // 2
  policy, reference = tables(seed=4)
  r = np.array([numpy_logps(policy, *s)[0] - numpy_logps(reference, *s)[0] for s in sides])
  z0 = max(0.0, float(r.mean()))
  sig = lambda x: 1 / (1 + np.exp(-x))
  losses = np.where(labels, LAMBDA_D * (1 - sig(BETA * (r - z0))), LAMBDA_U * (1 - sig(BETA * (z0 - r))))
  objective = kto.Kto(bigram, beta=BETA, desirable_weight=LAMBDA_D, undesirable_weight=LAMBDA_U, max_pairs=max_pairs)
  loss, weight, metrics = jax.jit(objective.loss)({"table": policy}, batch, {kto.REFERENCE: {"table": reference}})
  assert float(weight) == 3.5  # half the examples
  assert float(loss) / float(weight) == pytest.approx(losses.mean(), rel=1e-5)
  assert float(metrics["kl"]) / float(weight) == pytest.approx(z0, rel=1e-5)
  assert float(metrics["rewards/chosen"]) == pytest.approx(BETA * r[np.array(labels)].sum(), rel=1e-5)
  assert float(metrics["rewards/rejected"]) == pytest.approx(BETA * r[~np.array(labels)].sum(), rel=1e-5)
  assert float(metrics["rewards/accuracies"]) == 0.0  # no whole pair


def unpaired_lines(pairs_file: str, path: str, extra=()) -> str:
  """Each preference pair of `pairs_file` as two labelled examples (chosen: true, rejected: false), + `extra`."""
  with open(pairs_file) as f, open(path, "w") as out:
    for line in f:
      pair = json.loads(line)
      for key, label in (("chosen", True), ("rejected", False)):
        out.write(json.dumps({"prompt": pair["prompt"], "completion": pair[key], "label": label}) + "\n")
    out.writelines(json.dumps(e) + "\n" for e in extra)
  return path


@pytest.fixture(scope="module")
def unpaired(prefs, corpus, tmp_path_factory):
  """(an unpaired DATA_DIR of the reversal task's examples + two unlabelled lines, its report)."""
  root = tmp_path_factory.mktemp("unpaired")
  pairs_file = preference_synth.write_synthetic_preferences(str(root / "raw"), count=600, words=WORDS, distractors=3,
                                                            num_words=4, seed=1)
  lines = unpaired_lines(pairs_file, str(root / "examples.jsonl"),
                         extra=[{"prompt": "a", "completion": "b"}, {"prompt": "a", "completion": "b", "label": "yes"}])
  report = preprocessing.preprocess([lines], str(root / "ds"), data_format="unpaired", tokenizer=corpus,
                                    pack_length=SEQ + 1, validation_fraction=0.1, num_train_shards=2)
  return str(root / "ds"), report


def test_an_unpaired_data_dir_counts_lines_without_a_label_and_only_kto_reads_it(unpaired, corpus, tmp_path):
  data_dir, report = unpaired
  assert report["dropped"]["malformed_missing_key"] == 1 and report["dropped"]["malformed_wrong_shape"] == 1
  with open(os.path.join(data_dir, "manifest.json")) as f:
    assert json.load(f)["unpaired"] is True
  with pytest.raises(ValueError, match=r"TrainConfig.recipe='dpo' trains on pairs: DATA_DIR .* holds unpaired "
                                       r"examples \(preprocess --format=unpaired\), which only "
                                       r"TrainConfig.recipe='kto'"):
    experiment_lib.Experiment(run_config(tmp_path / "d", data_dir), TINY, OPT)
  no_labels = tmp_path / "no_labels.jsonl"
  no_labels.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n")
  with pytest.raises(ValueError, match=r"No labelled examples left in 1 input file\(s\) .*missing key 'label'"):
    preprocessing.preprocess([str(no_labels)], str(tmp_path / "x"), data_format="unpaired", tokenizer=corpus,
                             pack_length=SEQ + 1)


@pytest.mark.slow  # a 10-step run through trainer.train (≈ 30 s on 2 loaded cores)
def test_kto_on_unpaired_examples_raises_held_out_pairwise_accuracy(unpaired, prefs, tmp_path):
  """10 KTO steps on the unpaired examples (thumbs up / down, each pair's two answers as separate lines of other
  prompts than the pairs'), evaluated on the paired DATA_DIR's held-out pairs: accuracy from chance to ≥ 0.85."""
  base_dir = str(tmp_path / "base")
  checkpointing.save_params(base_dir, host_params(TINY, seed=0))
  trainer.train(recipe_run(tmp_path / "kto", unpaired[0], "kto", base=base_dir, train_steps=10), TINY, OPT)
  on_pairs = experiment_lib.Experiment(recipe_run(tmp_path / "kto", prefs[0], "kto", base=base_dir), TINY, OPT)
  after = on_pairs.evaluate_checkpoint()
  print({k: round(v, 3) for k, v in after.items() if k.startswith("eval/")})
  assert after["eval/rewards/accuracies"] >= 0.85 and after["eval/rewards/margins"] > 0
