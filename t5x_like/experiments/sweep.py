"""Grid sweeps over gin bindings: one MODEL_DIR per combination, each trained by `python -m t5x_like.train`.

    grid = parse_grid(["optimizer.OptimizerConfig.name=['adamw','adafactor']",
                       "optimizer.OptimizerConfig.learning_rate=[3e-4,1e-3]"])
    runs = plan(["configs/experiments/pystdlib_demo.gin"], [], ["."], grid, "sweeps/opt")
    # → 4 runs: sweeps/opt/name-adamw__learning_rate-0.0003, ..., each with its bindings and TRAIN_STEPS

Every combination is validated (its gin parsed, its configs built) before anything launches. A sweep
relaunched on the same output directory skips finished runs (metrics.jsonl holds the final step's eval)
and relaunches the others: train resumes each from its newest checkpoint.
"""

import ast
import ctypes
import dataclasses
import itertools
import json
import os
import re
import subprocess
import sys
import time
from typing import Optional, Sequence

from etils import epath
import gin

from t5x_like import cli
from t5x_like import errors
from t5x_like.experiments import sweep_data
from t5x_like.experiments import sweep_report
from t5x_like.model import decoder
from t5x_like.training import optimizer
from t5x_like.training import precision

SPEC_FILE = "sweep.json"  # the sweep's definition, compared on a relaunch
RESERVED = ("MODEL_DIR",)  # set by the sweep, one per run
EXPERIMENT_KEY = "observe.ObserveConfig.experiment"  # the trackers' experiment: the output folder's name by default


@dataclasses.dataclass(frozen=True)
class Run:
  """One combination of the grid."""
  name: str  # its folder under the output directory, e.g. 'name-adamw__learning_rate-0.0003'
  values: tuple  # ((grid key, value), ...) in grid order
  model_dir: str
  train_steps: int  # TRAIN_STEPS of this combination: the step whose eval marks it finished
  tokens_per_step: int  # BATCH_SIZE × SEQ_LEN
  data_dir: str = ""  # its DATA_DIR when the grid varies the tokenizer (keys preprocess.*), else the config's

  def bindings(self) -> list:
    data = [f"DATA_DIR = {self.data_dir!r}"] if self.data_dir else []
    return ([f"{key} = {value!r}" for key, value in self.values if not sweep_data.is_data_key(key)] + data
            + [f"MODEL_DIR = {self.model_dir!r}"])


def parse_grid(specs: Sequence[str]) -> list:
  """["KEY=[v1, v2]", "(K1,K2)=[(a1, b1), (a2, b2)]", ...] → [((KEY,), [(v1,), (v2,)]), ((K1, K2), [...]), ...].

  Values are Python literals (gin's value syntax for numbers, strings, tuples, lists and dicts). Keys in
  parentheses vary together (a zipped axis: e.g. a model size with its step count); the flags' axes combine
  as a Cartesian product. A missing '=', an empty or unparsable list, a tuple of the wrong length or a
  repeated key is a ValueError naming the key.
  """
  grid, seen = [], set()
  for spec in specs:
    if "=" not in spec:
      raise ValueError(f"--grid={spec!r} is not KEY=[VALUE, ...]")
    key, text = (s.strip() for s in spec.split("=", 1))
    zipped = key.startswith("(") and key.endswith(")")
    keys = tuple(k.strip() for k in key.strip("()").split(",")) if zipped else (key,)
    for k in keys:
      if not k:
        raise ValueError(f"--grid={spec!r} has an empty key")
      if k in RESERVED:
        raise ValueError(f"--grid key {k}: set by the sweep (one per run under --output_dir); it cannot be swept")
      if k in seen:
        raise ValueError(f"--grid key {k} is given twice")
      seen.add(k)
    try:
      values = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError) as e:
      raise ValueError(f"--grid key {key}: cannot parse {text!r} as a list of Python literals "
                       f"({type(e).__name__})") from None
    if not isinstance(values, (list, tuple)):
      raise ValueError(f"--grid key {key}: {text!r} is not a list, e.g. {key}=[1, 2]")
    if not values:
      raise ValueError(f"--grid key {key} has no values")
    if zipped:
      bad = [v for v in values if not isinstance(v, (list, tuple)) or len(v) != len(keys)]
      if bad:
        raise ValueError(f"--grid key {key}: {bad[0]!r} is not a tuple of {len(keys)} values")
    grid.append((keys, [tuple(v) if zipped else (v,) for v in values]))
  if not grid:
    raise ValueError("no --grid given: pass e.g. --grid=\"optimizer.OptimizerConfig.learning_rate=[3e-4,1e-3]\"")
  return grid


