"""GRPO on a generated verifiable task: held-out greedy exact match of the SFT model, then along GRPO.

A tiny Llama-shaped model (2 layers, d_model 32) is fine-tuned from random initialisation on "reverse two words"
chat data (t5x_like/data/chat_synth.py) for --sft_steps, then trained with GRPO (exact-match reward, G samples per
prompt, no KL) for --steps; the held-out prompts (the chat DATA_DIR's validation split) are answered greedily every
--eval_every steps. tests/test_grpo.py runs the same recipe for 40 steps.

  python bench/grpo_task.py [--sft_steps 100] [--steps 120] [--group 8] [--prompts 16] [--lr 3e-3]
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
from t5x_like.parallel import partitioning
from t5x_like.recipes import grpo as grpo_recipe
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


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--sft_steps", type=int, default=100)
  parser.add_argument("--steps", type=int, default=120)
  parser.add_argument("--group", type=int, default=8)
  parser.add_argument("--prompts", type=int, default=16)
  parser.add_argument("--lr", type=float, default=3e-3)
  parser.add_argument("--kl", type=float, default=0.0)
  parser.add_argument("--eval_every", type=int, default=20)
  args = parser.parse_args()
  root = tempfile.mkdtemp(prefix="grpo_task_")
  tok = tokenizer_lib.train_tokenizer([" ".join(chat_synth.WORDS) + "\nreverse: value of\n"] * 20,
                                      f"{root}/tok.model", vocab_size=360, num_threads=1)
  train_file, _ = chat_synth.write_synthetic_chat(f"{root}/task", "reverse", 640, 1, min_words=2, max_words=2)
  data_dir = f"{root}/data"
  preprocessing.preprocess([train_file], data_dir, tokenizer=tok.path, data_format="chat", num_train_shards=1,
                           validation_fraction=0.1, progress=False, cache_dir=None)
  base_dir, sft_dir, grpo_dir = f"{root}/base", f"{root}/sft", f"{root}/grpo"
  sft = config_lib.TrainConfig(
      model_dir=sft_dir, data_dir=data_dir, train_steps=args.sft_steps, batch_size=16, seq_len=32, log_every=50,
      eval_every=0, checkpoint_every=args.sft_steps, mesh_shape={"data": -1},
      data=data_lib.DataConfig(eval_batches=0, shuffle_buffer=256),
      checkpoint=checkpointing.CheckpointConfig(async_save=False, warm_start_from=base_dir, warm_start_required=True))
  sft_opt = optimizer_lib.OptimizerConfig(learning_rate=1e-2, warmup_steps=10, decay="constant")
  exp = experiment_lib.Experiment(sft, MODEL, sft_opt)
  checkpointing.save_params(base_dir, random_params(partitioning.unbox(exp.boxed_params), np.random.RandomState(1)))
  trainer.train(sft, MODEL, sft_opt)
  grpo = config_lib.TrainConfig(
      model_dir=grpo_dir, data_dir=data_dir, train_steps=args.steps, batch_size=args.prompts * args.group,
      seq_len=32, log_every=args.eval_every, eval_every=args.eval_every, checkpoint_every=args.steps,
      mesh_shape={"data": -1}, data=data_lib.DataConfig(eval_batches=1, shuffle_buffer=256),
      checkpoint=checkpointing.CheckpointConfig(async_save=False, warm_start_from=sft_dir, warm_start_required=True),
      recipe="grpo", recipe_config=grpo_recipe.GrpoConfig(num_generations=args.group, kl_beta=args.kl, max_new_tokens=6))
  opt = optimizer_lib.OptimizerConfig(learning_rate=args.lr, warmup_steps=10, decay="constant", weight_decay=0.0)
  gexp = experiment_lib.Experiment(grpo, MODEL, opt)
  with gexp.context():
    _, params = checkpointing.restore_params(sft_dir, abstract_params=gexp.abstract_with_shardings().params)
  start = gexp.evaluate(params)
  t0 = time.time()
  trainer.train(grpo, MODEL, opt)
  seconds = time.time() - t0
  print(f"| step | held-out exact match (greedy, {start['eval/prompts']} prompts) | sampled reward (train) | "
        "groups without signal | KL | rollout s | step s |")
  print("|---|---|---|---|---|---|---|")
  print(f"| SFT ({args.sft_steps} steps) | {start['eval/exact_match']:.3f} | | | | | |")
  records = [json.loads(line) for line in open(f"{grpo_dir}/metrics.jsonl")]
  by_step = {}
  for r in records:
    by_step.setdefault(r.get("step"), {}).update(r)
  for step in sorted(s for s in by_step if s):
    r = by_step[step]
    if "eval/exact_match" in r:
      print(f"| GRPO {step} | {r['eval/exact_match']:.3f} | {r.get('reward_mean', float('nan')):.3f} | "
            f"{r.get('groups_without_signal', float('nan')):.2f} | {r.get('kl', float('nan')):.3f} | "
            f"{r.get('rollout_seconds', float('nan')):.3f} | {r.get('step_seconds', float('nan')):.3f} |")
  print(f"GRPO wall time {seconds:.0f} s for {args.steps} steps of {args.prompts} prompts × {args.group} samples")


if __name__ == "__main__":
  main()
