"""One real tiny run (subprocess, 8 CPU devices, data×fsdp×tensor mesh) observed from outside: metrics.jsonl,
the Prometheus endpoint while it trains, the profiler trace, the plot, evaluate and infer CLIs (run in this
process, on 8 devices too; prompts from flags and a file; an unreadable newest checkpoint skipped for the one
before it)."""

import json
import math
import os
import random
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import jax
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests import conftest
from tests import forkserver
from tests.decode_reference import engine_tokens, generate_by_recompute

from t5x_like import cli as cli_lib
from t5x_like import plot
from t5x_like.model import decoder as model_lib
from t5x_like.training import optimizer as optimizer_lib
from t5x_like.data import preprocessing as preprocess
from t5x_like.data import tokenizer as tokenizer_lib
from t5x_like.training import checkpointing
from t5x_like.training import config as config_lib
from t5x_like.recipes import experiment

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESH = "{'pipeline': 1, 'data': 2, 'fsdp': 2, 'tensor': 2}"
STEPS, LOG_EVERY, EVAL_EVERY, BATCH, SEQ = 12, 2, 6, 8, 32
UNREADABLE = STEPS + 6  # the newer, damaged checkpoint step of the `damaged` copy
PROFILE = (5, 6)
# gpt_tiny.gin's layout, smaller: every compile of the file (train and eval steps, engines, the recompute) is cheaper
MODEL = {"num_layers": 2, "num_heads": 2, "d_model": 32, "d_ff": 64, "max_len": 64}


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def gin_args(model_dir, data_dir):
  return ["--gin_file=configs/models/gpt_tiny.gin", "--gin_file=configs/runs/pretrain.gin",
          f"--gin.MODEL_DIR='{model_dir}'", f"--gin.DATA_DIR='{data_dir}'", f"--gin.MESH_SHAPE={MESH}",
          f"--gin.BATCH_SIZE={BATCH}", f"--gin.SEQ_LEN={SEQ}",
          *[f"--gin.model.GPTConfig.{k}={v}" for k, v in MODEL.items()]]


def cli(monkeypatch, capsys, module, *args) -> str:
  """stdout of `python -m t5x_like.<module> *args`, run in this process (8 devices, as the run's launch)."""
  capsys.readouterr()
  code = conftest.run_entry_point(monkeypatch, module, args)
  captured = capsys.readouterr()
  assert code in (None, 0), captured.err[-3000:]
  return captured.out


def scrape(port):
  try:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
  except (urllib.error.URLError, ConnectionError, OSError):
    return None


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """Trains STEPS steps with the endpoint on and a trace of steps 5..6, scraping /metrics while it runs."""
  root = tmp_path_factory.mktemp("observed")
  rng = random.Random(0)
  os.makedirs(root / "raw")
  words = (["the trainer", "a shard", "every host"], ["reads", "writes", "packs"], ["tokens", "batches", "layers"])
  for f in range(4):
    with open(root / "raw" / f"doc{f}.txt", "w") as out:
      out.writelines(" ".join(rng.choice(w) for w in words) + ".\n" for _ in range(300))
  data_dir, model_dir = str(root / "ds"), str(root / "run")
  preprocess.preprocess([str(root / "raw" / "*.txt")], data_dir, vocab_size=512, num_train_shards=2,
                        validation_fraction=0.2, progress=False, cache_dir=None)
  port = free_port()
  cmd = [sys.executable, "-m", "t5x_like.train", *gin_args(model_dir, data_dir),
         f"--gin.TRAIN_STEPS={STEPS}", f"--gin.LOG_EVERY={LOG_EVERY}", f"--gin.EVAL_EVERY={EVAL_EVERY}",
         f"--gin.CHECKPOINT_EVERY={STEPS}", f"--gin.observe.ObserveConfig.prometheus_port={port}",
         f"--gin.observe.ObserveConfig.profile_steps={PROFILE}"]
  scrapes = []
  with open(root / "train.log", "w") as log:
    proc = forkserver.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 600
    while proc.poll() is None and time.time() < deadline:
      text = scrape(port)
      if text:
        scrapes.append(text)
      time.sleep(0.05)
    if proc.poll() is None:
      proc.kill()
  assert proc.wait() == 0, open(root / "train.log").read()[-3000:]
  records = [json.loads(line) for line in open(os.path.join(model_dir, "metrics.jsonl"))]
  return {"model_dir": model_dir, "data_dir": data_dir, "records": records, "scrapes": scrapes, "root": root}


