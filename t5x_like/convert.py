"""`python -m t5x_like.convert from_hf|to_hf ...`: Hugging Face GPT-2 / Llama / Mixtral / Qwen2 / Qwen3 / Mistral /
Gemma 2 / Gemma 3 checkpoints in and out (docs/interop.md).

  python -m t5x_like.convert from_hf --hf_dir=DIR --output_dir=MODEL_DIR
  python -m t5x_like.convert to_hf --model_dir=MODEL_DIR --output_dir=DIR [--step=N] [--tokenizer=DIR]
      [--gin_file=... --gin.NAME=VALUE]   (default model config: MODEL_DIR/model.gin, else MODEL_DIR/config.gin)
"""

import os

from absl import flags
import tensorflow as tf

from t5x_like import cli as gin_utils
from t5x_like.interop import chat_templates
from t5x_like.interop import hf
from t5x_like.model import decoder as model

FLAGS = flags.FLAGS
COMMANDS = ("from_hf", "to_hf")


def define_flags() -> None:
  """The CLI's flags; defined only when run as a program (tests import this module)."""
  gin_utils.define_gin_flags()
  flags.DEFINE_string("hf_dir", None, "from_hf: the Hugging Face folder (config.json + safetensors).")
  flags.DEFINE_string("model_dir", None, "to_hf: the MODEL_DIR (or MODEL_DIR/checkpoints/<step>) to export.")
  flags.DEFINE_string("output_dir", None, "The folder to create (must not exist or be empty).")
  flags.DEFINE_integer("step", None, "to_hf: checkpoint step to export (default: the newest).")
  flags.DEFINE_string("tokenizer", None, "to_hf: folder whose tokenizer files (and token ids) are carried "
                      "over, e.g. the converted MODEL_DIR a fine-tuning run started from (default: MODEL_DIR).")
  flags.DEFINE_enum("dtype", "float32", list(hf.EXPORT_DTYPES), "to_hf: the stored dtype of the weights.")
  flags.DEFINE_integer("max_shard_mb", 4096, "to_hf: safetensors shard size; larger models get shards + index.")


def export_config(model_dir: str, gin_files, gin_bindings, search_paths) -> model.GPTConfig:
  """The model config to export with: the --gin_file files, else MODEL_DIR/model.gin (a converted model)
  or MODEL_DIR/config.gin (a run's operative config); then the --gin.NAME=VALUE bindings."""
  files = list(gin_files)
  if not files:
    base = hf.run_dir(model_dir)
    found = [p for p in (f"{base}/{hf.MODEL_GIN}", f"{base}/config.gin") if tf.io.gfile.exists(p)]
    if not found:
      raise FileNotFoundError(f"{base} has no {hf.MODEL_GIN} or config.gin: pass the model config with "
                              f"--gin_file=... (the files the run trained with)")
    files = found[:1]
  gin_utils.parse_gin(files, gin_bindings, search_paths)
  return gin_utils.configured(model.GPTConfig, "model")


def main(argv):
  if len(argv) != 2 or argv[1] not in COMMANDS:
    raise ValueError(f"expected one command, from_hf or to_hf; got {argv[1:]}")
  required = ("hf_dir", "output_dir") if argv[1] == "from_hf" else ("model_dir", "output_dir")
  missing = [f"--{name}" for name in required if not getattr(FLAGS, name)]
  if missing:
    raise ValueError(f"{argv[1]} needs {' and '.join(missing)}")
  if argv[1] == "from_hf":
    config = hf.import_hf(FLAGS.hf_dir, FLAGS.output_dir)
    print(f"wrote {FLAGS.output_dir}: checkpoints/0, {hf.MODEL_GIN} ({config.num_layers} layers, d_model "
          f"{config.d_model}, vocabulary {config.valid_vocab_size} padded to {config.vocab_size})"
          + (f", {chat_templates.GIN_FILE}" if os.path.isfile(os.path.join(FLAGS.output_dir, chat_templates.GIN_FILE))
             else ""), flush=True)
  else:
    config = export_config(FLAGS.model_dir, FLAGS.gin_file, FLAGS.gin_bindings, FLAGS.gin_search_paths)
    step = hf.export_hf(FLAGS.model_dir, FLAGS.output_dir, config, step=FLAGS.step,
                        tokenizer=FLAGS.tokenizer, dtype=FLAGS.dtype, max_shard_bytes=FLAGS.max_shard_mb << 20)
    print(f"wrote {FLAGS.output_dir} from {FLAGS.model_dir} step {step}", flush=True)


if __name__ == "__main__":
  define_flags()
  gin_utils.run(main)
