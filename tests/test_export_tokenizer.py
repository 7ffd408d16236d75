"""`convert to_hf` of a pre-training run ships the tokenizer it trained with (found through its DATA_DIR)."""

import os
import shutil
import subprocess
import sys

import pytest

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from t5x_like.data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
from tests.test_fault_tolerance import REPO, launch_args, launch_env  # pylint: disable=g-import-not-at-top
from tests import conftest  # pylint: disable=g-import-not-at-top
from tests import forkserver

TEXT = "the quick brown fox sees a lazy dog.\nThe cat runs."


def _convert_args(model_dir, out):
  return ["to_hf", f"--model_dir={model_dir}", f"--output_dir={out}"]


@pytest.mark.slow  # a 2-step training run and two conversions
def test_pretraining_run_exports_its_data_dirs_tokenizer(corpus, tmp_path, monkeypatch):
  """test_fault_tolerance's TINY launch, trained and converted in this process (8 devices, so the mesh is all
  data-parallel); the conversion without the DATA_DIR is a launch of its own, whose stderr is counted."""
  data_dir = str(tmp_path / "data")
  shutil.copytree(corpus, data_dir)
  model_dir = str(tmp_path / "run")
  train_args = launch_args(model_dir, data_dir, 2)[3:] + ["--gin.MESH_SHAPE={'pipeline': 1, 'data': -1}"]
  assert conftest.run_entry_point(monkeypatch, "train", train_args) in (None, 0)
  out = str(tmp_path / "hf")
  assert conftest.run_entry_point(monkeypatch, "convert", _convert_args(model_dir, out)) in (None, 0)
  ours = tokenizer_lib.load(data_dir)
  # The DATA_DIR gone: the weights are still written, and one line says where no tokenizer was found.
  shutil.rmtree(data_dir)
  without = forkserver.Popen([sys.executable, "-m", "t5x_like.convert",
                              *_convert_args(model_dir, tmp_path / "hf2")], cwd=REPO, env=launch_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    assert os.path.exists(os.path.join(out, "tokenizer.json")), os.listdir(out)
    exported = tokenizers.Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    assert exported.encode(TEXT, add_special_tokens=False).ids == ours.encode(TEXT)
    transformers.AutoTokenizer.from_pretrained(out)  # transformers loads the folder
  finally:
    _, stderr = without.communicate(timeout=300)
  assert without.returncode == 0, stderr[-2000:]
  lines = [line for line in stderr.splitlines() if "no tokenizer found" in line]
  assert len(lines) == 1 and model_dir in lines[0], stderr[-2000:]
  assert os.path.exists(tmp_path / "hf2" / "config.json")
  assert not any("tokenizer" in name for name in os.listdir(tmp_path / "hf2"))


def test_the_data_dir_is_read_when_gin_wraps_a_long_path(tmp_path):
  from t5x_like.interop import hf  # pylint: disable=g-import-not-at-top
  long_path = "/data/" + "x" * 90
  (tmp_path / "config.gin").write_text(f"DATA_DIR = \\\n    '{long_path}'\nMODEL_DIR = '/r'\n")
  assert hf.run_data_dir(str(tmp_path), {}) == long_path
  assert hf.run_data_dir(str(tmp_path), {"gin_config": "DATA_DIR = '/short'\n"}) == "/short"
