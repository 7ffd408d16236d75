"""The local preprocess runner's worker processes (text_cleaning functions only) and its progress line."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import sys
import time
from typing import Callable, Iterator

from t5x_like.data import text_cleaning

log = logging.getLogger(__name__)


class Progress:
  """Logs "stage: i/n files, tokens, tokens/s" at most every `every_s` seconds and at the end."""

  def __init__(self, stage: str, total: int, every_s: float = 2.0, enabled: bool = True):
    self.stage, self.total, self.every_s, self.enabled = stage, total, every_s, enabled
    self.start = self.last = time.time()
    self.done = self.tokens = 0

  def update(self, files: int = 1, tokens: int = 0) -> None:
    self.done += files
    self.tokens += tokens
    now = time.time()
    if self.enabled and (now - self.last >= self.every_s or self.done == self.total):
      self.last = now
      rate = self.tokens / max(now - self.start, 1e-9)
      log.info("%s: %d/%d files, %d tokens, %.0f tokens/s", self.stage, self.done, self.total,
               self.tokens, rate)


@contextlib.contextmanager
def _main_module_hidden():
  """While workers start: multiprocessing would import this process's __main__ in each of them (the CLI, which
  loads TensorFlow: seconds per worker); they run text_cleaning functions only, so it is hidden from it."""
  main = sys.modules["__main__"]
  saved = {k: main.__dict__[k] for k in ("__spec__", "__file__") if k in main.__dict__}
  main.__spec__ = None
  main.__dict__.pop("__file__", None)
  try:
    yield
  finally:
    main.__dict__.pop("__spec__", None)
    main.__dict__.update(saved)


class Workers:
  """An ordered map over worker processes, each initialised by text_cleaning.init_worker(model); in this
  process when num_workers <= 1. A context manager: the pool lives until exit, so two phases can share it."""

  def __init__(self, num_workers: int, model: bytes | None = None):
    self.num_workers, self.model, self.pool = num_workers, model, None

  def __enter__(self) -> "Workers":
    if self.num_workers <= 1:
      text_cleaning.init_worker(self.model)
      return self
    if "forkserver" in multiprocessing.get_all_start_methods():
      # Workers fork from a clean server that imported only the TF-free worker module: never from
      # this process, whose TF / JAX threads make fork unsafe.
      ctx = multiprocessing.get_context("forkserver")
      ctx.set_forkserver_preload(["t5x_like.data.text_cleaning"])
    else:
      ctx = multiprocessing.get_context("spawn")
    with _main_module_hidden():
      self.pool = ctx.Pool(self.num_workers, text_cleaning.init_worker, (self.model,))
    return self

  def __exit__(self, *exc) -> None:
    if self.pool is not None:
      self.pool.terminate()
      self.pool.join()
      self.pool = None

  def map(self, fn: Callable, args: Iterator) -> Iterator:
    if self.pool is None:
      yield from map(fn, args)
      return
    window = []
    for a in args:  # bounded look-ahead: at most 4 files per worker are held in memory
      window.append(a)
      if len(window) >= 4 * self.num_workers:
        yield from self.pool.imap(fn, window)
        window = []
    yield from self.pool.imap(fn, window)
