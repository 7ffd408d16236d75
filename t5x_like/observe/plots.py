"""Loss, learning-rate and throughput curves of one or more runs (MODEL_DIR/metrics.jsonl) as a PNG."""

import json
import os

from etils import epath

try:  # optional: the extra t5x_like[plot]
  import matplotlib
  matplotlib.use("Agg")  # files only; no display needed
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
except ImportError:
  plt = None

PANELS = (  # (title, y label, [(metrics.jsonl key, line style, label suffix)])
    ("Loss", "loss (nats/token)", [("loss", "-", "train"), ("eval/loss", "o--", "validation")]),
    ("Learning rate", "lr", [("lr", "-", "")]),
    ("Throughput", "tokens/s (global)", [("tokens_per_sec", "-", "")]),
)


def series(records: list, key: str) -> tuple:
  """(steps, values) of `key`, sorted by step; a step logged twice (a resumed run) keeps its last value;
  non-finite values (written as strings) are skipped."""
  by_step = {}
  for record in records:
    value = record.get(key)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      by_step[int(record["step"])] = float(value)
  steps = sorted(by_step)
  return steps, [by_step[s] for s in steps]


def read_records(model_dir: str) -> list:
  """MODEL_DIR/metrics.jsonl records, local or gs://... (etils.epath; no TensorFlow import)."""
  path = epath.Path(model_dir) / "metrics.jsonl"
  if not path.exists():
    raise FileNotFoundError(f"{path} does not exist: is {model_dir!r} a MODEL_DIR of a run that logged?")
  return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def load_runs(model_dirs: list) -> dict:
  """{label: records} for each MODEL_DIR; a missing or empty metrics.jsonl is an error naming it."""
  runs = {}
  for model_dir in model_dirs:
    path = os.path.join(model_dir, "metrics.jsonl")
    try:
      records = read_records(model_dir)
    except ValueError as e:
      raise ValueError(f"{path} is not JSON lines: {e}") from e
    if not records:
      raise ValueError(f"{path} has no records yet")
    label = os.path.basename(os.path.normpath(model_dir)) or model_dir
    while label in runs:
      label += "'"
    runs[label] = records
  return runs


def task_panel(runs: dict):
  """A fourth panel for lm-eval task scores logged during training (tasks/<task>/<metric>, not perplexities),
  or None when no run logged any."""
  keys = sorted({k for records in runs.values() for r in records for k in r
                 if k.startswith("tasks/") and not k.endswith("perplexity")})
  return ("Tasks", "score", [(k, "o-", k[len("tasks/"):]) for k in keys]) if keys else None


def plot_runs(runs: dict, out: str, dpi: int = 110) -> str:
  """Draws every run into one figure of three panels (loss, lr, throughput; a fourth with lm-eval task scores when
  the runs logged any) and writes a PNG (local or gs://)."""
  if plt is None:
    raise ImportError("plotting needs matplotlib: pip install 't5x_like[plot]'")
  panels = PANELS + ((task_panel(runs),) if task_panel(runs) else ())
  fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), constrained_layout=True)
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for i, (label, records) in enumerate(runs.items()):
    color = colors[i % len(colors)]
    for ax, (title, ylabel, keys) in zip(axes, panels):
      for key, style, suffix in keys:
        steps, values = series(records, key)
        if steps:
          ax.plot(steps, values, style, color=color, markersize=4,
                  label=" ".join(p for p in (label, suffix) if p))
      ax.set_title(title)
      ax.set_xlabel("step")
      ax.set_ylabel(ylabel)
  for ax in axes:
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
      ax.legend(fontsize="small")
  return save_figure(fig, out, dpi)


def save_figure(fig, out: str, dpi: int = 110) -> str:
  """Writes a matplotlib figure as a PNG (local or gs://, its folder made) and closes it; returns `out`."""
  path = epath.Path(out)
  path.parent.mkdir(parents=True, exist_ok=True)
  with path.open("wb") as f:
    fig.savefig(f, dpi=dpi, format="png")
  plt.close(fig)
  return out
