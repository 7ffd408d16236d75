"""Tests for t5x_like.preprocess: shards hold exactly the cleaned, tokenized input; cache; bad input."""

import collections
import json
import os

import numpy as np
import pytest
import tensorflow as tf

from t5x_like.data import input_pipeline as ip
from t5x_like.data import packing
from t5x_like.data import preprocessing as pp
from t5x_like.data import shard_writer
from t5x_like.data import text_cleaning
from t5x_like.data import tokenizer as tokenizer_lib
from t5x_like.data.text_cleaning import CleaningConfig
from tests import conftest
from tests.test_chat_data import chat_dir, raw, tok  # pylint: disable=unused-import  (fixtures of the CLI test)
from tests.test_quality import noisy_inputs  # pylint: disable=unused-import  (a fixture of the CLI test)

TESTDATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "testdata")
INPUTS = [os.path.join(TESTDATA, "sample.txt"), os.path.join(TESTDATA, "sample.jsonl")]
KW = dict(vocab_size=500, doc_split="blank_line", num_train_shards=3, validation_fraction=0.2,
          num_workers=1, progress=False)


def read_records(path):
  spec = {"tokens": tf.io.RaggedFeature(tf.int64)}
  return [tf.io.parse_example(r[None], spec)["tokens"][0].numpy().tolist()
          for r in tf.data.TFRecordDataset(path)]


def shard_records(data_dir, split=None):
  with open(os.path.join(data_dir, "manifest.json")) as f:
    manifest = json.load(f)
  out = {}
  for name, entry in manifest["splits"].items():
    if split in (None, name):
      for s in entry["shards"]:
        out[s["path"]] = read_records(os.path.join(data_dir, s["path"]))
  return manifest, out


def expected_documents(data_dir):
  """Tokenizes the inputs independently of preprocess: the documents + EOS it must have written."""
  tok = tokenizer_lib.Tokenizer.load(os.path.join(data_dir, "tokenizer.model"))
  with open(INPUTS[0]) as f:
    docs = [d for d in f.read().split("\n\n") if d.strip()]
  with open(INPUTS[1]) as f:
    docs += [json.loads(line)["text"] for line in f]
  docs = [d.strip("\n") + ("\n" if d.endswith("\n") else "") for d in docs]
  return collections.Counter(tuple(tok.encode(d) + [tok.eos_id]) for d in docs)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("prep") / "data")
  report = pp.preprocess(INPUTS, out, **KW)
  return out, report


def test_layout_and_manifest(data_dir):
  out, report = data_dir
  names = sorted(os.listdir(out))
  assert "manifest.json" in names and "tokenizer.model" in names
  assert [n for n in names if n.endswith(".tfrecord")] == [
      "train-00000-of-00003.tfrecord", "train-00001-of-00003.tfrecord",
      "train-00002-of-00003.tfrecord", "validation-00000-of-00001.tfrecord"]
  manifest, records = shard_records(out)
  assert manifest["format_version"] == 1 and manifest["tokenizer"] == "tokenizer.model"
  assert (manifest["pad_id"], manifest["eos_id"], manifest["bos_id"]) == (0, 1, 3)
  assert manifest["tokenizer_sha256"] == tokenizer_lib.Tokenizer.load(
      os.path.join(out, "tokenizer.model")).sha256
  for entry in manifest["splits"].values():
    for s in entry["shards"]:
      docs = records[s["path"]]
      assert s["num_documents"] == s["num_records"] == len(docs)
      assert s["num_tokens"] == sum(map(len, docs))
      assert s["sha256"] == shard_writer.file_sha256(os.path.join(out, s["path"]))
  assert report["documents_in"] == report["documents_out"] == 18
  assert manifest["splits"]["validation"]["num_documents"] >= 1


def test_shards_hold_exactly_the_tokenized_documents(data_dir):
  out, _ = data_dir
  _, records = shard_records(out)
  written = collections.Counter(tuple(d) for docs in records.values() for d in docs)
  assert written == expected_documents(out)
  for docs in records.values():  # exactly one EOS per document, at its end
    assert all(d[-1] == 1 and 1 not in d[:-1] for d in docs)


def test_cache_hit_does_no_tokenization_and_changed_input_is_redone(tmp_path):
  out = str(tmp_path / "c")
  assert pp.preprocess(INPUTS, out, **KW)["documents_tokenized"] == 18
  manifest, _ = shard_records(out)
  again = pp.preprocess(INPUTS, out, **KW)
  assert again["documents_tokenized"] == 0 and again["cache_hits"] == 2
  manifest2, _ = shard_records(out)
  assert manifest2["splits"] == manifest["splits"]
  changed = tmp_path / "sample.jsonl"
  changed.write_text(open(INPUTS[1]).read() + json.dumps({"text": "A brand new line."}) + "\n")
  # A changed input retrains the tokenizer (so re-tokenizes all); with a fixed tokenizer only the
  # changed input is redone.
  fixed = str(tmp_path / "fixed.model")
  tokenizer_lib.Tokenizer.load(os.path.join(out, "tokenizer.model")).save(fixed)
  third = pp.preprocess([INPUTS[0], str(changed)], out, **dict(KW, tokenizer=fixed))
  assert third["cache_hits"] == 1 and third["documents_tokenized"] == 7
  assert third["documents_out"] == 19


