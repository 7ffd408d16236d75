"""Sequence-length warmup: train on short sequences first, growing to SEQ_LEN over the first N steps.

The recipe of Li, Zhang & He (2022, "The stability-efficiency dilemma: investigating sequence length
warmup for training GPT models"): early updates see short contexts, which keeps the loss from spiking
at large batch and learning rate. Here the tokens per step stay constant: each packed (B, SEQ_LEN) batch
from the input pipeline is cut into (B·SEQ_LEN/L, L) rows, so no data is skipped and the iterator (and
its checkpoint) is the same as without warmup. A document cut at a chunk boundary continues in the next
row as its own segment with positions counted from 0 again, exactly as packing treats a document cut at
a row boundary. L(step) is a pure function of the step, so a resumed run sees the same lengths.

L grows linearly from `seq_len_start` to SEQ_LEN over `seq_len_warmup_steps`, rounded down to a length
that divides SEQ_LEN (and the loss chunk), so only a handful of step shapes are ever compiled.
"""

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class CurriculumConfig:
  """Sequence-length warmup (gin: `curriculum.CurriculumConfig`)."""
  seq_len_warmup_steps: int = 0  # 0 = off; else steps over which the length grows to SEQ_LEN
  seq_len_start: int = 64  # the first steps' sequence length
  seq_len_multiple: int = 8  # lengths used are multiples of this (and divide SEQ_LEN)

  def enabled(self) -> bool:
    return self.seq_len_warmup_steps > 0


def lengths(config: CurriculumConfig, seq_len: int, loss_chunk: int = 0) -> list:
  """The sequence lengths the warmup may use, ascending (the last is seq_len)."""
  if config.seq_len_warmup_steps < 0:
    raise ValueError(f"CurriculumConfig.seq_len_warmup_steps={config.seq_len_warmup_steps} must be >= 0")
  if not 1 <= config.seq_len_start <= seq_len:
    raise ValueError(f"CurriculumConfig.seq_len_start={config.seq_len_start} must be in [1, SEQ_LEN={seq_len}]")
  if config.seq_len_multiple < 1:
    raise ValueError(f"CurriculumConfig.seq_len_multiple={config.seq_len_multiple} must be >= 1")
  out = [n for n in range(config.seq_len_start, seq_len + 1)
         if seq_len % n == 0 and n % config.seq_len_multiple == 0
         and (not loss_chunk or n <= loss_chunk or n % loss_chunk == 0)]
  if seq_len not in out:
    out.append(seq_len)
  return out


def length_at(config: CurriculumConfig, step: int, seq_len: int, loss_chunk: int = 0) -> int:
  """The sequence length of `step` (0-based): the largest allowed length ≤ the linear ramp, at least the
  shortest allowed one; seq_len from step seq_len_warmup_steps on (and always when warmup is off)."""
  if not config.enabled() or step >= config.seq_len_warmup_steps:
    return seq_len
  allowed = lengths(config, seq_len, loss_chunk)
  ramp = config.seq_len_start + (seq_len - config.seq_len_start) * step / config.seq_len_warmup_steps
  fitting = [n for n in allowed if n <= ramp]
  return fitting[-1] if fitting else allowed[0]


def _restart_positions(segment_ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
  """Positions counted from 0 at the start of each run of equal segment ids in each row."""
  cols = np.arange(segment_ids.shape[1])
  starts = np.ones_like(segment_ids, dtype=bool)
  starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
  first = np.maximum.accumulate(np.where(starts, cols[None], 0), axis=1)  # index of each run's first token
  restarted = positions - np.take_along_axis(positions, first, axis=1)
  return np.where(segment_ids != 0, restarted, 0).astype(positions.dtype)


def cut_rows(batch: dict, length: int) -> dict:
  """(B, S) arrays → (B·S/length, length): each row cut into S/length consecutive chunks, in order.

  Every (B, S) feature is reshaped; `positions` restart at each chunk's first token of a document.
  """
  rows, seq = batch["inputs"].shape
  if length == seq:
    return batch
  if seq % length:
    raise ValueError(f"sequence-length warmup: length {length} does not divide the batch's {seq} positions")
  out = {}
  for key, value in batch.items():
    value = np.asarray(value)
    if value.shape[:2] != (rows, seq):
      raise ValueError(f"sequence-length warmup: batch feature {key!r} has shape {value.shape}, expected "
                       f"({rows}, {seq}, ...)")
    out[key] = value.reshape((rows * (seq // length), length) + value.shape[2:])
  if "positions" in out and "segment_ids" in out:
    out["positions"] = _restart_positions(out["segment_ids"], out["positions"])
  return out
