"""`python -m t5x_like.serve --gin_file=... --gin.MODEL_DIR=... [--step=N] [--host=127.0.0.1] [--port=8000]`:
an OpenAI-compatible HTTP server on the inference engine (inference/server.py; docs/serving.md).

Endpoints: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions (streaming with
"stream": true), GET /metrics (Prometheus) and GET / (a chat page). Needs `pip install 't5x_like[serve]'`.
SIGTERM stops accepting, lets in-flight requests finish for --shutdown_timeout_seconds, and exits 0.
"""

import os

from absl import flags

from t5x_like import cli as gin_utils
from t5x_like.data import chat
from t5x_like.inference import server
from t5x_like.model import decoder as model
from t5x_like.training import runtime as runtime_lib

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The CLI's flags; defined only when run as a program (tests import this module)."""
  gin_utils.define_gin_flags()
  d = server.ServeConfig()
  flags.DEFINE_integer("step", None, "Checkpoint step to serve (default: the newest good one).")
  flags.DEFINE_string("host", d.host, "Address to bind (loopback by default; 0.0.0.0 exposes the server).")
  flags.DEFINE_integer("port", d.port, "TCP port (0: any free one, printed at start-up).")
  flags.DEFINE_integer("max_batch", d.max_batch, "Sequences decoded at once (the engine's slots).")
  flags.DEFINE_integer("max_seq_len", d.max_seq_len, "Prompt + completion tokens per sequence (0: the model's "
                       "max_len).")
  flags.DEFINE_integer("max_waiting", d.max_waiting, "Requests queued for a slot; beyond, 429 with Retry-After.")
  flags.DEFINE_float("shutdown_timeout_seconds", d.shutdown_timeout_seconds, "After SIGTERM, how long in-flight "
                     "requests may run before they are cancelled.")
  flags.DEFINE_string("model_name", None, "The model id clients name (default: MODEL_DIR's folder name).")
  flags.DEFINE_integer("seed", d.seed, "Seed of sampled requests that give none.")
  flags.DEFINE_bool("warmup", d.warmup, "Compile every prefill shape (slots x prompt widths, powers of two) before "
                    "serving, so that no request waits for a compilation (--nowarmup: start at once).")
  flags.DEFINE_string("tokenizer", None, "Tokenizer instead of DATA_DIR's: a SentencePiece .model, an HF "
                      "tokenizer.json or HF folder (e.g. a converted MODEL_DIR); with it DATA_DIR may be ''.")


def main(argv):
  if len(argv) > 1:
    raise ValueError(f"unexpected arguments {argv[1:]}")
  gin_utils.parse_gin_flags()
  runtime = runtime_lib.Runtime(gin_utils.train_config(), gin_utils.configured(model.GPTConfig, "model"))
  name = FLAGS.model_name or os.path.basename(os.path.normpath(runtime.config.model_dir)) or "t5x_like"
  config = server.ServeConfig(host=FLAGS.host, port=FLAGS.port, max_batch=FLAGS.max_batch,
                              max_seq_len=FLAGS.max_seq_len, max_waiting=FLAGS.max_waiting,
                              shutdown_timeout_seconds=FLAGS.shutdown_timeout_seconds, model_name=name,
                              seed=FLAGS.seed, warmup=FLAGS.warmup)
  server.serve(server.load_model(runtime, config, step=FLAGS.step, tokenizer=FLAGS.tokenizer,
                                 template=gin_utils.configured(chat.ChatTemplate, "data")), config)


if __name__ == "__main__":
  define_flags()
  gin_utils.run(main)
