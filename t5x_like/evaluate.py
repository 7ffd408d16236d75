"""`python -m t5x_like.evaluate --gin_file=... --gin.MODEL_DIR=... [--gin.DATA_DIR=...]`: loss/perplexity of a checkpoint."""

import dataclasses
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from absl import flags  # pylint: disable=g-import-not-at-top

from t5x_like import cli as gin_utils
from t5x_like.data import tokenizer
from t5x_like.model import decoder as model
from t5x_like.training import optimizer
from t5x_like.training import experiment

gin_utils.define_gin_flags()
flags.DEFINE_integer("step", None, "Checkpoint step to evaluate (default: the newest good one).")
flags.DEFINE_string("split", "validation", "Split of DATA_DIR to evaluate on.")
flags.DEFINE_integer("eval_batches", None, "Batches to evaluate (default: DataConfig.eval_batches; "
                     "0 = the whole split).")
flags.DEFINE_string("tokenizer", None, "The model's tokenizer (.model, tokenizer.json or HF folder): refuse a "
                    "DATA_DIR whose records another tokenizer wrote.")
FLAGS = flags.FLAGS


def main(argv):
  if len(argv) > 1:
    raise ValueError(f"unexpected arguments {argv[1:]}")
  gin_utils.parse_gin_flags()
  config = gin_utils.train_config()
  if FLAGS.eval_batches is not None:
    if FLAGS.eval_batches < 0:
      raise ValueError(f"--eval_batches must be >= 0, got {FLAGS.eval_batches}")
    config = dataclasses.replace(config, data=dataclasses.replace(config.data, eval_batches=FLAGS.eval_batches))
  exp = experiment.Experiment(config, gin_utils.configured(model.GPTConfig, "model"),
                           gin_utils.configured(optimizer.OptimizerConfig, "optimizer"))
  if FLAGS.tokenizer:
    tokenizer.check_wrote(tokenizer.load(FLAGS.tokenizer), exp.manifest, config.data_dir)
  result = exp.evaluate_checkpoint(FLAGS.step, FLAGS.split)
  print(f"step {result['step']}  {result['split']}  loss {result['eval/loss']:.6f}  "
        f"perplexity {result['eval/perplexity']:.4f}  ({int(result['eval/tokens'])} tokens, "
        f"{result['eval/batches']} batches)", flush=True)
  print(json.dumps(result), flush=True)


if __name__ == "__main__":
  gin_utils.run(main)
