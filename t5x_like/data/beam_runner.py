"""The preprocess transforms as an Apache Beam pipeline (DirectRunner, Dataflow, Flink, Spark)."""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import time
from typing import Sequence

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions
import numpy as np
import tensorflow as tf

from t5x_like.data import data_dir
from t5x_like.data import near_dedup
from t5x_like.data import packing
from t5x_like.data import preprocessing as pp
from t5x_like.data import quality_filters
from t5x_like.data import shard_writer
from t5x_like.data import text_cleaning
from t5x_like.data import tokenizer_formats
from t5x_like.data.text_cleaning import CleaningConfig

log = logging.getLogger(__name__)
_PARTS = ".beam-parts"  # per-shard manifest entries and counts, read back by the driver


class _ScanFile(beam.DoFn):
  """(file index, path) -> (hash, ((file index, doc index), text, signature)) per document; its counts and
  examples tagged. The tokenizer model decodes TFRecord token-id features (text_cleaning.read_documents)."""

  def __init__(self, model_proto, cleaning, doc_split, text_field):
    self._model, self._args = model_proto, (cleaning, doc_split, text_field)

  def setup(self):
    text_cleaning.init_worker(self._model)

  def process(self, element):
    index, path = element
    cleaning, doc_split, text_field = self._args
    scan = text_cleaning.scan_file(pp.read_raw(path), pp.input_kind(path), cleaning, doc_split, text_field,
                                   name=path)
    for j, text in enumerate(scan.texts):
      sig = None if scan.signatures is None else scan.signatures[j]
      yield (scan.hashes[j].tobytes(), ((index, j), text, sig))
    yield beam.pvalue.TaggedOutput("counts", dict(scan.counts))
    yield beam.pvalue.TaggedOutput("examples", (index, scan.examples))


def _first_of_duplicates(element, dedup: bool):
  """Keeps the first document (in input order) of each content hash, unless dedup is off."""
  doc_hash, docs = element
  docs = sorted(docs, key=lambda d: d[0])
  keep = docs[:1] if dedup else docs
  for order, text, sig in keep:
    yield order, doc_hash, text, sig
  if len(docs) > len(keep):
    yield beam.pvalue.TaggedOutput("counts", {"dropped_duplicate": len(docs) - len(keep)})


def _band_keys(element, config):
  """A unique document -> ((band, its signature slice), (order, signature)) for each LSH band."""
  order, _, _, sig = element
  for band, (start, end) in enumerate(near_dedup.bands(config)):
    yield (band, sig[start:end].tobytes()), (order, sig)


def _similar_pairs(element, config):
  """The (earlier, later) orders of the similar documents of one LSH bucket."""
  _, docs = element
  docs = sorted(docs, key=lambda d: d[0])
  for i, (a, sig_a) in enumerate(docs):
    for b, sig_b in docs[i + 1:]:
      if near_dedup.similar(sig_a, sig_b, config):
        yield a, b


class _Tokenize(beam.DoFn):
  """(order, hash, text, signature) of a kept document -> (order, hash, tokens); near-duplicates dropped."""

  def __init__(self, model_proto, eos_id):
    self._model, self._eos_id, self._sp = model_proto, eos_id, None

  def setup(self):
    self._sp = tokenizer_formats.encoder(self._model)

  def process(self, element, near):
    order, doc_hash, text, _ = element
    if order in near:
      yield beam.pvalue.TaggedOutput("dropped", (order, text))
      return
    tokens, _ = text_cleaning.tokenize_texts([text], self._sp, self._eos_id)
    yield order, doc_hash, tokens


def _examples(file_examples, dropped):
  """The report's examples: per input in input order, then the near-duplicates in input order."""
  examples = quality_filters.merge_examples(e for _, e in sorted(file_examples, key=lambda x: x[0]))
  for _, text in sorted(dropped, key=lambda x: x[0]):
    quality_filters.note(examples, "near_duplicate", text)
  return examples


def _plan(metadata, validation_fraction, seed, num_shards, min_validation):
  """Same split and shard plan as the local runner: {order: (split, shard, position)}."""
  metadata = sorted(metadata)  # (order, hash, length) in input order
  is_val = shard_writer.split_documents([h for _, h, _ in metadata], validation_fraction, seed,
                                        [n for _, _, n in metadata], *min_validation)
  plan = {}
  for split, mask in (("train", ~is_val), ("validation", is_val)):
    rows = [m for m, v in zip(metadata, mask) if v]
    for shard, docs in enumerate(shard_writer.plan_shards([n for _, _, n in rows],
                                                          num_shards[split], seed)):
      for position, i in enumerate(docs):
        plan[rows[i][0]] = (split, shard, position)
  return plan


