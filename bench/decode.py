"""Decoding throughput: KV-cache generation (one position per new token) vs recomputing the whole sequence.

  python bench/decode.py [--num_layers 4 --d_model 128 --num_heads 4 --d_ff 512 --vocab_size 4096]
                         [--batch 4 --prompt_len 64 --new_tokens 32 --dtype float32 --repeats 3]

Both decoders are greedy on the same randomly initialised GPT, are compiled before timing (the
recompute reference compiles once per sequence length, during the warm-up run), and must emit
identical tokens. Prints one table row per method: new tokens/s over the batch and ms per token.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from t5x_like.model import decoder as model_lib
from t5x_like.parallel import partitioning
from t5x_like.model import decoding as sampling


def timed(fn, repeats: int) -> tuple:
  """(best seconds of `repeats` runs after one warm-up, output)."""
  out = jax.block_until_ready(fn())
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    best = min(best, time.perf_counter() - t0)
  return best, out


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  for name, default in (("num_layers", 4), ("d_model", 128), ("num_heads", 4), ("d_ff", 512),
                        ("vocab_size", 4096), ("batch", 4), ("prompt_len", 64), ("new_tokens", 32),
                        ("repeats", 3)):
    parser.add_argument(f"--{name}", type=int, default=default)
  parser.add_argument("--dtype", default="float32", help="activation dtype (float32 or bfloat16)")
  args = parser.parse_args()
  cfg = model_lib.GPTConfig(vocab_size=args.vocab_size, num_layers=args.num_layers, num_heads=args.num_heads,
                            d_model=args.d_model, d_ff=args.d_ff, dtype=args.dtype,
                            max_len=args.prompt_len + args.new_tokens)
  params = partitioning.unbox(model_lib.GPT(cfg).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])
  prompts = np.random.RandomState(0).randint(4, args.vocab_size, (args.batch, args.prompt_len)).astype(np.int32)
  segments = np.ones_like(prompts)

  cached_seconds, cached = timed(lambda: sampling.generate(params, prompts, segments, jax.random.key(0), config=cfg,
                                                     max_new_tokens=args.new_tokens), args.repeats)
  recompute_seconds, recomputed = timed(lambda: sampling.generate_by_recompute(params, prompts, config=cfg,
                                                                         max_new_tokens=args.new_tokens),
                                  max(1, args.repeats - 2))
  same = bool(np.array_equal(np.asarray(cached), np.asarray(recomputed)))
  new = args.batch * args.new_tokens
  print(f"device {jax.devices()[0].device_kind} ({jax.device_count()}); {model_lib.count_params(cfg):,} params; "
        f"batch {args.batch}, prompt {args.prompt_len}, {args.new_tokens} new tokens, {args.dtype}")
  print(f"{'method':<12} {'new tok/s':>12} {'ms/token step':>14}")
  for name, seconds in (("kv_cache", cached_seconds), ("recompute", recompute_seconds)):
    print(f"{name:<12} {new / seconds:>12,.0f} {1e3 * seconds / args.new_tokens:>14.2f}")
  print(f"speed-up {recompute_seconds / cached_seconds:.1f}x; identical greedy tokens: {same}")
  if not same:
    raise SystemExit("KV-cache and recompute decoding disagree")


if __name__ == "__main__":
  main()
