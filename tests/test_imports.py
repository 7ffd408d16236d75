"""The package's imports point one way: checked from the source by tests/import_graph.py."""

import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import import_graph  # pylint: disable=g-import-not-at-top,wrong-import-position


def test_no_cycles_no_hidden_imports_layering_kept():
  _, _, problems = import_graph.graph()
  assert not problems, "\n".join(problems)


def test_the_checker_sees_a_cycle_and_a_function_level_import(tmp_path):
  """The checks themselves can fail: a two-module cycle and an import inside a function are reported."""
  assert import_graph.cycles({"a": ["b"], "b": ["a"], "c": ["a"]}) == [["a", "b", "a"]]
  path = tmp_path / "m.py"
  path.write_text("import os\n\ndef f():\n  from t5x_like.model import decoder\n  return decoder\n")
  known = {"t5x_like.model.decoder": ""}
  top, nested, private = import_graph.scan(str(path), known)
  assert not top and nested == [(4, "t5x_like.model.decoder")] and not private


@pytest.mark.slow  # two Python processes
def test_importing_the_package_quiets_tensorflow_and_keeps_the_users_setting():
  """t5x_like/__init__ sets TF's log defaults before any module imports tensorflow (else TF's C++ notices land
  ahead of an entry point's one-line error); a value the user exported wins."""
  show = "import os, t5x_like; print(os.environ['TF_CPP_MIN_LOG_LEVEL'], os.environ['TF_ENABLE_ONEDNN_OPTS'])"
  env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "TF_ENABLE_ONEDNN_OPTS")}
  run = lambda extra: subprocess.run([sys.executable, "-c", show], env={**env, **extra}, capture_output=True,
                                     text=True, check=True, timeout=60).stdout.split()
  assert run({}) == ["3", "0"]
  assert run({"TF_ENABLE_ONEDNN_OPTS": "1", "TF_CPP_MIN_LOG_LEVEL": "1"}) == ["1", "1"]
