"""PPO: the rollout arithmetic (KL-penalised rewards, GAE, whitening) and the clipped policy + value update against a
hand computation on a bigram model, the step on data×fsdp×tensor and pipeline layouts equal to one device (GRPO's
too), and the recipe end to end on a generated chat task (held-out exact match raised, rollout log-probs equal to
the trainer's, a run resumed inside a rollout cycle repeating the same updates), bad input named in one line."""

import dataclasses
import os
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests import conftest
from tests import test_parallelism as layouts
from tests.test_finetune import CHAT_MODEL as MODEL
from tests.test_grpo import chat_data, sft  # pylint: disable=unused-import  (fixtures)
from tests.test_grpo import evaluate_start, logged, numpy_logps

from t5x_like import data as data_lib
from t5x_like.model import heads
from t5x_like.parallel import partitioning
from t5x_like.posttrain import grpo
from t5x_like.posttrain import ppo
from t5x_like.posttrain import ppo_rollout
from t5x_like.recipes import experiment as experiment_lib
from t5x_like.recipes import ppo as ppo_recipe
from t5x_like.training import checkpointing
from t5x_like.training import config as config_lib
from t5x_like.training import optimizer as optimizer_lib
from t5x_like.training import step as step_lib
from t5x_like.training import train_state
from t5x_like.training import trainer
from t5x_like.training.train_state import TrainState

pytestmark = pytest.mark.run_bound  # tests/conftest.py: 10 s longer at level 0 with the cache warm

# ----------------------------------------------------------------------------------------------------
# The arithmetic on a tiny case: a bigram policy (logits = table[input]) with a value table (V = values[input]).

V, B, L = 5, 4, 6
EPS, EPS_V, VF, KL, GAMMA, LAM = 0.2, 0.2, 0.5, 0.1, 0.9, 0.8


def hand_gae(rewards, values, spans):
  """Advantages and returns by the textbook recursion, one row's span [start, end) at a time."""
  adv, ret = np.zeros_like(rewards), np.zeros_like(rewards)
  for i, (start, end) in enumerate(spans):
    running = 0.0
    for t in reversed(range(start, end)):
      next_value = values[i, t + 1] if t + 1 < end else 0.0
      running = rewards[i, t] + GAMMA * next_value - values[i, t] + GAMMA * LAM * running
      adv[i, t], ret[i, t] = running, running + values[i, t]
  return adv, ret


def rollout_case(seed=0):
  """(policy table, value table, reference table, rollout batch made by posttrain/ppo.py's arithmetic, spans)."""
  rng = np.random.RandomState(seed)
  table = rng.normal(0, 1, (V, V)).astype(np.float32)
  values = rng.normal(0, 1, (V,)).astype(np.float32)
  ref_table = (table + rng.normal(0, 0.3, (V, V))).astype(np.float32)
  inputs = rng.randint(0, V, (B, L)).astype(np.int32)
  targets = rng.randint(0, V, (B, L)).astype(np.int32)
  spans = [(1, 4), (2, 6), (0, 6), (3, 4)]  # each row's completion positions
  weights = np.zeros((B, L), np.float32)
  for i, (start, end) in enumerate(spans):
    weights[i, start:end] = 1
  logp, _ = numpy_logps(table, inputs, targets)
  # the sampling policy off by ±0.5 in log-prob: some ratios leave [0.8, 1.2] on either side, most do not
  old = (logp + rng.uniform(-0.5, 0.5, (B, L))).astype(np.float64)
  ref, _ = numpy_logps(ref_table, inputs, targets)
  old_values = (values[inputs] + rng.uniform(-0.4, 0.4, (B, L))) * weights  # some values leave V_old ± 0.2
  scores = np.array([1.0, -0.5, 0.3, 2.0])
  rewards = ppo.token_rewards(old, ref, weights, scores, KL)
  hand_rewards = np.where(weights > 0, -KL * (old - ref), 0.0)
  for i, (_, end) in enumerate(spans):
    hand_rewards[i, end - 1] += scores[i]
  np.testing.assert_allclose(rewards, hand_rewards, rtol=1e-12)
  adv, ret = ppo.gae(rewards, old_values, weights, GAMMA, LAM)
  hand_adv, hand_ret = hand_gae(hand_rewards, old_values, spans)
  np.testing.assert_allclose(adv, hand_adv, rtol=1e-12, atol=1e-12)
  np.testing.assert_allclose(ret, hand_ret, rtol=1e-12, atol=1e-12)
  kept = hand_adv[weights > 0]
  white = ppo.whiten(adv, weights)
  np.testing.assert_allclose(white[weights > 0], (kept - kept.mean()) / kept.std(), rtol=1e-6)
  assert np.all(white[weights == 0] == 0)
  batch = {"inputs": inputs, "targets": targets, "positions": np.zeros((B, L), np.int32),
           "segment_ids": np.ones((B, L), np.int32), "weights": weights, "old_logps": old.astype(np.float32),
           "old_values": old_values.astype(np.float32), "advantages": white.astype(np.float32),
           "returns": ret.astype(np.float32)}
  return table, values, batch


