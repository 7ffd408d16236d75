"""GRPO and PPO on a generated verifiable task, from one SFT model with the same sampling budget: held-out greedy
exact match of the SFT model, then along each method.

A tiny Llama-shaped model (2 layers, d_model 32) is fine-tuned from random initialisation on "reverse two words"
chat data (t5x_like/data/chat_synth.py) for --sft_steps (few enough that it answers a minority of the held-out
prompts), then trained from that checkpoint with each method and the exact-match reward:
  GRPO  --steps steps of --prompts prompts × --group samples (one update per rollout, no KL);
  PPO   the same number of sampled completions: rollouts of --prompts × --group, each trained for --ppo_epochs
        epochs × --ppo_minibatches minibatches (so --steps × epochs × minibatches optimizer steps), KL --ppo_kl.
The held-out prompts (the chat DATA_DIR's validation split) are answered greedily every --eval_every rollouts.
tests/test_grpo.py and tests/test_ppo.py run shorter versions of the same recipes.

  python bench/rl_task.py [--sft_steps 80] [--steps 40] [--group 8] [--prompts 16] [--methods grpo,ppo]
"""

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import numpy as np  # pylint: disable=g-import-not-at-top

from t5x_like.data import chat_synth  # pylint: disable=g-import-not-at-top
from t5x_like.data import preprocessing
from t5x_like.data import tokenizer as tokenizer_lib
from t5x_like.model import decoder as model_lib
from t5x_like.model import heads
from t5x_like.parallel import partitioning
from t5x_like.recipes import grpo as grpo_recipe
from t5x_like.recipes import ppo as ppo_recipe
from t5x_like.training import checkpointing
from t5x_like.training import config as config_lib
from t5x_like import data as data_lib
from t5x_like.recipes import experiment as experiment_lib
from t5x_like.training import optimizer as optimizer_lib
from t5x_like.training import trainer

MODEL = model_lib.GPTConfig(num_layers=2, num_heads=2, d_model=32, d_ff=64, max_len=32, dtype="float32",
                            tie_embeddings=False, position_embedding="rope", norm="rmsnorm", mlp_activation="swiglu",
                            use_bias=False)


def random_params(abstract, rng):
  return {k: random_params(v, rng) if isinstance(v, dict) else
          ((k == "scale") + rng.normal(0.0, 0.05, v.shape)).astype(np.float32) for k, v in sorted(abstract.items())}


def prepare(root: str, sft_steps: int):
  """(chat DATA_DIR, SFT MODEL_DIR): the task's data and the SFT model every method starts from."""
  tok = tokenizer_lib.train_tokenizer([" ".join(chat_synth.WORDS) + "\nreverse: value of\n"] * 20,
                                      f"{root}/tok.model", vocab_size=360, num_threads=1)
  train_file, _ = chat_synth.write_synthetic_chat(f"{root}/task", "reverse", 640, 1, min_words=2, max_words=2)
  data_dir = f"{root}/data"
  preprocessing.preprocess([train_file], data_dir, tokenizer=tok.path, data_format="chat", num_train_shards=1,
                           validation_fraction=0.1, progress=False, cache_dir=None)
  return data_dir, sft_run(root, data_dir, sft_steps)


def sft_run(root: str, data_dir: str, steps: int, model=MODEL, checkpoint_every: int = 0) -> str:
  """ROOT/sft: `steps` of SFT (batch 16, SEQ_LEN 32, lr 1e-2) on a chat DATA_DIR from a random base (ROOT/base),
  checkpointed at the end (or every `checkpoint_every` steps, the newest 3 kept)."""
  base_dir, sft_dir = f"{root}/base", f"{root}/sft"
  sft = config_lib.TrainConfig(
      model_dir=sft_dir, data_dir=data_dir, train_steps=steps, batch_size=16, seq_len=32, log_every=50,
      eval_every=0, checkpoint_every=checkpoint_every or steps, mesh_shape={"data": -1},
      data=data_lib.DataConfig(eval_batches=0, shuffle_buffer=256),
      checkpoint=checkpointing.CheckpointConfig(async_save=False, warm_start_from=base_dir, warm_start_required=True))
  sft_opt = optimizer_lib.OptimizerConfig(learning_rate=1e-2, warmup_steps=10, decay="constant")
  exp = experiment_lib.Experiment(sft, model, sft_opt)
  checkpointing.save_params(base_dir, random_params(partitioning.unbox(exp.boxed_params), np.random.RandomState(1)))
  trainer.train(sft, model, sft_opt)
  return sft_dir


