"""Preference pairs (DPO data): JSON-lines parsing, rendering with the chat template, and rows that hold whole pairs.

A line is {"prompt": P, "chosen": C, "rejected": R}. P is a string (one user turn) or a message list in the
chat format (`chat.parse_conversation`'s messages); C and R are the assistant's answer as a string, or a
one-message list [{"role": "assistant", "content": ...}]. Each side is rendered exactly as chat SFT renders
the conversation P + [assistant: C] (the same `ChatTemplate`, EOS last), with loss weight 1 on the response
tokens only (the final assistant turn's content and its end marker; 0 on the prompt, even on assistant
turns inside it).

Record format ("preference" DATA_DIRs). Rows are always pre-packed (`--pack_length` = SEQ_LEN + 1) in the
raw-row format of `packing` with 4 channels (tokens, segment ids, positions, weights), so the input
pipeline reads them as they are, never re-cutting a row. A row holds whole pairs, each as two adjacent
segments: pair k of a row is segment 2k+1 (prompt + chosen) followed by segment 2k+2 (prompt + rejected).
A pair is never split across rows; padding is segment 0. The manifest records `max_pairs_per_row`, the
largest number of pairs in any row, which bounds the objective's per-row pair count.

Unpaired examples (`preprocess --format=unpaired`, KTO's thumbs-up / thumbs-down data): a line is
{"prompt": P, "completion": C, "label": true|false}. An example is a pair with one side empty: a desirable one
(label true) takes its pair's chosen segment 2k+1 and leaves 2k+2 empty, an undesirable one the rejected segment
2k+2, so the label is where the example sits and the rows are read like pairs. The manifest records
"unpaired": true; only objectives that read one side at a time (KTO) accept such a DATA_DIR.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from typing import Sequence

import numpy as np
import tensorflow as tf

from t5x_like.data import chat
from t5x_like.data import packing
from t5x_like.data import shard_writer


KEYS = ("prompt", "chosen", "rejected")
# Why a line is not used, beyond chat.MALFORMED_REASONS; counted as dropped_malformed_<reason>.
REASONS = ("missing_key", "same_response")


@dataclasses.dataclass(frozen=True)
class Pair:
  """One rendered pair: (ids, weights) of prompt + chosen and of prompt + rejected, int32 each."""
  chosen: tuple
  rejected: tuple

  def __len__(self) -> int:
    return len(self.chosen[0]) + len(self.rejected[0])

  def digest(self) -> bytes:
    h = hashlib.sha256()
    for ids, weights in (self.chosen, self.rejected):
      h.update(np.int64(len(ids)).tobytes() + ids.tobytes() + weights.tobytes())
    return h.digest()[:16]


def _response(value, key: str) -> str:
  if isinstance(value, str):
    return value
  if (isinstance(value, list) and len(value) == 1 and isinstance(value[0], dict)
      and value[0].get("role") == "assistant" and isinstance(value[0].get("content"), str)):
    return value[0]["content"]
  raise chat.MalformedLine("wrong_shape", f"'{key}' must be a string or [{{\"role\": \"assistant\", "
                           "\"content\": str}]")


def _check_keys(obj, keys: Sequence[str]) -> None:
  """A line must be a JSON object holding `keys` (wrong_shape, missing_key otherwise)."""
  if not isinstance(obj, dict):
    raise chat.MalformedLine("wrong_shape", f"a JSON {type(obj).__name__}, not an object with "
                             f"{', '.join(repr(k) for k in keys)}")
  missing = [k for k in keys if k not in obj]
  if missing:
    raise chat.MalformedLine("missing_key", f"missing key {', '.join(repr(k) for k in missing)}")


def parse_prompt(prompt) -> list[tuple[str, str]]:
  """The messages of a line's "prompt": a string (one user turn) or a message list in the chat format.

  Raises:
    chat.MalformedLine: another shape (wrong_shape), a message with empty content (empty_content).
  """
  if isinstance(prompt, str):
    messages = [("user", prompt)]
  elif isinstance(prompt, list):
    messages = chat._messages(prompt, "prompt")  # pylint: disable=protected-access  (the chat format's own check)
  else:
    raise chat.MalformedLine("wrong_shape", "'prompt' must be a string or a list of messages")
  for i, (role, content) in enumerate(messages):
    if not content.strip():
      raise chat.MalformedLine("empty_content", f"prompt message {i} ({role}) has empty content")
  return messages


def parse_pair(obj) -> tuple[list[tuple[str, str]], str, str]:
  """(prompt messages, chosen text, rejected text) of one decoded JSON line.

  Raises:
    chat.MalformedLine: not an object, a missing key (missing_key), a wrong shape, an empty prompt or
      response (empty_content), or chosen equal to rejected (same_response).
  """
  _check_keys(obj, KEYS)
  messages = parse_prompt(obj["prompt"])
  chosen, rejected = _response(obj["chosen"], "chosen"), _response(obj["rejected"], "rejected")
  for key, text in (("chosen", chosen), ("rejected", rejected)):
    if not text.strip():
      raise chat.MalformedLine("empty_content", f"'{key}' is empty")
  if chosen == rejected:
    raise chat.MalformedLine("same_response", "'chosen' equals 'rejected': the pair prefers nothing")
  return messages, chosen, rejected


def render_side(encoder: chat.ChatEncoder, messages, response: str) -> tuple[np.ndarray, np.ndarray]:
  """(ids, weights) of prompt + response as chat SFT renders it, weight 1 only on the response's tokens."""
  doc = encoder.render(list(messages) + [("assistant", response)])
  prompt = len(encoder.prompt_ids(messages))  # the turns before, then the assistant marker
  weights = doc.weights.copy()
  weights[:prompt] = 0
  return doc.ids, weights