def test_parallel_workers_write_identical_shards(data_dir, tmp_path):
  out, _ = data_dir
  par = str(tmp_path / "par")
  pp.preprocess(INPUTS, par, **dict(KW, num_workers=2, cache_dir=None))
  assert shard_records(par)[0]["splits"] == shard_records(out)[0]["splits"]


def test_interrupted_write_leaves_no_manifest(data_dir, tmp_path, monkeypatch):
  out = str(tmp_path / "d")
  pp.preprocess(INPUTS, out, **KW)
  calls = []

  def failing(*args, **kwargs):
    calls.append(1)
    if len(calls) == 2:
      raise KeyboardInterrupt
    return original(*args, **kwargs)

  original = shard_writer.write_shard
  monkeypatch.setattr(shard_writer, "write_shard", failing)
  with pytest.raises(KeyboardInterrupt):
    pp.preprocess(INPUTS, out, **dict(KW, seed=1))
  assert not os.path.exists(os.path.join(out, "manifest.json"))
  assert not [n for n in os.listdir(out) if ".tmp-" in n]


def test_prepacked_rows_hold_the_same_stream(data_dir, tmp_path):
  out, _ = data_dir
  packed = str(tmp_path / "packed")
  pp.preprocess(INPUTS, packed, **dict(KW, pack_length=33))
  _, docs = shard_records(out, "train")
  with open(os.path.join(packed, "manifest.json")) as f:
    manifest = json.load(f)
  assert manifest["packed_length"] == 33 and manifest["packed_dtype"] == "uint16"
  assert manifest["record_format"] == "raw_rows"
  for name in docs:
    stream = [t for d in docs[name] for t in d]
    records = list(tf.data.TFRecordDataset(os.path.join(packed, name)).batch(1000))[0]
    rows = packing.parse_packed(records, 33, "uint16")  # (R, 3, 33)
    flat = rows[:, packing.TOKENS].numpy().reshape(-1).tolist()
    assert flat[:len(stream)] == stream and set(flat[len(stream):]) <= {0}
    assert len(flat) - len(stream) < 33
    assert np.array_equal(rows.numpy(), packing.segment_rows(rows[:, packing.TOKENS]).numpy())


def test_plan_shards_is_balanced_and_seeded():
  lengths = np.random.default_rng(0).integers(1, 100, size=500)
  plan = shard_writer.plan_shards(lengths, 8, seed=3)
  sizes = [lengths[p].sum() for p in plan]
  assert max(sizes) - min(sizes) <= lengths.max()
  assert sorted(i for p in plan for i in p) == list(range(500))
  assert plan == shard_writer.plan_shards(lengths, 8, seed=3)
  assert plan != shard_writer.plan_shards(lengths, 8, seed=4)


def test_cleaning_rules_are_applied_and_counted():
  c = collections.Counter()
  cfg = CleaningConfig(min_chars=5)  # strip_html="auto": HTML by content below, the rest untouched by it
  assert text_cleaning.clean_text("<p>cafe\u0301 &amp; tea</p><script>x()</script>\r\n",
                                  CleaningConfig(strip_html=True, min_chars=5), c) == "caf\u00e9 & tea\n"
  assert text_cleaning.clean_text("a\x00b\u200bc\u00a0d   \n\n\n\n\ne", cfg, c) == "abc d\n\n\ne"
  assert text_cleaning.clean_text("tiny", cfg, c) is None
  assert text_cleaning.clean_text(" \n\t", cfg, c) is None
  assert (c["changed_strip_html"], c["changed_unicode"], c["changed_control_chars"]) == (1, 1, 1)
  # the HTML parser already turned the first one's \r\n into \n: whitespace changed the second and third
  assert (c["changed_whitespace"], c["dropped_min_chars"], c["dropped_empty"]) == (2, 1, 1)
  assert text_cleaning.clean_text("  keep\n    indentation\n", CleaningConfig(), c) == \
      "keep\n    indentation\n"


