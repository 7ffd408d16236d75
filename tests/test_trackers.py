"""Experiment trackers: MLflow gets the flattened gin config, the metrics and config.gin; W&B (offline) the config
and the metrics; a failing tracker never stops training."""

import glob
import json
import logging
import os
import shutil
import time

import pytest

from t5x_like.observe import trackers
from t5x_like import observe


@pytest.fixture(autouse=True, scope="module")
def tracker_packages():
  """MLflow and W&B (the test extra installs them, setup.py), imported by this file's first test rather than at
  collection (~4 s, paid by every test worker, most never running these tests)."""
  pytest.importorskip("mlflow")
  pytest.importorskip("wandb.proto.wandb_internal_pb2")


WANDB_BLOCK = 32768  # a .wandb file is a LevelDB-style log: 32 KiB blocks of records with a 7-byte header

CONFIG = """# Macros:
# ==============================================================================
BATCH_SIZE = 16
MESH_SHAPE = {'data': -1,
 'pipeline': 1}

# Parameters for OptimizerConfig:
# ==============================================================================
OptimizerConfig.learning_rate = 0.002
OptimizerConfig.name = 'adafactor'
TrainConfig.batch_size = %BATCH_SIZE
"""


@pytest.fixture(autouse=True)
def no_file_store_opt_in():
  """Each test starts without MLFLOW_ALLOW_FILE_STORE, which the default store sets in the process."""
  before = os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)
  yield
  os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)
  if before is not None:
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = before


def test_flatten_gin_gives_one_param_per_binding_and_joins_multiline_values():
  assert trackers.flatten_gin(CONFIG) == {
      "BATCH_SIZE": "16", "MESH_SHAPE": "{'data': -1, 'pipeline': 1}", "OptimizerConfig.learning_rate": "0.002",
      "OptimizerConfig.name": "'adafactor'", "TrainConfig.batch_size": "%BATCH_SIZE"}


def test_unknown_tracker_is_refused():
  with pytest.raises(ValueError, match=r"trackers: unknown \['mlfow'\]"):
    trackers.open_trackers(["mlfow"], "/tmp/unused", CONFIG)
  with pytest.raises(ValueError, match=r"trackers: unknown \['mlfow'\]"):  # when gin builds the config
    observe.ObserveConfig(trackers=("tensorboard", "mlfow"))
  with pytest.raises(ValueError, match=r"trackers='mlflow': give a tuple, e.g. \('tensorboard', 'mlflow'\)"):
    observe.ObserveConfig(trackers="mlflow")


def test_a_missing_tracker_package_names_its_extra():
  with pytest.raises(ImportError, match=r"trackers has 'wandb': pip install 't5x_like\[wandb\]'"):
    trackers._require("no_such_package_t5x.sub", "wandb")  # pylint: disable=protected-access


def wandb_records(model_dir) -> list:
  """Every protobuf Record of the offline W&B runs under MODEL_DIR/wandb, in order: read from the files, as
  `wandb sync` would (header ':W&B', magic 0xBEE1, version 0; records FULL=1 or FIRST=2 .. LAST=4)."""
  from wandb.proto import wandb_internal_pb2 as wandb_pb2  # pylint: disable=g-import-not-at-top
  records = []
  for path in sorted(glob.glob(os.path.join(model_dir, "wandb", "offline-run-*", "run-*.wandb"))):
    with open(path, "rb") as f:
      data = f.read()
    assert data[:7] == b":W&B\xe1\xbe\x00", path
    pos, chunk = 7, b""
    while pos + 7 <= len(data):
      if WANDB_BLOCK - pos % WANDB_BLOCK < 7:  # a block's tail too short for a header is padding
        pos += WANDB_BLOCK - pos % WANDB_BLOCK
        continue
      length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
      if pos + 7 + length > len(data):  # a record still being written
        break
      chunk, pos = chunk + data[pos + 7:pos + 7 + length], pos + 7 + length
      if kind in (1, 4):
        records.append(wandb_pb2.Record.FromString(chunk))
        chunk = b""
  return records


