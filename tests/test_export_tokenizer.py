"""`convert to_hf` of a pre-training run ships the tokenizer it trained with (found through its DATA_DIR)."""

import os
import shutil
import subprocess
import sys

import pytest

transformers = pytest.importorskip("transformers")

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
  loaded = transformers.AutoTokenizer.from_pretrained(out)
  assert loaded(TEXT, add_special_tokens=False).input_ids == ours.encode(TEXT)
  # The DATA_DIR gone: the weights are still written, and one line says where no tokenizer was found.
  shutil.rmtree(data_dir)
  done = _convert(model_dir, str(tmp_path / "hf2"))
  assert done.returncode == 0, done.stderr[-2000:]
  lines = [line for line in done.stderr.splitlines() if "no tokenizer found" in line]
  assert len(lines) == 1 and model_dir in lines[0], done.stderr[-2000:]
  assert os.path.exists(tmp_path / "hf2" / "config.json")
  assert not any("tokenizer" in name for name in os.listdir(tmp_path / "hf2"))
