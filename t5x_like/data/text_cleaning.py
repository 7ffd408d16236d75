"""Per-document text functions (decode, split, clean, hash, tokenize) shared by every preprocess runner."""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
import json
import re
import unicodedata
from typing import Iterator

import numpy as np

from t5x_like.data import html_text
from t5x_like.data import near_dedup
from t5x_like.data import ordering
from t5x_like.data import quality_filters
from t5x_like.data import readers
from t5x_like.data import tokenizer_formats
from t5x_like.data.near_dedup import NearDedupConfig
from t5x_like.data.quality_filters import QualityConfig

# Cc characters except tab / newline / carriage return, plus BOM, zero-width space and the
# non-characters U+FFFE / U+FFFF.
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ufeff\u200b\ufffe\uffff]")
_EXOTIC_SPACE = re.compile("[\u00a0\u1680\u2000-\u200a\u202f\u205f\u3000]")
_TRAILING_SPACE = re.compile(r"[ \t]+\n")
_MANY_BLANK_LINES = re.compile(r"\n{3,}")
_RUN_OF_SPACES = re.compile(r"[ \t]{2,}")
_BLANK_LINE_SPLIT = re.compile(r"\n[ \t]*\n")
_SURROGATE = re.compile("[\udc80-\udcff]")


@dataclasses.dataclass(frozen=True)
class CleaningConfig:
  """Which cleaning rules run; every rule counts the documents it changed or dropped."""
  non_utf8: str = "replace"         # invalid UTF-8 bytes: "replace" each with U+FFFD, or "drop" the doc
  # HTML → its visible text (html_text: markup, scripts, styles, comments go): "auto" for .html inputs and
  # documents that are HTML by content (html_text.looks_like_html), "always", or "never" (True / False too).
  strip_html: str = "auto"
  remove_control_chars: bool = True  # delete C0/C1 controls (not \t \n), BOM, zero-width space
  unicode_form: str = "NFC"         # "NFC", "NFKC", ... or "" to keep the code points as they are
  whitespace: str = "basic"         # "none"; "basic": \r\n->\n, odd spaces->' ', strip line ends,
                                    # at most 2 blank lines; "collapse": basic + runs of spaces->' '
  min_chars: int = 1                # drop documents shorter than this after cleaning
  dedup: bool = True                # drop exact duplicates (same cleaned text) after the first, before tokenizing
  quality: QualityConfig = QualityConfig()  # heuristic quality filters (off by default)
  near_dedup: NearDedupConfig = NearDedupConfig()  # MinHash LSH near-duplicate removal (off by default)

  def __post_init__(self):
    if isinstance(self.strip_html, bool):
      object.__setattr__(self, "strip_html", "always" if self.strip_html else "never")
    if self.strip_html not in ("auto", "always", "never"):
      raise ValueError(f"strip_html must be 'auto', 'always' or 'never', got '{self.strip_html}'")
    if self.non_utf8 not in ("replace", "drop"):
      raise ValueError(f"non_utf8 must be 'replace' or 'drop', got '{self.non_utf8}'")
    if self.whitespace not in ("none", "basic", "collapse"):
      raise ValueError(f"whitespace must be 'none', 'basic' or 'collapse', got '{self.whitespace}'")
    if self.unicode_form not in ("", "NFC", "NFD", "NFKC", "NFKD"):
      raise ValueError(f"unicode_form must be NFC/NFD/NFKC/NFKD or '', got '{self.unicode_form}'")


def decode_utf8(raw: bytes) -> str:
  """Decodes bytes as UTF-8; each invalid byte becomes a lone surrogate (U+DC80..U+DCFF)."""
  return raw.decode("utf-8", "surrogateescape")


