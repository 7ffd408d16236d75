"""`python -m t5x_like.train --gin_file=... [--gin.NAME=VALUE ...] [--check]`: flags → gin → trainer.train()
(or trainer.check(): the whole configuration checked, nothing compiled or written)."""

import importlib
import sys

from absl import flags
from absl import logging
import jax

from t5x_like.parallel import distributed
from t5x_like.training import fault_tolerance
from t5x_like import cli as gin_utils
from t5x_like.model import decoder as model
from t5x_like.training import optimizer
from t5x_like.training import precision
from t5x_like.training import trainer

gin_utils.define_gin_flags()
distributed.define_flags()
flags.DEFINE_bool("check", False, "check the whole run configuration (layout, recipe, data, the shapes of every "
                  "checkpoint it reads), print the start-up report and exit, compiling and writing nothing")


def main(argv):
  if len(argv) > 1:
    raise ValueError(f"unexpected arguments {argv[1:]}")
  gin_utils.parse_gin_flags()
  distributed.initialize_from_flags()  # before anything touches devices
  config = gin_utils.train_config()
  hook_factories = []
  if config.observe.tasks:  # lm-eval (the eval extra) loads only for a run that evaluates tasks in the loop
    in_loop = importlib.import_module("t5x_like.evaluation.in_loop")
    hook_factories.append(in_loop.task_hook_factory(config.observe))
  if flags.FLAGS.check:
    report = trainer.check(config, gin_utils.configured(model.GPTConfig, "model"),
                           gin_utils.configured(optimizer.OptimizerConfig, "optimizer"),
                           gin_utils.configured(precision.PrecisionConfig, "precision"))
    for key, value in report.items():
      print(f"{key} {value:,}" if isinstance(value, int) else f"{key} {value:.4g}")
    print("configuration OK")
    distributed.finish()  # every process leaves together (a no-op for one process)
    return
  try:
    result = trainer.train(config,
                           gin_utils.configured(model.GPTConfig, "model"),
                           gin_utils.configured(optimizer.OptimizerConfig, "optimizer"),
                           gin_utils.configured(precision.PrecisionConfig, "precision"),
                           hook_factories=hook_factories)
  except fault_tolerance.RunStopped as e:  # preempted 75, save failed 74, non-finite 65
    print(f"stopped: {e}", file=sys.stderr, flush=True)
    if jax.process_count() > 1:
      distributed.exit_now(e.exit_code)
    sys.exit(e.exit_code)
  distributed.finish()  # every process leaves together (a no-op for one process)
  logging.info("done: %s", {k: v for k, v in result.items() if k.startswith(("loss", "eval/"))})


if __name__ == "__main__":
  gin_utils.run(main)
