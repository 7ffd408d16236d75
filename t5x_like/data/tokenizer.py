"""SentencePiece tokenizer: train, load, encode and decode with fixed special ids."""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
from typing import Iterable, Iterator, Sequence

import numpy as np
import sentencepiece as spm
import tensorflow as tf

from t5x_like import files

PAD_ID = 0
EOS_ID = 1
UNK_ID = 2
BOS_ID = 3
# Chat-template role markers, kept whole as single pieces in every tokenizer the project trains.
CHAT_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
# SentencePiece skips training sentences longer than this many bytes; we cut documents into
# line-aligned chunks below it.
_MAX_SENTENCE_BYTES = 8192
_VOCAB_TOO_HIGH = re.compile(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)")

log = logging.getLogger(__name__)


def _read_bytes(path: str) -> bytes:
  """Reads a whole file through tf.io.gfile (local, gs:// and other TF filesystems)."""
  try:
    with tf.io.gfile.GFile(path, "rb") as f:
      return f.read()
  except tf.errors.NotFoundError as e:
    raise FileNotFoundError(str(e)) from e


class Tokenizer:
  """A loaded SentencePiece model.

  Example:
    >>> tok = Tokenizer.load("data/pystdlib/prepared/tokenizer.model")
    >>> ids = tok.encode("def f(x):\\n    return x\\n")
    >>> tok.decode(ids + [tok.eos_id, 57])   # stops at EOS
    'def f(x):\\n    return x\\n'
  """

  def __init__(self, model_proto: bytes, path: str | None = None):
    self._proto = bytes(model_proto)
    self._sp = spm.SentencePieceProcessor(model_proto=self._proto)
    self.path = path

  @classmethod
  def load(cls, path: str) -> "Tokenizer":
    """Loads a `.model` file; a missing or unreadable file raises an error naming the path."""
    path = os.fspath(path)
    try:
      proto = _read_bytes(path)
    except FileNotFoundError as e:
      raise FileNotFoundError(f"Tokenizer model '{path}' does not exist") from e
    try:
      return cls(proto, path)
    except Exception as e:
      raise ValueError(f"Tokenizer model '{path}' is not a SentencePiece model: {e}") from e

  def save(self, path: str) -> None:
    files.write_atomic(os.fspath(path), self._proto)

  @property
  def model_proto(self) -> bytes:
    return self._proto

  @property
  def sha256(self) -> str:
    return hashlib.sha256(self._proto).hexdigest()

  @property
  def vocab_size(self) -> int:
    return self._sp.get_piece_size()

  @property
  def pad_id(self) -> int:
    return self._sp.pad_id()

  @property
  def eos_id(self) -> int:
    return self._sp.eos_id()

  @property
  def bos_id(self) -> int:
    return self._sp.bos_id()

  @property
  def unk_id(self) -> int:
    return self._sp.unk_id()

  def encode(self, text: str) -> list[int]:
    """Token ids of `text`, without BOS or EOS."""
    return self._sp.encode(text)

  def decode(self, ids: Iterable[int]) -> str:
    """Text of `ids`, stopping at the first EOS and ignoring padding."""
    out = []
    for i in np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids).reshape(-1).tolist():
      if i == self.eos_id:
        break
      if i != self.pad_id:
        out.append(int(i))
    return self._sp.decode(out)


def _training_sentences(texts: Iterable[str], max_chars: int | None) -> list[str]:
  """Cuts documents into line-aligned chunks that SentencePiece accepts, up to max_chars total."""
  out, total = [], 0
  for text in texts:
    buf, size = [], 0
    for line in text.splitlines(keepends=True):
      n = len(line.encode("utf-8"))
      if n >= _MAX_SENTENCE_BYTES:  # one very long line: hard-cut it
        line = line.encode("utf-8")[:_MAX_SENTENCE_BYTES - 16].decode("utf-8", "ignore")
        n = len(line.encode("utf-8"))
      if size + n > _MAX_SENTENCE_BYTES - 16 and buf:
        out.append("".join(buf))
        buf, size = [], 0
      buf.append(line)
      size += n
      total += len(line)
    if buf:
      out.append("".join(buf))
    if max_chars is not None and total >= max_chars:
      break
  return out