def fix_invalid_utf8(text: str, policy: str, counts: collections.Counter) -> str | None:
  """Replaces (with U+FFFD) or drops the undecodable bytes left by `decode_utf8`, counting them."""
  bad = len(_SURROGATE.findall(text))
  if not bad:
    return text
  counts["invalid_utf8_bytes"] += bad
  counts["documents_with_invalid_utf8"] += 1
  if policy == "drop":
    counts["dropped_non_utf8"] += 1
    return None
  return _SURROGATE.sub("\ufffd", text)


def split_documents(text: str, mode: str) -> list[str]:
  """Splits a plain-text file: "file" -> one document, "blank_line" -> paragraphs."""
  if mode == "file":
    return [text]
  if mode == "blank_line":
    return [d for d in _BLANK_LINE_SPLIT.split(text.replace("\r\n", "\n")) if d.strip()]
  raise ValueError(f"doc_split must be 'file' or 'blank_line', got '{mode}'")


def iter_jsonl_objects(text: str, field: str, counts: collections.Counter) -> Iterator[tuple[int, dict]]:
  """Yields (line number from 1, object) of each JSON line whose `field` is a string; bad lines and
  lines without the field are counted."""
  for number, line in enumerate(text.splitlines(), 1):
    if not line.strip():
      continue
    try:
      value = json.loads(line)
    except ValueError:
      counts["dropped_bad_json"] += 1
      continue
    if not isinstance(value, dict) or not isinstance(value.get(field), str):
      counts["dropped_missing_field"] += 1
      continue
    yield number, value


def iter_jsonl(text: str, field: str, counts: collections.Counter) -> Iterator[str]:
  """Yields `field` of each JSON line; bad lines and lines without the field are counted."""
  for _, value in iter_jsonl_objects(text, field, counts):
    yield value[field]


def is_html(text: str, config: CleaningConfig, kind: str = "text") -> bool:
  """Whether `clean_text` treats the document as HTML: per `config.strip_html`, the input kind and content."""
  if config.strip_html == "auto":
    return kind == "html" or html_text.looks_like_html(text)
  return config.strip_html == "always"


def clean_text(text: str, config: CleaningConfig, counts: collections.Counter, kind: str = "text") -> str | None:
  """Applies the cleaning rules in order; returns None (and counts why) when the document is dropped.

  `kind`: the input's kind (readers.input_kind): an "html" input is HTML under strip_html="auto".

  Example:
    >>> clean_text("<p>caf\\u0065\\u0301 &amp; tea</p>\\r\\n", CleaningConfig(strip_html=True), c)
    'café & tea\\n'
  """
  text = fix_invalid_utf8(text, config.non_utf8, counts)
  if text is None:
    return None
  if is_html(text, config, kind):
    new = html_text.html_to_text(text) + ("\n" if text.endswith(("\n", "\r")) else "")
    counts["changed_strip_html"] += new != text
    text = new
  if config.remove_control_chars:
    new = _CONTROL.sub("", text)
    counts["changed_control_chars"] += new != text
    text = new
  if config.unicode_form and not unicodedata.is_normalized(config.unicode_form, text):
    text = unicodedata.normalize(config.unicode_form, text)
    counts["changed_unicode"] += 1
  if config.whitespace != "none":
    new = _EXOTIC_SPACE.sub(" ", text.replace("\r\n", "\n").replace("\r", "\n"))
    new = _MANY_BLANK_LINES.sub("\n\n\n", _TRAILING_SPACE.sub("\n", new))
    if config.whitespace == "collapse":
      new = _RUN_OF_SPACES.sub(" ", new)
    new = new.strip(" \t\n")
    new = new + "\n" if new and text.endswith(("\n", "\r")) else new
    counts["changed_whitespace"] += new != text
    text = new
  if len(text) < max(config.min_chars, 1):
    counts["dropped_empty" if not text.strip() else "dropped_min_chars"] += 1
    return None
  return text


def content_hash(text: str) -> bytes:
  """16-byte digest of a cleaned document: the key for de-duplication and the train/val split."""
  return hashlib.sha256(text.encode("utf-8")).digest()[:16]