def hand_step(table, values, batch, lr):
  """(loss, new table, new values, policy clip fraction, value clip fraction) of one SGD step on the PPO loss,
  every derivative written out:
    d(−min(ρA, clip(ρ)A))/dlogπ = −ρA where the unclipped side is the min, else 0; dlogπ(t)/dlogits = onehot − softmax;
    d(½max((V−R)², (Vc−R)²))/dV = V − R where the unclipped error is the larger, else (Vc − R) inside the clip
    range |V − V_old| < ε_v and 0 outside it."""
  inputs, targets, w, adv, old, old_v, ret = (batch[k] for k in ("inputs", "targets", "weights", "advantages",
                                                                  "old_logps", "old_values", "returns"))
  logp, probs = numpy_logps(table, inputs, targets)
  v = values[inputs].astype(np.float64)
  ratio = np.exp(logp - old)
  unclipped, clipped = ratio * adv, np.clip(ratio, 1 - EPS, 1 + EPS) * adv
  v_clipped = old_v + np.clip(v - old_v, -EPS_V, EPS_V)
  err, err_clipped = (v - ret) ** 2, (v_clipped - ret) ** 2
  per_token = -np.minimum(unclipped, clipped) + VF * 0.5 * np.maximum(err, err_clipped)
  n = w.sum()
  dlogp = np.where(unclipped <= clipped, -ratio * adv, 0.0) * w / n
  dv = VF * np.where(err >= err_clipped, v - ret, (v_clipped - ret) * (np.abs(v - old_v) < EPS_V)) * w / n
  grad = np.zeros_like(table, dtype=np.float64)
  np.add.at(grad, inputs, dlogp[..., None] * (np.eye(V)[targets] - probs))
  grad_v = np.zeros_like(values, dtype=np.float64)
  np.add.at(grad_v, inputs, dv)
  fraction = lambda x: (x * w).sum() / n
  return ((per_token * w).sum() / n, table - lr * grad, values - lr * grad_v, fraction(clipped < unclipped),
          fraction(err_clipped > err))


def bigram_forward(params, batch):
  return params["table"][batch["inputs"]], params["values"][batch["inputs"]], {}


def test_ppo_step_equals_a_hand_computed_step_through_gae_and_the_kl_penalty():
  table, values, batch = rollout_case()
  objective = ppo.Ppo(bigram_forward, clip_epsilon=EPS, value_clip=EPS_V, vf_coef=VF)
  params = {"table": jnp.asarray(table), "values": jnp.asarray(values)}
  step = jax.jit(step_lib.make_train_step(objective, optax.sgd(0.5), lambda s: 0.5))
  state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optax.sgd(0.5).init(params),
                     loss_scale=None)
  new_state, metrics = step(state, batch, {})
  loss, expected_table, expected_values, clip, value_clip = hand_step(table, values, batch, lr=0.5)
  assert 0 < clip < 1 and 0 < value_clip < 1  # both branches of both losses are exercised
  assert float(metrics["clip_fraction"]) == pytest.approx(clip) and float(metrics["tokens"]) == 14
  assert float(metrics["value_clip_fraction"]) == pytest.approx(value_clip)
  assert float(metrics["loss"]) == pytest.approx(loss, rel=1e-5)
  np.testing.assert_allclose(np.asarray(new_state.params["table"]), expected_table, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(new_state.params["values"]), expected_values, rtol=1e-5, atol=1e-6)
  logp, probs = numpy_logps(table, batch["inputs"], batch["targets"])
  entropy = -(probs * np.log(probs)).sum(-1)
  w = batch["weights"]
  assert float(metrics["entropy"]) == pytest.approx((entropy * w).sum() / w.sum(), rel=1e-5)
  assert float(metrics["ratio"]) == pytest.approx((np.exp(logp - batch["old_logps"]) * w).sum() / w.sum(), rel=1e-5)


