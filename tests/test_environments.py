"""Multi-turn rollouts with a tool: the calculator environment, episodes played token in / token out with the
environment's turns at loss weight 0, turn and token limits, a failing environment, and GRPO learning to use the
tool on a generated task (held-out reward raised, the engine's log-probs of every policy token the trainer's)."""

import dataclasses
import json
import os
import sys

import numpy as np
import pytest

from tests.test_grpo import evaluate_start

from t5x_like.data import chat
from t5x_like.data import tokenizer as tokenizer_lib
from t5x_like.posttrain import environments
from t5x_like.posttrain import rollout
from t5x_like.recipes import experiment as experiment_lib
from t5x_like.training import checkpointing
from t5x_like.training import optimizer as optimizer_lib
from t5x_like.training import trainer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import tool_task  # pylint: disable=g-import-not-at-top,wrong-import-position  (bench/tool_task.py: the task's recipe)

# Not run_bound (tests/conftest.py): the calculator test's GRPO start (0.30–0.70) and its +0.1 were measured at
# optimisation level 0; at the default level the same recipe gained +0.02 from a start of 0.47 (2-core AVX2 EPYC, 5 Dec
# 2026)


def test_the_calculator_answers_tool_calls_and_rewards_a_right_answer_after_a_right_call():
  calc = environments.get("calculator")
  question = [("user", "12 * 34")]
  assert calc(question + [("assistant", "calc 12 * 34")], "408") == environments.EnvReply(message="= 408")
  assert calc(question + [("assistant", "calc 12 ** 34")], "408").message == "= error"  # only + − ×
  assert calc(question + [("assistant", "calc __import__('os')")], "408").message == "= error"
  called = question + [("assistant", "calc 12 * 34"), ("user", "= 408")]
  assert calc(called + [("assistant", "408")], "408") == environments.EnvReply(done=True, reward=1.0)
  assert calc(called + [("assistant", "407")], "408").reward == 0.0  # a wrong answer
  assert calc(question + [("assistant", "408")], "408") == environments.EnvReply(done=True, reward=0.0)  # no tool
  wrong_call = question + [("assistant", "calc 12 * 33"), ("user", "= 396")]
  assert calc(wrong_call + [("assistant", "408")], "408").reward == 0.0
  assert environments.evaluate("(2 + 3) * -4") == -20 and environments.evaluate("2 / 3") is None
  with pytest.raises(ValueError, match=r"GrpoConfig.environment='nope' is not a registered environment "
                                       r"\(registered: .*calculator"):
    environments.get("nope")


class ScriptedRollouts:
  """What `play` reads of rollout.Rollouts, with the policy's turns scripted as text (encoded to tokens here)."""

  def __init__(self, encoder, prompts, references, script, seq_len=48, max_len=64):
    self.encoder, self.script, self.calls = encoder, script, []
    self.objective_config = type("Config", (), {"max_new_tokens": 12})()
    self.exp = type("Exp", (), {"config": type("C", (), {"seq_len": seq_len})(),
                                "model_config": type("M", (), {"max_len": max_len})()})()
    self.prompt_set = rollout.PromptSet([encoder.prompt_ids([("user", p)]) for p in prompts], list(references),
                                        list(prompts), {})

  def sample(self, params, prompts, *, n, seed, temperature, top_k, max_tokens):
    del params, n, temperature, top_k
    self.calls.append((seed, [len(p) for p in prompts], max_tokens))
    out = []
    for prompt, budget in zip(prompts, max_tokens):
      turn = sum(1 for t in prompt if t == self.encoder.marker_ids["assistant"]) - 1
      index = next(i for i, p in enumerate(self.prompt_set.prompts) if prompt[:len(p)] == p)
      text = self.script[index][turn] if turn < len(self.script[index]) else "calc 1 + 1"
      tokens = (list(self.encoder.tokenizer.encode(text)) + [self.encoder.marker_ids["end"]])[:budget]
      out.append(tokens)
    return out, [[-0.5] * len(t) for t in out]


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
  texts = [" ".join(m["content"] for m in line["messages"]) for line in environments.calculator_examples(300)]
  tok = tokenizer_lib.train_tokenizer(texts, str(tmp_path_factory.mktemp("tok") / "tok.model"), vocab_size=320,
                                      num_threads=1)
  return chat.ChatEncoder(tokenizer_lib.load(tok.path))


