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
import posixpath
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
  """"hf_dataset" (a folder), "tfrecord" (*.tfrecord(s), seqio's *.tfrecord-00000-of-00008), "jsonl"
  (*.jsonl / *.json), "parquet", "html" (*.html / *.htm), else "text"; each optionally .gz / .zst compressed
  (not Parquet, which compresses inside; a .gz TFRecord file is TFRecord's GZIP)."""
  if is_dir:
    return "hf_dataset"
  name = strip_compression(path).lower()
  if name.endswith((".tfrecord", ".tfrecords")) or ".tfrecord-" in posixpath.basename(name):
    return "tfrecord"
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


def _varint(buf: bytes, at: int) -> tuple[int, int]:
  value = shift = 0
  while True:
    if at >= len(buf):
      raise ValueError("truncated varint")
    byte = buf[at]
    value |= (byte & 0x7F) << shift
    at += 1
    if not byte & 0x80:
      return value, at
    shift += 7


def _fields(buf: bytes) -> Iterator[tuple[int, int, object]]:
  """(field number, wire type, value) of a serialized protocol buffer: an int for varint / fixed fields,
  bytes for length-delimited ones."""
  at = 0
  while at < len(buf):
    tag, at = _varint(buf, at)
    number, wire = tag >> 3, tag & 7
    if wire == 0:
      value, at = _varint(buf, at)
    elif wire == 2:
      size, at = _varint(buf, at)
      value, at = buf[at:at + size], at + size
      if at > len(buf):
        raise ValueError("truncated field")
    elif wire in (1, 5):
      width = 8 if wire == 1 else 4
      value, at = int.from_bytes(buf[at:at + width], "little"), at + width
    else:
      raise ValueError(f"unsupported wire type {wire}")
    yield number, wire, value


def example_feature(record: bytes, name: str) -> list | None:
  """One feature of a serialized tf.train.Example: its bytes values (list[bytes]) or int64 values (list[int]);
  None when the Example lacks it. Read with our own wire-format parser, without TensorFlow."""
  for number, _, features in _fields(record):
    if number != 1:  # Example.features
      continue
    for entry_number, _, entry in _fields(features):  # Features.feature: map<string, Feature> entries
      if entry_number != 1:
        continue
      key, feature = None, b""
      for k, _, v in _fields(entry):
        key, feature = (v.decode("utf-8"), feature) if k == 1 else (key, v)
      if key != name:
        continue
      for kind, _, values in _fields(feature):  # Feature: 1 bytes_list, 2 float_list, 3 int64_list
        if kind == 1:
          return [v for n, _, v in _fields(values) if n == 1]
        if kind == 3:
          out = []
          for n, wire, v in _fields(values):
            if n == 1 and wire == 2:  # packed
              at = 0
              while at < len(v):
                x, at = _varint(v, at)
                out.append(x - (1 << 64) if x >= 1 << 63 else x)
            elif n == 1:
              out.append(v - (1 << 64) if v >= 1 << 63 else v)
          return out
        if kind == 2:
          raise ValueError(f"feature '{name}' holds floats, not text or token ids")
      return []
  return None


def tfrecord_records(raw: bytes, path: str) -> Iterator[bytes]:
  """The records of a TFRecord file's bytes (length, its CRC, data, its CRC; CRCs not checked): a truncated
  file raises CorruptInput naming it."""
  at = 0
  while at < len(raw):
    if at + 12 > len(raw):
      raise CorruptInput(f"Input '{path}' is not a valid TFRecord file: truncated record header at byte {at}")
    size = int.from_bytes(raw[at:at + 8], "little")
    if at + 12 + size + 4 > len(raw):
      raise CorruptInput(f"Input '{path}' is not a valid TFRecord file: truncated record at byte {at}")
    yield raw[at + 12:at + 12 + size]
    at += 12 + size + 4


def tfrecord_texts(raw: bytes, feature: str, path: str, counts: collections.Counter, decode=None) -> list[str]:
  """The documents of a TFRecord file of tf.train.Examples (other trainers' data, e.g. seqio's `targets`):
  a bytes feature is text (several values joined by newlines), an int64 feature is token ids turned into text
  by `decode` (the tokenizer they come from, --tokenizer). Records without the feature are counted."""
  texts = []
  for record in tfrecord_records(decompress(raw, path), path):
    try:
      values = example_feature(record, feature)
    except (ValueError, UnicodeDecodeError) as e:
      raise CorruptInput(f"Input '{path}': a record is not a tf.train.Example: {e}") from e
    if values is None:
      counts["dropped_missing_field"] += 1
    elif values and isinstance(values[0], int):
      if decode is None:
        raise ValueError(f"Input '{path}': feature '{feature}' holds token ids: pass --tokenizer, the vocabulary "
                         "they come from, to read them as text")
      texts.append(decode(values))
    else:
      texts.append("\n".join(v.decode("utf-8", "surrogateescape") for v in values))
  if not texts and counts["dropped_missing_field"]:
    raise ValueError(f"Input '{path}': no record has the feature '{feature}' (--text_field)")
  return texts
