"""OpenAI's HTTP API as plain data: request bodies checked field by field, responses and stream chunks built.

Only what the server speaks is here (no HTTP, no model): `parse_completion` / `parse_chat` turn a decoded
JSON body into a `Request` or raise `ApiError` naming the field; the `*_response` / `*_chunk` functions build
the JSON objects of https://platform.openai.com/docs/api-reference (completions and chat completions).
"""

import dataclasses
import time
import uuid
from typing import Optional

MAX_STOP = 4  # stop strings per request, as OpenAI's API allows
MAX_N = 16  # samples per request (also bounded by the engine's slots)
IGNORED_ZERO = ("frequency_penalty", "presence_penalty")  # accepted only at their neutral value 0


class ApiError(Exception):
  """A request the server refuses: HTTP `status` and OpenAI's error JSON naming `param`."""

  def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
               kind: str = "invalid_request_error", headers: Optional[dict] = None):
    super().__init__(message)
    self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
    self.headers = headers or {}

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclasses.dataclass(frozen=True)
class Request:
  """One checked request. `prompts`: completion prompts (each a str or a list of token ids); `messages`:
  chat turns ((role, content), ...). max_tokens None: the endpoint's default."""
  model: str
  prompts: tuple = ()
  messages: tuple = ()
  max_tokens: Optional[int] = None
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  n: int = 1
  seed: Optional[int] = None
  stop: tuple = ()
  logprobs: bool = False
  stream: bool = False
  include_usage: bool = False


def _is_int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool)


def _get(body: dict, name: str, check, expected: str, default):
  """body[name] (or `default` when absent or null) after `check(value)`, else a 400 naming the field."""
  value = body.get(name)
  if value is None:
    return default
  if not check(value):
    raise ApiError(400, f"'{name}' must be {expected}, got {value!r}", param=name, code="invalid_type")
  return value


def _stop(body: dict) -> tuple:
  stop = body.get("stop")
  if stop is None:
    return ()
  stops = [stop] if isinstance(stop, str) else stop
  if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
    raise ApiError(400, f"'stop' must be a non-empty string or a list of them, got {stop!r}", param="stop",
                   code="invalid_type")
  if len(stops) > MAX_STOP:
    raise ApiError(400, f"'stop' has {len(stops)} strings, at most {MAX_STOP} are allowed", param="stop",
                   code="too_many_stop_strings")
  return tuple(stops)


def _common(body, *, default_temperature: float = 1.0) -> dict:
  """The sampling fields both endpoints share, checked."""
  if not isinstance(body, dict):
    raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_body")
  model = body.get("model")
  if not isinstance(model, str) or not model:
    raise ApiError(400, f"'model' must be a non-empty string (GET /v1/models lists it), got {model!r}",
                   param="model", code="invalid_type")
  for name in IGNORED_ZERO:
    if _get(body, name, _is_number, "a number", 0) != 0:
      raise ApiError(400, f"'{name}' is not supported (only 0)", param=name, code="unsupported")
  options = body.get("stream_options")
  if options is not None and not (isinstance(options, dict) and isinstance(options.get("include_usage", False), bool)):
    raise ApiError(400, f"'stream_options' must be an object like {{\"include_usage\": true}}, got {options!r}",
                   param="stream_options", code="invalid_type")
  out = dict(
      model=model,
      max_tokens=_get(body, "max_tokens", lambda v: _is_int(v) and v >= 1, "an integer >= 1", None),
      temperature=float(_get(body, "temperature", lambda v: _is_number(v) and 0 <= v <= 2, "a number in [0, 2]",
                             default_temperature)),
      top_p=float(_get(body, "top_p", lambda v: _is_number(v) and 0 < v <= 1, "a number in (0, 1]", 1.0)),
      top_k=_get(body, "top_k", lambda v: _is_int(v) and v >= 0, "an integer >= 0 (0: all tokens)", 0),
      n=_get(body, "n", lambda v: _is_int(v) and 1 <= v <= MAX_N, f"an integer in [1, {MAX_N}]", 1),
      seed=_get(body, "seed", _is_int, "an integer", None),
      stop=_stop(body),
      stream=_get(body, "stream", lambda v: isinstance(v, bool), "true or false", False),
      include_usage=bool((options or {}).get("include_usage", False)))
  if "max_completion_tokens" in body and body["max_completion_tokens"] is not None:  # chat's newer name
    out["max_tokens"] = _get(body, "max_completion_tokens", lambda v: _is_int(v) and v >= 1, "an integer >= 1", None)
  return out