def wandb_finished_records(model_dir, timeout: float = 60.0) -> list:
  """wandb_records once every offline run under MODEL_DIR ends in its `exit` record: W&B's service process
  writes the file, and under load (wandb 0.31, two busy cores) it can still be writing after `run.finish()`
  returns. Fails, naming the folder, if a run has not ended within `timeout` seconds."""
  deadline = time.time() + timeout
  while True:
    records = wandb_records(model_dir)
    runs = len(glob.glob(os.path.join(model_dir, "wandb", "offline-run-*", "run-*.wandb")))
    exits = sum(r.WhichOneof("record_type") == "exit" for r in records)
    if runs and exits >= runs:
      return records
    assert time.time() < deadline, f"{model_dir}: {runs} offline W&B run(s), {exits} ended after {timeout} s"
    time.sleep(0.2)


def wandb_history(model_dir) -> tuple:
  """({step: {metric: value}}, the runs' ids, their config) of the offline W&B runs under MODEL_DIR."""
  history, ids, config = {}, set(), {}
  for record in wandb_finished_records(model_dir):
    kind = record.WhichOneof("record_type")
    if kind == "history":
      items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
      history.setdefault(items.pop("_step"), {}).update({k: v for k, v in items.items() if not k.startswith("_")})
    elif kind == "run":
      ids.add(record.run.run_id)
      config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
  return history, ids, config


def test_wandb_offline_run_holds_config_and_metrics(tmp_path, monkeypatch):
  monkeypatch.setenv("WANDB_MODE", "offline")
  model_dir = str(tmp_path / "run")
  sinks = trackers.open_trackers(("tensorboard", "wandb"), model_dir, CONFIG, experiment="sweep_a")
  assert len(sinks) == 1 and not sinks[0].failed
  for step in (1, 2, 3):
    sinks[0].write(step, {"loss": 5.0 / step, "eval/loss": 6.0 / step, "note": "text"})
  sinks[0].close()
  history, ids, config = wandb_history(model_dir)
  assert history == {1: {"loss": 5.0, "eval/loss": 6.0}, 2: {"loss": 2.5, "eval/loss": 3.0},
                     3: {"loss": 5.0 / 3, "eval/loss": 2.0}}
  assert len(ids) == 1 and config["OptimizerConfig.name"] == "'adafactor'" and config["BATCH_SIZE"] == "16"


def _log_run(model_dir, steps, **kwargs) -> list:
  sinks = trackers.open_trackers(("tensorboard", "mlflow"), str(model_dir), CONFIG, **kwargs)
  for step in steps:
    for sink in sinks:
      sink.write(step, {"loss": 5.0 / step, "eval/loss": 6.0 / step, "lr": 1e-3, "note": "text", "bad": float("nan")})
  for sink in sinks:
    sink.close()
  return sinks


def test_mlflow_run_read_back_has_params_metrics_and_config_artefact_and_a_relaunch_continues_it(tmp_path):
  import mlflow  # pylint: disable=g-import-not-at-top
  model_dir = tmp_path / "run"
  model_dir.mkdir()
  (model_dir / "config.gin").write_text(CONFIG)
  sinks = _log_run(model_dir, [1, 2], experiment="sweep_a")
  assert len(sinks) == 1 and not sinks[0].failed  # tensorboard is the event files MetricsLogger writes
  _log_run(model_dir, [3], experiment="sweep_a")  # the relaunch of a resumed run
  mlflow.set_tracking_uri("file:" + str(model_dir / "mlruns"))  # the default store: under the run
  try:
    runs = mlflow.search_runs(experiment_names=["sweep_a"], output_format="list")
  finally:
    mlflow.set_tracking_uri(None)
  assert len(runs) == 1
  run = runs[0]
  assert run.info.run_name == "run" and run.info.status == "FINISHED"
  assert run.data.params["OptimizerConfig.name"] == "'adafactor'" and run.data.params["BATCH_SIZE"] == "16"
  assert run.data.metrics["loss"] == 5.0 / 3 and run.data.metrics["eval/loss"] == 2.0  # the latest values
  assert "bad" not in run.data.metrics and "note" not in run.data.metrics
  client = mlflow.tracking.MlflowClient("file:" + str(model_dir / "mlruns"))
  history = client.get_metric_history(run.info.run_id, "loss")
  assert sorted((m.step, m.value) for m in history) == [(1, 5.0), (2, 2.5), (3, 5.0 / 3)]
  assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["config.gin"]


