"""A trained model opened for evaluation from its MODEL_DIR alone: config, parameters on a mesh, tokenizer, template."""

import dataclasses
import os
from typing import Optional, Sequence

import gin
import tensorflow as tf

from t5x_like import cli
from t5x_like.data import chat
from t5x_like.inference import chat_eval
from t5x_like.model import decoder as model_lib
from t5x_like.training import runtime as runtime_lib

MODEL_NAME = "t5x_like"


@dataclasses.dataclass
class Run:
  """What evaluation needs of a trained model: its config, parameters on a mesh, tokenizer and chat template."""
  model_config: object
  params: object
  mesh: object
  rules: tuple
  tokenizer: object
  template: chat.ChatTemplate = chat.ChatTemplate()
  name: str = MODEL_NAME
  step: Optional[int] = None


def run_gin_files(model_dir: str) -> list:
  """The gin file a MODEL_DIR describes itself with: a converted model's model.gin, else a run's config.gin."""
  for name in ("model.gin", "config.gin"):
    path = os.path.join(model_dir, name)
    if tf.io.gfile.exists(path):
      return [path]
  raise FileNotFoundError(f"{model_dir} has no model.gin or config.gin: pass its gin files (gin_file=...)")


def open_run(model_dir: str, *, step: Optional[int] = None, gin_files: Sequence[str] = (),
             bindings: Sequence[str] = (), tokenizer: Optional[str] = None) -> Run:
  """Restores MODEL_DIR's checkpoint (newest, or `step`) onto all devices with its own config and tokenizer. The
  run's gin config is parsed for this and cleared again after: it leaves no parsed (locked) config behind."""
  gin.clear_config()
  cli.parse_gin(list(gin_files) or run_gin_files(model_dir), list(bindings))
  try:
    config = dataclasses.replace(cli.train_config(), model_dir=model_dir)
    return run_from_config(config, cli.configured(model_lib.GPTConfig, "model"), step=step, tokenizer=tokenizer)
  finally:
    gin.clear_config()


def run_from_config(config, model_config: model_lib.GPTConfig, *, step: Optional[int] = None,
                    tokenizer: Optional[str] = None) -> Run:
  """The Run of parsed configs (the gin already parsed): MODEL_DIR's checkpoint on all devices. A converted HF
  folder (no DATA_DIR) carries its tokenizer in the folder itself; a run's is its DATA_DIR's."""
  if tokenizer is None and not config.data_dir:
    tokenizer = config.model_dir
  # evaluation reads no training rows: a converted model's shorter context must not trip the run's SEQ_LEN check
  config = dataclasses.replace(config, seq_len=min(config.seq_len, model_config.max_len))
  exp = runtime_lib.Runtime(config, model_config)
  with exp.context():
    found, params = exp.restore_params(step)
  tok = exp.load_tokenizer(tokenizer)
  template = chat_eval.template_for(exp.manifest, config.data_dir, cli.configured(chat.ChatTemplate, "data"))
  return Run(exp.model_config, params, exp.mesh, exp.rules, tok, template,
             name=os.path.basename(config.model_dir.rstrip("/")) or MODEL_NAME, step=int(found))
