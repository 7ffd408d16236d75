"""Sweeps: grid validation before any launch; a sweep killed -9 in its last run and relaunched gives the same
table."""

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import types

import pytest

from tests import conftest
from tests import forkserver
from tests import interrupt

from t5x_like.experiments import sweep
from t5x_like.experiments import sweep_data
from t5x_like.experiments import sweep_report
from t5x_like.training import checkpointing

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = ["configs/models/gpt_tiny.gin", "configs/runs/pretrain.gin"]
STEPS = 12


def bindings(data_dir) -> list:
  """A TINY model on 2 CPU devices, logged, evaluated and checkpointed every 4 steps."""
  return [f"DATA_DIR = '{data_dir}'", f"TRAIN_STEPS = {STEPS}", "LOG_EVERY = 4", "EVAL_EVERY = 4",
          "CHECKPOINT_EVERY = 4", "BATCH_SIZE = 8", "SEQ_LEN = 16",
          "MESH_SHAPE = {'pipeline': 1, 'data': 2, 'fsdp': 1, 'tensor': 1}",
          "data.DataConfig.eval_batches = 1", "data.DataConfig.shuffle_buffer = 64",
          "checkpointing.CheckpointConfig.async_save = False",
          "optimizer.OptimizerConfig.warmup_steps = 2", "model.GPTConfig.num_layers = 1",
          "model.GPTConfig.d_model = 32", "model.GPTConfig.num_heads = 2", "model.GPTConfig.d_ff = 64",
          "model.GPTConfig.max_len = 32", "model.GPTConfig.dtype = 'float32'"]


GRID = ["optimizer.OptimizerConfig.name=['adamw','adafactor']", "optimizer.OptimizerConfig.learning_rate=[3e-3,1e-2]"]
# the end-to-end sweep: two runs (a paired key), each with its own optimizer and learning rate
PAIRED = ["(optimizer.OptimizerConfig.name,optimizer.OptimizerConfig.learning_rate)="
          "[('adamw',3e-3),('adafactor',1e-2)]"]


