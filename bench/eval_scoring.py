"""Log-likelihood scoring (inference.Scorer, what `evaluate --tasks` runs) against the training forward, tokens/s.

    python bench/eval_scoring.py                      # gpt_tiny shape, 256 requests of 64..128 tokens
    python bench/eval_scoring.py --model=configs/models/gpt_25m.gin --requests=64

Both sides score the same tokens: the scorer's requests (context + continuation, ragged, right-padded to a
power-of-two width in rows of --batch) and the language-model objective's forward (the loss the trainer computes,
without the backward) on (--batch, width) rows of the same tokens. Best of --rounds; the CPU is named.
"""

import argparse
import os
import time

from t5x_like.parallel import distributed

distributed.set_cpu_xla_flags()

import gin  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position

from t5x_like import cli  # pylint: disable=g-import-not-at-top,wrong-import-position
from t5x_like.inference import scoring  # pylint: disable=g-import-not-at-top,wrong-import-position
from t5x_like.model import decoder as model_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
from t5x_like.observe import hardware  # pylint: disable=g-import-not-at-top,wrong-import-position
from t5x_like.parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
from t5x_like.parallel import partitioning  # pylint: disable=g-import-not-at-top,wrong-import-position
from t5x_like.training.objectives import language_model  # pylint: disable=g-import-not-at-top,wrong-import-position


def best(fn, rounds: int) -> float:
  times = []
  for _ in range(rounds):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return min(times)


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="configs/models/gpt_tiny.gin")
  parser.add_argument("--vocab", type=int, default=4096)
  parser.add_argument("--requests", type=int, default=256)
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--rounds", type=int, default=3)
  args = parser.parse_args()
  cli.parse_gin([args.model])
  config = cli.configured(model_lib.GPTConfig, "model")
  config = model_lib.GPTConfig(**{**config.__dict__, "vocab_size": args.vocab, "dtype": "float32"})
  mesh = mesh_lib.create_mesh({"data": 1}, jax.devices()[:1])
  rules = partitioning.DEFAULT_RULES
  model = model_lib.GPT(config)
  params = partitioning.unbox(model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])
  rng = np.random.default_rng(0)
  requests = []
  for _ in range(args.requests):
    n = int(rng.integers(64, 129))
    ids = rng.integers(4, args.vocab, n).tolist()
    requests.append((ids[:n - 8], ids[n - 8:]))
  tokens = sum(len(c) + len(x) for c, x in requests)
  scorer = scoring.Scorer(config, params, mesh, rules, batch_size=args.batch)
  scorer.loglikelihood(requests)  # compile
  score_s = best(lambda: scorer.loglikelihood(requests), args.rounds)

  width = 128
  objective = language_model.LanguageModel(apply_fn=model.apply,
                                           logits_fn=lambda p, h: model_lib.project_logits(p, h, config))
  rows = [c + x for c, x in requests]
  batches = []
  for start in range(0, len(rows), args.batch):
    chunk = rows[start:start + args.batch]
    toks = np.zeros((args.batch, width + 1), np.int32)
    seg = np.zeros((args.batch, width), np.int32)
    for i, r in enumerate(chunk):
      toks[i, :len(r)] = r
      seg[i, :len(r) - 1] = 1
    batches.append({"inputs": toks[:, :-1], "targets": toks[:, 1:], "segment_ids": seg,
                    "positions": np.tile(np.arange(width, dtype=np.int32), (args.batch, 1)),
                    "weights": seg.astype(np.float32)})
  loss = jax.jit(lambda p, b: objective.loss(p, b, {})[0])
  with jax.set_mesh(mesh):
    run = lambda: [float(loss(params, b)) for b in batches]
    run()
    forward_s = best(run, args.rounds)
  print(f"# {hardware.cpu_name()}, {os.cpu_count()} CPUs, jax {jax.__version__}; model {os.path.basename(args.model)} "
        f"(vocab {args.vocab}, float32); {args.requests} requests, {tokens} tokens, rows of {args.batch}")
  print("| what | seconds | tokens/s |\n|---|---|---|")
  print(f"| Scorer.loglikelihood (evaluate --tasks) | {score_s:.3f} | {tokens / score_s:,.0f} |")
  print(f"| training forward (language-model loss, no backward) | {forward_s:.3f} | {tokens / forward_s:,.0f} |")
  print(f"scoring / forward: {forward_s / score_s:.2f}x the forward's speed")


if __name__ == "__main__":
  main()
