"""Reward model: Bradley–Terry on the score head against NumPy, a generated preference learnt from an LM checkpoint
without a head (held-out pairwise accuracy ≥ 90%), the scorer reading the checkpoint as training does, the reward
step on a mesh layout equal to one device, and bad input. (Exact resume is the generic loop's: test_dpo.py and
test_distill.py run it for objectives over frozen models.)"""

import dataclasses
import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow as tf

from tests import test_dpo as dpo
from tests import test_parallelism as layouts

from t5x_like.data import input_pipeline
from t5x_like.data import packing
from t5x_like.data import preference as preference_data
from t5x_like.model import decoder as model_lib
from t5x_like.model import heads
from t5x_like.parallel import partitioning
from t5x_like.training import checkpointing
from t5x_like.training import config as config_lib
from t5x_like.recipes import reward as reward_recipe
from t5x_like.recipes import experiment as experiment_lib
from t5x_like.posttrain import reward_scoring
from t5x_like.training import step as step_lib
from t5x_like.training import train_state
from t5x_like.training import trainer
from t5x_like.posttrain import reward

prefs = dpo.prefs  # the generated preference DATA_DIR (module fixture)
TINY, SEQ, V = dpo.TINY, dpo.SEQ, dpo.V


# ----------------------------------------------------------------------------------------------------
# Bradley–Terry against NumPy: a stand-in model whose hidden state at a position is row `token` of a table, so
# the reward of a side is table[its last learned token] · w (the position whose input is that token).


def hidden_of(variables, tokens, *_, return_hidden=True):
  assert return_hidden
  return jnp.asarray(variables["params"]["table"])[tokens]  # (B, L, D)


def score_of(params, hidden):
  return jnp.einsum("bld,d->bl", hidden, jnp.asarray(params["w"]))


def numpy_rewards(table, w, pair):
  out = []
  for ids, weights in (pair.chosen, pair.rejected):
    last = np.nonzero(weights)[0].max()  # the last token with loss weight (the response's end marker)
    out.append(float(table[ids[last]].astype(np.float64) @ w.astype(np.float64)))
  return out


