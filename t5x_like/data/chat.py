"""Chat / instruction data: the chat template, JSON-lines parsing, and rendering to token ids with loss weights."""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
from typing import Iterable, Sequence

import numpy as np

from t5x_like.data import ordering
from t5x_like.data import tokenizer as tokenizer_lib

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
# Why a JSON line is not used; each is counted as dropped_malformed_<reason> in the preprocess report.
MALFORMED_REASONS = ("bad_json", "wrong_shape", "unknown_role", "no_assistant", "empty_content",
                     "marker_in_content", "system_unsupported")
EXAMPLES_KEPT = 10  # malformed lines named (file:line) in the report and in warnings


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
  """How a conversation becomes text: each turn is `<marker>content<end>separator`.

  The default renders

    <|system|>Be brief.<|end|>\\n<|user|>Hi<|end|>\\n<|assistant|>Hello!<|end|>\\n<EOS>

  A marker starts with a single token of the tokenizer, looked up as such (never encoded from text), so it
  cannot merge with the content next to it; what follows that token is encoded as text. The defaults are
  single tokens, `tokenizer.CHAT_TOKENS`, reserved in every tokenizer the project trains; a Hugging Face
  model's template has markers such as ChatML's `<|im_start|>user\n` (`interop.chat_templates` derives
  them). `end` must be one token (generation stops at it). Loss weights: 1 on each assistant turn's
  content tokens and its end marker (the model learns to answer and to stop), 0 on the prefix, markers,
  separators, system and user turns and the EOS. Bound in gin as `data.ChatTemplate.<field>`; a chat
  DATA_DIR records the template it was written with.
  """
  system: str = tokenizer_lib.CHAT_TOKENS[0]     # opens a system turn
  user: str = tokenizer_lib.CHAT_TOKENS[1]       # opens a user turn
  assistant: str = tokenizer_lib.CHAT_TOKENS[2]  # opens an assistant turn (the generation prompt ends with it)
  end: str = tokenizer_lib.CHAT_TOKENS[3]        # closes every turn
  separator: str = "\n"                          # text after each end marker ("" for none); weight 0
  default_system: str = ""                       # system turn put first when a conversation has none ("": none)
  prefix: str = ""                               # text before the first turn (a BOS token); weight 0

  def markers(self) -> dict[str, str]:
    """{name: marker} of the markers the template needs (no system marker: the template has no system turn)."""
    names = ("system", "user", "assistant", "end") if self.system else ("user", "assistant", "end")
    return {name: getattr(self, name) for name in names}


def template_from_manifest(manifest: dict) -> ChatTemplate:
  """The template a chat DATA_DIR was written with (the default for one written without a record)."""
  return ChatTemplate(**manifest.get("chat_template", {}))


class MalformedLine(ValueError):
  """A JSON line that is not a usable conversation; `reason` is one of MALFORMED_REASONS."""

  def __init__(self, reason: str, detail: str):
    super().__init__(f"{reason}: {detail}")
    self.reason = reason


def _messages(value, key: str) -> list[tuple[str, str]]:
  if not isinstance(value, list) or not value:
    raise MalformedLine("wrong_shape", f"'{key}' must be a non-empty list of {{role, content}} objects")
  out = []
  for i, m in enumerate(value):
    if not isinstance(m, dict) or "role" not in m or "content" not in m:
      raise MalformedLine("wrong_shape", f"{key}[{i}] must be an object with keys 'role' and 'content'")
    if m["role"] not in ROLES:
      raise MalformedLine("unknown_role", f"{key}[{i}] has role {m['role']!r} (expected one of {ROLES})")
    if not isinstance(m["content"], str):
      raise MalformedLine("wrong_shape", f"{key}[{i}].content must be a string")
    out.append((m["role"], m["content"]))
  return out