def test_episodes_keep_the_policys_tokens_weigh_the_environment_zero_and_cut_at_the_limits(encoder):
  """Four episodes: a right one (tool, then the answer), one answering without the tool, one that never stops
  calling the tool (cut at max_turns, counted), and one whose environment raises (dropped)."""
  script = [["calc 12 * 34", "408"], ["99"], ["calc 1 + 1"] * 9, ["boom"]]

  def env(messages, reference):
    if messages[-1][1] == "boom":
      raise RuntimeError("the tool crashed")
    return environments.calculator(messages, reference)

  ro = ScriptedRollouts(encoder, ["12 * 34", "50 + 49", "1 + 1", "2 + 2"], ["408", "99", "2", "4"], script)
  episodes = environments.play(ro, None, ro.prompt_set, np.arange(4), environment=env, seed=7, max_turns=3,
                               temperature=1.0, top_k=0)
  np.testing.assert_array_equal(episodes.rewards[:3], [1.0, 0.0, 0.0])
  assert np.isnan(episodes.rewards[3]) and episodes.metrics()["rollout/dropped_episodes"] == 1
  assert episodes.extra == {"episodes_cut": 1.0, "turns": 1.75, "tool_calls": 1.0}
  # episode 0: the policy's tokens exactly as sampled, the environment's reply rendered between them
  call = list(encoder.tokenizer.encode("calc 12 * 34")) + [encoder.marker_ids["end"]]
  answer = list(encoder.tokenizer.encode("408")) + [encoder.marker_ids["end"]]
  reply = encoder.next_turn_ids("user", "= 408")
  assert episodes.completions[0] == call + reply + answer
  assert episodes.masks[0] == [1] * len(call) + [0] * len(reply) + [1] * len(answer)
  assert len(episodes.logprobs[0]) == len(call) + len(answer)
  assert encoder.turns_of(episodes.prompts[0] + episodes.completions[0]) == [
      ("user", "12 * 34"), ("assistant", "calc 12 * 34"), ("user", "= 408"), ("assistant", "408")]
  assert [s for s, _, _ in ro.calls] == [rollout.step_seed(7, t) for t in range(3)]  # a seed per turn
  assert len(ro.calls[1][1]) == 2  # turn 2: only the episodes still going (0 and 2)
  # a row's loss weights: the policy's tokens only
  rows_of = rollout.Rollouts.rows_of
  holder = type("R", (), {"exp": ro.exp, "encoder": encoder})()
  rows = rows_of(holder, episodes, np.zeros(4, np.float32))
  first = len(episodes.prompts[0]) - 1
  np.testing.assert_array_equal(rows["weights"][0, first:first + len(episodes.masks[0])], episodes.masks[0])
  assert rows["weights"][3].sum() == 0  # dropped
  # the token budget: an episode whose next turn would pass it is cut (and counted) before it overflows
  short = ScriptedRollouts(encoder, ["12 * 34"], ["408"], [["calc 12 * 34", "408"]], seq_len=14, max_len=64)
  cut = environments.play(short, None, short.prompt_set, np.arange(1), environment=environments.calculator, seed=0,
                          max_turns=3, temperature=1.0, top_k=0)
  assert cut.extra["episodes_cut"] == 1 and cut.rewards[0] == 0.0
  assert len(cut.prompts[0]) + len(cut.completions[0]) <= 15


SFT_STEPS, SFT_EVERY, STEPS = 300, 50, 20  # the SFT keeps its newest 3 checkpoints: 200, 250, 300


