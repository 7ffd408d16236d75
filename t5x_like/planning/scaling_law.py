"""Scaling-law fits L(N, D) = E + A/N^α + B/D^β (Chinchilla's approach 3), their bootstrap and the compute optimum.

The fit minimises Σ Huber_δ(LSE(a − α·log N, b − β·log D, e) − log L) over (a, b, e, α, β) with A = e^a,
B = e^b, E = e^e (Hoffmann et al. 2022, appendix D.2: δ = 1e-3, L-BFGS-B, the best of many starts). The
starts are the best points of a grid over the five parameters, each refined by SciPy's L-BFGS-B with the
analytic gradient. With C ≈ 6·N·D FLOPs, the loss-minimising split of a budget C is

    N_opt = G·(C/6)^(β/(α+β)),  D_opt = (C/6)^(α/(α+β)) / G,  G = (α·A / (β·B))^(1/(α+β)).
"""

import dataclasses
import itertools
import json
import math
from typing import Optional

from etils import epath
import numpy as np
from scipy import optimize
from scipy import special

HUBER_DELTA = 1e-3
# The start grid (Chinchilla's, coarser): exponents, log E and log A / log B.
GRID = {"alpha": (0.1, 0.3, 0.6, 1.0, 1.5), "beta": (0.1, 0.3, 0.6, 1.0, 1.5), "e": (-1.0, -0.5, 0.0, 0.5, 1.0),
        "a": (0.0, 5.0, 10.0, 15.0, 20.0, 25.0), "b": (0.0, 5.0, 10.0, 15.0, 20.0, 25.0)}
REFINED_STARTS = 16  # grid points (lowest objective first) refined by L-BFGS-B


@dataclasses.dataclass(frozen=True)
class Fit:
  """L(N, D) = E + A/N^alpha + B/D^beta."""
  E: float
  A: float
  B: float
  alpha: float
  beta: float
  objective: float = float("nan")  # the Huber objective at the optimum

  def loss(self, n, d):
    """The predicted loss at N parameters and D tokens (scalars or arrays)."""
    return self.E + self.A / np.power(n, self.alpha) + self.B / np.power(d, self.beta)

  def compute_optimal(self, flops: float) -> tuple:
    """(N_opt, D_opt) minimising the loss at C = 6·N·D = `flops`."""
    g = (self.alpha * self.A / (self.beta * self.B)) ** (1.0 / (self.alpha + self.beta))
    c6 = flops / 6.0
    return g * c6 ** (self.beta / (self.alpha + self.beta)), c6 ** (self.alpha / (self.alpha + self.beta)) / g


def save(fit_: Fit, path: str, extra: Optional[dict] = None) -> None:
  """Writes the fit (and e.g. its bootstrap) as JSON."""
  epath.Path(path).write_text(json.dumps({**dataclasses.asdict(fit_), **(extra or {})}, indent=1))


def load(path: str) -> Fit:
  """A fit written by save(); a missing field is a ValueError naming the file."""
  try:
    data = json.loads(epath.Path(path).read_text())
    return Fit(**{f.name: float(data[f.name]) for f in dataclasses.fields(Fit) if f.name != "objective"})
  except FileNotFoundError:
    raise ValueError(f"--fit={path}: no such file (write one with `scaling fit --save={path}`)") from None
  except (KeyError, TypeError, ValueError) as e:
    raise ValueError(f"--fit={path}: not a scaling-law fit ({type(e).__name__}: {e})") from None


def _huber(r, delta):
  """(Huber_δ(r), its derivative), elementwise."""
  small = np.abs(r) <= delta
  return np.where(small, 0.5 * r * r, delta * (np.abs(r) - 0.5 * delta)), np.where(small, r, delta * np.sign(r))


def _objective(theta, log_n, log_d, log_l, delta):
  """Σ Huber_δ(LSE − log L) and its gradient over θ = (a, b, e, α, β)."""
  a, b, e, alpha, beta = theta
  terms = np.stack([a - alpha * log_n, b - beta * log_d, np.full_like(log_n, e)])  # (3, P)
  lse = special.logsumexp(terms, axis=0)  # (P,)
  value, slope = _huber(lse - log_l, delta)
  w = np.exp(terms - lse) * slope  # (3, P): ∂Huber/∂term
  grad = np.array([w[0].sum(), w[1].sum(), w[2].sum(), -(w[0] * log_n).sum(), -(w[1] * log_d).sum()])
  return float(value.sum()), grad


