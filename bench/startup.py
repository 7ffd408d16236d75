"""Start-up cost of a short `train` launch: what every run, resume and test launch pays before and around its steps.

    python bench/startup.py [--repeats 3] [--devices 4]

Prepares a small generated corpus once, then launches `python -m t5x_like.train` on a 2-layer gpt_tiny for 6 steps
(checkpoints every 2, one evaluation) `--repeats` times with an empty JAX compilation cache (cold) and as many
times with the cache those launches filled (warm). Prints, per case, the median wall and CPU seconds (user + system
of the launch) and the XLA programs it built (jax's "Finished XLA compilation" log lines: compiled when cold,
loaded from the cache when warm). Run it on a quiet machine and name the CPU beside the figures.
"""

import argparse
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from t5x_like.parallel import distributed  # pylint: disable=g-import-not-at-top,wrong-import-position


def corpus(work: str) -> str:
  from t5x_like.data import preprocessing  # pylint: disable=g-import-not-at-top
  raw, out = os.path.join(work, "raw"), os.path.join(work, "data")
  os.makedirs(raw, exist_ok=True)
  words = ["alpha", "beta", "gamma", "delta", "sigma", "omega", "theta", "kappa"]
  for i in range(4):
    with open(os.path.join(raw, f"{i}.txt"), "w", encoding="utf-8") as f:
      f.writelines(" ".join(words[(i + j + k) % 8] for k in range(12)) + "\n" for j in range(300))
  preprocessing.preprocess([os.path.join(raw, "*.txt")], out, vocab_size=300, num_train_shards=4,
                           validation_fraction=0.2, num_workers=1, progress=False, cache_dir=None)
  return out


def launch(data_dir: str, model_dir: str, cache_dir: str, devices: int) -> tuple[float, float, int]:
  """One launch: (wall s, CPU s, programs compiled)."""
  shutil.rmtree(model_dir, ignore_errors=True)
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=cache_dir, JAX_LOG_COMPILES="1",
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
             XLA_FLAGS=" ".join(distributed.cpu_xla_flags()) + f" --xla_force_host_platform_device_count={devices}")
  argv = [sys.executable, "-m", "t5x_like.train", "--gin_file=configs/models/gpt_tiny.gin",
          "--gin_file=configs/runs/pretrain.gin", f"--gin.MODEL_DIR='{model_dir}'", f"--gin.DATA_DIR='{data_dir}'",
          "--gin.TRAIN_STEPS=6", "--gin.BATCH_SIZE=8", "--gin.SEQ_LEN=32", "--gin.LOG_EVERY=1", "--gin.EVAL_EVERY=0",
          "--gin.CHECKPOINT_EVERY=2", "--gin.model.GPTConfig.num_layers=2", "--gin.model.GPTConfig.dtype='float32'",
          "--gin.data.DataConfig.eval_batches=2"]
  before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
  done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
  wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
  if done.returncode:
    raise RuntimeError(f"train exited {done.returncode}:\n{done.stderr[-3000:]}")
  cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
  return wall, cpu, len(re.findall(r"Finished XLA compilation", done.stderr))


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--devices", type=int, default=4, help="Fake CPU devices (a data-parallel mesh over them).")
  args = p.parse_args(argv)
  with tempfile.TemporaryDirectory() as work:
    data_dir = corpus(work)
    rows = {"cold": [], "warm": []}
    for i in range(args.repeats):
      cache = os.path.join(work, f"cache{i}")
      rows["cold"].append(launch(data_dir, os.path.join(work, "run"), cache, args.devices))
      rows["warm"].append(launch(data_dir, os.path.join(work, "run"), cache, args.devices))
  print(f"| cache | wall s | CPU s | XLA programs |  ({args.repeats} launches each, medians)")
  print("|---|---|---|---|")
  for name, runs in rows.items():
    wall, cpu, programs = (statistics.median(r[k] for r in runs) for k in range(3))
    print(f"| {name} | {wall:.2f} | {cpu:.2f} | {programs:.0f} |")


if __name__ == "__main__":
  main()
