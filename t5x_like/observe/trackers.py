"""Experiment trackers (MLflow, Weights & Biases) as metric sinks beside metrics.jsonl and TensorBoard.

Each sink has `write(step, scalars)` and `close()`, as the trainer's MetricsLogger. MLflow logs the run's
whole gin config (flattened: one param per binding), its metrics, and config.gin as an artefact, by
default into a local store under the run (`mlflow ui --backend-store-uri MODEL_DIR/mlruns` opens it); a
tracking URI points it at a server or database instead. W&B runs offline (files under MODEL_DIR/wandb,
`wandb sync` uploads them) unless the user is logged in. A relaunched run continues its tracker run. A
tracker that fails is reported once and switched off: it never stops training.

The trackers' packages are optional extras (t5x_like[mlflow], t5x_like[wandb]) and are imported only when a
run asks for them: `import mlflow` alone takes ~1.5 s, which every launch of the trainer would pay.
"""

import hashlib
import importlib
import importlib.util
import math
import os
import time
from typing import Mapping, Optional, Sequence

from absl import logging

TRACKERS = ("tensorboard", "mlflow", "wandb")  # tensorboard: the event files every run writes
DEFAULT_EXPERIMENT = "t5x_like"
MODEL_DIR_TAG = "t5x_like.model_dir"  # MLflow tag that finds a relaunched run's tracker run
_MAX_PARAMS, _MAX_METRICS, _MAX_VALUE = 100, 1000, 6000  # MLflow's log_batch and param value limits


def _require(package: str, extra: str):
  """The imported package, or an ImportError naming the extra that installs it."""
  if importlib.util.find_spec(package.split(".")[0]) is None:
    raise ImportError(f"observe.ObserveConfig.trackers has '{extra}': pip install 't5x_like[{extra}]'")
  return importlib.import_module(package)


def flatten_gin(config_text: str) -> dict:
  """{'optimizer.OptimizerConfig.learning_rate': '0.001', 'BATCH_SIZE': '16', ...} from an operative config
  (gin.operative_config_str(), config.gin): one entry per binding or macro, values as written (a value
  spread over several lines is joined)."""
  out, pending = {}, ""
  for line in config_text.splitlines():
    stripped = line.strip()
    if not pending and (not stripped or stripped.startswith("#")):
      continue
    pending = f"{pending} {stripped}".strip()
    if sum(pending.count(c) for c in "([{") > sum(pending.count(c) for c in ")]}"):
      continue  # the value goes on over the next lines
    if " = " in pending and not pending.startswith(("import ", "include ")):
      key, value = pending.split(" = ", 1)
      out[key.strip()] = value.strip()
    pending = ""
  return out


class MlflowSink:
  """One MLflow run per MODEL_DIR (a relaunch continues it), in experiment `experiment`."""

  def __init__(self, model_dir: str, params: Mapping[str, str], config_file: Optional[str] = None,
               tracking_uri: str = "", experiment: str = "", run_name: str = ""):
    tracking, self.entities = _require("mlflow.tracking", "mlflow"), _require("mlflow.entities", "mlflow")
    if not tracking_uri:  # MLflow keeps its file store in maintenance mode; a local run needs no server
      os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
      tracking_uri = "file:" + os.path.abspath(os.path.join(model_dir, "mlruns"))
    self.tracking_uri = tracking_uri
    self.client = tracking.MlflowClient(tracking_uri=tracking_uri)
    name = experiment or DEFAULT_EXPERIMENT
    found = self.client.get_experiment_by_name(name)
    experiment_id = found.experiment_id if found else self.client.create_experiment(name)
    key = os.path.abspath(model_dir) if "://" not in model_dir else model_dir
    previous = self.client.search_runs([experiment_id], filter_string=f"tags.`{MODEL_DIR_TAG}` = '{key}'",
                                       max_results=1)
    if previous:
      self.run_id = previous[0].info.run_id
      self.client.update_run(self.run_id, status="RUNNING")
      logged = previous[0].data.params
    else:
      run = self.client.create_run(experiment_id, run_name=run_name or os.path.basename(key.rstrip("/")),
                                   tags={MODEL_DIR_TAG: key})
      self.run_id, logged = run.info.run_id, {}
    new = [self.entities.Param(k, str(v)[:_MAX_VALUE]) for k, v in sorted(params.items()) if k not in logged]
    for i in range(0, len(new), _MAX_PARAMS):
      self.client.log_batch(self.run_id, params=new[i:i + _MAX_PARAMS])
    if config_file and os.path.exists(config_file):
      self.client.log_artifact(self.run_id, config_file)

  def write(self, step: int, scalars: Mapping[str, float]) -> None:
    now = int(time.time() * 1000)
    metrics = [self.entities.Metric(k, float(v), now, int(step)) for k, v in scalars.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))]
    for i in range(0, len(metrics), _MAX_METRICS):
      self.client.log_batch(self.run_id, metrics=metrics[i:i + _MAX_METRICS])

  def close(self) -> None:
    self.client.set_terminated(self.run_id)