def parse_completion(body) -> Request:
  """A /v1/completions body: `prompt` is a string, a list of strings, a list of token ids or a list of them.
  `logprobs` (an integer 0..5 in OpenAI's API) asks for the chosen tokens' log-probs (no alternatives)."""
  fields = _common(body)
  prompt = body.get("prompt")
  if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt)):
    prompts = (prompt,)
  elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or (isinstance(p, list) and all(
      _is_int(t) for t in p)) for p in prompt):
    prompts = tuple(prompt)
  else:
    raise ApiError(400, f"'prompt' must be a string, a list of strings or a list of token ids, got {prompt!r:.80}",
                   param="prompt", code="invalid_type")
  if any(len(p) == 0 for p in prompts):
    raise ApiError(400, "'prompt' is empty: give at least one character or token", param="prompt",
                   code="empty_prompt")
  logprobs = _get(body, "logprobs", lambda v: _is_int(v) and 0 <= v <= 5, "an integer in [0, 5] or null", None)
  return Request(prompts=prompts, logprobs=logprobs is not None, **fields)


def parse_chat(body) -> Request:
  """A /v1/chat/completions body; `messages` become (role, content) turns.

  `content` may be a string or a list of {"type": "text", "text": ...} parts (joined); `logprobs` is a bool,
  `top_logprobs` only 0 (the engine returns the chosen tokens' log-probs)."""
  fields = _common(body)
  messages = body.get("messages")
  if not isinstance(messages, list) or not messages:
    raise ApiError(400, f"'messages' must be a non-empty list of {{\"role\", \"content\"}} objects, got "
                   f"{messages!r:.80}", param="messages", code="invalid_type")
  turns = []
  for i, m in enumerate(messages):
    content = m.get("content") if isinstance(m, dict) else None
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(
        p.get("text"), str) for p in content):
      content = "".join(p["text"] for p in content)
    if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(content, str):
      raise ApiError(400, f"'messages[{i}]' must be {{\"role\": str, \"content\": str}}, got {m!r:.80}",
                     param=f"messages[{i}]", code="invalid_type")
    turns.append({"role": m["role"], "content": content})
  logprobs = _get(body, "logprobs", lambda v: isinstance(v, bool), "true or false", False)
  _get(body, "top_logprobs", lambda v: v == 0, "0 (alternatives are not returned)", 0)
  return Request(messages=tuple((t["role"], t["content"]) for t in turns), logprobs=logprobs, **fields)


def new_id(prefix: str) -> str:
  return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
  return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
          "total_tokens": prompt_tokens + completion_tokens}


def completion_logprobs(pieces: list, logprobs: list, offset: int = 0) -> dict:
  """Legacy completions' logprobs: the chosen tokens (as text pieces), their log-probs and text offsets."""
  offsets, at = [], offset
  for piece in pieces:
    offsets.append(at)
    at += len(piece)
  return {"tokens": list(pieces), "token_logprobs": list(logprobs), "top_logprobs": None, "text_offset": offsets}


def chat_logprobs(pieces: list, logprobs: list) -> dict:
  return {"content": [{"token": p, "logprob": lp, "bytes": list(p.encode("utf-8")), "top_logprobs": []}
                      for p, lp in zip(pieces, logprobs)]}


def completion_response(rid: str, model: str, choices: list, usage_: dict) -> dict:
  """choices: [{"index", "text", "logprobs", "finish_reason"}]."""
  return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
          "choices": choices, "usage": usage_}


def chat_response(rid: str, model: str, choices: list, usage_: dict) -> dict:
  """choices: [{"index", "text", "logprobs", "finish_reason"}] (text becomes the assistant message)."""
  return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
          "choices": [{"index": c["index"], "message": {"role": "assistant", "content": c["text"]},
                       "logprobs": c["logprobs"], "finish_reason": c["finish_reason"]} for c in choices],
          "usage": usage_}


def completion_chunk(rid: str, model: str, index: int, text: str, logprobs: Optional[dict],
                     finish_reason: Optional[str], usage_: Optional[dict] = None) -> dict:
  choices = [] if index < 0 else [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]
  return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model, "choices": choices,
          "usage": usage_}


def chat_chunk(rid: str, model: str, index: int, text: Optional[str], logprobs: Optional[dict],
               finish_reason: Optional[str], usage_: Optional[dict] = None, role: bool = False) -> dict:
  """A chat stream chunk; index < 0: the usage-only last chunk (no choices)."""
  delta = {}
  if role:
    delta["role"] = "assistant"
  if text:
    delta["content"] = text
  choices = [] if index < 0 else [{"index": index, "delta": delta, "logprobs": logprobs,
                                   "finish_reason": finish_reason}]
  return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
          "choices": choices, "usage": usage_}
