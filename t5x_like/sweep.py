"""`python -m t5x_like.sweep --gin_file=... --grid=KEY=[V1,V2] [--grid=...] --output_dir=DIR [--parallel=N]`:
trains every combination of the grid as its own MODEL_DIR (DIR/<key-value__...>), then writes DIR/results.md,
DIR/results.csv and DIR/eval_loss.png.

    python -m t5x_like.sweep --gin_file=configs/experiments/pystdlib_demo.gin \\
        --grid="optimizer.OptimizerConfig.name=['adamw','adafactor']" \\
        --grid="optimizer.OptimizerConfig.learning_rate=[3e-4,1e-3]" --output_dir=sweeps/opt --gin.TRAIN_STEPS=60

A tokenizer axis, --grid="preprocess.vocab_size=[1024,4096]" with --preprocess=--input='raw/*.txt', builds one
dataset per setting (DIR/data/vocab_size-1024, ...; reused once built) and trains on it.
Relaunching the same command resumes an interrupted sweep: finished runs are skipped, the others resume
from their checkpoints. The work is in t5x_like/experiments/sweep.py; docs/experiments.md describes it.
"""

from absl import flags

from t5x_like import cli
from t5x_like.experiments import sweep


def define_flags():
  cli.define_gin_flags()
  flags.DEFINE_multi_string("grid", [], "KEY=[VALUE, ...]: a gin binding (or macro) and the Python literals it "
                            "takes; the sweep runs every combination of all --grid flags.")
  flags.DEFINE_string("output_dir", None, "Folder of the sweep: one MODEL_DIR per combination, results.md/.csv, "
                      "eval_loss.png.")
  flags.DEFINE_integer("parallel", 1, "Runs trained at the same time.")
  flags.DEFINE_multi_string("preprocess", [], "A flag of `python -m t5x_like.preprocess` (e.g. --preprocess=--input="
                            "'raw/*.txt') for the datasets a tokenizer axis (--grid=preprocess.vocab_size=[...]) builds.")


def main(argv):
  if len(argv) > 1:
    raise ValueError(f"unexpected arguments {argv[1:]}")
  f = flags.FLAGS
  report = sweep.run_sweep(f.gin_file, f.gin_bindings, f.gin_search_paths, f.grid, f.output_dir, f.parallel,
                           preprocess_args=f.preprocess)
  print(open(report["markdown"]).read() + f"\n{report['csv']}\n{report['png']}", flush=True)


if __name__ == "__main__":
  define_flags()
  cli.run(main)
