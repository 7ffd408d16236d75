"""Tests for t5x_like.input_pipeline: exact token stream, packing masks, hosts, determinism, errors."""

import collections
import json
import os
import shutil
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

from t5x_like.data import input_pipeline as ip
from t5x_like.data import packing
from t5x_like.data import preprocessing as pp

TESTDATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "testdata")
INPUTS = [os.path.join(TESTDATA, "sample.txt"), os.path.join(TESTDATA, "sample.jsonl")]
KW = dict(vocab_size=500, doc_split="blank_line", num_train_shards=3, validation_fraction=0.2,
          num_workers=1, progress=False, cache_dir=None)
ONE = dict(process_index=0, process_count=1)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("pipe") / "data")
  pp.preprocess(INPUTS, out, **KW)
  return out


@pytest.fixture
def copy_dir(data_dir, tmp_path):
  out = str(tmp_path / "copy")
  shutil.copytree(data_dir, out)
  return out


def shard_documents(data_dir, split="train"):
  """Documents as written, shard by shard in manifest order."""
  manifest = ip.load_manifest(data_dir)
  spec = {"tokens": tf.io.RaggedFeature(tf.int64)}
  docs = []
  for s in manifest["splits"][split]["shards"]:
    for r in tf.data.TFRecordDataset(os.path.join(data_dir, s["path"])):
      docs.append(tf.io.parse_example(r[None], spec)["tokens"][0].numpy().tolist())
  return docs


def rows_of(ds, limit=None):
  """Full rows (L+1 tokens) of every batch."""
  rows = []
  for i, b in enumerate(ds):
    if limit is not None and i >= limit:
      break
    rows.append(np.concatenate([b["inputs"].numpy(), b["targets"].numpy()[:, -1:]], axis=1))
  return np.concatenate(rows)


def split_docs(stream):
  """Splits a token stream at EOS (1) and drops padding (0)."""
  docs, cur = [], []
  for t in stream:
    if t == 0:
      continue
    cur.append(int(t))
    if t == 1:
      docs.append(tuple(cur))
      cur = []
  assert not cur, "stream does not end in EOS"
  return docs


def test_stream_equals_written_documents_in_order(data_dir):
  ds = ip.make_dataset(data_dir, "train", batch_size=2, seq_len=16, shuffle=False, repeat=False,
                       cycle_length=1, **ONE)
  rows = rows_of(ds)
  expected = [t for d in shard_documents(data_dir) for t in d]
  stream = rows.reshape(-1)
  assert stream[:len(expected)].tolist() == expected
  assert not stream[len(expected):].any()  # only padding after the last token


def test_batch_shapes_and_dtypes(data_dir):
  b = next(iter(ip.make_dataset(data_dir, "train", batch_size=3, seq_len=8, **ONE)))
  assert {k: (v.shape.as_list(), v.dtype) for k, v in b.items()} == {
      "inputs": ([3, 8], tf.int32), "targets": ([3, 8], tf.int32),
      "segment_ids": ([3, 8], tf.int32), "positions": ([3, 8], tf.int32),
      "weights": ([3, 8], tf.float32)}


def test_pack_features_hand_made_rows():
  rows = tf.constant([[7, 1, 5, 6, 1, 0],     # end of a doc, a whole doc, padding
                      [8, 9, 4, 1, 5, 1],     # continues a doc, then a one-token doc
                      [1, 1, 7, 7, 7, 7]])    # two EOS in a row (empty-ish docs)
  f = {k: v.numpy().tolist() for k, v in ip.pack_features(rows).items()}
  assert f["inputs"] == [[7, 1, 5, 6, 1], [8, 9, 4, 1, 5], [1, 1, 7, 7, 7]]
  assert f["targets"] == [[1, 5, 6, 1, 0], [9, 4, 1, 5, 1], [1, 7, 7, 7, 7]]
  assert f["segment_ids"] == [[1, 1, 2, 2, 2], [1, 1, 1, 1, 2], [1, 2, 3, 3, 3]]
  assert f["positions"] == [[0, 1, 0, 1, 2], [0, 1, 2, 3, 0], [0, 0, 0, 1, 2]]
  assert f["weights"] == [[1, 0, 1, 1, 0], [1, 1, 1, 0, 1], [0, 0, 1, 1, 1]]


def test_weights_never_cross_documents(data_dir):
  b = next(iter(ip.make_dataset(data_dir, "train", batch_size=4, seq_len=32, seed=3, **ONE)))
  seg, w = b["segment_ids"].numpy(), b["weights"].numpy()
  inputs, targets = b["inputs"].numpy(), b["targets"].numpy()
  assert np.all(w[inputs == 1] == 0) and np.all(w[targets == 0] == 0)
  # a weighted target is the next token of the same segment
  assert np.all((seg[:, 1:] == seg[:, :-1])[w[:, :-1] > 0])