def parse_conversation(obj) -> list[tuple[str, str]]:
  """[(role, content), ...] from one decoded JSON line.

  Accepted shapes: {"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]} and
  {"prompt": str, "completion": str} (either may also be a list of messages, as in TRL's
  conversational prompt-completion data). Other keys are ignored.

  Raises:
    MalformedLine: wrong shape or missing key, an unknown role, no assistant turn, empty content.
  """
  if not isinstance(obj, dict):
    raise MalformedLine("wrong_shape", f"a JSON {type(obj).__name__}, not an object with 'messages' "
                        "or 'prompt' and 'completion'")
  if "messages" in obj:
    messages = _messages(obj["messages"], "messages")
  elif "prompt" in obj or "completion" in obj:
    messages = []
    for key, role in (("prompt", "user"), ("completion", "assistant")):
      if key not in obj:
        raise MalformedLine("wrong_shape", f"missing key '{key}'")
      value = obj[key]
      if isinstance(value, str):
        messages.append((role, value))
      elif isinstance(value, list):
        messages.extend(_messages(value, key))
      else:
        raise MalformedLine("wrong_shape", f"'{key}' must be a string or a list of messages")
  else:
    raise MalformedLine("wrong_shape", "missing key 'messages' (or 'prompt' and 'completion')")
  for i, (role, content) in enumerate(messages):
    if not content.strip():
      raise MalformedLine("empty_content", f"message {i} ({role}) has empty content")
  if not any(role == "assistant" for role, _ in messages):
    raise MalformedLine("no_assistant", "no assistant turn to learn from")
  return messages


def load_line(line: str | bytes):
  """One decoded JSON line; bad JSON raises MalformedLine("bad_json")."""
  try:
    return json.loads(line)
  except ValueError as e:
    raise MalformedLine("bad_json", str(e)) from None


def parse_line(line: str | bytes) -> list[tuple[str, str]]:
  """`parse_conversation` of one JSON line; bad JSON raises MalformedLine("bad_json")."""
  return parse_conversation(load_line(line))


def prompt_and_reference(messages: Sequence[tuple[str, str]]) -> tuple[list, str]:
  """(the turns before the last assistant turn, that turn's content): a generation prompt and its reference."""
  last = max(i for i, (role, _) in enumerate(messages) if role == "assistant")
  return list(messages[:last]), messages[last][1]


def token_id(tokenizer, piece: str) -> int | None:
  """The id of `piece` as one token of `tokenizer`, or None when it has no such token.

  Works with anything that has `token_to_id` (the project's tokenizer classes, HF `tokenizers.Tokenizer`)
  or `piece_to_id` (a `sentencepiece.SentencePieceProcessor`, which maps an absent piece to unk).
  """
  if hasattr(tokenizer, "token_to_id"):
    return tokenizer.token_to_id(piece)
  i = tokenizer.piece_to_id(piece)
  return i if tokenizer.id_to_piece(i) == piece else None


@dataclasses.dataclass(frozen=True)
class Rendered:
  """One conversation as tokens. ids, weights: (n,) int32; turn_ends: the end index of each turn."""
  ids: np.ndarray
  weights: np.ndarray
  turn_ends: tuple[int, ...]
  roles: tuple[str, ...]