def run_method(method: str, args, data_dir: str, sft_dir: str, root: str) -> dict:
  """Trains `method` from the SFT model; returns {'start', 'rows': [(rollout, eval exact match, sampled reward,
  KL, rollout s, update s)], 'seconds', 'steps'}."""
  rows = args.prompts * args.group
  if method == "grpo":
    recipe = grpo_recipe.GrpoConfig(num_generations=args.group, kl_beta=0.0, max_new_tokens=6)
    batch, per_rollout, lr = rows, 1, args.lr
  else:
    recipe = ppo_recipe.PpoConfig(num_generations=1, kl_coef=args.ppo_kl, max_new_tokens=6,
                                  ppo_epochs=args.ppo_epochs, num_minibatches=args.ppo_minibatches,
                                  vf_coef=args.vf_coef)
    batch, per_rollout, lr = rows // args.ppo_minibatches, args.ppo_epochs * args.ppo_minibatches, args.ppo_lr
  steps, every = args.steps * per_rollout, args.eval_every * per_rollout
  model_dir = f"{root}/{method}"
  config = config_lib.TrainConfig(
      model_dir=model_dir, data_dir=data_dir, train_steps=steps, batch_size=batch, seq_len=32, log_every=1,
      eval_every=every, checkpoint_every=steps, mesh_shape={"data": -1},
      data=data_lib.DataConfig(eval_batches=max(1, 128 // batch), shuffle_buffer=256),
      checkpoint=checkpointing.CheckpointConfig(async_save=False, warm_start_from=sft_dir, warm_start_required=True),
      recipe=method, recipe_config=recipe)
  opt = optimizer_lib.OptimizerConfig(learning_rate=lr, warmup_steps=10, decay="constant", weight_decay=0.0)
  exp = experiment_lib.Experiment(config, MODEL, opt)
  with exp.context():
    _, params = checkpointing.restore_params(sft_dir, abstract_params=exp.abstract_with_shardings().params)
  if method == "ppo":
    params = {**params, heads.SCORE_HEAD: np.zeros((MODEL.d_model, 1), np.float32)}
  start = exp.evaluate(params)
  t0 = time.time()
  trainer.train(config, MODEL, opt)
  seconds = time.time() - t0
  by_step = {}
  for line in open(f"{model_dir}/metrics.jsonl"):
    r = json.loads(line)
    by_step.setdefault(r.get("step"), {}).update(r)
  out = []
  for step in sorted(s for s in by_step if s and "eval/exact_match" in by_step[s]):
    first = by_step[step - per_rollout + 1]  # the step that rolled out what this one trained on
    update = np.mean([by_step[s]["step_seconds"] - by_step[s]["rollout_seconds"]
                      for s in range(step - per_rollout + 1, step + 1) if "step_seconds" in by_step[s]])
    out.append((step // per_rollout, by_step[step]["eval/exact_match"], first["reward_mean"],
                first.get("kl", first.get("rollout/kl", 0.0)), first["rollout_seconds"], update))
  return {"start": start, "rows": out, "seconds": seconds, "steps": steps}


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--sft_steps", type=int, default=80)
  parser.add_argument("--steps", type=int, default=40, help="rollouts of each method")
  parser.add_argument("--group", type=int, default=8)
  parser.add_argument("--prompts", type=int, default=16)
  parser.add_argument("--lr", type=float, default=3e-3, help="GRPO's learning rate")
  parser.add_argument("--ppo_lr", type=float, default=1e-3)
  parser.add_argument("--ppo_kl", type=float, default=0.02)
  parser.add_argument("--ppo_epochs", type=int, default=2)
  parser.add_argument("--ppo_minibatches", type=int, default=2)
  parser.add_argument("--vf_coef", type=float, default=0.5)
  parser.add_argument("--eval_every", type=int, default=10, help="rollouts")
  parser.add_argument("--methods", default="grpo,ppo")
  args = parser.parse_args()
  root = tempfile.mkdtemp(prefix="rl_task_")
  data_dir, sft_dir = prepare(root, args.sft_steps)
  for method in args.methods.split(","):
    result = run_method(method, args, data_dir, sft_dir, root)
    print(f"\n{method.upper()}: {args.steps} rollouts of {args.prompts * args.group} completions, "
          f"{result['steps']} optimizer steps, {result['seconds']:.0f} s")
    print(f"| rollout | held-out exact match (greedy, {result['start']['eval/prompts']} prompts) | sampled reward | "
          "KL | rollout s | update s |")
    print("|---|---|---|---|---|---|")
    print(f"| SFT ({args.sft_steps} steps) | {result['start']['eval/exact_match']:.3f} | | | | |")
    for rollout, match, reward, kl, rollout_s, update_s in result["rows"]:
      print(f"| {rollout} | {match:.3f} | {reward:.3f} | {kl:.3f} | {rollout_s:.3f} | {update_s:.3f} |")


if __name__ == "__main__":
  main()