def test_same_seed_same_batches_other_seed_differs(data_dir):
  make = lambda seed: rows_of(ip.make_dataset(data_dir, "train", batch_size=2, seq_len=8,
                                              seed=seed, shuffle_buffer=64, **ONE), limit=6)
  a, b, c = make(1), make(1), make(2)
  assert np.array_equal(a, b) and not np.array_equal(a, c)


@pytest.mark.parametrize("process_count", [2, 5])  # 3 shards: by file, and record-level fallback
def test_no_token_lost_or_duplicated_across_processes(data_dir, process_count):
  written = shard_documents(data_dir)
  docs, tokens = collections.Counter(), collections.Counter()
  for i in range(process_count):
    common = dict(batch_size=2, seq_len=8, repeat=False, process_index=i,
                  process_count=process_count)
    docs.update(split_docs(rows_of(ip.make_dataset(data_dir, "train", shuffle=False, **common))
                           .reshape(-1)))
    if process_count == 2:  # shuffled rows: the multiset of tokens
      shuffled = rows_of(ip.make_dataset(data_dir, "train", seed=i, **common)).reshape(-1)
      tokens.update(shuffled[shuffled != 0].tolist())
  assert docs == collections.Counter(map(tuple, written))
  if process_count == 2:
    assert tokens == collections.Counter(t for d in written for t in d)


def test_repeat_keeps_every_token_across_epochs(data_dir):
  written = [t for d in shard_documents(data_dir) for t in d]
  seq_len = 10
  n_rows = 2 * len(written) // (seq_len + 1) + 2
  ds = ip.make_dataset(data_dir, "train", batch_size=1, seq_len=seq_len, shuffle=False,
                       cycle_length=1, **ONE)
  stream = rows_of(ds, limit=n_rows).reshape(-1).tolist()
  assert stream[:2 * len(written)] == written + written


def test_validation_split_reads(data_dir):
  docs = split_docs(rows_of(ip.make_dataset(data_dir, "validation", batch_size=4, seq_len=16, shuffle=False,
                                            repeat=False, **ONE)).reshape(-1))
  assert collections.Counter(docs) == collections.Counter(map(tuple, shard_documents(data_dir, "validation")))


def test_iterator_checkpoint_restores_the_next_batch(data_dir, tmp_path):
  ds = ip.make_dataset(data_dir, "train", batch_size=2, seq_len=8, seed=5, shuffle_buffer=32, **ONE)
  it = iter(ds)
  for _ in range(3):
    next(it)
  ckpt = tf.train.Checkpoint(iterator=it)
  path = ckpt.write(str(tmp_path / "it"))
  expected = [next(it) for _ in range(3)]
  fresh = iter(ds)
  tf.train.Checkpoint(iterator=fresh).read(path).assert_consumed()
  for want in expected:
    got = next(fresh)
    assert all(np.array_equal(want[k].numpy(), got[k].numpy()) for k in want)


def test_prepacked_data_is_read_without_repacking(data_dir, tmp_path):
  packed = str(tmp_path / "packed")
  pp.preprocess(INPUTS, packed, **dict(KW, pack_length=17))
  common = dict(batch_size=2, shuffle=False, repeat=False, cycle_length=1, **ONE)
  manifest = ip.load_manifest(packed)
  written = []  # the packed rows, padding included
  for s in manifest["splits"]["train"]["shards"]:
    records = list(tf.data.TFRecordDataset(os.path.join(packed, s["path"])).batch(1000))[0]
    written += packing.parse_packed(records, 17, "uint16")[:, packing.TOKENS].numpy().reshape(-1).tolist()
  ds = ip.make_dataset(packed, "train", seq_len=16, **common)
  rows = rows_of(ds)
  assert rows.reshape(-1)[:len(written)].tolist() == written
  for b in ds:  # stored segment ids / positions equal the ones computed at runtime
    row = np.concatenate([b["inputs"].numpy(), b["targets"].numpy()[:, -1:]], axis=1)
    want = packing.pack_features(row)
    assert all(np.array_equal(b[k].numpy(), want[k].numpy()) for k in want)
  assert sorted(split_docs(rows.reshape(-1))) == sorted(map(tuple, shard_documents(data_dir)))
  # another seq_len repacks the same documents
  other = rows_of(ip.make_dataset(packed, "train", seq_len=8, **common))
  assert sorted(split_docs(other.reshape(-1))) == sorted(map(tuple, shard_documents(data_dir)))


def test_default_process_index_comes_from_jax(data_dir):
  b = next(iter(ip.make_dataset(data_dir, "train", batch_size=1, seq_len=4)))
  assert b["inputs"].shape == (1, 4)


