"""Decoding: the inference engine against Hugging Face `transformers`' `generate` on the same exported Llama, and
continuous batching against fixed batches.

  python bench/decode.py [--num_layers 4 --d_model 256 --num_heads 8 --num_kv_heads 4 --d_ff 688
                          --vocab_size 4096 --prompt_len 32 --new_tokens 128 --slots 8 --torch_threads 1]

1. A random Llama-shaped GPTConfig (RoPE, RMSNorm, SwiGLU, grouped-query attention, untied head) is saved as a
   checkpoint and exported with the project's `to_hf` (interop/hf.py); transformers loads the folder
   (float32, PyTorch CPU). Both decode greedily --new_tokens tokens after the same --prompt_len-token prompts,
   at batch 1 and 32: new tokens/s over the batch (first token included) and the time to the first token (the
   engine: its first step, i.e. the prefill and one decode step; transformers: generate(max_new_tokens=1)).
   Both are warmed up first (the engine compiles its programs). The table says whether the greedy tokens agree.
2. 64 requests, prompts of 4..64 tokens and max_tokens 8..128 (greedy), through --slots slots: continuous
   batching (a slot is refilled when its sequence ends) against the same requests in fixed batches of --slots
   (each batch runs until its longest request ends). Wall time of both; both give the same tokens.
"""

import argparse
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from t5x_like.inference.engine import Engine
from t5x_like.inference.sampling import SamplingParams
from t5x_like.interop import hf
from t5x_like.model import decoder as model_lib
from t5x_like.observe import hardware
from t5x_like.parallel import mesh as mesh_lib
from t5x_like.parallel import partitioning
from t5x_like.training import checkpointing


def export_llama(config, params, root: str) -> str:
  """Saves `params` as MODEL_DIR/checkpoints/0 and exports it with to_hf; returns the HF folder."""
  manager = checkpointing.make_manager(os.path.join(root, "run"), async_save=False)
  checkpointing.save(manager, 0, {"params": params})
  manager.close()
  out = os.path.join(root, "hf")
  hf.export_hf(os.path.join(root, "run"), out, config)
  return out


def engine_run(engine, prompts, new_tokens: int) -> tuple:
  """(seconds to the first token, total seconds, tokens) of greedy decoding of `prompts` through the engine."""
  sampling = SamplingParams(max_tokens=new_tokens)
  t0 = time.perf_counter()
  ids = [engine.submit(p, sampling) for p in prompts]
  first, tokens = None, {rid: [] for rid in ids}
  while engine.busy:
    for d in engine.step():
      tokens[d.request_id] += d.tokens
    first = first or time.perf_counter() - t0
  return first, time.perf_counter() - t0, [tokens[rid] for rid in ids]


