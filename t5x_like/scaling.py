"""`python -m t5x_like.scaling fit|sweep`: scaling-law fits L(N, D) = E + A/N^α + B/D^β and IsoFLOP grids.

    # fit the eval losses of finished runs of ≥ 3 model sizes; the optimum at a FLOP budget
    python -m t5x_like.scaling fit --runs=sweeps/iso/* --flops=1e18
    # the compute-optimal split of a budget from a saved fit
    python -m t5x_like.scaling fit --runs=sweeps/iso/* --save=fit.json && python -m t5x_like.scaling plan --fit=fit.json --flops=1e15
    # lay out an IsoFLOP grid (sizes × steps) that trains on a CPU in minutes, as a sweep command
    python -m t5x_like.scaling sweep --flops=3e11,1e12 --output_dir=sweeps/iso

The fit (Chinchilla's approach 3) is in t5x_like/planning/scaling_law.py, the run reading and the grid in
t5x_like/planning/scaling_runs.py; docs/experiments.md describes both.
"""

import glob

from absl import flags

from t5x_like import cli
from t5x_like.planning import scaling_law
from t5x_like.planning import scaling_runs

COMMANDS = ("fit", "plan", "sweep")


def define_flags():
  flags.DEFINE_list("runs", [], "fit: MODEL_DIRs of finished runs (glob patterns allowed), ≥ 3 model sizes.")
  flags.DEFINE_list("holdout", [], "fit: MODEL_DIRs (globs) left out of the fit; their last eval loss is predicted.")
  flags.DEFINE_list("flops", [], "fit: FLOP budget(s) for the compute-optimal N and D; sweep: the IsoFLOP budgets.")
  flags.DEFINE_integer("bootstrap", 100, "fit: bootstrap resamples (of whole runs) for the parameters' intervals.")
  flags.DEFINE_bool("final_only", False, "fit: only each run's last evaluation (default: every evaluation, with "
                    "D = tokens seen there).")
  flags.DEFINE_integer("seed", 0, "fit: the bootstrap's seed.")
  flags.DEFINE_string("plot", None, "fit: PNG of the runs' eval losses and the fitted curves.")
  flags.DEFINE_string("save", None, "fit: also write the fit (and its bootstrap intervals) to this JSON file.")
  flags.DEFINE_string("fit", None, "plan: a JSON fit written by `fit --save`.")
  flags.DEFINE_string("gin_file", "configs/experiments/pystdlib_demo.gin", "sweep: the run's gin file.")
  flags.DEFINE_string("output_dir", "sweeps/isoflop", "sweep: the sweep's --output_dir.")
  flags.DEFINE_integer("vocab_size", 4096, "sweep: vocabulary of the sized models (the built-in corpus: 4096).")
  flags.DEFINE_integer("max_len", 512, "sweep: GPTConfig.max_len of the gin file (gpt_tiny: 512).")
  flags.DEFINE_integer("batch_size", 16, "sweep: BATCH_SIZE.")
  flags.DEFINE_integer("seq_len", 128, "sweep: SEQ_LEN.")


def _budgets() -> list:
  try:
    return [float(x) for x in flags.FLAGS.flops]
  except ValueError:
    raise ValueError(f"--flops={','.join(flags.FLAGS.flops)}: expected numbers such as 1e12") from None


def main(argv):
  if len(argv) != 2 or argv[1] not in COMMANDS:
    raise ValueError(f"expected one command, {' or '.join(COMMANDS)}: python -m t5x_like.scaling fit --runs=DIR,...")
  f = flags.FLAGS
  if argv[1] == "fit":
    held = [path for pattern in f.holdout for path in (sorted(glob.glob(pattern)) or [pattern])]
    runs = [path for pattern in f.runs for path in (sorted(glob.glob(pattern)) or [pattern]) if path not in held]
    points = scaling_runs.load_points(runs, f.final_only)
    held_out = scaling_runs.load_points(held, f.final_only, min_sizes=1) if held else None
    fit = scaling_law.fit(points.n, points.d, points.loss)
    boot = scaling_law.bootstrap(points.n, points.d, points.loss, fit, f.bootstrap, f.seed, groups=points.run)
    for i, budget in enumerate(_budgets() or [0.0]):
      text = scaling_runs.report(fit, boot, points, budget, held_out)
      print(text if i == 0 else text.splitlines()[-1], flush=True)
    if f.plot:
      print(f"plot written to {scaling_runs.plot_fit(fit, points, f.plot, held_out)}", flush=True)
    if f.save:
      scaling_law.save(fit, f.save, {"bootstrap_5_95_std": boot, "runs": list(points.names)})
      print(f"fit written to {f.save}", flush=True)
  elif argv[1] == "plan":
    if not f.fit or not _budgets():
      raise ValueError("plan: give --fit=FIT.json (from `scaling fit --save`) and --flops=C[,C2,...]")
    fit = scaling_law.load(f.fit)
    for budget in _budgets():
      n_opt, d_opt = fit.compute_optimal(budget)
      print(f"C = {budget:.3g} FLOPs: N = {n_opt:,.0f} parameters, D = {d_opt:,.0f} tokens "
            f"({d_opt / n_opt:.1f} tokens/parameter), predicted loss {fit.loss(n_opt, d_opt):.4f}", flush=True)
  else:
    budgets = _budgets()
    if not budgets:
      raise ValueError("sweep: give --flops=C[,C2,...], e.g. --flops=3e11,1e12")
    print(scaling_runs.isoflop_sweep_command(budgets, f.vocab_size, f.max_len, f.batch_size, f.seq_len, f.gin_file,
                                             f.output_dir), flush=True)


if __name__ == "__main__":
  define_flags()
  cli.run(main)