def _iter_texts(source) -> Iterator[str]:
  if isinstance(source, (str, os.PathLike)):  # a glob pattern or a file
    pattern = os.fspath(source)
    paths = sorted(tf.io.gfile.glob(pattern))
    if not paths:
      raise FileNotFoundError(f"No tokenizer training files match '{pattern}'")
    for p in paths:
      yield _read_bytes(p).decode("utf-8", "replace")
    return
  for item in source:
    if isinstance(item, os.PathLike):
      yield _read_bytes(os.fspath(item)).decode("utf-8", "replace")
    else:
      yield item


def train_tokenizer(text_iter_or_files,
                    model_prefix_or_path: str | None,
                    vocab_size: int,
                    model_type: str = "bpe",
                    byte_fallback: bool = True,
                    character_coverage: float = 0.9995,
                    max_training_chars: int | None = 20_000_000,
                    num_threads: int | None = None,
                    user_defined_symbols: Sequence[str] = ("\n",) + CHAT_TOKENS,
                    **extra_trainer_args) -> Tokenizer:
  """Trains a SentencePiece model with pad=0, eos=1, unk=2, bos=3 and writes it.

  Text is kept byte-exact (identity normalisation, no whitespace folding, no dummy prefix), so
  `decode(encode(text)) == text` for any text when byte_fallback is on: code keeps its indentation.

  Args:
    text_iter_or_files: an iterable of document strings (or of `pathlib.Path` files), or one path
      / glob pattern string naming text files.
    model_prefix_or_path: `X.model` is written as given; any other value gets `.model` appended;
      None writes nothing.
    vocab_size: requested size; when the corpus cannot support it, the largest size SentencePiece
      accepts is used instead and a warning is logged.
    model_type: "bpe" or "unigram".
    byte_fallback: unknown characters become UTF-8 byte pieces instead of <unk>.
    character_coverage: fraction of characters covered by single-character pieces.
    max_training_chars: documents are read until this many characters (None: all).
    num_threads: trainer threads (default: CPU count).
    user_defined_symbols: pieces always kept whole ("\\n" and the chat role markers by default).
    **extra_trainer_args: passed to `SentencePieceTrainer.train`.

  Returns:
    The trained Tokenizer (its `path` is the written file).
  """
  if model_type not in ("bpe", "unigram"):
    raise ValueError(f"model_type must be 'bpe' or 'unigram', got '{model_type}'")
  path = os.fspath(model_prefix_or_path) if model_prefix_or_path else None
  if path and not path.endswith(".model"):
    path += ".model"
  sentences = _training_sentences(_iter_texts(text_iter_or_files), max_training_chars)
  if not sentences:
    raise ValueError("No text to train the tokenizer on (all documents empty?)")
  args = dict(model_type=model_type, pad_id=PAD_ID, eos_id=EOS_ID, unk_id=UNK_ID, bos_id=BOS_ID,
              byte_fallback=byte_fallback, character_coverage=character_coverage,
              normalization_rule_name="identity", remove_extra_whitespaces=False,
              add_dummy_prefix=False, allow_whitespace_only_pieces=True,
              user_defined_symbols=list(user_defined_symbols), max_sentence_length=_MAX_SENTENCE_BYTES,
              num_threads=num_threads or os.cpu_count() or 1, minloglevel=2,
              hard_vocab_limit=True)
  args.update(extra_trainer_args)
  size = int(vocab_size)
  for _ in range(12):
    writer = io.BytesIO()
    try:
      spm.SentencePieceTrainer.train(sentence_iterator=iter(sentences), model_writer=writer,
                                     vocab_size=size, **args)
      break
    except RuntimeError as e:
      small = re.search(r"smaller than required_chars\. (\d+) vs (\d+)", str(e))
      if small:
        raise ValueError(
            f"tokenizer vocab_size={size} is below the {int(small.group(2)) + 4} pieces this corpus needs "
            f"({'256 byte pieces, ' if byte_fallback else ''}its characters and 4 special ids): "
            f"raise --vocab_size" + (" or pass --nobyte_fallback" if byte_fallback else "")) from None
      m = _VOCAB_TOO_HIGH.search(str(e))
      if "Vocabulary size" not in str(e) or size <= 8:
        raise
      new = int(m.group(2)) if m else size // 2
      new = min(new, size // 2) if new >= size else new
      log.warning("Tokenizer vocab_size %d is too large for this corpus; using %d instead", size, new)
      size = new
  else:
    raise RuntimeError(f"Could not train a tokenizer with vocab_size <= {vocab_size}")
  tok = Tokenizer(writer.getvalue(), path)
  if path:
    tok.save(path)
  return tok