def hf_run(model, prompts, new_tokens: int) -> tuple:
  """(seconds to the first token, total seconds, tokens) of transformers' greedy generate (equal-length prompts)."""
  batch = torch.tensor(prompts, dtype=torch.long)
  kwargs = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(batch))
  with torch.no_grad():
    t0 = time.perf_counter()
    model.generate(batch, max_new_tokens=1, min_new_tokens=1, **kwargs)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = model.generate(batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
    total = time.perf_counter() - t0
  return first, total, out[:, batch.shape[1]:].tolist()


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  for name, default in (("num_layers", 4), ("d_model", 256), ("num_heads", 8), ("num_kv_heads", 4), ("d_ff", 688),
                        ("vocab_size", 4096), ("prompt_len", 32), ("new_tokens", 128), ("slots", 8),
                        ("torch_threads", 1)):
    parser.add_argument(f"--{name}", type=int, default=default)
  args = parser.parse_args()
  # PyTorch's OpenMP workers spin-wait: on a shared, loaded 2-core machine 2 threads made one forward pass of
  # this model take 1.1 s instead of 30 ms with 1 (measured), so the reference runs single-threaded by default.
  torch.set_num_threads(args.torch_threads)
  config = model_lib.GPTConfig(vocab_size=args.vocab_size, max_len=256, num_layers=args.num_layers,
                               num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, d_model=args.d_model,
                               d_ff=args.d_ff, dtype="float32", position_embedding="rope", norm="rmsnorm",
                               mlp_activation="swiglu", tie_embeddings=False, use_bias=False)
  params = partitioning.unbox(model_lib.GPT(config).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])
  params = jax.tree.map(lambda x: x * 4.0, params)  # sharper logits: decisive greedy choices
  with tempfile.TemporaryDirectory() as root:
    model = transformers.AutoModelForCausalLM.from_pretrained(export_llama(config, params, root),
                                                              dtype="float32").eval()
  mesh = mesh_lib.create_mesh({"data": 1}, devices=jax.devices()[:1])
  rules = partitioning.DEFAULT_RULES
  rng = np.random.RandomState(0)
  print(f"CPU {hardware.cpu_name()} ({os.cpu_count()} cores); jax {jax.__version__} ({jax.devices()[0].platform}), "
        f"transformers {transformers.__version__} (torch {args.torch_threads} thread(s)); Llama "
        f"{model_lib.count_params(config):,} params, float32; prompt {args.prompt_len} tokens, "
        f"{args.new_tokens} new tokens, greedy")
  print(f"{'batch':>5} {'engine tok/s':>13} {'HF tok/s':>9} {'engine TTFT ms':>15} {'HF TTFT ms':>11} "
        f"{'same tokens':>12}")
  for batch in (1, 32):
    prompts = rng.randint(4, args.vocab_size, (batch, args.prompt_len)).tolist()
    engine = Engine(config, params, mesh, rules, slots=batch, cache_len=args.prompt_len + args.new_tokens)
    engine_run(engine, prompts, args.new_tokens)  # compiles
    ttft, seconds, ours = engine_run(engine, prompts, args.new_tokens)
    hf_run(model, prompts[:1], 4)  # warm-up
    hf_ttft, hf_seconds, theirs = hf_run(model, prompts, args.new_tokens)
    same = sum(a == b for a, b in zip(ours, theirs))
    new = batch * args.new_tokens
    print(f"{batch:>5} {new / seconds:>13,.0f} {new / hf_seconds:>9,.0f} {1e3 * ttft:>15.1f} {1e3 * hf_ttft:>11.1f} "
          f"{same:>7}/{batch}")

  lengths, budgets = rng.randint(4, 65, 64), rng.randint(8, 129, 64)
  prompts = [rng.randint(4, args.vocab_size, n).tolist() for n in lengths]
  sampling = [SamplingParams(max_tokens=int(m)) for m in budgets]
  engine = Engine(config, params, mesh, rules, slots=args.slots, cache_len=256)
  engine.generate(prompts[:args.slots], sampling[:args.slots])  # compiles the shapes both runs use
  engine.generate(prompts, sampling)
  t0 = time.perf_counter()
  continuous = engine.generate(prompts, sampling)
  continuous_seconds = time.perf_counter() - t0
  t0 = time.perf_counter()
  fixed = []
  for start in range(0, len(prompts), args.slots):
    fixed += engine.generate(prompts[start:start + args.slots], sampling[start:start + args.slots])
  fixed_seconds = time.perf_counter() - t0
  same = all(a[0].tokens == b[0].tokens for a, b in zip(continuous, fixed))
  total = int(sum(len(c[0].tokens) for c in continuous))
  print(f"\n64 requests (prompts 4..64, max_tokens 8..128, {total} tokens), {args.slots} slots, greedy:")
  print(f"{'schedule':<22} {'wall s':>8} {'tok/s':>8}")
  for name, seconds in (("continuous batching", continuous_seconds), (f"fixed batches of {args.slots}", fixed_seconds)):
    print(f"{name:<22} {seconds:>8.2f} {total / seconds:>8,.0f}")
  print(f"speed-up {fixed_seconds / continuous_seconds:.2f}x; identical tokens: {same}")


if __name__ == "__main__":
  main()