def grid_keys(grid: list) -> list:
  """Every key of the grid, in order (a zipped axis gives several)."""
  return [key for keys, _ in grid for key in keys]


def _slug(value) -> str:
  text = value if isinstance(value, str) else repr(value)
  return re.sub(r"[^A-Za-z0-9.+-]+", "_", text).strip("_") or "_"


def run_name(values: Sequence) -> str:
  """'name-adamw__learning_rate-0.0003': each key's last part and its value, filesystem-safe; stable across
  relaunches (the folder a relaunch finds)."""
  short = [key.rsplit(".", 1)[-1] for key, _ in values]
  if len(set(short)) < len(short):  # two keys end alike (model.X.dropout, data.Y.dropout): the whole key
    short = [key for key, _ in values]
  return "__".join(f"{_slug(k)}-{_slug(v)}" for k, (_, v) in zip(short, values))


def _parse(gin_files, bindings, search_paths) -> None:
  gin.clear_config()
  cli.parse_gin(gin_files, bindings, search_paths)


def _build_configs(where: str):
  """The configs a train launch builds (their checks run here, before anything launches)."""
  try:
    config = cli.train_config()
    cli.configured(decoder.GPTConfig, "model").validate()
    cli.configured(optimizer.OptimizerConfig, "optimizer")
    cli.configured(precision.PrecisionConfig, "precision")
  except (ValueError, TypeError) as e:
    raise ValueError(f"{where}: {errors.first_line(e)}") from e
  return config


def plan(gin_files: Sequence[str], gin_bindings: Sequence[str], search_paths: Sequence[str], grid: list,
         output_dir: str) -> list:
  """The sweep's runs, every combination parsed and its configs built; a grid key that is no gin binding
  (no configurable parameter or macro of the files) is a ValueError naming it.

  Returns:
    [Run, ...] in grid order (the last key varies fastest).
  """
  base = list(gin_bindings) + [f"MODEL_DIR = {output_dir!r}"]
  if any(sweep_data.is_data_key(k) for k in grid_keys(grid)):  # each run's DATA_DIR is its tokenizer's dataset
    base.append(f"DATA_DIR = {os.path.join(output_dir, 'data')!r}")
  try:
    _parse(gin_files, base, search_paths)
  except ValueError as e:
    raise ValueError(f"the sweep's --gin_file / --gin flags: {errors.first_line(e)}") from None
  finally:
    gin.clear_config()
  for key, value in [(k, values[0][i]) for keys, values in grid for i, k in enumerate(keys)]:  # one at a time
    if sweep_data.is_data_key(key):  # a preprocess flag, checked when the datasets are built
      continue
    try:
      _parse(gin_files, base + [f"{key} = {value!r}"], search_paths)
    except ValueError as e:
      raise ValueError(f"--grid key {key} is not a gin binding of {list(gin_files)}: {errors.first_line(e)}") from None
    finally:
      gin.clear_config()
  runs = []
  for axes in itertools.product(*[[tuple(zip(keys, v)) for v in values] for keys, values in grid]):
    combo = tuple(pair for axis in axes for pair in axis)
    name = run_name(combo)
    model_dir = os.path.join(output_dir, name)
    run = Run(name, tuple(combo), model_dir, 0, 0, sweep_data.data_dir(output_dir, combo))
    try:
      _parse(gin_files, list(gin_bindings) + run.bindings(), search_paths)
      config = _build_configs(f"sweep run {name}")
    finally:
      gin.clear_config()
    runs.append(dataclasses.replace(run, train_steps=config.train_steps,
                                    tokens_per_step=config.batch_size * config.seq_len))
  if len({r.name for r in runs}) < len(runs):
    raise ValueError(f"two grid values give the same run name: {[r.name for r in runs]}")
  return runs


def is_finished(run: Run) -> bool:
  """Whether the run's metrics.jsonl has an eval at its final step (a kill before that relaunches it)."""
  records = sweep_report.read_records(run.model_dir)
  return any(r.get("step") == run.train_steps and "eval/loss" in r for r in records)


def train_command(run: Run, gin_files, gin_bindings, search_paths) -> list:
  """The `python -m t5x_like.train` launch of one run: the sweep's files and bindings, then the run's."""
  return ([sys.executable, "-m", "t5x_like.train"] + [f"--gin_file={f}" for f in gin_files]
          + [f"--gin_search_paths={','.join(search_paths)}"]
          + [f"--gin_bindings={b}" for b in list(gin_bindings) + run.bindings()])


