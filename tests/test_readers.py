"""preprocess input formats (data/readers.py): compressed JSON lines, Parquet, datasets folders, HTML; bad input."""

import collections
import gzip
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from t5x_like.data import html_text
from t5x_like.data import preprocessing as pp
from t5x_like.data import shard_writer
from t5x_like.data import text_cleaning
from t5x_like.data import tokenizer as tokenizer_lib
from t5x_like.data.text_cleaning import CleaningConfig
from tests.test_preprocess import shard_records

TEXTS = [f"document {i}: the trainer reads {i} shards and writes {i * 3} records." for i in range(12)]
KW = dict(num_train_shards=1, validation_fraction=0.0, num_workers=1, progress=False, cache_dir=None)


def write_formats(root, texts):
  """The same documents as .jsonl.gz, .jsonl.zst, .parquet and a datasets.save_to_disk folder (3 each)."""
  lines = lambda part: "".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(part)).encode()
  (root / "a.jsonl.gz").write_bytes(gzip.compress(lines(texts[0:3])))
  (root / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines(texts[3:6])))
  pq.write_table(pa.table({"id": [6, 7, 8], "text": texts[6:9]}), root / "c.parquet")
  folder = root / "d_dataset"  # the layout datasets.Dataset.save_to_disk writes: Arrow stream file(s) + state.json
  folder.mkdir()
  table = pa.table({"text": texts[9:12], "id": [9, 10, 11]})
  with pa.ipc.new_stream(str(folder / "data-00000-of-00001.arrow"), table.schema) as w:
    w.write_table(table)
  (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}],
                                                 "_split": "train"}))
  (folder / "dataset_info.json").write_text("{}")
  return [str(root / n) for n in ("a.jsonl.gz", "b.jsonl.zst", "c.parquet", "d_dataset")]


def decoded_documents(data_dir):
  tok = tokenizer_lib.Tokenizer.load(os.path.join(data_dir, "tokenizer.model"))
  return sorted(tok.decode(d[:-1]) for docs in shard_records(data_dir)[1].values() for d in docs)


def test_every_format_yields_its_documents(corpus, tmp_path):
  inputs = write_formats(tmp_path, TEXTS)
  assert [pp.input_kind(f) for f in inputs] == ["jsonl", "jsonl", "parquet", "hf_dataset"]
  report = pp.preprocess([str(tmp_path / "*")], str(tmp_path / "out"), tokenizer=corpus, **KW)
  assert report["documents_in"] == 12 and report["documents_out"] == 12
  assert decoded_documents(str(tmp_path / "out")) == sorted(TEXTS)