def _grid_starts(log_n, log_d, log_l, delta, count: int) -> np.ndarray:
  """The `count` grid points with the lowest objective (evaluated all at once)."""
  points = np.array(list(itertools.product(GRID["a"], GRID["b"], GRID["e"], GRID["alpha"], GRID["beta"])))  # (G, 5)
  a, b, e, alpha, beta = (points[:, i:i + 1] for i in range(5))
  terms = np.stack([a - alpha * log_n, b - beta * log_d, np.broadcast_to(e, (len(points), len(log_n)))])
  values = _huber(special.logsumexp(terms, axis=0) - log_l, delta)[0].sum(axis=1)  # (G,)
  return points[np.argsort(values)[:count]]


def _refine(start, log_n, log_d, log_l, delta):
  bounds = [(None, None), (None, None), (None, None), (0.0, 5.0), (0.0, 5.0)]
  return optimize.minimize(_objective, start, args=(log_n, log_d, log_l, delta), jac=True, method="L-BFGS-B",
                           bounds=bounds, options={"maxiter": 2000, "ftol": 1e-15, "gtol": 1e-12})


def fit(n, d, loss, delta: float = HUBER_DELTA, starts: Optional[np.ndarray] = None) -> Fit:
  """Fits E, A, B, α, β to losses `loss` measured at N = `n` parameters and D = `d` tokens.

  Args:
    n, d, loss: 1-D arrays of equal length (one entry per eval point), all positive.
    delta: the Huber loss's threshold on log L residuals.
    starts: (S, 5) rows of (log A, log B, log E, α, β) to refine; default the best REFINED_STARTS grid points.

  Returns:
    The best fit over all starts.
  """
  n, d, loss = (np.asarray(x, np.float64) for x in (n, d, loss))
  if not (n.shape == d.shape == loss.shape and n.ndim == 1):
    raise ValueError(f"n, d and loss must be 1-D arrays of one length, got shapes {n.shape}, {d.shape}, {loss.shape}")
  if np.any(n <= 0) or np.any(d <= 0) or np.any(loss <= 0) or not np.all(np.isfinite(loss)):
    raise ValueError("every N, D and loss must be positive and finite")
  log_n, log_d, log_l = np.log(n), np.log(d), np.log(loss)
  if starts is None:
    starts = _grid_starts(log_n, log_d, log_l, delta, REFINED_STARTS)
  best = min((_refine(s, log_n, log_d, log_l, delta) for s in starts), key=lambda r: r.fun)
  a, b, e, alpha, beta = best.x
  return Fit(E=math.exp(e), A=math.exp(a), B=math.exp(b), alpha=float(alpha), beta=float(beta),
             objective=float(best.fun))


def bootstrap(n, d, loss, best: Fit, samples: int = 100, seed: int = 0, groups=None) -> dict:
  """Refits on `samples` resamples with replacement, each started from `best` and the best grid point.

  Args:
    groups: an id per point (e.g. the run it came from): whole groups are resampled, since one run's eval
      points are not independent; default each point alone.

  Returns:
    {parameter: (5th percentile, 95th percentile, standard deviation)} for E, A, B, alpha, beta.
  """
  n, d, loss = (np.asarray(x, np.float64) for x in (n, d, loss))
  groups = np.arange(len(n)) if groups is None else np.asarray(groups)
  ids = np.unique(groups)
  rng = np.random.default_rng(seed)
  base = np.array([math.log(best.A), math.log(best.B), math.log(best.E), best.alpha, best.beta])
  fits = []
  for _ in range(samples):
    pick = np.concatenate([np.flatnonzero(groups == g) for g in rng.choice(ids, size=len(ids))])
    log_n, log_d, log_l = np.log(n[pick]), np.log(d[pick]), np.log(loss[pick])
    starts = np.vstack([base[None], _grid_starts(log_n, log_d, log_l, HUBER_DELTA, 1)])
    fits.append(fit(n[pick], d[pick], loss[pick], starts=starts))
  out = {}
  for name in ("E", "A", "B", "alpha", "beta"):
    values = np.array([getattr(f, name) for f in fits])
    out[name] = (float(np.percentile(values, 5)), float(np.percentile(values, 95)), float(values.std()))
  return out


def isoflop_grid(sizes: dict, flops: float, tokens_per_step: int, min_steps: int = 10) -> list:
  """[(name, N, steps), ...]: for each model size (name → parameters), the steps that spend `flops` at
  6·N·tokens_per_step FLOPs per step; sizes needing fewer than `min_steps` steps are left out."""
  if flops <= 0 or tokens_per_step <= 0:
    raise ValueError(f"flops ({flops}) and tokens per step ({tokens_per_step}) must be positive")
  out = []
  for name, params in sorted(sizes.items(), key=lambda kv: kv[1]):
    steps = int(round(flops / (6.0 * params * tokens_per_step)))
    if steps >= min_steps:
      out.append((name, params, steps))
  return out
