"""Local preprocessing runner: clean -> tokenizer -> balanced TFRecord shards + manifest.json."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import logging
import os
import time
from typing import Sequence

import numpy as np
import tensorflow as tf

from t5x_like.data import chat
from t5x_like.data import data_dir
from t5x_like.data import input_pipeline
from t5x_like.data.input_files import expand_inputs, input_kind, read_input, read_raw  # also the runners' API
from t5x_like.data import near_dedup
from t5x_like.data import ordering
from t5x_like.data import preference
from t5x_like.data import quality_filters
from t5x_like.data.tokenization_cache import CACHE_VERSION as _CACHE_VERSION
from t5x_like.data.tokenization_cache import Cache
from t5x_like.data.tokenization_cache import digest as _digest
from t5x_like.data import shard_writer
from t5x_like.data import text_cleaning
from t5x_like.data import tokenizer as tokenizer_lib
from t5x_like.data.text_cleaning import CleaningConfig
from t5x_like.data.workers import Progress
from t5x_like.data.workers import Workers

log = logging.getLogger(__name__)


def get_tokenizer(files, file_hashes, opts, cache: Cache, num_workers, texts=None) -> tokenizer_lib.Tokenizer:
  """Loads --tokenizer, or a cached one trained on the same inputs, or trains one (on `texts`, the cleaned
  documents, when given; else on the inputs read again)."""
  if opts["tokenizer"]:
    tok = tokenizer_lib.load(opts["tokenizer"])
  else:
    key = _digest(_CACHE_VERSION, file_hashes, opts["tokenizer_args"], opts["doc_args"])
    cached = cache.path(f"tokenizer-{key}.model")
    if cached and tf.io.gfile.exists(cached):
      log.info("Tokenizer: cache hit %s", cached)
      tok = tokenizer_lib.Tokenizer.load(cached)
    else:
      t0 = time.time()
      with Workers(num_workers if texts is None else 1) as workers:
        if texts is None:
          cfg, doc_split, text_field = opts["doc_args"]
          args = ((read_raw(f), input_kind(f), cfg, doc_split, text_field, None, f) for f in files)
          texts = (t for scan in workers.map(text_cleaning.worker_scan_file, args) for t in scan.texts)
        tok = tokenizer_lib.train_tokenizer(texts, cached, **opts["tokenizer_args"])
      log.info("Tokenizer: trained vocab %d in %.1fs", tok.vocab_size, time.time() - t0)
  if tok.pad_id < 0 or tok.eos_id < 0 or tok.pad_id == tok.eos_id:
    raise ValueError(f"Tokenizer '{tok.path}' needs distinct pad and eos ids >= 0, "
                     f"found pad_id={tok.pad_id} eos_id={tok.eos_id}")
  return tok


def scan_inputs(files, cleaning, doc_split, text_field, workers: Workers, score_field=None
                ) -> list[text_cleaning.FileScan]:
  """Reads, cleans, filters and hashes every input in worker processes (text_cleaning.scan_file); the
  workers' model (the given --tokenizer, if any) decodes the token ids of TFRecord inputs."""
  args = ((read_raw(f), input_kind(f), cleaning, doc_split, text_field, score_field, f) for f in files)
  return list(workers.map(text_cleaning.worker_scan_file, args))


def tokenize_kept(files, file_hashes, scans, keep, tok, cleaning, doc_split, text_field, cache: Cache,
                  workers: Workers, progress=True, score_field=None, counts=None) -> list[tuple[np.ndarray, np.ndarray]]:
  """(tokens, lengths) of each input's kept documents: cache hits are loaded, the rest tokenized by
  `workers` (initialised with `tok`'s model), counted in `counts` as cache_hits and documents_tokenized."""
  counts = collections.Counter() if counts is None else counts
  results: list = [None] * len(files)
  todo, keys = [], {}
  bar = Progress("tokenize", len(files), enabled=progress)
  for i, f in enumerate(files):
    keys[i] = _digest(_CACHE_VERSION, file_hashes[i], tok.encoding_sha256, dataclasses.asdict(cleaning),
                      doc_split, text_field, input_kind(f), score_field,
                      hashlib.sha256(np.packbits(keep[i]).tobytes()).hexdigest())
    hit = cache.get_docs(keys[i])
    if hit is not None:
      results[i] = hit.tokens, hit.lengths
      counts["cache_hits"] += 1
      bar.update(1, int(hit.lengths.sum()))
    else:
      todo.append(i)
  args = (([t for t, k in zip(scans[i].texts, keep[i]) if k], tok.eos_id) for i in todo)
  for i, (tokens, lengths) in zip(todo, workers.map(text_cleaning.worker_tokenize, args)):
    results[i] = tokens, lengths
    counts["documents_tokenized"] += len(lengths)
    cache.put_docs(keys[i], text_cleaning.FileDocuments(tokens, lengths, np.zeros([0, 16], np.uint8),
                                                        collections.Counter()))
    bar.update(1, int(lengths.sum()))
  return results


