"""Quality filters and MinHash near-duplicate removal: what each rule drops, the threshold, both runners alike."""

import collections
import json
import random

import numpy as np
import pytest

from t5x_like.data import near_dedup
from t5x_like.data import preprocessing as pp
from t5x_like.data import quality_filters
from t5x_like.data.near_dedup import NearDedupConfig
from t5x_like.data.quality_filters import QualityConfig
from t5x_like.data.text_cleaning import CleaningConfig

WORDS = ("the trainer reads every shard of the corpus once and writes balanced records for each host while a "
         "checkpoint keeps the iterator position so that resumed runs continue exactly where they stopped").split()
KW = dict(num_train_shards=2, validation_fraction=0.0, num_workers=1, progress=False, cache_dir=None)


def essay(seed, n=120):
  rng = random.Random(seed)
  return " ".join(rng.choice(WORDS) for _ in range(n)) + "."


def edited(text, edits, seed=0):
  """`text` with `edits` words replaced by another word."""
  rng = random.Random(seed)
  words = text.split()
  for i in rng.sample(range(len(words)), edits):
    words[i] = "zebra"
  return " ".join(words)


def test_each_quality_rule_drops_its_documents_with_examples():
  cfg = QualityConfig(enabled=True)
  good = "The trainer reads every shard once. It writes balanced records for each host, and resumes exactly."
  bad = {"repeated_lines": "buy cheap shoes today\n" * 4 + "the end of this short page",
         "repeated_ngrams": "click here click here click here click here to win a prize",
         "symbol_ratio": "#### @@@ ~~~ ^^^ ||| <<< >>> ### the words are here and there",
         "digit_ratio": "call 5551234567 or 5559876543 or 5550001111 now please",
         "mean_word_length": "a b c d e f g h i j k l",
         "too_few_words": "tiny"}
  counts, examples = collections.Counter(), {}
  assert quality_filters.apply(good, cfg, counts, examples) == good
  for rule, text in bad.items():
    assert quality_filters.apply(text, cfg, counts, examples) is None, rule
    assert counts[f"dropped_{rule}"] == 1 and examples[rule][0] == " ".join(text.split())[:120]
  page = "Accept all cookies\n" + good + "\nPrivacy Policy | Terms of Use"
  assert quality_filters.apply(page, cfg, counts, examples) == good
  assert counts["boilerplate_lines_removed"] == 2 and examples["boilerplate_lines"] == ["Accept all cookies",
                                                                                        "Privacy Policy | Terms of Use"]
  off = collections.Counter()
  assert quality_filters.apply(bad["digit_ratio"], QualityConfig(), off, {}) == bad["digit_ratio"] and not off


def jaccard(a, b, size=5):
  x, y = near_dedup.shingles(a, size), near_dedup.shingles(b, size)
  return len(x & y) / len(x | y)


def test_near_duplicates_are_removed_at_the_threshold_and_kept_below():
  base = essay(1)
  close, far = edited(base, 2), edited(base, 12)  # true Jaccard of 5-word shingles about 0.85 and 0.4
  assert jaccard(base, close) > 0.8 > 0.6 > jaccard(base, far)
  sigs = near_dedup.signatures([base, close, far, essay(2)], NearDedupConfig(enabled=True))
  assert near_dedup.find_near_duplicates(sigs, NearDedupConfig(enabled=True, threshold=0.7)) == {1: 0}
  assert near_dedup.find_near_duplicates(sigs, NearDedupConfig(enabled=True, threshold=0.95)) == {}
  assert near_dedup.find_near_duplicates(sigs, NearDedupConfig(enabled=True, threshold=0.3)) == {1: 0, 2: 0}
  # the LSH index only proposes candidates: one it proposes below the threshold is kept (estimate 0.73 < 0.75)
  mid = near_dedup.signatures([base, edited(base, 5)], NearDedupConfig(enabled=True))
  assert 0.7 < np.mean(mid[0] == mid[1]) < 0.75
  assert near_dedup.find_near_duplicates(mid, NearDedupConfig(enabled=True, threshold=0.75)) == {}
  assert near_dedup.find_near_duplicates(mid, NearDedupConfig(enabled=True, threshold=0.7)) == {1: 0}