def test_a_tracking_uri_points_mlflow_elsewhere(tmp_path, monkeypatch):
  import mlflow  # pylint: disable=g-import-not-at-top
  monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a file URI given by the user: their opt-in
  (tmp_path / "run").mkdir()
  store = "file:" + str(tmp_path / "server_store")
  _log_run(tmp_path / "run", [1], tracking_uri=store)
  assert not (tmp_path / "run" / "mlruns").exists()
  runs = mlflow.tracking.MlflowClient(store).search_runs(
      [mlflow.tracking.MlflowClient(store).get_experiment_by_name(trackers.DEFAULT_EXPERIMENT).experiment_id])
  assert [r.data.metrics["loss"] for r in runs] == [5.0]


def test_a_tracker_failing_mid_run_is_reported_once_and_never_raises(tmp_path, caplog):
  (tmp_path / "run").mkdir()
  sinks = trackers.open_trackers(["mlflow"], str(tmp_path / "run"), CONFIG)
  sinks[0].write(1, {"loss": 1.0})
  shutil.rmtree(tmp_path / "run" / "mlruns")  # the store vanishes (a full disk, a server gone)
  with caplog.at_level(logging.WARNING):
    for step in (2, 3, 4):
      sinks[0].write(step, {"loss": 1.0})
    sinks[0].close()
  warnings = [r.getMessage() for r in caplog.records if "tracker mlflow failed" in r.getMessage()]
  assert len(warnings) == 1 and "step 2" in warnings[0] and sinks[0].failed


def test_a_tracker_that_cannot_start_is_left_out(tmp_path, caplog, monkeypatch):
  monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
  os.makedirs(tmp_path / "run")
  (tmp_path / "blocked").write_text("a file where the store's folder would go")
  with caplog.at_level(logging.WARNING):
    sinks = trackers.open_trackers(["mlflow"], str(tmp_path / "run"), CONFIG,
                                   tracking_uri="file:" + str(tmp_path / "blocked" / "store"))
  starts = [r.getMessage() for r in caplog.records if "tracker mlflow did not start" in r.getMessage()]
  assert sinks == [] and len(starts) == 1 and "blocked" in starts[0], starts


def check_sweep_trackers(report, store, sweep_dir, steps) -> None:
  """observe.ObserveConfig.trackers=('tensorboard', 'mlflow', 'wandb') through train, checked on a finished sweep
  (tests/test_sweep's uninterrupted two-run sweep, which logs to both): each run is an MLflow run in the experiment
  named after the sweep's folder, with the final losses metrics.jsonl has, the gin config and config.gin, and an offline
  W&B run under its MODEL_DIR with every logged figure of metrics.jsonl at its step."""
  import mlflow  # pylint: disable=g-import-not-at-top
  client = mlflow.tracking.MlflowClient(store)
  runs = client.search_runs([client.get_experiment_by_name(os.path.basename(sweep_dir)).experiment_id])
  assert sorted(r.info.run_name for r in runs) == sorted(row["run"] for row in report["rows"])
  for run in runs:
    row = next(r for r in report["rows"] if r["run"] == run.info.run_name)
    values = dict(part.split("-", 1) for part in run.info.run_name.split("__"))  # name-adamw__learning_rate-0.01
    assert run.data.metrics["loss"] == row["final_train_loss"] and run.data.metrics["eval/loss"] == row["final_eval_loss"]
    assert run.data.metrics["memory/opt_state_bytes_per_device"] == row["opt_state_bytes_per_device"]
    assert float(run.data.params["OptimizerConfig.learning_rate"]) == float(values["learning_rate"])
    assert values["name"] in run.data.params["OptimizerConfig.name"]
    assert run.data.params["TRAIN_STEPS"] == str(steps) and run.info.status == "FINISHED"
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["config.gin"]
    model_dir = os.path.join(sweep_dir, run.info.run_name)
    history, ids, config = wandb_history(model_dir)
    with open(os.path.join(model_dir, "metrics.jsonl")) as f:
      logged = [json.loads(line) for line in f]
    assert len(ids) == 1 and float(config["OptimizerConfig.learning_rate"]) == float(values["learning_rate"])
    assert history[steps]["loss"] == row["final_train_loss"] and history[steps]["eval/loss"] == row["final_eval_loss"]
    for record in logged:  # every numeric figure metrics.jsonl has, at its step
      for key, value in record.items():
        if key != "step" and isinstance(value, (int, float)) and value == value:
          assert history[record["step"]][key] == value, (record["step"], key)