def _die_with_parent() -> None:
  """In the child before exec: SIGKILL when the sweep dies (Linux prctl PR_SET_PDEATHSIG), so a sweep killed
  with -9 leaves no run writing to its MODEL_DIR while a relaunch starts it again."""
  try:
    ctypes.CDLL(None, use_errno=True).prctl(1, 9)
  except (OSError, AttributeError):
    pass


def check_spec(output_dir: str, spec: dict) -> None:
  """Writes output_dir/sweep.json, or refuses a relaunch whose files, bindings or grid differ from it."""
  path = epath.Path(output_dir) / SPEC_FILE
  if path.exists():
    saved = json.loads(path.read_text())
    if saved != json.loads(json.dumps(spec)):
      diff = sorted(k for k in set(saved) | set(spec) if saved.get(k) != json.loads(json.dumps(spec)).get(k))
      raise ValueError(f"{path} holds a different sweep (its {', '.join(diff)} differ): use another --output_dir")
    return
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(spec, indent=1))


def launch_all(runs: list, gin_files, gin_bindings, search_paths, parallel: int = 1,
               log=print, env: Optional[dict] = None) -> dict:
  """Trains the unfinished runs, `parallel` at a time; returns {run name: exit code} of those launched."""
  if parallel < 1:
    raise ValueError(f"--parallel={parallel} must be at least 1")
  pending, active, codes = [], {}, {}
  for run in runs:
    if is_finished(run):
      log(f"sweep: {run.name}: finished, skipped")
    else:
      pending.append(run)
  while pending or active:
    while pending and len(active) < parallel:
      run = pending.pop(0)
      os.makedirs(run.model_dir, exist_ok=True)
      with open(os.path.join(run.model_dir, "train.log"), "ab") as out:
        log(f"sweep: {run.name}: training (log: {os.path.join(run.model_dir, 'train.log')})")
        active[run.name] = subprocess.Popen(train_command(run, gin_files, gin_bindings, search_paths),
                                            stdout=out, stderr=subprocess.STDOUT, env=env,
                                            preexec_fn=_die_with_parent)
    for name, proc in list(active.items()):
      if proc.poll() is not None:
        codes[name] = proc.returncode
        log(f"sweep: {name}: " + ("done" if proc.returncode == 0 else f"failed (exit {proc.returncode})"))
        del active[name]
    time.sleep(0.2)
  return codes


def run_sweep(gin_files: Sequence[str], gin_bindings: Sequence[str], search_paths: Sequence[str],
              grid_specs: Sequence[str], output_dir: str, parallel: int = 1, log=print,
              env: Optional[dict] = None, preprocess_args: Sequence[str] = ()) -> dict:
  """Validates the grid, builds the datasets of its tokenizer settings (grid keys preprocess.*, from the
  `python -m t5x_like.preprocess` flags `preprocess_args`), trains what is not finished, writes the report
  (also after failed runs). The runs' MLflow experiment / W&B project is the output folder's name unless the
  bindings set one.

  Returns:
    sweep_report.write_report's dict; a run that failed is a ValueError naming it and its log, after the
    report is written (a relaunch retries it).
  """
  if not output_dir:
    raise ValueError("no --output_dir given: the folder that holds one MODEL_DIR per combination")
  grid = parse_grid(grid_specs)
  spec = {"gin_files": list(gin_files), "gin_bindings": list(gin_bindings),
          "grid": [[list(keys), [list(v) for v in values]] for keys, values in grid]}
  sweep_data.check_grid(grid_keys(grid), preprocess_args)
  if preprocess_args:
    spec["preprocess"] = list(preprocess_args)
  if not any(b.replace(" ", "").startswith(f"{EXPERIMENT_KEY}=") for b in gin_bindings):  # trackers group the runs
    gin_bindings = list(gin_bindings) + [f"{EXPERIMENT_KEY} = {os.path.basename(os.path.normpath(output_dir))!r}"]
  runs = plan(gin_files, gin_bindings, search_paths, grid, output_dir)
  check_spec(output_dir, spec)
  log(f"sweep: {len(runs)} runs under {output_dir}")
  sweep_data.prepare(runs, preprocess_args, log, env)
  codes = launch_all(runs, gin_files, gin_bindings, search_paths, parallel, log, env)
  report = sweep_report.write_report(runs, grid_keys(grid), output_dir)
  failed = [f"{name} (exit {code}, see {os.path.join(output_dir, name, 'train.log')})"
            for name, code in codes.items() if code != 0]
  if failed:
    raise ValueError(f"{len(failed)} of {len(runs)} sweep runs failed: {'; '.join(failed)}")
  return report
