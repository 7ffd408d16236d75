"""Input formats of `preprocess`: the documents of one input's bytes (JSON lines, gzip/zstd, Parquet, a
Hugging Face `datasets` folder, HTML, plain text). TF-free: runs in the tokenization workers.

An input is read once, as bytes, by the driver (its hash keys the cache); `documents` turns those bytes into
texts. A `datasets.save_to_disk` folder travels as its Arrow files framed by `frame`.
"""

from __future__ import annotations

import collections
import gzip
import io
import json
import zlib
from typing import Iterator, Sequence

import pyarrow as pa
import pyarrow.ipc
import pyarrow.parquet as pq
import zstandard

COMPRESSED = (".gz", ".zst")
HF_STATE = "state.json"  # what marks a `datasets.Dataset.save_to_disk` folder
HF_DICT = "dataset_dict.json"  # a DatasetDict's folder: one Dataset folder per split


class CorruptInput(ValueError):
  """A compressed or columnar input that cannot be decoded; the runners skip it, name it and go on."""


def strip_compression(path: str) -> str:
  path = path.rstrip("/")
  for ext in COMPRESSED:
    if path.endswith(ext):
      return path[:-len(ext)]
  return path


def input_kind(path: str, is_dir: bool = False) -> str:
  """"hf_dataset" (a folder), "jsonl" (*.jsonl / *.json), "parquet", "html" (*.html / *.htm), else "text";
  each optionally .gz / .zst compressed (not Parquet, which compresses inside)."""
  if is_dir:
    return "hf_dataset"
  name = strip_compression(path).lower()
  if name.endswith((".jsonl", ".json")):
    return "jsonl"
  if path.lower().endswith(".parquet"):
    return "parquet"
  if name.endswith((".html", ".htm", ".xhtml")):
    return "html"
  return "text"


def decompress(raw: bytes, path: str) -> bytes:
  """The bytes of a .gz / .zst input uncompressed (others as they are); CorruptInput names a bad one."""
  try:
    if path.endswith(".gz"):
      return gzip.decompress(raw)
    if path.endswith(".zst"):
      with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(raw)) as reader:
        return reader.read()
  except (OSError, EOFError, zlib.error, zstandard.ZstdError) as e:
    raise CorruptInput(f"Input '{path}' is not valid {path.rsplit('.', 1)[-1]}: {e}") from e
  return raw


def frame(parts: Sequence[bytes]) -> bytes:
  """Several files' bytes as one: each preceded by its length (8 bytes, little-endian)."""
  return b"".join(len(p).to_bytes(8, "little") + p for p in parts)


def unframe(raw: bytes) -> Iterator[bytes]:
  at = 0
  while at < len(raw):
    size = int.from_bytes(raw[at:at + 8], "little")
    yield raw[at + 8:at + 8 + size]
    at += 8 + size


def hf_dataset_files(state_json: bytes, path: str) -> list[str]:
  """The Arrow files (relative names, in order) a `save_to_disk` folder's state.json lists."""
  try:
    files = [f["filename"] for f in json.loads(state_json)["_data_files"]]
  except (ValueError, KeyError, TypeError) as e:
    raise ValueError(f"'{path}/{HF_STATE}' is not a datasets state.json (no _data_files list): {e}") from e
  if not files:
    raise ValueError(f"Hugging Face dataset folder '{path}' lists no data files in {HF_STATE}")
  return files


def _column(table: pa.Table, column: str, path: str) -> list[str]:
  if column not in table.column_names:
    raise ValueError(f"Input '{path}' has no column '{column}' (--text_field); its columns: "
                     f"{', '.join(table.column_names)}")
  values = table.column(column)
  if not (pa.types.is_string(values.type) or pa.types.is_large_string(values.type)):
    raise ValueError(f"Input '{path}': column '{column}' (--text_field) holds {values.type}, not text")
  return values.to_pylist()


def table_texts(raw: bytes, kind: str, column: str, path: str, counts: collections.Counter) -> list[str]:
  """The text column of a Parquet file or of a `datasets` folder's Arrow files; null cells are counted."""
  try:
    if kind == "parquet":
      tables = [pq.read_table(pa.BufferReader(raw))]
    else:
      tables = [pa.ipc.open_stream(pa.BufferReader(part)).read_all() for part in unframe(raw)]
  except (pa.ArrowInvalid, pa.ArrowException, OSError) as e:
    raise CorruptInput(f"Input '{path}' is not a readable {'Parquet file' if kind == 'parquet' else 'Arrow file'}: "
                       f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
  texts = []
  for table in tables:
    for value in _column(table, column, path):
      if value is None:
        counts["dropped_missing_field"] += 1
      else:
        texts.append(value)
  return texts