def test_explained_variance():
  w = np.array([[1, 1, 1, 0]], np.float32)
  returns = np.array([[1.0, 2.0, 3.0, 9.0]])
  assert ppo.explained_variance(returns, returns, w) == 1.0
  assert ppo.explained_variance(np.full_like(returns, 2.0), returns, w) == pytest.approx(0.0)
  assert ppo.explained_variance(np.array([[3.0, 2.0, 1.0, 0.0]]), returns, w) == pytest.approx(-3.0)



def test_rollouts_are_kept_while_a_committed_or_in_flight_checkpoint_resumes_into_their_cycle(tmp_path):
  """3 updates per cycle, checkpoints every 4 steps unless said. CI's race: cycle 3 began (step 7) while the step-4
  save (it resumes in cycle 2) was still being written, so cycle 2's rollout must outlive a listing of committed
  checkpoints that does not show step 4 yet."""
  stale = lambda on_disk, committed, cycle, every=4: ppo_rollout.stale_cycles(on_disk, committed, 3, cycle, every)
  assert stale([1, 2, 3], committed=[], cycle=3) == [1]  # the step-4 save in flight: cycle 2 kept
  assert stale([1, 2, 3], committed=[4], cycle=3) == [1]
  assert stale([2, 3, 4], committed=[4, 8], cycle=4) == []  # 2: step 4, 3: step 8, 4: the current cycle
  assert stale([2, 3, 4, 5], committed=[4, 8, 12], cycle=5) == [4]  # 12 ends cycle 4
  assert stale([2, 3, 5, 6], committed=[8, 12], cycle=6) == [2, 5]  # 4 was dropped (keep=N)
  assert stale([3, 5], committed=[12], cycle=3) == [5]  # rolled back past the newest checkpoint: the current stays
  assert stale([1, 2], committed=[], cycle=2, every=0) == [1]  # no checkpoints but the last
  # 4 updates a cycle, checkpoints every 10 (the PPO learning test below), cycle 10 begins at step 37: the step-30
  # save may be in flight (8); 9 holds no checkpoint, and none can land in it any more
  assert ppo_rollout.stale_cycles([3, 8, 9, 10], [10, 20, 30], 4, 10, 10) == [9]
  assert ppo_rollout.stale_cycles([3, 8, 9, 10], [10, 20], 4, 10, 10) == [9]
  # PpoRollouts._save applies it with the run's own settings (CI's case: nothing committed yet as cycle 3 begins),
  # and _load reads the rollout back
  rollouts = object.__new__(ppo_rollout.PpoRollouts)  # the saving and loading only: no model, no engine
  rollouts.exp = types.SimpleNamespace(config=types.SimpleNamespace(model_dir=str(tmp_path), checkpoint_every=4))
  rollouts.updates, rollouts.metrics = 3, {"reward_mean": 0.5}
  for cycle in (1, 2, 3):
    rollouts.data = {"advantages": np.full((2, 3), cycle, np.float32)}
    rollouts._save(cycle)  # pylint: disable=protected-access
  assert sorted(os.listdir(tmp_path / ppo_rollout.ROLLOUT_DIR)) == ["2.npz", "3.npz"]
  rollouts._load(2, 5)  # pylint: disable=protected-access
  assert rollouts.cycle == 2 and rollouts.metrics == {"reward_mean": 0.5}
  np.testing.assert_array_equal(rollouts.data["advantages"], np.full((2, 3), 2, np.float32))


