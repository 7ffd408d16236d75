"""One decode step of the inference engine, by sampler setting: what greedy, plain sampling and top-k / top-p cost.

  python bench/decode_step.py [--slots 128 --vocab_size 400 --num_layers 2 --d_model 32 --max_len 64
                               --devices 1 --level default --steps 50]

A random GPT of the given size decodes --slots requests of a 1-token prompt through `Engine.step` (the public path:
the program, the settings' transfer and the host copy of the new tokens), --steps steps timed once every slot is
decoding, for four settings of every request: greedy; temperature 1; temperature 1 with top-k 40; temperature 1 with
top-p 0.9. The step's milliseconds (wall, after the prefill and one warm-up step). The sampler sorts each row's
vocabulary only when some row filters (top-k or top-p) and draws only when some row samples
(inference/sampling.py), so the rows read what each of those costs, in one run. --level 0 is the tests' XLA setting
(optimisation turned down, tests/conftest.py), `default` a user's run; --devices fake CPU devices, data-parallel.
"""

import argparse
import dataclasses
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  for name, default in (("slots", 128), ("vocab_size", 400), ("num_layers", 2), ("d_model", 32), ("max_len", 64),
                        ("devices", 1), ("steps", 50)):
    parser.add_argument(f"--{name}", type=int, default=default)
  parser.add_argument("--level", choices=("0", "default"), default="default")
  return parser.parse_args(argv)


def main(argv=None):
  args = parse(argv)
  flags = [f"--xla_force_host_platform_device_count={args.devices}"]
  if args.level == "0":
    flags += ["--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"]
  os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", "")] + flags).strip()
  sys.path.insert(0, ROOT)
  import jax  # pylint: disable=g-import-not-at-top  (after XLA_FLAGS)
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from t5x_like.inference.engine import Engine  # pylint: disable=g-import-not-at-top
  from t5x_like.inference.sampling import SamplingParams  # pylint: disable=g-import-not-at-top
  from t5x_like.model import decoder as model_lib  # pylint: disable=g-import-not-at-top
  from t5x_like.observe import hardware  # pylint: disable=g-import-not-at-top
  from t5x_like.parallel import distributed  # pylint: disable=g-import-not-at-top
  from t5x_like.parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  from t5x_like.parallel import partitioning  # pylint: disable=g-import-not-at-top

  distributed.set_cpu_xla_flags()  # the entry points' XLA:CPU flags
  jax.config.update("jax_disable_most_optimizations", args.level == "0")
  config = model_lib.GPTConfig(vocab_size=args.vocab_size, max_len=args.max_len, num_layers=args.num_layers,
                               num_heads=2, d_model=args.d_model, d_ff=2 * args.d_model, dtype="float32")
  mesh = mesh_lib.create_mesh({"data": -1})
  params = partitioning.unbox(model_lib.GPT(config).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])
  params = jax.device_put(params, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))  # replicated
  engine = Engine(config, params, mesh, partitioning.DEFAULT_RULES, slots=args.slots)
  print(f"CPU {hardware.cpu_name()} ({os.cpu_count()} cores); jax {jax.__version__}; XLA level {args.level}; "
        f"{args.devices} device(s); {engine.slots} slots, vocabulary {args.vocab_size}, {args.num_layers} layers, "
        f"d_model {args.d_model}")
  print("sampler                        ms per decode step")
  settings = {"greedy": SamplingParams(), "temperature 1": SamplingParams(temperature=1.0),
              "temperature 1, top-k 40": SamplingParams(temperature=1.0, top_k=40),
              "temperature 1, top-p 0.9": SamplingParams(temperature=1.0, top_p=0.9)}
  for name, sampling in settings.items():
    sampling = dataclasses.replace(sampling, max_tokens=args.steps + 2)
    for _ in range(engine.slots):
      engine.submit([1], sampling, seed=0)
    engine.step()  # the prefill and every slot's first token
    engine.step()  # one decode step (compiled on the first setting)
    start = time.perf_counter()
    for _ in range(args.steps):
      engine.step()  # returns once the step's tokens are on the host
    print(f"{name:30s} {(time.perf_counter() - start) / args.steps * 1e3:8.2f}")
    while engine.busy:
      engine.step()


if __name__ == "__main__":
  main()