def test_corrupt_file_is_named_and_skipped_missing_column_is_an_error(corpus, tmp_path):
  root = tmp_path / ("a_folder_with_a_long_name_" * 6)  # the report names the file however long its path
  root.mkdir()
  inputs = write_formats(root, TEXTS)
  good = open(inputs[0], "rb").read()
  (root / "broken.jsonl.gz").write_bytes(good[:len(good) // 2])  # truncated gzip
  report = pp.preprocess([str(root / "*")], str(tmp_path / "out"), tokenizer=corpus, **KW)
  assert report["dropped"]["corrupt_input"] == 1 and report["documents_out"] == 12  # the rest unaffected
  assert f"'{root / 'broken.jsonl.gz'}'" in report["filter_examples"]["corrupt_input"][0]
  pq.write_table(pa.table({"body": ["x"]}), tmp_path / "nocol.parquet")
  with pytest.raises(ValueError, match=r"Input '.*nocol.parquet' has no column 'text' \(--text_field\); its columns: body"):
    pp.preprocess([str(tmp_path / "nocol.parquet")], str(tmp_path / "o2"), tokenizer=corpus, **KW)
  (tmp_path / "nofield.jsonl").write_text('{"body": "x"}\n')
  with pytest.raises(ValueError, match=r"nofield.jsonl': no JSON line has the text field 'text'"):
    pp.preprocess([str(tmp_path / "nofield.jsonl")], str(tmp_path / "o3"), tokenizer=corpus, **KW)
  (root / "empty.txt").write_text("")
  with pytest.raises(ValueError, match=r"No documents left .*empty_input.*a_long_name_/empty.txt"):
    pp.preprocess([str(root / "empty.txt")], str(tmp_path / "o4"), tokenizer=corpus, **KW)


def test_html_is_cleaned_by_default_code_is_untouched(corpus, tmp_path):
  page = ("<!DOCTYPE html><html><head><title>t</title><style>div{}</style></head><body><div>Shards are "
          "<b>balanced</b>.</div><script>track()</script><p>List&lt;String&gt; stays</p></body></html>")
  (tmp_path / "page.html").write_text(page)
  code = "List<String> names = new ArrayList<String>();\nif (a < b && c > d) { return; }\n"
  (tmp_path / "Code.java").write_text(code)
  report = pp.preprocess([str(tmp_path / "page.html"), str(tmp_path / "Code.java")], str(tmp_path / "out"),
                         tokenizer=corpus, **KW)
  assert report["changed"]["strip_html"] == 1
  assert decoded_documents(str(tmp_path / "out")) == sorted(["Shards are balanced.\n\nList<String> stays", code])
  counts = collections.Counter()  # by content, in a plain-text or JSON-lines input too; never code
  assert text_cleaning.clean_text("<div><p>a</p><p>b</p><span>c</span></div>", CleaningConfig(), counts) == "a\n\nb\nc"
  assert not html_text.looks_like_html(code) and not html_text.looks_like_html("x = a<b> c </b>")
  template = 'ROW = """<tr><td>%s</td><td>%s</td></tr>"""\nPAGE = "<div>%s</div>"\n'  # code holding HTML
  assert not html_text.looks_like_html(template)
  keep = text_cleaning.clean_text(page, CleaningConfig(strip_html="never"), counts)
  assert "<script>" in keep


def test_small_corpus_gets_the_stated_validation_minimum(corpus, tmp_path):
  texts = [f"licence text number {i} with its own clause about {i * 7} parties." for i in range(220)]
  (tmp_path / "l.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
  kw = dict(KW, validation_fraction=0.01)
  report = pp.preprocess([str(tmp_path / "l.jsonl")], str(tmp_path / "out"), tokenizer=corpus, **kw)
  assert report["validation_minimum"] == {"documents": 16, "tokens": 8192, "max_fraction": 0.1}
  assert report["validation"]["num_documents"] == 22  # capped at 10% of 220 before 8192 tokens
  bare = pp.preprocess([str(tmp_path / "l.jsonl")], str(tmp_path / "bare"), tokenizer=corpus,
                       min_validation_documents=0, min_validation_tokens=0, **kw)
  assert bare["validation"]["num_documents"] < 6 and "validation_minimum" not in bare
  assert shard_writer.MAX_TOPPED_UP_FRACTION == 0.1


def write_tfrecord(path, examples, compression=None):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  with tf.io.TFRecordWriter(str(path), options=compression) as w:
    for features in examples:
      feature = {k: tf.train.Feature(bytes_list=tf.train.BytesList(value=[v.encode()])) if isinstance(v, str)
                 else tf.train.Feature(int64_list=tf.train.Int64List(value=v)) for k, v in features.items()}
      w.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())


def test_other_trainers_tfrecords_text_feature_and_token_ids(corpus, tmp_path):
  """seqio-style shards: a text feature `targets` is tokenized here; an int64 feature is token ids of
  --tokenizer's vocabulary, read back as the same documents."""
  tok = tokenizer_lib.Tokenizer.load(os.path.join(corpus, "tokenizer.model"))
  rows = [{"targets": t, "ids": tok.encode(t), "other": "x"} for t in TEXTS[:6]]
  write_tfrecord(tmp_path / "task.tfrecord-00000-of-00002", rows[:3])
  write_tfrecord(tmp_path / "task.tfrecord-00001-of-00002.gz", rows[3:], "GZIP")
  inputs = [str(tmp_path / "task.tfrecord-*")]
  assert {pp.input_kind(f) for f in pp.expand_inputs(inputs)} == {"tfrecord"}
  text = pp.preprocess(inputs, str(tmp_path / "text"), tokenizer=corpus, text_field="targets", **KW)
  ids = pp.preprocess(inputs, str(tmp_path / "ids"), tokenizer=corpus, text_field="ids", **KW)
  assert decoded_documents(str(tmp_path / "text")) == decoded_documents(str(tmp_path / "ids")) == sorted(TEXTS[:6])
  assert text["documents_out"] == 6
  with pytest.raises(ValueError, match=r"task.tfrecord-00000-of-00002': no record has the feature 'body'"):
    pp.preprocess(inputs, str(tmp_path / "o"), tokenizer=corpus, text_field="body", **KW)
  raw = (tmp_path / "task.tfrecord-00000-of-00002").read_bytes()
  (tmp_path / "task.tfrecord-00000-of-00002").write_bytes(raw[:-9])  # truncated: skipped, named, rest read
  cut = pp.preprocess(inputs, str(tmp_path / "cut"), tokenizer=corpus, text_field="targets", **KW)
  assert cut["dropped"]["corrupt_input"] == 1 and cut["documents_out"] == 3
  assert "task.tfrecord-00000-of-00002" in cut["filter_examples"]["corrupt_input"][0]