# ----------------------------------------------------------------------------------------------------
# The step on sharded layouts: the policy with its value head (ScoredGPT) on packed rows of rollout features.


def layout_batch(seed=3):
  rng = np.random.RandomState(seed)
  batch = layouts.synthetic_batch(seed)
  shape = batch["weights"].shape
  batch.update(old_logps=rng.uniform(-5.0, -3.0, shape).astype(np.float32),
               old_values=rng.normal(0, 0.1, shape).astype(np.float32),
               advantages=rng.normal(0, 1, shape).astype(np.float32),
               returns=rng.normal(0, 1, shape).astype(np.float32))
  return batch


def train_on_layout(method, initial, mesh_shape, *, reference=None, num_microbatches=1, devices=None):
  """(losses, gradient norms and a method metric per step; final parameters) of 3 steps of `method` ('ppo': the
  policy with its value head; 'grpo': the plain decoder against a frozen `reference`) on one rollout batch."""
  mesh, cfg, model, tx, lr_fn = layouts.make_layout(mesh_shape, devices=devices)
  if method == "ppo":
    model = heads.ScoredGPT(cfg)
    objective, metric = ppo.Ppo(ppo.value_head_forward(model.apply, cfg), vf_coef=0.5), "value_loss"
  else:
    objective, metric = grpo.Grpo(model.apply, clip_epsilon=0.2, beta=0.1), "kl"
  with jax.set_mesh(mesh), nn.logical_axis_rules(layouts.RULES):
    _, shardings = train_state.state_shardings(model, tx, mesh, layouts.RULES)
    state = jax.device_put(initial, shardings)
    frozen_shardings = {grpo.REFERENCE: shardings.params} if reference is not None else {}
    frozen = {k: jax.device_put(reference, v) for k, v in frozen_shardings.items()}
    batch_sharding = partitioning.batch_sharding(mesh, layouts.RULES)
    batch = {k: jax.device_put(v, batch_sharding) for k, v in layout_batch().items() if k in objective.features}
    step = step_lib.jit_train_step(step_lib.make_train_step(objective, tx, lr_fn, num_microbatches=num_microbatches),
                                   shardings, batch_sharding, objective.features, frozen_shardings)
    history = []
    for _ in range(layouts.STEPS):
      state, metrics = step(state, batch, frozen)
      history.append((float(metrics["loss"]), float(metrics["grad_norm"]), float(metrics[metric])))
  return np.array(history), jax.tree.map(np.asarray, state.params)


@pytest.fixture(scope="module")
def layout_runs():
  """{method: (initial state, frozen reference or None, its one-device run)}, each made on first use."""
  return {}


def initial_of(method):
  """(initial host state, reference): PPO's policy with a non-zero value head; GRPO's plain decoder and a reference
  near it."""
  if method == "grpo":
    initial = layouts.host_initial_state()
    rng = np.random.RandomState(2)
    return initial, jax.tree.map(lambda x: (x + rng.normal(0.0, 0.02, x.shape)).astype(x.dtype), initial.params)
  mesh, cfg, _, tx, _ = layouts.make_layout({"data": 1}, devices=jax.devices()[:1])
  with jax.set_mesh(mesh), nn.logical_axis_rules(layouts.RULES):
    state, _ = train_state.init_state(heads.ScoredGPT(cfg), tx, jax.random.key(0), mesh, layouts.RULES)
  state = jax.tree.map(np.asarray, state)
  head = np.random.RandomState(1).normal(0, 0.05, state.params[heads.SCORE_HEAD].shape).astype(np.float32)
  return state.replace(params={**state.params, heads.SCORE_HEAD: head}), None


@pytest.mark.slow  # ≈ 15-25 s each on 2 loaded cores
@pytest.mark.parametrize("method", ["ppo", "grpo"])
@pytest.mark.parametrize("mesh_shape, microbatches", [({"data": 2, "fsdp": 2, "tensor": 2}, 2),
                                                      ({"pipeline": 2, "data": 2, "tensor": 2}, 1)])
