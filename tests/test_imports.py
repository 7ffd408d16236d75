"""The package's imports point one way: checked from the source by tests/import_graph.py."""

import os
import sys

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
