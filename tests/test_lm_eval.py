"""lm-evaluation-harness on the engine: log-likelihoods equal transformers' on the same exported model, lm-eval's
tasks and metrics through `evaluate --tasks`, and bad tasks as one-line errors before any model loads."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
lm_eval = pytest.importorskip("lm_eval")
from lm_eval.api.model import TemplateLM  # pylint: disable=g-import-not-at-top

from t5x_like.evaluation import harness  # pylint: disable=g-import-not-at-top
from t5x_like.evaluation import runs  # pylint: disable=g-import-not-at-top
from t5x_like.evaluation import tasks as lm_tasks  # pylint: disable=g-import-not-at-top
from tests.hf_reference import hf_models, imported, tokenizer  # pylint: disable=g-import-not-at-top,unused-import
from tests.test_fault_tolerance import REPO, launch_args, launch_env  # pylint: disable=g-import-not-at-top
from tests import conftest  # pylint: disable=g-import-not-at-top
from tests import forkserver

WORDS = ["the quick brown fox", "jumps over the lazy dog;", "hello world, hello there.", "the lazy fox"]


def _write_mc_task(folder, name, rows):
  """An lm-eval multiple-choice task `name` over `rows` ({"context", "choices", "label"}) in `folder`."""
  os.makedirs(folder, exist_ok=True)
  with open(os.path.join(folder, f"{name}.jsonl"), "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  with open(os.path.join(folder, f"{name}.yaml"), "w") as f:
    f.write(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {name}.jsonl\n"
            "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{context}}'\n"
            "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{label}}'\ntarget_delimiter: ''\n"
            "metric_list:\n  - metric: acc\n")
  return folder


def _mc_task(folder, items=12, seed=0):
  """A multiple-choice task over the hf_reference tokenizer's text: which ending follows the context."""
  rng = np.random.default_rng(seed)
  rows = [{"context": " ".join(rng.choice(WORDS, 2)), "choices": [" " + w for w in WORDS],
           "label": int(rng.integers(4))} for _ in range(items)]
  return _write_mc_task(folder, "ends", rows)


class HFReference(TemplateLM):
  """lm-eval's log-likelihoods straight from a transformers model, on the same token ids as ours."""

  def __init__(self, model, ours):
    super().__init__()
    self.model, self.ours = model, ours

  eot_token_id = property(lambda self: self.ours.eot_token_id)
  tok_encode = lambda self, string, **kwargs: self.ours.tok_encode(string)

  def _loglikelihood_tokens(self, requests, **kwargs):
    out = []
    for _, context, continuation in requests:
      ids = torch.tensor([list(context) + list(continuation)])
      with torch.no_grad():
        logp = torch.log_softmax(self.model(ids).logits[0].double(), -1).numpy()
      targets = ids[0, len(context):].numpy()
      rows = logp[len(context) - 1:len(context) - 1 + len(targets)]
      out.append((float(rows[np.arange(len(targets)), targets].sum()),
                  bool((rows.argmax(-1) == targets).all())))
    return out

  def loglikelihood_rolling(self, requests, disable_tqdm=False):
    raise NotImplementedError

  def generate_until(self, requests, disable_tqdm=False):
    raise NotImplementedError


@pytest.mark.parametrize("name", ["gpt2", "llama_gqa"])
def test_loglikelihoods_and_accuracy_equal_transformers(name, hf_models, imported, tmp_path):
  model_dir = imported[name][0]
  run = runs.open_run(model_dir, gin_files=[os.path.join(model_dir, "model.gin")],
                      bindings=["model.GPTConfig.dtype = 'float32'"])
  ours = harness.T5xLikeLM(run=run, batch_size=4)
  reference = HFReference(hf_models[name][0], ours)
  manager = lm_tasks.task_manager(["ends"], _mc_task(str(tmp_path / "tasks")))
  got = lm_eval.simple_evaluate(model=ours, tasks=["ends"], task_manager=manager, log_samples=True,
                                bootstrap_iters=0)
  want = lm_eval.simple_evaluate(model=reference, tasks=["ends"], task_manager=manager, log_samples=True,
                                 bootstrap_iters=0)
  ours_ll = [r[0][0] for s in got["samples"]["ends"] for r in s["resps"]]
  ref_ll = [r[0][0] for s in want["samples"]["ends"] for r in s["resps"]]
  assert len(ours_ll) == 12 * 4
  np.testing.assert_allclose(ours_ll, ref_ll, atol=1e-4)
  assert len(set(np.round(ref_ll, 3))) > 4  # the choices really differ
  assert got["results"]["ends"]["acc,none"] == want["results"]["ends"]["acc,none"]


