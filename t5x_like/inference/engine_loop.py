"""One thread drives the engine for every client: requests are submitted and cancelled from any thread, each
step's Deltas go back to the request's sink (continuous batching: a request joins the running batch as soon
as a slot frees), and the serving metrics (Prometheus) are counted here.

Only the loop thread touches the Engine (it is not thread-safe); other threads talk to it through a queue.
"""

import itertools
import logging
import queue
import threading
import time
from typing import Callable, Optional, Sequence

import prometheus_client as prom

from t5x_like.inference.engine import Engine
from t5x_like.inference.sampling import SamplingParams

LOG = logging.getLogger(__name__)
IDLE_WAIT_SECONDS = 0.05  # how long the idle loop waits for a command before looking again
RATE_WINDOW_SECONDS = 1.0  # tokens_per_second is measured over windows of about this length


class ShutDown(RuntimeError):
  """Sent to the requests still running when the loop stops."""


class ServeMetrics:
  """The server's Prometheus metrics, in a registry of their own (several servers may share a process)."""

  def __init__(self):
    self.registry = prom.CollectorRegistry()
    r = self.registry
    self.requests = prom.Counter("t5x_like_requests", "HTTP generation requests answered, by endpoint and status.",
                                 ["endpoint", "status"], registry=r)
    self.tokens = prom.Counter("t5x_like_generated_tokens", "Tokens generated (every sample).", registry=r)
    self.prompt_tokens = prom.Counter("t5x_like_prompt_tokens", "Prompt tokens prefilled.", registry=r)
    self.cancelled = prom.Counter("t5x_like_cancelled_requests", "Requests cancelled (client gone, shutdown).",
                                  registry=r)
    self.ttft = prom.Histogram("t5x_like_time_to_first_token_seconds", "From a request's arrival to its first "
                               "token.", buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60), registry=r)
    self.latency = prom.Histogram("t5x_like_request_seconds", "From a request's arrival to its last token.",
                                  buckets=(.05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120), registry=r)
    self.tokens_per_second = prom.Gauge("t5x_like_tokens_per_second", "Tokens generated per second over the "
                                        "last window.", registry=r)
    self.queue_depth = prom.Gauge("t5x_like_queue_depth", "Requests waiting for a slot.", registry=r)
    self.running = prom.Gauge("t5x_like_running_requests", "Requests being decoded.", registry=r)

  def exposition(self) -> bytes:
    return prom.generate_latest(self.registry)


