"""t5x_like's train step against a plain PyTorch eager loop of the same GPT on this CPU, in one run.

    python bench/torch_reference.py                       # gpt_tiny and gpt_25m, default dtype and float32
    python bench/torch_reference.py --models=gpt_tiny --steps=20 --rounds=3

The PyTorch side is what a new user writes (nanoGPT-style): nn.Embedding (tied to the output projection),
learned positions, pre-LN blocks of nn.Linear / F.scaled_dot_product_attention(is_causal=True) / GELU (tanh),
AdamW, float32, `torch.set_num_threads(--threads)`, loss.backward() + optimizer.step() per step. The t5x_like side
is the trainer's own jitted step (bench/train_throughput.bench_point: TrainState, AdamW with clipping, donated
state, the language-model objective) on one synthetic batch kept on the device, in the model's default dtype
(bfloat16 activations) and in float32. Both see batch × seq tokens per step (default 16 × 256) and the same
shapes (the model gin file's, vocabulary --vocab).

Timing: wall-clock seconds per step, best of --rounds rounds of --steps steps after a warm-up, the two
frameworks alternating round by round so a change in the machine's load hits both. `uptime`'s load average is
printed: on a shared 2-core machine, numbers are only comparable at a load average near 0.

Last, each framework's float32 GEMM alone on the forward's dense shapes (XLA's dot in this process, torch.mm in the
PyTorch worker): how much of the ratio is the GEMM library on this CPU rather than the step around it.

The PyTorch loop runs in a child process of its own (never at the same time as t5x_like's), with the C library's
malloc as a new user's script has it. t5x_like's side runs as the trainer does: restarted on jemalloc where Debian's
libjemalloc2 is installed, else glibc set to keep freed memory (t5x_like/jemalloc.py, parallel/host_allocator.py),
each step dispatched as the trainer's loop does (trainer.StepGate); `--torch_allocator=same` gives the
PyTorch process the same allocator, to show what it is worth to it.

Resident memory (VmRSS) after each model's rounds: the PyTorch worker's (one per model), and this process's, which
also holds the models measured before (run one --models at a time for each alone).
"""

import argparse
import math
import os
import subprocess
import sys
import time

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

import train_throughput  # bench/ is on sys.path when this file runs as a script (it sets the CPU flags first)

import jax  # pylint: disable=g-import-not-at-top,g-bad-import-order

from t5x_like.model import decoder as model_lib
from t5x_like.parallel import host_allocator


