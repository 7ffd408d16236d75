"""Scaling-law data from finished runs (N, D and eval loss of each MODEL_DIR), the fit's report, and IsoFLOP grids.

N is the run's parameter count (`params/total` of metrics.jsonl's start-up report); D at each evaluation is
step × BATCH_SIZE × SEQ_LEN (from MODEL_DIR/config.gin, the operative config train wrote).
"""

import dataclasses
import re

from etils import epath
import numpy as np

from t5x_like.model import decoder
from t5x_like.observe import plots
from t5x_like.planning import scaling_law

MIN_SIZES = 3  # distinct model sizes a fit needs (E, A, α are not separable with fewer)
# Model sizes of an IsoFLOP sweep on a CPU (gpt_tiny's family: d_ff = 4·d_model, 16-wide heads).
CPU_SIZES = {
    "d32_l1": dict(d_model=32, num_layers=1, num_heads=2, d_ff=128),
    "d48_l2": dict(d_model=48, num_layers=2, num_heads=3, d_ff=192),
    "d64_l2": dict(d_model=64, num_layers=2, num_heads=4, d_ff=256),
    "d96_l3": dict(d_model=96, num_layers=3, num_heads=6, d_ff=384),
    "d128_l4": dict(d_model=128, num_layers=4, num_heads=8, d_ff=512),
}


@dataclasses.dataclass(frozen=True)
class Points:
  """One entry per (run, evaluation)."""
  n: np.ndarray  # parameters
  d: np.ndarray  # training tokens seen at the evaluation
  loss: np.ndarray  # eval loss there
  run: np.ndarray  # index into `names`
  names: tuple  # the MODEL_DIRs


def _config_int(model_dir: str, field: str, macro: str) -> int:
  """TrainConfig.<field> from MODEL_DIR/config.gin, following a %MACRO reference."""
  path = epath.Path(model_dir) / "config.gin"
  if not path.exists():
    raise ValueError(f"run {model_dir}: no config.gin (is it a MODEL_DIR that trained?)")
  text = path.read_text()
  match = re.search(rf"^(?:trainer\.)?TrainConfig\.{field}\s*=\s*(\S+)", text, re.M)
  value = match.group(1) if match else f"%{macro}"
  if value.startswith("%"):
    match = re.search(rf"^{re.escape(value[1:])}\s*=\s*(\d+)", text, re.M)
    if not match:
      raise ValueError(f"run {model_dir}: config.gin has no value for TrainConfig.{field}")
    value = match.group(1)
  return int(value)


def load_points(model_dirs, final_only: bool = False, min_sizes: int = MIN_SIZES) -> Points:
  """The eval points of each run (only its last with final_only); a run without eval loss or without a
  start-up report, or fewer than MIN_SIZES distinct sizes, is a ValueError naming the run(s)."""
  if not model_dirs:
    raise ValueError("no --runs given: pass the MODEL_DIRs of finished runs of several model sizes")
  n, d, loss, run = [], [], [], []
  for i, model_dir in enumerate(model_dirs):
    try:
      records = plots.read_records(model_dir)
    except FileNotFoundError:
      raise ValueError(f"run {model_dir}: no metrics.jsonl") from None
    params = plots.series(records, "params/total")[1]
    if not params:
      raise ValueError(f"run {model_dir}: metrics.jsonl has no start-up report (params/total)")
    steps, losses = plots.series(records, "eval/loss")
    steps_losses = [(s, l) for s, l in zip(steps, losses) if s > 0]
    if not steps_losses:
      raise ValueError(f"run {model_dir}: metrics.jsonl has no eval/loss after step 0")
    if final_only:
      steps_losses = steps_losses[-1:]
    tokens_per_step = _config_int(model_dir, "batch_size", "BATCH_SIZE") * _config_int(model_dir, "seq_len", "SEQ_LEN")
    for step, value in steps_losses:
      n.append(params[-1])
      d.append(step * tokens_per_step)
      loss.append(value)
      run.append(i)
  sizes = sorted(set(n))
  if len(sizes) < min_sizes:
    by_size = ", ".join(f"{model_dirs[run[n.index(s)]]}: N={int(s):,}" for s in sizes)
    raise ValueError(f"a fit needs runs of at least {min_sizes} model sizes, got {len(sizes)} ({by_size})")
  return Points(np.array(n, np.float64), np.array(d, np.float64), np.array(loss, np.float64), np.array(run),
                tuple(model_dirs))


def _last_points(fit: scaling_law.Fit, points: Points, title: str) -> list:
  lines = [f"{title} (last eval): N, D, measured, predicted, error"]
  for i, name in enumerate(points.names):
    last = np.flatnonzero(points.run == i)[-1]
    predicted = fit.loss(points.n[last], points.d[last])
    lines.append(f"  {name}: N={points.n[last]:,.0f} D={points.d[last]:,.0f} {points.loss[last]:.4f} "
                 f"{predicted:.4f} {100 * (predicted / points.loss[last] - 1):+.2f}%")
  return lines