class EngineLoop:
  """Runs `engine.step()` in a thread while any request is live.

  Example:
    loop = EngineLoop(engine, ServeMetrics()); loop.start()
    key = loop.submit(prompt_ids, SamplingParams(max_tokens=8), n=1, sink=print)  # sink(Delta | Exception)
    loop.cancel(key); loop.stop()
  """

  def __init__(self, engine: Engine, metrics: ServeMetrics):
    self.engine, self.metrics = engine, metrics
    self._commands = queue.SimpleQueue()
    self._keys = itertools.count()
    self._lock = threading.Lock()
    self._waiting = set()  # keys submitted that have no token yet (in the engine's queue or ours)
    self._live = {}  # key → [engine request id or None, sink, samples not finished, arrival time]
    self._rid_key = {}  # engine request id → key
    self._stopping = threading.Event()
    self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
    self._window = (time.monotonic(), 0)  # (start, tokens) of the tokens/s window

  @property
  def waiting(self) -> int:
    """Requests waiting for a slot."""
    return len(self._waiting)

  @property
  def running(self) -> int:
    """Requests that have tokens and are not finished."""
    return len(self._live) - len(self._waiting)

  def start(self) -> None:
    self._thread.start()

  def stop(self, timeout_seconds: float = 10.0) -> None:
    """Ends the thread; requests still live get ShutDown."""
    self._stopping.set()
    self._commands.put(("wake",))
    self._thread.join(timeout_seconds)

  def submit(self, prompt: Sequence[int], sampling: SamplingParams, n: int,
             sink: Callable[[object], None]) -> int:
    """Queues `n` samples of `prompt`; `sink` is called in the loop thread with each Delta of the request,
    or once with an exception when the engine or the loop fails. Returns the key to cancel it with."""
    key = next(self._keys)
    with self._lock:
      self._waiting.add(key)
      self._live[key] = [None, sink, n, time.monotonic()]
    self.metrics.queue_depth.set(self.waiting)
    self._commands.put(("submit", key, list(prompt), sampling, n))
    return key

  def cancel(self, key: int) -> None:
    """Drops a request (waiting or running; a finished one is ignored) and frees its slots."""
    self._commands.put(("cancel", key))

  def _run(self) -> None:
    while not self._stopping.is_set():
      try:
        block = not self.engine.busy
        self._apply(self._commands.get(timeout=IDLE_WAIT_SECONDS) if block else self._commands.get_nowait())
        while True:
          self._apply(self._commands.get_nowait())
      except queue.Empty:
        pass
      if self.engine.busy and not self._stopping.is_set():
        self._step()
    with self._lock:
      live = list(self._live.items())
      self._live.clear()
      self._waiting.clear()
    for key, (rid, sink, _, _) in live:
      if rid is not None:
        self.engine.cancel(rid)
      sink(ShutDown("the server is shutting down"))

  def _apply(self, command: tuple) -> None:
    if command[0] == "submit":
      _, key, prompt, sampling, n = command
      with self._lock:
        entry = self._live.get(key)
      if entry is None:  # cancelled before the loop saw it
        return
      try:
        entry[0] = self.engine.submit(prompt, sampling, n)
      except ValueError as e:  # the server checks first; this is a last guard, never a crash
        self._drop(key)
        entry[1](e)
        return
      self._rid_key[entry[0]] = key
      self.metrics.prompt_tokens.inc(len(prompt))
    elif command[0] == "cancel":
      entry = self._drop(command[1])
      if entry is not None:
        if entry[0] is not None:
          self.engine.cancel(entry[0])
        self.metrics.cancelled.inc()

  def _drop(self, key: int) -> Optional[list]:
    with self._lock:
      entry = self._live.pop(key, None)
      self._waiting.discard(key)
    if entry is not None and entry[0] is not None:
      self._rid_key.pop(entry[0], None)
    self.metrics.queue_depth.set(self.waiting)
    self.metrics.running.set(self.running)
    return entry

  def _step(self) -> None:
    try:
      deltas = self.engine.step()
    except Exception as e:  # pylint: disable=broad-except  # fail the live requests, keep serving
      LOG.exception("engine step failed; cancelling every live request")
      for key in list(self._live):
        entry = self._drop(key)
        if entry is not None:
          if entry[0] is not None:
            self.engine.cancel(entry[0])
          entry[1](RuntimeError(f"the engine failed: {e}"))
      return
    now, produced = time.monotonic(), 0
    for d in deltas:
      produced += len(d.tokens)
      key = self._rid_key.get(d.request_id)
      entry = self._live.get(key) if key is not None else None
      if entry is None:
        continue
      if key in self._waiting:
        with self._lock:
          self._waiting.discard(key)
        self.metrics.ttft.observe(now - entry[3])
      if d.finish_reason is not None:
        entry[2] -= 1
        if entry[2] == 0:
          self._drop(key)
          self.metrics.latency.observe(now - entry[3])
      entry[1](d)
    self.metrics.tokens.inc(produced)
    self.metrics.queue_depth.set(self.waiting)
    self.metrics.running.set(self.running)
    start, count = self._window
    if now - start >= RATE_WINDOW_SECONDS:
      self.metrics.tokens_per_second.set((count + produced) / (now - start))
      self._window = (now, 0)
    else:
      self._window = (start, count + produced)
