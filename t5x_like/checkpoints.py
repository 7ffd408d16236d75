"""`python -m t5x_like.checkpoints list|digest|inspect|merge_lora MODEL_DIR [--step N]`: look into a run's checkpoints.

  list        committed steps (with their recorded mesh and code version), unfinished saves,
              and steps moved aside as unreadable
  digest      SHA-256 over all parameter bytes (names, dtypes, shapes, bytes; sorted by name; independent
              of the sharding); the digest is the last line
  inspect     every saved array of the train state: path, shape, dtype, saved sharding; then the metadata
  merge_lora  a LoRA run's adapters merged into the base its checkpoint names, written as a plain
              checkpoint (--output_dir=DIR: DIR/checkpoints/0) that infer, evaluate and
              INITIAL_CHECKPOINT_PATH read

MODEL_DIR may be local or gs://.
"""

import json
import os

from absl import flags
from absl import logging
from etils import epath
import jax
import numpy as np

from t5x_like import cli
from t5x_like.training import checkpointing as checkpoints
from t5x_like.posttrain import lora

flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest committed one).")
flags.DEFINE_string("output_dir", None, "merge_lora: the directory the merged checkpoint is written to.")
FLAGS = flags.FLAGS
USAGE = "python -m t5x_like.checkpoints list|digest|inspect|merge_lora MODEL_DIR [--step N] [--output_dir DIR]"


def cmd_list(model_dir: str, step=None) -> None:
  directory = checkpoints.checkpoint_dir(model_dir)
  if not epath.Path(directory).is_dir():
    raise FileNotFoundError(f"no checkpoints/ directory in MODEL_DIR '{model_dir}'")
  steps = checkpoints.committed_steps(model_dir)
  for s in steps if step is None else [s for s in steps if s == step]:
    path = os.path.join(directory, str(s))
    try:
      meta = checkpoints.read_metadata(path)
      info = (f"mesh={meta.get('mesh_shape')} code={meta.get('code_version', '?')}"
              if meta else "no metadata")
    except Exception as e:  # pylint: disable=broad-except  # a corrupt item: say so, keep listing
      info = f"UNREADABLE metadata ({type(e).__name__})"
    print(f"step {s}: {info}")
  for tmp in checkpoints.unfinished_saves(directory):
    print(f"unfinished save (ignored, removed on the next run): {tmp.name}")
  corrupt = epath.Path(model_dir) / checkpoints.CORRUPT_DIR
  for path in sorted(corrupt.iterdir(), key=lambda p: p.name) if corrupt.is_dir() else []:
    print(f"moved aside as unreadable: {path}")
  print(f"{len(steps)} committed step(s): {steps}")


def cmd_digest(model_dir: str, step=None) -> None:
  found, params = checkpoints.restore_params(model_dir, step)
  n = sum(int(x.size) for x in jax.tree.leaves(params))
  print(f"step {found}: {n:,} parameters")
  print(checkpoints.params_digest(params))


def cmd_inspect(model_dir: str, step=None) -> None:
  found, path = checkpoints.step_dir(model_dir, step)
  tree = checkpoints.state_tree_metadata(path)
  print(f"step {found}: {path}")
  total = 0
  for key_path, m in jax.tree_util.tree_flatten_with_path(tree)[0]:
    spec = getattr(getattr(m, "sharding", None), "partition_spec", None)
    size = int(np.prod(m.shape)) if m.shape else 1
    total += size if key_path and getattr(key_path[0], "key", None) == "params" else 0
    print(f"{checkpoints.path_name(key_path):60s} {str(tuple(m.shape)):20s} {str(m.dtype):9s} "
          f"sharding={tuple(spec) if spec is not None else None}")
  print(f"parameters: {total:,}")
  meta = checkpoints.read_metadata(path)
  gin_config = meta.pop("gin_config", None)
  print("metadata: " + json.dumps(meta, sort_keys=True))
  if gin_config:
    print(f"gin config: {len(gin_config.splitlines())} lines recorded (printed below)")
    print(gin_config.rstrip())


def cmd_merge_lora(model_dir: str, step=None) -> None:
  if not FLAGS.output_dir:
    raise ValueError(f"merge_lora needs --output_dir=DIR for the merged checkpoint ({USAGE})")
  written = lora.merge_checkpoint(model_dir, FLAGS.output_dir, step)
  print(f"merged LoRA adapters of {model_dir} into {written}")


COMMANDS = {"list": cmd_list, "digest": cmd_digest, "inspect": cmd_inspect, "merge_lora": cmd_merge_lora}


def look(command: str, model_dir: str, step=None) -> None:
  """Runs one command on MODEL_DIR (what the CLI does after parsing its flags)."""
  if command not in COMMANDS:
    raise ValueError(f"unknown command {command!r}: expected one of {sorted(COMMANDS)} ({USAGE})")
  if not epath.Path(model_dir).is_dir():
    raise FileNotFoundError(f"MODEL_DIR '{model_dir}' does not exist")
  COMMANDS[command](model_dir, step)


def main(argv) -> None:
  logging.set_verbosity(logging.ERROR)  # orbax warns about optional files it does not find
  if len(argv) != 3:
    raise ValueError(f"expected COMMAND MODEL_DIR, got {argv[1:]}: {USAGE}")
  look(argv[1], argv[2], FLAGS.step)


def run() -> None:
  """Entry point: a user error prints one line and exits 1 (T5X_LIKE_TRACEBACK=1 shows the traceback)."""
  cli.run(main)


if __name__ == "__main__":
  run()
