"""A sweep's results: one row per run (final losses, throughput, memory, optimizer bytes) as Markdown and CSV,
and every run's eval-loss curve in one PNG."""

import csv
import io
import json
import statistics

from etils import epath

from t5x_like.observe import plots

COLUMNS = (  # (CSV column, Markdown header, format)
    ("final_train_loss", "train loss", "{:.4f}"),
    ("final_eval_loss", "eval loss", "{:.4f}"),
    ("tokens_per_sec", "tokens/s", "{:,.0f}"),
    ("peak_memory_bytes", "peak memory (MiB)", None),
    ("opt_state_bytes_per_device", "optimizer bytes/device", "{:,}"),
    ("params", "parameters", "{:,}"),
)


def read_records(model_dir: str) -> list:
  """MODEL_DIR/metrics.jsonl's records, skipping a line a kill cut short (the relaunch appends after it);
  [] when the run has not logged yet."""
  path = epath.Path(model_dir) / "metrics.jsonl"
  if not path.exists():
    return []
  records = []
  for line in path.read_text(encoding="utf-8").splitlines():
    try:
      records.append(json.loads(line))
    except ValueError:
      continue
  return records


def _last(records: list, key: str, step=None):
  """The last value of `key` (at `step` if given): a step logged twice (a relaunch) keeps its newest."""
  steps, values = plots.series(records, key)
  if step is not None:
    return values[steps.index(step)] if step in steps else None
  return values[-1] if values else None


def summarize(run) -> dict:
  """One table row of a sweep.Run from its metrics.jsonl (None where it has not logged the figure yet).

  tokens_per_sec is the median over its log intervals (the first, compiling, interval excluded by the meter
  and the median robust to a slow one); peak memory is the largest device peak the run reported, else the
  training process's peak RSS (CPU backends report no device memory).
  """
  row = {"run": run.name, **{key: value for key, value in run.values}, "status": "not started"}
  row.update({column: None for column, _, _ in COLUMNS})
  records = read_records(run.model_dir)
  if not records:
    return row
  row["final_train_loss"] = _last(records, "loss", run.train_steps)
  row["final_eval_loss"] = _last(records, "eval/loss", run.train_steps)
  speeds = plots.series(records, "tokens_per_sec")[1]
  row["tokens_per_sec"] = statistics.median(speeds) if speeds else None
  device = plots.series(records, "memory/device_peak_bytes")[1]
  host = plots.series(records, "memory/host_rss_peak_bytes")[1]
  row["peak_memory_bytes"] = int(max(device or host)) if (device or host) else None
  opt_bytes = _last(records, "memory/opt_state_bytes_per_device")
  row["opt_state_bytes_per_device"] = int(opt_bytes) if opt_bytes is not None else None
  params = _last(records, "params/total")
  row["params"] = int(params) if params is not None else None
  row["status"] = "finished" if row["final_eval_loss"] is not None else "incomplete"
  return row


def _cell(value, fmt) -> str:
  if value is None:
    return "—"
  if fmt is None:  # peak memory in MiB
    return f"{value / 2**20:,.0f}"
  return fmt.format(value)


def markdown(rows: list, grid_keys: list) -> str:
  """A Markdown table: run, each grid key's value, status, then COLUMNS (losses to 4 decimals)."""
  short = [key.rsplit(".", 1)[-1] for key in grid_keys]
  header = ["run"] + short + ["status"] + [title for _, title, _ in COLUMNS]
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  for row in rows:
    cells = [row["run"]] + [str(row[k]) for k in grid_keys] + [row["status"]]
    cells += [_cell(row[column], fmt) for column, _, fmt in COLUMNS]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def csv_text(rows: list, grid_keys: list) -> str:
  """CSV with full-precision numbers (Python's repr), empty where a figure is missing."""
  out = io.StringIO()
  writer = csv.writer(out, lineterminator="\n")
  columns = ["run"] + list(grid_keys) + ["status"] + [column for column, _, _ in COLUMNS]
  writer.writerow(columns)
  for row in rows:
    writer.writerow(["" if row[c] is None else repr(row[c]) if isinstance(row[c], float) else row[c]
                     for c in columns])
  return out.getvalue()


def plot_eval_curves(runs: list, out: str, dpi: int = 110) -> str:
  """Every run's eval loss against training tokens, one line each, in one PNG; returns its path."""
  if plots.plt is None:
    raise ImportError("the sweep's PNG needs matplotlib: pip install 't5x_like[plot]'")
  fig, ax = plots.plt.subplots(figsize=(8, 5))
  for run in runs:
    steps, losses = plots.series(read_records(run.model_dir), "eval/loss")
    if steps:
      ax.plot([s * run.tokens_per_step for s in steps], losses, "o-", label=run.name, markersize=3)
  ax.set_xlabel("training tokens")
  ax.set_ylabel("eval loss (nats/token)")
  ax.set_title("Sweep: eval loss")
  ax.grid(alpha=0.3)
  if ax.lines:
    ax.legend(fontsize="small")
  fig.tight_layout()
  return plots.save_figure(fig, out, dpi)


def write_report(runs: list, grid_keys: list, output_dir: str) -> dict:
  """results.md, results.csv and eval_loss.png under output_dir; returns {'rows', 'markdown', 'csv', 'png'}."""
  rows = [summarize(run) for run in runs]
  root = epath.Path(output_dir)
  (root / "results.md").write_text(markdown(rows, grid_keys))
  (root / "results.csv").write_text(csv_text(rows, grid_keys))
  png = plot_eval_curves(runs, str(root / "eval_loss.png"))
  return {"rows": rows, "markdown": str(root / "results.md"), "csv": str(root / "results.csv"), "png": png}
