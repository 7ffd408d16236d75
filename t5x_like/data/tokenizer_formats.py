"""What both tokenizer kinds share, and their file formats, without TensorFlow (workers import it).

- `TokenizerBase`, `choose_pad_id`: the interface and the pad rule of `t5x_like.data.tokenizer.Tokenizer`
  (SentencePiece) and `t5x_like.data.hf_tokenizer.HFTokenizer` (tokenizer.json);
- `encoder(model)`: a single-threaded `.encode(texts) -> [ids]` from a model's bytes, either kind, for
  preprocessing workers (they must not import TensorFlow);
- `read_sentencepiece(proto)`: the fields of a SentencePiece ModelProto that a conversion needs, read
  straight from the protobuf wire format (the `sentencepiece_model_pb2` module that ships with
  sentencepiece is generated for a newer protobuf than the one TensorFlow pins);
- `sentencepiece_to_tokenizers(proto)`: the same model as a `tokenizers.Tokenizer`, giving the same ids.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from typing import Iterable, Sequence

import numpy as np
import sentencepiece as spm
import tokenizers
from tokenizers import decoders, models, normalizers

# SentencePiece piece types (sentencepiece_model.proto).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_MODEL_TYPES = {1: "unigram", 2: "bpe", 3: "word", 4: "char"}
_SPACE = "\u2581"  # SentencePiece's visible space


def is_tokenizer_json(data: bytes) -> bool:
  """True for an HF tokenizer.json (a JSON object), False for a SentencePiece proto (binary)."""
  return data.lstrip()[:1] == b"{"


class _JsonEncoder:
  """`tokenizers.Tokenizer` behind SentencePiece's `encode(str | list[str])`, without special tokens."""

  def __init__(self, tok: tokenizers.Tokenizer, parallel: bool):
    self._tok, self._parallel = tok, parallel

  def encode(self, text: str | Sequence[str]):
    if isinstance(text, str):
      return self._tok.encode(text, add_special_tokens=False).ids
    if self._parallel:
      return [e.ids for e in self._tok.encode_batch(list(text), add_special_tokens=False)]
    return [self._tok.encode(t, add_special_tokens=False).ids for t in text]


def encoder(model: bytes, parallel: bool = False):
  """An object whose `encode(text | texts)` gives token ids (no BOS/EOS) for a model's bytes.

  Args:
    model: a SentencePiece model proto or the bytes of an HF tokenizer.json.
    parallel: use the library's own threads for lists (False in worker processes).
  """
  if is_tokenizer_json(model):
    return _JsonEncoder(tokenizers.Tokenizer.from_str(model.decode("utf-8")), parallel)
  return spm.SentencePieceProcessor(model_proto=model, num_threads=0 if parallel else 1)


def choose_pad_id(declared: int, eos_id: int, bos_id: int, unk_id: int, unk_emittable: bool,
                  special_tokens: dict, vocab_size: int) -> int:
  """The pad id: `declared` when it is >= 0 and not EOS, else the first that exists of (see
  `t5x_like.data.tokenizer` for why): a special token named like padding, the highest reserved special
  token, <unk> when text cannot produce it, BOS, and `vocab_size` (one past the vocabulary).

  Args:
    declared: the tokenizer's own pad id (-1: none).
    eos_id, bos_id, unk_id: the tokenizer's ids (-1: none).
    unk_emittable: whether encoding text can produce `unk_id`.
    special_tokens: {content: id} of the special tokens.
    vocab_size: one past the largest id.
  """
  if declared >= 0 and declared != eos_id:
    return declared
  taken = {eos_id, bos_id, unk_id}
  named = sorted(i for t, i in special_tokens.items() if "pad" in t.lower() and i not in taken)
  if named:
    return named[0]
  reserved = sorted(i for t, i in special_tokens.items() if "reserved" in t.lower() and i not in taken)
  if reserved:
    return reserved[-1]
  if unk_id >= 0 and unk_id != eos_id and not unk_emittable:
    return unk_id
  if bos_id >= 0 and bos_id != eos_id:
    return bos_id
  return vocab_size


