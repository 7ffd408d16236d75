"""Optimizer state and compiled-step memory per device: full, attention-only, LoRA and QLoRA fine-tuning.

    python bench/finetune_memory.py [--model gpt2_small] [--mesh data=8] [--batch_size 8] [--seq_len 1024]
        [--rank 8] [--remat full] [--modes full,attention,lora,lora-nf4,lora-int8,lora-bfloat16]

Builds each run the way the trainer does (configs/models/MODEL.gin + configs/runs/finetune.gin, the trainable
regex or LoRA adapters over a frozen base, the generic step, its shardings and donation) and only compiles the
step on 8 fake CPU devices: nothing is allocated. `lora` keeps the base as finetune.gin stores it; `lora-nf4`,
`lora-int8`, `lora-bfloat16` store it so (lora.LoraConfig.base_precision: QLoRA), the step computing with it
dequantised. Prints, per mode, the trainable parameters, the frozen base's and the optimizer state's bytes per
device (from their shardings) and XLA's memory analysis of the compiled step (arguments, outputs, temporaries;
peak = arguments + outputs − aliased + temporaries). The layer loop is compiled rolled (scan_unroll 1), as an
accelerator runs it.
"""

import argparse
import dataclasses
import functools
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax.linen as nn  # pylint: disable=g-import-not-at-top
import jax
import jax.numpy as jnp

from t5x_like import cli
from t5x_like.model import decoder as model_lib
from t5x_like.parallel import mesh as mesh_lib
from t5x_like.parallel import partitioning
from t5x_like.planning import memory_model
from t5x_like.training import checkpointing
from t5x_like.training import config as config_lib
from t5x_like.posttrain import lora
from t5x_like.posttrain import quantize
from t5x_like.training import optimizer as optimizer_lib
from t5x_like.training import step as step_lib
from t5x_like.training import train_state
from t5x_like.training import trainable as trainable_lib
from t5x_like.training.objectives import language_model

MODES = ("full", "attention", "lora")
QLORA_MODES = tuple(f"lora-{p}" for p in ("nf4", "int8", "bfloat16"))


def configs(model: str, rank: int):
  """(GPTConfig, OptimizerConfig, LoraConfig) of a fine-tune of configs/models/`model`.gin as the gin files give
  them (a model without a vocabulary size gets GPT-2's, 50,304)."""
  cli.parse_gin([f"configs/models/{model}.gin", "configs/runs/finetune.gin"],
                ["MODEL_DIR='/tmp/unused'", "DATA_DIR='/tmp/unused'", f"lora.LoraConfig.rank={rank}"])
  model_config = cli.configured(model_lib.GPTConfig, "model")
  if not model_config.vocab_size:
    model_config = dataclasses.replace(model_config, vocab_size=50304)
  return (model_config, cli.configured(optimizer_lib.OptimizerConfig, "optimizer"), cli.train_config().lora)


