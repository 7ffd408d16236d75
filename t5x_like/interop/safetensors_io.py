"""Safetensors in and out of a Hugging Face folder, one tensor at a time (numpy; bfloat16 via ml_dtypes).

Reading also takes PyTorch's `pytorch_model.bin` (or its shards), loaded with `torch.load(weights_only=True)`:
tensors and plain containers only, so a pickle that names any other object is refused, never executed."""

import contextlib
import json
import os
from typing import Callable, Iterable, Optional

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
BIN_FILE = "pytorch_model.bin"
BIN_INDEX_FILE = "pytorch_model.bin.index.json"
READABLE_DTYPES = ("F64", "F32", "F16", "BF16")  # the safetensors dtype codes we convert to float32


class Reader(contextlib.AbstractContextManager):
  """The tensors of a Hugging Face folder: `model.safetensors`, or the shards `model.safetensors.index.json`
  lists, else `pytorch_model.bin` or its shards (loaded weights_only). Safetensors files and zip-format .bin
  files are memory-mapped; `read` converts one tensor.

  Example:
    with Reader("llama-3-8b") as r:
      w = r.read("model.embed_tokens.weight")  # (V, D) float32
  """

  def __init__(self, hf_dir: str):
    self.hf_dir = hf_dir
    files, index_path, opener = _weight_files(hf_dir, self._open_safetensors)
    self._stack = contextlib.ExitStack()
    self._where = {}
    try:
      for name in files:
        path = os.path.join(hf_dir, name)
        if not os.path.isfile(path):
          raise FileNotFoundError(f"{index_path}: lists the shard {name}, which does not exist")
        handle = opener(path)
        for key in handle.keys():
          self._where[key] = (handle, path)
    except BaseException:
      self._stack.close()
      raise

  def _open_safetensors(self, path: str):
    return _SafetensorsFile(self._stack.enter_context(safe_open(path, framework="np")))

  def __exit__(self, *exc):
    self._stack.close()

  def keys(self) -> list:
    return sorted(self._where)

  def __contains__(self, key: str) -> bool:
    return key in self._where

  def shape(self, key: str) -> tuple:
    """The stored shape (for safetensors read from the file header: no tensor bytes are loaded)."""
    return self._where[key][0].shape(key)

  def read(self, key: str) -> np.ndarray:
    """One tensor as float32 (exact for float16 / bfloat16 inputs)."""
    handle, path = self._where[key]
    dtype = handle.dtype(key)
    if dtype not in READABLE_DTYPES:
      raise ValueError(f"{path}: tensor {key!r} has dtype {dtype}; only {', '.join(READABLE_DTYPES)} "
                       f"checkpoints convert (no quantized weights)")
    return handle.tensor(key)


def _weight_files(hf_dir: str, open_safetensors: Callable) -> tuple:
  """(file names, the index's path, the function that opens one file) of the folder's weights: safetensors
  first, then PyTorch's .bin; each as an index listing shards, else a single file."""
  for index_name, single_name, opener in ((INDEX_FILE, SINGLE_FILE, open_safetensors),
                                          (BIN_INDEX_FILE, BIN_FILE, _open_bin)):
    index_path = os.path.join(hf_dir, index_name)
    if os.path.isfile(index_path):
      with open(index_path, encoding="utf-8") as f:
        weight_map = json.load(f).get("weight_map")
      if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index_path}: no 'weight_map' of tensor name → shard file")
      return sorted(set(weight_map.values())), index_path, opener
    if os.path.isfile(os.path.join(hf_dir, single_name)):
      return [single_name], index_path, opener
  others = sorted(n for n in os.listdir(hf_dir) if n.endswith((".bin", ".pt", ".pth", ".h5", ".msgpack")))
  hint = (f" (found {', '.join(others)}: name a PyTorch state dict {BIN_FILE}, or save the model with safetensors)"
          if others else "")
  raise FileNotFoundError(f"{hf_dir}: no weights: none of {SINGLE_FILE}, {INDEX_FILE}, {BIN_FILE}, "
                          f"{BIN_INDEX_FILE}{hint}")


class _SafetensorsFile:
  """One open safetensors file: names, shapes and dtypes from its header, a tensor loaded on `tensor`."""

  def __init__(self, handle):
    self._handle = handle

  def keys(self) -> list:
    return list(self._handle.keys())

  def shape(self, key: str) -> tuple:
    return tuple(self._handle.get_slice(key).get_shape())

  def dtype(self, key: str) -> str:
    return self._handle.get_slice(key).get_dtype()

  def tensor(self, key: str) -> np.ndarray:
    return self._handle.get_tensor(key).astype(np.float32)


class _BinFile:
  """One PyTorch pickle (`pytorch_model.bin`): a flat {name: tensor} dict, as `torch.save(state_dict)` writes."""

  def __init__(self, tensors: dict):
    self._tensors = tensors

  def keys(self) -> list:
    return list(self._tensors)

  def shape(self, key: str) -> tuple:
    return tuple(self._tensors[key].shape)

  def dtype(self, key: str) -> str:
    name = str(self._tensors[key].dtype)
    return _TORCH_DTYPE_CODES.get(name, name)

  def tensor(self, key: str) -> np.ndarray:
    return self._tensors[key].float().numpy()  # bfloat16 / float16 → float32 is exact; numpy has no bfloat16


# torch dtype → the safetensors code READABLE_DTYPES names
_TORCH_DTYPE_CODES = {"torch.float64": "F64", "torch.float32": "F32", "torch.float16": "F16", "torch.bfloat16": "BF16"}


def _open_bin(path: str) -> _BinFile:
  """Loads a PyTorch pickle with `weights_only=True`: torch's restricted unpickler admits tensors, dicts, lists
  and numbers and refuses any other global (a class, a function such as os.system) before calling it. The file
  must hold {name: tensor}; anything else is refused, naming the file and the key."""
  try:
    import torch  # pylint: disable=g-import-not-at-top  (only .bin checkpoints need it)
  except ImportError:
    raise ValueError(f"{path}: reading PyTorch .bin checkpoints needs torch (pip install 't5x_like[hf]'), or save "
                     f"the model with safetensors") from None
  try:
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=_is_zip(path))
  except Exception as e:  # pickle.UnpicklingError for a refused global; RuntimeError for a damaged archive
    reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise ValueError(f"{path}: refused: not a PyTorch file of tensors that loads with weights_only=True "
                     f"({reason}); nothing in it was run") from None
  if not isinstance(state, dict) or not state:
    raise ValueError(f"{path}: holds a {type(state).__name__}, not a {{name: tensor}} state dict")
  for key, value in state.items():
    if not isinstance(key, str) or not isinstance(value, torch.Tensor):
      raise ValueError(f"{path}: entry {key!r} holds a {type(value).__name__}, not a tensor")
  return _BinFile(state)


def _is_zip(path: str) -> bool:
  """torch.save's format since 1.6 (a zip archive; memory-mappable) rather than the legacy pickle stream."""
  with open(path, "rb") as f:
    return f.read(4) == b"PK\x03\x04"


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
