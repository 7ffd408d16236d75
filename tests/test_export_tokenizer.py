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

TEXT = "the quick brown fox sees a lazy dog.\nThe cat runs."


def _convert(model_dir, out):
  return subprocess.run([sys.executable, "-m", "t5x_like.convert", "to_hf", f"--model_dir={model_dir}",
                         f"--output_dir={out}"], cwd=REPO, env=launch_env(), capture_output=True, text=True,
                        timeout=300)


@pytest.mark.slow  # a 2-step training launch and two conversions
def test_pretraining_run_exports_its_data_dirs_tokenizer(corpus, tmp_path):
  data_dir = str(tmp_path / "data")
  shutil.copytree(corpus, data_dir)
  model_dir = str(tmp_path / "run")
  assert subprocess.run(launch_args(model_dir, data_dir, 2), cwd=REPO, env=launch_env(),
                        capture_output=True, timeout=300).returncode == 0
  out = str(tmp_path / "hf")
  done = _convert(model_dir, out)
  assert done.returncode == 0, done.stderr[-2000:]
  ours = tokenizer_lib.load(data_dir)
  assert os.path.exists(os.path.join(out, "tokenizer.json")), (os.listdir(out), done.stderr[-2000:])
  exported = tokenizers.Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
  assert exported.encode(TEXT, add_special_tokens=False).ids == ours.encode(TEXT)
  transformers.AutoTokenizer.from_pretrained(out)  # transformers loads the folder
  # The DATA_DIR gone: the weights are still written, and one line says where no tokenizer was found.
  shutil.rmtree(data_dir)
  done = _convert(model_dir, str(tmp_path / "hf2"))
  assert done.returncode == 0, done.stderr[-2000:]
  lines = [line for line in done.stderr.splitlines() if "no tokenizer found" in line]
  assert len(lines) == 1 and model_dir in lines[0], done.stderr[-2000:]
  assert os.path.exists(tmp_path / "hf2" / "config.json")
  assert not any("tokenizer" in name for name in os.listdir(tmp_path / "hf2"))


def test_the_data_dir_is_read_when_gin_wraps_a_long_path(tmp_path):
  from t5x_like.interop import hf  # pylint: disable=g-import-not-at-top
  long_path = "/data/" + "x" * 90
  (tmp_path / "config.gin").write_text(f"DATA_DIR = \\\n    '{long_path}'\nMODEL_DIR = '/r'\n")
  assert hf.run_data_dir(str(tmp_path), {}) == long_path
  assert hf.run_data_dir(str(tmp_path), {"gin_config": "DATA_DIR = '/short'\n"}) == "/short"
