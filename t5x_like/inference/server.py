"""The OpenAI-compatible HTTP server on the engine: `/v1/completions`, `/v1/chat/completions` (plain or
streamed as server-sent events), `/v1/models`, `/health`, Prometheus `/metrics` and a chat page at `/`.

Every request goes to one EngineLoop (continuous batching over the engine's slots). A request is checked
before it reaches the engine: a bad one gets OpenAI's error JSON naming the field, a full queue a 429 with
Retry-After. A client that goes away cancels its request and frees its slots.
"""

import asyncio
import contextlib
import dataclasses
import importlib.resources
import json
import logging
import signal
import threading
import time
from typing import Callable, Optional

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route
import uvicorn

from t5x_like.data import chat
from t5x_like.inference import chat_eval
from t5x_like.inference import openai_schema as schema
from t5x_like.inference import engine as engine_lib
from t5x_like.inference.engine import Engine
from t5x_like.inference.engine_loop import EngineLoop, ServeMetrics
from t5x_like.inference.sampling import SamplingParams
from t5x_like.inference.streaming import SampleText

LOG = logging.getLogger(__name__)
PAGE = importlib.resources.files("t5x_like.inference") / "static" / "chat.html"


@dataclasses.dataclass(frozen=True)
class ServeConfig:
  """How the server runs (the `serve` command's flags)."""
  host: str = "127.0.0.1"  # loopback by default: binding elsewhere is the user's explicit choice
  port: int = 8000  # 0: any free port (the bound one is logged)
  max_batch: int = 8  # the engine's slots: sequences decoded at once
  max_seq_len: int = 0  # prompt + completion tokens per sequence (0: the model's max_len)
  max_waiting: int = 256  # requests queued for a slot; one more gets 429 with Retry-After
  shutdown_timeout_seconds: float = 10.0  # after SIGTERM, in-flight requests get this long, then are cancelled
  model_name: str = "t5x_like"  # the model id /v1/models lists and requests must name
  default_max_tokens: int = 16  # /v1/completions without max_tokens (OpenAI's default); chat: the context's rest
  seed: int = 0  # the seed of sampled requests that give none
  warmup: bool = True  # compile every prefill shape at start-up (server.warm_up) instead of on first use


class Model:
  """What the server runs: the engine, the tokenizer and the chat encoder (None: `chat_error` says why)."""

  def __init__(self, engine: Engine, tokenizer, encoder: Optional[chat.ChatEncoder], chat_error: str = "",
               step: Optional[int] = None):
    self.engine, self.tokenizer, self.encoder, self.chat_error = engine, tokenizer, encoder, chat_error
    self.step = step
    self.limit = min(engine.config.max_len, engine.cache_len)

  def plain_text(self, tokens) -> str:
    """A completion's text: its tokens decoded, EOS left out (as `infer` prints it)."""
    return self.tokenizer.decode([t for t in tokens if t != self.tokenizer.eos_id])


def load_model(runtime, config: ServeConfig, *, step: Optional[int] = None, tokenizer: Optional[str] = None,
               template: chat.ChatTemplate = chat.ChatTemplate()) -> Model:
  """The Model of a run: its checkpoint (`step`, default the newest) on the runtime's mesh, an engine of
  `config.max_batch` slots and `config.max_seq_len` cache columns, and its tokenizer (`tokenizer`, else
  DATA_DIR's) with the chat template (DATA_DIR's, else `template`; chat is off when its markers are not
  tokens of the tokenizer). The first request's compilation happens here (a one-token warm-up).

  Args:
    runtime: the run's runtime (`restore_params`, `load_tokenizer`, `model_config`, `mesh`, `rules`,
      `context()`, `manifest`, `config`).
  """
  if config.max_batch < 1:
    raise ValueError(f"--max_batch must be >= 1, got {config.max_batch}")
  if config.max_seq_len < 0:
    raise ValueError(f"--max_seq_len must be >= 0 (0: the model's max_len), got {config.max_seq_len}")
  tok = runtime.load_tokenizer(tokenizer)
  try:
    encoder, chat_error = chat.ChatEncoder(tok, chat_eval.template_for(runtime.manifest, runtime.config.data_dir,
                                                                       template)), ""
  except ValueError as e:
    encoder, chat_error = None, str(e)
  eos = tok.eos_id
  with runtime.context():
    found, params = runtime.restore_params(step)
    engine = Engine(runtime.model_config, params, runtime.mesh, runtime.rules, slots=config.max_batch,
                    cache_len=config.max_seq_len or None, pad_id=tok.pad_id, seed=config.seed,
                    detokenize=lambda ids: tok.decode([t for t in ids if t != eos]))
    engine.generate([[eos]], SamplingParams(max_tokens=2))  # compiles the prefill and the decode step
    if config.warmup:
      warm_up(engine)
  return Model(engine, tok, encoder, chat_error, found)