class TokenizerBase:
  """What both kinds share: the file's bytes, its hash, saving, and decoding rules."""

  filename = ""  # the name a DATA_DIR stores this kind under

  def __init__(self, data: bytes, path: str | None):
    self._data = bytes(data)
    self.path = path

  @property
  def model_proto(self) -> bytes:
    """The bytes of the file `save` writes (a SentencePiece proto or tokenizer.json)."""
    return self._data

  @property
  def sha256(self) -> str:
    return hashlib.sha256(self._data).hexdigest()

  @property
  def encoder_model(self) -> bytes:
    """Bytes from which `encoder` builds an encoder with the same ids (for workers)."""
    return self._data

  @property
  def encoding_sha256(self) -> str:
    """SHA-256 of what fixes the tokens a document becomes (the encoder and EOS): a cache key."""
    eos = int(self.eos_id).to_bytes(8, "little", signed=True)
    return hashlib.sha256(self.encoder_model + eos).hexdigest()

  def _decode_ids(self, ids: list[int]) -> str:
    raise NotImplementedError

  def decode(self, ids: Iterable[int]) -> str:
    """Text of `ids`, stopping at the first EOS; padding and ids outside the vocabulary are dropped."""
    out = []
    for i in np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids).reshape(-1).tolist():
      if i == self.eos_id:
        break
      if i != self.pad_id and 0 <= i < self.vocab_size:
        out.append(int(i))
    return self._decode_ids(out)


def _fields(data: bytes):
  """(field number, wire type, value) of one protobuf message; value: int or bytes (fixed32 as bytes)."""
  i, n = 0, len(data)

  def varint():
    nonlocal i
    shift = value = 0
    while True:
      b = data[i]
      i += 1
      value |= (b & 0x7F) << shift
      if b < 0x80:
        return value
      shift += 7

  while i < n:
    key = varint()
    field, wire = key >> 3, key & 7
    if wire == 0:
      yield field, wire, varint()
    elif wire == 1:
      yield field, wire, data[i:i + 8]
      i += 8
    elif wire == 2:
      size = varint()
      yield field, wire, data[i:i + size]
      i += size
    elif wire == 5:
      yield field, wire, data[i:i + 4]
      i += 4
    else:
      raise ValueError(f"unsupported protobuf wire type {wire} (field {field})")


@dataclasses.dataclass
class SentencePieceModel:
  """What a conversion needs from a SentencePiece ModelProto (defaults are the proto's)."""
  pieces: list  # (piece, score, type) by id
  model_type: str = "unigram"
  byte_fallback: bool = False
  treat_whitespace_as_suffix: bool = False
  normalizer_name: str = ""
  precompiled_charsmap: bytes = b""
  add_dummy_prefix: bool = True
  remove_extra_whitespaces: bool = True
  escape_whitespaces: bool = True


def read_sentencepiece(proto: bytes) -> SentencePieceModel:
  """Reads pieces, trainer and normalizer options from a serialized SentencePiece ModelProto."""
  model = SentencePieceModel(pieces=[])
  for field, _, value in _fields(proto):
    if field == 1:  # SentencePiece {1: piece, 2: score, 3: type}
      piece, score, kind = "", 0.0, NORMAL
      for f, _, v in _fields(value):
        if f == 1:
          piece = v.decode("utf-8")
        elif f == 2:
          score = struct.unpack("<f", v)[0]
        elif f == 3:
          kind = v
      model.pieces.append((piece, score, kind))
    elif field == 2:  # TrainerSpec
      for f, _, v in _fields(value):
        if f == 3:
          model.model_type = _MODEL_TYPES.get(v, str(v))
        elif f == 35:
          model.byte_fallback = bool(v)
        elif f == 24:
          model.treat_whitespace_as_suffix = bool(v)
    elif field == 3:  # NormalizerSpec
      for f, _, v in _fields(value):
        if f == 1:
          model.normalizer_name = v.decode("utf-8")
        elif f == 2:
          model.precompiled_charsmap = bytes(v)
        elif f == 3:
          model.add_dummy_prefix = bool(v)
        elif f == 4:
          model.remove_extra_whitespaces = bool(v)
        elif f == 5:
          model.escape_whitespaces = bool(v)
  return model


