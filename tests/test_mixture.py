"""Weighted mixtures of DATA_DIRs (data/mixture.py): token shares, stages, process layouts, exact resume, bad input."""

import dataclasses
import json
import os

import numpy as np
import pytest
import tensorflow as tf

from t5x_like.data import mixture as mixture_lib
from t5x_like.data import preprocessing as pp
from t5x_like.model import decoder as model_lib
from t5x_like.parallel import global_batch
from t5x_like import data as data_lib
from t5x_like.training import trainer
from tests import conftest
from tests import test_train_e2e

SEQ = 16
MODEL = model_lib.GPTConfig(num_layers=1, num_heads=2, d_model=32, d_ff=64, max_len=SEQ, dtype="float32")
KW = dict(num_train_shards=2, validation_fraction=0.2, num_workers=1, progress=False, cache_dir=None)


@pytest.fixture(scope="module")
def sources(corpus, tmp_path_factory):
  """Two DATA_DIRs with the session corpus's tokenizer: the corpus itself ('web') and another ('code')."""
  root = tmp_path_factory.mktemp("mixture")
  conftest.write_corpus(str(root / "raw"), files=6, lines=60, seed=3)
  code = str(root / "code")
  pp.preprocess([str(root / "raw" / "*.txt")], code, tokenizer=corpus, **KW)
  return corpus, code


def global_batches(mix, steps, *, processes=1, streams=1, batch=8, seed=0):
  """The global batches (numpy dicts) of `steps` steps as `processes` processes together hold them."""
  parts = []
  for p in range(processes):
    ds = global_batch.process_rows(
        lambda stream_index, num_streams, batch_size: mix.make_dataset(
            "train", batch_size=batch_size, seq_len=SEQ, seed=seed, shuffle_buffer=64,
            process_index=stream_index, process_count=num_streams),
        num_streams=streams, global_batch_size=batch, process_index=p, process_count=processes)
    parts.append([{k: v.numpy() for k, v in b.items()} for b in ds.take(steps)])
  return [{k: np.concatenate([part[i][k] for part in parts]) for k in parts[0][i]} for i in range(steps)]


def token_shares(batches, n_sources=2):
  """Trained tokens (weight > 0) of each source over the batches, as shares."""
  tokens = np.zeros(n_sources)
  for b in batches:
    tokens += np.bincount(b[mixture_lib.SOURCE][b["weights"] > 0], minlength=n_sources)
  return tokens / tokens.sum()


def test_two_sources_at_08_02_give_those_token_shares_and_every_batch_its_share(sources):
  mix = mixture_lib.Mixture.create({sources[0]: 0.8, sources[1]: 0.2})
  batches = global_batches(mix, 150)
  shares = token_shares(batches)
  assert abs(shares[0] - 0.8) < 0.01 and abs(shares[1] - 0.2) < 0.01, shares
  rows = [np.bincount(b[mixture_lib.SOURCE][:, 0], minlength=2) for b in batches]
  assert all(abs(r[0] - 8 * 0.8) < 1 for r in rows)  # systematic sampling: 6 or 7 of 8 rows, never 8 or 5
  assert len({tuple(b[mixture_lib.SOURCE][:, 0]) for b in batches}) > 10  # the order within a batch is seeded
  # the counts the trainer logs (data/tokens/<source>) are those of the batches, recomputed from the choice
  np.testing.assert_array_equal(mix.rows_seen(150, batch_size=8, num_streams=1, seed=0), np.sum(rows, axis=0))
  np.testing.assert_array_equal(mix.rows_seen(150, batch_size=8, num_streams=1, seed=0, start=40)
                                + mix.rows_seen(40, batch_size=8, num_streams=1, seed=0), np.sum(rows, axis=0))


def test_stage_schedule_changes_the_weights_at_its_step(sources):
  mix = mixture_lib.Mixture.create(stages=((0, {sources[0]: 1, sources[1]: 0}), (20, {sources[0]: 1, sources[1]: 3})))
  batches = global_batches(mix, 60)
  assert token_shares(batches[:20])[1] == 0
  assert abs(token_shares(batches[20:])[1] - 0.75) < 0.02


@pytest.mark.slow  # 10 s: six mixed streams opened
def test_same_batches_on_one_and_two_processes(sources):
  mix = mixture_lib.Mixture.create({sources[0]: 0.7, sources[1]: 0.3})
  one = global_batches(mix, 3, processes=1, streams=2, batch=4)
  two = global_batches(mix, 3, processes=2, streams=2, batch=4)
  for a, b in zip(one, two):
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])
  assert {0, 1} <= set(np.concatenate([b[mixture_lib.SOURCE][:, 0] for b in one]).tolist())  # both sources read