def warm_up(engine: Engine) -> int:
  """Compiles the prefill of every (prompts admitted together, prompt width) bucket the engine uses (powers of two
  up to its slots × from engine.MIN_WIDTH to its context), so that no request waits for a compilation later.
  Returns how many shapes were run."""
  limit = min(engine.config.max_len, engine.cache_len)
  rows = sorted({min(1 << i, engine.slots) for i in range(engine.slots.bit_length() + 1)})
  widths = sorted({min(w, limit - 1) for w in (engine_lib.MIN_WIDTH << i for i in range(limit.bit_length()))
                   if w // 2 < limit - 1})
  for r in rows:
    for w in widths:
      engine.generate([[engine.pad_id + 1] * w] * r, SamplingParams(max_tokens=1))
  return len(rows) * len(widths)


def _error(e: schema.ApiError) -> JSONResponse:
  return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _sse(obj) -> str:
  return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _disconnected(request: Request) -> None:
  """Returns when the client closes the connection (the body has been read already)."""
  while (await request.receive())["type"] != "http.disconnect":
    pass


class Server:
  """The Starlette app over one Model and one EngineLoop (`app`; run it with `serve`)."""

  def __init__(self, model: Model, config: ServeConfig):
    self.model, self.config = model, config
    self.metrics = ServeMetrics()
    self.loop = EngineLoop(model.engine, self.metrics)
    self.app = Starlette(routes=[
        Route("/", self.page), Route("/health", self.health), Route("/metrics", self.prometheus),
        Route("/v1/models", self.models), Route("/v1/completions", self.completions, methods=["POST"]),
        Route("/v1/chat/completions", self.chat_completions, methods=["POST"])], lifespan=self._lifespan)

  @contextlib.asynccontextmanager
  async def _lifespan(self, app):  # pylint: disable=unused-argument
    self.loop.start()
    try:
      yield
    finally:
      self.loop.stop()

  async def page(self, request: Request) -> Response:  # pylint: disable=unused-argument
    return HTMLResponse(PAGE.read_text(encoding="utf-8"))

  async def health(self, request: Request) -> Response:  # pylint: disable=unused-argument
    return JSONResponse({"status": "ok", "model": self.config.model_name, "slots": self.model.engine.slots,
                         "running": self.loop.running, "waiting": self.loop.waiting, "context": self.model.limit})

  async def prometheus(self, request: Request) -> Response:  # pylint: disable=unused-argument
    return Response(self.metrics.exposition(), media_type="text/plain; version=0.0.4")

  async def models(self, request: Request) -> Response:  # pylint: disable=unused-argument
    return JSONResponse({"object": "list", "data": [{"id": self.config.model_name, "object": "model",
                                                     "created": 0, "owned_by": "t5x_like"}]})

  async def completions(self, request: Request) -> Response:
    return await self._generate(request, "completions")

  async def chat_completions(self, request: Request) -> Response:
    return await self._generate(request, "chat")

  # Checking a request.

  async def _body(self, request: Request):
    raw = await request.body()
    try:
      return json.loads(raw)
    except ValueError as e:
      raise schema.ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None

  def _encode(self, req: schema.Request, chat_mode: bool) -> list:
    """Token ids of each prompt (chat: the rendered conversation ending with the assistant marker)."""
    tok = self.model.tokenizer
    if chat_mode:
      if self.model.encoder is None:
        raise schema.ApiError(400, f"this model has no chat template: {self.model.chat_error}", param="messages",
                              code="no_chat_template")
      try:
        turns = chat.parse_conversation({"messages": [{"role": r, "content": c} for r, c in req.messages]
                                         + [{"role": "assistant", "content": "?"}]})[:-1]
        return [self.model.encoder.prompt_ids(turns)]
      except chat.MalformedLine as e:
        raise schema.ApiError(400, f"'messages': {e}", param="messages", code="invalid_messages") from None
    out = []
    for p in req.prompts:
      ids = list(tok.encode(p)) if isinstance(p, str) else list(p)
      if not ids:
        raise schema.ApiError(400, f"'prompt' {p!r:.40} encodes to no token", param="prompt", code="empty_prompt")
      bad = [t for t in ids if not 0 <= t < self.model.engine.config.vocab_size]
      if bad:
        raise schema.ApiError(400, f"'prompt' has token ids outside the vocabulary [0, "
                              f"{self.model.engine.config.vocab_size}): {bad[:5]}", param="prompt",
                              code="invalid_token")
      out.append(ids)
    return out

  def _sampling(self, req: schema.Request, prompts: list, chat_mode: bool) -> SamplingParams:
    limit, longest = self.model.limit, max(len(p) for p in prompts)
    where = "messages" if chat_mode else "prompt"
    if longest >= limit:
      raise schema.ApiError(400, f"'{where}' is {longest} tokens; the context holds {limit} (prompt + completion), "
                            "leaving no room to answer", param=where, code="context_length_exceeded")
    max_tokens = req.max_tokens
    if max_tokens is None:
      max_tokens = limit - longest if chat_mode else min(self.config.default_max_tokens, limit - longest)
    if longest + max_tokens > limit:
      raise schema.ApiError(400, f"'max_tokens' {max_tokens} + the prompt's {longest} tokens = {longest + max_tokens}"
                            f" exceeds the model's context of {limit} tokens", param="max_tokens",
                            code="context_length_exceeded")
    if req.n > self.model.engine.slots:
      raise schema.ApiError(400, f"'n' {req.n} exceeds the server's {self.model.engine.slots} slots (--max_batch)",
                            param="n", code="invalid_value")
    tok = self.model.tokenizer
    stops = (self.model.encoder.marker_ids["end"], tok.eos_id) if chat_mode else (tok.eos_id,)
    return SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_k=req.top_k, top_p=req.top_p,
                          stop_token_ids=stops, stop=req.stop, seed=req.seed)

  # Running a request.

  async def _generate(self, request: Request, endpoint: str) -> Response:
    chat_mode = endpoint == "chat"
    try:
      body = await self._body(request)
      req = schema.parse_chat(body) if chat_mode else schema.parse_completion(body)
      if req.model != self.config.model_name:
        raise schema.ApiError(404, f"'model' {req.model!r} is not served here (GET /v1/models: "
                              f"{self.config.model_name!r})", param="model", code="model_not_found")
      prompts = self._encode(req, chat_mode)
      sampling = self._sampling(req, prompts, chat_mode)
      if self.loop.waiting + len(prompts) > self.config.max_waiting:
        raise schema.ApiError(429, f"{self.loop.waiting} requests are waiting for a slot (--max_waiting="
                              f"{self.config.max_waiting}); retry shortly", code="queue_full",
                              kind="rate_limit_error", headers={"Retry-After": "1"})
    except schema.ApiError as e:
      self.metrics.requests.labels(endpoint, str(e.status)).inc()
      return _error(e)
    text_fn = self.model.encoder.completion_text if chat_mode else self.model.plain_text
    run = _Run(self.loop, prompts, sampling, req.n, lambda: SampleText(text_fn, req.stop, req.logprobs))
    rid = schema.new_id("chatcmpl" if chat_mode else "cmpl")
    if req.stream:
      self.metrics.requests.labels(endpoint, "200").inc()
      return StreamingResponse(self._stream(run, req, rid, chat_mode), media_type="text/event-stream")
    waiter = asyncio.ensure_future(run.finish())
    gone = asyncio.ensure_future(_disconnected(request))
    await asyncio.wait({waiter, gone}, return_when=asyncio.FIRST_COMPLETED)
    gone.cancel()
    if not waiter.done():  # the client left: free its slots
      waiter.cancel()
      run.cancel()
      self.metrics.requests.labels(endpoint, "499").inc()
      return Response(status_code=499)
    failure = waiter.result()
    if failure is not None:
      self.metrics.requests.labels(endpoint, "503").inc()
      return _error(schema.ApiError(503, str(failure), kind="server_error", code="unavailable"))
    self.metrics.requests.labels(endpoint, "200").inc()
    choices = [{"index": i, "text": s.final_text(), "finish_reason": s.finish_reason,
                "logprobs": self._logprobs(s.pieces, s.logprobs, chat_mode) if req.logprobs else None}
               for i, s in enumerate(run.samples)]
    build = schema.chat_response if chat_mode else schema.completion_response
    return JSONResponse(build(rid, req.model, choices, run.usage()))

  @staticmethod
  def _logprobs(pieces, logprobs, chat_mode: bool, offset: int = 0) -> dict:
    return schema.chat_logprobs(pieces, logprobs) if chat_mode else schema.completion_logprobs(pieces, logprobs,
                                                                                              offset)

  async def _stream(self, run: "_Run", req: schema.Request, rid: str, chat_mode: bool):
    """Server-sent events: a chunk per new text of a sample, its finish reason, [usage], then [DONE]."""
    chunk = schema.chat_chunk if chat_mode else schema.completion_chunk
    try:
      if chat_mode:
        for i in range(len(run.samples)):
          yield _sse(schema.chat_chunk(rid, req.model, i, "", None, None, role=True))
      async for index, text, pieces, logprobs, finish in run.updates():
        if isinstance(text, Exception):
          yield _sse(schema.ApiError(503, str(text), kind="server_error", code="unavailable").body())
          return
        lp = None
        if req.logprobs and pieces:
          lp = self._logprobs(pieces, logprobs, chat_mode, run.samples[index].offset_of(pieces))
        if text or lp or finish:
          yield _sse(chunk(rid, req.model, index, text, lp, finish))
      if req.include_usage:
        yield _sse(chunk(rid, req.model, -1, "", None, None, run.usage()))
      yield "data: [DONE]\n\n"
    finally:
      run.cancel()  # a client gone mid-stream (or a shutdown) frees the slots; a finished run ignores it


class _Run:
  """The engine requests of one HTTP request (one per prompt, n samples each) and their samples' text."""

  def __init__(self, loop: EngineLoop, prompts: list, sampling: SamplingParams, n: int,
               new_sample: Callable[[], SampleText]):
    self.loop, self.n, self.prompt_tokens = loop, n, sum(len(p) for p in prompts)
    self.samples = [new_sample() for _ in range(n * len(prompts))]
    self.queue = asyncio.Queue()
    event_loop = asyncio.get_running_loop()

    def sink(p):
      def put(item):
        with contextlib.suppress(RuntimeError):  # the event loop closed (shutdown)
          event_loop.call_soon_threadsafe(self.queue.put_nowait, (p, item))
      return put

    self.keys = [loop.submit(prompt, sampling, n, sink(p)) for p, prompt in enumerate(prompts)]
    self.done = False

  def cancel(self) -> None:
    if not self.done:
      for key in self.keys:
        self.loop.cancel(key)
      self.done = True

  async def updates(self):
    """(choice index, new text, new pieces, new log-probs, finish reason or None) as the engine produces them;
    (−1, exception, ...) when the engine or the server fails."""
    while any(s.finish_reason is None for s in self.samples):
      p, item = await self.queue.get()
      if isinstance(item, Exception):
        self.done = True
        yield -1, item, [], [], None
        return
      index = p * self.n + item.index
      yield (index,) + self.samples[index].add(item.tokens, item.logprobs, item.finish_reason)
    self.done = True

  async def finish(self) -> Optional[Exception]:
    """Waits for every sample; returns the failure, if any."""
    async for _, text, _, _, _ in self.updates():
      if isinstance(text, Exception):
        return text
    return None

  def usage(self) -> dict:
    return schema.usage(self.prompt_tokens, sum(len(s.tokens) for s in self.samples))


def serve(model: Model, config: ServeConfig, *, on_ready: Optional[Callable[[int], None]] = None) -> None:
  """Serves until SIGTERM or SIGINT: then stops accepting, lets in-flight requests finish for
  `shutdown_timeout_seconds`, cancels the rest and returns (the process exits 0).

  Args:
    on_ready: called with the bound port once the server listens (port 0 picks a free one).
  """
  server = Server(model, config)
  uv = uvicorn.Server(uvicorn.Config(server.app, host=config.host, port=config.port, log_level="warning",
                                     timeout_graceful_shutdown=config.shutdown_timeout_seconds,
                                     lifespan="on"))

  async def run():
    task = asyncio.ensure_future(uv.serve())
    while not uv.started and not task.done():
      await asyncio.sleep(0.05)
    if uv.started:
      port = uv.servers[0].sockets[0].getsockname()[1]
      print(f"serving {config.model_name} on http://{config.host}:{port} ({model.engine.slots} slots, context "
            f"{model.limit} tokens)", flush=True)
      if on_ready:
        on_ready(port)
    await task

  # uvicorn re-raises a caught SIGTERM once it has shut down; a no-op handler turns that into a clean return
  main = threading.current_thread() is threading.main_thread()
  previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)} if main else {}
  try:
    asyncio.run(run())
  finally:
    for sig, handler in previous.items():
      signal.signal(sig, handler)
