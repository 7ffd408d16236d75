"""Hugging Face folder → MODEL_DIR (orbax checkpoint + model.gin) and back, tensor by tensor, all or nothing.

`import_hf` fills preallocated float32 parameters one HF tensor at a time (never a second copy of the
model) and writes checkpoints/0, model.gin (the GPTConfig bindings `--gin_file` takes), hf_config.json
(the original config.json) and the tokenizer files. `export_hf` restores a checkpoint and writes
config.json, safetensors and the tokenizer files transformers loads. Both write into a temporary folder
beside the output and rename it at the end: on any error nothing is left at the output path.
"""

import contextlib
import dataclasses
import functools
import json
import os
import re
import shutil
import uuid
from typing import Iterator, Optional

from absl import logging
import flax.linen as nn
import jax
import ml_dtypes
import numpy as np
import tensorflow as tf

from t5x_like.data import tokenizer as tokenizer_lib
from t5x_like.interop import hf_config
from t5x_like.interop import chat_templates
from t5x_like.interop import hf_weights
from t5x_like.interop import safetensors_io
from t5x_like.model import decoder
from t5x_like.training import checkpointing
from t5x_like.posttrain import lora

CONFIG_FILE = "config.json"
HF_CONFIG_COPY = "hf_config.json"  # the imported config.json, kept in MODEL_DIR for its token ids
MODEL_GIN = "model.gin"
# Files carried between a HF folder and MODEL_DIR as they are: tokenizers (tokenizer.json, SentencePiece,
# GPT-2's vocab.json + merges.txt), their settings and chat template, and the generation defaults.
CARRIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                 "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
                 "generation_config.json")
EXPORT_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def import_hf(hf_dir: str, output_dir: str) -> decoder.GPTConfig:
  """Converts a Hugging Face GPT-2 / Llama / Mixtral / Qwen2 / Qwen3 / Mistral / Gemma 2 / Gemma 3 (text) folder into
  a new MODEL_DIR.

  Args:
    hf_dir: a folder with config.json and model.safetensors (or shards + model.safetensors.index.json, or
      PyTorch's pytorch_model.bin / its shards, loaded weights_only), float32 / bfloat16 / float16; tokenizer
      files are copied along when present.
    output_dir: the MODEL_DIR to create; it must not exist or be empty.

  Returns:
    The model's GPTConfig (vocabulary padded to a multiple of 128, valid_vocab_size = the real one).
  """
  hf = _read_hf_config(hf_dir)
  arch, config = hf_config.from_hf(hf, os.path.join(hf_dir, CONFIG_FILE))
  config.validate()
  _check_tokenizer(find_tokenizer(hf_dir), config)
  with safetensors_io.Reader(hf_dir) as reader:
    entries = hf_weights.expand(hf_weights.table(arch, config, reader.keys()), config.num_layers)
    _check_tensors(reader, entries, config, arch, hf_dir)
    with staged_dir(output_dir) as tmp:
      params = jax.tree.map(lambda s: np.zeros(s.shape, np.float32), param_shapes(config))
      for key, tensor, layer in entries:
        slot = tensor.slot(params, layer, config)
        slot[...] = tensor.to_ours(reader.read(key), slot.shape)
      gin_text = hf_config.model_gin(config, f"Converted from {os.path.abspath(hf_dir)} ({arch}) by "
                                             f"python -m t5x_like.convert from_hf.")
      checkpointing.save_params(tmp, params, 0, {"converted_from": os.path.abspath(hf_dir), "hf_architecture": arch,
                                                 "gin_config": gin_text, "code_version": checkpointing.code_version()})
      del params
      _write_text(os.path.join(tmp, MODEL_GIN), gin_text)
      _write_text(os.path.join(tmp, HF_CONFIG_COPY), json.dumps(hf, indent=2) + "\n")
      _copy_carried(hf_dir, tmp)
      gin_template, report = chat_templates.convert_folder(hf_dir, find_tokenizer(hf_dir))
      if gin_template is not None:
        _write_text(os.path.join(tmp, chat_templates.GIN_FILE), gin_template)
      refused = gin_template is None and chat_templates.read_template(hf_dir) is not None
      (logging.warning if refused else logging.info)("%s", report)
  return config