class WandbSink:
  """One W&B run per MODEL_DIR (its id from the path, so a relaunch resumes it); offline unless logged in."""

  def __init__(self, model_dir: str, params: Mapping[str, str], experiment: str = "", run_name: str = ""):
    wandb = _require("wandb", "wandb")
    key = os.path.abspath(model_dir) if "://" not in model_dir else model_dir
    mode = os.environ.get("WANDB_MODE") or ("online" if wandb.api.api_key else "offline")
    self.run = wandb.init(project=experiment or DEFAULT_EXPERIMENT, name=run_name or os.path.basename(key.rstrip("/")),
                          id=hashlib.sha256(key.encode()).hexdigest()[:16], resume="allow", dir=model_dir,
                          config=dict(params), mode=mode)

  def write(self, step: int, scalars: Mapping[str, float]) -> None:
    self.run.log({k: v for k, v in scalars.items() if isinstance(v, (int, float))}, step=int(step))

  def close(self) -> None:
    self.run.finish()


class Guarded:
  """A tracker whose first failure is logged once (with the step) and that is silent afterwards."""

  def __init__(self, name: str, sink):
    self.name, self.sink, self.failed = name, sink, False

  def _call(self, what: str, fn, *args) -> None:
    if self.failed:
      return
    try:
      fn(*args)
    except Exception as e:  # pylint: disable=broad-except  (a tracker never stops training)
      self.failed = True
      logging.warning("tracker %s failed (%s): %s: %s; it is off for the rest of the run", self.name, what,
                      type(e).__name__, str(e).splitlines()[0] if str(e) else "")

  def write(self, step: int, scalars: Mapping[str, float]) -> None:
    self._call(f"step {step}", self.sink.write, step, scalars)

  def close(self) -> None:
    self._call("close", self.sink.close)


def validate(names: Sequence[str]) -> None:
  """Refuses a tracker name not in TRACKERS (and a bare string, which gin gives for a missing tuple comma)."""
  if isinstance(names, str):
    raise ValueError(f"observe.ObserveConfig.trackers={names!r}: give a tuple, e.g. ('tensorboard', {names!r})")
  unknown = [n for n in names if n not in TRACKERS]
  if unknown:
    raise ValueError(f"observe.ObserveConfig.trackers: unknown {unknown}; expected any of {TRACKERS}")


def open_trackers(names: Sequence[str], model_dir: str, config_text: str, tracking_uri: str = "",
                  experiment: str = "", run_name: str = "", is_primary: bool = True) -> list:
  """The Guarded sinks of `names` other than tensorboard (whose event files MetricsLogger writes); none off
  process 0. A tracker that cannot start is reported and left out; a missing package is an ImportError.

  Args:
    config_text: the operative gin config, logged as params (flattened) and, from MODEL_DIR/config.gin,
      as an artefact.
  """
  validate(names)
  if not is_primary:
    return []
  for name in set(names) - {"tensorboard"}:  # a missing package fails the launch, not silently later
    _require(name, name)
  params = flatten_gin(config_text)
  makers = {"mlflow": lambda: MlflowSink(model_dir, params, os.path.join(model_dir, "config.gin"), tracking_uri,
                                         experiment, run_name),
            "wandb": lambda: WandbSink(model_dir, params, experiment, run_name)}
  sinks = []
  for name in names:
    if name in makers:
      try:
        sinks.append(Guarded(name, makers[name]()))
      except Exception as e:  # pylint: disable=broad-except  (an unreachable server must not stop training)
        logging.warning("tracker %s did not start: %s: %s; training continues without it", name, type(e).__name__,
                        str(e).splitlines()[0] if str(e) else "")
  return sinks
