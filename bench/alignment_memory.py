"""Step time and frozen-model bytes per device of the alignment objectives against plain SFT.

    python bench/alignment_memory.py [--models gpt_tiny,gpt_25m] [--batch_size 8] [--seq_len 128] [--steps 5]
        [--devices 1] [--mesh data=-1] [--teacher gpt_25m]

Builds each run the way the trainer does (Experiment: the model from configs/models/<name>.gin, the objective,
its frozen models restored from checkpoints on disk, the generic jitted step) and times `--steps` optimizer steps
after one compiling step, on synthetic batches: SFT (token-weighted cross-entropy), DPO (policy + frozen
reference on rows of pairs; plain and with loss_chunk = 32), reward (Bradley–Terry on the score head) and
distillation from a frozen `--teacher` (plain and with loss_chunk = 32). Prints milliseconds per step, XLA's
temporary bytes of the compiled step (memory_analysis: activations, logits and their gradients), and the start-up
report's parameter, optimizer-state and frozen-model bytes per device (memory/frozen_reference_bytes_per_device,
memory/frozen_teacher_bytes_per_device).
`--devices 8 --mesh fsdp=8 --steps 0` reports the bytes of an FSDP layout without timing.
"""

import argparse
import dataclasses
import os
import sys
import tempfile
import time


def _parse():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", default="gpt_tiny,gpt_25m", help="configs/models/<name>.gin, comma-separated")
  parser.add_argument("--teacher", default="gpt_25m", help="the distillation teacher's configs/models/<name>.gin")
  parser.add_argument("--vocab_size", type=int, default=4096)
  parser.add_argument("--dtype", default="float32", help="activation dtype (CPUs run bfloat16 matmuls slowly)")
  parser.add_argument("--batch_size", type=int, default=8)
  parser.add_argument("--seq_len", type=int, default=128)
  parser.add_argument("--steps", type=int, default=5, help="timed steps after the compiling one; 0 = bytes only")
  parser.add_argument("--devices", type=int, default=1, help="fake CPU devices")
  parser.add_argument("--mesh", default="data=-1", help="MESH_SHAPE as axis=size,...")
  return parser.parse_args()


ARGS = _parse() if __name__ == "__main__" else None
if ARGS is not None:
  os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={ARGS.devices}")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gin  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position
import tensorflow as tf  # pylint: disable=g-import-not-at-top,wrong-import-position

from t5x_like import cli  # pylint: disable=g-import-not-at-top,wrong-import-position
from t5x_like.data import packing  # pylint: disable=g-import-not-at-top,wrong-import-position
from t5x_like.data import preference as preference_data  # pylint: disable=g-import-not-at-top,wrong-import-position
from t5x_like.interop import hf_config  # pylint: disable=g-import-not-at-top,wrong-import-position
from t5x_like.model import decoder as model_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
from t5x_like.parallel import partitioning  # pylint: disable=g-import-not-at-top,wrong-import-position
from t5x_like.recipes import distill as distill_recipe  # pylint: disable=g-import-not-at-top,wrong-import-position
from t5x_like.recipes import dpo as dpo_recipe  # pylint: disable=g-import-not-at-top,wrong-import-position
from t5x_like.recipes import reward as reward_recipe  # pylint: disable=g-import-not-at-top,wrong-import-position
from t5x_like.training import checkpointing  # pylint: disable=g-import-not-at-top,wrong-import-position
from t5x_like.training import config as config_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
from t5x_like.recipes import experiment as experiment_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
from t5x_like.training import optimizer as optimizer_lib  # pylint: disable=g-import-not-at-top,wrong-import-position

RUNS = ("sft", "dpo", "dpo_chunk32", "reward", "distill", "distill_chunk32")


def model_config(name: str, vocab: int, dtype: str) -> model_lib.GPTConfig:
  gin.clear_config()
  cli.parse_gin([f"configs/models/{name}.gin"], [f"model.GPTConfig.vocab_size={vocab}", f"model.GPTConfig.dtype='{dtype}'"])
  return cli.configured(model_lib.GPTConfig, "model")


def random_checkpoint(directory: str, config: model_lib.GPTConfig) -> str:
  """A MODEL_DIR with random parameters of `config` (checkpoints/0) and its model.gin, as convert writes one."""
  boxed = jax.eval_shape(lambda: model_lib.GPT(config).init(jax.random.key(0), np.zeros((1, 1), np.int32)))
  rng = np.random.RandomState(0)
  params = jax.tree.map(lambda x: rng.normal(0, 0.02, x.shape).astype(np.float32),
                        partitioning.unbox(boxed["params"]))
  checkpointing.save_params(directory, params)
  with open(os.path.join(directory, "model.gin"), "w") as f:
    f.write(hf_config.model_gin(config, "bench/alignment_memory.py (random)"))
  return directory


def lm_batch(rng, batch: int, seq: int, vocab: int) -> dict:
  tokens = rng.randint(2, vocab, (batch, seq + 1)).astype(np.int32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": np.ones((batch, seq), np.int32),
          "positions": np.tile(np.arange(seq, dtype=np.int32), (batch, 1)), "weights": np.ones((batch, seq), np.float32)}


