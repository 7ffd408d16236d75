"""The README's demo figures against what the demo config prints today: a short run of the README's own command."""

import json
import os
import re
import shlex
import sys

import pytest

from tests import conftest
from tests import forkserver

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_GIN = "configs/experiments/pystdlib_demo.gin"
# what hooks.EvalHook prints after the last evaluation of a run with the unigram baseline
EVAL_LINE = re.compile(r"eval loss (\d+\.\d+) perplexity (\d+\.\d+) \(unigram baseline (\d+\.\d+)\)")


def readme_demo() -> dict:
  """The demo section of README.md: its first code block, the short-run command, and the stated figures."""
  with open(os.path.join(ROOT, "README.md")) as f:
    text = f.read()
  section = " ".join(text[text.index("## Set-up"):text.index("Run the tests")].split())  # a figure may wrap
  first_block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
  short = re.search(r"`(python -m t5x_like\.train [^`]*--gin\.TRAIN_STEPS=\d+[^`]*)`", section)
  figures = EVAL_LINE.findall(section)
  tokens = re.search(r"([\d,]+) tokens\)", section)
  assert short and len(figures) == 2 and tokens, (
      "README.md's demo section must state the long run's and the short run's `eval loss ... (unigram baseline ...)` "
      "lines, the short run's `python -m t5x_like.train ... --gin.TRAIN_STEPS=N` command and the corpus's tokens")
  return {"first_block": first_block, "short_command": short.group(1), "long": figures[0], "short": figures[1],
          "tokens": int(tokens.group(1).replace(",", ""))}


def _run(argv, timeout=900) -> str:
  # As a user's shell runs it: none of the tests' XLA settings (conftest.user_env); forked from a fork server that
  # has imported TensorFlow and JAX, as `python ARGV` (tests/forkserver.py; tests/test_forkserver.py compares both).
  out = forkserver.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=conftest.user_env())
  assert out.returncode == 0, f"{shlex.join(argv)} exited {out.returncode}:\n{out.stderr[-3000:]}"
  return out.stdout + out.stderr


@pytest.fixture(scope="module")
def readme():
  return readme_demo()


def test_readme_demo_command_is_the_demo_config(readme):
  assert "python data/pystdlib/prepare.py" in readme["first_block"]
  assert f"python -m t5x_like.train --gin_file={DEMO_GIN}" in readme["first_block"]
  assert readme["short_command"].startswith(f"python -m t5x_like.train --gin_file={DEMO_GIN} ")


@pytest.mark.slow
def test_readme_demo_figures_are_what_the_demo_prints(readme, tmp_path):
  """Prepares the demo's dataset as the README does, runs the README's short command on it and compares what it
  prints with the README: eval loss to 2 decimals (XLA:CPU may round the last bits differently on another CPU),
  and the unigram baseline, a count over the prepared data, to every stated digit (the long run's line too:
  same data)."""
  data_dir = tmp_path / "prepared"
  _run([sys.executable, "data/pystdlib/prepare.py", f"--output_dir={data_dir}"])
  with open(data_dir / "manifest.json") as f:
    splits = json.load(f)["splits"]
  tokens = sum(shard["num_tokens"] for split in splits.values() for shard in split["shards"])
  assert tokens == readme["tokens"], (
      f"the prepared corpus has {tokens} tokens, README.md states {readme['tokens']}: this Python's standard "
      f"library ({sys.version.split()[0]}) is not the README's corpus, or prepare.py changed")

  argv = shlex.split(readme["short_command"])
  argv = [a for a in argv if not a.startswith(("--gin.MODEL_DIR=", "--gin.DATA_DIR="))]
  argv = [sys.executable] + argv[1:] + [f"--gin.MODEL_DIR='{tmp_path / 'run'}'", f"--gin.DATA_DIR='{data_dir}'"]
  printed = EVAL_LINE.findall(_run(argv))
  assert printed, "the short demo run printed no `eval loss ... (unigram baseline ...)` line"
  loss, _, baseline = printed[-1]
  readme_loss, _, readme_baseline = readme["short"]
  assert abs(float(loss) - float(readme_loss)) < 0.005, (
      f"the README's short run states eval loss {readme_loss}, `{readme['short_command']}` prints {loss}")
  assert baseline == readme_baseline == readme["long"][2], (
      f"unigram baseline printed {baseline}, README.md states {readme_baseline} (short) / {readme['long'][2]} (long)")