def test_metrics_jsonl_figures_are_consistent(run):
  train = [r for r in run["records"] if "loss" in r]
  assert [r["step"] for r in train] == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))
  first, rest = train[0], train[1:]
  assert first["compile_seconds"] > 0 and all("compile_seconds" not in r for r in rest)
  for r in train:
    assert r["perplexity"] == pytest.approx(math.exp(r["loss"]), rel=1e-12)
    assert r["nonfinite_steps"] == 0 and r["nonfinite_steps_total"] == 0
    assert r["data_queue_depth"] >= 0 and r["memory/host_rss_bytes"] > 0
    assert r["data_wait_seconds"] + r["compute_seconds"] == pytest.approx(r["step_seconds"])
    assert r["tokens_per_sec"] == pytest.approx(BATCH * SEQ / r["step_seconds"])
    assert r["tokens_per_sec_per_device"] == pytest.approx(r["tokens_per_sec"] / 8)
  # MFU is throughput × a constant (FLOPs/token over the summed peak) in every record
  ratios = [r["mfu"] / r["tokens_per_sec"] for r in train]
  assert max(ratios) == pytest.approx(min(ratios), rel=1e-9)
  assert train[-1]["loss"] < train[0]["loss"]


def test_eval_perplexity_is_exp_of_eval_loss(run):
  evals = [r for r in run["records"] if "eval/loss" in r]
  assert [r["step"] for r in evals] == [EVAL_EVERY, STEPS]
  for r in evals:
    assert r["eval/perplexity"] == pytest.approx(math.exp(r["eval/loss"]), rel=1e-12)
    assert r["eval/tokens"] > 0 and r["eval/batches"] >= 1
  assert evals[-1]["eval/loss"] < evals[0]["eval/loss"]


def test_prometheus_endpoint_shows_the_step_advancing_during_the_run(run):
  parsed = [{f.name: f.samples[0].value for f in text_string_to_metric_families(text)} for text in run["scrapes"]]
  steps = [p["t5x_like_step"] for p in parsed]
  assert steps == sorted(steps), steps
  logged = sorted({s for s in steps if s > 0})
  assert len(logged) >= 2, f"the endpoint showed steps {logged} only"
  by_step = {r["step"]: r for r in run["records"] if "loss" in r}
  late = [p for p in parsed if p["t5x_like_step"] > LOG_EVERY]  # past the compile-only interval
  assert late
  for p in late:
    step = int(p["t5x_like_step"])
    if "t5x_like_eval_loss" not in p:  # a training snapshot: every gauge is from the same log step
      assert p["t5x_like_loss"] == by_step[step]["loss"]
      assert p["t5x_like_tokens_per_second"] == by_step[step]["tokens_per_sec"]
    assert {"t5x_like_mfu_ratio", "t5x_like_step_seconds", "t5x_like_data_wait_seconds",
            "t5x_like_data_queue_depth", "t5x_like_host_rss_bytes"} <= set(p)
    assert p["t5x_like_train_steps"] == STEPS


def test_profiler_writes_a_trace_under_model_dir_profile(run):
  traces = []
  for dirpath, _, files in os.walk(os.path.join(run["model_dir"], "profile")):
    traces += [os.path.join(dirpath, f) for f in files if f.endswith(".xplane.pb")]
  assert len(traces) == 1 and os.path.getsize(traces[0]) > 0, traces


