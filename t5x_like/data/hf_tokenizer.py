"""An HF `tokenizers` tokenizer (tokenizer.json) with special ids resolved as transformers would.

See `t5x_like.data.tokenizer` for how the special and pad ids are chosen and for `load`.
"""

from __future__ import annotations

import json
import os
from typing import Sequence

import tokenizers

from t5x_like import files
from t5x_like.data import tokenizer_formats

HF_FILE = "tokenizer.json"
HF_CONFIG = "tokenizer_config.json"
SIDE_FILES = (HF_CONFIG, "special_tokens_map.json")  # {bos,eos,unk,pad}_token, in this order
ROLES = ("bos", "eos", "unk", "pad")
# Names that mark a special token's role when no config file names it.
_CONVENTIONAL = {"bos": ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>"),
                 "eos": ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>"),
                 "unk": ("<unk>", "[UNK]")}


def write_hf(path: str, data: bytes, tokens: dict, config: dict) -> None:
  """tokenizer.json `data` at `path`, and beside it a tokenizer_config.json (`config` with its
  tokenizer class and the special `tokens`, {role: content or None}) for transformers."""
  config = {k: v for k, v in config.items() if k not in ("auto_map", "tokenizer_file")}
  config.update(tokenizer_class="PreTrainedTokenizerFast", clean_up_tokenization_spaces=False,
                **{f"{role}_token": tokens[role] for role in ROLES})
  files.write_atomic(path, data)
  files.write_atomic(os.path.join(os.path.dirname(path) or ".", HF_CONFIG),
                     json.dumps(config, indent=1, ensure_ascii=False) + "\n")


def _config_token(value) -> str | None:
  """A tokenizer_config / special_tokens_map entry: "<s>", {"content": "<s>", ...} or null."""
  return value.get("content") if isinstance(value, dict) else value


