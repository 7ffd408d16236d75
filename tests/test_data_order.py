"""Easy-to-hard document order (preprocess --order_by): written sorted, read back in order, exact resume."""

import json
import os

import numpy as np
import pytest
import tensorflow as tf

from t5x_like.data import chat
from t5x_like.data import input_pipeline as ip
from t5x_like.data import ordering
from t5x_like.data import preprocessing as pp
from t5x_like.data import text_cleaning
from t5x_like.data import tokenizer as tokenizer_lib
from t5x_like.model import decoder as model_lib
from t5x_like.parallel import global_batch
from t5x_like.training import config as config_lib
from t5x_like import data as data_lib
from t5x_like.recipes import experiment as experiment_lib
from t5x_like.training import optimizer as optimizer_lib

WORDS = ["the trainer", "a shard", "the mesh", "reads", "writes", "tokens", "batches", "records"]
KW = dict(num_train_shards=4, validation_fraction=0.1, num_workers=1, progress=False, cache_dir=None)
SEQ = 15  # rows of 16 tokens


def write_lines(path, rows):
  with open(path, "w", encoding="utf-8") as f:
    f.write("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
  """60 JSON-lines documents of 1..12 phrases with a 'difficulty' unrelated to their length, in 2 files."""
  rng = np.random.default_rng(0)
  root = tmp_path_factory.mktemp("order_raw")
  rows = [{"text": f"{i} " + " ".join(rng.choice(WORDS, size=int(rng.integers(1, 13)))),
           "difficulty": float(rng.integers(0, 7)) / 2} for i in range(60)]
  return [write_lines(root / "a.jsonl", rows[:30]), write_lines(root / "b.jsonl", rows[30:])], rows


@pytest.fixture(scope="module")
def tok_path(corpus):
  return corpus  # the session DATA_DIR's tokenizer


@pytest.fixture(scope="module")
def dirs(raw, tok_path, tmp_path_factory):
  """{order_by: (DATA_DIR, report)} of the same inputs."""
  root = tmp_path_factory.mktemp("order_dirs")
  out = {}
  for by in ("length", "field:difficulty", "none"):
    d = str(root / by.replace(":", "_"))
    out[by] = d, pp.preprocess(raw[0], d, tokenizer=tok_path, order_by=by, **KW)
  return out


@pytest.fixture(scope="module")
def score_of(raw, tok_path):
  """{token ids of a document (EOS included): (its difficulty, its content hash)}."""
  tok = tokenizer_lib.load(os.path.join(tok_path, "tokenizer.model"))
  return {tuple(tok.encode(r["text"]) + [tok.eos_id]): (r["difficulty"], text_cleaning.content_hash(r["text"]))
          for r in raw[1]}


def manifest(data_dir):
  return ip.load_manifest(data_dir)


def batches(data_dir, n=None, **kw):
  args = dict(batch_size=2, seq_len=SEQ, shuffle=True, repeat=False, process_index=0, process_count=1)
  ds = ip.make_dataset(data_dir, "train", **dict(args, **kw))
  return [{k: v.numpy() for k, v in b.items()} for b in (ds.take(n) if n else ds)]


def stream_documents(bs, pad_id, eos_id):
  """The documents in read order: text rows are cut from the document stream, so their tokens back to
  back (padding removed) are that stream; split after each EOS."""
  rows = [np.concatenate([b["inputs"][i], b["targets"][i, -1:]]) for b in bs for i in range(len(b["inputs"]))]
  stream = np.concatenate(rows)
  stream = stream[stream != pad_id].tolist()
  docs, cur = [], []
  for t in stream:
    cur.append(t)
    if t == eos_id:
      docs.append(tuple(cur))
      cur = []
  return docs, cur


@pytest.fixture(scope="module")
def length_epoch(dirs):
  """One epoch of the length-ordered DATA_DIR as the trainer reads it (shuffle=True): (batches, documents)."""
  d, _ = dirs["length"]
  m = manifest(d)
  bs = batches(d)
  return bs, stream_documents(bs, m["pad_id"], m["eos_id"])[0]


def train_documents(data_dir):
  """The train split's documents, read shard by shard from the records (order not implied)."""
  m = manifest(data_dir)
  spec = {"tokens": tf.io.RaggedFeature(tf.int64)}
  return sorted(tuple(tf.io.parse_example(r[None], spec)["tokens"][0].numpy().tolist())
                for s in m["splits"]["train"]["shards"]
                for r in tf.data.TFRecordDataset(os.path.join(data_dir, s["path"])))


def test_length_order_reads_back_ascending(dirs, length_epoch):
  d, report = dirs["length"]
  m = manifest(d)
  assert m["order"] == {"by": "length", "ascending": True, "splits": ["train"]}
  docs = length_epoch[1]
  assert sorted(docs) == train_documents(d)  # every train document once
  lengths = [len(x) for x in docs]
  assert lengths == sorted(lengths) and lengths[0] < lengths[-1]
  assert report["order"] == {"by": "length", "train_first": lengths[0], "train_last": lengths[-1]}
  # the validation split keeps the seeded plan and is not listed as ordered
  assert ip.ordered_splits(m) == ("train",)


def test_field_order_from_json_lines(dirs, score_of, length_epoch):
  d, _ = dirs["field:difficulty"]
  m = manifest(d)
  assert m["order"]["by"] == "field:difficulty"
  docs, _ = stream_documents(batches(d), m["pad_id"], m["eos_id"])
  keys = [score_of[x] for x in docs]  # (difficulty, content hash): ties broken by the hash
  assert keys == sorted(keys) and len({k[0] for k in keys}) > 3 and len(keys) > len({k[0] for k in keys})
  # field order is not length order: the same documents, another sequence
  assert sorted(length_epoch[1]) == sorted(docs) and length_epoch[1] != docs


def test_each_stream_reads_its_part_in_order_at_the_same_pace(dirs):
  """3 streams over 4 shards: each reads every shard, keeping every third record (see host_shards)."""
  d, _ = dirs["length"]
  streams = 3
  m = manifest(d)
  ordered = train_documents(d)
  ordered.sort(key=len)
  per_stream = []
  for s in range(streams):
    docs, _ = stream_documents(batches(d, process_index=s, process_count=streams), m["pad_id"], m["eos_id"])
    assert [len(x) for x in docs] == sorted(len(x) for x in docs)
    per_stream.append(docs)
  assert sorted(x for docs in per_stream for x in docs) == sorted(ordered)
  sizes = [len(x) for x in per_stream]
  assert max(sizes) - min(sizes) <= 4  # at most one record per shard apart


def test_order_repeats_each_epoch(dirs, length_epoch):
  d, _ = dirs["length"]
  m = manifest(d)
  one = length_epoch[1]
  rows_per_epoch = sum(len(x) for x in one) // (SEQ + 1) + 2
  docs, _ = stream_documents(batches(d, n=rows_per_epoch + 4, repeat=True), m["pad_id"], m["eos_id"])
  assert docs[:len(one)] == one and docs[len(one):2 * len(one)] == one[:len(docs) - len(one)]
  assert len(docs) > len(one) + 3


def test_iterator_restore_gives_the_identical_continuation(dirs, tmp_path):
  """Two streams zipped as the trainer does (process_rows), with a local window, saved after 3 batches,
  restored in a fresh one."""
  d, _ = dirs["field:difficulty"]

  def make():
    def stream(stream_index, num_streams, batch_size):
      return ip.make_dataset(d, "train", batch_size=batch_size, seq_len=SEQ, shuffle=True, repeat=True,
                             process_index=stream_index, process_count=num_streams, order_window=4)
    return iter(global_batch.process_rows(stream, num_streams=2, global_batch_size=4, process_index=0,
                                          process_count=1))
  it = make()
  for _ in range(3):
    next(it)
  path = tf.train.Checkpoint(iterator=it).write(str(tmp_path / "it"))
  expected = [next(it)["inputs"].numpy() for _ in range(25)]  # past the end of the first epoch
  fresh = make()
  tf.train.Checkpoint(iterator=fresh).read(path).assert_consumed()
  got = [next(fresh)["inputs"].numpy() for _ in range(25)]
  np.testing.assert_array_equal(np.stack(got), np.stack(expected))


def test_local_window_permutes_rows_only_within_it(dirs, length_epoch):
  d, _ = dirs["length"]
  strict = np.concatenate([b["inputs"] for b in length_epoch[0][:8]])
  local = np.concatenate([b["inputs"] for b in batches(d, n=8, order_window=4)])
  assert not np.array_equal(strict, local)
  for i in range(0, 16, 4):  # the same rows in each block of 4, in another order
    assert sorted(map(tuple, strict[i:i + 4])) == sorted(map(tuple, local[i:i + 4]))
  unshuffled = np.concatenate([b["inputs"] for b in batches(d, n=8, shuffle=False, order_window=4)])
  np.testing.assert_array_equal(unshuffled, strict)  # shuffle=False: no window


def test_prepacked_ordered_rows_come_back_in_order(raw, tok_path, tmp_path):
  d = str(tmp_path / "packed")
  pp.preprocess(raw[0], d, tokenizer=tok_path, order_by="length", pack_length=SEQ + 1, **KW)
  m = manifest(d)
  for seq in (SEQ, 9):  # read as stored, and repacked to another length
    docs, _ = stream_documents(batches(d, seq_len=seq), m["pad_id"], m["eos_id"])
    assert [len(x) for x in docs] == sorted(len(x) for x in docs)
    assert len(docs) == m["splits"]["train"]["num_documents"]


def test_chat_field_order_keeps_conversations_whole_and_sorted(tok_path, tmp_path):
  rng = np.random.default_rng(1)
  rows = [{"prompt": f"q{i} " + " ".join(rng.choice(WORDS, size=int(rng.integers(1, 5)))),
           "completion": " ".join(rng.choice(WORDS, size=int(rng.integers(1, 5)))), "level": int(rng.integers(0, 50))}
          for i in range(24)]
  src = write_lines(tmp_path / "sft.jsonl", rows)
  d = str(tmp_path / "sft")
  pp.preprocess([src], d, data_format="chat", tokenizer=tok_path, order_by="field:level", **KW)
  m = manifest(d)
  enc = chat.ChatEncoder(tokenizer_lib.load(os.path.join(tok_path, "tokenizer.model")))
  level = {tuple(enc.render(chat.parse_conversation(r)).ids.tolist()): r["level"] for r in rows}
  docs = []
  for b in batches(d, seq_len=63):
    for i in range(len(b["inputs"])):
      row, seg = np.append(b["inputs"][i], b["targets"][i, -1]), np.append(b["segment_ids"][i], -1)
      docs += [tuple(row[seg == s].tolist()) for s in range(1, seg.max() + 1)]
  scores = [level[x] for x in docs]
  assert scores == sorted(scores) and len(docs) == m["splits"]["train"]["num_documents"]


@pytest.mark.parametrize("data_format", ["text", "chat"])
@pytest.mark.parametrize("value,message", [
    (None, "the line has no field 'difficulty'"),
    ("hard", "'difficulty' is 'hard', not a finite number"),
    (True, "'difficulty' is True, not a finite number")])
def test_bad_field_is_one_line_error_naming_file_and_line(tok_path, tmp_path, data_format, value, message):
  key = "text" if data_format == "text" else "prompt"
  rows = [{key: "the trainer reads", "completion": "tokens", "difficulty": 1}] * 2
  bad = {key: "a shard writes", "completion": "records"}
  if value is not None:
    bad["difficulty"] = value
  src = write_lines(tmp_path / "bad.jsonl", rows + [{"other": 1}, bad])  # line 3: no text, skipped
  with pytest.raises(ValueError) as e:
    pp.preprocess([src], str(tmp_path / "o"), tokenizer=tok_path, data_format=data_format,
                  order_by="field:difficulty", **KW)
  assert str(e.value) == f"{src}:4: --order_by=field:difficulty: {message}"


def test_bad_order_by_and_plain_text_field_are_errors(tok_path, tmp_path):
  (tmp_path / "a.txt").write_text("the trainer reads tokens\n")
  with pytest.raises(ValueError, match=r"--order_by='size' must be 'none', 'length' or 'field:NAME'"):
    pp.preprocess([str(tmp_path / "a.txt")], str(tmp_path / "o"), tokenizer=tok_path, order_by="size", **KW)
  with pytest.raises(ValueError, match=r"--order_by=field:x needs JSON-lines input: --input file '.*a\.txt'"):
    pp.preprocess([str(tmp_path / "a.txt")], str(tmp_path / "o"), tokenizer=tok_path, order_by="field:x", **KW)


def test_unordered_data_dir_is_unchanged(dirs, raw, tok_path, tmp_path):
  """order_by none: the same shards as without the option, no "order" in the manifest, the seeded
  shuffle as before (order_window has no effect), shards dealt to readers as before."""
  d, _ = dirs["none"]
  default = str(tmp_path / "default")
  pp.preprocess(raw[0], default, tokenizer=tok_path, **KW)
  m, m_default = manifest(d), manifest(default)
  assert "order" not in m and ip.ordered_splits(m) == ()
  assert [s["sha256"] for s in m["splits"]["train"]["shards"]] == \
         [s["sha256"] for s in m_default["splits"]["train"]["shards"]]
  shuffled = batches(d)
  np.testing.assert_array_equal(np.concatenate([b["inputs"] for b in shuffled]),
                                np.concatenate([b["inputs"] for b in batches(d, order_window=3)]))
  docs, _ = stream_documents(shuffled, m["pad_id"], m["eos_id"])
  assert [len(x) for x in docs] != sorted(len(x) for x in docs)
  shards, record_shard = ip.host_shards(m, d, "train", 1, 3)
  assert record_shard is None and [os.path.basename(p) for p, _ in shards] == ["train-00001-of-00004.tfrecord"]
  shards, record_shard = ip.host_shards(manifest(dirs["length"][0]), d, "train", 1, 3)
  assert record_shard == (3, 1) and len(shards) == 4  # ordered: record-level when 3 streams do not divide 4 shards
  shards, record_shard = ip.host_shards(manifest(dirs["length"][0]), d, "train", 1, 2)
  assert record_shard is None and [os.path.basename(p) for p, _ in shards] == \
      ["train-00001-of-00004.tfrecord", "train-00003-of-00004.tfrecord"]


def test_sorted_indices_and_parse_order_by():
  np.testing.assert_array_equal(ordering.sorted_indices([3.0, 1.0, 3.0], [b"\x02" * 16, b"\x09" * 16, b"\x01" * 16]),
                                [1, 2, 0])
  assert ordering.parse_order_by("none") is None and ordering.parse_order_by("") is None
  assert ordering.parse_order_by("field:level").field == "level" and ordering.parse_order_by("length").field is None
  with pytest.raises(ValueError, match="'field:'"):
    ordering.parse_order_by("field:")


def _experiment(data_dir, order_window=0):
  """An Experiment of a one-layer model over `data_dir` (batches of 8 rows of SEQ tokens)."""
  tiny = model_lib.GPTConfig(num_layers=1, num_heads=2, d_model=16, d_ff=32, max_len=16, dtype="float32")
  config = config_lib.TrainConfig(model_dir="unused", data_dir=data_dir, train_steps=1, batch_size=8, seq_len=SEQ,
                                  mesh_shape={"data": -1},
                                  data=data_lib.DataConfig(shuffle_buffer=64, order_window=order_window))
  return experiment_lib.Experiment(config, tiny, optimizer_lib.OptimizerConfig())


@pytest.mark.slow  # fast subset: the developer loop; CI runs it
def test_trainer_reads_the_order_and_its_window(dirs):
  """Experiment.dataset (what the trainer iterates) keeps the order; DataConfig.order_window reaches the pipeline."""
  d, _ = dirs["length"]
  for window in (0, 4):
    exp = _experiment(d, window)
    got = [b["inputs"].numpy() for b in exp.dataset("train", shuffle=True, repeat=False).take(3)]
    want = [b["inputs"] for b in batches(d, n=3, batch_size=8, order_window=window)]
    np.testing.assert_array_equal(np.stack(got), np.stack(want))
  assert not np.array_equal(got, [b["inputs"] for b in batches(d, n=3, batch_size=8)])


def test_a_runs_training_pipeline_is_built_once_and_each_iteration_starts_afresh(dirs, monkeypatch):
  """validate() builds the pipeline train() reads (its checks, and its tf.data functions traced once per run);
  each iter() of it starts from the first batch."""
  exp = _experiment(dirs["length"][0])
  built = []
  make = ip.make_dataset
  monkeypatch.setattr(ip, "make_dataset", lambda *a, **k: built.append(k) or make(*a, **k))
  exp.validate()
  ds = exp.dataset("train", shuffle=True, repeat=True)
  assert len(built) == 1 and built[0]["shuffle"] and built[0]["repeat"]
  first, again = ([b["inputs"].numpy() for b in ds.take(2)] for _ in range(2))
  np.testing.assert_array_equal(np.stack(first), np.stack(again))
