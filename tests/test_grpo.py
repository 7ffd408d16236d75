"""GRPO: the update against a hand-computed policy-gradient step, group advantages, prompts read from a chat
DATA_DIR, bad input named by key, the mean verifiable reward on held-out prompts raised well above the SFT model's,
and a resumed run repeating the same rollouts and rewards."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests import conftest
from tests.test_finetune import CHAT_MODEL, chat_sft_run, model_params, random_params, reverse_chat_data

from t5x_like.data import chat
from t5x_like.model import decoder as model_lib
from t5x_like.model import heads
from t5x_like.inference import chat_eval
from t5x_like.parallel import partitioning
from t5x_like.training import checkpointing
from t5x_like.training import config as config_lib
from t5x_like.recipes import grpo as grpo_recipe
from t5x_like import data as data_lib
from t5x_like.recipes import experiment as experiment_lib
from t5x_like.training import optimizer as optimizer_lib
from t5x_like.posttrain import rewards
from t5x_like.posttrain import rollout
from t5x_like.training import step as step_lib
from t5x_like.training import trainer
from t5x_like.posttrain import grpo
from t5x_like.training.train_state import TrainState

pytestmark = pytest.mark.run_bound  # tests/conftest.py: 8 s longer at level 0 with the cache warm

# ----------------------------------------------------------------------------------------------------
# The update on a tiny case: a bigram "model" (logits = table[input token]) whose gradient is written by hand.

V, B, L = 5, 4, 3


def bigram_apply(variables, inputs, positions, segment_ids):
  del positions, segment_ids
  return variables["params"]["table"][inputs]  # (B, L, V)


def numpy_logps(table, inputs, targets):
  logits = table[inputs].astype(np.float64)
  logits -= logits.max(-1, keepdims=True)
  log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  return np.take_along_axis(log_probs, targets[..., None], -1)[..., 0], np.exp(log_probs)


def hand_step(table, ref_table, batch, *, eps, beta, lr):
  """(loss, new table) of one SGD step on the GRPO loss, every derivative written out:
  d(−min(ρA, clip(ρ)A))/dlogπ = −ρA where the unclipped side is the min, else 0;
  d(β(e^δ − δ − 1))/dlogπ = β(1 − e^δ) with δ = logπ_ref − logπ; dlogπ(t)/dlogits = onehot(t) − softmax."""
  inputs, targets, w, adv, old = (batch[k] for k in ("inputs", "targets", "weights", "advantages", "old_logps"))
  logp, probs = numpy_logps(table, inputs, targets)
  ref, _ = numpy_logps(ref_table, inputs, targets)
  ratio = np.exp(logp - old)
  unclipped, clipped = ratio * adv, np.clip(ratio, 1 - eps, 1 + eps) * adv
  delta = ref - logp
  per_token = -np.minimum(unclipped, clipped) + beta * (np.exp(delta) - delta - 1)
  n = w.sum()
  dlogp = (np.where(unclipped <= clipped, -ratio * adv, 0.0) + beta * (1 - np.exp(delta))) * w / n
  dlogits = dlogp[..., None] * (np.eye(V)[targets] - probs)
  grad = np.zeros_like(table, dtype=np.float64)
  np.add.at(grad, inputs, dlogits)
  return (per_token * w).sum() / n, table - lr * grad


def test_grpo_step_equals_a_hand_computed_policy_gradient_step():
  rng = np.random.RandomState(0)
  table = rng.normal(0, 1, (V, V)).astype(np.float32)
  ref_table = (table + rng.normal(0, 0.3, (V, V))).astype(np.float32)
  inputs = rng.randint(0, V, (B, L)).astype(np.int32)
  targets = rng.randint(0, V, (B, L)).astype(np.int32)
  logp, _ = numpy_logps(table, inputs, targets)
  # old log-probs off by ±0.5: some ratios leave [0.8, 1.2] (clipped on one side or the other), most do not
  old = (logp + rng.uniform(-0.5, 0.5, (B, L))).astype(np.float32)
  batch = {"inputs": inputs, "targets": targets, "positions": np.zeros((B, L), np.int32),
           "segment_ids": np.ones((B, L), np.int32),
           "weights": np.array([[0, 1, 1], [0, 0, 1], [1, 1, 1], [0, 1, 0]], np.float32),
           "advantages": np.repeat(np.array([1.5, -0.5, -0.5, 0.7], np.float32)[:, None], L, 1), "old_logps": old}
  objective = grpo.Grpo(bigram_apply, clip_epsilon=0.2, beta=0.1)
  step = jax.jit(step_lib.make_train_step(objective, optax.sgd(0.5), lambda s: 0.5))
  state = TrainState(step=jnp.zeros((), jnp.int32), params={"table": jnp.asarray(table)},
                     opt_state=optax.sgd(0.5).init({"table": jnp.asarray(table)}), loss_scale=None)
  new_state, metrics = step(state, batch, {grpo.REFERENCE: {"table": jnp.asarray(ref_table)}})
  loss, expected = hand_step(table, ref_table, batch, eps=0.2, beta=0.1, lr=0.5)
  ratio = np.exp(logp - old)
  assert 0 < float(metrics["clip_fraction"]) < 1 and np.any(np.abs(ratio - 1) > 0.2)  # both branches exercised
  assert float(metrics["loss"]) == pytest.approx(loss, rel=1e-5)
  np.testing.assert_allclose(np.asarray(new_state.params["table"]), expected, rtol=1e-5, atol=1e-6)
  assert float(metrics["tokens"]) == 7  # completion tokens
  # without the reference (β = 0) none is needed, and the step is the clipped policy gradient alone
  no_kl = jax.jit(step_lib.make_train_step(grpo.Grpo(bigram_apply, beta=0.0), optax.sgd(0.5), lambda s: 0.5))
  _, expected = hand_step(table, ref_table, batch, eps=0.2, beta=0.0, lr=0.5)
  np.testing.assert_allclose(np.asarray(no_kl(state, batch, {})[0].params["table"]), expected, rtol=1e-5, atol=1e-6)


def test_group_advantages_and_prompt_schedule():
  values = np.array([1, 0, 0, 0, 1, 1, 1, 1], np.float64)
  adv = rollout.group_advantages(values, 4)
  np.testing.assert_allclose(adv[:4], np.array([0.75, -0.25, -0.25, -0.25]) / (np.std([1, 0, 0, 0], ddof=1) + 1e-4),
                             rtol=1e-6)
  assert np.all(adv[4:] == 0)  # a group whose samples all scored the same carries no signal
  # each epoch visits every prompt once, in a seeded order; the same (seed, step) gives the same prompts
  seen = np.concatenate([rollout.schedule(10, s, 5, seed=3) for s in (1, 2)])
  assert sorted(seen) == list(range(10))
  assert list(rollout.schedule(10, 3, 5, seed=3)) == list(rollout.schedule(10, 3, 5, seed=3))
  assert list(rollout.schedule(10, 3, 5, seed=3)) != list(rollout.schedule(10, 3, 5, seed=4))


def test_built_in_rewards_and_an_unregistered_name():
  config = grpo_recipe.GrpoConfig(reward_format=r"\w+ \w+")
  assert rewards.get("exact_match")([" a b", "a c"], ["a b", "a b"], ["", ""]) == [1.0, 0.0]
  assert rewards.get("format")(["two words", "three words here"], ["", ""], ["", ""], config=config) == [1.0, 0.0]
  with pytest.raises(ValueError, match=r"GrpoConfig.reward='nope' is not a registered reward function "
                                       r"\(registered: .*exact_match, format"):
    rewards.get("nope")


# ----------------------------------------------------------------------------------------------------
# On a generated task: prompts from a chat DATA_DIR, a bad configuration named by key, the held-out reward raised
# above the SFT model's, and a resumed run repeating the same rollouts.

MODEL = CHAT_MODEL
SFT_STEPS, GRPO_STEPS, GROUP = 100, 40, 8


def grpo_config(model_dir, data_dir, sft_dir, **objective):
  return config_lib.TrainConfig(
      model_dir=str(model_dir), data_dir=data_dir, train_steps=GRPO_STEPS, batch_size=16 * GROUP, seq_len=32,
      log_every=5, eval_every=0, checkpoint_every=30, mesh_shape={"data": -1},
      data=data_lib.DataConfig(eval_batches=1, shuffle_buffer=256),
      checkpoint=checkpointing.CheckpointConfig(async_save=False, warm_start_from=sft_dir, warm_start_required=True),
      recipe="grpo", recipe_config=grpo_recipe.GrpoConfig(**{"num_generations": GROUP, "kl_beta": 0.0,
                                                             "max_new_tokens": 6, **objective}))


GRPO_OPT = optimizer_lib.OptimizerConfig(learning_rate=3e-3, warmup_steps=10, decay="constant", weight_decay=0.0)


def evaluate_start(exp, checkpoint: str, **extra) -> dict:
  """`exp`'s own evaluation (the recipe's: greedy answers to the validation prompts) of a checkpoint's parameters
  restored onto its mesh, before any training; `extra` adds parameters the checkpoint lacks (PPO's value head)."""
  with exp.context():
    _, params = checkpointing.restore_params(checkpoint, abstract_params=exp.abstract_with_shardings().params)
    return exp.evaluate({**params, **extra})


def logged(model_dir) -> dict:
  """{step: its training record} of a run's metrics.jsonl."""
  return {r["step"]: r for r in map(json.loads, open(os.path.join(model_dir, "metrics.jsonl"))) if "loss" in r}


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
  """(chat DATA_DIR of 'reverse two words' with a held-out split, the JSON-lines file it was made from, a file of 40
  other conversations with their reference answers); made once per test run (conftest.built_once: this file,
  test_ppo, test_online_dpo and test_rl_resume read it; none writes into it)."""
  return tuple(conftest.built_once(tmp_path_factory, "grpo_data", lambda root: reverse_chat_data(
      root, 640, 40, validation_fraction=0.1)))


@pytest.fixture(scope="module")
def sft(chat_data, tmp_path_factory):
  """(chat DATA_DIR, its source file, an SFT MODEL_DIR, its base MODEL_DIR): SFT_STEPS steps from a random model,
  which then answers about 70% of the held-out prompts exactly (greedy) and half of its samples. Trained once per
  test run (conftest.built_once): the RL tests start from it and never write into it."""
  data_dir, train_file, _ = chat_data

  def build(root):
    base_dir, sft_dir = str(root / "base"), str(root / "sft")
    run, opt = chat_sft_run(sft_dir, data_dir, base_dir, SFT_STEPS)
    checkpointing.save_params(base_dir, model_params(experiment_lib.Experiment(run, MODEL, opt), seed=0))
    trainer.train(run, MODEL, opt)
    return data_dir, train_file, sft_dir, base_dir

  return tuple(conftest.built_once(tmp_path_factory, "grpo_sft", build))


@pytest.mark.slow  # the SFT fixture (100 steps) and two generations of 40 answers
def test_fine_tuning_teaches_a_generated_chat_task_the_base_cannot_do(chat_data, sft):
  """Reverse two words, asked in a chat (t5x_like/data/chat_synth.py): the random base answers none of 40 held-out
  conversations; fine-tuned from it (INITIAL_CHECKPOINT_PATH; the `sft` fixture's SFT_STEPS steps on 576 others, loss
  on the answers only) it answers most exactly. (Here rather than in tests/test_finetune.py, whose data, model and
  SFT run these are, to share the SFT run GRPO starts from; bench/finetune_task.py measures full / LoRA /
  attention-only from a pre-trained base.)"""
  test_file = chat_data[2]
  data_dir, _, sft_dir, base_dir = sft
  run, opt = chat_sft_run(sft_dir, data_dir, base_dir, SFT_STEPS)
  exp = experiment_lib.Experiment(run, MODEL, opt)
  lines = chat_eval.read_chat_lines(test_file, require_reference=True)
  assert len(lines) == 40
  encoder = chat_eval.encoder_for(exp, chat.ChatTemplate())

  def exact_match(params) -> float:
    with exp.context():
      return chat_eval.evaluate(params, encoder, lines, objective=exp.model_objective, config=exp.model_config,
                                batch_size=40, max_new_tokens=6)["generate/exact_match"]

  assert exact_match(checkpointing.restore_params(base_dir)[1]) == 0.0
  with exp.context():
    step, tuned = exp.restore_params(None)
  assert step == SFT_STEPS and exact_match(tuned) >= 0.5


def test_prompts_are_the_conversations_before_their_last_assistant_turn(chat_data, tmp_path):
  (data_dir, train_file, _), sft_dir = chat_data, ""  # nothing is restored to read prompts
  exp = experiment_lib.Experiment(grpo_config(tmp_path, data_dir, sft_dir), MODEL, GRPO_OPT)
  prompts = exp.recipe.rollouts(exp).train
  assert not any(prompts.skipped.values()) and len(prompts.prompts) == exp.manifest["splits"]["train"]["num_documents"]
  encoder = chat_eval.encoder_for(exp, chat.ChatTemplate())
  lines = {tuple(encoder.prompt_ids(line.messages)): line.reference
           for line in chat_eval.read_chat_lines(train_file, require_reference=True)}
  for ids, reference in zip(prompts.prompts, prompts.references):  # exactly what `infer --chat` would prompt
    assert lines[tuple(ids)] == reference
  # a row too short for the answer budget leaves no prompt: named, with the key to change
  with pytest.raises(ValueError, match=r"split 'train' has no usable GRPO prompt .*no_room_for_max_new_tokens"):
    short = experiment_lib.Experiment(grpo_config(tmp_path, data_dir, sft_dir, max_new_tokens=30), MODEL, GRPO_OPT)
    short.recipe.rollouts(short)


def test_an_episode_whose_reward_fails_is_counted_and_dropped_never_trained_on(chat_data, tmp_path):
  """A reward function that raises for one episode (so for its whole batch) or returns NaN for another: it is called
  again one episode at a time, both episodes are dropped (weight 0, no part in their group's advantages) and
  counted; one that raises on every episode is a one-line error."""
  data_dir = chat_data[0]
  refs = {}

  @rewards.register("flaky_for_test")
  def flaky(completions, references, prompts, *, config=None):
    del completions, prompts, config
    if refs["raise"] in references:
      raise RuntimeError("tool timed out")
    return [float("nan") if r == refs["nan"] else 1.0 for r in references]

  exp = experiment_lib.Experiment(grpo_config(tmp_path, data_dir, "", reward="flaky_for_test"), MODEL, GRPO_OPT)
  ro = exp.recipe.rollouts(exp)
  indices = np.array([0, 1, 2, 3])
  refs.update({"raise": ro.train.references[1], "nan": ro.train.references[2]})
  assert len({ro.train.references[i] for i in indices}) == 4
  completions = [ro.train.prompts[i][-3:] for i in indices]
  values = ro.score(ro.train, indices, completions)
  np.testing.assert_array_equal(np.isnan(values), [False, True, True, False])
  episodes = rollout.Episodes(indices, [ro.train.prompts[i] for i in indices], completions, [[-1.0] * 3] * 4, values,
                              0.0)
  assert episodes.metrics()["rollout/dropped_episodes"] == 2 and episodes.metrics()["reward_mean"] == 1.0
  rows = ro.rows_of(episodes, rollout.group_advantages(values, 4))
  np.testing.assert_array_equal(rows["weights"].sum(axis=1) > 0, [True, False, False, True])
  np.testing.assert_array_equal(rollout.group_advantages(np.array([1.0, np.nan, 0.0, 2.0]), 4),
                                rollout.group_advantages(np.array([1.0, 0.0, 2.0]), 3)[[0, 0, 1, 2]] * [1, 0, 1, 1])
  refs["raise"] = None
  refs.update(nan=None)
  with pytest.raises(ValueError, match=r"reward function 'flaky_for_test' raised on every episode: RuntimeError: "
                                       r"tool timed out"):
    refs["raise"] = ro.train.references[0]
    ro.score(ro.train, np.array([0, 0]), completions[:2])


def test_bad_grpo_configurations_are_one_line_errors_naming_the_key(chat_data, corpus, tmp_path):
  (data_dir, _, _), sft_dir = chat_data, ""
  for objective, message in [
      (dict(num_generations=1), r"GrpoConfig.num_generations=1: GRPO compares each sample with the others"),
      (dict(num_generations=3), r"BATCH_SIZE=128 is not a multiple of GrpoConfig.num_generations=3"),
      (dict(reward="nope"), r"GrpoConfig.reward='nope' is not a registered reward function"),
      (dict(max_new_tokens=0), r"GrpoConfig.max_new_tokens=0 must be in \[1, SEQ_LEN=32\]")]:
    with pytest.raises(ValueError, match=message) as raised:
      experiment_lib.Experiment(grpo_config(tmp_path, data_dir, sft_dir, **objective), MODEL, GRPO_OPT)
    assert "\n" not in str(raised.value)
  with pytest.raises(ValueError, match=r"TrainConfig.recipe='grpo' samples answers to the prompts of a chat "
                                       r"DATA_DIR .* has format 'text'"):
    experiment_lib.Experiment(grpo_config(tmp_path, corpus, sft_dir), MODEL, GRPO_OPT)


@pytest.mark.slow  # 100 SFT steps (the fixture), 40 + 10 GRPO steps with rollouts (≈ 60 s on 2 loaded cores)
def test_grpo_raises_the_held_out_reward_and_a_resumed_run_repeats_the_same_rollouts(sft, tmp_path):
  """GRPO from the SFT model with the exact-match reward: the greedy answers to the held-out prompts score well
  above the SFT model's, and so do the training samples; a copy rewound to the step-30 checkpoint and resumed
  samples the same completions (same rewards, lengths) and makes the same updates (same loss), bit for bit."""
  data_dir, _, sft_dir, _ = sft
  config = grpo_config(tmp_path / "grpo", data_dir, sft_dir)
  exp = experiment_lib.Experiment(config, MODEL, GRPO_OPT)
  before = evaluate_start(exp, sft_dir)
  after = trainer.train(config, MODEL, GRPO_OPT)
  print("held-out reward", before["eval/reward_mean"], "→", after["eval/reward_mean"])
  assert before["eval/prompts"] == after["eval/prompts"] == exp.manifest["splits"]["validation"]["num_documents"]
  assert 0.5 <= before["eval/reward_mean"] <= 0.8  # the SFT model is half-way there
  assert after["eval/reward_mean"] >= before["eval/reward_mean"] + 0.08
  assert after["eval/exact_match"] == after["eval/reward_mean"]  # the reward is exact match here
  first = logged(tmp_path / "grpo")
  assert first[GRPO_STEPS]["reward_mean"] >= first[5]["reward_mean"] + 0.1  # the samples improve too
  assert first[GRPO_STEPS]["kl"] == 0.0 and first[GRPO_STEPS]["clip_fraction"] < 0.05
  assert all(r["rollout/logprob_gap"] <= 1e-5 for r in first.values())  # the engine's numbers are the trainer's
  rewound = conftest.rewind(tmp_path / "grpo", tmp_path / "resumed", 30)
  trainer.train(dataclasses.replace(config, model_dir=rewound), MODEL, GRPO_OPT)
  second = logged(rewound)
  assert sorted(second) == [35, 40]
  for step in second:
    for key in ("reward_mean", "reward_std", "response_length", "loss", "grad_norm"):
      assert second[step][key] == first[step][key], (step, key)


@pytest.mark.slow  # the SFT fixture, rollouts and a reward model (≈ 20 s)
def test_a_learned_reward_scores_each_prompt_and_completion_with_the_reward_model(sft, tmp_path):
  """reward='reward_model': the reward of a rollout is the reward model's score head read at the completion's end
  marker, computed here independently from the rollout row the step trains on (RLHF with a learned reward)."""
  data_dir, _, sft_dir, _ = sft
  rm_dir = str(tmp_path / "rm")
  exp = experiment_lib.Experiment(grpo_config(tmp_path / "g", data_dir, sft_dir, reward="reward_model",
                                              reward_checkpoint=rm_dir, temperature=0.0), MODEL, GRPO_OPT)
  rm_exp = experiment_lib.Experiment(grpo_config(tmp_path / "r", data_dir, sft_dir), MODEL, GRPO_OPT)
  rm_config = rm_exp.model_config  # the DATA_DIR's vocabulary filled in
  model = heads.ScoredGPT(rm_config)  # the reward model: the decoder under a score head
  rm_params = random_params(partitioning.unbox(rm_exp.boxed_params_of(model)), seed=3)
  checkpointing.save_params(rm_dir, rm_params)
  with open(os.path.join(rm_dir, "model.gin"), "w") as f:
    f.writelines(f"model.GPTConfig.{name} = {getattr(rm_config, name)!r}\n" for name in (
        "num_layers", "num_heads", "d_model", "d_ff", "max_len", "tie_embeddings", "position_embedding", "norm",
        "mlp_activation", "use_bias", "vocab_size"))
  with exp.context():
    _, params = checkpointing.restore_params(sft_dir, abstract_params=exp.abstract_with_shardings().params)
    batch, host = exp.recipe.rollouts(exp).batch(params, 1)
  rows = {k: np.asarray(v) for k, v in batch.items()}
  end = exp.recipe.rollouts(exp).encoder.marker_ids["end"]
  sequences = []
  # greedy: the G samples of a prompt are one completion, so one row a group is checked (each group's first)
  group_rows = lambda x: x[::GROUP]
  for inputs, targets, weights in zip(*(group_rows(rows[k]) for k in ("inputs", "targets", "weights"))):
    last = int(np.flatnonzero(weights)[-1])  # the position predicting the completion's last token
    tokens = np.append(inputs[:last + 1], targets[last])  # prompt + completion
    sequences.append(tokens if targets[last] == end else np.append(tokens, end))  # one cut by max_new_tokens: + end
  # each prompt + completion alone in its row, right-padded to the longest (one compiled forward pass): causal
  # attention within the row's segment leaves every score at the sequence's own end marker unchanged
  lengths = np.array([len(t) for t in sequences])
  width = int(lengths.max())
  tokens = np.stack([np.pad(t, (0, width - len(t))) for t in sequences]).astype(np.int32)
  positions = np.broadcast_to(np.arange(width, dtype=np.int32), tokens.shape)
  segments = (positions < lengths[:, None]).astype(np.int32)
  scores = jax.jit(lambda p, t, pos, seg: heads.project_scores(
      p, model.apply({"params": p}, t, pos, seg, return_hidden=True), rm_config))(rm_params, tokens, positions, segments)
  expected = [float(x) for x in np.asarray(scores)[np.arange(len(sequences)), lengths - 1]]
  assert host["reward_mean"] == pytest.approx(np.mean(expected), rel=1e-5)  # groups are equal-sized
  assert np.std(expected) > 0  # a random reward model tells the completions apart