def _scan_and_tokenize(files, file_hashes, given, opts, cleaning, doc_split, text_field, cache, workers, progress,
                       score_field):
  """The text runner's worker phases: scan every input, drop duplicates, get the tokenizer (given, cached, or
  trained on every cleaned document, duplicates included, as the Beam runner's driver does), tokenize the
  survivors. `workers` run the scan (and the tokenization, when initialised with the given tokenizer)."""
  scans = scan_inputs(files, cleaning, doc_split, text_field, workers, score_field)
  counts = collections.Counter()
  for scan in scans:
    counts.update(scan.counts)
  examples = quality_filters.merge_examples(scan.examples for scan in scans)
  keep, dedup_counts = near_dedup.select_documents(
      scans, cleaning.dedup, cleaning.near_dedup, lambda rule, text: quality_filters.note(examples, rule, text))
  counts.update(dedup_counts)
  t_scan = time.time()
  if not given:
    workers.__exit__(None, None, None)  # the scan pool is done: the tokenizer's pool replaces it
  tok = given or get_tokenizer(files, file_hashes, opts, cache, 1, texts=(t for scan in scans for t in scan.texts))
  t_tok = time.time()
  with contextlib.nullcontext(workers) if given else Workers(workers.num_workers, tok.encoder_model) as tokenizers:
    per_file = tokenize_kept(files, file_hashes, scans, keep, tok, cleaning, doc_split, text_field, cache,
                             tokenizers, progress, score_field, counts)
  return per_file, tok, scans, keep, counts, examples, (t_scan, t_tok, time.time())


def resolve_tokenizer_path(path: str) -> str:
  """--tokenizer as a file: a DATA_DIR (a folder with manifest.json) means the tokenizer it lists."""
  if tf.io.gfile.isdir(path) and tf.io.gfile.exists(shard_writer.join(path, shard_writer.MANIFEST)):
    return input_pipeline.resolve_path(path, input_pipeline.load_manifest(path, verify="none")["tokenizer"])
  return path


def read_json_lines_inputs(inputs: Sequence[str] | str, tokenizer: str | None, data_format: str, whose: str):
  """The JSON-lines inputs of a chat or preference DATA_DIR: (files, the given tokenizer, [(file, text)], the
  counts so far: invalid UTF-8 replaced); a missing --tokenizer or a non-JSON-lines file is a ValueError."""
  if not tokenizer:
    raise ValueError(f"--format={data_format} needs --tokenizer: {whose} DATA_DIR, .model or tokenizer.json")
  files = expand_inputs(inputs)
  for f in files:
    if input_kind(f) != "jsonl":
      raise ValueError(f"--format={data_format} reads JSON lines: --input file '{f}' is not *.jsonl / *.json(.gz)")
  tok = get_tokenizer(files, None, {"tokenizer": resolve_tokenizer_path(tokenizer)}, Cache(None), 1)
  counts = collections.Counter()
  texts = [(f, text_cleaning.fix_invalid_utf8(text_cleaning.decode_utf8(read_input(f)), "replace", counts))
           for f in files]
  return files, tok, texts, counts