def test_plot_writes_a_png_of_one_or_several_runs(run, tmp_path, monkeypatch, capsys):
  import matplotlib.image  # pylint: disable=g-import-not-at-top
  other = tmp_path / "other"
  other.mkdir()
  with open(other / "metrics.jsonl", "w") as f:
    for r in run["records"]:
      f.write(json.dumps({**r, **({"loss": r["loss"] + 0.5} if "loss" in r else {})}) + "\n")
  out = str(tmp_path / "curves.png")
  code = conftest.run_cli_in_process(monkeypatch, lambda: cli_lib.run(plot.main),
                                     ["plot", run["model_dir"], str(other), f"--out={out}"])
  assert code in (None, 0)
  assert capsys.readouterr().out.strip() == out
  with open(out, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  image = matplotlib.image.imread(out)
  assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 600


@pytest.fixture(scope="module")
def damaged(run, tmp_path_factory):
  """A copy of the run's MODEL_DIR whose newest committed step, UNREADABLE, is step STEPS's directory
  with every array data file overwritten by zeros: listed like a good step, failing only at restore."""
  model_dir = str(tmp_path_factory.mktemp("damaged") / "run")
  shutil.copytree(run["model_dir"], model_dir, ignore=shutil.ignore_patterns("profile"))
  bad = os.path.join(checkpointing.checkpoint_dir(model_dir), str(UNREADABLE))
  shutil.copytree(os.path.join(checkpointing.checkpoint_dir(model_dir), str(STEPS)), bad)
  zeroed = 0
  for dirpath, _, files in os.walk(os.path.join(bad, checkpointing.STATE)):
    for name in files if os.path.basename(dirpath) == "d" else []:  # ocdbt data files
      path = os.path.join(dirpath, name)
      with open(path, "r+b") as f:
        f.write(bytes(os.path.getsize(path)))
      zeroed += 1
  assert zeroed and checkpointing.committed_steps(model_dir) == [STEPS, UNREADABLE]
  return model_dir


def experiment_on(model_dir, data_dir):
  """The run's Experiment (gpt_tiny with MODEL's sizes, on the run's mesh), pointed at `model_dir`."""
  config = config_lib.TrainConfig(model_dir=model_dir, data_dir=data_dir, batch_size=BATCH, seq_len=SEQ,
                                  mesh_shape=eval(MESH))  # pylint: disable=eval-used
  tiny = model_lib.GPTConfig(**MODEL, dtype="float32")
  return experiment.Experiment(config, tiny, optimizer_lib.OptimizerConfig())


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax's loop, after the failed read
def test_restore_params_falls_back_past_an_unreadable_newest_checkpoint(run, damaged, caplog):
  """infer and evaluate restore through Experiment.restore_params: an unreadable newest step is logged
  and the one before it restored, bit-identical to the undamaged run's; asked for by number, it fails."""
  exp = experiment_on(damaged, run["data_dir"])
  with exp.context():
    found, params = exp.restore_params()
    with pytest.raises(FileNotFoundError, match=f"no readable checkpoint in .* at step {UNREADABLE}"):
      exp.restore_params(UNREADABLE)
  assert found == STEPS
  assert f"checkpoint step {UNREADABLE} is unreadable" in caplog.text
  clean = experiment_on(run["model_dir"], run["data_dir"])
  with clean.context():
    assert clean.restore_params()[0] == STEPS
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(params), jax.device_get(clean.restore_params()[1]))


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax's loop, after the failed read
def test_evaluate_cli_matches_the_runs_own_evaluation_past_an_unreadable_checkpoint(run, damaged, monkeypatch,
                                                                                   capsys):
  out = cli(monkeypatch, capsys, "evaluate", *gin_args(damaged, run["data_dir"]))
  result = json.loads(out.strip().splitlines()[-1])
  assert result["step"] == STEPS and result["split"] == "validation"
  assert result["eval/perplexity"] == pytest.approx(math.exp(result["eval/loss"]), rel=1e-12)
  logged = next(r for r in run["records"] if r.get("step") == STEPS and "eval/loss" in r)
  assert result["eval/loss"] == pytest.approx(logged["eval/loss"], rel=1e-6)
  assert f"loss {result['eval/loss']:.6f}" in out and f"perplexity {result['eval/perplexity']:.4f}" in out


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax's loop, after the failed read
def test_infer_cli_continues_prompts_from_flags_and_file_past_an_unreadable_checkpoint(run, damaged, tmp_path,
                                                                                     monkeypatch, capsys):
  """--prompt and --prompt_file (blank lines skipped), from the last readable checkpoint: each sample
  is its prompt + the greedy continuation of a cache-free recompute on one device, cut at EOS."""
  prompt_file = tmp_path / "prompts.txt"
  prompt_file.write_text("every host packs\n\na shard writes\n")
  prompts = ["the trainer", "every host packs", "a shard writes"]
  new_tokens = 12
  out = cli(monkeypatch, capsys, "infer", *gin_args(damaged, run["data_dir"]), "--prompt=the trainer",
            f"--prompt_file={prompt_file}", f"--max_new_tokens={new_tokens}")
  header, *samples = out.split("# sample ")
  assert header == f"# checkpoint step {STEPS}\n"
  exp = experiment_on(run["model_dir"], run["data_dir"])
  tok = tokenizer_lib.Tokenizer.load(os.path.join(run["data_dir"], exp.manifest["tokenizer"]))
  with exp.context():
    params = jax.device_get(exp.restore_params()[1])
  continued = [np.asarray(generate_by_recompute(params, np.array([tok.encode(p)]), config=exp.model_config,
                                                max_new_tokens=new_tokens))[0].tolist() for p in prompts]
  continuations = [tok.decode(row[:row.index(tok.eos_id)] if tok.eos_id in row else row) for row in continued]
  assert samples == [f"{i + 1}/3\n{p}{c}\n" for i, (p, c) in enumerate(zip(prompts, continuations))]
  assert all(c.strip() for c in continuations)


def test_generate_on_the_training_mesh_matches_one_device(run):
  exp = experiment_on(run["model_dir"], run["data_dir"])
  prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
  with exp.context():
    _, params = exp.restore_params()
    sharded = engine_tokens(exp.model_config, params, prompts, 10, mesh=exp.mesh, rules=exp.rules)
  host = jax.device_get(params)
  single = engine_tokens(exp.model_config, host, prompts, 10)
  np.testing.assert_array_equal(sharded, single)
  leaves = jax.tree.leaves(params)
  assert any(len(leaf.sharding.device_set) == 8 and not leaf.sharding.is_fully_replicated for leaf in leaves)