class ChatEncoder:
  """Renders conversations with a template into (token ids, loss weights), piece by piece.

  Example (the default template):
    >>> ChatEncoder(tok).render([("user", "Hi"), ("assistant", "Yo")])
    pieces   <|user|>  Hi  <|end|>  \\n  <|assistant|>  Yo  <|end|>  \\n  EOS
    weights     0       0     0      0        0         1      1     0    0
  """

  def __init__(self, tokenizer, template: ChatTemplate = ChatTemplate(), *, train_on_prompt: bool = False,
               tokenizer_path: str | None = None):
    """Resolves the template's markers to ids.

    Args:
      tokenizer: see `token_id`; also needs `encode(text)` (no BOS/EOS) and `eos_id`.
      template: the chat template.
      train_on_prompt: weight 1 on every token (markers, system and user turns, EOS), not only assistant turns.
      tokenizer_path: named in errors (default: `tokenizer.path`).

    Raises:
      ValueError: a marker that does not start with a single token of the tokenizer, an end marker that is not
        one token, markers that are not distinct (naming them and the tokenizer).
    """
    self.tokenizer, self.template, self.train_on_prompt = tokenizer, template, train_on_prompt
    path = tokenizer_path or getattr(tokenizer, "path", None) or "<in memory>"
    if template.default_system and not template.system:
      raise ValueError("data.ChatTemplate.default_system needs a system marker (ChatTemplate.system is empty)")
    self.marker_seqs = {}  # name → the marker's token ids
    for name, text in template.markers().items():
      ids = marker_tokens(tokenizer, text)
      if ids is None:
        raise ValueError(f"chat template marker {text!r} (ChatTemplate.{name}) is not a single token of the "
                         f"tokenizer '{path}' (nor text that starts with one of its special tokens): use a tokenizer "
                         f"that reserves it, or bind data.ChatTemplate.{name}")
      self.marker_seqs[name] = tuple(ids)
    if len(self.marker_seqs["end"]) != 1:
      raise ValueError(f"chat template end marker {template.end!r} is {len(self.marker_seqs['end'])} tokens of "
                       f"'{path}': it must be one token (generation stops at it)")
    if len(set(self.marker_seqs.values())) < len(self.marker_seqs):
      raise ValueError(f"chat template markers {template.markers()} are not distinct tokens of '{path}'")
    self.marker_ids = {name: ids[0] for name, ids in self.marker_seqs.items()}  # name → the marker's first token
    self.end_id = self.marker_ids["end"]
    self.separator_ids = list(tokenizer.encode(template.separator)) if template.separator else []
    self.prefix_ids = (marker_tokens(tokenizer, template.prefix) or list(tokenizer.encode(template.prefix))
                       if template.prefix else [])
    # content may not hold a marker, nor the text of a marker's leading token (it would read as that token)
    self._forbidden = tuple(sorted({text for text in template.markers().values()} | set(
        marker_pieces(tokenizer, template))))

  def _turn(self, role: str, content: str) -> tuple[list[int], list[int]]:
    if role == "system" and "system" not in self.marker_seqs:
      raise MalformedLine("system_unsupported", "the chat template has no system turn (ChatTemplate.system is empty)")
    if any(m in content for m in self._forbidden):
      raise MalformedLine("marker_in_content", f"{role} content contains a template marker "
                          f"({', '.join(m for m in self._forbidden if m in content)})")
    body = list(self.tokenizer.encode(content))
    learn = 1 if (role == "assistant" or self.train_on_prompt) else 0
    prompt = 1 if self.train_on_prompt else 0
    marker = list(self.marker_seqs[role])
    ids = marker + body + [self.end_id] + self.separator_ids
    weights = [prompt] * len(marker) + [learn] * (len(body) + 1) + [prompt] * len(self.separator_ids)
    return ids, weights

  def _turns(self, messages: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    if self.template.default_system and not any(role == "system" for role, _ in messages):
      return [("system", self.template.default_system)] + list(messages)
    return list(messages)

  def render(self, messages: Sequence[tuple[str, str]]) -> Rendered:
    """The whole conversation (after the template's prefix) followed by EOS (one training document).

    Raises:
      MalformedLine("marker_in_content"): a content string holds a template marker;
      MalformedLine("system_unsupported"): a system turn, where the template has none.
    """
    ids, ends, roles = list(self.prefix_ids), [], []
    weights = [1 if self.train_on_prompt else 0] * len(ids)
    for role, content in self._turns(messages):
      i, w = self._turn(role, content)
      ids += i
      weights += w
      ends.append(len(ids))
      roles.append(role)
    ids.append(self.tokenizer.eos_id)
    weights.append(1 if self.train_on_prompt else 0)
    return Rendered(np.asarray(ids, np.int32), np.asarray(weights, np.int32), tuple(ends), tuple(roles))

  def prompt_ids(self, messages: Sequence[tuple[str, str]]) -> list[int]:
    """Token ids that ask for the next assistant turn: the prefix, the turns as rendered, the assistant marker."""
    ids = list(self.prefix_ids)
    for role, content in self._turns(messages):
      ids += self._turn(role, content)[0]
    return ids + list(self.marker_seqs["assistant"])

  def turns_of(self, ids: Iterable[int]) -> list[tuple[str, str]]:
    """The (role, content) turns of rendered token ids (the inverse of rendering; a turn left open, such as a
    prompt's final assistant marker, is not returned)."""
    seqs = sorted(((seq, name) for name, seq in self.marker_seqs.items() if name != "end"), key=lambda x: -len(x[0]))
    ids = np.asarray(list(ids)).reshape(-1).tolist()
    out, role, body, k = [], None, [], 0
    while k < len(ids):
      opened = next((name, len(seq)) for seq, name in seqs + [((), None)] if tuple(ids[k:k + len(seq)]) == seq)
      if opened[0] is not None:
        role, body = opened[0], []
        k += opened[1]
        continue
      if ids[k] == self.end_id and role is not None:
        out.append((role, self.tokenizer.decode(body)))
        role = None
      elif role is not None:
        body.append(int(ids[k]))
      k += 1
    return out

  def next_turn_ids(self, role: str, content: str) -> list[int]:
    """Token ids that follow a generated assistant turn (which ends with its end marker) to add a `role` turn and
    ask for the next assistant turn: the separator, the turn as rendered, then the assistant marker."""
    return self.separator_ids + self._turn(role, content)[0] + list(self.marker_seqs["assistant"])

  def completion_text(self, ids: Iterable[int]) -> str:
    """The generated assistant text: `ids` up to the first end marker or EOS, decoded."""
    out = []
    for i in np.asarray(list(ids)).reshape(-1).tolist():
      if i in (self.end_id, self.tokenizer.eos_id):
        break
      out.append(int(i))
    return self.tokenizer.decode(out)


def marker_tokens(tokenizer, text: str) -> list[int] | None:
  """A marker's token ids, or None when it is not a marker of `tokenizer`.

  A marker is one token (any token: `token_id`), or text that starts with a special piece of the tokenizer
  (`tokenizer.special_pieces()`: HF added tokens, SentencePiece control and user-defined pieces): every special
  piece in it is its own id, the text between them is encoded."""
  whole = token_id(tokenizer, text)
  if whole is not None:
    return [whole]
  special = getattr(tokenizer, "special_pieces", dict)()
  ids, k, run = [], 0, ""
  while k < len(text):
    piece = max((p for p in special if p and text.startswith(p, k)), key=len, default=None)
    if piece is None:
      if not ids:
        return None  # the marker does not start with a special piece
      run += text[k]
      k += 1
      continue
    ids += list(tokenizer.encode(run)) if run else []
    ids.append(special[piece])
    run, k = "", k + len(piece)
  return ids + (list(tokenizer.encode(run)) if run else [])


def marker_pieces(tokenizer, template: ChatTemplate) -> dict[str, int]:
  """{text: id} of the single tokens the template's markers start with (the whole marker where it is one token; the
  prefix's too); markers the tokenizer lacks are left out. These are the tokens a base pre-trained on plain text
  never saw (LoRA's marker rows) and what a text rendering of a conversation must map back to their ids."""
  special, out = getattr(tokenizer, "special_pieces", dict)(), {}
  for text in list(template.markers().values()) + ([template.prefix] if template.prefix else []):
    whole = token_id(tokenizer, text)
    if whole is not None:
      out[text] = whole
    elif marker_tokens(tokenizer, text) is not None:
      piece = max((p for p in special if p and text.startswith(p)), key=len)
      out[piece] = special[piece]
  return out


def truncate(doc: Rendered, max_tokens: int, eos_id: int) -> Rendered | None:
  """Fits a conversation in `max_tokens` (EOS included) at a turn boundary, or None to drop it.

  Rule: keep the longest run of whole turns from the start that ends with an assistant turn and fits
  with its EOS; a conversation whose first assistant turn does not fit is dropped.
  """
  if len(doc.ids) <= max_tokens:
    return doc
  keep = [k for k, (end, role) in enumerate(zip(doc.turn_ends, doc.roles))
          if role == "assistant" and end + 1 <= max_tokens]
  if not keep:
    return None
  end = doc.turn_ends[keep[-1]]
  eos_weight = doc.weights[-1]
  return Rendered(np.append(doc.ids[:end], np.int32(eos_id)), np.append(doc.weights[:end], eos_weight),
                  doc.turn_ends[:keep[-1] + 1], doc.roles[:keep[-1] + 1])


@dataclasses.dataclass
class ChatDocuments:
  """The conversations read from JSON-lines files, rendered, with what was dropped and why."""
  docs: list = dataclasses.field(default_factory=list)       # Rendered, in input order
  counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  malformed_lines: list = dataclasses.field(default_factory=list)  # "file:line: reason: detail", first few
  scores: list = dataclasses.field(default_factory=list)  # per doc: the score_field value (when one is asked)


def json_lines(files: Sequence[tuple[str, str]]):
  """(where "file:line", line) for every non-blank line of `files` ((name, text) each)."""
  for name, text in files:
    for number, line in enumerate(text.splitlines(), 1):
      if line.strip():
        yield f"{name}:{number}", line


def count_malformed(counts: collections.Counter, examples: list, where: str, error: MalformedLine, kind: str) -> None:
  """Counts a malformed line under dropped_malformed_<reason>; names the first EXAMPLES_KEPT (file:line)."""
  counts[f"dropped_malformed_{error.reason}"] += 1
  if len(examples) < EXAMPLES_KEPT:
    examples.append(f"{where}: {error}")
    log.warning("Skipping malformed %s line %s: %s", kind, where, error)


def warn_malformed_total(counts: collections.Counter, examples: list, kind: str) -> None:
  malformed = sum(v for k, v in counts.items() if k.startswith("dropped_malformed_"))
  if malformed > len(examples):
    log.warning("%d malformed %s lines in all (the first %d named above)", malformed, kind, len(examples))


def read_conversations(files: Sequence[tuple[str, str]], encoder: ChatEncoder,
                       max_tokens: int | None = None, score_field: str | None = None) -> ChatDocuments:
  """Parses, renders and length-checks every JSON line of `files`.

  Args:
    files: (name used in messages, text) per input file.
    encoder: the template and tokenizer.
    max_tokens: conversations longer than this (EOS included) are cut by `truncate` (None: no limit).
    score_field: keep each conversation's numeric value of this field in `scores`
      (`ordering.field_score`: a conversation without one is a ValueError naming file:line).

  Returns:
    ChatDocuments. Blank lines are skipped; every other line is either a document or counted under
    counts["dropped_malformed_<reason>"] / ["dropped_too_long"] (and ["changed_truncated"] when cut).
  """
  out = ChatDocuments()
  for where, line in json_lines(files):
    out.counts["documents_in"] += 1
    try:
      obj = load_line(line)
      doc = encoder.render(parse_conversation(obj))
    except MalformedLine as e:
      count_malformed(out.counts, out.malformed_lines, where, e, "chat")
      continue
    score = ordering.field_score(obj, score_field, where) if score_field else None
    if max_tokens is not None and len(doc.ids) > max_tokens:
      doc = truncate(doc, max_tokens, encoder.tokenizer.eos_id)
      if doc is None:
        out.counts["dropped_too_long"] += 1
        continue
      out.counts["changed_truncated"] += 1
    if score_field:
      out.scores.append(score)
    out.docs.append(doc)
  warn_malformed_total(out.counts, out.malformed_lines, "chat")
  return out