def test_bradley_terry_equals_a_direct_numpy_computation():
  pairs = dpo.tiny_pairs(seed=4)
  rows = preference_data.pack_pairs_np(pairs, dpo.L_SMALL + 1, pad_id=0)
  assert len(rows) >= 2 and rows[:, packing.SEGMENTS].max() >= 4  # several pairs per row, and padding
  batch = {k: v.numpy() for k, v in packing.row_features(tf.constant(rows)).items()}
  batch = {k: np.concatenate([v, np.zeros_like(v[:1])]) for k, v in batch.items()}  # + an all-padding row
  rng = np.random.RandomState(2)
  params = {"table": rng.normal(0, 0.5, (V, 8)).astype(np.float32), "w": rng.normal(0, 0.5, 8).astype(np.float32)}
  objective = reward.Reward(hidden_of, score_of, max_pairs=int(rows[:, packing.SEGMENTS].max() // 2))
  loss_sum, weight_sum, metrics = jax.jit(objective.loss)(params, batch)
  rc, rr = np.array([numpy_rewards(params["table"], params["w"], p) for p in pairs]).T
  assert float(weight_sum) == len(pairs)
  np.testing.assert_allclose(float(loss_sum), np.sum(np.log1p(np.exp(-(rc - rr)))), rtol=2e-6)
  np.testing.assert_allclose(float(metrics["rewards/chosen"]), rc.sum(), rtol=2e-6, atol=1e-6)
  np.testing.assert_allclose(float(metrics["rewards/rejected"]), rr.sum(), rtol=2e-6, atol=1e-6)
  np.testing.assert_allclose(float(metrics["rewards/margin"]), (rc - rr).sum(), rtol=2e-6, atol=1e-6)
  assert float(metrics["rewards/accuracy"]) == np.sum(rc > rr) and 0 < np.sum(rc > rr) < len(pairs)
  # two gradient-accumulation microbatches give the same sums (pairs never straddle rows)
  one = step_lib.accumulated_grads(lambda p, m: objective.loss(p, m), params, batch, 1)
  two = step_lib.accumulated_grads(lambda p, m: objective.loss(p, m), params, batch, 2)
  np.testing.assert_allclose(float(two[1]), float(one[1]), rtol=1e-6)
  for key in params:
    np.testing.assert_allclose(np.asarray(two[0][key]), np.asarray(one[0][key]), rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------------------------------
# The generated task learnt from an LM checkpoint without a score head; resumed bit for bit; scored by the scorer.

OPT = dataclasses.replace(dpo.OPT, learning_rate=3e-3)


def run_config(model_dir, data_dir, base, **overrides):
  return dpo.run_config(model_dir, data_dir, base=base, recipe="reward", recipe_config=reward_recipe.RewardConfig(),
                        **overrides)


def held_out_sequences(data_dir):
  """Each validation pair's (chosen, rejected) token lists, up to and including their last learned token."""
  ds = input_pipeline.make_dataset(data_dir, "validation", batch_size=64, seq_len=SEQ, shuffle=False, repeat=False,
                                   process_index=0, process_count=1)
  out = []
  for batch in ds:
    batch = {k: v.numpy() for k, v in batch.items()}
    for row in range(batch["inputs"].shape[0]):
      seg, weights = batch["segment_ids"][row], batch["weights"][row]
      tokens = np.append(batch["inputs"][row], batch["targets"][row][-1])
      for s in range(1, seg.max() + 1, 2):
        sides = []
        for side in (s, s + 1):
          last = np.nonzero((seg == side) & (weights > 0))[0].max() + 1  # the token after the last weighted target
          sides.append(tokens[np.nonzero(seg == side)[0][0]:last + 1].tolist())
        out.append(sides)
  return out


@pytest.mark.slow  # an in-process training run of 14 steps
def test_reward_model_learns_held_out_pairs_and_scores_like_training(prefs, tmp_path):
  data_dir, _ = prefs
  base_dir = str(tmp_path / "base")  # a language model: no score head
  checkpointing.save_params(base_dir, dpo.host_params(TINY, seed=0))
  steps = 14
  config = run_config(tmp_path / "rm", data_dir, base_dir, train_steps=steps, checkpoint_every=steps)
  result = trainer.train(config, TINY, OPT)
  logged = lambda d: {r["step"]: r for r in map(json.loads, open(os.path.join(d, "metrics.jsonl"))) if "loss" in r}
  first = logged(tmp_path / "rm")
  # step 1 ran the warm-started body with a fresh (zero) head: every reward 0, a tie on every pair
  assert first[1]["rewards/accuracy"] == 0.5 and first[1]["loss"] == pytest.approx(np.log(2), rel=1e-6)
  print({k: v for k, v in result.items() if k.startswith("eval/")})
  assert result["eval/rewards/accuracy"] >= 0.9 and result["eval/rewards/margin"] > 0
  assert result["eval/loss"] < 0.5 * np.log(2)
  # the scorer reads the checkpoint as training does: the same held-out accuracy and margin
  scorer = reward_scoring.RewardModelScorer(str(tmp_path / "rm"), dataclasses.replace(TINY, vocab_size=512))
  pairs = held_out_sequences(data_dir)
  scores = scorer.score([side for pair in pairs for side in pair]).reshape(-1, 2)
  assert len(pairs) == 157
  assert np.mean(scores[:, 0] > scores[:, 1]) == pytest.approx(result["eval/rewards/accuracy"], abs=1e-9)
  np.testing.assert_allclose(np.mean(scores[:, 0] - scores[:, 1]), result["eval/rewards/margin"], rtol=1e-4)


# ----------------------------------------------------------------------------------------------------
# The reward step on a mesh layout equals one device.

SMALL = dpo.SMALL


def scored_layout(mesh_shape, devices=None):
  """layouts.make_layout with the reward model (the decoder under its score head) as the model."""
  mesh, cfg, model, tx, lr_fn = layouts.make_layout(mesh_shape, devices=devices, base=SMALL)
  return mesh, cfg, heads.ScoredGPT(model.config), tx, lr_fn


def scored_initial_state():
  """layouts.host_initial_state of the reward model."""
  mesh, _, model, tx, _ = scored_layout({"data": 1}, devices=jax.devices()[:1])
  with jax.set_mesh(mesh), nn.logical_axis_rules(layouts.RULES):
    state, _ = train_state.init_state(model, tx, jax.random.key(0), mesh, layouts.RULES)
  return jax.tree.map(np.asarray, state)


def reward_train(initial, mesh_shape, *, num_microbatches=1, devices=None):
  mesh, _, model, tx, lr_fn = scored_layout(mesh_shape, devices=devices)
  rules = layouts.RULES
  cfg = model.config
  objective = reward.Reward(model.apply,
                            lambda p, h: heads.project_scores(p, h, cfg), max_pairs=2)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    _, shardings = train_state.state_shardings(model, tx, mesh, rules)
    state = jax.device_put(initial, shardings)
    batch_sharding = partitioning.batch_sharding(mesh, rules)
    batch = {k: jax.device_put(v, batch_sharding) for k, v in dpo.synthetic_pair_batch().items()
             if k in objective.features}
    step = step_lib.jit_train_step(step_lib.make_train_step(objective, tx, lr_fn, num_microbatches=num_microbatches),
                                   shardings, batch_sharding, objective.features)
    history = []
    for _ in range(layouts.STEPS):
      state, metrics = step(state, batch, {})
      history.append((float(metrics["loss"]), float(metrics["grad_norm"])))
      assert float(metrics["tokens"]) == 2 * layouts.BATCH  # pairs
  return np.array(history), jax.tree.map(np.asarray, state.params)


@pytest.mark.slow  # fast subset: the developer loop; CI runs it
def test_reward_step_on_a_layout_equals_one_device():
  initial = scored_initial_state()
  rng = np.random.RandomState(3)  # a non-zero head, so the body's gradients are not zero at step 1
  initial = initial.replace(params={**initial.params, "score_head": rng.normal(0, 0.2, (SMALL.d_model, 1)).astype(
      np.float32)})
  single = reward_train(initial, {"data": 1}, devices=jax.devices()[:1])
  # Parameters within 1e-5 (test_parallelism's 2e-6 is for dense LM gradients): the reward's gradient reaches
  # most token rows through one read position per segment, and AdamW's normalised update turns float noise on a
  # near-zero gradient into ~4e-6; still 300× below the update it checks (learning rate 1e-3 × 3 steps).
  layouts.assert_same_training(reward_train(initial, {"pipeline": 2, "data": 2, "tensor": 2}, num_microbatches=2),
                               single, param_atol=1e-5)


# ----------------------------------------------------------------------------------------------------
# Bad input.


def test_reward_objective_refuses_text_data_and_a_head_mismatch(prefs, corpus, tmp_path):
  with pytest.raises(ValueError, match=r"TrainConfig.recipe='reward' reads a preference DATA_DIR.*format 'text'"):
    experiment_lib.Experiment(run_config(tmp_path / "r", corpus, ""), TINY, OPT)
  exp = experiment_lib.Experiment(run_config(tmp_path / "r", prefs[0], ""), TINY, OPT)
  assert isinstance(exp.model, heads.ScoredGPT) and isinstance(exp.objective, reward.Reward)
  bad = str(tmp_path / "bad")  # a checkpoint with a score head of another width
  params = dpo.host_params(TINY, seed=0)
  params["score_head"] = np.zeros((32, 1), np.float32)
  checkpointing.save_params(bad, params)
  with pytest.raises(ValueError, match=r"score_head: checkpoint \(32, 1\) vs model config \(64, 1\) — "
                                       r"GPTConfig.d_model") as raised:
    exp.check_checkpoint_shapes(bad)
  assert "\n" not in str(raised.value) and bad in str(raised.value)