def pair_batch(rng, batch: int, seq: int, vocab: int) -> dict:
  """Rows of one pair each: a prompt of seq/4 tokens, two responses filling the rest."""
  rows = []
  for _ in range(batch):
    prompt = rng.randint(2, vocab, seq // 4)
    sides = []
    for _ in range(2):
      response = rng.randint(2, vocab, (seq + 1) // 2 - seq // 4 - 1)
      sides.append((np.concatenate([prompt, response, [1]]).astype(np.int32),
                    np.concatenate([np.zeros(len(prompt)), np.ones(len(response)), [0]]).astype(np.int32)))
    rows.append(preference_data.pack_pairs_np([preference_data.Pair(*sides)], seq + 1, pad_id=0)[0])
  return {k: v.numpy() for k, v in packing.row_features(tf.constant(np.stack(rows))).items()}


def run(name: str, run_kind: str, student, teacher_dir: str, base_dir: str, args, mesh_shape) -> dict:
  recipe = {"sft": config_lib.LanguageModelConfig(), "dpo": dpo_recipe.DpoConfig(),
            "reward": reward_recipe.RewardConfig()}.get(run_kind.replace("_chunk32", ""),
                                                       distill_recipe.DistillConfig(teacher_checkpoint=teacher_dir))
  config = config_lib.TrainConfig(model_dir="", data_dir="", train_steps=100, batch_size=args.batch_size,
                                  seq_len=args.seq_len, mesh_shape=mesh_shape, recipe_config=recipe,
                                  loss_chunk=32 if run_kind.endswith("_chunk32") else 0,
                                  checkpoint=checkpointing.CheckpointConfig(warm_start_from=base_dir))
  exp = experiment_lib.Experiment(config, student, optimizer_lib.OptimizerConfig(learning_rate=1e-4))
  for spec in exp.frozen_specs:  # a reference, a teacher
    exp.load_frozen_model(spec.name)
  report = exp.startup_report()
  out = {"run": run_kind, "params": report["memory/params_bytes_per_device"],
         "opt_state": report["memory/opt_state_bytes_per_device"],
         "frozen": report.get("memory/frozen_reference_bytes_per_device",
                              report.get("memory/frozen_teacher_bytes_per_device", 0)), "ms": float("nan"),
         "temp": float("nan")}
  if not args.steps:
    return out
  rng = np.random.RandomState(0)
  make = pair_batch if run_kind.startswith(("dpo", "reward")) else lm_batch
  batch = exp.global_batch(make(rng, args.batch_size, args.seq_len, args.vocab_size))
  state, step = exp.init_state(), exp.jit_train_step()
  with exp.context():
    step = step.lower(state, batch, exp.frozen).compile()
    out["temp"] = step.memory_analysis().temp_size_in_bytes
    state, metrics = step(state, batch, exp.frozen)
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for _ in range(args.steps):
      state, metrics = step(state, batch, exp.frozen)
    jax.block_until_ready(metrics)
  out["ms"] = 1000 * (time.perf_counter() - start) / args.steps
  return out


def main() -> None:
  args = ARGS
  mesh_shape = {k: int(v) for k, v in (item.split("=") for item in args.mesh.split(","))}
  teacher = model_config(args.teacher, args.vocab_size, args.dtype)
  mib = lambda n: f"{n / 2**20:,.2f}"
  print(f"{len(jax.devices())} {jax.devices()[0].platform} device(s), mesh {mesh_shape}, batch {args.batch_size} x "
        f"{args.seq_len}, vocab {args.vocab_size}, teacher {args.teacher} "
        f"({model_lib.count_params(teacher):,} parameters), float32 parameters, "
        f"{teacher.dtype} activations; {args.steps} timed steps after one compiling step")
  print(f"{'model':10s} {'run':16s} {'ms/step':>9s} {'vs SFT':>7s} {'XLA temp MiB':>13s} {'params MiB/dev':>15s} "
        f"{'opt MiB/dev':>12s} {'frozen MiB/dev':>15s}")
  with tempfile.TemporaryDirectory() as root:
    teacher_dir = random_checkpoint(os.path.join(root, "teacher"), teacher)
    for name in args.models.split(","):
      student = model_config(name, args.vocab_size, args.dtype)
      base_dir = random_checkpoint(os.path.join(root, name), student)
      sft_ms = None
      for run_kind in RUNS:
        r = run(name, run_kind, student, teacher_dir, base_dir, args, mesh_shape)
        sft_ms = r["ms"] if run_kind == "sft" else sft_ms
        print(f"{name:10s} {run_kind:16s} {r['ms']:>9.1f} {r['ms'] / sft_ms:>6.2f}x {mib(r['temp']):>13s} "
              f"{mib(r['params']):>15s} "
              f"{mib(r['opt_state']):>12s} {mib(r['frozen']):>15s}", flush=True)


if __name__ == "__main__":
  main()
