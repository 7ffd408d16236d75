"""`python -m t5x_like.plot MODEL_DIR [MODEL_DIR ...] [--out FILE.png]`: loss, learning rate and throughput curves."""

import os

from absl import flags

from t5x_like import cli
from t5x_like.observe import plots

flags.DEFINE_string("out", None, "PNG to write (default: MODEL_DIR/metrics.png for one run, "
                    "./runs.png for several).")
flags.DEFINE_integer("dpi", 110, "Resolution of the PNG.")
FLAGS = flags.FLAGS


def main(argv):
  model_dirs = argv[1:]
  if not model_dirs:
    raise ValueError("no MODEL_DIR given: python -m t5x_like.plot MODEL_DIR [MODEL_DIR ...] [--out FILE.png]")
  out = FLAGS.out or (os.path.join(model_dirs[0], "metrics.png") if len(model_dirs) == 1 else "runs.png")
  if not out.lower().endswith(".png"):
    raise ValueError(f"--out={out!r}: only PNG is written; give a name ending in .png")
  print(plots.plot_runs(plots.load_runs(model_dirs), out, FLAGS.dpi), flush=True)


if __name__ == "__main__":
  cli.run(main)