def preprocess_chat(inputs: Sequence[str] | str, output_dir: str, *, tokenizer: str | None,
                    template: chat.ChatTemplate = chat.ChatTemplate(), train_on_prompt: bool = False,
                    max_tokens: int | None = None, num_train_shards: int = 4,
                    num_validation_shards: int = 1, validation_fraction: float = 0.01, seed: int = 0,
                    pack_length: int | None = None, dedup: bool = True,
                    order: ordering.OrderSpec | None = None) -> dict:
  """Builds a chat DATA_DIR (format "chat": tokens and per-token loss weights) from JSON lines.

  Each line is a conversation (see `chat.parse_conversation` for the shapes) rendered by `template`
  and ending in EOS: one document. Content is used as written (no text cleaning). Malformed lines are
  counted by reason and the first few named by file:line; exact duplicates are dropped.

  Args:
    tokenizer: the base model's tokenizer: a DATA_DIR (its tokenizer), or a tokenizer file.
    template, train_on_prompt: see `chat.ChatEncoder`.
    max_tokens: longest conversation kept, EOS included (default: pack_length; None: no limit);
      longer ones are cut or dropped by `chat.truncate`'s rule.
    order: sort the train split by length or by a numeric field of each line (`preprocess`'s order_by).
    Others: as `preprocess`.
  """
  if max_tokens is None:
    max_tokens = pack_length
  elif max_tokens < 2 or (pack_length and max_tokens > pack_length):
    raise ValueError(f"--max_tokens={max_tokens} must be >= 2 and <= --pack_length={pack_length}")
  files, tok, texts, counts = read_json_lines_inputs(inputs, tokenizer, "chat", "the base model's")
  encoder = chat.ChatEncoder(tok, template, train_on_prompt=train_on_prompt)
  result = chat.read_conversations(texts, encoder, max_tokens, score_field=order and order.field)
  counts.update(result.counts)
  docs, weights, hashes, scores, seen = [], [], [], [], set()
  for k, d in enumerate(result.docs):
    h = hashlib.sha256(d.ids.tobytes() + d.weights.tobytes()).digest()[:16]
    if dedup and h in seen:
      counts["dropped_duplicate"] += 1
      continue
    seen.add(h)
    docs.append(d.ids)
    weights.append(d.weights)
    hashes.append(h)
    if result.scores:
      scores.append(result.scores[k])
  if not docs:
    raise ValueError(f"No conversations left in {len(files)} input file(s) (dropped: "
                     f"{data_dir.by_prefix(counts, 'dropped_')}; first: {result.malformed_lines[:1]})")
  extra = {"inputs": len(files), "chat_template": dataclasses.asdict(template),
           "train_on_prompt": train_on_prompt, "max_tokens": max_tokens}
  report = data_dir.write_data_dir(output_dir, tok, docs, hashes, validation_fraction, seed, num_train_shards,
                          num_validation_shards, pack_length, counts, extra, weights=weights, order=order,
                          scores=scores if order and order.field else None)
  report["malformed_lines"] = result.malformed_lines
  return report


def preprocess_preference(inputs: Sequence[str] | str, output_dir: str, *, tokenizer: str | None,
                          template: chat.ChatTemplate = chat.ChatTemplate(), num_train_shards: int = 4,
                          num_validation_shards: int = 1, validation_fraction: float = 0.01, seed: int = 0,
                          pack_length: int | None = None, dedup: bool = True, unpaired: bool = False) -> dict:
  """Builds a preference DATA_DIR (format "preference", see `data/preference.py`) from JSON lines
  {"prompt", "chosen", "rejected"}: rows of `pack_length` (= SEQ_LEN + 1) tokens holding whole pairs; with
  `unpaired`, from labelled examples {"prompt", "completion", "label"} (KTO's data; manifest "unpaired": true).

  Malformed lines (bad JSON, a missing key, chosen == rejected, empty text, ...) are counted by reason and
  the first few named by file:line; pairs longer than a row are dropped (dropped_too_long); exact
  duplicate pairs are dropped.
  """
  what = "unpaired" if unpaired else "preference"
  if tokenizer and not pack_length:
    raise ValueError(f"--format={what} needs --pack_length=SEQ_LEN+1: its rows hold whole pairs")
  files, tok, texts, counts = read_json_lines_inputs(inputs, tokenizer, what, "the policy's")
  result = preference.read_pairs(texts, chat.ChatEncoder(tok, template), pack_length, unpaired=unpaired)
  counts.update(result.counts)
  pairs, seen = [], set()
  for pair in result.pairs:
    if dedup and pair.digest() in seen:
      counts["dropped_duplicate"] += 1
      continue
    seen.add(pair.digest())
    pairs.append(pair)
  if not pairs:
    raise ValueError(f"No {'labelled examples' if unpaired else 'preference pairs'} left in {len(files)} input "
                     f"file(s) (dropped: "
                     f"{data_dir.by_prefix(counts, 'dropped_')}; first: {result.malformed_lines[:1]})")
  extra = {"inputs": len(files), "chat_template": dataclasses.asdict(template)}
  if unpaired:
    extra["unpaired"] = True
  path, manifest, splits, most = preference.write_data_dir(
      output_dir, tok, pairs, pack_length=pack_length, validation_fraction=validation_fraction, seed=seed,
      num_train_shards=num_train_shards, num_validation_shards=num_validation_shards, counts=counts, extra=extra)
  report = data_dir.make_report(counts, splits, len(pairs))
  report["max_pairs_per_row"] = most
  manifest["stats"] = {k: v for k, v in report.items() if k not in ("documents_tokenized", "cache_hits")}
  shard_writer.write_json(path, manifest)
  report["malformed_lines"] = result.malformed_lines
  return report


