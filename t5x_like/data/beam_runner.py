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

from t5x_like.data import packing
from t5x_like.data import data_dir
from t5x_like.data import preprocessing as pp
from t5x_like.data import shard_writer
from t5x_like.data import text_cleaning
from t5x_like.data import tokenizer_formats
from t5x_like.data.text_cleaning import CleaningConfig

log = logging.getLogger(__name__)
_PARTS = ".beam-parts"  # per-shard manifest entries and counts, read back by the driver


class _TokenizeFile(beam.DoFn):
  """(file index, path) -> ((file index, doc index), hash, tokens) per kept document."""

  def __init__(self, model_proto, cleaning, doc_split, text_field, eos_id):
    self._args = (model_proto, cleaning, doc_split, text_field, eos_id)
    self._sp = None

  def setup(self):
    self._sp = tokenizer_formats.encoder(self._args[0])

  def process(self, element):
    index, path = element
    _, cleaning, doc_split, text_field, eos_id = self._args
    docs = text_cleaning.process_file(pp.read_input(path), pp.input_kind(path), cleaning, doc_split,
                                      text_field, self._sp, eos_id)
    offsets = np.concatenate([[0], np.cumsum(docs.lengths)])
    for j in range(len(docs.lengths)):
      yield (docs.hashes[j].tobytes(), ((index, j), docs.tokens[offsets[j]:offsets[j + 1]]))
    yield beam.pvalue.TaggedOutput("counts", dict(docs.counts))


def _first_of_duplicates(element, dedup: bool):
  """Keeps the first document (in input order) of each content hash, unless dedup is off."""
  doc_hash, docs = element
  docs = sorted(docs, key=lambda d: d[0])
  keep = docs[:1] if dedup else docs
  for order, tokens in keep:
    yield order, doc_hash, tokens
  if len(docs) > len(keep):
    yield beam.pvalue.TaggedOutput("counts", {"dropped_duplicate": len(docs) - len(keep)})


def _plan(metadata, validation_fraction, seed, num_shards):
  """Same split and shard plan as the local runner: {order: (split, shard, position)}."""
  metadata = sorted(metadata)  # (order, hash, length) in input order
  is_val = shard_writer.split_documents([h for _, h, _ in metadata], validation_fraction, seed)
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
        num_workers: int | None = None, cache_dir: str | None = "", progress: bool = True) -> dict:
  """Writes the same DATA_DIR as `preprocess.preprocess` with a Beam runner; returns the report.

  The tokenizer is loaded or trained on the driver first (pass `tokenizer` for corpora too big
  for one machine). Documents, de-duplication, the split and shard plan, and the shard writes
  run in Beam; the driver then writes tokenizer.model and manifest.json.

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
  with beam.Pipeline(options=options) as p:
    docs, counts = (p | "Inputs" >> beam.Create(list(enumerate(files)))
                    | "Reshuffle" >> beam.Reshuffle()
                    | "Tokenize" >> beam.ParDo(_TokenizeFile(tok.encoder_model, cleaning, doc_split,
                                                             text_field, tok.eos_id))
                    .with_outputs("counts", main="docs"))
    unique, dup_counts = (docs | "ByHash" >> beam.GroupByKey()
                          | "Dedup" >> beam.FlatMap(_first_of_duplicates, cleaning.dedup)
                          .with_outputs("counts", main="docs"))
    plan = (unique | "Meta" >> beam.Map(lambda d: (d[0], d[1], len(d[2])))
            | "AllMeta" >> beam.combiners.ToList()
            | "Plan" >> beam.Map(_plan, validation_fraction, seed, num_shards))
    keyed = unique | "Assign" >> beam.Map(
        lambda d, plan: ((plan[d[0]][0], plan[d[0]][1]), (plan[d[0]][2], d[2])),
        plan=beam.pvalue.AsSingleton(plan))
    every_shard = p | "ShardKeys" >> beam.Create(
        [((s, i), None) for s, n in num_shards.items() for i in range(n)])
    entries = ((keyed, every_shard) | beam.Flatten() | "ByShard" >> beam.GroupByKey()
               | "Write" >> beam.ParDo(_WriteShard(output_dir, num_shards, pack_length, tok)))
    totals = ((counts, dup_counts) | "AllCounts" >> beam.Flatten()
              | "SumCounts" >> beam.CombineGlobally(_sum_counts))
    _ = (entries | "AllEntries" >> beam.combiners.ToList()
         | "Parts" >> beam.Map(lambda e, c: shard_writer.write_json(parts, {"entries": e, "counts": c}),
                               c=beam.pvalue.AsSingleton(totals)))
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
    raise ValueError(f"No documents left after cleaning {len(files)} input file(s)")
  tok.save(shard_writer.join(output_dir, tok.filename))
  shard_writer.remove_stale(output_dir, [s["path"] for sp in splits.values() for s in sp["shards"]])
  report = data_dir.make_report(counts, splits, documents_out)
  extra = {"cleaning": dataclasses.asdict(cleaning), "doc_split": doc_split,
           "text_field": text_field, "inputs": len(files), "runner": runner}
  stats = {k: v for k, v in report.items() if k not in ("documents_tokenized", "cache_hits")}
  shard_writer.write_json(manifest_path, shard_writer.make_manifest(
      tok, splits, pack_length, dict(extra, seed=seed, stats=stats)))
  elapsed = time.time() - t0
  report.update(time_s=round(elapsed, 3), tokenizer_s=round(t_tok - t0, 3),
                tokens_per_s=round(report["tokens"] / max(elapsed, 1e-9)), runner=runner)
  return report