def render_pair(encoder: chat.ChatEncoder, obj) -> Pair:
  messages, chosen, rejected = parse_pair(obj)
  return Pair(render_side(encoder, messages, chosen), render_side(encoder, messages, rejected))


UNPAIRED_KEYS = ("prompt", "completion", "label")
_EMPTY = (np.zeros(0, np.int32), np.zeros(0, np.int32))


def render_example(encoder: chat.ChatEncoder, obj) -> Pair:
  """An unpaired example {"prompt", "completion", "label"} as a pair with one side empty (the module docstring).

  Raises:
    chat.MalformedLine: a missing key (missing_key: a line without its label among them), a label that is not
      true or false (wrong_shape), an empty prompt or completion (empty_content).
  """
  _check_keys(obj, UNPAIRED_KEYS)
  if not isinstance(obj["label"], bool):
    raise chat.MalformedLine("wrong_shape", f"'label' must be true or false, got {obj['label']!r}")
  messages, completion = parse_prompt(obj["prompt"]), _response(obj["completion"], "completion")
  if not completion.strip():
    raise chat.MalformedLine("empty_content", "'completion' is empty")
  side = render_side(encoder, messages, completion)
  return Pair(side, _EMPTY) if obj["label"] else Pair(_EMPTY, side)


@dataclasses.dataclass
class PreferencePairs:
  """The pairs read from JSON-lines files, with what was dropped and why."""
  pairs: list = dataclasses.field(default_factory=list)  # Pair, in input order
  counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  malformed_lines: list = dataclasses.field(default_factory=list)  # "file:line: reason: detail", first few


def read_pairs(files: Sequence[tuple[str, str]], encoder: chat.ChatEncoder, max_tokens: int,
               unpaired: bool = False) -> PreferencePairs:
  """Parses and renders every JSON line of `files` ((name, text) each): pairs, or with `unpaired` labelled
  examples (`render_example`).

  A pair longer than `max_tokens` (both sides, EOS included) does not fit a row and is counted as
  dropped_too_long; every other unusable line as dropped_malformed_<reason>, the first few named by
  file:line. Blank lines are skipped.
  """
  out = PreferencePairs()
  for where, line in chat.json_lines(files):
    out.counts["documents_in"] += 1
    try:
      pair = (render_example if unpaired else render_pair)(encoder, chat.load_line(line))
    except chat.MalformedLine as e:
      chat.count_malformed(out.counts, out.malformed_lines, where, e, "preference")
      continue
    if len(pair) > max_tokens:
      out.counts["dropped_too_long"] += 1
      continue
    out.pairs.append(pair)
  chat.warn_malformed_total(out.counts, out.malformed_lines, "preference")
  return out