def compile_mode(mode: str, model_config, optimizer_config, lora_config, mesh_shape: dict, batch_size: int,
                 seq_len: int) -> dict:
  """Compiles one fine-tuning step; returns its figures per device."""
  mesh = mesh_lib.create_mesh(mesh_shape)
  cfg = dataclasses.replace(model_config, num_stages=mesh.shape["pipeline"], scan_unroll=model_config.scan_unroll or 1)
  cfg.validate()
  rules = partitioning.DEFAULT_RULES
  model = model_lib.GPT(cfg)
  tx = optimizer_lib.make_optimizer(optimizer_config, 1000)
  lr_fn = optimizer_lib.learning_rate_schedule(optimizer_config, 1000)
  objective = language_model.LanguageModel(model.apply, logits_fn=lambda p, h: model_lib.project_logits(p, h, cfg))
  trainable = config_lib.TRAINABLE_PRESETS["attention"] if mode == "attention" else ".*"
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))["params"]
    params_fn, frozen, frozen_shardings, base_bytes = None, {}, {}, 0
    if mode.startswith("lora"):
      precision = mode.partition("-")[2] or lora_config.base_precision
      objective = lora.objective(objective, boxed, lora_config)
      params_fn = functools.partial(lora.init_adapters, kernels=lora.target_kernels(boxed, lora_config.targets),
                                    config=lora_config)
      stored = quantize.boxed_stored(boxed, precision)  # the frozen base as the run stores it
      base_shardings = partitioning.shardings_from_boxed(stored, mesh, rules)
      frozen_shardings = {lora.BASE: base_shardings}
      frozen = {lora.BASE: checkpointing.abstract_with_shardings(partitioning.unbox(stored), base_shardings)}
      base_bytes = train_state.bytes_per_device(partitioning.unbox(stored), base_shardings)
    abstract_state, shardings = train_state.state_shardings(model, tx, mesh, rules, trainable=trainable,
                                                            params_fn=params_fn)
    paths = trainable_lib.trainable_paths(abstract_state.params, trainable)
    batch_sharding = partitioning.batch_sharding(mesh, rules)
    batch = {k: jax.ShapeDtypeStruct((batch_size, seq_len), jnp.float32 if k == "weights" else jnp.int32,
                                     sharding=batch_sharding) for k in objective.features}
    step = step_lib.make_train_step(objective, tx, lr_fn, trainable_paths=paths)
    jitted = step_lib.jit_train_step(step, shardings, batch_sharding, objective.features, frozen_shardings)
    start = time.perf_counter()
    compiled = jitted.lower(checkpointing.abstract_with_shardings(abstract_state, shardings), batch, frozen).compile()
    seconds = time.perf_counter() - start
  analysis = compiled.memory_analysis()
  base = lora.count(partitioning.unbox(boxed))
  trainable_count = lora.count(trainable_lib.trainable_part(abstract_state.params, paths))
  return {
      "mode": mode, "trainable": trainable_count,
      "fraction": trainable_count / (base + (lora.count(abstract_state.params) if mode.startswith("lora") else 0)),
      "base": base_bytes,
      "opt_state": train_state.bytes_per_device(abstract_state.opt_state, shardings.opt_state),
      "arguments": analysis.argument_size_in_bytes, "temporaries": analysis.temp_size_in_bytes,
      "peak": memory_model.xla_bytes_per_device(analysis), "compile_seconds": seconds,
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="gpt2_small", help="a configs/models/ gin file's name")
  parser.add_argument("--mesh", default="data=8", help="MESH_SHAPE as axis=size,... (default data=8)")
  parser.add_argument("--batch_size", type=int, default=8, help="global sequences per step")
  parser.add_argument("--seq_len", type=int, default=1024)
  parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
  parser.add_argument("--remat", default="", help="GPTConfig.remat_policy (default: the gin files')")
  parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {MODES + QLORA_MODES}")
  args = parser.parse_args()
  mesh_shape = {k: int(v) for k, v in (item.split("=") for item in args.mesh.split(","))}
  model_config, optimizer_config, lora_config = configs(args.model, args.rank)
  if args.remat:
    model_config = dataclasses.replace(model_config, remat_policy=args.remat)
  mib = lambda n: f"{n / 2**20:,.1f}"
  print(f"{args.model} (vocab {model_config.vocab_size}, {model_config.dtype} activations, remat "
        f"{model_config.remat_policy}), mesh {mesh_shape}, {len(jax.devices())} "
        f"{jax.devices()[0].platform} devices, batch {args.batch_size} x {args.seq_len}, LoRA rank {args.rank} "
        f"(alpha {lora_config.alpha}) on {lora_config.targets}")
  print(f"{'mode':14s} {'trainable':>12s} {'fraction':>9s} {'base MiB/dev':>13s} {'opt state MiB/dev':>18s} "
        f"{'XLA args MiB':>13s} "
        f"{'XLA temp MiB':>13s} {'XLA peak MiB':>13s} {'compile s':>10s}")
  for mode in args.modes.split(","):
    r = compile_mode(mode, model_config, optimizer_config, lora_config, mesh_shape, args.batch_size, args.seq_len)
    print(f"{r['mode']:14s} {r['trainable']:>12,} {100 * r['fraction']:>8.3f}% {mib(r['base']):>13s} "
          f"{mib(r['opt_state']):>18s} "
          f"{mib(r['arguments']):>13s} {mib(r['temporaries']):>13s} {mib(r['peak']):>13s} "
          f"{r['compile_seconds']:>10.1f}", flush=True)


if __name__ == "__main__":
  main()
