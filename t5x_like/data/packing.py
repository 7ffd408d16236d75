"""Packed rows: segment ids, positions and loss weights (TF and NumPy), and the pre-packed record format."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

# Pre-packed shards hold one row per TFRecord record as raw little-endian integers of the manifest's
# "packed_dtype" ("uint16" when vocab and row length fit, else "int32"): the row's N tokens, then
# its N segment ids, then its N positions. Decoding is a memcpy (no tf.train.Example, no varints).
# In the pipeline a block of rows is one int32 tensor (R, 3, N) in that order.
RECORD_FORMAT = "raw_rows"
TOKENS, SEGMENTS, POSITIONS = 0, 1, 2


def packed_dtype(vocab_size: int, length: int) -> str:
  return "uint16" if vocab_size <= 1 << 16 and length <= 1 << 16 else "int32"


def segment_rows(rows: tf.Tensor, pad_id: int = 0, eos_id: int = 1) -> tf.Tensor:
  """Segment ids and positions of rows cut from the document stream.

  A document starts at column 0 and after every EOS; `pad_id` tokens get segment 0, position 0.

  Args:
    rows: int32 (R, N).

  Returns:
    int32 (R, 3, N): tokens, segment ids (1, 2, ... per row), positions (0 at each document start).
  """
  rows = tf.cast(rows, tf.int32)                                         # (R, N)
  shape = tf.shape(rows)
  keep = tf.cast(tf.not_equal(rows, pad_id), tf.int32)
  starts = tf.concat([tf.ones([shape[0], 1], tf.bool), tf.equal(rows[:, :-1], eos_id)], axis=1)
  segments = tf.cumsum(tf.cast(starts, tf.int32), axis=1)
  first = tf.cast(tf.where(tf.reshape(starts, [-1]))[:, 0], tf.int32)    # flat index of each start
  lengths = tf.concat([first[1:], [tf.size(rows)]], axis=0) - first
  positions = tf.reshape(tf.ragged.range(lengths).flat_values, shape)
  return tf.stack([rows, segments * keep, positions * keep], axis=1)


def row_features(rows: tf.Tensor) -> dict[str, tf.Tensor]:
  """Model features from segmented rows of L+1 tokens ((B, 3, L+1), see `segment_rows`).

  weights[i] = 1 when target i (token i+1) is in the same document as input i: never across a
  document boundary (after EOS) and never on padding.

  Returns:
    inputs, targets, segment_ids, positions: int32 (B, L); weights: float32 (B, L).
  """
  rows = tf.cast(rows, tf.int32)                                        # (B, 3, L+1)
  tokens, segments = rows[:, TOKENS], rows[:, SEGMENTS]                 # (B, L+1)
  same_doc = tf.equal(segments[:, 1:], segments[:, :-1]) & tf.not_equal(segments[:, :-1], 0)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": segments[:, :-1],
          "positions": rows[:, POSITIONS, :-1], "weights": tf.cast(same_doc, tf.float32)}


def pack_features(rows: tf.Tensor, pad_id: int = 0, eos_id: int = 1) -> dict[str, tf.Tensor]:
  """Model features from rows of L+1 tokens cut from the document stream.

  Example (pad 0, EOS 1; a row holding the end of doc A, doc B, and padding):
    rows        [[7, 1, 5, 6, 1, 0]]
    inputs      [[7, 1, 5, 6, 1]]      targets   [[1, 5, 6, 1, 0]]
    segment_ids [[1, 1, 2, 2, 2]]      positions [[0, 1, 0, 1, 2]]
    weights     [[1, 0, 1, 1, 0]]

  Args:
    rows: int32 (B, L+1).

  Returns:
    inputs, targets, segment_ids, positions: int32 (B, L); weights: float32 (B, L).
  """
  return row_features(segment_rows(rows, pad_id, eos_id))


def segment_rows_np(rows: np.ndarray, pad_id: int = 0, eos_id: int = 1) -> tuple[np.ndarray, np.ndarray]:
  """NumPy twin of `segment_rows` for writing pre-packed shards: (segment_ids, positions)."""
  rows = np.asarray(rows)
  starts = np.ones(rows.shape, bool)
  starts[:, 1:] = rows[:, :-1] == eos_id
  segments = np.cumsum(starts, axis=1)
  index = np.broadcast_to(np.arange(rows.shape[1]), rows.shape)
  positions = index - np.maximum.accumulate(np.where(starts, index, 0), axis=1)
  keep = rows != pad_id
  return segments * keep, positions * keep


def serialize_packed_row(row: np.ndarray, segments: np.ndarray, positions: np.ndarray,
                         dtype: str) -> bytes:
  """One pre-packed record: tokens, segment ids, positions as raw little-endian `dtype`."""
  return np.concatenate([row, segments, positions]).astype(np.dtype(dtype).newbyteorder("<")).tobytes()


def parse_packed(records: tf.Tensor, length: int, dtype: str) -> tf.Tensor:
  """(K,) pre-packed records -> (K, 3, length) of `dtype`: tokens, segment ids, positions.

  The stored dtype is kept (uint16 halves the bytes every later copy moves); `row_features`
  casts to int32 at the end.
  """
  values = tf.io.decode_raw(records, tf.uint16 if dtype == "uint16" else tf.int32,
                            little_endian=True)
  return tf.reshape(values, [-1, 3, length])