def test_unknown_task_empty_folder_missing_field_and_too_many_shots_are_one_line_errors(tmp_path):
  folder = _mc_task(str(tmp_path / "tasks"), items=3)
  with pytest.raises(ValueError, match=r"unknown task 'nope': not in --task_dir=") as e:
    lm_tasks.task_manager(["nope"], folder)
  assert "\n" not in str(e.value)
  os.makedirs(tmp_path / "empty")
  with pytest.raises(ValueError, match=r"holds no task YAML"):
    lm_tasks.task_manager(["ends"], str(tmp_path / "empty"))
  manager = lm_tasks.task_manager(["ends"], folder)
  with pytest.raises(ValueError, match=r"task 'ends' \(.*ends.jsonl\): --num_fewshot=5 but the data holds only 2"):
    lm_tasks.load_tasks(["ends"], manager, num_fewshot=5)
  lm_tasks.load_tasks(["ends"], manager, num_fewshot=2)
  with open(os.path.join(folder, "ends.jsonl")) as f:
    text = f.read().replace('"choices"', '"options"', 1)
  with open(os.path.join(folder, "ends.jsonl"), "w") as f:
    f.write(text)
  with pytest.raises(ValueError, match=r"task 'ends' \(.*ends.jsonl\): document 0 lacks the field 'choices'") as e:
    lm_tasks.load_tasks(["ends"], lm_tasks.task_manager(["ends"], folder))
  assert "ends" in str(e.value) and "\n" not in str(e.value)
  os.remove(os.path.join(folder, "ends.jsonl"))
  with pytest.raises(ValueError, match=r"task 'ends': data file .*ends.jsonl does not exist"):
    lm_tasks.task_manager(["ends"], folder)


def test_every_kind_of_name_lm_eval_registers_passes_the_quick_unknown_check(monkeypatch, tmp_path):
  """task_manager refuses a name written in none of lm-eval's task files without indexing them (about 9 s); a
  task, a group, and tags written only in included files (one named `_..._yaml`, one without an extension) pass."""
  text = lm_tasks._lm_eval_task_text()  # pylint: disable=protected-access
  for name in ("hellaswag", "mmlu", "acp_bench", "mafand_tasks"):
    assert name.encode() in text, name
  assert b"nope_not_a_task" not in text
  built = []  # the TaskManagers task_manager makes: none indexing lm-eval's own tasks for an unknown name
  manager = lm_tasks.TaskManager
  monkeypatch.setattr(lm_tasks, "TaskManager", lambda **kw: built.append(kw) or manager(**kw))
  with pytest.raises(ValueError, match=r"unknown task 'nope_not_a_task'"):
    lm_tasks.task_manager(["nope_not_a_task"], _mc_task(str(tmp_path / "tasks"), items=3))
  assert built and all(kw.get("include_defaults") is False for kw in built), built


def _corpus_task(folder):
  """A multiple-choice task over the shared test corpus's sentences (tests/conftest.write_corpus)."""
  rows = [{"context": "every host", "choices": [" restores tokens.", " blue sky."], "label": 0},
          {"context": "the mesh", "choices": [" green grass.", " shards gradients."], "label": 1}] * 3
  return _write_mc_task(folder, "hosts", rows)


