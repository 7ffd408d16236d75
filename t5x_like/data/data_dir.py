"""Writing a DATA_DIR from tokenized documents: the train/validation split, the shards, the tokenizer and
the manifest (last); and the report every runner prints (documents in/out, tokens, what each rule dropped)."""

from __future__ import annotations

import collections

import numpy as np
import tensorflow as tf

from t5x_like.data import ordering
from t5x_like.data import packing
from t5x_like.data import shard_writer


def by_prefix(counts, prefix: str) -> dict:
  return {k[len(prefix):]: v for k, v in sorted(counts.items()) if k.startswith(prefix) and v}


def write_data_dir(output_dir, tok, docs, hashes, validation_fraction, seed, num_train_shards,
                   num_validation_shards, pack_length, counts, extra, weights=None,
                   order: ordering.OrderSpec | None = None, scores=None, min_validation=(0, 0)) -> dict:
  """Splits, shards and writes documents, then the tokenizer and manifest (manifest last).

  `weights`: one loss-weight array per document (a chat DATA_DIR), or None (text).
  `order`: write the splits in `ordering.ORDERED_SPLITS` sorted by length, or by `scores` (one per
  document) for a field order; None: every split by the seeded shard plan.
  `min_validation`: (documents, tokens) the validation split is topped up to (shard_writer.split_documents).
  """
  tf.io.gfile.makedirs(output_dir)
  manifest_path = shard_writer.join(output_dir, shard_writer.MANIFEST)
  if tf.io.gfile.exists(manifest_path):  # an interrupted rewrite must not leave a valid manifest
    tf.io.gfile.remove(manifest_path)
  is_val = shard_writer.split_documents(hashes, validation_fraction, seed, [len(d) for d in docs], *min_validation)
  packed_dtype = packing.packed_dtype(tok.vocab_size, pack_length or 0)
  splits, score_range = {}, {}
  for split, mask, n in (("train", ~is_val, num_train_shards),
                         ("validation", is_val, num_validation_shards)):
    split_docs = [d for d, m in zip(docs, mask) if m]
    split_weights = None if weights is None else [w for w, m in zip(weights, mask) if m]
    if order is not None and split in ordering.ORDERED_SPLITS:
      split_scores = (np.array([len(d) for d in split_docs], np.float64) if scores is None
                      else np.array([x for x, m in zip(scores, mask) if m], np.float64))
      index = ordering.sorted_indices(split_scores, [h for h, m in zip(hashes, mask) if m])
      if len(index):
        score_range[split] = {"first": float(split_scores[index[0]]), "last": float(split_scores[index[-1]])}
      shards = shard_writer.write_ordered_shards(
          output_dir, split, [split_docs[j] for j in index], n, pack_length, tok.pad_id, tok.eos_id,
          packed_dtype, None if weights is None else [split_weights[j] for j in index])
    else:
      plan = shard_writer.plan_shards([len(d) for d in split_docs], n, seed)
      shards = [shard_writer.write_shard(output_dir, shard_writer.shard_name(split, i, n),
                                         [split_docs[j] for j in plan[i]], pack_length, tok.pad_id,
                                         tok.eos_id, packed_dtype,
                                         None if weights is None else [split_weights[j] for j in plan[i]])
                for i in range(n)]
    splits[split] = shard_writer.split_entry(shards)
    if weights is not None:  # the pipeline warns when conversations are longer than its rows
      splits[split]["max_document_tokens"] = max((len(d) for d in split_docs), default=0)
  tok.save(shard_writer.join(output_dir, tok.filename))
  shard_writer.remove_stale(output_dir, [s["path"] for sp in splits.values() for s in sp["shards"]])
  report = make_report(counts, splits, len(docs))
  if validation_fraction > 0 and any(min_validation):
    report["validation_minimum"] = {"documents": min_validation[0], "tokens": min_validation[1],
                                    "max_fraction": shard_writer.MAX_TOPPED_UP_FRACTION}
  if order is not None:
    extra = dict(extra, order=order.manifest_entry())
    report["order"] = {"by": order.by, **{f"{split}_{k}": v for split, r in score_range.items()
                                           for k, v in r.items()}}
  stats = {k: v for k, v in report.items() if k not in ("documents_tokenized", "cache_hits")}
  manifest = shard_writer.make_manifest(tok, splits, pack_length, dict(extra, seed=seed, stats=stats),
                                        data_format="text" if weights is None else "chat")
  shard_writer.write_json(manifest_path, manifest)
  return report


def make_report(counts: collections.Counter, splits: dict, documents_out: int) -> dict:
  """The counts every runner reports: documents in/out, tokens, dropped/changed by rule."""
  keys = ("num_documents", "num_tokens", "num_records")
  return {
      "documents_in": counts["documents_in"],
      "documents_out": documents_out,
      "tokens": sum(s["num_tokens"] for s in splits.values()),
      "train": {k: splits["train"][k] for k in keys},
      "validation": {k: splits["validation"][k] for k in keys},
      "dropped": by_prefix(counts, "dropped_"),
      "changed": by_prefix(counts, "changed_"),
      "invalid_utf8_bytes": counts["invalid_utf8_bytes"],
      "documents_with_invalid_utf8": counts["documents_with_invalid_utf8"],
      "documents_tokenized": counts["documents_tokenized"],
      "cache_hits": counts["cache_hits"],
  }


def format_report(report: dict) -> str:
  """A Markdown table of the report's scalar entries and the per-rule counts."""
  rows = ["| item | value |", "|---|---|"]
  for k, v in report.items():
    if isinstance(v, dict):
      v = ", ".join(f"{a}={b}" for a, b in v.items()) or "-"
    elif isinstance(v, list):
      v = "; ".join(str(x).replace("|", "\\|") for x in v) or "-"
    rows.append(f"| {k} | {v} |")
  return "\n".join(rows)