def _unsupported(model: SentencePieceModel) -> str | None:
  """Why a SentencePiece model cannot be converted with identical ids, or None."""
  if model.model_type != "bpe":
    return (f"model_type={model.model_type} (only BPE converts with identical ids: unigram's Viterbi ties "
            "break differently in the two libraries)")
  if model.remove_extra_whitespaces:
    return "remove_extra_whitespaces=true"
  if model.treat_whitespace_as_suffix:
    return "treat_whitespace_as_suffix=true"
  if not model.escape_whitespaces:
    return "escape_whitespaces=false"
  if any(kind == UNUSED for _, _, kind in model.pieces):
    return "UNUSED pieces"
  if model.add_dummy_prefix and any(kind == USER_DEFINED for _, _, kind in model.pieces):
    return "add_dummy_prefix=true and user-defined pieces"
  return None


def sentencepiece_to_tokenizers(proto: bytes) -> tokenizers.Tokenizer:
  """A SentencePiece BPE model as a `tokenizers.Tokenizer` that gives the same ids on any text.

  SentencePiece BPE merges, at each step, the adjacent pair whose concatenation is the
  highest-scoring piece; `tokenizers` BPE merges by rank. So every split of every normal piece
  into two normal pieces becomes a merge, ranked by the merged piece's score (ties: longer left
  part first, then ids). Spaces become U+2581 as SentencePiece escapes them; user-defined pieces
  (here "\\n" and the chat markers) are added tokens matched before BPE; control pieces (<s>, </s>,
  <pad>) and <unk> are special added tokens that, as in SentencePiece, text never produces: the
  caller must encode with `encode_special_tokens = True` (transformers: `split_special_tokens`).

  Raises:
    ValueError: the model uses an option without an exact `tokenizers` equivalent (named).
  """
  model = read_sentencepiece(proto)
  reason = _unsupported(model)
  if reason:
    raise ValueError(f"SentencePiece model with {reason} cannot be converted to tokenizer.json")
  vocab = {piece: i for i, (piece, _, _) in enumerate(model.pieces)}
  normal = {piece: (score, i) for i, (piece, score, kind) in enumerate(model.pieces) if kind == NORMAL}
  merges = []
  for piece, (score, i) in normal.items():
    for k in range(1, len(piece)):
      left, right = piece[:k], piece[k:]
      if left in normal and right in normal:
        merges.append((-score, -k, i, left, right))
  merges.sort()
  unk = next((piece for piece, _, kind in model.pieces if kind == UNKNOWN), None)
  # Without byte fallback SentencePiece emits one <unk> per run of unknown characters.
  tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for *_, a, b in merges],
                                        unk_token=unk, byte_fallback=model.byte_fallback,
                                        fuse_unk=not model.byte_fallback))
  steps = [normalizers.Precompiled(model.precompiled_charsmap)] if model.precompiled_charsmap else []
  steps += [normalizers.Prepend(_SPACE)] if model.add_dummy_prefix else []
  tok.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", _SPACE)])
  steps = [decoders.Replace(_SPACE, " ")]
  steps += [decoders.Replace(unk, " \u2047 ")] if unk else []  # how SentencePiece shows <unk>
  steps += [decoders.ByteFallback(), decoders.Fuse()]
  tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if model.add_dummy_prefix else []))
  tok.add_tokens([tokenizers.AddedToken(piece, special=False, normalized=False)
                  for piece, _, kind in model.pieces if kind == USER_DEFINED])
  tok.add_special_tokens([tokenizers.AddedToken(piece, special=True, normalized=False)
                          for piece, _, kind in model.pieces if kind in (CONTROL, UNKNOWN)])
  return tok
