"""Tokenizer axes of a sweep: grid keys `preprocess.<flag>` build one DATA_DIR per setting, cached by it.

    --grid="preprocess.vocab_size=[1024,4096]" --preprocess=--input='raw/*.txt'
    # → OUTPUT_DIR/data/vocab_size-1024 and .../vocab_size-4096, each made once by
    #   python -m t5x_like.preprocess --input='raw/*.txt' --vocab_size=1024 --output_dir=OUTPUT_DIR/data/vocab_size-1024
    #   and bound as DATA_DIR of the runs with that setting (GPTConfig.vocab_size 0 follows the tokenizer).

A dataset whose manifest.json exists is reused (a relaunched sweep, or another run with the same setting);
one cut short by a kill has none yet and is built again.
"""

import os
import re
import subprocess
import sys
from typing import Optional, Sequence

from etils import epath

PREFIX = "preprocess."  # grid keys that are flags of python -m t5x_like.preprocess
MANIFEST = "manifest.json"  # written last by preprocess: the dataset is complete


def is_data_key(key: str) -> bool:
  return key.startswith(PREFIX)


def _slug_name(pairs) -> str:
  """'vocab_size-1024__model_type-unigram': filesystem-safe, like the runs' names."""
  slug = lambda x: re.sub(r"[^A-Za-z0-9.+-]+", "_", str(x)).strip("_") or "_"
  return "__".join(f"{slug(key[len(PREFIX):])}-{slug(value)}" for key, value in pairs)


def data_dir(output_dir: str, combo: Sequence) -> str:
  """OUTPUT_DIR/data/<flag-value__...> for a combination's preprocess.* values; '' when it has none."""
  pairs = [(key, value) for key, value in combo if is_data_key(key)]
  return os.path.join(output_dir, "data", _slug_name(pairs)) if pairs else ""


def check_grid(keys: Sequence[str], preprocess_args: Sequence[str]) -> None:
  """A tokenizer axis needs the corpus (--preprocess=--input=...) and owns DATA_DIR and --output_dir."""
  data_keys = [k for k in keys if is_data_key(k)]
  if data_keys and not preprocess_args:
    raise ValueError(f"--grid key {data_keys[0]} varies the tokenizer: give the corpus and preprocess's other flags "
                     "with --preprocess, e.g. --preprocess=--input='raw/*.txt'")
  if data_keys and "DATA_DIR" in keys:
    raise ValueError("--grid varies both DATA_DIR and the tokenizer (preprocess.*): each run's DATA_DIR is the "
                     "dataset of its tokenizer setting")
  for key in data_keys:
    if key[len(PREFIX):] in ("output_dir", "input"):
      raise ValueError(f"--grid key {key}: set by the sweep (output_dir) or given once with --preprocess (input)")
  for arg in preprocess_args:
    if not arg.startswith("--") or arg.startswith("--output_dir"):
      raise ValueError(f"--preprocess={arg!r}: expected a preprocess flag --NAME=VALUE other than --output_dir")


def _build(command: list, log_path: str, env: Optional[dict]) -> tuple:
  with open(log_path, "ab") as out:
    code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env, check=False).returncode
  if code == 0:
    return code, ""
  with open(log_path, encoding="utf-8", errors="replace") as f:
    lines = [line.strip() for line in f if line.strip()]
  return code, lines[-1] if lines else ""


def prepare(runs: Sequence, preprocess_args: Sequence[str], log=print, env: Optional[dict] = None) -> None:
  """Builds each distinct DATA_DIR of the runs (once; skipped when its manifest exists). A failed build is a
  ValueError naming its grid values and preprocess's own one-line reason."""
  wanted = {}
  for run in runs:
    if run.data_dir:
      wanted.setdefault(run.data_dir, [(k, v) for k, v in run.values if is_data_key(k)])
  for path, pairs in wanted.items():
    if (epath.Path(path) / MANIFEST).exists():
      log(f"sweep: dataset {path}: built, reused")
      continue
    os.makedirs(os.path.dirname(path), exist_ok=True)
    command = ([sys.executable, "-m", "t5x_like.preprocess"] + list(preprocess_args)
               + [f"--{key[len(PREFIX):]}={value}" for key, value in pairs] + [f"--output_dir={path}"])
    log(f"sweep: dataset {path}: preprocessing (log: {path}.log)")
    code, reason = _build(command, path + ".log", env)
    if code != 0:
      setting = ", ".join(f"{k}={v!r}" for k, v in pairs)
      raise ValueError(f"sweep dataset for {setting} failed (exit {code}): {reason}")