class HFTokenizer(tokenizer_formats.TokenizerBase):
  """A Hugging Face `tokenizers` tokenizer (tokenizer.json) with resolved special ids.

  `encode(text)` is exactly `tokenizers.Tokenizer.encode(text, add_special_tokens=False).ids`
  (with `split_special_tokens` from tokenizer_config.json applied, as transformers does).

  Example:
    >>> tok = t5x_like.data.tokenizer.load("llama3/")  # tokenizer.json + tokenizer_config.json
    >>> tok.encode("def f(x):"), tok.eos_id, tok.pad_id
  """

  filename = HF_FILE

  def __init__(self, data: bytes, path: str | None = None, config: dict | None = None,
               side_files: Sequence[tuple[str, dict]] = (), model_config: dict | None = None):
    """Builds the tokenizer from tokenizer.json bytes.

    Args:
      data: the bytes of tokenizer.json.
      path: where they were read from (for messages).
      config: tokenizer_config.json's content, kept for `save_hf` (None: none).
      side_files: (file name, content) of tokenizer_config.json / special_tokens_map.json, first wins.
      model_config: config.json's content (its `*_token_id` entries are the last resort).
    """
    super().__init__(data, path)
    where = path or "tokenizer.json"
    try:
      self._tok = tokenizers.Tokenizer.from_str(self._data.decode("utf-8"))
    except Exception as e:  # pylint: disable=broad-except  (the Rust parser's errors have no common type)
      raise ValueError(f"Tokenizer '{where}' is not an HF tokenizer.json: {str(e).splitlines()[0]}") from None
    self._config = dict(config or {})
    self._split_special = bool(self._config.get("split_special_tokens", False))
    self._tok.encode_special_tokens = self._split_special
    vocab = self._tok.get_vocab(with_added_tokens=True)
    self._vocab_size = max(vocab.values(), default=-1) + 1
    spec = json.loads(self._data)
    ids = self._resolve_special_ids(spec, list(side_files), model_config or {}, where)
    model, pre = spec.get("model") or {}, json.dumps(spec.get("pre_tokenizer"))
    unk_emittable = not (model.get("byte_fallback") or '"ByteLevel"' in pre)
    specials = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
    self._bos, self._eos, self._unk = ids["bos"], ids["eos"], ids["unk"]
    self._pad = tokenizer_formats.choose_pad_id(ids["pad"], self._eos, self._bos, self._unk, unk_emittable,
                                                specials, self._vocab_size)

  def _resolve_special_ids(self, spec: dict, side_files, model_config: dict, where: str) -> dict:
    """{role: id} from the side files, config.json, then tokenizer.json itself (-1: none)."""
    out = {}
    for role in ROLES:
      for name, content in side_files:
        if f"{role}_token" in content:
          token = _config_token(content[f"{role}_token"])
          out[role] = -1 if token is None else self._tok.token_to_id(token)
          if out[role] is None:
            raise ValueError(f"Tokenizer '{where}': {name} names {role}_token '{token}', which is not in "
                             "its vocabulary")
          break
      else:
        value = model_config.get(f"{role}_token_id")
        value = value[0] if isinstance(value, list) and value else value
        out[role] = value if isinstance(value, int) else self._inferred_id(spec, role)
    if out["eos"] < 0:
      raise ValueError(f"Tokenizer '{where}' has no end-of-text token: name eos_token in a "
                       f"{HF_CONFIG} next to it (none of {', '.join(_CONVENTIONAL['eos'])} is in it)")
    return out

  def _inferred_id(self, spec: dict, role: str) -> int:
    """A role's id from tokenizer.json (`spec`) alone: the post-processor template, the model, names."""
    if role in ("bos", "eos"):
      template = (spec.get("post_processor") or {}).get("single") or []
      kinds = [next(iter(item)) for item in template]
      if "Sequence" in kinds:
        a = kinds.index("Sequence")
        side = template[:a][:1] if role == "bos" else template[a + 1:][-1:]
        for item in side:
          if "SpecialToken" in item and self._tok.token_to_id(item["SpecialToken"]["id"]) is not None:
            return self._tok.token_to_id(item["SpecialToken"]["id"])
    if role == "unk":
      model = spec.get("model") or {}
      if model.get("unk_token") and self._tok.token_to_id(model["unk_token"]) is not None:
        return self._tok.token_to_id(model["unk_token"])
      if isinstance(model.get("unk_id"), int):
        return model["unk_id"]
    for name in _CONVENTIONAL.get(role, ()):
      if self._tok.token_to_id(name) is not None:
        return self._tok.token_to_id(name)
    return -1

  @property
  def encoder_model(self) -> bytes:
    """tokenizer.json; with split_special_tokens, without its special added tokens (same ids then)."""
    if not self._split_special:
      return self._data
    spec = json.loads(self._data)
    spec["added_tokens"] = [t for t in spec.get("added_tokens") or [] if not t.get("special")]
    return json.dumps(spec).encode("utf-8")

  def save(self, path: str) -> None:
    """Writes tokenizer.json to `path` and the tokenizer_config.json that pins its special ids beside it."""
    tokens = {r: self._tok.id_to_token(i) if 0 <= i < self._vocab_size else None
              for r, i in zip(ROLES, (self.bos_id, self.eos_id, self.unk_id, self.pad_id))}
    write_hf(os.fspath(path), self._data, tokens, dict(self._config, split_special_tokens=self._split_special))

  def save_hf(self, output_dir: str) -> None:
    """Writes tokenizer.json (unchanged) and tokenizer_config.json for `transformers.AutoTokenizer`."""
    self.save(os.path.join(os.fspath(output_dir), HF_FILE))

  @property
  def vocab_size(self) -> int:
    """One past the largest id, added tokens included."""
    return self._vocab_size

  @property
  def pad_id(self) -> int:
    return self._pad

  @property
  def eos_id(self) -> int:
    return self._eos

  @property
  def bos_id(self) -> int:
    return self._bos

  @property
  def unk_id(self) -> int:
    return self._unk

  def encode(self, text: str | Sequence[str]):
    """Token ids of `text` (or a list of id lists for a list of texts), without special tokens added."""
    if isinstance(text, str):
      return self._tok.encode(text, add_special_tokens=False).ids
    return [e.ids for e in self._tok.encode_batch(list(text), add_special_tokens=False)]

  def _decode_ids(self, ids: list[int]) -> str:
    return self._tok.decode(ids, skip_special_tokens=False)

  def token_to_id(self, piece: str) -> int | None:
    """The id of `piece`, or None when the vocabulary lacks it."""
    return self._tok.token_to_id(piece)

  def special_pieces(self) -> dict[str, int]:
    """{text: id} of the added tokens (special or not): tokens the model's text never merges into others."""
    return {t.content: i for i, t in self._tok.get_added_tokens_decoder().items()}
