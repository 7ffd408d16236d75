"""Sequence-length warmup: the schedule, and cutting packed rows into shorter ones without losing a token."""

import dataclasses
import json

import numpy as np
import pytest

from t5x_like.model import decoder as model_lib
from t5x_like.training import checkpointing
from t5x_like import data as data_lib
from t5x_like.training import curriculum
from t5x_like.training import trainer
from tests import conftest
from tests import test_train_e2e

# one layer: the schedule and the exact resume do not depend on the model; it compiles in half the time of TINY
SMALL = model_lib.GPTConfig(num_layers=1, num_heads=2, d_model=32, d_ff=64, max_len=32, dtype="float32")
CFG = curriculum.CurriculumConfig(seq_len_warmup_steps=100, seq_len_start=16, seq_len_multiple=8)


def test_length_grows_from_start_to_seq_len_over_the_warmup():
  got = [curriculum.length_at(CFG, step, 128) for step in range(0, 120)]
  assert got[0] == 16 and got[99] == 64 and got[100:] == [128] * 20  # 128's divisors: 16, 32, 64, 128
  assert got == sorted(got) and set(got) == {16, 32, 64, 128}
  assert all(128 % n == 0 for n in got)
  # the ramp: at step s the length is the largest allowed one ≤ 16 + 112·s/100 (32 from s = 14.3, 64 from 42.9)
  assert (got[14], got[15], got[42], got[43]) == (16, 32, 32, 64)
  assert curriculum.length_at(curriculum.CurriculumConfig(), 0, 128) == 128  # off by default


def test_lengths_respect_the_loss_chunk_and_the_multiple():
  assert curriculum.lengths(CFG, 96) == [16, 24, 32, 48, 96]
  assert curriculum.lengths(CFG, 96, loss_chunk=32) == [16, 24, 32, 96]  # 48 is not a multiple of 32


@pytest.mark.parametrize("bad, message", [
    (dict(seq_len_start=0), "seq_len_start=0"),
    (dict(seq_len_start=300), r"seq_len_start=300 must be in \[1, SEQ_LEN=128\]"),
    (dict(seq_len_multiple=0), "seq_len_multiple=0"),
])
def test_bad_settings_name_the_field(bad, message):
  with pytest.raises(ValueError, match=message):
    curriculum.lengths(curriculum.CurriculumConfig(seq_len_warmup_steps=10, **bad), 128)


def packed_batch():
  """Two rows of 16 positions: documents of 5, 7 and 4 tokens, then 10 tokens and 6 of padding."""
  segment_ids = np.array([[1] * 5 + [2] * 7 + [3] * 4, [1] * 10 + [0] * 6], np.int32)
  positions = np.array([list(range(5)) + list(range(7)) + list(range(4)), list(range(10)) + [0] * 6], np.int32)
  inputs = np.arange(32, dtype=np.int32).reshape(2, 16) + 10
  return {"inputs": inputs, "targets": inputs + 1, "segment_ids": segment_ids, "positions": positions,
          "weights": (segment_ids != 0).astype(np.float32)}


def test_cut_rows_keeps_every_token_in_order_and_restarts_cut_documents():
  batch = packed_batch()
  cut = curriculum.cut_rows(batch, 8)
  assert {k: v.shape for k, v in cut.items()} == {k: (4, 8) for k in batch}
  for key in ("inputs", "targets", "segment_ids", "weights"):
    np.testing.assert_array_equal(cut[key].reshape(-1), batch[key].reshape(-1))
  # row 0 = doc1 (5) + doc2's first 3; row 1 = doc2's last 4 (restarted at 0) + doc3 (4)
  np.testing.assert_array_equal(cut["positions"], [[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 2, 3, 0, 1, 2, 3],
                                                   [0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 0, 0, 0, 0, 0, 0]])
  assert curriculum.cut_rows(batch, 16) is batch
  with pytest.raises(ValueError, match="length 6 does not divide"):
    curriculum.cut_rows(batch, 6)


@pytest.mark.slow  # two short training launches
def test_warmup_runs_short_rows_first_and_a_resumed_run_is_bit_identical(corpus, tmp_path, monkeypatch):
  """6 steps straight vs a copy of its step-3 checkpoint resumed to 6: the same lengths per step, losses
  and parameters. The straight run keeps one step in flight (the CPU default), the resumed one dispatches ahead
  (TrainConfig.dispatch_ahead=True): the way steps are dispatched changes nothing they compute. Each run hands its
  training iterator to input_pipeline.release as it returns (tf.data's teardown can wait half a minute)."""
  seen, gates, released = [], [], []

  class Gate(trainer.StepGate):
    def __init__(self, dispatch_ahead):
      super().__init__(dispatch_ahead)
      gates.append(self.ahead)

  monkeypatch.setattr(trainer, "StepGate", Gate)
  monkeypatch.setattr(trainer.input_pipeline, "release", lambda iterator: released.append(type(iterator).__name__))
  cut = curriculum.cut_rows
  monkeypatch.setattr(curriculum, "cut_rows", lambda batch, length: (seen.append(length), cut(batch, length))[1])
  warmup = curriculum.CurriculumConfig(seq_len_warmup_steps=4, seq_len_start=8, seq_len_multiple=8)
  small_data = data_lib.DataConfig(eval_batches=1, shuffle_buffer=64)  # the run's final evaluation: one batch

  def run(model_dir, steps, dispatch_ahead=None):
    config = test_train_e2e.run_config(str(model_dir), corpus, train_steps=steps, log_every=1, checkpoint_every=3,
                                       eval_every=0, curriculum=warmup, data=small_data, dispatch_ahead=dispatch_ahead)
    trainer.train(config, SMALL, dataclasses.replace(test_train_e2e.OPT, decay="constant", warmup_steps=2))

  def losses(model_dir):
    return {r["step"]: r["loss"] for r in map(json.loads, open(model_dir / "metrics.jsonl")) if "loss" in r}

  run(tmp_path / "straight", 6)
  assert seen == [8, 8, 16, 16, 32, 32]  # SEQ_LEN 32: the ramp 8 → 32 over 4 steps, then 32
  seen.clear()
  run(conftest.rewind(tmp_path / "straight", tmp_path / "resumed", 3), 6, dispatch_ahead=True)
  assert seen == [16, 32, 32] and gates == [False, True]  # steps 4-6 continue the ramp where the checkpoint left it
  assert released == ["OwnedIterator", "OwnedIterator"]  # tf.data's iterator of each run
  straight = losses(tmp_path / "straight")
  assert losses(tmp_path / "resumed") == {step: straight[step] for step in (4, 5, 6)}
  digests = [checkpointing.params_digest(checkpointing.restore_params(str(tmp_path / name))[1])
             for name in ("straight", "resumed")]
  assert digests[0] == digests[1]
