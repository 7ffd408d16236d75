"""Easy-to-hard document order (`preprocess --order_by`): the score of a document and the sorted order.

An ordered DATA_DIR holds its train split sorted ascending by a score (ties broken by content hash)
and dealt round-robin over its shards (`shard_writer.write_ordered_shards`): reading every shard one
record at a time in turn (`input_pipeline.make_dataset`) gives back the sorted order.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

ORDERED_SPLITS = ("train",)  # the splits --order_by sorts; validation keeps the seeded shard plan
_FIELD = "field:"


@dataclasses.dataclass(frozen=True)
class OrderSpec:
  """How documents are scored: "length" (tokens, EOS included) or "field:NAME" (a numeric JSON field)."""
  by: str

  @property
  def field(self) -> str | None:
    """The JSON field NAME of "field:NAME", else None."""
    return self.by[len(_FIELD):] if self.by.startswith(_FIELD) else None

  def manifest_entry(self) -> dict:
    """manifest.json "order": what the reader keeps in order."""
    return {"by": self.by, "ascending": True, "splits": list(ORDERED_SPLITS)}


def parse_order_by(value: str | None) -> OrderSpec | None:
  """--order_by: "" / "none" -> None (the seeded shard plan), "length", or "field:NAME".

  Raises:
    ValueError: any other value (the message names it).
  """
  if not value or value == "none":
    return None
  if value == "length" or (value.startswith(_FIELD) and len(value) > len(_FIELD)):
    return OrderSpec(value)
  raise ValueError(f"--order_by={value!r} must be 'none', 'length' or 'field:NAME' (NAME: a numeric JSON field)")


def field_score(obj, field: str, where: str) -> float:
  """The numeric value of `field` in one decoded JSON line.

  Args:
    obj: the decoded line (a dict).
    field: the field name.
    where: "file:line", named in the error.

  Raises:
    ValueError: one line naming `where` and the field: missing, or not a finite number (booleans,
      strings and null are not numbers).
  """
  if field not in obj:
    raise ValueError(f"{where}: --order_by=field:{field}: the line has no field '{field}'")
  value = obj[field]
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
    raise ValueError(f"{where}: --order_by=field:{field}: '{field}' is {value!r}, not a finite number")
  return float(value)


def sorted_indices(scores: Sequence[float], hashes: Sequence[bytes]) -> np.ndarray:
  """Indices of the documents by ascending score; equal scores by ascending content hash.

  Example:
    >>> sorted_indices([3.0, 1.0, 3.0], [b"\\x02" * 16, b"\\x09" * 16, b"\\x01" * 16])
    array([1, 2, 0])
  """
  if not len(scores):
    return np.zeros([0], np.int64)
  keys = np.frombuffer(b"".join(bytes(h)[:16].ljust(16, b"\0") for h in hashes), ">u8").reshape(-1, 2)
  return np.lexsort((keys[:, 1], keys[:, 0], np.asarray(scores, np.float64)))