def test_step_on_a_layout_equals_one_device(method, mesh_shape, microbatches, layout_runs):
  """PPO's step (the value head included) and GRPO's (against its frozen reference; tests/test_grpo.py checks it by
  hand) on data×fsdp×tensor with 2 accumulation microbatches and on a pipeline layout, against one device."""
  if method not in layout_runs:
    initial, reference = initial_of(method)
    layout_runs[method] = (initial, reference, train_on_layout(method, initial, {"data": 1}, reference=reference,
                                                               devices=jax.devices()[:1]))
  initial, reference, single = layout_runs[method]
  result = train_on_layout(method, initial, mesh_shape, reference=reference, num_microbatches=microbatches)
  layouts.assert_same_training(result, single)
  if method == "ppo":
    assert result[0][-1, 2] < result[0][0, 2]  # the value head learns too


# ----------------------------------------------------------------------------------------------------
# The recipe end to end on the generated chat task (test_grpo's data and SFT model).

PPO_STEPS, BATCH = 40, 64
PPO_OPT = optimizer_lib.OptimizerConfig(learning_rate=1e-3, warmup_steps=4, decay="constant", weight_decay=0.0)


def ppo_config(model_dir, data_dir, sft_dir, **recipe):
  return config_lib.TrainConfig(
      model_dir=str(model_dir), data_dir=data_dir, train_steps=PPO_STEPS, batch_size=BATCH, seq_len=32,
      log_every=1, eval_every=0, checkpoint_every=10, mesh_shape={"data": -1},
      data=data_lib.DataConfig(eval_batches=2, shuffle_buffer=256),
      checkpoint=checkpointing.CheckpointConfig(async_save=False, warm_start_from=sft_dir, warm_start_required=True,
                                                keep=5),
      recipe="ppo", recipe_config=ppo_recipe.PpoConfig(**{"max_new_tokens": 6, "kl_coef": 0.02, "ppo_epochs": 2,
                                                         "num_minibatches": 2, "vf_coef": 0.5, **recipe}))


@pytest.mark.slow  # the SFT fixture (100 steps), 40 + 30 PPO steps with 10 + 8 rollouts (≈ 30 s on 2 cores)
def test_ppo_raises_held_out_exact_match_with_trainer_equal_logprobs_and_resumes_inside_a_cycle(sft, tmp_path):
  """PPO from the SFT model with the exact-match reward (2 epochs × 2 minibatches of 64 per rollout of 128): the
  greedy answers to the held-out prompts improve (measured 0.74 → 0.84) and so do the samples; every rollout's
  sampled log-probs equal the trainer's within 1e-5 in float32 (measured up to 4.3e-6: the engine's KV cache
  computes over other shapes) and the first update of each rollout has ratio exactly 1 (its old log-probs are
  the trainer's own); a copy rewound to the step-10 checkpoint (inside the cycle of steps 9-12) reads that
  cycle's rollout back and repeats the same updates bit for bit."""
  data_dir, _, sft_dir, _ = sft
  config = ppo_config(tmp_path / "ppo", data_dir, sft_dir)
  exp = experiment_lib.Experiment(config, MODEL, PPO_OPT)
  before = evaluate_start(exp, sft_dir, **{heads.SCORE_HEAD: jnp.zeros((MODEL.d_model, 1))})
  after = trainer.train(config, MODEL, PPO_OPT)
  print("held-out exact match", before["eval/exact_match"], "→", after["eval/exact_match"])
  assert after["eval/exact_match"] >= before["eval/exact_match"] + 0.07
  first = logged(tmp_path / "ppo")
  sampled = [first[step]["reward_mean"] for step in range(1, PPO_STEPS + 1, 4)]  # one per rollout
  assert np.mean(sampled[-2:]) >= np.mean(sampled[:2]) + 0.05  # measured 0.49 → 0.59
  assert sorted(first) == list(range(1, PPO_STEPS + 1))
  for step, record in first.items():
    assert record["rollout/logprob_gap"] <= 1e-5, step
    assert (record["rollout_seconds"] > 0) == (step % 4 == 1)  # a rollout every 4 updates
    if step % 4 == 1:
      assert record["ratio"] == 1.0 and record["clip_fraction"] == 0.0 and record["approx_kl"] == 0.0
  # rollout files are kept only for cycles a checkpoint lies inside (10: cycle 3, 30: cycle 8) and the newest (10)
  assert sorted(os.listdir(tmp_path / "ppo" / ppo_rollout.ROLLOUT_DIR)) == ["10.npz", "3.npz", "8.npz"]
  rewound = conftest.rewind(tmp_path / "ppo", tmp_path / "resumed", 10)
  trainer.train(dataclasses.replace(config, model_dir=rewound), MODEL, PPO_OPT)
  second = logged(rewound)
  assert sorted(second) == list(range(11, PPO_STEPS + 1))
  for step in second:
    for key in ("loss", "grad_norm", "value_loss", "reward_mean", "response_length", "rollout/kl"):
      assert second[step][key] == first[step][key], (step, key)
  # without the cycle's rollout file a run cannot resume inside it: one line naming the file and the steps
  os.remove(os.path.join(rewound, ppo_rollout.ROLLOUT_DIR, "3.npz"))
  again = conftest.rewind(rewound, tmp_path / "again", 10)
  with pytest.raises(ValueError, match=r"3.npz is missing: the run resumes at step 11, inside PPO cycle 3 "
                                       r"\(steps 9..12\)"):
    trainer.train(dataclasses.replace(config, model_dir=again), MODEL, PPO_OPT)


