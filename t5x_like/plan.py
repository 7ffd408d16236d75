"""`python -m t5x_like.plan`: FLOPs, per-device memory, step time and a ranked list of mesh layouts, before a run.

    python -m t5x_like.plan --gin_file=configs/models/gpt2_small.gin --vocab_size=50304 \\
        --hardware=h100 --num_devices=8 --global_batch=512 --tokens=10e9
    (a LoRA / QLoRA run: add --gin.lora.LoraConfig.rank=8 [--gin.lora.LoraConfig.base_precision="'nf4'"])

The model of step time and memory is in t5x_like/planning/planner.py and docs/plan.md.
"""

import dataclasses

from absl import flags
import gin
import jax

from t5x_like import cli
from t5x_like.model import decoder as model_lib
from t5x_like.observe import hardware as hardware_lib
from t5x_like.planning import planner
from t5x_like.posttrain import lora as lora_lib
from t5x_like.planning.planner import Target


def define_flags():
  cli.define_gin_flags()
  flags.DEFINE_string("hardware", "h100", f"catalogue entry: {', '.join(hardware_lib.CATALOGUE)}")
  flags.DEFINE_string("hardware_file", None, "JSON file of extra catalogue entries (see t5x_like/observe/hardware.py)")
  flags.DEFINE_integer("num_devices", None, "accelerators in the run")
  flags.DEFINE_integer("hosts", None, "hosts the devices are spread over (default: the catalogue's devices/host)")
  flags.DEFINE_float("tokens", None, "training tokens (default TRAIN_STEPS×BATCH_SIZE×SEQ_LEN, else 20 × params)")
  flags.DEFINE_integer("seq_len", None, "tokens per sequence (default SEQ_LEN, else GPTConfig.max_len)")
  flags.DEFINE_integer("global_batch", None, "sequences per step (default BATCH_SIZE, else ≈0.5M tokens)")
  flags.DEFINE_integer("vocab_size", None, "vocabulary when GPTConfig.vocab_size is 0 (dataset-sized), e.g. 50304")
  flags.DEFINE_float("efficiency", 0.6, "fraction of peak FLOP/s reached while computing")
  flags.DEFINE_float("comm_efficiency", 0.7, "fraction of nominal link bandwidth reached by collectives")
  flags.DEFINE_float("memory_fraction", 0.9, "usable fraction of device memory")
  flags.DEFINE_integer("max_sequence", 1, "largest context-parallel `sequence` axis searched (1 = none)")
  flags.DEFINE_bool("causal_halved", False, "count only the unmasked half of causal attention in FLOPs/MFU")
  flags.DEFINE_integer("top", 10, "rows of the ranked table")
  flags.DEFINE_bool("compile", False, "AOT-compile the best layout's train step on a CPU-emulated mesh and "
                    "print XLA's memory analysis next to the estimate")
  flags.DEFINE_integer("compile_devices", 64, "largest CPU mesh --compile emulates (memory/time bound)")


def _gin_macro(name: str):
  try:
    return gin.query_parameter(f"%{name}")
  except ValueError:
    return None


def _target_from_flags(cfg: model_lib.GPTConfig) -> Target:
  f = flags.FLAGS
  if not f.num_devices or f.num_devices < 1:
    raise ValueError(f"--num_devices must be a positive integer, got {f.num_devices}")
  hw = hardware_lib.get(f.hardware)
  per_host = 0
  if f.hosts:
    if f.num_devices % f.hosts:
      raise ValueError(f"--num_devices={f.num_devices} is not divisible by --hosts={f.hosts}")
    per_host = f.num_devices // f.hosts
  seq_len = f.seq_len or _gin_macro("SEQ_LEN") or cfg.max_len
  if seq_len > cfg.max_len:
    raise ValueError(f"sequence length {seq_len} exceeds GPTConfig.max_len={cfg.max_len}")
  batch = f.global_batch or _gin_macro("BATCH_SIZE") or max(1, 2**19 // seq_len)
  tokens = f.tokens
  if tokens is None:
    steps = _gin_macro("TRAIN_STEPS")
    tokens = steps * batch * seq_len if steps else 20.0 * model_lib.count_params(cfg)
  if tokens <= 0 or batch <= 0:
    raise ValueError(f"--tokens and --global_batch must be positive, got {tokens}, {batch}")
  return Target(hardware=hw, num_devices=f.num_devices, global_batch=int(batch), seq_len=int(seq_len),
                tokens=float(tokens), devices_per_host=per_host, efficiency=f.efficiency,
                comm_efficiency=f.comm_efficiency, memory_fraction=f.memory_fraction,
                causal_halved=f.causal_halved, max_sequence=max(1, f.max_sequence),
                lora=cli.configured(lora_lib.LoraConfig, "lora"))


def _model_from_gin() -> model_lib.GPTConfig:
  cli.parse_gin_flags()
  cfg = cli.configured(model_lib.GPTConfig, "model")
  vocab = flags.FLAGS.vocab_size or cfg.vocab_size
  if not vocab:
    raise ValueError("GPTConfig.vocab_size is 0 (taken from the dataset at train time): pass --vocab_size=N "
                     "(e.g. 50304 for GPT-2's BPE)")
  cfg = dataclasses.replace(cfg, vocab_size=vocab)
  cfg.validate()
  return cfg


def main(argv):
  if len(argv) > 1:
    raise ValueError(f"unexpected arguments {argv[1:]}")
  f = flags.FLAGS
  if f.compile:  # must precede any use of a jax backend
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", min(f.num_devices or 1, f.compile_devices))
  if f.hardware_file:
    hardware_lib.load_file(f.hardware_file)
  cfg = _model_from_gin()
  target = _target_from_flags(cfg)
  text, feasible, _ = planner.report(cfg, target, f.top)
  print(text, flush=True)
  if f.compile:
    if not feasible:
      raise ValueError("--compile: no feasible layout to compile")
    best = feasible[0].layout
    if best.num_devices > f.compile_devices:
      print(f"\n--compile: {best.num_devices} devices exceed --compile_devices={f.compile_devices}; "
            "raise it if host memory allows", flush=True)
      return
    print("\n" + planner.compile_check(cfg, best, target), flush=True)


if __name__ == "__main__":
  define_flags()
  cli.run(main)
