"""A tiny served model for tests/test_serve.py and bench/serve_load.py: a chat DATA_DIR, a MODEL_DIR with large
random weights (decisive, distinct greedy answers), and `python -m t5x_like.serve` started on a free loopback
port as a subprocess."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import jax
import numpy as np

from tests import forkserver

from t5x_like.data import chat_synth
from t5x_like.data import preprocessing
from t5x_like.data import tokenizer as tokenizer_lib
from t5x_like.model import decoder as model_lib
from t5x_like.parallel import partitioning
from t5x_like.training import checkpointing
from t5x_like.training import config as config_lib
from t5x_like.training import runtime as runtime_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = dict(num_layers=1, num_heads=2, d_model=32, d_ff=64, max_len=64, dtype="float32", tie_embeddings=False)
GIN = (["--gin_file=configs/models/gpt_tiny.gin", "--gin_file=configs/runs/pretrain.gin"]
       + [f"--gin.model.GPTConfig.{k}={v!r}" for k, v in MODEL.items()] + ["--gin.SEQ_LEN=56", "--gin.BATCH_SIZE=8"])
CONVERSATIONS = [{"messages": [{"role": "user", "content": "reverse: self path"},
                               {"role": "assistant", "content": "path self"}]},
                 {"prompt": "value of a", "completion": "value"}]


def make_run(root: str) -> dict:
  """{"model_dir", "data_dir", "tokenizer"} of a chat DATA_DIR and a MODEL_DIR holding random weights
  (checkpoint 0) under `root`."""
  texts = [" ".join(chat_synth.WORDS) + "\nreverse: value of again, two be brief\n"] * 20
  tok = tokenizer_lib.train_tokenizer(texts, os.path.join(root, "tok.model"), vocab_size=360, num_threads=1)
  raw = os.path.join(root, "chat.jsonl")
  with open(raw, "w", encoding="utf-8") as f:
    f.writelines(json.dumps(c) + "\n" for c in CONVERSATIONS)
  data_dir, model_dir = os.path.join(root, "data"), os.path.join(root, "tiny")
  preprocessing.preprocess([raw], data_dir, tokenizer=tok.path, data_format="chat", num_train_shards=1,
                           validation_fraction=0.0, progress=False, cache_dir=None)
  config = config_lib.TrainConfig(model_dir=model_dir, data_dir=data_dir, batch_size=8, seq_len=56,
                                  mesh_shape={"data": -1})
  exp = runtime_lib.Runtime(config, model_lib.GPTConfig(**MODEL))
  rng = np.random.RandomState(0)
  params = jax.tree.map(lambda x: rng.normal(0.0, 1.0, x.shape).astype(np.float32),
                        partitioning.unbox(exp.boxed_params))
  checkpointing.save_params(model_dir, params)
  return {"model_dir": model_dir, "data_dir": data_dir, "tokenizer": tok.path}


def env(xla_flags: str = "--xla_force_host_platform_device_count=1") -> dict:
  """A launch's environment: one CPU device (`xla_flags`: its XLA_FLAGS; the tests add XLA:CPU's fast compile)."""
  return dict(os.environ, XLA_FLAGS=xla_flags, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")


def run_args(run: dict) -> list:
  return GIN + [f"--gin.MODEL_DIR='{run['model_dir']}'", f"--gin.DATA_DIR='{run['data_dir']}'"]


class ServerProcess:
  """`python -m t5x_like.serve` on a free loopback port; `url` once it listens. `run`: make_run's folders
  (None: `flags` name the model); `environ`: the process's environment (default env()); `wait=False` returns at
  once, and wait() waits for it to listen (so that several launches start together)."""

  def __init__(self, run: dict | None, *flags, timeout_seconds: float = 300, environ: dict | None = None,
               wait: bool = True):
    self.proc = forkserver.Popen([sys.executable, "-m", "t5x_like.serve", *(run_args(run) if run else []), "--port=0",
                                  *flags],
                                 cwd=REPO, env=environ or env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True)
    self.timeout_seconds = timeout_seconds
    self.banner = self.url = ""
    if wait:
      self.wait()

  def wait(self) -> "ServerProcess":
    """Returns once the server listens (at once after the first call)."""
    if self.url:
      return self
    deadline = time.monotonic() + self.timeout_seconds
    while time.monotonic() < deadline:
      line = self.proc.stdout.readline()
      if not line:
        raise RuntimeError(f"serve exited {self.proc.wait()}: {self.proc.stderr.read()[-3000:]}")
      found = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
      if found:
        self.banner, self.url = line.strip(), found.group(1)
        return self
    self.stop()
    raise RuntimeError("serve did not start in time")

  def terminate(self, timeout_seconds: float = 60) -> tuple:
    """SIGTERM; returns (exit code, stderr)."""
    self.proc.send_signal(signal.SIGTERM)
    try:
      _, err = self.proc.communicate(timeout=timeout_seconds)
    except subprocess.TimeoutExpired:
      self.proc.kill()
      _, err = self.proc.communicate()
    return self.proc.returncode, err

  def stop(self) -> None:
    if self.proc.poll() is None:
      self.proc.kill()
      self.proc.communicate()


def post(url: str, body, raw: bool = False) -> tuple:
  """(status, JSON reply, headers (case-insensitive)) of a POST (`raw`: body is already bytes)."""
  data = body if raw else json.dumps(body).encode()
  request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
  try:
    with urllib.request.urlopen(request, timeout=120) as r:
      return r.status, json.loads(r.read()), r.headers
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read()), e.headers


def get(url: str) -> str:
  with urllib.request.urlopen(url, timeout=60) as r:
    return r.read().decode()


class Chromium:
  """Headless Chromium driven over the DevTools protocol on a pipe (--remote-debugging-pipe: the browser reads
  NUL-terminated JSON commands on fd 3 and writes replies on fd 4), so no websocket client is needed.

  Example:
    with Chromium(binary, profile_dir) as browser:
      session = browser.open(url); browser.evaluate(session, "document.title")
  """

  def __init__(self, binary: str, profile_dir: str, width: int = 900, height: int = 640):
    to_browser, self._out = os.pipe()
    self._in, from_browser = os.pipe()

    args = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe",
            f"--user-data-dir={profile_dir}", f"--window-size={width},{height}"]
    wire = f'exec "$0" "$@" 3<&{to_browser} 4>&{from_browser} {to_browser}<&- {from_browser}>&-'  # fds 3 and 4
    self.proc = subprocess.Popen(["bash", "-c", wire, *args], pass_fds=(to_browser, from_browser),
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.close(to_browser)
    os.close(from_browser)
    self._reader = os.fdopen(self._in, "rb")
    self._next_id = 0
    self._buffer = b""

  def call(self, method: str, session: str | None = None, **params) -> dict:
    """Sends one command and returns its result (events in between are skipped)."""
    self._next_id += 1
    message = {"id": self._next_id, "method": method, "params": params}
    if session:
      message["sessionId"] = session
    os.write(self._out, json.dumps(message).encode() + b"\0")
    while True:
      while b"\0" not in self._buffer:
        chunk = self._reader.read1(65536)
        if not chunk:
          raise RuntimeError(f"chromium closed the pipe (exit {self.proc.poll()})")
        self._buffer += chunk
      raw, self._buffer = self._buffer.split(b"\0", 1)
      reply = json.loads(raw)
      if reply.get("id") == self._next_id:
        if "error" in reply:
          raise RuntimeError(f"{method}: {reply['error']}")
        return reply["result"]

  def open(self, url: str, first_script: str | None = None) -> str:
    """A new tab at `url`, where `first_script` (JavaScript) runs before the page's own; returns its session id."""
    target = self.call("Target.createTarget", url="about:blank" if first_script else url)["targetId"]
    session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
    if first_script:
      self.call("Page.enable", session)
      self.call("Page.addScriptToEvaluateOnNewDocument", session, source=first_script)
      self.call("Page.navigate", session, url=url)
    return session

  def evaluate(self, session: str, expression: str):
    return self.call("Runtime.evaluate", session, expression=expression, returnByValue=True)["result"].get("value")

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    try:
      self.call("Browser.close")
    except (RuntimeError, OSError):
      pass
    try:
      self.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
      self.proc.kill()
      self.proc.wait()
    os.close(self._out)
    self._reader.close()
