"""Experiment trackers: MLflow gets the flattened gin config, the metrics and config.gin; a failing tracker never
stops training."""

import logging
import os
import shutil

import pytest

from tests import test_sweep

from t5x_like.experiments import sweep
from t5x_like.observe import trackers
from t5x_like import observe

mlflow = pytest.importorskip("mlflow")  # the test extra installs it (setup.py)

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


def _log_run(model_dir, steps, **kwargs) -> list:
  sinks = trackers.open_trackers(("tensorboard", "mlflow"), str(model_dir), CONFIG, **kwargs)
  for step in steps:
    for sink in sinks:
      sink.write(step, {"loss": 5.0 / step, "eval/loss": 6.0 / step, "lr": 1e-3, "note": "text", "bad": float("nan")})
  for sink in sinks:
    sink.close()
  return sinks


def test_mlflow_run_read_back_has_params_metrics_and_config_artefact_and_a_relaunch_continues_it(tmp_path):
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


@pytest.mark.slow  # trains two tiny runs through the sweep and the train CLI
def test_sweep_runs_log_to_one_mlflow_experiment_with_their_metrics_and_params(corpus, tmp_path, monkeypatch):
  """observe.ObserveConfig.trackers=('tensorboard', 'mlflow') through train: each run of a sweep is an MLflow run in
  the experiment named after the sweep's folder, with the final losses metrics.jsonl has and the gin config."""
  store = "file:" + str(tmp_path / "store")
  monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a file URI given by the user: their opt-in
  environment = dict(test_sweep.env(), MLFLOW_ALLOW_FILE_STORE="true")
  bindings = test_sweep.bindings(corpus) + ["TRAIN_STEPS = 4", "observe.ObserveConfig.trackers = ('tensorboard', 'mlflow')",
                                            f"observe.ObserveConfig.tracking_uri = {store!r}"]
  report = sweep.run_sweep(test_sweep.FILES, bindings, ["."], ["optimizer.OptimizerConfig.learning_rate=[3e-3,1e-2]"],
                           str(tmp_path / "lr_sweep"), env=environment)
  client = mlflow.tracking.MlflowClient(store)
  runs = client.search_runs([client.get_experiment_by_name("lr_sweep").experiment_id])
  assert sorted(r.info.run_name for r in runs) == ["learning_rate-0.003", "learning_rate-0.01"]
  for run in runs:
    row = next(r for r in report["rows"] if r["run"] == run.info.run_name)
    assert run.data.metrics["loss"] == row["final_train_loss"] and run.data.metrics["eval/loss"] == row["final_eval_loss"]
    assert run.data.metrics["memory/opt_state_bytes_per_device"] == row["opt_state_bytes_per_device"]
    assert float(run.data.params["OptimizerConfig.learning_rate"]) == float(run.info.run_name.split("-", 1)[1])
    assert run.data.params["TRAIN_STEPS"] == "4" and run.info.status == "FINISHED"
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["config.gin"]