@dataclasses.dataclass
class FileDocuments:
  """Tokenized documents of one input file, in file order."""
  tokens: np.ndarray   # int32 (total,): documents back to back, each ending in EOS
  lengths: np.ndarray  # int64 (num_docs,): tokens per document, EOS included
  hashes: np.ndarray   # uint8 (num_docs, 16): content_hash of each cleaned document
  counts: collections.Counter
  scores: np.ndarray | None = None  # float64 (num_docs,): the --order_by=field:NAME value of each, else None


@dataclasses.dataclass
class FileScan:
  """The cleaned, filtered documents of one input file, before de-duplication and tokenization."""
  texts: list[str]
  hashes: np.ndarray   # uint8 (num_docs, 16): content_hash of each
  counts: collections.Counter
  examples: dict       # rule -> a few examples of what it removed (quality_filters.note)
  signatures: np.ndarray | None = None  # uint64 (num_docs, num_perm): MinHash of each, with near_dedup on
  scores: np.ndarray | None = None  # float64 (num_docs,): --order_by=field:NAME values, else None


def read_documents(raw: bytes, kind: str, doc_split: str, text_field: str, counts: collections.Counter,
                   name: str, score_field: str | None = None) -> tuple[list[str], list | None]:
  """The raw documents of one input (readers.input_kind `kind`) and, with `score_field`, their scores.

  A corrupt compressed or columnar input raises readers.CorruptInput; a JSON-lines input none of whose
  lines has `text_field`, or a table without that column, raises ValueError naming the file.
  """
  if kind in ("parquet", "hf_dataset"):
    if score_field:
      raise ValueError(f"--order_by=field:{score_field} needs JSON-lines input: '{name}' is {kind}")
    return readers.table_texts(raw, kind, text_field, name, counts), None
  if kind == "tfrecord":
    if score_field:
      raise ValueError(f"--order_by=field:{score_field} needs JSON-lines input: '{name}' is {kind}")
    return readers.tfrecord_texts(raw, text_field, name, counts, getattr(_worker_sp, "decode", None)), None
  text = decode_utf8(readers.decompress(raw, name))
  if not text.strip():  # an empty input: named in the report (empty_input)
    return [], None
  if kind == "jsonl":
    objects = list(iter_jsonl_objects(text, text_field, counts))
    if not objects and counts["dropped_missing_field"]:
      raise ValueError(f"Input '{name}': no JSON line has the text field '{text_field}' (--text_field)")
    scores = None
    if score_field:
      scores = [ordering.field_score(value, score_field, f"{name}:{number}") for number, value in objects]
    return [value[text_field] for _, value in objects], scores
  if score_field:
    raise ValueError(f"--order_by=field:{score_field} needs JSON-lines input: '{name}' is plain text")
  return split_documents(text, "file" if kind == "html" else doc_split), None


def scan_file(raw: bytes, kind: str, config: CleaningConfig, doc_split: str = "file", text_field: str = "text",
              score_field: str | None = None, name: str = "<input>") -> FileScan:
  """Reads, cleans, filters and hashes one input (and MinHashes it with near_dedup on); no tokenization.

  A corrupt input is skipped: counted (dropped_corrupt_input) and named in the examples, never fatal.
  """
  counts, examples = collections.Counter(), {}
  try:
    docs, scores = read_documents(raw, kind, doc_split, text_field, counts, name, score_field)
  except readers.CorruptInput as e:
    counts["dropped_corrupt_input"] += 1
    quality_filters.note(examples, "corrupt_input", str(e), whole=True)
    docs, scores = [], None
  counts["documents_in"] += len(docs) + counts["dropped_bad_json"] + counts["dropped_missing_field"]
  if not docs and not counts["dropped_corrupt_input"]:
    counts["empty_inputs"] += 1
    quality_filters.note(examples, "empty_input", name, whole=True)
  texts, kept_scores = [], []
  for k, doc in enumerate(docs):
    text = clean_text(doc, config, counts, kind)
    if text is not None:
      text = quality_filters.apply(text, config.quality, counts, examples)
    if text is not None and len(text) >= max(config.min_chars, 1):
      texts.append(text)
      if scores is not None:
        kept_scores.append(scores[k])
    elif text is not None:
      counts["dropped_empty" if not text.strip() else "dropped_min_chars"] += 1
  hashes = np.frombuffer(b"".join(content_hash(d) for d in texts), np.uint8).reshape(-1, 16)
  sigs = near_dedup.signatures(texts, config.near_dedup) if config.near_dedup.enabled else None
  return FileScan(texts, hashes, counts, examples, sigs,
                  None if scores is None else np.array(kept_scores, np.float64))