def report(fit: scaling_law.Fit, boot: dict, points: Points, flops: float = 0.0, held_out: Points = None) -> str:
  """The fit, its bootstrap 90% intervals, each run's residual at its last point (and each held-out run's:
  measured against predicted), and the optimum at `flops`."""
  lines = [f"L(N, D) = E + A/N^alpha + B/D^beta fitted to {len(points.loss)} eval points of "
           f"{len(points.names)} runs ({len(set(points.n.tolist()))} sizes); Huber objective {fit.objective:.3g}"]
  for name in ("E", "A", "B", "alpha", "beta"):
    low, high, std = boot[name] if boot else (float("nan"),) * 3
    lines.append(f"  {name:5s} = {getattr(fit, name):.4g}   90% bootstrap interval [{low:.4g}, {high:.4g}], "
                 f"std {std:.3g}")
  lines += _last_points(fit, points, "fitted run")
  if held_out is not None:
    lines += _last_points(fit, held_out, "held-out run")
  if flops > 0:
    n_opt, d_opt = fit.compute_optimal(flops)
    lines.append(f"compute-optimal at C = {flops:.3g} FLOPs (C ≈ 6ND): N = {n_opt:,.0f} parameters, "
                 f"D = {d_opt:,.0f} tokens ({d_opt / n_opt:.1f} tokens/parameter), "
                 f"predicted loss {fit.loss(n_opt, d_opt):.4f}")
  return "\n".join(lines)


def cpu_sizes(vocab_size: int, max_len: int) -> dict:
  """{name: parameters} of CPU_SIZES at a vocabulary (tied embeddings, as gpt_tiny)."""
  return {name: decoder.count_params(decoder.GPTConfig(vocab_size=vocab_size, max_len=max_len, tie_embeddings=True,
                                                       **shape))
          for name, shape in CPU_SIZES.items()}


def isoflop_sweep_command(flops_budgets, vocab_size: int, max_len: int, batch_size: int, seq_len: int,
                          gin_file: str, output_dir: str, evals: int = 4) -> str:
  """The model sizes × steps of an IsoFLOP grid (a table) and the `python -m t5x_like.sweep` command that trains
  them: one zipped grid axis of (d_model, num_layers, num_heads, d_ff, TRAIN_STEPS, EVAL_EVERY), `evals`
  evaluations per run, warmup a tenth of the shortest run."""
  sizes = cpu_sizes(vocab_size, max_len)
  tokens_per_step = batch_size * seq_len
  shortest, rows, values = 10**9, [f"{'budget':>9s} {'size':8s} {'params':>10s} {'steps':>6s} {'tokens':>12s}"], []
  for flops in flops_budgets:
    for name, params, steps in scaling_law.isoflop_grid(sizes, flops, tokens_per_step):
      rows.append(f"{flops:9.3g} {name:8s} {params:10,d} {steps:6d} {steps * tokens_per_step:12,d}")
      shape = CPU_SIZES[name]
      every = max(1, steps // evals)
      values.append(f"({shape['d_model']},{shape['num_layers']},{shape['num_heads']},{shape['d_ff']},{steps},{every})")
      shortest = min(shortest, steps)
  if not values:
    raise ValueError(f"--flops={list(flops_budgets)}: no size of {list(sizes)} gets 10 steps; raise the budget")
  keys = ("model.GPTConfig.d_model,model.GPTConfig.num_layers,model.GPTConfig.num_heads,model.GPTConfig.d_ff,"
          "TRAIN_STEPS,EVAL_EVERY")
  command = (f"python -m t5x_like.sweep --gin_file={gin_file} --output_dir={output_dir} \\\n"
             f"    --gin.BATCH_SIZE={batch_size} --gin.SEQ_LEN={seq_len} --gin.LOG_EVERY=10 \\\n"
             f"    --gin.optimizer.OptimizerConfig.warmup_steps={max(1, shortest // 10)} "
             f"--gin.model.GPTConfig.vocab_size={vocab_size} \\\n"
             f"    --grid=\"({keys})=[{','.join(values)}]\"")
  return "\n".join(rows) + "\n\n" + command


def plot_fit(fit: scaling_law.Fit, points: Points, out: str, held_out: Points = None, dpi: int = 110) -> str:
  """Eval loss against tokens, one colour per run (hollow markers: held out), with the fitted L(N, D) of each
  run's N as a line; returns the PNG's path."""
  if plots.plt is None:
    raise ImportError("--plot needs matplotlib: pip install 't5x_like[plot]'")
  fig, ax = plots.plt.subplots(figsize=(8, 5))
  colours = plots.plt.get_cmap("viridis")
  groups = [(points, False)] + ([(held_out, True)] if held_out is not None else [])
  sizes = sorted({float(n) for g, _ in groups for n in g.n})
  for group, held in groups:
    for i, name in enumerate(group.names):
      pick = group.run == i
      n, d, loss = group.n[pick][0], group.d[pick], group.loss[pick]
      colour = colours(sizes.index(float(n)) / max(1, len(sizes) - 1))
      ax.plot(d, loss, "o", color=colour, markerfacecolor="none" if held else colour,
              label=f"N={n:,.0f}{' (held out)' if held else ''}")
      grid = np.geomspace(d.min(), d.max(), 50)
      ax.plot(grid, fit.loss(n, grid), "--" if held else "-", color=colour, linewidth=1)
  ax.set_xscale("log")
  ax.set_xlabel("training tokens D")
  ax.set_ylabel("eval loss (nats/token)")
  ax.set_title(f"L(N, D) = {fit.E:.3g} + {fit.A:.3g}/N^{fit.alpha:.3g} + {fit.B:.3g}/D^{fit.beta:.3g}")
  ax.grid(alpha=0.3, which="both")
  ax.legend(fontsize="small")
  fig.tight_layout()
  return plots.save_figure(fig, out, dpi)