def preprocess(inputs: Sequence[str] | str, output_dir: str, *, vocab_size: int = 8192,
               tokenizer: str | None = None, model_type: str = "bpe", byte_fallback: bool = True,
               character_coverage: float = 0.9995, max_tokenizer_chars: int | None = 20_000_000,
               num_train_shards: int = 4, num_validation_shards: int = 1,
               validation_fraction: float = 0.01, seed: int = 0, text_field: str = "text",
               doc_split: str = "file", cleaning: CleaningConfig = CleaningConfig(),
               pack_length: int | None = None, num_workers: int | None = None,
               cache_dir: str | None = "", progress: bool = True, data_format: str = "text",
               chat_template: chat.ChatTemplate = chat.ChatTemplate(), train_on_prompt: bool = False,
               max_tokens: int | None = None, order_by: str | None = None,
               min_validation_documents: int = 16, min_validation_tokens: int = 8192) -> dict:
  """Builds a DATA_DIR from text / JSON-lines / Parquet / `datasets` inputs; returns the report (also in the
  manifest).

  Every input is read, cleaned and filtered (quality filters, MinHash hashes) in worker processes; exact and
  near duplicates are dropped in input order; only then are the survivors tokenized.

  Args:
    inputs: glob patterns. *.jsonl / *.json (optionally .gz / .zst) hold one JSON object per line with
      the text in `text_field`; *.parquet files and `datasets.save_to_disk` folders hold it in the column
      `text_field`; *.html pages are one document each, HTML cleaned; any other file is plain text
      (optionally .gz / .zst) split by `doc_split` ("file": one document per file, "blank_line": one per
      paragraph). A corrupt compressed or Parquet file is skipped, counted and named in the report.
    output_dir: the DATA_DIR to write (local path or any TF filesystem such as gs://).
    vocab_size, model_type, byte_fallback, character_coverage, max_tokenizer_chars: tokenizer
      training settings, unused when `tokenizer` names an existing .model file.
    num_train_shards, num_validation_shards: shard counts per split.
    validation_fraction: share of documents (chosen by content hash and seed) for validation.
    min_validation_documents, min_validation_tokens: the validation split is topped up (by the same hash
      order) to at least this many documents and tokens, never past 10% of the documents; the report
      states the minimum ("validation_minimum").
    seed: shard assignment and split seed.
    cleaning: the cleaning rules.
    pack_length: write rows of exactly this many tokens (documents concatenated, last row of a
      shard padded with pad_id) instead of one record per document.
    num_workers: tokenization processes (default: CPU count).
    cache_dir: "" -> `output_dir/.cache`; None disables caching.
    progress: log progress lines.
    data_format: "text", or "chat": conversations with loss weights (`preprocess_chat`, which
      takes chat_template, train_on_prompt, max_tokens; needs `tokenizer`; no cleaning or cache).
      "preference": {"prompt", "chosen", "rejected"} pairs (`preprocess_preference`: chat_template,
      pack_length required, `tokenizer` required). "unpaired": {"prompt", "completion", "label"} examples for
      KTO, written as a preference DATA_DIR whose pairs have one side each.
    order_by: None / "none": the seeded shard plan. "length" (tokens, EOS included) or "field:NAME"
      (the numeric JSON field NAME of each line; JSON-lines input only, every line needs it): the
      train split is written sorted ascending by that score, ties by content hash, dealt round-robin
      over its shards so that the input pipeline reads it back in that order (`ordering`); the
      manifest records it as "order".

  Returns:
    The report: documents in/out, tokens, dropped and changed counts by rule, time, tokens/s.
  """
  t0 = time.time()
  if num_train_shards < 1 or num_validation_shards < 1:
    raise ValueError("--num_train_shards and --num_validation_shards must be >= 1")
  if not 0 <= validation_fraction < 1:
    raise ValueError(f"--validation_fraction must be in [0, 1), got {validation_fraction}")
  if pack_length is not None and pack_length < 2:
    raise ValueError(f"--pack_length must be >= 2, got {pack_length}")
  if data_format not in (*shard_writer.FEATURES, "unpaired"):
    raise ValueError(f"--format must be one of {sorted([*shard_writer.FEATURES, 'unpaired'])}, got '{data_format}'")
  order = ordering.parse_order_by(order_by)
  if data_format in ("preference", "unpaired"):
    if order is not None:
      raise ValueError(f"--order_by={order_by} is not supported with --format={data_format}")
    report = preprocess_preference(inputs, output_dir, tokenizer=tokenizer, template=chat_template,
                                   num_train_shards=num_train_shards, num_validation_shards=num_validation_shards,
                                   validation_fraction=validation_fraction, seed=seed, pack_length=pack_length,
                                   dedup=cleaning.dedup, unpaired=data_format == "unpaired")
    elapsed = time.time() - t0
    report.update(time_s=round(elapsed, 3), tokens_per_s=round(report["tokens"] / max(elapsed, 1e-9)))
    return report
  if data_format == "chat":
    report = preprocess_chat(inputs, output_dir, tokenizer=tokenizer, template=chat_template,
                             train_on_prompt=train_on_prompt, max_tokens=max_tokens,
                             num_train_shards=num_train_shards, num_validation_shards=num_validation_shards,
                             validation_fraction=validation_fraction, seed=seed, pack_length=pack_length,
                             dedup=cleaning.dedup, order=order)
    elapsed = time.time() - t0
    report.update(time_s=round(elapsed, 3), tokens_per_s=round(report["tokens"] / max(elapsed, 1e-9)))
    return report
  tokenizer = resolve_tokenizer_path(tokenizer) if tokenizer else None
  text_cleaning.split_documents("", doc_split)  # validates doc_split
  files = expand_inputs(inputs)
  score_field = order and order.field
  for f in files if score_field else ():
    if input_kind(f) != "jsonl":
      raise ValueError(f"--order_by={order.by} needs JSON-lines input: --input file '{f}' is not "
                       "*.jsonl / *.json(.gz)")
  num_workers = num_workers or os.cpu_count() or 1
  cache = Cache(shard_writer.join(output_dir, ".cache") if cache_dir == "" else cache_dir)
  file_hashes = [hashlib.sha256(read_raw(f)).hexdigest() for f in files]
  opts = {"tokenizer": tokenizer,
          "tokenizer_args": dict(vocab_size=vocab_size, model_type=model_type,
                                 byte_fallback=byte_fallback, character_coverage=character_coverage,
                                 max_training_chars=max_tokenizer_chars),
          "doc_args": (cleaning, doc_split, text_field)}
  given = get_tokenizer(files, file_hashes, opts, cache, num_workers) if tokenizer else None
  with Workers(num_workers, given.encoder_model if given else None) as workers:  # one pool when --tokenizer
    per_file, tok, scans, keep, counts, examples, times = _scan_and_tokenize(
        files, file_hashes, given, opts, cleaning, doc_split, text_field, cache, workers, progress, score_field)
  t_scan, t_tok, t_tokenized = times
  docs, hashes, scores = [], [], []
  for scan, mask, (tokens, lengths) in zip(scans, keep, per_file):
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    kept = np.flatnonzero(mask)
    docs.extend(tokens[offsets[k]:offsets[k + 1]] for k in range(len(kept)))
    hashes.extend(scan.hashes[j].tobytes() for j in kept)
    if score_field:
      scores.extend(float(scan.scores[j]) for j in kept)
  if not docs:
    raise ValueError(f"No documents left after cleaning {len(files)} input file(s) "
                     f"(dropped: {data_dir.by_prefix(counts, 'dropped_')}; examples: {examples})")
  report = data_dir.write_data_dir(output_dir, tok, docs, hashes, validation_fraction, seed,
                          num_train_shards, num_validation_shards, pack_length, counts,
                          extra={"cleaning": dataclasses.asdict(cleaning), "doc_split": doc_split,
                                 "text_field": text_field, "inputs": len(files)},
                          order=order, scores=scores if score_field else None,
                          min_validation=(min_validation_documents, min_validation_tokens))
  report["filter_examples"] = examples
  elapsed = time.time() - t0
  report.update(time_s=round(elapsed, 3), scan_s=round(t_scan - t0, 3), tokenizer_s=round(t_tok - t_scan, 3),
                tokenize_s=round(t_tokenized - t_tok, 3),
                tokens_per_s=round(report["tokens"] / max(elapsed, 1e-9)),
                num_workers=num_workers)
  return report