@pytest.mark.slow
def test_ppo_bad_input_is_one_line(sft, corpus, tmp_path):
  data_dir, _, sft_dir, _ = sft
  for recipe, message in [
      (dict(ppo_epochs=0), r"PpoConfig.ppo_epochs=0 must be >= 1"),
      (dict(lam=1.5), r"PpoConfig.lam=1.5 must be in \[0, 1\]"),
      (dict(reward="nope"), r"PpoConfig.reward='nope' is not a registered reward function"),
      (dict(max_new_tokens=40), r"PpoConfig.max_new_tokens=40 must be in \[1, SEQ_LEN=32\]")]:
    with pytest.raises(ValueError, match=message) as raised:
      experiment_lib.Experiment(ppo_config(tmp_path, data_dir, sft_dir, **recipe), MODEL, PPO_OPT)
    assert "\n" not in str(raised.value)
  with pytest.raises(ValueError, match=r"TrainConfig.recipe='ppo' samples answers to the prompts of a chat DATA_DIR"):
    experiment_lib.Experiment(ppo_config(tmp_path, corpus, sft_dir), MODEL, PPO_OPT)
  # the critic: a reward model's score head starts the value head; one that does not fit the policy is one line
  head = np.random.RandomState(4).normal(0, 0.1, (MODEL.d_model, 1)).astype(np.float32)
  _, sft_params = checkpointing.restore_params(sft_dir)
  checkpointing.save_params(str(tmp_path / "rm"), {**sft_params, heads.SCORE_HEAD: head})
  exp = experiment_lib.Experiment(ppo_config(tmp_path / "p", data_dir, sft_dir, critic_checkpoint=str(tmp_path / "rm")),
                                  MODEL, PPO_OPT)
  state = exp.fresh_state(sft_dir)
  np.testing.assert_array_equal(np.asarray(state.params[heads.SCORE_HEAD]), head)
  np.testing.assert_array_equal(np.asarray(state.params["lm_head"]["kernel"]), sft_params["lm_head"]["kernel"])
  checkpointing.save_params(str(tmp_path / "wide"), {heads.SCORE_HEAD: np.zeros((64, 1), np.float32)})
  for path, message in [(tmp_path / "wide", r"its score_head has shape \(64, 1\), the policy's value head \(32, 1\) "
                                             r"\(GPTConfig.d_model=32\): the critic does not fit the policy"),
                        (sft_dir, r"has no 'score_head' \(not a reward model")]:
    with pytest.raises(ValueError, match=message) as raised:
      experiment_lib.Experiment(ppo_config(tmp_path / "q", data_dir, sft_dir, critic_checkpoint=str(path)),
                                MODEL, PPO_OPT)
    assert "\n" not in str(raised.value)