def export_hf(model_dir: str, output_dir: str, config: decoder.GPTConfig, *, step: Optional[int] = None,
              tokenizer: Optional[str] = None, dtype: str = "float32",
              max_shard_bytes: int = 4 << 30) -> int:
  """Writes MODEL_DIR's checkpoint as a Hugging Face folder `AutoModelForCausalLM.from_pretrained` loads.

  A LoRA run's checkpoint is merged with the base its metadata names (W + alpha/rank · A·B).

  Args:
    model_dir: a run or converted MODEL_DIR (or one of its checkpoints/<step> directories).
    output_dir: the folder to create; it must not exist or be empty.
    config: the model's GPTConfig (MODEL_DIR/model.gin, or the gin files it trained with); a
      vocab_size of 0 is read off the checkpoint.
    step: the checkpoint step; default the newest.
    tokenizer: the tokenizer to ship, default model_dir's or else that of the model the run started from
      (its metadata's INITIAL_CHECKPOINT_PATH or LoRA base): a folder with Hugging Face tokenizer files
      (tokenizer.json or tokenizer_config.json; they are copied as they are, with generation_config.json
      and hf_config.json's token ids), e.g. the converted MODEL_DIR a fine-tuning run started from; or a
      SentencePiece .model / tokenizer.json / DATA_DIR, written with `save_hf`.
    dtype: the stored dtype: float32 (exact), bfloat16 or float16.
    max_shard_bytes: safetensors shard size; a larger model is written as shards + index.

  Returns:
    The exported step.
  """
  if dtype not in EXPORT_DTYPES:
    raise ValueError(f"export dtype {dtype!r}: expected one of {list(EXPORT_DTYPES)}")
  hf_config.export_architecture(config)  # fail before reading anything
  step, path = checkpointing.resolve_checkpoint(model_dir, step)
  metadata = checkpointing.read_metadata(path)
  params = merged_params(path, metadata)
  if not config.vocab_size:
    config = dataclasses.replace(config, vocab_size=int(params["token_embedding"].shape[0]))
  arch = hf_config.export_architecture(config)
  _check_params(params, config, model_dir)
  origins = [run_dir(model_dir)] + [run_dir(p) for p in (metadata.get("lora", {}).get("base"),
                                                           metadata.get("initial_checkpoint")) if p]
  origins += [d for d in [run_data_dir(model_dir, metadata)] if d and tf.io.gfile.isdir(d)]
  source = tokenizer or next((d for d in origins if find_tokenizer(d) is not None), origins[0])
  tok = find_tokenizer(source)
  _check_tokenizer(tok, config)
  token_ids = _token_ids(source, tok, config)
  entries = hf_weights.expand(hf_weights.table(arch, config), config.num_layers)
  store = EXPORT_DTYPES[dtype]
  itemsize = np.dtype(store).itemsize
  sizes = {key: int(np.prod(tensor.slot(params, layer, config).shape)) * itemsize for key, tensor, layer in entries}

  def produce(tensor, layer):
    return tensor.to_hf(tensor.slot(params, layer, config)).astype(store)

  with staged_dir(output_dir) as tmp:
    hf_files = os.path.isdir(source) and any(os.path.isfile(os.path.join(source, n))
                                             for n in (tokenizer_lib.HF_FILE, tokenizer_lib.HF_CONFIG))
    if hf_files:
      _copy_carried(source, tmp)
    elif tok is not None:
      tok.save_hf(tmp)
    else:
      logging.warning("no tokenizer found in %s: %s gets none (pass --tokenizer=..., e.g. the run's DATA_DIR or "
                      "the converted model it started from)", ", ".join(origins), output_dir)
    _write_text(os.path.join(tmp, CONFIG_FILE),
                json.dumps(hf_config.to_hf(config, token_ids, dtype), indent=2) + "\n")
    safetensors_io.write(tmp, [(key, functools.partial(produce, tensor, layer)) for key, tensor, layer in entries],
                         sizes.__getitem__, max_shard_bytes)
  return step


