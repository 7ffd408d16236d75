"""Tokenizers: SentencePiece models and HF tokenizer.json files behind one interface; training.

`load(path)` takes a SentencePiece `.model` (`Tokenizer`), an HF `tokenizer.json` (`HFTokenizer`,
in hf_tokenizer.py), or a folder holding either (tokenizer.json first). Both kinds encode without
BOS/EOS, decode up to the first EOS, and have `pad_id`, `eos_id`, `bos_id`, `unk_id` (-1: none),
`vocab_size`, `token_to_id`, `filename`, `save` and `save_hf` (files `transformers.AutoTokenizer` loads).

Special ids of an HF tokenizer come from `tokenizer_config.json`, then `special_tokens_map.json`
(`bos_token`, `eos_token`, `unk_token`, `pad_token`), then `config.json` (`*_token_id`), all read
from the tokenizer.json's folder; what none names is inferred from tokenizer.json (the post-processor
template, the model's unk token, conventional names such as `</s>` or `<|endoftext|>`).

Padding. The data pipeline recognises padding by its token value (packing.segment_rows gives
`pad_id` tokens segment 0 and weight 0, and re-packing drops them), so the pad id must be one that
documents never contain, and never EOS. A tokenizer without its own pad token (Llama's SentencePiece
model has pad_id -1, HF Llama-3 and GPT-2 have none), or whose pad token is its EOS (a common
Llama-3 config), gets the first of (`tokenizer_formats.choose_pad_id`):
  1. a special token whose name contains "pad" (Llama-3.1's <|finetune_right_pad_id|>);
  2. the highest-numbered special token whose name contains "reserved" (Llama-3's reserved tokens);
  3. the unknown token, when the model cannot emit it (byte fallback or byte-level BPE);
  4. the BOS token (documents are encoded without BOS; the pipeline never writes one);
  5. `vocab_size`, one past the last id (GPT-2, whose only special token is EOS). The model's
     embedding has that row when its vocabulary is rounded up (the default rounds to 128, and
     `convert` pads imported models), and `decode` drops the id.
HF tokenizers match special tokens written in the text (as transformers does), so a document that
literally contains the chosen token's text (e.g. "<unk>", which pads HF Llama-2) holds that id, and
it then counts as padding.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
from typing import Iterable, Iterator, Sequence

import numpy as np
import sentencepiece as spm
import tensorflow as tf

from t5x_like import files
from t5x_like.data import tokenizer_formats
from t5x_like.data.hf_tokenizer import HF_CONFIG, HF_FILE, ROLES, SIDE_FILES, HFTokenizer, write_hf

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
SENTENCEPIECE_FILE = "tokenizer.model"

log = logging.getLogger(__name__)


def _read_bytes(path: str) -> bytes:
  """Reads a whole file through tf.io.gfile (local, gs:// and other TF filesystems)."""
  try:
    with tf.io.gfile.GFile(path, "rb") as f:
      return f.read()
  except tf.errors.NotFoundError as e:
    raise FileNotFoundError(str(e)) from e


class Tokenizer(tokenizer_formats.TokenizerBase):
  """A loaded SentencePiece model.

  Example:
    >>> tok = Tokenizer.load("data/pystdlib/prepared/tokenizer.model")
    >>> ids = tok.encode("def f(x):\\n    return x\\n")
    >>> tok.decode(ids + [tok.eos_id, 57])   # stops at EOS
    'def f(x):\\n    return x\\n'
  """

  filename = SENTENCEPIECE_FILE

  def __init__(self, model_proto: bytes, path: str | None = None):
    super().__init__(model_proto, path)
    self._sp = spm.SentencePieceProcessor(model_proto=self._data)
    byte0 = self._sp.piece_to_id("<0x00>")
    specials = {self._sp.id_to_piece(i): i for i in range(self._sp.get_piece_size())
                if self._sp.is_control(i)}
    self._pad = tokenizer_formats.choose_pad_id(self._sp.pad_id(), self._sp.eos_id(), self._sp.bos_id(),
                                                self._sp.unk_id(), not self._sp.is_byte(byte0), specials,
                                                self._sp.get_piece_size())

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
    files.write_atomic(os.fspath(path), self._data)

  @property
  def vocab_size(self) -> int:
    return self._sp.get_piece_size()

  @property
  def pad_id(self) -> int:
    return self._pad

  @property
  def eos_id(self) -> int:
    return self._sp.eos_id()

  @property
  def bos_id(self) -> int:
    return self._sp.bos_id()

  @property
  def unk_id(self) -> int:
    return self._sp.unk_id()

  def encode(self, text: str | Sequence[str]):
    """Token ids of `text` (or a list of id lists for a list of texts), without BOS or EOS."""
    return self._sp.encode(text)

  def _decode_ids(self, ids: list[int]) -> str:
    return self._sp.decode(ids)

  def token_to_id(self, piece: str) -> int | None:
    """The id of `piece`, or None when the vocabulary lacks it."""
    i = self._sp.piece_to_id(piece)
    return i if self._sp.id_to_piece(i) == piece else None

  def special_pieces(self) -> dict[str, int]:
    """{text: id} of the control and user-defined pieces (the chat markers, BOS/EOS): tokens never merged with
    the text around them."""
    kinds = (tokenizer_formats.CONTROL, tokenizer_formats.USER_DEFINED)
    return {piece: i for i, (piece, _, kind) in enumerate(tokenizer_formats.read_sentencepiece(self._data).pieces)
            if kind in kinds}

  def save_hf(self, output_dir: str) -> None:
    """Writes tokenizer.json + tokenizer_config.json that `transformers.AutoTokenizer` loads with
    the same ids on any text (see `tokenizer_formats.sentencepiece_to_tokenizers` for the models
    that convert: BPE, no whitespace folding)."""
    try:
      converted = tokenizer_formats.sentencepiece_to_tokenizers(self._data)
    except ValueError as e:
      raise ValueError(f"Tokenizer '{self.path}': {e}") from None
    data = converted.to_str().encode("utf-8")
    piece = lambda i: self._sp.id_to_piece(i) if 0 <= i < self.vocab_size else None
    write_hf(os.path.join(os.fspath(output_dir), HF_FILE), data,
             {r: piece(getattr(self, f"{r}_id")) for r in ROLES},
             {"split_special_tokens": True})  # control pieces are never read from text


def _read_json(path: str) -> dict | None:
  """A JSON object file, None when absent; malformed content is an error naming the file."""
  if not tf.io.gfile.exists(path):
    return None
  try:
    value = json.loads(_read_bytes(path))
  except ValueError as e:
    raise ValueError(f"'{path}' is not valid JSON: {e}") from None
  if not isinstance(value, dict):
    raise ValueError(f"'{path}' does not hold a JSON object")
  return value


def check_wrote(tok: Tokenizer | HFTokenizer, manifest: dict | None, data_dir: str) -> None:
  """Raises ValueError unless `tok` is the tokenizer whose ids DATA_DIR's records hold (the same
  file, EOS and pad id as its manifest); no manifest (no DATA_DIR), nothing to check."""
  if manifest is None:
    return
  for key, value in (("tokenizer_sha256", tok.sha256), ("eos_id", tok.eos_id), ("pad_id", tok.pad_id)):
    if manifest.get(key) != value:
      raise ValueError(f"Tokenizer '{tok.path}' did not write DATA_DIR '{data_dir}': its {key} is {value}, "
                       f"the manifest's {manifest.get(key)}")


def load(path: str) -> Tokenizer | HFTokenizer:
  """Loads a SentencePiece `.model`, an HF `tokenizer.json`, or a folder holding either.

  A folder's tokenizer.json wins over its tokenizer.model. For tokenizer.json, the
  tokenizer_config.json, special_tokens_map.json and config.json next to it name the special tokens
  (see the module docstring).

  Raises:
    FileNotFoundError: the path, or a tokenizer file in the folder, does not exist (named).
    ValueError: the file is neither kind, or its special tokens cannot be resolved (named).
  """
  path = os.fspath(path)
  if tf.io.gfile.isdir(path):
    for name in (HF_FILE, SENTENCEPIECE_FILE):
      if tf.io.gfile.exists(os.path.join(path, name)):
        return load(os.path.join(path, name))
    raise FileNotFoundError(f"Tokenizer folder '{path}' holds neither {HF_FILE} nor {SENTENCEPIECE_FILE}")
  if not tf.io.gfile.exists(path):
    raise FileNotFoundError(f"Tokenizer '{path}' does not exist")
  data = _read_bytes(path)
  if not tokenizer_formats.is_tokenizer_json(data) and not path.endswith(".json"):
    return Tokenizer.load(path)
  folder = os.path.dirname(path) or "."
  side = [(name, c) for name in SIDE_FILES if (c := _read_json(os.path.join(folder, name))) is not None]
  return HFTokenizer(data, path, config=dict(side).get(HF_CONFIG), side_files=side,
                     model_config=_read_json(os.path.join(folder, "config.json")))


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