class Block(nn.Module):
  def __init__(self, d_model: int, heads: int, d_ff: int):
    super().__init__()
    self.heads = heads
    self.ln_1, self.ln_2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
    self.qkv, self.out = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
    self.mlp_in, self.mlp_out = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)

  def forward(self, x):  # (B, T, C)
    b, t, c = x.shape
    q, k, v = self.qkv(self.ln_1(x)).split(c, dim=2)
    q, k, v = (a.view(b, t, self.heads, c // self.heads).transpose(1, 2) for a in (q, k, v))  # (B, H, T, Dh)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
    x = x + self.out(y)
    return x + self.mlp_out(F.gelu(self.mlp_in(self.ln_2(x)), approximate="tanh"))


class TorchGPT(nn.Module):
  """nanoGPT's GPT with the shapes of a t5x_like GPTConfig (tied embeddings, learned positions)."""

  def __init__(self, cfg: model_lib.GPTConfig):
    super().__init__()
    self.wte, self.wpe = nn.Embedding(cfg.vocab_size, cfg.d_model), nn.Embedding(cfg.max_len, cfg.d_model)
    self.blocks = nn.ModuleList(Block(cfg.d_model, cfg.num_heads, cfg.d_ff) for _ in range(cfg.num_layers))
    self.ln_f = nn.LayerNorm(cfg.d_model)
    for p in self.parameters():
      if p.dim() == 2:
        nn.init.normal_(p, std=0.02)

  def forward(self, tokens, targets):  # (B, T) each
    x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
    for block in self.blocks:
      x = block(x)
    logits = self.ln_f(x) @ self.wte.weight.T  # (B, T, V)
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


class TorchLoop:
  """A PyTorch eager training loop on one batch; `run(steps)` returns the last loss."""

  def __init__(self, cfg: model_lib.GPTConfig, batch: dict):
    torch.manual_seed(0)
    self.model = TorchGPT(cfg)
    self.opt = torch.optim.AdamW(self.model.parameters(), lr=6e-4, weight_decay=0.1)
    self.inputs = torch.from_numpy(batch["inputs"].astype(np.int64))
    self.targets = torch.from_numpy(batch["targets"].astype(np.int64))

  def run(self, steps: int) -> float:
    for _ in range(steps):
      loss = self.model(self.inputs, self.targets)
      self.opt.zero_grad(set_to_none=True)
      loss.backward()
      self.opt.step()
    return loss.item()


class TorchProcess:
  """TorchLoop in a child process (`--torch_worker`); `run(steps)` → (seconds per step, last loss)."""

  def __init__(self, args, name: str, same_allocator: bool):
    env = dict(os.environ)
    if not same_allocator:  # glibc's malloc as a new user's script has it: nothing preloaded, nothing set
      env[host_allocator.ENV] = "default"
      env.pop("LD_PRELOAD", None)
    cmd = [sys.executable, os.path.abspath(__file__), "--torch_worker", f"--models={name}", f"--vocab={args.vocab}",
           f"--batch={args.batch}", f"--seq={args.seq}", f"--threads={args.threads}", f"--warmup={args.warmup}"]
    self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    if self.proc.stdout.readline().strip() != "ready":
      raise RuntimeError(f"the PyTorch worker for {name} did not start: {' '.join(cmd)}")

  def run(self, steps: int) -> tuple:
    self.proc.stdin.write(f"{steps}\n")
    self.proc.stdin.flush()
    seconds, loss = self.proc.stdout.readline().split()
    return float(seconds), float(loss)

  def rss_gib(self) -> float:
    """The worker's resident memory now, GiB."""
    return rss_gib(self.proc.pid)

  def gemm_rate(self) -> float:
    """gemm_rate of torch.mm on the model's gemm_shapes, in the worker (its threads, its malloc)."""
    self.proc.stdin.write("gemm\n")
    self.proc.stdin.flush()
    return float(self.proc.stdout.readline())

  def close(self):
    self.proc.stdin.close()
    self.proc.wait()


def torch_worker(args):
  """The child process: builds the PyTorch loop, warms it up, then times `N` steps for every line `N` on stdin."""
  torch.set_num_threads(args.threads)
  cfg = train_throughput.model_config(args.models, dtype="float32", vocab_size=args.vocab)
  loop = TorchLoop(cfg, train_throughput.synthetic_batch(args.batch, args.seq, cfg.vocab_size))
  loop.run(args.warmup)
  print("ready", flush=True)
  for line in sys.stdin:
    if line.strip() == "gemm":
      print(gemm_rate(torch_product, gemm_shapes(cfg, args.batch * args.seq)), flush=True)
      continue
    seconds, loss = seconds_per_step(loop, int(line))
    print(f"{seconds} {loss}", flush=True)


class T5xLoop:
  """t5x_like's trainer step, compiled once (bench/train_throughput.compiled_step); `run(steps)` → last loss."""

  def __init__(self, cfg: model_lib.GPTConfig, batch: int, seq: int):
    self.step, self.state, self.data, _, _ = train_throughput.compiled_step(cfg, batch, seq)

  def run(self, steps: int) -> float:
    self.state, loss = train_throughput.run_steps(self.step, self.state, self.data, steps)  # as the trainer's loop
    return loss


def rss_gib(pid="self") -> float:
  """VmRSS of a process (Linux /proc), GiB; nan elsewhere."""
  try:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
      return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 2 ** 20
  except (OSError, StopIteration):
    return math.nan


def gemm_shapes(cfg: model_lib.GPTConfig, rows: int) -> list:
  """(m, k, n) of the forward's dense products for `rows` tokens: q/k/v, attention output, MLP in and out, logits."""
  d = cfg.d_model
  return [(rows, d, 3 * d), (rows, d, d), (rows, d, cfg.d_ff), (rows, cfg.d_ff, d), (rows, d, cfg.vocab_size)]


def gemm_rate(product, shapes: list, reps: int = 5) -> float:
  """float32 GFLOP/s over `shapes`: their FLOPs over the sum of each one's best of 3 × `reps` products.
  product(m, k, n) returns a callable that computes one (m, k) · (k, n) product of random operands and waits for it.
  The GEMM library's speed on this CPU, the part of the step ratio that does not come from the step's own code."""
  flop, seconds = 0, 0.0
  for m, k, n in shapes:
    run = product(m, k, n)
    run()
    best = math.inf
    for _ in range(3):
      t0 = time.perf_counter()
      for _ in range(reps):
        run()
      best = min(best, (time.perf_counter() - t0) / reps)
    flop, seconds = flop + 2 * m * k * n, seconds + best
  return flop / seconds / 1e9


def _random(shape) -> np.ndarray:
  return np.random.default_rng(0).standard_normal(shape, dtype=np.float32)


def torch_product(m, k, n):
  a, b = torch.from_numpy(_random((m, k))), torch.from_numpy(_random((k, n)))
  return lambda: torch.mm(a, b)


def xla_product(m, k, n):
  a, b = jax.device_put(_random((m, k))), jax.device_put(_random((k, n)))
  dot = jax.jit(lambda x, y: x @ y)
  return lambda: dot(a, b).block_until_ready()


def seconds_per_step(loop, steps: int) -> tuple:
  t0 = time.perf_counter()
  loss = loop.run(steps)
  return (time.perf_counter() - t0) / steps, loss


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--models", default="gpt_tiny,gpt_25m")
  parser.add_argument("--dtypes", default="bfloat16,float32", help="t5x_like compute dtypes (bfloat16 = default)")
  parser.add_argument("--vocab", type=int, default=8192)
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--seq", type=int, default=256)
  parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--warmup", type=int, default=3)
  parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
  parser.add_argument("--attention_impl", default="", help="t5x_like GPTConfig.attention_impl; '' = the config's")
  parser.add_argument("--torch_allocator", default="default", choices=("default", "same"),
                      help="the PyTorch process's malloc: glibc's defaults, or t5x_like's settings (host_allocator)")
  parser.add_argument("--torch_worker", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.torch_worker:
    return torch_worker(args)
  t5x_malloc = "jemalloc" if host_allocator.jemalloc_loaded() else "glibc, freed memory kept"
  print(f"torch {torch.__version__} ({args.threads} threads, malloc: {args.torch_allocator}); t5x_like malloc: "
        f"{t5x_malloc}, dispatching ahead: {train_throughput.trainer.StepGate().ahead}; {os.cpu_count()} cores; "
        f"load average {os.getloadavg()[0]:.2f} at start; batch {args.batch} × {args.seq}\n")
  print("| model | params | t5x_like dtype | t5x_like tokens/s | PyTorch float32 tokens/s | ratio | loss t5x / torch | "
        "RSS t5x_like / PyTorch GiB |")
  print("|---|---:|---|---:|---:|---:|---|---|")
  tokens = args.batch * args.seq
  gemm_lines = []
  for name in args.models.split(","):
    torch_loop, torch_seconds, rows = None, math.inf, []
    for dtype in args.dtypes.split(","):
      overrides = {"attention_impl": args.attention_impl} if args.attention_impl else {}
      cfg = train_throughput.model_config(name, dtype=dtype, vocab_size=args.vocab, **overrides)
      if torch_loop is None:
        torch_loop = TorchProcess(args, name, same_allocator=args.torch_allocator == "same")
      t5x_loop, t5x_seconds = T5xLoop(cfg, args.batch, args.seq), math.inf
      t5x_loop.run(args.warmup)
      for _ in range(args.rounds):  # alternate: one t5x_like round, one PyTorch round
        seconds, t5x_loss = seconds_per_step(t5x_loop, args.steps)
        t5x_seconds = min(t5x_seconds, seconds)
        seconds, torch_loss = torch_loop.run(args.steps)
        torch_seconds = min(torch_seconds, seconds)
      # resident memory after the rounds: the PyTorch worker's own; this process's holds every loop built so far
      rows.append((dtype, model_lib.count_params(cfg), t5x_seconds, t5x_loss, torch_loss, rss_gib(),
                   torch_loop.rss_gib()))
    shapes = gemm_shapes(cfg, tokens)
    gemm_lines.append(f"{name}: XLA {gemm_rate(xla_product, shapes):.0f}, PyTorch {torch_loop.gemm_rate():.0f} GFLOP/s")
    torch_loop.close()
    for dtype, params, t5x_seconds, t5x_loss, torch_loss, t5x_rss, torch_rss in rows:  # against PyTorch's best round
      print(f"| {name} | {params / 1e6:.1f}M | {dtype} | {tokens / t5x_seconds:,.0f} | "
            f"{tokens / torch_seconds:,.0f} | {torch_seconds / t5x_seconds:.2f}× | "
            f"{t5x_loss:.2f} / {torch_loss:.2f} | {t5x_rss:.2f} / {torch_rss:.2f} |", flush=True)
  print(f"\nfloat32 GEMMs alone on the forward's dense shapes ({args.threads} threads): " + "; ".join(gemm_lines))
  print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
  main()
