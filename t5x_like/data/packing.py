"""Packed rows: segment ids, positions and loss weights (TF and NumPy), and the pre-packed record format."""

from __future__ import annotations

from typing import Iterable

import numpy as np
import tensorflow as tf

# Pre-packed shards hold one row per TFRecord record as raw little-endian integers of the manifest's
# "packed_dtype" ("uint16" when vocab and row length fit, else "int32"): the row's N tokens, then
# its N segment ids, then its N positions, then (chat data) its N loss weights. Decoding is a memcpy
# (no tf.train.Example, no varints). In the pipeline a block of rows is one int32 tensor (R, C, N)
# with C = 3 channels in that order, or 4 with the stored loss weights.
RECORD_FORMAT = "raw_rows"
TOKENS, SEGMENTS, POSITIONS, WEIGHTS = 0, 1, 2, 3


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
  """Model features from segmented rows of L+1 tokens ((B, 3, L+1), see `segment_rows`, or
  (B, 4, L+1) with stored loss weights, see `pack_documents_np`).

  weights[i] = 1 when target i (token i+1) is in the same document as input i: never across a
  document boundary (after EOS) and never on padding. With stored weights it is that times the
  stored weight of token i+1 (the weight of predicting a token is the token's own weight).

  Returns:
    inputs, targets, segment_ids, positions: int32 (B, L); weights: float32 (B, L).
  """
  rows = tf.cast(rows, tf.int32)                                        # (B, C, L+1)
  tokens, segments = rows[:, TOKENS], rows[:, SEGMENTS]                 # (B, L+1)
  same_doc = tf.equal(segments[:, 1:], segments[:, :-1]) & tf.not_equal(segments[:, :-1], 0)
  weights = tf.cast(same_doc, tf.float32)
  if rows.shape[1] == 4:
    weights *= tf.cast(rows[:, WEIGHTS, 1:], tf.float32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": segments[:, :-1],
          "positions": rows[:, POSITIONS, :-1], "weights": weights}


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


def serialize_packed_row(channels: np.ndarray, dtype: str) -> bytes:
  """One pre-packed record: (C, N) tokens, segment ids, positions [, weights] as raw little-endian `dtype`."""
  return np.asarray(channels).astype(np.dtype(dtype).newbyteorder("<")).tobytes()


def parse_packed(records: tf.Tensor, length: int, dtype: str, channels: int = 3) -> tf.Tensor:
  """(K,) pre-packed records -> (K, channels, length) of `dtype`: tokens, segment ids, positions
  [, weights].

  The stored dtype is kept (uint16 halves the bytes every later copy moves); `row_features`
  casts to int32 at the end.
  """
  values = tf.io.decode_raw(records, tf.uint16 if dtype == "uint16" else tf.int32,
                            little_endian=True)
  return tf.reshape(values, [-1, channels, length])


def empty_row(length: int, pad_id: int) -> np.ndarray:
  """(4, length) int32: all padding (token pad_id, segment 0, position 0, weight 0)."""
  row = np.zeros([4, length], np.int32)
  row[TOKENS] = pad_id
  return row


def pack_documents_np(docs: Iterable[tuple[np.ndarray, np.ndarray]], length: int, pad_id: int) -> np.ndarray:
  """Whole documents with loss weights into rows of `length`, in order, never split across rows.

  Next-fit: a document that does not fit in what is left of the current row starts the next one (the
  rest of the row is padding); a document longer than `length` is cut to it. Segment ids count the
  documents of a row from 1; positions restart at 0 in each.

  Example (pad 0):
    >>> pack_documents_np([([5, 6, 1], [0, 1, 0]), ([7, 1], [1, 0]), ([8, 8, 1], [1, 1, 0])], 5, 0)
    tokens    [[5, 6, 1, 7, 1], [8, 8, 1, 0, 0]]
    segments  [[1, 1, 1, 2, 2], [1, 1, 1, 0, 0]]
    positions [[0, 1, 2, 0, 1], [0, 1, 2, 0, 0]]
    weights   [[0, 1, 0, 1, 0], [1, 1, 0, 0, 0]]

  Returns:
    int32 (R, 4, length): tokens, segment ids, positions, weights.
  """
  rows, row, fill = [], empty_row(length, pad_id), 0
  for tokens, weights in docs:
    tokens, weights = np.asarray(tokens)[:length], np.asarray(weights)[:length]
    n = len(tokens)
    if fill + n > length:
      rows.append(row)
      row, fill = empty_row(length, pad_id), 0
    segment = row[SEGMENTS, fill - 1] + 1 if fill else 1
    row[:, fill:fill + n] = [tokens, np.full(n, segment), np.arange(n), weights]
    fill += n
  if fill:
    rows.append(row)
  return np.stack(rows) if rows else np.zeros([0, 4, length], np.int32)


def pack_documents_step(length: int, pad_id: int):
  """The `tf.data.Dataset.scan` step of `pack_documents_np`'s packing, one document at a time.

  State: (row (4, length) int32, fill, segment); element: (tokens (n,), weights (n,)) int32 with
  n <= length. Emits (the finished row, whether one was finished): a row is finished when the next
  document does not fit in it. Feed a final document of `length` tokens to flush the last row.
  """
  empty = tf.constant(empty_row(length, pad_id))

  def step(state, doc):
    row, fill, segment = state
    tokens, weights = doc
    n = tf.size(tokens)
    full = fill + n > length
    emitted = (row, full & (fill > 0))
    row = tf.where(full, empty, row)
    fill, segment = tf.where(full, 0, fill), tf.where(full, 1, segment + 1)
    block = tf.stack([tokens, tf.fill([n], segment), tf.range(n), weights])     # (4, n)
    row = tf.ensure_shape(tf.concat([row[:, :fill], block, row[:, fill + n:]], axis=1), [4, length])
    return (row, fill + n, segment), emitted

  initial = (empty, tf.constant(0), tf.constant(0))
  return initial, step