def pack_pairs_np(pairs: Sequence[Pair], length: int, pad_id: int) -> np.ndarray:
  """Whole pairs into rows of `length` in order (next-fit): pair k of a row is segments 2k+1 (chosen) and
  2k+2 (rejected); positions restart at 0 in each segment. Every pair must fit (len(pair) <= length).

  Returns:
    int32 (R, 4, length): tokens, segment ids, positions, weights.
  """
  rows, row, fill, segment = [], packing.empty_row(length, pad_id), 0, 0
  for pair in pairs:
    if len(pair) > length:
      raise ValueError(f"a preference pair of {len(pair)} tokens does not fit a row of {length}")
    if fill + len(pair) > length:
      rows.append(row)
      row, fill, segment = packing.empty_row(length, pad_id), 0, 0
    for ids, weights in (pair.chosen, pair.rejected):
      n = len(ids)
      segment += 1
      row[:, fill:fill + n] = [ids, np.full(n, segment), np.arange(n), weights]
      fill += n
  if fill:
    rows.append(row)
  return np.stack(rows) if rows else np.zeros([0, 4, length], np.int32)


def write_shard(output_dir: str, name: str, pairs: Sequence[Pair], length: int, pad_id: int,
                dtype: str) -> dict:
  """One shard of packed pair rows; its manifest entry (num_documents = pairs) plus max_pairs_per_row."""
  rows = pack_pairs_np(pairs, length, pad_id)
  entry = {"path": name, "num_documents": len(pairs), "num_tokens": int(sum(len(p) for p in pairs))}
  entry.update(shard_writer.write_records(shard_writer.join(output_dir, name),
                                          (packing.serialize_packed_row(r, dtype) for r in rows)))
  pairs_per_row = (rows[:, packing.SEGMENTS].max(axis=1) + 1) // 2 if len(rows) else np.zeros([0])
  return entry, int(pairs_per_row.max(initial=0))


def write_data_dir(output_dir: str, tok, pairs: Sequence[Pair], *, pack_length: int, validation_fraction: float,
                   seed: int, num_train_shards: int, num_validation_shards: int, counts, extra: dict) -> dict:
  """Splits pairs by content hash, shards them (balanced by tokens), writes the rows and the tokenizer.

  Returns:
    (manifest path, manifest (format "preference"; the caller adds its stats and writes it last), split
    entries, max_pairs_per_row).
  """
  tf.io.gfile.makedirs(output_dir)
  manifest_path = shard_writer.join(output_dir, shard_writer.MANIFEST)
  if tf.io.gfile.exists(manifest_path):  # an interrupted rewrite must not leave a valid manifest
    tf.io.gfile.remove(manifest_path)
  is_val = shard_writer.split_documents([p.digest() for p in pairs], validation_fraction, seed)
  dtype = packing.packed_dtype(tok.vocab_size, pack_length)
  splits, most = {}, 0
  for split, mask, n in (("train", ~is_val, num_train_shards), ("validation", is_val, num_validation_shards)):
    split_pairs = [p for p, m in zip(pairs, mask) if m]
    plan = shard_writer.plan_shards([len(p) for p in split_pairs], n, seed)
    shards = []
    for i in range(n):
      entry, per_row = write_shard(output_dir, shard_writer.shard_name(split, i, n),
                                   [split_pairs[j] for j in plan[i]], pack_length, tok.pad_id, dtype)
      shards.append(entry)
      most = max(most, per_row)
    splits[split] = shard_writer.split_entry(shards)
    splits[split]["max_document_tokens"] = max((len(p) for p in split_pairs), default=0)
  tok.save(shard_writer.join(output_dir, tok.filename))
  shard_writer.remove_stale(output_dir, [s["path"] for sp in splits.values() for s in sp["shards"]])
  manifest = shard_writer.make_manifest(tok, splits, pack_length, dict(extra, seed=seed, max_pairs_per_row=most),
                                        data_format="preference")
  return manifest_path, manifest, splits, most