def tokenize_texts(texts: list[str], sp, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
  """(tokens int32 (total,), lengths int64 (n,)): each text encoded by `sp` (`encode(list[str])`) + EOS."""
  ids = sp.encode(texts) if texts else []
  lengths = np.array([len(x) + 1 for x in ids], np.int64)
  flat = np.full([int(lengths.sum())], eos_id, np.int32)
  is_token = np.ones_like(flat, bool)
  is_token[np.cumsum(lengths) - 1] = False  # the last slot of each document keeps EOS
  flat[is_token] = np.fromiter(itertools.chain.from_iterable(ids), np.int32, len(flat) - len(ids))
  return flat, lengths


def process_file(raw: bytes, kind: str, config: CleaningConfig, doc_split: str = "file",
                 text_field: str = "text", sp=None, eos_id: int = 1, score_field: str | None = None,
                 name: str = "<input>") -> FileDocuments:
  """Reads, cleans, filters, hashes and (when `sp` is given) tokenizes one input file, without
  de-duplication (the runners de-duplicate across files before tokenizing: `scan_file`, `tokenize_texts`).

  Args:
    raw: the file's bytes (compressed ones as stored: `name`'s extension says how to read them).
    kind: readers.input_kind of the file.
    config: cleaning rules.
    doc_split: for text files, "file" or "blank_line".
    text_field: for JSON lines, the field that holds the text; for tables, the column.
    sp: anything with `encode(list[str]) -> list[list[int]]` (a t5x_like tokenizer,
      `tokenizer_formats.encoder`); None keeps only hashes.
    eos_id: appended to each document.
    score_field: JSON lines: keep each document's numeric value of this field as its score
      (`ordering.field_score`; a line without one is an error naming `name`:line).
    name: the file's name in errors (and its extension: .gz / .zst).

  Returns:
    FileDocuments; without `sp`, tokens is empty and lengths counts characters (for stats).
  """
  scan = scan_file(raw, kind, config, doc_split, text_field, score_field, name)
  if sp is None:
    return FileDocuments(np.zeros([0], np.int32), np.array([len(d) for d in scan.texts], np.int64),
                         scan.hashes, scan.counts, scan.scores)
  tokens, lengths = tokenize_texts(scan.texts, sp, eos_id)
  scan.counts["documents_tokenized"] += len(scan.texts)
  return FileDocuments(tokens, lengths, scan.hashes, scan.counts, scan.scores)


_worker_sp = None


def init_worker(model_proto: bytes | None) -> None:
  """multiprocessing initializer: one single-threaded encoder per worker, from a SentencePiece model
  proto or an HF tokenizer.json (a tokenizer's `encoder_model`); it also decodes TFRecord token-id features."""
  global _worker_sp
  _worker_sp = None if model_proto is None else tokenizer_formats.encoder(model_proto)


def worker_scan_file(args: tuple) -> FileScan:
  """`scan_file` on (raw, kind, config, doc_split, text_field, score_field, name)."""
  return scan_file(*args)


def worker_tokenize(args: tuple) -> tuple[np.ndarray, np.ndarray]:
  """`tokenize_texts` on (texts, eos_id) with the worker's model."""
  texts, eos_id = args
  return tokenize_texts(texts, _worker_sp, eos_id)