@pytest.mark.slow  # 300 SFT steps and 20 GRPO steps of 128 two-turn episodes (≈ 45 s on 2 cores)
def test_grpo_with_the_calculator_learns_to_call_the_tool_and_answer(tmp_path):
  """bench/tool_task.py's recipe, shorter: from an SFT model that gets 30-70% of the held-out questions right
  (tool call and answer), 20 GRPO steps raise it, and the samples' reward with it; every policy token's engine
  log-prob equals the trainer's to 1e-4 (the environment's tokens, weight 0, are not compared), and episodes are
  rarely cut at the turn limit. The start is whichever of the SFT's last three checkpoints (steps 200, 250, 300)
  answers least, from 30% to 70%: where SFT lands depends on the CPU's float rounding (200, 250, 300 steps: 0.44,
  0.76, 0.87 on an AVX2 EPYC; 0.58, 0.69, 0.71 on an AVX-512 Zen 4 one), a start near 1.0 leaves GRPO nothing to
  show, and from 0.69 its 20 steps reached only 0.76 on 45 held-out questions (the newest in range was the start
  until 6 Dec 2026)."""
  root = str(tmp_path)
  sft_data, rl_data = tool_task.prepare(root)
  sft_dir = tool_task.sft_run(root, sft_data, SFT_STEPS, checkpoint_every=SFT_EVERY)
  config = tool_task.grpo_config(f"{root}/grpo", rl_data, sft_dir, steps=STEPS, prompts=16, group=8, eval_every=0)
  opt = optimizer_lib.OptimizerConfig(learning_rate=3e-3, warmup_steps=5, decay="constant", weight_decay=0.0)
  exp = experiment_lib.Experiment(config, tool_task.MODEL, opt)
  kept = {step: checkpointing.step_dir(sft_dir, step)[1] for step in checkpointing.committed_steps(sft_dir)}
  assert sorted(kept) == [200, 250, 300]
  starts = {step: evaluate_start(exp, path) for step, path in kept.items()}
  step = min((s for s, r in starts.items() if 0.3 <= r["eval/reward_mean"] <= 0.7), default=None,
             key=lambda s: starts[s]["eval/reward_mean"])
  assert step is not None, {s: r["eval/reward_mean"] for s, r in starts.items()}
  before = starts[step]
  config = dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, warm_start_from=kept[step]))
  after = trainer.train(config, tool_task.MODEL, opt)
  print("SFT step", step, {k: (round(before[k], 3), round(after[k], 3)) for k in before})
  # GRPO started where `before` was measured, not from the SFT run's newest checkpoint
  last = checkpointing.step_dir(f"{root}/grpo")[1]
  assert checkpointing.read_metadata(last)["initial_checkpoint"] == kept[step]
  assert after["eval/reward_mean"] >= before["eval/reward_mean"] + 0.1  # measured 0.58 → 0.71 (AVX-512 Zen 4)
  steps = [json.loads(line) for line in open(f"{root}/grpo/metrics.jsonl")]
  steps = [r for r in steps if "loss" in r]
  assert len(steps) == STEPS
  assert all(r["rollout/logprob_gap"] <= 1e-4 for r in steps)  # measured ≤ 2.8e-5 over 60 steps
  # tool calls per episode, 128 sampled episodes a step: mean 0.97, lowest step 0.89 from the Zen 4 start of 0.58
  calls = [r["tool_calls"] for r in steps]
  assert np.mean(calls) >= 0.9 and min(calls) >= 0.8, calls
  # of 128 episodes a step: ≤ 2 in every step from the AVX-512 start of 0.71; 0-7 (mean 0.7) from the AVX2 one of 0.44
  assert np.mean([r["episodes_cut"] for r in steps]) <= 2
  sampled = [r["reward_mean"] for r in steps]
  assert np.mean(sampled[-5:]) >= np.mean(sampled[:5]) + 0.1  # measured 0.28 → 0.41 (Zen 4)