def test_iterator_checkpoint_resumes_the_mixed_stream_exactly(sources, tmp_path):
  """The trainer's iterator checkpoint (tf.train.Checkpoint(iterator=...)) covers the mixed iterator."""
  mix = mixture_lib.Mixture.create({sources[0]: 0.5, sources[1]: 0.5})
  ds = mix.make_dataset("train", batch_size=4, seq_len=SEQ, seed=2, shuffle_buffer=32)
  it = iter(ds)
  for _ in range(5):
    next(it)
  path = tf.train.Checkpoint(iterator=it).write(str(tmp_path / "it"))
  expected = [next(it) for _ in range(4)]
  fresh = iter(mix.make_dataset("train", batch_size=4, seq_len=SEQ, seed=2, shuffle_buffer=32))
  tf.train.Checkpoint(iterator=fresh).read(path).assert_consumed()
  for want in expected:
    got = next(fresh)
    for k in want:
      np.testing.assert_array_equal(want[k].numpy(), got[k].numpy())


@pytest.mark.parametrize("weights, message", [
    ({"A": 0.0, "B": 0.0}, "weights must sum to a positive number"),
    ({"A": -1.0, "B": 2.0}, "weight of 'A' must be a finite number >= 0"),
    ({}, "must be a non-empty dict"),
])
def test_bad_weights_are_one_line_errors(sources, weights, message):
  names = {"A": sources[0], "B": sources[1]}
  with pytest.raises(ValueError, match=message.replace("'A'", f"'{sources[0]}'")):
    mixture_lib.Mixture.create({names[k]: w for k, w in weights.items()} if weights else {})


def test_missing_source_and_other_tokenizer_are_named(sources, tmp_path):
  with pytest.raises(FileNotFoundError, match=str(tmp_path / "nowhere")):
    mixture_lib.Mixture.create({sources[0]: 1, str(tmp_path / "nowhere"): 1})
  conftest.write_corpus(str(tmp_path / "raw"), files=2, lines=40, seed=9)
  odd = str(tmp_path / "odd")
  pp.preprocess([str(tmp_path / "raw" / "*.txt")], odd, vocab_size=300, **KW)
  with pytest.raises(ValueError, match=f"mixture source '{odd}' has another tokenizer than '{sources[0]}'"):
    mixture_lib.Mixture.create({sources[0]: 1, sources[1]: 1, odd: 1})
  with pytest.raises(ValueError, match=r"mixture_stages\[1\] names"):
    mixture_lib.Mixture.create(stages=((0, {sources[0]: 1}), (5, {sources[1]: 1})))


@pytest.mark.slow  # two short training launches
def test_training_logs_per_source_tokens_and_eval_loss_and_resumes_bit_identically(sources, tmp_path):
  """A 0.8/0.2 run: metrics.jsonl has data/tokens/<source> and eval/<source>/loss; a copy of its step-2
  checkpoint resumed to step 4 logs the same losses and token counts."""
  data = data_lib.DataConfig(shuffle_buffer=64, mixture={sources[0]: 0.8, sources[1]: 0.2})
  names = mixture_lib.source_names(sources)

  def run(model_dir, eval_batches=0):  # the resumed run's final evaluation (not compared): one batch
    config = test_train_e2e.run_config(str(model_dir), "", train_steps=4, log_every=1, checkpoint_every=2,
                                       eval_every=4, seq_len=SEQ,
                                       data=dataclasses.replace(data, eval_batches=eval_batches))
    trainer.train(config, MODEL, dataclasses.replace(test_train_e2e.OPT, warmup_steps=1))

  def logged(model_dir):
    return {r["step"]: r for r in map(json.loads, open(os.path.join(model_dir, "metrics.jsonl"))) if "loss" in r}

  run(tmp_path / "straight")
  straight = logged(tmp_path / "straight")
  tokens = [straight[4][f"data/tokens/{n}"] for n in names]
  assert sum(tokens) == 4 * 8 * SEQ and tokens[0] > 3 * tokens[1]
  evals = [r for r in map(json.loads, open(tmp_path / "straight" / "metrics.jsonl")) if "eval/loss" in r][-1]
  per_source = [evals[f"eval/{n}/loss"] for n in names]
  assert min(per_source) <= evals["eval/loss"] <= max(per_source) and per_source[0] != per_source[1]
  run(conftest.rewind(tmp_path / "straight", tmp_path / "resumed", 2), eval_batches=1)
  resumed = logged(tmp_path / "resumed")
  for step in (3, 4):
    assert resumed[step]["loss"] == straight[step]["loss"]
    assert all(resumed[step][f"data/tokens/{n}"] == straight[step][f"data/tokens/{n}"] for n in names)


def test_gin_binds_a_mixture_and_its_stages():
  import gin  # pylint: disable=g-import-not-at-top
  from t5x_like import cli  # pylint: disable=g-import-not-at-top
  gin.clear_config()
  try:
    cli.register_all()
    gin.parse_config(["data.DataConfig.mixture = {'/data/web': 0.8, '/data/code': 0.2}",
                      "data.DataConfig.mixture_stages = ()"])
    assert cli.train_config().data.mixture == {"/data/web": 0.8, "/data/code": 0.2}
    gin.parse_config(["data.DataConfig.mixture = None",
                      "data.DataConfig.mixture_stages = ((0, {'/a': 1.0, '/b': 0.0}), (500, {'/a': 0.5, '/b': 0.5}))"])
    assert cli.train_config().data.mixture_stages[1] == (500, {"/a": 0.5, "/b": 0.5})
  finally:
    gin.clear_config()