def test_non_utf8_bytes_are_replaced_or_dropped_and_counted(tmp_path):
  bad = tmp_path / "bad.txt"
  bad.write_bytes(b"caf\xe9 and \xff\xfe bytes\n\nclean paragraph here\n")
  raw = bad.read_bytes()
  rep = text_cleaning.process_file(raw, "text", CleaningConfig(), "blank_line")
  assert rep.counts["invalid_utf8_bytes"] == 3 and rep.counts["documents_with_invalid_utf8"] == 1
  assert len(rep.lengths) == 2
  drop = text_cleaning.process_file(raw, "text", CleaningConfig(non_utf8="drop"), "blank_line")
  assert drop.counts["dropped_non_utf8"] == 1 and len(drop.lengths) == 1
  out = str(tmp_path / "out")
  report = pp.preprocess([str(bad), INPUTS[0]], out, **KW)
  assert report["invalid_utf8_bytes"] == 3
  tok = tokenizer_lib.Tokenizer.load(os.path.join(out, "tokenizer.model"))
  texts = [tok.decode(d) for docs in shard_records(out)[1].values() for d in docs]
  assert "caf\ufffd and \ufffd\ufffd bytes\n" in texts or "caf\ufffd and \ufffd\ufffd bytes" in texts


def test_duplicates_and_bad_json_lines_are_counted(tmp_path):
  f = tmp_path / "d.jsonl"
  f.write_text('{"text": "same words here"}\nnot json\n{"other": 1}\n{"text": "same words here"}\n'
               '{"text": "different words"}\n')
  report = pp.preprocess([str(f)], str(tmp_path / "o"), **dict(KW, validation_fraction=0.0))
  assert report["dropped"] == {"bad_json": 1, "duplicate": 1, "missing_field": 1}
  assert report["documents_in"] == 5 and report["documents_out"] == 2


def test_empty_glob_is_an_error_naming_it(tmp_path):
  with pytest.raises(ValueError, match="nothing-here"):
    pp.preprocess([str(tmp_path / "nothing-here*.txt")], str(tmp_path / "o"), **KW)


@pytest.mark.slow  # the one CLI launch of the data tests (~10 s)
def test_cli_chat_quality_filters_and_bad_input(chat_dir, raw, noisy_inputs, corpus, tmp_path):
  """`python -m t5x_like.preprocess`, three runs one after another in one process (conftest.launch_each):
  chat: a gin-bound ChatTemplate field and --tokenizer=DATA_DIR reach the manifest; a malformed line is named
  and counted, the run exits 0;
  quality: --quality_filters, --near_dedup, --near_dedup_threshold and a gin-bound QualityConfig limit, end to end;
  bad input: an --input that matches no file is a one-line error (no traceback), a nonzero exit status."""
  out, _ = chat_dir
  gin = tmp_path / "template.gin"
  gin.write_text("data.ChatTemplate.default_system = 'answer briefly'\n")
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"prompt": "x"}\n')
  (tmp_path / "none").mkdir()
  runs = [["--format=chat", f"--input={raw[2]}", f"--input={bad}", f"--output_dir={tmp_path / 'chat'}",
           f"--tokenizer={out}", f"--gin_file={gin}", "--validation_fraction=0"],
          [f"--input={noisy_inputs[0]}", f"--input={noisy_inputs[1]}", f"--output_dir={tmp_path / 'quality'}",
           f"--tokenizer={corpus}", "--quality_filters", "--near_dedup", "--near_dedup_threshold=0.7",
           "--num_workers=1", "--gin.data.QualityConfig.max_digit_ratio=1.0", "--validation_fraction=0"],
          [f"--input={tmp_path}/none/none*", f"--output_dir={tmp_path}/none/o"]]
  chat_run, quality_run, bad_run = conftest.launch_each("t5x_like.preprocess", runs,
                                                         env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
  assert chat_run.returncode == 0, chat_run.stderr[-2000:]
  assert quality_run.returncode == 0, quality_run.stderr[-2000:]
  chat_out, quality_out = chat_run.stdout, quality_run.stdout

  assert f"{bad}:1: wrong_shape: missing key 'completion'" in chat_out
  assert "malformed_wrong_shape=1" in chat_out
  manifest = ip.load_manifest(str(tmp_path / "chat"))
  assert manifest["chat_template"]["default_system"] == "answer briefly"  # MULTI_TURN has its own system turn

  dropped = [line for line in quality_out.splitlines() if line.startswith("| dropped |")]
  assert dropped == ["| dropped | duplicate=3, near_duplicate=10, symbol_ratio=1 |"]  # any share of digits allowed
  cleaning = json.load(open(tmp_path / "quality" / "manifest.json"))["cleaning"]
  assert cleaning["near_dedup"]["threshold"] == 0.7 and cleaning["quality"]["max_digit_ratio"] == 1.0
  assert cleaning["strip_html"] == "auto"

  assert bad_run.returncode != 0
  assert "Traceback" not in bad_run.stderr
  assert bad_run.stderr.strip().splitlines()[-1] == \
      f"preprocess: error: --input '{tmp_path}/none/none*' matches no file"