# ---- bad input ----

def test_missing_data_dir_names_path(tmp_path):
  with pytest.raises(FileNotFoundError, match=str(tmp_path / "nope")):
    ip.load_manifest(str(tmp_path / "nope"))


def test_missing_manifest_names_path(tmp_path):
  with pytest.raises(FileNotFoundError, match=f"DATA_DIR '{tmp_path}' has no manifest.json"):
    ip.make_dataset(str(tmp_path), "train", batch_size=1, seq_len=4, **ONE)


def _edit_manifest(data_dir, fn):
  path = os.path.join(data_dir, "manifest.json")
  with open(path) as f:
    m = json.load(f)
  fn(m)
  with open(path, "w") as f:
    json.dump(m, f)


def test_missing_shard_is_named(copy_dir):
  os.remove(os.path.join(copy_dir, "train-00001-of-00003.tfrecord"))
  with pytest.raises(FileNotFoundError, match="train-00001-of-00003.tfrecord"):
    ip.load_manifest(copy_dir)


@pytest.mark.parametrize("bad", ["../elsewhere.tfrecord", "/etc/passwd", "a/../../x.tfrecord",
                                 "gs://bucket/x.tfrecord"])
def test_path_outside_data_dir_is_refused(copy_dir, bad):
  _edit_manifest(copy_dir, lambda m: m["splits"]["train"]["shards"][0].update(path=bad))
  with pytest.raises(ValueError, match="outside"):
    ip.load_manifest(copy_dir)


def test_tokenizer_hash_mismatch_fails_before_reading(copy_dir):
  _edit_manifest(copy_dir, lambda m: m.update(tokenizer_sha256="0" * 64))
  with pytest.raises(ValueError, match="tokenizer.model.*does not match"):
    ip.make_dataset(copy_dir, "train", batch_size=1, seq_len=4, **ONE)


def test_count_mismatch_fails_before_reading(copy_dir):
  _edit_manifest(copy_dir, lambda m: m["splits"]["train"].update(num_tokens=1))
  with pytest.raises(ValueError, match="num_tokens"):
    ip.load_manifest(copy_dir)


def _damage(path, truncate):
  data = bytearray(open(path, "rb").read())
  if truncate:
    data = data[:len(data) * 2 // 3]
  else:
    data[len(data) // 2] ^= 0xFF
  open(path, "wb").write(bytes(data))


def test_truncated_shard_is_named_before_training(copy_dir):
  _damage(os.path.join(copy_dir, "train-00002-of-00003.tfrecord"), truncate=True)
  with pytest.raises(ValueError, match="train-00002-of-00003.tfrecord.*truncated"):
    ip.make_dataset(copy_dir, "train", batch_size=1, seq_len=4, **ONE)


@pytest.mark.parametrize("truncate", [True, False])
def test_corrupt_shard_error_names_file_or_is_skipped(copy_dir, truncate):
  name = "train-00002-of-00003.tfrecord"
  full = len(shard_documents(copy_dir))
  _damage(os.path.join(copy_dir, name), truncate)
  common = dict(batch_size=1, seq_len=8, repeat=False, shuffle=False, verify="none", **ONE)
  with pytest.raises(tf.errors.InvalidArgumentError, match=name):
    rows_of(ip.make_dataset(copy_dir, "train", **common))
  skipped = split_docs(rows_of(ip.make_dataset(copy_dir, "train", on_corrupt="skip", **common))
                       .reshape(-1))
  assert 0 < len(skipped) < full


def test_release_frees_the_iterator_on_its_own_thread_once_the_caller_lets_go():
  """trainer.train hands its tf.data iterator to `release` before it returns: freeing one can wait for tf.data's
  autotuning thread (half a minute at the end of some demo runs), so the caller must not be the one that frees it,
  and the caller's own reference must still work until it drops it."""
  returned, freed = threading.Event(), {}

  class SlowToFree:  # stands in for an iterator whose teardown waits
    def __del__(self):
      freed["thread"] = threading.current_thread().name
      freed["after_the_caller_went_on"] = returned.wait(timeout=10)

  def both_recorded():
    for _ in range(1000):
      if len(freed) == 2:
        return dict(freed)
      time.sleep(0.01)
    return dict(freed)

  ip.release(SlowToFree())  # the caller holds nothing: freed off its thread while the caller goes on
  returned.set()
  alone = both_recorded()
  freed.clear()
  held = SlowToFree()
  ip.release(held)  # the caller still holds it: freed only once it lets go, and not by the caller
  time.sleep(0.05)
  assert not freed
  del held
  assert alone == both_recorded() == {"thread": "t5x_like-release-iterator", "after_the_caller_went_on": True}
