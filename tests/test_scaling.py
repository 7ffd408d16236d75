"""Scaling-law fits: a known law plus noise is recovered; runs are read as (N, D, loss); bad runs are refused."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from scipy import optimize

from tests import conftest
from tests import forkserver

from t5x_like.experiments import sweep
from t5x_like.planning import scaling_law
from t5x_like.planning import scaling_runs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRUE = scaling_law.Fit(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)  # Chinchilla's published fit
SIZES = [2e5, 6e5, 2e6, 6e6, 2e7]


def _noisy_grid(noise=0.003, seed=0):
  rng = np.random.default_rng(seed)
  n = np.repeat(SIZES, 6)
  d = np.tile([2e6, 6e6, 2e7, 6e7, 2e8, 6e8], len(SIZES))
  return n, d, TRUE.loss(n, d) * np.exp(rng.normal(0.0, noise, n.shape))  # multiplicative noise, 0.3%


@pytest.fixture(scope="module")
def noisy_fit():
  """The noisy grid and its fit (deterministic), shared by the fit and bootstrap tests."""
  n, d, loss = _noisy_grid()
  return n, d, loss, scaling_law.fit(n, d, loss)


def test_fit_recovers_known_exponents_within_10_percent(noisy_fit):
  n, d, loss, fit = noisy_fit
  assert abs(fit.alpha / TRUE.alpha - 1) < 0.10, fit
  assert abs(fit.beta / TRUE.beta - 1) < 0.10, fit
  assert abs(fit.E / TRUE.E - 1) < 0.10, fit
  assert np.max(np.abs(fit.loss(n, d) / loss - 1)) < 0.02  # it fits the points, within the noise
  assert fit.objective < 1e-3


def test_bootstrap_intervals_cover_the_true_exponents(noisy_fit):
  n, d, loss, fit = noisy_fit
  boot = scaling_law.bootstrap(n, d, loss, fit, samples=12, seed=1, groups=np.repeat(np.arange(len(SIZES)), 6))
  for name in ("alpha", "beta"):
    low, high, std = boot[name]
    assert low <= getattr(fit, name) <= high and 0 < std < 0.1 * getattr(fit, name), (name, boot[name])


def test_compute_optimal_split_minimises_the_loss_at_the_budget():
  flops = 1e20
  n_opt, d_opt = TRUE.compute_optimal(flops)
  assert np.isclose(6 * n_opt * d_opt, flops, rtol=1e-9)
  # the numerical minimum over N of L(N, C / 6N)
  best = optimize.minimize_scalar(lambda log_n: TRUE.loss(np.exp(log_n), flops / (6 * np.exp(log_n))),
                                  bounds=(np.log(1e6), np.log(1e12)), method="bounded", options={"xatol": 1e-9})
  assert np.isclose(n_opt, np.exp(best.x), rtol=1e-3), (n_opt, np.exp(best.x))


def test_isoflop_grid_spends_the_budget_at_each_size():
  grid = scaling_law.isoflop_grid({"s": 1e5, "m": 4e5, "l": 4e7}, 1e12, 2048)
  assert [name for name, _, _ in grid] == ["s", "m"]  # l would get 2 steps (< 10)
  for _, params, steps in grid:
    assert abs(6 * params * steps * 2048 / 1e12 - 1) < 0.01


def fake_run(model_dir, params, evals, batch=16, seq_len=128):
  """A MODEL_DIR as train leaves it, for the reader: config.gin's macros and metrics.jsonl's records."""
  os.makedirs(model_dir, exist_ok=True)
  with open(os.path.join(model_dir, "config.gin"), "w") as f:
    f.write(f"BATCH_SIZE = {batch}\nSEQ_LEN = {seq_len}\nTrainConfig.batch_size = %BATCH_SIZE\n"
            f"TrainConfig.seq_len = %SEQ_LEN\n")
  with open(os.path.join(model_dir, "metrics.jsonl"), "w") as f:
    f.write(json.dumps({"step": 0, "params/total": params, "params/trainable": params}) + "\n")
    for step, loss in evals:
      f.write(json.dumps({"step": step, "loss": loss + 0.1}) + "\n")
      f.write(json.dumps({"step": step, "eval/loss": loss}) + "\n")


def _law_runs(root, sizes=SIZES):
  dirs = []
  for i, n in enumerate(sizes):
    steps = [100, 300, 1000, 3000]
    dirs.append(str(root / f"run{i}"))
    fake_run(dirs[-1], int(n), [(s, float(TRUE.loss(int(n), s * 16 * 128))) for s in steps])
  return dirs


def test_runs_are_read_as_params_tokens_and_eval_loss(tmp_path):
  dirs = _law_runs(tmp_path)
  points = scaling_runs.load_points(dirs)
  assert len(points.loss) == 4 * len(SIZES)
  assert points.d[:4].tolist() == [100 * 2048, 300 * 2048, 1000 * 2048, 3000 * 2048]  # step × batch × seq_len
  assert points.n[:4].tolist() == [SIZES[0]] * 4 and points.run[4] == 1
  final = scaling_runs.load_points(dirs, final_only=True)
  assert final.d.tolist() == [3000 * 2048] * len(SIZES)


def test_too_few_sizes_and_runs_without_eval_loss_are_one_line_errors_naming_the_run(tmp_path):
  dirs = _law_runs(tmp_path, sizes=SIZES[:2])
  with pytest.raises(ValueError, match=f"at least 3 model sizes, got 2 \\({re.escape(dirs[0])}: N=200,000, "):
    scaling_runs.load_points(dirs)
  fake_run(str(tmp_path / "no_eval"), 1000, [])
  with pytest.raises(ValueError, match=f"run {re.escape(str(tmp_path / 'no_eval'))}: metrics.jsonl has no eval/loss"):
    scaling_runs.load_points(dirs + [str(tmp_path / "no_eval")])
  with pytest.raises(ValueError, match="run /no/such/run: no metrics.jsonl"):
    scaling_runs.load_points(["/no/such/run"])


def _scaling(*args) -> subprocess.Popen:
  return forkserver.Popen([sys.executable, "-m", "t5x_like.scaling", *args], cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)


@pytest.mark.slow  # CLI launches
def test_cli_fit_prints_the_law_and_the_compute_optimum(tmp_path):
  """Exact losses of the known law at 5 sizes × 4 evaluations: the CLI recovers its exponents and optimum; `plan`
  reads the saved fit; too few sizes is a one-line error (that launch runs alongside `fit`)."""
  dirs = _law_runs(tmp_path)
  extra = str(tmp_path / "held")  # a sixth size, left out of the fit and predicted
  fake_run(extra, 60_000_000, [(s, float(TRUE.loss(60_000_000, s * 16 * 128))) for s in (100, 300, 1000, 3000)])
  fitting = _scaling("fit", f"--runs={tmp_path}/run*,{extra}", f"--holdout={extra}", "--flops=1e20", "--bootstrap=4",
                     f"--save={tmp_path}/fit.json", f"--plot={tmp_path}/fit.png")
  bad = conftest.finished(_scaling("fit", f"--runs={dirs[0]},{dirs[1]}"))
  out = conftest.finished(fitting)
  assert out.returncode == 0, out.stderr[-2000:]
  alpha = float(re.search(r"alpha = (\S+)", out.stdout).group(1))
  beta = float(re.search(r"beta  = (\S+)", out.stdout).group(1))
  assert abs(alpha / TRUE.alpha - 1) < 0.02 and abs(beta / TRUE.beta - 1) < 0.02, out.stdout
  n_opt = float(re.search(r"N = ([\d,]+) parameters", out.stdout).group(1).replace(",", ""))
  assert abs(n_opt / TRUE.compute_optimal(1e20)[0] - 1) < 0.1, out.stdout
  assert f"{len(dirs)} runs (5 sizes)" in out.stdout
  held = re.search(r"held-out run \(last eval\).*\n  (\S+): N=60,000,000 .* (\S+)%", out.stdout)
  assert held.group(1) == extra + ":" or held.group(1) == extra, out.stdout
  assert abs(float(held.group(2))) < 1.0, out.stdout  # exact losses of the law: the prediction is within 1%
  assert (tmp_path / "fit.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  plan = conftest.finished(_scaling("plan", f"--fit={tmp_path}/fit.json", "--flops=1e20"))
  assert plan.returncode == 0 and re.search(r"N = ([\d,]+) parameters", plan.stdout).group(1) == f"{n_opt:,.0f}"
  assert bad.returncode == 1 and bad.stderr.startswith("error: a fit needs runs of at least 3 model sizes")
  assert len(bad.stderr.strip().splitlines()) == 1


def test_isoflop_sweep_command_is_a_valid_sweep_spending_each_budget(tmp_path):
  """The printed grid parses and plans as a sweep of the demo config (every key a gin binding), and each run's
  6·N·steps·tokens is the budget it was laid out for."""
  text = scaling_runs.isoflop_sweep_command([3e11, 1e12], 4096, 512, 16, 128, "configs/experiments/pystdlib_demo.gin",
                                            str(tmp_path / "iso"))
  spec = re.search(r'--grid="([^"]+)"', text).group(1)
  grid = sweep.parse_grid([spec])
  overrides = [b.split("=", 1)[0][len("--gin."):] + " = " + b.split("=", 1)[1]
               for b in re.findall(r"--gin\.\S+", text)]
  runs = sweep.plan(["configs/experiments/pystdlib_demo.gin"], overrides, ["."], grid, str(tmp_path / "iso"))
  sizes = scaling_runs.cpu_sizes(4096, 512)
  by_shape = {(s["d_model"], s["num_layers"]): name for name, s in scaling_runs.CPU_SIZES.items()}
  budgets = []
  for run in runs:
    values = dict(run.values)
    params = sizes[by_shape[(values["model.GPTConfig.d_model"], values["model.GPTConfig.num_layers"])]]
    budgets.append(6 * params * run.train_steps * run.tokens_per_step)
    assert run.tokens_per_step == 16 * 128 and values["EVAL_EVERY"] == run.train_steps // 4
  assert len(runs) == 10 and all(min(abs(b / c - 1) for c in (3e11, 1e12)) < 0.05 for b in budgets), budgets


def test_saved_fit_plans_a_budget(tmp_path):
  scaling_law.save(TRUE, str(tmp_path / "fit.json"))
  loaded = scaling_law.load(str(tmp_path / "fit.json"))
  assert [getattr(loaded, k) for k in "E A B alpha beta".split()] == [getattr(TRUE, k) for k in "E A B alpha beta".split()]
  (tmp_path / "bad.json").write_text('{"E": 1.0}')
  with pytest.raises(ValueError, match="--fit=.*bad.json: not a scaling-law fit"):
    scaling_law.load(str(tmp_path / "bad.json"))
