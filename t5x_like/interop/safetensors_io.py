"""Safetensors in and out of a Hugging Face folder, one tensor at a time (numpy; bfloat16 via ml_dtypes)."""

import contextlib
import json
import os
from typing import Callable, Iterable, Optional

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
READABLE_DTYPES = ("F64", "F32", "F16", "BF16")  # the safetensors dtype codes we convert to float32


class Reader(contextlib.AbstractContextManager):
  """The tensors of a Hugging Face folder: `model.safetensors`, or the shards `model.safetensors.index.json`
  lists. Files are memory-mapped; `read` loads one tensor.

  Example:
    with Reader("llama-3-8b") as r:
      w = r.read("model.embed_tokens.weight")  # (V, D) float32
  """

  def __init__(self, hf_dir: str):
    self.hf_dir = hf_dir
    index_path, single_path = os.path.join(hf_dir, INDEX_FILE), os.path.join(hf_dir, SINGLE_FILE)
    if os.path.isfile(index_path):
      with open(index_path, encoding="utf-8") as f:
        weight_map = json.load(f).get("weight_map")
      if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index_path}: no 'weight_map' of tensor name → shard file")
      files = sorted(set(weight_map.values()))
    elif os.path.isfile(single_path):
      files = [SINGLE_FILE]
    else:
      others = sorted(n for n in os.listdir(hf_dir) if n.endswith((".bin", ".pt", ".pth", ".h5", ".msgpack")))
      hint = f" (found {', '.join(others)}: save it with safetensors first)" if others else ""
      raise FileNotFoundError(f"{hf_dir}: no weights: neither {SINGLE_FILE} nor {INDEX_FILE}{hint}")
    self._stack = contextlib.ExitStack()
    self._where = {}
    try:
      for name in files:
        path = os.path.join(hf_dir, name)
        if not os.path.isfile(path):
          raise FileNotFoundError(f"{index_path}: lists the shard {name}, which does not exist")
        handle = self._stack.enter_context(safe_open(path, framework="np"))
        for key in handle.keys():
          self._where[key] = (handle, path)
    except BaseException:
      self._stack.close()
      raise

  def __exit__(self, *exc):
    self._stack.close()

  def keys(self) -> list:
    return sorted(self._where)

  def __contains__(self, key: str) -> bool:
    return key in self._where

  def shape(self, key: str) -> tuple:
    """The stored shape, read from the file header (no tensor bytes are loaded)."""
    return tuple(self._where[key][0].get_slice(key).get_shape())

  def read(self, key: str) -> np.ndarray:
    """One tensor as float32 (exact for float16 / bfloat16 inputs)."""
    handle, path = self._where[key]
    dtype = handle.get_slice(key).get_dtype()
    if dtype not in READABLE_DTYPES:
      raise ValueError(f"{path}: tensor {key!r} has dtype {dtype}; only {', '.join(READABLE_DTYPES)} "
                       f"checkpoints convert (no quantized weights)")
    return handle.get_tensor(key).astype(np.float32)


def write(output_dir: str, tensors: Iterable, num_bytes: Callable[[str], int],
          max_shard_bytes: int, metadata: Optional[dict] = None) -> list:
  """Writes (name, array-producer) pairs as safetensors, at most `max_shard_bytes` per file.

  Producers are called one by one and a shard's arrays are dropped once it is written, so memory holds
  one shard, not the model. One shard is written as `model.safetensors`; more as
  `model-00001-of-0000N.safetensors` with a `model.safetensors.index.json` (Hugging Face's names).

  Args:
    output_dir: an existing folder.
    tensors: (name, producer) pairs; producer() returns the array to store under `name`.
    num_bytes: name → the stored size of that tensor, to plan shards before producing anything.
    max_shard_bytes: the size a shard stays under (a larger single tensor gets a shard of its own).
    metadata: string → string header metadata ({"format": "pt"} is always added; transformers needs it).

  Returns:
    The file names written.
  """
  tensors = list(tensors)
  shards, size = [[]], 0
  for name, producer in tensors:
    n = num_bytes(name)
    if shards[-1] and size + n > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append((name, producer))
    size += n
  header = {"format": "pt", **(metadata or {})}
  names = [SINGLE_FILE] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                                   for i in range(len(shards))]
  weight_map, total = {}, 0
  for file_name, shard in zip(names, shards):
    arrays = {name: np.ascontiguousarray(producer()) for name, producer in shard}
    save_file(arrays, os.path.join(output_dir, file_name), metadata=header)
    total += sum(a.nbytes for a in arrays.values())
    weight_map.update({name: file_name for name in arrays})
    del arrays
  if len(shards) > 1:
    with open(os.path.join(output_dir, INDEX_FILE), "w", encoding="utf-8") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
  return names