@pytest.mark.parametrize("threshold", [0.6, 0.7, 0.8, 0.9])
def test_the_walk_over_similar_pairs_equals_the_walk_over_signatures(threshold):
  """The Beam runner finds similar pairs per LSH bucket and walks them; the local runner walks the index. Chains
  (a ~ b ~ c, a !~ c) keep c when b was dropped, in both."""
  chain = [essay(5)]
  for k in range(4):
    chain.append(edited(chain[-1], 3, seed=k))
  texts = chain + [essay(6), edited(essay(6), 1), essay(7)]
  config = NearDedupConfig(enabled=True, threshold=threshold)
  sigs = near_dedup.signatures(texts, config)
  pairs = [(i, j) for i in range(len(texts)) for j in range(i + 1, len(texts))
           if any(np.array_equal(sigs[i][a:b], sigs[j][a:b]) for a, b in near_dedup.bands(config))
           and near_dedup.similar(sigs[i], sigs[j], config)]
  assert near_dedup.walk_similar_pairs(pairs) == sorted(near_dedup.find_near_duplicates(sigs, config))


@pytest.fixture(scope="module")
def noisy_inputs(tmp_path_factory):
  """Web-like JSON lines: essays, their near-copies and exact copies, boilerplate, junk; in two files."""
  root = tmp_path_factory.mktemp("noisy")
  docs = [essay(i) for i in range(30)]
  docs += [edited(docs[i], 2, seed=i) for i in range(0, 10)]  # near-duplicates of the first 10
  docs += docs[20:23]  # exact duplicates
  docs += ["Accept all cookies\n" + essay(100), "1234 5678 9012 3456 7890 1111 2222", "$$$ ### @@@ %%% ^^^ &&& the words are here and there"]
  rows = [{"text": d} for d in docs]
  for name, part in (("a.jsonl", rows[::2]), ("b.jsonl", rows[1::2])):
    (root / name).write_text("".join(json.dumps(r) + "\n" for r in part))
  return [str(root / "a.jsonl"), str(root / "b.jsonl")]


FILTERS = CleaningConfig(quality=QualityConfig(enabled=True), near_dedup=NearDedupConfig(enabled=True, threshold=0.7))


def test_preprocess_reports_each_filter_and_drops_duplicates_before_tokenizing(noisy_inputs, corpus, tmp_path):
  report = pp.preprocess(noisy_inputs, str(tmp_path / "out"), tokenizer=corpus, cleaning=FILTERS, **KW)
  assert report["dropped"] == {"digit_ratio": 1, "duplicate": 3, "near_duplicate": 10, "symbol_ratio": 1}
  assert report["documents_out"] == 31 and report["documents_tokenized"] == 31  # duplicates never tokenized
  assert report["changed"]["boilerplate_lines"] == 1
  assert set(report["filter_examples"]) == {"boilerplate_lines", "digit_ratio", "near_duplicate", "symbol_ratio"}
  assert len(report["filter_examples"]["near_duplicate"]) == 3


@pytest.mark.slow  # a Beam DirectRunner pipeline (~15 s)
def test_beam_runner_writes_identical_shards_with_the_filters_on(noisy_inputs, corpus, tmp_path):
  beam_runner = pytest.importorskip("t5x_like.data.beam_runner", reason="apache-beam is not installed (extra 'beam')")
  kw = dict(KW, validation_fraction=0.2, num_train_shards=3, min_validation_documents=4)
  local = pp.preprocess(noisy_inputs, str(tmp_path / "local"), tokenizer=corpus, cleaning=FILTERS, **kw)
  del kw["progress"]
  remote = beam_runner.run(noisy_inputs, str(tmp_path / "beam"), tokenizer=corpus, cleaning=FILTERS, **kw)
  for key in ("documents_in", "documents_out", "tokens", "dropped", "changed", "train", "validation",
              "filter_examples", "validation_minimum"):
    assert local[key] == remote[key], key
  manifests = [json.load(open(tmp_path / name / "manifest.json")) for name in ("local", "beam")]
  assert manifests[0]["splits"] == manifests[1]["splits"]
  for entry in manifests[0]["splits"].values():
    for s in entry["shards"]:
      assert open(tmp_path / "local" / s["path"], "rb").read() == open(tmp_path / "beam" / s["path"], "rb").read()
  assert local["dropped"]["near_duplicate"] == 10 and np.sum(local["validation"]["num_documents"]) >= 4


# The CLI flags reaching the filters: test_preprocess.py's test_cli_chat_quality_filters_and_bad_input.