# ------------------------------------------------------------------------------------------------------
# Checks, all made before anything is written.


def merged_params(path: str, metadata: dict) -> dict:
  """The parameters of one checkpoints/<step> directory as numpy arrays; a LoRA run's adapters merged into
  the base named by its metadata (as `lora.merge_checkpoint` writes them)."""
  _, params = checkpointing.restore_params(path)
  info = metadata.get("lora") or {}
  if not info.get("base"):
    return params
  _, base = checkpointing.restore_params(info["base"])
  base = lora.computed_base(base, info.get("base_precision", "float32"))
  return jax.tree.map(np.asarray, lora.merge(base, params, info["alpha"] / info["rank"],
                                            marker_ids=tuple(info.get("marker_ids") or ())))


def param_shapes(config: decoder.GPTConfig) -> dict:
  """Our parameter tree as ShapeDtypeStructs (an abstract init: nothing is allocated)."""
  return nn.meta.unbox(decoder.abstract_params(config))


def _check_tensors(reader, entries: list, config, arch: str, hf_dir: str) -> None:
  """Every tensor the table names exists with the shape the config gives, and nothing is left over."""
  shapes = jax.tree.map(lambda s: np.broadcast_to(np.float32(0), s.shape), param_shapes(config))
  where = f"{hf_dir} ({arch})"
  covered = {t.ours for _, t, _ in entries} | set(hf_weights.zero_leaves(config))
  leaves = {checkpointing.path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(shapes)[0]}
  if covered != leaves:
    raise ValueError(f"{where}: the tensor table and the model disagree: parameters without a HF tensor "
                     f"{sorted(leaves - covered)}, table entries without a parameter {sorted(covered - leaves)}")
  for key, tensor, layer in entries:
    if key not in reader:
      raise ValueError(f"{where}: tensor {key!r} is missing (config.json describes {config.num_layers} layers)")
    want = tensor.hf_shape(tensor.slot(shapes, layer, config).shape)
    if reader.shape(key) != want:
      raise ValueError(f"{where}: tensor {key!r} has shape {reader.shape(key)} but config.json gives {want}")
  expected = {key for key, _, _ in entries}
  if config.tie_embeddings:
    expected.add("lm_head.weight")  # a tied head saved anyway is the embedding again
  extra = [k for k in reader.keys() if k not in expected and not hf_weights.IGNORED.fullmatch(k)]
  if extra:
    raise ValueError(f"{where}: {len(extra)} tensor(s) have no place in this model, e.g. {extra[:3]} "
                     f"(an architecture variant we do not convert)")


def _check_params(params: dict, config: decoder.GPTConfig, model_dir: str) -> None:
  """The restored tree has exactly the config's parameters and shapes; HF-less leaves are zero."""
  want = {checkpointing.path_name(p): tuple(s.shape)
          for p, s in jax.tree_util.tree_flatten_with_path(param_shapes(config))[0]}
  have = {checkpointing.path_name(p): tuple(np.shape(a)) for p, a in jax.tree_util.tree_flatten_with_path(params)[0]}
  for name in sorted(set(want) | set(have)):
    if want.get(name) != have.get(name):
      found = f"has shape {have[name]}" if name in have else "is missing"
      wanted = f"gives {want[name]}" if name in want else "has no such parameter"
      raise ValueError(f"{model_dir}: checkpoint parameter {name!r} {found} but the model config {wanted}: "
                       f"pass the gin files the run trained with")
  for name in hf_weights.zero_leaves(config):
    node = params
    for part in name.split("/"):
      node = node[part]
    if np.any(node):
      raise ValueError(f"{model_dir}: {name} is nonzero but {hf_config.export_architecture(config)} has no "
                       f"output bias: the export would change the model")


def run_dir(model_dir: str) -> str:
  """MODEL_DIR of a MODEL_DIR or of one of its checkpoints/<step> directories."""
  path = model_dir.rstrip("/")
  if os.path.basename(os.path.dirname(path)) == "checkpoints":
    return os.path.dirname(os.path.dirname(path))
  return path


