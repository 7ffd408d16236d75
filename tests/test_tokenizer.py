"""Tests for t5x_like.tokenizer: special ids, exact round trip, vocab capping, load errors."""

import logging
import os

import pytest

from t5x_like.data import tokenizer as tokenizer_lib

TESTDATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "testdata")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  path = tmp_path_factory.mktemp("tok") / "sp"
  return tokenizer_lib.train_tokenizer(os.path.join(TESTDATA, "sample.txt"), str(path),
                                       vocab_size=400, num_threads=1)


def test_special_ids_and_file(tok):
  assert (tok.pad_id, tok.eos_id, tok.unk_id, tok.bos_id) == (0, 1, 2, 3)
  assert tok.vocab_size == 400
  assert tok.path.endswith("sp.model") and os.path.exists(tok.path)


def test_round_trip_is_exact_for_any_text(tok):
  text = "The keeper wrote:\n\n    indented\tline  \u00e9t\u00e9 \u2603 \x07 z\u00fcrich\n"
  ids = tok.encode(text)
  assert all(i not in (tok.pad_id, tok.eos_id) for i in ids)
  assert tok.decode(ids) == text


def test_decode_stops_at_eos_and_ignores_pad(tok):
  ids = tok.encode("the sea")
  assert tok.decode([0] + ids + [0, tok.eos_id] + tok.encode(" more")) == "the sea"


def test_load_matches_trained(tok):
  loaded = tokenizer_lib.Tokenizer.load(tok.path)
  assert loaded.sha256 == tok.sha256
  assert loaded.encode("Bridges are promises.") == tok.encode("Bridges are promises.")


def test_missing_model_names_path(tmp_path):
  missing = str(tmp_path / "nope.model")
  with pytest.raises(FileNotFoundError, match="nope.model"):
    tokenizer_lib.Tokenizer.load(missing)


def test_vocab_too_large_is_capped_with_warning(tmp_path, caplog):
  texts = ["a small corpus about the sea and ships", "another line about bread and ovens"]
  with caplog.at_level(logging.WARNING):
    tok = tokenizer_lib.train_tokenizer(texts, str(tmp_path / "x.model"), vocab_size=5000,
                                        num_threads=1)
  assert tok.vocab_size < 5000
  assert "too large" in caplog.text
  assert tok.decode(tok.encode(texts[0])) == texts[0]


def test_unigram_from_iterator(tmp_path):
  with open(os.path.join(TESTDATA, "sample.txt")) as f:
    paragraphs = f.read().split("\n\n")
  tok = tokenizer_lib.train_tokenizer(paragraphs, None, vocab_size=350, model_type="unigram",
                                      num_threads=1)
  assert tok.path is None and tok.eos_id == 1
  assert tok.decode(tok.encode(paragraphs[3])) == paragraphs[3]


def test_vocab_below_what_the_corpus_needs_is_a_clear_error(tmp_path):
  from t5x_like.data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  text = ["the mesh shards tokens. every host reads records."] * 50
  with pytest.raises(ValueError, match="vocab_size=64 is below"):
    tokenizer_lib.train_tokenizer(text, str(tmp_path / "t"), vocab_size=64, byte_fallback=True)