def env() -> dict:
  return dict(os.environ, XLA_FLAGS=conftest.xla_flags(2), JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")


@pytest.fixture
def forked_launches(monkeypatch):
  """The launches of a sweep run in this process (its training runs and dataset builds) forked from the fork server
  (tests/forkserver.py). Such a sweep is never killed: its runs need not die with it (sweep._die_with_parent, the
  preexec_fn dropped here); the sweeps launched through the CLI below start theirs as the CLI does."""

  def popen(args, preexec_fn=None, **kwargs):  # pylint: disable=unused-argument
    return forkserver.Popen(args, **kwargs)

  forked = types.SimpleNamespace(Popen=popen, run=forkserver.run, STDOUT=subprocess.STDOUT, PIPE=subprocess.PIPE)
  monkeypatch.setattr(sweep, "subprocess", forked)
  monkeypatch.setattr(sweep_data, "subprocess", forked)


def test_grid_parses_literals_and_names_runs_stably():
  grid = sweep.parse_grid(GRID + ["MESH_SHAPE=[{'data': 2}, {'fsdp': 2}]", "(TRAIN_STEPS, SEED)=[(5, 1), (9, 2)]"])
  assert grid[0] == (("optimizer.OptimizerConfig.name",), [("adamw",), ("adafactor",)])
  assert grid[1][1] == [(3e-3,), (1e-2,)]
  assert grid[3] == (("TRAIN_STEPS", "SEED"), [(5, 1), (9, 2)])
  assert sweep.grid_keys(grid)[-3:] == ["MESH_SHAPE", "TRAIN_STEPS", "SEED"]
  assert sweep.run_name((("optimizer.OptimizerConfig.name", "adamw"), ("optimizer.OptimizerConfig.learning_rate",
                                                                        0.003))) == "name-adamw__learning_rate-0.003"
  assert sweep.run_name((("MESH_SHAPE", {"data": 2}),)) == "MESH_SHAPE-data_2"
  # two keys with the same last part keep their whole names
  assert sweep.run_name((("a.X.rate", 1), ("b.Y.rate", 2))) == "a.X.rate-1__b.Y.rate-2"


@pytest.mark.parametrize("spec, message", [
    ("optimizer.OptimizerConfig.learning_rate=[]", "key optimizer.OptimizerConfig.learning_rate has no values"),
    ("optimizer.OptimizerConfig.learning_rate=[3e-4,", "key optimizer.OptimizerConfig.learning_rate: cannot parse"),
    ("optimizer.OptimizerConfig.learning_rate=3e-4", "key optimizer.OptimizerConfig.learning_rate: '3e-4' is not a list"),
    ("MODEL_DIR=['a']", "key MODEL_DIR: set by the sweep"),
    ("no_equals_sign", "is not KEY=\\[VALUE"),
    ("(TRAIN_STEPS,SEED)=[(5, 1), (9,)]", "key \\(TRAIN_STEPS,SEED\\): \\(9,\\) is not a tuple of 2 values"),
    ("(TRAIN_STEPS,TRAIN_STEPS)=[(5, 1)]", "key TRAIN_STEPS is given twice"),
])
def test_bad_grid_specs_are_one_line_errors_naming_the_key(spec, message):
  with pytest.raises(ValueError, match=message):
    sweep.parse_grid([spec])


def test_grid_key_that_is_not_a_gin_binding_is_refused_before_any_launch(tmp_path):
  for key, reason in (("optimizer.OptimizerConfig.learning_rte", "doesn't have a parameter named 'learning_rte'"),
                      ("optimizer.NoSuchConfig.x", "No configurable matching 'optimizer.NoSuchConfig'"),
                      ("NO_SUCH_MACRO", "no gin file defines the macro NO_SUCH_MACRO")):
    grid = sweep.parse_grid([f"{key}=[1, 2]"])
    with pytest.raises(ValueError, match=f"--grid key {key} is not a gin binding.*{reason}"):
      sweep.plan(FILES, bindings("/nowhere"), ["."], grid, str(tmp_path / "s"))
  grid = sweep.parse_grid(["optimizer.OptimizerConfig.name=['adamw', 'adamx']"])  # a value its config refuses
  with pytest.raises(ValueError, match="sweep run name-adamx: OptimizerConfig.name='adamx'"):
    sweep.plan(FILES, bindings("/nowhere"), ["."], grid, str(tmp_path / "s"))
  assert not (tmp_path / "s").exists()  # nothing launched, nothing written


def test_tokenizer_axis_needs_the_corpus_and_owns_data_dir(tmp_path):
  with pytest.raises(ValueError, match="--grid key preprocess.vocab_size varies the tokenizer: give the corpus"):
    sweep.run_sweep(FILES, bindings("/nowhere"), ["."], ["preprocess.vocab_size=[300]"], str(tmp_path / "s"))
  with pytest.raises(ValueError, match="--grid key preprocess.output_dir: set by the sweep"):
    sweep.run_sweep(FILES, bindings("/nowhere"), ["."], ["preprocess.output_dir=['x']"], str(tmp_path / "s"),
                    preprocess_args=["--input=x"])
  with pytest.raises(ValueError, match="varies both DATA_DIR and the tokenizer"):
    sweep.run_sweep(FILES, bindings("/nowhere"), ["."], ["preprocess.vocab_size=[300]", "DATA_DIR=['a']"],
                    str(tmp_path / "s"), preprocess_args=["--input=x"])
  runs = sweep.plan(FILES, bindings("/nowhere"), ["."], sweep.parse_grid(["preprocess.vocab_size=[300]", GRID[0]]),
                    str(tmp_path))
  assert runs[0].data_dir == str(tmp_path / "data" / "vocab_size-300")
  assert f"DATA_DIR = '{tmp_path / 'data' / 'vocab_size-300'}'" in runs[0].bindings()
  assert not any(b.startswith("preprocess.") for b in runs[0].bindings())


def test_plan_gives_each_combination_its_model_dir_and_steps(tmp_path):
  grid = sweep.parse_grid(GRID + ["(TRAIN_STEPS,BATCH_SIZE)=[(5, 8)]"])
  runs = sweep.plan(FILES, bindings("/nowhere"), ["."], grid, str(tmp_path))
  assert [r.name for r in runs] == ["name-adamw__learning_rate-0.003__TRAIN_STEPS-5__BATCH_SIZE-8",
                                    "name-adamw__learning_rate-0.01__TRAIN_STEPS-5__BATCH_SIZE-8",
                                    "name-adafactor__learning_rate-0.003__TRAIN_STEPS-5__BATCH_SIZE-8",
                                    "name-adafactor__learning_rate-0.01__TRAIN_STEPS-5__BATCH_SIZE-8"]
  assert {r.train_steps for r in runs} == {5} and {r.tokens_per_step for r in runs} == {8 * 16}
  assert runs[2].bindings()[0] == "optimizer.OptimizerConfig.name = 'adafactor'"
  assert runs[2].bindings()[-1] == f"MODEL_DIR = '{tmp_path / runs[2].name}'"


def test_finished_means_the_final_eval_is_logged_and_a_cut_line_is_skipped(tmp_path):
  run = sweep.Run("r", (("SEED", 1),), str(tmp_path), train_steps=8, tokens_per_step=128)
  assert not sweep.is_finished(run) and sweep_report.summarize(run)["status"] == "not started"
  lines = [{"step": 0, "params/total": 10, "memory/opt_state_bytes_per_device": 80},
           {"step": 8, "loss": 2.5, "tokens_per_sec": 100.0, "memory/host_rss_peak_bytes": 2**30}]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 8, "ev')
  assert not sweep.is_finished(run) and sweep_report.summarize(run)["status"] == "incomplete"
  with open(tmp_path / "metrics.jsonl", "a") as f:  # the relaunch appends after the line a kill cut
    f.write("\n" + json.dumps({"step": 8, "eval/loss": 2.25}) + "\n")
  row = sweep_report.summarize(run)
  assert sweep.is_finished(run) and row["status"] == "finished"
  assert (row["final_train_loss"], row["final_eval_loss"], row["params"], row["opt_state_bytes_per_device"],
          row["peak_memory_bytes"], row["tokens_per_sec"]) == (2.5, 2.25, 10, 80, 2**30, 100.0)


@pytest.mark.slow  # two CLI launches
def test_cli_help_and_one_line_error():
  """`--help`, and a grid key that is no gin binding: the two launches run side by side."""
  launches = [forkserver.Popen([sys.executable, "-m", "t5x_like.sweep", *argv], cwd=REPO, env=env(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for argv in (["--help"], [*[f"--gin_file={f}" for f in FILES], "--gin.DATA_DIR='/nowhere'",
                                        "--grid=optimizer.OptimizerConfig.lr=[1e-3]", "--output_dir=/tmp/never"])]
  out, bad = (conftest.finished(p) for p in launches)
  assert out.returncode == 0 and "--grid" in out.stdout and "--output_dir" in out.stdout
  assert bad.returncode == 1
  assert bad.stderr.strip().splitlines() == [bad.stderr.strip().splitlines()[-1]]  # one line
  assert bad.stderr.startswith("error: --grid key optimizer.OptimizerConfig.lr is not a gin binding")


def _table(output_dir) -> list:
  with open(os.path.join(output_dir, "results.csv")) as f:
    return list(csv.DictReader(f))


def _launches(model_dir) -> list:
  """The step of each launch's start-up report in the run's metrics.jsonl."""
  from t5x_like.observe import plots  # pylint: disable=g-import-not-at-top
  return [r["step"] for r in plots.read_records(model_dir) if "params/total" in r]


@pytest.mark.slow  # trains 2 tiny runs, then the last of them again through the CLI with a kill -9
@pytest.mark.usefixtures("forked_launches")
def test_sweep_killed_mid_way_and_relaunched_gives_the_same_table(corpus, tmp_path, monkeypatch):
  """The uninterrupted sweep also logs every run to MLflow and W&B (tests/test_trackers.check_sweep_trackers). The
  same sweep through the CLI, as a kill -9 in its last run leaves it (its folder with the first run finished,
  copied from the uninterrupted one), killed -9 in that run and relaunched, writes the same table."""
  from tests import test_trackers  # pylint: disable=g-import-not-at-top  # (it needs mlflow and wandb)
  reference, store = str(tmp_path / "reference"), "file:" + str(tmp_path / "store")
  monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a file URI given by the user: their opt-in
  tracked = bindings(corpus) + ["observe.ObserveConfig.trackers = ('tensorboard', 'mlflow', 'wandb')",
                                f"observe.ObserveConfig.tracking_uri = {store!r}"]
  report = sweep.run_sweep(FILES, tracked, ["."], PAIRED, reference,
                           env=dict(env(), MLFLOW_ALLOW_FILE_STORE="true", WANDB_MODE="offline"))
  test_trackers.check_sweep_trackers(report, store, reference, STEPS)
  rows = _table(reference)
  assert [r["run"] for r in rows] == ["name-adamw__learning_rate-0.003", "name-adafactor__learning_rate-0.01"]
  assert {r["status"] for r in rows} == {"finished"}
  for row in rows:
    assert float(row["final_eval_loss"]) > 0 and float(row["tokens_per_sec"]) > 0
    assert int(row["peak_memory_bytes"]) > 2**20 and int(row["params"]) > 0
  opt = {r["run"]: int(r["opt_state_bytes_per_device"]) for r in rows}
  assert opt["name-adafactor__learning_rate-0.01"] < opt["name-adamw__learning_rate-0.003"]  # factored moments
  assert len({r["final_train_loss"] for r in rows}) == 2  # each run trained with its own optimizer / lr
  assert open(report["png"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
  assert "| name-adamw__learning_rate-0.003 | adamw | 0.003 | finished |" in open(report["markdown"]).read()

  # The same sweep from the CLI on a copy of the finished sweep without its last run and report: the CLI skips the
  # finished run, trains the last and is killed -9 (with its training child) once that run has logged
  # step 8 (checkpointed at 4); the relaunch skips it again and resumes the last run from its checkpoint.
  interrupted = str(tmp_path / "interrupted")
  last = os.path.join(interrupted, rows[-1]["run"])
  shutil.copytree(reference, interrupted, ignore=lambda folder, names: [
      n for n in names if folder == reference and (n == rows[-1]["run"] or n.startswith("results.")
                                                   or n.endswith(".png"))])
  assert _table_missing(interrupted) and not os.path.exists(last)
  command = [sys.executable, "-m", "t5x_like.sweep", *[f"--gin_file={f}" for f in FILES],
             *[f"--gin_bindings={b}" for b in tracked], *[f"--grid={g}" for g in PAIRED],
             f"--output_dir={interrupted}"]
  cli_env = dict(env(), MLFLOW_ALLOW_FILE_STORE="true", WANDB_MODE="offline")
  with open(str(tmp_path / "sweep.log"), "ab") as log:
    proc = forkserver.Popen(command, cwd=REPO, env=cli_env, stdout=log, stderr=subprocess.STDOUT)

    def resumable() -> bool:  # the last run logged step 8 and has not committed its step-12 checkpoint
      return (any(r["step"] >= 8 for r in interrupt.logged(last)) and os.path.isdir(checkpointing.checkpoint_dir(last))
              and checkpointing.committed_steps(last)[-1:] in ([4], [8]))

    interrupt.signal_when(proc, resumable, signal.SIGKILL, what="step 8 of the last run", timeout=600, poll=0.05,
                          log=str(tmp_path / "sweep.log"))
    assert proc.wait(timeout=60) == -signal.SIGKILL
    assert _table_missing(interrupted)
    assert forkserver.run(command, cwd=REPO, env=cli_env, stdout=log, stderr=subprocess.STDOUT,
                          timeout=900).returncode == 0
  for row in rows[:-1]:
    assert _launches(os.path.join(interrupted, row["run"])) == [0]  # finished: not relaunched
  assert _launches(last)[0] == 0 and _launches(last)[1] in (4, 8)  # resumed from its checkpoint
  again = _table(interrupted)
  for ref, row in zip(rows, again):
    assert row["run"] == ref["run"] and row["status"] == "finished"
    for column in ("final_train_loss", "final_eval_loss", "opt_state_bytes_per_device", "params"):
      assert row[column] == ref[column], (row["run"], column, row[column], ref[column])


def _table_missing(output_dir) -> bool:
  return not os.path.exists(os.path.join(output_dir, "results.csv"))


@pytest.mark.slow  # preprocesses the corpus twice and trains two tiny runs
@pytest.mark.usefixtures("forked_launches")
def test_tokenizer_axis_builds_one_dataset_per_setting_once(tmp_path):
  """--grid=preprocess.vocab_size=[300, 400]: two datasets built by preprocess, each run trained on its own (the
  embedding follows the vocabulary, padded to 128); a relaunch reuses both datasets and trains nothing."""
  conftest.write_corpus(str(tmp_path / "raw"))
  args = [f"--input={tmp_path / 'raw'}/*.txt", "--validation_fraction=0.2", "--num_train_shards=2", "--num_workers=1"]
  base = [b for b in bindings("/unused") if not b.startswith("DATA_DIR")] + ["TRAIN_STEPS = 4"]
  logs = []
  report = sweep.run_sweep(FILES, base, ["."], ["preprocess.vocab_size=[300, 400]"], str(tmp_path / "tok"),
                           env=env(), preprocess_args=args, log=logs.append)
  for vocab in (300, 400):
    manifest = json.loads((tmp_path / "tok" / "data" / f"vocab_size-{vocab}" / "manifest.json").read_text())
    assert manifest["vocab_size"] == vocab
  params = {row["run"]: row["params"] for row in report["rows"]}
  assert params["vocab_size-400"] - params["vocab_size-300"] == (512 - 384) * 32  # tied embedding, d_model 32
  assert sum("preprocessing" in line for line in logs) == 2
  logs.clear()
  sweep.run_sweep(FILES, base, ["."], ["preprocess.vocab_size=[300, 400]"], str(tmp_path / "tok"), env=env(),
                  preprocess_args=args, log=logs.append)
  assert sum("built, reused" in line for line in logs) == 2 and not any("training" in line for line in logs)