def _launch(args) -> subprocess.Popen:
  return forkserver.Popen(args, cwd=REPO, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow  # trains and evaluates in process; two launches that must fail (exit code 1, one stderr line)
def test_tasks_in_the_training_loop_and_the_evaluate_cli(corpus, tmp_path, monkeypatch, capsys):
  """In the loop: task scores at the interval in metrics.jsonl, TensorBoard and the plot's Tasks panel; an unknown
  task stops the start in one line. After: `evaluate --tasks` on the same run's checkpoint runs the shipped tasks
  and writes lm-eval's results; a bad --num_fewshot is one line. The run and `evaluate --tasks` run in this process
  (train and evaluate's main, 8 devices: the mesh all data-parallel), each failing launch meanwhile."""
  from t5x_like.observe import plots  # pylint: disable=g-import-not-at-top
  tasks = _corpus_task(str(tmp_path / "tasks"))
  model_dir = str(tmp_path / "run")
  flags = ["--gin.observe.ObserveConfig.tasks=('hosts',)", "--gin.observe.ObserveConfig.task_every=2",
           f"--gin.observe.ObserveConfig.task_dir='{tasks}'", "--gin.model.GPTConfig.max_len=128"]
  # a task that cannot load stops the start, before anything compiles, in one line
  bad_start = _launch(launch_args(str(tmp_path / "bad"), corpus, 4) + flags[:1] + [
      "--gin.observe.ObserveConfig.tasks=('nope',)", f"--gin.observe.ObserveConfig.task_dir='{tasks}'"])
  bad_fewshot = None
  try:
    code = conftest.run_entry_point(monkeypatch, "train", launch_args(model_dir, corpus, 4)[3:] + flags + [
        "--gin.MESH_SHAPE={'pipeline': 1, 'data': -1}"])
    assert code in (None, 0), capsys.readouterr().err[-3000:]
    # the evaluate CLI on the run's checkpoint: the shipped tasks, then a bad --num_fewshot
    base = [sys.executable, "-m", "t5x_like.evaluate", f"--gin_file={model_dir}/config.gin"]
    shutil.copytree(lm_tasks.shipped_task_dir(), tmp_path / "shipped")
    bad_fewshot = _launch(base + ["--tasks=copy_digits", "--num_fewshot=50", f"--task_dir={tmp_path / 'shipped'}"])
    out = str(tmp_path / "results.json")
    capsys.readouterr()
    code = conftest.run_entry_point(monkeypatch, "evaluate", base[3:] + [
        "--tasks=pystdlib_next_line,pystdlib_cloze,copy_digits", "--limit=4", f"--output_file={out}"])
    stdout, stderr = capsys.readouterr()
    assert code in (None, 0), stderr[-3000:]
    assert "|pystdlib_next_line|" in stdout and "exact_match" in stdout
    results = json.load(open(out))["results"]
    assert set(results) == {"pystdlib_next_line", "pystdlib_cloze", "copy_digits"}
    assert results["pystdlib_next_line"]["sample_len"] == 4 and 0 <= results["pystdlib_next_line"]["acc,none"] <= 1
    assert results["copy_digits"]["exact_match,none"] >= 0 and results["pystdlib_cloze"]["perplexity,none"] > 1
    records = plots.read_records(model_dir)
    assert [r["step"] for r in records if "tasks/hosts/acc" in r] == [2, 4]
    assert all(0 <= r["tasks/hosts/acc"] <= 1 for r in records if "tasks/hosts/acc" in r)
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    tags = {v.tag for path in tf.io.gfile.glob(f"{model_dir}/events.out.tfevents*")
            for event in tf.compat.v1.train.summary_iterator(path) for v in event.summary.value}
    assert "tasks/hosts/acc" in tags
    assert plots.task_panel({"run": records})[2] == [("tasks/hosts/acc", "o-", "hosts/acc")]
    png = plots.plot_runs({"run": records}, str(tmp_path / "curves.png"))
    assert os.path.getsize(png) > 1000
  finally:
    done = conftest.finished(bad_start, timeout=400)
    fewshot = bad_fewshot and conftest.finished(bad_fewshot, timeout=400)
  assert done.returncode == 1
  assert done.stderr.strip().splitlines()[-1].startswith("error: unknown task 'nope'"), done.stderr[-2000:]
  assert not any("loss" in r for r in plots.read_records(str(tmp_path / "bad")))  # no step ran (only the report)
  assert fewshot.returncode == 1
  assert fewshot.stderr.strip().splitlines()[-1].startswith("error: task 'copy_digits'"), fewshot.stderr[-2000:]
  assert "--num_fewshot=50 but the data holds only 20" in fewshot.stderr


def test_a_task_failing_mid_run_is_reported_once_and_training_goes_on(monkeypatch, caplog):
  from t5x_like.evaluation import in_loop  # pylint: disable=g-import-not-at-top
  from t5x_like.observe import ObserveConfig  # pylint: disable=g-import-not-at-top
  hook = object.__new__(in_loop.TaskEvalHook)
  written = []

  class Sink:
    def write(self, step, scalars):
      written.append((step, scalars))

  hook.config, hook.sinks, hook.train_steps = ObserveConfig(tasks=("hosts",), task_every=1), [Sink()], 3
  hook.failed, hook.last = False, {}

  def broken(params):
    raise FileNotFoundError("hosts.jsonl was removed")

  monkeypatch.setattr(hook, "evaluate", broken)
  state = type("State", (), {"params": {}})()
  for step in (1, 2, 3):
    hook(step, state, {})
  assert written == [] and caplog.text.count("task evaluation failed") == 1
  assert "hosts.jsonl was removed" in caplog.text