def run_data_dir(model_dir: str, metadata: dict) -> Optional[str]:
  """The DATA_DIR a run trained on (its tokenizer is the run's): the DATA_DIR binding of the operative gin
  config its checkpoint records, else of MODEL_DIR/config.gin; None when neither names one."""
  texts = [metadata.get("gin_config") or ""]
  config_gin = os.path.join(run_dir(model_dir), "config.gin")
  if tf.io.gfile.exists(config_gin):
    with tf.io.gfile.GFile(config_gin) as f:
      texts.append(f.read())
  for text in texts:
    # gin wraps a long value onto the next line: `DATA_DIR = \` then the quoted path
    found = re.search(r"^DATA_DIR\s*=\s*(?:\\\s*)?['\"]([^'\"]+)['\"]", text, re.MULTILINE)
    if found:
      return found.group(1)
  return None


def find_tokenizer(path: str):
  """The tokenizer (data.tokenizer.load) of a folder or file, None for a folder without one."""
  if os.path.isdir(path) and not any(os.path.isfile(os.path.join(path, n))
                                     for n in (tokenizer_lib.HF_FILE, tokenizer_lib.SENTENCEPIECE_FILE)):
    return None
  return tokenizer_lib.load(path)


def _check_tokenizer(tok, config: decoder.GPTConfig) -> None:
  rows = config.valid_vocab_size or config.vocab_size
  if tok is not None and tok.vocab_size > rows:
    raise ValueError(f"{tok.path}: the tokenizer has {tok.vocab_size} tokens but the embedding has {rows} rows "
                     f"(vocab_size): tokenizer and model disagree")


def _token_ids(source: str, tok, config: decoder.GPTConfig) -> dict:
  """bos/eos/pad ids for config.json: the imported config.json's, else the tokenizer's real tokens."""
  if os.path.isfile(os.path.join(source, HF_CONFIG_COPY)):
    return {k: v for k, v in _read_json(os.path.join(source, HF_CONFIG_COPY)).items() if k in hf_config.TOKEN_ID_KEYS}
  if tok is None:
    return {}
  rows = config.valid_vocab_size or config.vocab_size
  ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
  return {k: v for k, v in ids.items() if 0 <= v < min(rows, tok.vocab_size)}


# ------------------------------------------------------------------------------------------------------
# Files.


@contextlib.contextmanager
def staged_dir(output_dir: str) -> Iterator[str]:
  """Yields a new temporary folder beside `output_dir`, renamed to it when the block succeeds and
  deleted when it raises. `output_dir` must not exist or be empty (nothing is overwritten)."""
  if "://" in output_dir:
    raise ValueError(f"--output_dir={output_dir}: conversion writes a local folder (copy it to the bucket after)")
  output_dir = os.path.abspath(output_dir)
  if os.path.exists(output_dir) and (not os.path.isdir(output_dir) or os.listdir(output_dir)):
    raise FileExistsError(f"{output_dir} exists and is not empty: choose a new output folder")
  parent = os.path.dirname(output_dir)
  os.makedirs(parent, exist_ok=True)
  tmp = os.path.join(parent, f".{os.path.basename(output_dir)}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
  os.mkdir(tmp)  # the user's umask applies, as for any folder they create
  try:
    yield tmp
    if os.path.isdir(output_dir):
      os.rmdir(output_dir)
    os.rename(tmp, output_dir)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def _read_hf_config(hf_dir: str) -> dict:
  if not os.path.isdir(hf_dir):
    raise FileNotFoundError(f"--hf_dir={hf_dir} is not a folder")
  path = os.path.join(hf_dir, CONFIG_FILE)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{hf_dir}: no {CONFIG_FILE}: not a Hugging Face model folder")
  return _read_json(path)


def _read_json(path: str) -> dict:
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}: not valid JSON ({e})") from e


def _write_text(path: str, text: str) -> None:
  with open(path, "w", encoding="utf-8") as f:
    f.write(text)


def _copy_carried(source: str, target: str) -> list:
  """Copies the CARRIED_FILES `source` has into `target`; returns their names."""
  names = [n for n in CARRIED_FILES if os.path.isfile(os.path.join(source, n))]
  for name in names:
    shutil.copyfile(os.path.join(source, name), os.path.join(target, name))
  return names