class _WriteShard(beam.DoFn):
  """((split, shard), [(position, tokens)...]) -> the shard file and its manifest entry."""

  def __init__(self, output_dir, num_shards, pack_length, tok):
    dtype = packing.packed_dtype(tok.vocab_size, pack_length or 0)
    self._args = (output_dir, num_shards, pack_length, tok.pad_id, tok.eos_id, dtype)

  def process(self, element):
    (split, shard), docs = element
    output_dir, num_shards, pack_length, pad_id, eos_id, dtype = self._args
    docs = [tokens for _, tokens in sorted((d for d in docs if d is not None), key=lambda d: d[0])]
    name = shard_writer.shard_name(split, shard, num_shards[split])
    yield split, shard, shard_writer.write_shard(output_dir, name, docs, pack_length, pad_id, eos_id,
                                                 dtype)


def _write_parts(entries, path, counts, examples):
  shard_writer.write_json(path, {"entries": entries, "counts": counts, "examples": examples})


def _sum_counts(dicts):
  total = collections.Counter()
  for d in dicts:
    total.update(d)
  return dict(total)


def run(inputs: Sequence[str] | str, output_dir: str, *, runner: str = "DirectRunner",
        pipeline_args: Sequence[str] = (), vocab_size: int = 8192, tokenizer: str | None = None,
        model_type: str = "bpe", byte_fallback: bool = True, character_coverage: float = 0.9995,
        max_tokenizer_chars: int | None = 20_000_000, num_train_shards: int = 4,
        num_validation_shards: int = 1, validation_fraction: float = 0.01, seed: int = 0,
        text_field: str = "text", doc_split: str = "file",
        cleaning: CleaningConfig = CleaningConfig(), pack_length: int | None = None,
        num_workers: int | None = None, cache_dir: str | None = "", progress: bool = True,
        min_validation_documents: int = 16, min_validation_tokens: int = 8192) -> dict:
  """Writes the same DATA_DIR as `preprocess.preprocess` with a Beam runner; returns the report.

  The tokenizer is loaded or trained on the driver first (pass `tokenizer` for corpora too big
  for one machine). Reading, cleaning and filtering, exact de-duplication, near-duplicate candidate
  pairs (by LSH bucket), tokenization of the survivors, the split and shard plan, and the shard writes
  run in Beam; the order-dependent walk over the similar pairs (`near_dedup.walk_similar_pairs`, the
  same answer as the local runner's) runs on one worker. The driver then writes tokenizer.model and
  manifest.json.

  Args:
    runner: a Beam runner name; `pipeline_args` are its options (e.g. ["--project=p"]).
    Others: as `preprocess.preprocess`.
  """
  del progress
  t0 = time.time()
  files = pp.expand_inputs(inputs)
  cache = pp.Cache(shard_writer.join(output_dir, ".cache") if cache_dir == "" else cache_dir)
  identities = [[f, tf.io.gfile.stat(f).length, tf.io.gfile.stat(f).mtime_nsec] for f in files]
  opts = {"tokenizer": tokenizer,
          "tokenizer_args": dict(vocab_size=vocab_size, model_type=model_type,
                                 byte_fallback=byte_fallback, character_coverage=character_coverage,
                                 max_training_chars=max_tokenizer_chars),
          "doc_args": (cleaning, doc_split, text_field)}
  tok = pp.get_tokenizer(files, identities, opts, cache, num_workers or 1)
  t_tok = time.time()
  tf.io.gfile.makedirs(output_dir)
  manifest_path = shard_writer.join(output_dir, shard_writer.MANIFEST)
  if tf.io.gfile.exists(manifest_path):
    tf.io.gfile.remove(manifest_path)
  num_shards = {"train": num_train_shards, "validation": num_validation_shards}
  parts = shard_writer.join(output_dir, _PARTS)
  options = PipelineOptions(list(pipeline_args), runner=runner, pipeline_type_check=False)
  min_validation = (min_validation_documents, min_validation_tokens)
  with beam.Pipeline(options=options) as p:
    docs, counts, file_examples = (
        p | "Inputs" >> beam.Create(list(enumerate(files)))
        | "Reshuffle" >> beam.Reshuffle()
        | "Scan" >> beam.ParDo(_ScanFile(tok.encoder_model if tokenizer else None, cleaning, doc_split,
                                         text_field))
        .with_outputs("counts", "examples", main="docs"))
    unique, dup_counts = (docs | "ByHash" >> beam.GroupByKey()
                          | "Dedup" >> beam.FlatMap(_first_of_duplicates, cleaning.dedup)
                          .with_outputs("counts", main="docs"))
    if cleaning.near_dedup.enabled:  # candidate pairs by LSH bucket in parallel, then the walk over them
      near = (unique | "Bands" >> beam.FlatMap(_band_keys, cleaning.near_dedup)
              | "ByBand" >> beam.GroupByKey()
              | "SimilarPairs" >> beam.FlatMap(_similar_pairs, cleaning.near_dedup)
              | "DistinctPairs" >> beam.Distinct()
              | "AllPairs" >> beam.combiners.ToList()
              | "NearDuplicates" >> beam.Map(lambda pairs: set(near_dedup.walk_similar_pairs(pairs))))
    else:
      near = p | "NoNearDuplicates" >> beam.Create([set()])
    tokenized, dropped = (unique | "Tokenize" >> beam.ParDo(_Tokenize(tok.encoder_model, tok.eos_id),
                                                            near=beam.pvalue.AsSingleton(near))
                          .with_outputs("dropped", main="docs"))
    near_counts = dropped | "CountNear" >> beam.combiners.Count.Globally() | beam.Map(
        lambda n: {"dropped_near_duplicate": n, "documents_tokenized": 0})
    tokenized_counts = tokenized | "CountTokenized" >> beam.combiners.Count.Globally() | beam.Map(
        lambda n: {"documents_tokenized": n})
    examples = (file_examples | "AllExamples" >> beam.combiners.ToList()
                | "Examples" >> beam.Map(_examples, dropped=beam.pvalue.AsList(dropped)))
    plan = (tokenized | "Meta" >> beam.Map(lambda d: (d[0], d[1], len(d[2])))
            | "AllMeta" >> beam.combiners.ToList()
            | "Plan" >> beam.Map(_plan, validation_fraction, seed, num_shards, min_validation))
    keyed = tokenized | "Assign" >> beam.Map(
        lambda d, plan: ((plan[d[0]][0], plan[d[0]][1]), (plan[d[0]][2], d[2])),
        plan=beam.pvalue.AsSingleton(plan))
    every_shard = p | "ShardKeys" >> beam.Create(
        [((s, i), None) for s, n in num_shards.items() for i in range(n)])
    entries = ((keyed, every_shard) | beam.Flatten() | "ByShard" >> beam.GroupByKey()
               | "Write" >> beam.ParDo(_WriteShard(output_dir, num_shards, pack_length, tok)))
    totals = ((counts, dup_counts, near_counts, tokenized_counts) | "AllCounts" >> beam.Flatten()
              | "SumCounts" >> beam.CombineGlobally(_sum_counts))
    _ = (entries | "AllEntries" >> beam.combiners.ToList()
         | "Parts" >> beam.Map(_write_parts, parts, counts=beam.pvalue.AsSingleton(totals),
                               examples=beam.pvalue.AsSingleton(examples)))
  with tf.io.gfile.GFile(parts) as f:
    result = json.load(f)
  tf.io.gfile.remove(parts)
  counts = collections.Counter(result["counts"])
  splits = {}
  for split, n in num_shards.items():
    by_index = {shard: e for s, shard, e in result["entries"] if s == split}
    splits[split] = shard_writer.split_entry([by_index[i] for i in range(n)])
  documents_out = sum(s["num_documents"] for s in splits.values())
  if not documents_out:
    raise ValueError(f"No documents left after cleaning {len(files)} input file(s) "
                     f"(dropped: {data_dir.by_prefix(counts, 'dropped_')}; examples: {result['examples']})")
  tok.save(shard_writer.join(output_dir, tok.filename))
  shard_writer.remove_stale(output_dir, [s["path"] for sp in splits.values() for s in sp["shards"]])
  report = data_dir.make_report(counts, splits, documents_out)
  if validation_fraction > 0 and any(min_validation):
    report["validation_minimum"] = {"documents": min_validation[0], "tokens": min_validation[1],
                                    "max_fraction": shard_writer.MAX_TOPPED_UP_FRACTION}
  extra = {"cleaning": dataclasses.asdict(cleaning), "doc_split": doc_split,
           "text_field": text_field, "inputs": len(files), "runner": runner}
  stats = {k: v for k, v in report.items() if k not in ("documents_tokenized", "cache_hits")}
  shard_writer.write_json(manifest_path, shard_writer.make_manifest(
      tok, splits, pack_length, dict(extra, seed=seed, stats=stats)))
  report["filter_examples"] = result["examples"]
  elapsed = time.time() - t0
  report.update(time_s=round(elapsed, 3), tokenizer_s=round(t_tok - t0, 3),
                tokens_per_s=round(report["tokens"] / max(elapsed, 1e-9)), runner=runner)
  return report
