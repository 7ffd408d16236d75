"""`python -m t5x_like.plot MODEL_DIR [MODEL_DIR ...] [--out FILE.png]`: loss, learning rate and throughput curves."""

import json
import os

from absl import flags
import matplotlib

matplotlib.use("Agg")  # files only; no display needed
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

from t5x_like import gin_utils  # pylint: disable=g-import-not-at-top

flags.DEFINE_string("out", None, "PNG to write (default: MODEL_DIR/metrics.png for one run, "
                    "./runs.png for several).")
flags.DEFINE_integer("dpi", 110, "Resolution of the PNG.")
FLAGS = flags.FLAGS

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
  """MODEL_DIR/metrics.jsonl records; local paths are read without TensorFlow (fast start), other
  URLs (gs://...) through metrics.read_metrics."""
  if "://" in model_dir:
    from t5x_like import metrics as metrics_lib  # pylint: disable=g-import-not-at-top
    return metrics_lib.read_metrics(model_dir)
  path = os.path.join(model_dir, "metrics.jsonl")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path} does not exist: is {model_dir!r} a MODEL_DIR of a run that logged?")
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


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


def plot_runs(runs: dict, out: str, dpi: int = 110) -> str:
  """Draws every run into one figure of three panels (loss, lr, throughput) and writes a PNG."""
  fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 4), constrained_layout=True)
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for i, (label, records) in enumerate(runs.items()):
    color = colors[i % len(colors)]
    for ax, (title, ylabel, keys) in zip(axes, PANELS):
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
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  fig.savefig(out, dpi=dpi, format="png")
  plt.close(fig)
  return out


def main(argv):
  model_dirs = argv[1:]
  if not model_dirs:
    raise ValueError("no MODEL_DIR given: python -m t5x_like.plot MODEL_DIR [MODEL_DIR ...] [--out FILE.png]")
  out = FLAGS.out or (os.path.join(model_dirs[0], "metrics.png") if len(model_dirs) == 1 else "runs.png")
  if not out.lower().endswith(".png"):
    raise ValueError(f"--out={out!r}: only PNG is written; give a name ending in .png")
  print(plot_runs(load_runs(model_dirs), out, FLAGS.dpi), flush=True)


if __name__ == "__main__":
  gin_utils.run(main)
