"""`python -m t5x_like.infer --gin_file=... --gin.MODEL_DIR=... --prompt=... [--tokenizer=...]`: sample text from the latest checkpoint."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from absl import flags  # pylint: disable=g-import-not-at-top

from t5x_like import cli as gin_utils
from t5x_like.model import decoder as model
from t5x_like.training import optimizer
from t5x_like.training import experiment

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The CLI's flags; defined only when run as a program (tests import this module)."""
  gin_utils.define_gin_flags()
  flags.DEFINE_multi_string("prompt", [], "Prompt text; repeat the flag for a batch of prompts.")
  flags.DEFINE_string("prompt_file", None, "A file with one prompt per line (added to --prompt).")
  flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate after each prompt.")
  flags.DEFINE_float("temperature", 0.0, "0 = greedy; otherwise softmax temperature.")
  flags.DEFINE_integer("top_k", 0, "Sample only among the k most likely tokens (0 = all).")
  flags.DEFINE_float("top_p", 1.0, "Nucleus sampling: the smallest set of tokens with this much probability.")
  flags.DEFINE_integer("seed", 0, "Sampling seed.")
  flags.DEFINE_integer("step", None, "Checkpoint step to load (default: the newest good one).")
  flags.DEFINE_string("tokenizer", None, "Tokenizer instead of DATA_DIR's: a SentencePiece .model, an HF "
                      "tokenizer.json or HF folder (e.g. a converted MODEL_DIR); with it DATA_DIR may be ''.")


def main(argv):
  if len(argv) > 1:
    raise ValueError(f"unexpected arguments {argv[1:]}")
  gin_utils.parse_gin_flags()
  prompts = list(FLAGS.prompt)
  if FLAGS.prompt_file:
    with open(FLAGS.prompt_file, encoding="utf-8") as f:
      prompts += [line.rstrip("\n") for line in f if line.strip()]
  if not prompts:
    raise ValueError("no prompt: pass --prompt='...' (repeatable) or --prompt_file=FILE")
  exp = experiment.Experiment(gin_utils.train_config(), gin_utils.configured(model.GPTConfig, "model"),
                              gin_utils.configured(optimizer.OptimizerConfig, "optimizer"))
  step, continuations = exp.sample(prompts, max_new_tokens=FLAGS.max_new_tokens, temperature=FLAGS.temperature,
                                   top_k=FLAGS.top_k, top_p=FLAGS.top_p, seed=FLAGS.seed, step=FLAGS.step,
                                   tokenizer=FLAGS.tokenizer)
  print(f"# checkpoint step {step}", flush=True)
  for i, (prompt, text) in enumerate(zip(prompts, continuations)):
    if len(prompts) > 1:  # a continuation may span lines: mark where each sample starts
      print(f"# sample {i + 1}/{len(prompts)}", flush=True)
    print(prompt + text, flush=True)


if __name__ == "__main__":
  define_flags()
  gin_utils.run(main)
