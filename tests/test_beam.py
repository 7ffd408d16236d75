"""Beam DirectRunner writes the same shards as the local runner."""

import json
import os

import pytest

from t5x_like.data import preprocessing as pp


@pytest.fixture(scope="module")
def beam_preprocess():
  """t5x_like.data.beam_runner, imported by the test that runs it (Beam's import, ~3 s, is not paid at collection
  by a test worker that never runs this file)."""
  pytest.importorskip("apache_beam", reason="apache-beam is not installed (extra 'beam')")
  from t5x_like.data import beam_runner  # pylint: disable=g-import-not-at-top
  return beam_runner

TESTDATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "testdata")
INPUTS = [os.path.join(TESTDATA, "sample.txt"), os.path.join(TESTDATA, "sample.jsonl")]


@pytest.mark.parametrize("pack_length", [None, 33])
def test_direct_runner_equals_local_runner(tmp_path, pack_length, beam_preprocess):
  kw = dict(vocab_size=500, doc_split="blank_line", num_train_shards=3, validation_fraction=0.2,
            num_workers=1, cache_dir=None, pack_length=pack_length, seed=7)
  extra = tmp_path / "dup.jsonl"  # duplicates and a bad line exercise the shared counting
  extra.write_text('{"text": "A river carries sand from the mountains."}\nbad\n'
                   '{"text": "A river carries sand from the mountains."}\n')
  inputs = INPUTS + [str(extra)]
  local = pp.preprocess(inputs, str(tmp_path / "local"), **kw)
  tok = str(tmp_path / "local" / "tokenizer.model")
  remote = beam_preprocess.run(inputs, str(tmp_path / "beam"), runner="DirectRunner", **kw)
  manifests = []
  for name in ("local", "beam"):
    with open(tmp_path / name / "manifest.json") as f:
      manifests.append(json.load(f))
  assert manifests[0]["splits"] == manifests[1]["splits"]  # includes every shard's sha256
  assert manifests[0]["tokenizer_sha256"] == manifests[1]["tokenizer_sha256"]
  for entry in manifests[0]["splits"].values():
    for s in entry["shards"]:
      with open(tmp_path / "local" / s["path"], "rb") as a, open(tmp_path / "beam" / s["path"], "rb") as b:
        assert a.read() == b.read()
  for key in ("documents_in", "documents_out", "tokens", "dropped", "changed", "train", "validation"):
    assert local[key] == remote[key], key
  assert os.path.exists(tok)
