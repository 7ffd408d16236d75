"""Multi-turn RL with a tool: GRPO against the calculator environment (t5x_like/posttrain/environments.py).

The task: a question "a op b" (a, b in 10..99, op + or *). The policy must call the tool ("calc a op b"), read its
answer ("= value", a user turn), and answer with the value; the reward is 1 when it did both right. A tiny
Llama-shaped model (2 layers, d_model 32) is fine-tuned from random initialisation on --sft_steps of
demonstrations, then trained with GRPO (--group samples per question, no KL) for --steps; every --eval_every steps
the held-out questions are played greedily. Prints the curve: held-out reward (the fraction of episodes that call
the tool correctly and answer right), tool calls and turns per episode, episodes cut at the turn limit.
tests/test_environments.py runs a shorter version.

  python bench/tool_task.py [--sft_steps 300] [--steps 60] [--group 8] [--prompts 16]
"""

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import numpy as np  # pylint: disable=g-import-not-at-top

import rl_task  # pylint: disable=g-import-not-at-top  (bench/rl_task.py: the SFT both tasks start from)
from t5x_like import data as data_lib
from t5x_like.data import preprocessing
from t5x_like.data import tokenizer as tokenizer_lib
from t5x_like.model import decoder as model_lib
from t5x_like.posttrain import environments
from t5x_like.recipes import experiment as experiment_lib
from t5x_like.recipes import grpo as grpo_recipe
from t5x_like.training import checkpointing
from t5x_like.training import config as config_lib
from t5x_like.training import optimizer as optimizer_lib
from t5x_like.training import trainer

MODEL = model_lib.GPTConfig(num_layers=2, num_heads=2, d_model=32, d_ff=64, max_len=32, dtype="float32",
                            tie_embeddings=False, position_embedding="rope", norm="rmsnorm", mlp_activation="swiglu",
                            use_bias=False)


def write_lines(path: str, lines) -> str:
  with open(path, "w") as f:
    f.writelines(json.dumps(line) + "\n" for line in lines)
  return path


def prepare(root: str, num_sft: int = 2000, num_prompts: int = 600):
  """(SFT chat DATA_DIR of demonstrations, chat DATA_DIR of questions and answers with a validation split)."""
  sft = environments.calculator_examples(num_sft, seed=1)
  texts = [" ".join(m["content"] for m in line["messages"]) for line in sft]
  tok = tokenizer_lib.train_tokenizer(texts, f"{root}/tok.model", vocab_size=320, num_threads=1)
  sft_dir, rl_dir = f"{root}/sft_data", f"{root}/rl_data"
  preprocessing.preprocess([write_lines(f"{root}/sft.jsonl", sft)], sft_dir, tokenizer=tok.path, data_format="chat",
                           num_train_shards=1, validation_fraction=0.0, progress=False, cache_dir=None)
  questions = environments.calculator_examples(num_prompts, seed=2, tool_turns=False)
  preprocessing.preprocess([write_lines(f"{root}/rl.jsonl", questions)], rl_dir, tokenizer=tok.path,
                           data_format="chat", num_train_shards=1, validation_fraction=0.1, progress=False,
                           cache_dir=None)
  return sft_dir, rl_dir


def sft_run(root: str, data_dir: str, steps: int, checkpoint_every: int = 0) -> str:
  """ROOT/sft: bench/rl_task.py's SFT of this task's MODEL from a random base."""
  return rl_task.sft_run(root, data_dir, steps, MODEL, checkpoint_every)


def grpo_config(model_dir: str, data_dir: str, sft_dir: str, *, steps: int, prompts: int, group: int,
                eval_every: int) -> config_lib.TrainConfig:
  return config_lib.TrainConfig(
      model_dir=model_dir, data_dir=data_dir, train_steps=steps, batch_size=prompts * group, seq_len=32,
      log_every=1, eval_every=eval_every, checkpoint_every=steps, mesh_shape={"data": -1},
      data=data_lib.DataConfig(eval_batches=1, shuffle_buffer=256),
      checkpoint=checkpointing.CheckpointConfig(async_save=False, warm_start_from=sft_dir, warm_start_required=True),
      recipe="grpo", recipe_config=grpo_recipe.GrpoConfig(num_generations=group, kl_beta=0.0, max_new_tokens=10,
                                                          environment="calculator", max_turns=3))


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--sft_steps", type=int, default=300)
  parser.add_argument("--steps", type=int, default=60)
  parser.add_argument("--group", type=int, default=8)
  parser.add_argument("--prompts", type=int, default=16)
  parser.add_argument("--lr", type=float, default=3e-3)
  parser.add_argument("--eval_every", type=int, default=10)
  args = parser.parse_args()
  root = tempfile.mkdtemp(prefix="tool_task_")
  sft_data, rl_data = prepare(root)
  sft_dir = sft_run(root, sft_data, args.sft_steps)
  config = grpo_config(f"{root}/grpo", rl_data, sft_dir, steps=args.steps, prompts=args.prompts, group=args.group,
                       eval_every=args.eval_every)
  opt = optimizer_lib.OptimizerConfig(learning_rate=args.lr, warmup_steps=5, decay="constant", weight_decay=0.0)
  exp = experiment_lib.Experiment(config, MODEL, opt)
  with exp.context():
    _, params = checkpointing.restore_params(sft_dir, abstract_params=exp.abstract_with_shardings().params)
  start = exp.evaluate(params)
  trainer.train(config, MODEL, opt)
  by_step = {}
  for line in open(f"{root}/grpo/metrics.jsonl"):
    r = json.loads(line)
    by_step.setdefault(r.get("step"), {}).update(r)
  print(f"| step | held-out reward (greedy, {start['eval/prompts']} questions) | tool calls | turns | cut | "
        f"sampled reward (mean of the last {args.eval_every} steps) | log-prob gap (largest) |")
  print("|---|---|---|---|---|---|---|")
  print(f"| SFT ({args.sft_steps} steps) | {start['eval/reward_mean']:.3f} | {start['eval/tool_calls']:.2f} | "
        f"{start['eval/turns']:.2f} | {start['eval/episodes_cut']:.0f} | | |")
  for step in sorted(s for s in by_step if s and "eval/reward_mean" in by_step[s]):
    r = by_step[step]
    window = [by_step[s] for s in range(max(1, step - args.eval_every + 1), step + 1)]
    print(f"| GRPO {step} | {r['eval/reward_mean']:.3f} | {r['eval/tool_calls']:.2f} | {r['eval/turns']:.2f} | "
          f"{r['eval/episodes_cut']:.0f} | {np.mean([w['reward_mean'] for w in window]):.3f} | "
          f"{max(w['rollout/logprob_gap'] for w in window):.1e} |")


if __name__ == "__main__":
  main()
