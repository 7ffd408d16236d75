"""`python -m t5x_like.serve` through the real `openai` client and raw HTTP: completions, chat, streaming (chunks
concatenate to the plain answer, stop strings included), n > 1, log-probs (= the engine's), greedy text = `infer`'s,
continuous batching (greedy alone = among others), bad requests (OpenAI error JSON naming the field, then a good
request still answered), a client that leaves frees its slots, Prometheus metrics, 429 on a full queue, SIGTERM
(drains, exit 0), and the chat page in headless Chromium."""

import base64
import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request

import pytest

from tests import conftest
from tests import forkserver
from tests import serve_fixtures as sf

from t5x_like.data import chat
from t5x_like.inference import chat_eval
from t5x_like.inference import streaming
from t5x_like.inference.engine import Engine
from t5x_like.inference.sampling import SamplingParams
from t5x_like.model import decoder as model_lib
from t5x_like.training import config as config_lib
from t5x_like.training import runtime as runtime_lib

PROMPT = "reverse: self path"
CHAT = [{"role": "user", "content": "reverse: value of"}]


# every launch: one CPU device and XLA:CPU's fast compile (tests/conftest.py); infer and serve compile alike
ENV = sf.env(conftest.xla_flags(1))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  return sf.make_run(str(tmp_path_factory.mktemp("serve")))


class Launch:
  """`python -m <module> <args>` started now with ENV; result() (conftest.finished) waits for it."""

  def __init__(self, module: str, *args):
    self.proc = forkserver.Popen([sys.executable, "-m", module, *args], cwd=sf.REPO, env=ENV,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

  def result(self) -> subprocess.CompletedProcess:
    return conftest.finished(self.proc)

  def stop(self) -> None:
    if self.proc.poll() is None:
      self.proc.kill()
    self.proc.communicate()


@pytest.fixture(scope="module")
def launches(run):
  """The slow tests' launches, started together by the first of them so that their start-ups overlap: the 429
  test's server (2 slots, 1 waiting request, warm-up on), two infer runs, serve --help and a bad flag."""
  started = {
      "queue": sf.ServerProcess(run, "--max_batch=2", "--max_waiting=1", "--shutdown_timeout_seconds=30",
                                environ=ENV, wait=False),
      "infer": Launch("t5x_like.infer", *sf.run_args(run), f"--prompt={PROMPT}", "--temperature=0",
                      "--max_new_tokens=12"),
      "infer_chat": Launch("t5x_like.infer", *sf.run_args(run), "--chat", f"--prompt={CHAT[0]['content']}",
                           "--max_new_tokens=10"),
      "help": Launch("t5x_like.serve", "--help"),
      "bad_flag": Launch("t5x_like.serve", *sf.run_args(run), "--max_batch=0"),
  }
  yield started
  for proc in started.values():
    proc.stop()


@pytest.fixture(scope="module")
def server(run):
  proc = sf.ServerProcess(run, "--max_batch=4", "--nowarmup", environ=ENV)  # compiles on first use (the 429 test's
  yield proc                                                                 # server warms up)
  proc.stop()


@pytest.fixture(scope="module")
def client(server):
  """The real `openai` client (imported here: ~1.5 s that a test worker not running this file does not pay)."""
  import openai  # pylint: disable=g-import-not-at-top
  return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(run):
  """An engine of our own over the run's checkpoint: the log-probs the server must return."""
  config = config_lib.TrainConfig(model_dir=run["model_dir"], data_dir=run["data_dir"], batch_size=8, seq_len=56,
                                  mesh_shape={"data": -1})
  exp = runtime_lib.Runtime(config, model_lib.GPTConfig(**sf.MODEL))
  tok = exp.load_tokenizer()
  with exp.context():
    _, params = exp.restore_params()
    engine = Engine(exp.model_config, params, exp.mesh, exp.rules, slots=8, pad_id=tok.pad_id)
  return exp, engine, tok


def test_sample_text_streams_exactly_the_final_text():
  pieces = {1: "ab", 2: "c", 3: "\n", 4: "d", 5: "\ufffd"}
  text_fn = lambda ids: "".join(pieces[i] for i in ids).replace("\ufffd" + "d", "é")
  s = streaming.SampleText(text_fn, stops=("c\nd",), want_pieces=True)
  sent = [s.add([t], [-1.0], None)[0] for t in (1, 2, 3)]
  assert sent == ["ab", "", ""]  # "c", "c\n" may start the stop string: held back
  assert s.add([4], [-1.0], "stop")[0] == "" and s.final_text() == "ab"
  s = streaming.SampleText(text_fn, stops=("zz",), want_pieces=True)
  out = [s.add([t], [-0.5], None)[0] for t in (2, 5)] + [s.add([4], [-0.5], "length")[0]]
  assert out == ["c", "", "é"] and "".join(out) == s.final_text()  # a split character waits for its bytes
  assert s.logprobs == [-0.5] * 3 and len(s.pieces) == 3


@pytest.mark.slow  # the module's server process
def test_completion_and_chat_with_the_openai_client(client, reference):
  exp, engine, tok = reference
  r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=1)
  [choice] = r.choices
  [[want]] = engine.generate([tok.encode(PROMPT)], SamplingParams(max_tokens=12, stop_token_ids=(tok.eos_id,)))
  assert choice.text == tok.decode([t for t in want.tokens if t != tok.eos_id]) and choice.text
  assert choice.logprobs.token_logprobs == pytest.approx(want.logprobs, abs=1e-4)
  assert "".join(choice.logprobs.tokens) == choice.text and choice.finish_reason == want.finish_reason
  assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(tok.encode(PROMPT)), len(want.tokens))
  c = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=10, temperature=0, logprobs=True)
  encoder = chat.ChatEncoder(tok, chat_eval.template_for(exp.manifest, exp.config.data_dir, chat.ChatTemplate()))
  [[want]] = engine.generate([encoder.prompt_ids([("user", CHAT[0]["content"])])],
                             SamplingParams(max_tokens=10, stop_token_ids=(encoder.marker_ids["end"], tok.eos_id)))
  assert c.choices[0].message.content == encoder.completion_text(want.tokens)
  assert c.choices[0].message.role == "assistant"
  assert [x.logprob for x in c.choices[0].logprobs.content] == pytest.approx(want.logprobs, abs=1e-4)
  assert c.usage.completion_tokens == len(want.tokens)


@pytest.mark.slow  # the module's server process
def test_streamed_chunks_concatenate_to_the_plain_answer(client):
  plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0).choices[0].text
  chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0, stream=True))
  assert len([c for c in chunks if c.choices and c.choices[0].text]) > 3
  assert "".join(c.choices[0].text for c in chunks if c.choices) == plain
  stop = plain[len(plain) // 2:len(plain) // 2 + 2]  # a stop string in the middle of the answer
  cut = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0, stop=[stop])
  assert cut.choices[0].text == plain[:plain.find(stop)] and cut.choices[0].finish_reason == "stop"
  streamed = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0, stop=[stop],
                                            stream=True))
  assert "".join(c.choices[0].text for c in streamed if c.choices) == cut.choices[0].text
  chat_plain = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=16, temperature=0)
  chat_chunks = list(client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=16, temperature=0,
                                                    stream=True, stream_options={"include_usage": True}))
  assert "".join(c.choices[0].delta.content or "" for c in chat_chunks if c.choices) == \
      chat_plain.choices[0].message.content
  assert chat_chunks[-1].usage.completion_tokens == chat_plain.usage.completion_tokens


@pytest.mark.slow  # the module's server process
def test_n_samples_seeded_and_streamed(client):
  ask = dict(model="tiny", prompt=PROMPT, max_tokens=12, temperature=1.0, n=3, seed=7)
  first = client.completions.create(**ask)
  texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
  assert [c.index for c in sorted(first.choices, key=lambda c: c.index)] == [0, 1, 2] and len(set(texts)) > 1
  assert [c.text for c in sorted(client.completions.create(**ask).choices, key=lambda c: c.index)] == texts
  streamed = ["", "", ""]
  for chunk in client.completions.create(**ask, stream=True):
    for c in chunk.choices:
      streamed[c.index] += c.text
  assert streamed == texts


@pytest.mark.slow  # the module's server process
def test_greedy_answer_is_the_same_alone_and_among_others(client):
  alone = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
  asks = [dict(prompt=PROMPT, temperature=0) if i % 2 else dict(prompt=f"value of {'a ' * i}", temperature=1.0,
                                                                seed=i) for i in range(10)]
  with concurrent.futures.ThreadPoolExecutor(10) as pool:
    out = list(pool.map(lambda a: client.completions.create(model="tiny", max_tokens=16, **a).choices[0].text, asks))
  assert [o for o, a in zip(out, asks) if a["temperature"] == 0] == [alone] * 5


@pytest.mark.slow  # the module's server process
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, client):
  import openai  # pylint: disable=g-import-not-at-top
  url = server.url + "/v1/completions"
  good = dict(model="tiny", prompt=PROMPT, max_tokens=4)
  cases = [  # (body, status, param, words in the message)
      (b'{"model": "tiny", "prompt": ', 400, None, "not valid JSON"),
      (dict(good, max_tokens="ten"), 400, "max_tokens", "integer"),
      (dict(good, temperature="hot"), 400, "temperature", "number"),
      (dict(good, stream="yes"), 400, "stream", "true or false"),
      (dict(good, max_tokens=1000), 400, "max_tokens", "context of 64"),
      (dict(good, prompt=""), 400, "prompt", "empty"),
      (dict(good, prompt="value of a " * 40), 400, "prompt", "context holds 64"),
      (dict(good, model="gpt-4"), 404, "model", "not served"),
      (dict(good, stop=["a", "b", "c", "d", "e"]), 400, "stop", "at most 4"),
      (dict(good, n=9), 400, "n", "slots"),
      (dict(good, prompt=[5, 100000]), 400, "prompt", "vocabulary"),
  ]
  for body, status, param, words in cases:
    code, reply, _ = sf.post(url, body, raw=isinstance(body, bytes))
    assert (code, reply["error"]["param"]) == (status, param), (body, reply)
    assert words in reply["error"]["message"] and reply["error"]["type"] == "invalid_request_error"
    assert client.completions.create(**good).choices[0].text  # the next good request is answered
  code, reply, _ = sf.post(server.url + "/v1/chat/completions", dict(model="tiny", messages=[{"role": "robot",
                                                                                            "content": "hi"}]))
  assert (code, reply["error"]["param"]) == (400, "messages") and "robot" in reply["error"]["message"]
  with pytest.raises(openai.BadRequestError, match="max_tokens"):
    client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=64)
  assert client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3).choices[0].message.content


def metric(text: str, name: str) -> float:
  return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


@pytest.mark.slow  # the module's server process
def test_a_client_that_leaves_frees_its_slots(server, client):
  """A streaming client reads the first chunk and leaves: the server cancels its 4 samples and frees their slots.
  A test process off the CPU for the whole generation (0.1-0.3 s) sees it finish first, and tries again (3 tries);
  a server that never noticed a client leaving fails every try."""
  # no max_tokens: each sample may run to the context's end
  body = json.dumps(dict(model="tiny", messages=CHAT, n=4, temperature=1.0, seed=3, stream=True))
  counters = ("t5x_like_cancelled_requests_total", "t5x_like_request_seconds_count", "t5x_like_generated_tokens_total")
  for _ in range(3):
    before = sf.get(server.url + "/metrics")
    request = urllib.request.Request(server.url + "/v1/chat/completions", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
    response = urllib.request.urlopen(request, timeout=60)
    assert response.readline().startswith(b"data: ")  # the stream began; now the client goes away
    response.close()
    for _ in range(600):  # until the request was cancelled or finished (bounded; no wall-clock assertion)
      health = json.loads(sf.get(server.url + "/health"))
      text = sf.get(server.url + "/metrics")
      cancelled, finished, generated = (metric(text, name) - metric(before, name) for name in counters)
      if (cancelled or finished) and health["running"] == health["waiting"] == 0:
        break
      time.sleep(0.05)
    if cancelled:
      break
  assert (cancelled, finished) == (1, 0) and health["running"] == health["waiting"] == 0
  assert generated < 4 * 40  # cut short, not run to the end
  assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4).choices[0].text


@pytest.mark.slow  # the module's server process
def test_prometheus_metrics(server, client):
  client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0)
  text = sf.get(server.url + "/metrics")
  assert float(re.search(r'^t5x_like_requests_total{endpoint="completions",status="200"} (\S+)$', text, re.M)[1]) >= 1
  assert metric(text, "t5x_like_generated_tokens_total") >= 5 and metric(text, "t5x_like_prompt_tokens_total") >= 1
  assert metric(text, "t5x_like_time_to_first_token_seconds_count") >= 1
  for name in ("t5x_like_queue_depth", "t5x_like_tokens_per_second", "t5x_like_running_requests"):
    assert re.search(rf"^{name} \S+$", text, re.M), name


@pytest.mark.slow  # two infer processes
def test_greedy_text_equals_infer(launches, client):
  """`infer`'s greedy continuation of PROMPT is the server's, and `infer --chat`'s answer its chat answer."""
  out = launches["infer"].result()
  assert out.returncode == 0, out.stderr[-2000:]
  text = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
  assert out.stdout == f"# checkpoint step 0\n{PROMPT}{text}\n" and text
  out = launches["infer_chat"].result()
  assert out.returncode == 0, out.stderr[-2000:]
  answer = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=10, temperature=0)
  assert json.loads(out.stdout)["messages"][-1]["content"] == answer.choices[0].message.content


@pytest.mark.slow  # a server of its own
def test_full_queue_gets_429_then_sigterm_drains_and_exits_0(launches):
  proc = launches["queue"].wait()
  try:
    body = dict(model="tiny", prompt=PROMPT, max_tokens=50, n=2, temperature=1.0, seed=1)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
      replies = list(pool.map(lambda _: sf.post(proc.url + "/v1/completions", body), range(6)))
    codes = sorted(code for code, _, _ in replies)
    assert 429 in codes and 200 in codes and set(codes) == {200, 429}, codes
    for code, reply, headers in replies:
      if code == 429:
        assert headers.get("Retry-After") == "1" and reply["error"]["type"] == "rate_limit_error"
      else:
        assert len(reply["choices"]) == 2 and all(c["text"] for c in reply["choices"])
    assert sf.post(proc.url + "/v1/completions", dict(body, max_tokens=4))[0] == 200  # served after the burst
    request = urllib.request.Request(proc.url + "/v1/completions", data=json.dumps(
        dict(body, stream=True)).encode(), headers={"Content-Type": "application/json"})
    response = urllib.request.urlopen(request, timeout=60)
    assert response.readline().startswith(b"data: ")
    code, err = proc.terminate()  # mid-stream: the stream still ends properly, then the process exits 0
    rest = response.read().decode()
    assert code == 0 and "Traceback" not in err, err[-2000:]
    assert rest.rstrip().endswith("data: [DONE]") and '"finish_reason": "length"' in rest
    with pytest.raises(OSError):
      sf.get(proc.url + "/health")
  finally:
    proc.stop()


# before the page's own script: every value the page's state (<body data-state>) held, in order, but the current one
RECORD_STATES = """window.states = [];
new MutationObserver(records => records.forEach(r => { if (r.target === document.body) window.states.push(r.oldValue); }))
    .observe(document, {subtree: true, attributes: true, attributeFilter: ["data-state"], attributeOldValue: true});"""


@pytest.mark.slow  # headless Chromium
def test_chat_page_in_headless_chromium(server, client, tmp_path):
  browser = shutil.which("chromium") or shutil.which("chromium-browser")
  if browser is None and not os.environ.get("CI"):
    pytest.skip("chromium is not installed (.ci/run installs it: apt-get install -y chromium)")
  assert browser, "chromium missing: .ci/run installs it"
  url = server.url + "/?q=" + urllib.request.quote("reverse: value of")
  want = client.chat.completions.create(model="tiny", messages=CHAT, temperature=0).choices[0].message.content
  with sf.Chromium(browser, str(tmp_path / "profile")) as chromium:
    tab = chromium.open(url, RECORD_STATES)  # the page sends ?q= as the user's message, streaming the answer
    for _ in range(1200):  # bounded wait for the stream's end (no wall-clock assertion)
      if chromium.evaluate(tab, "document.body && document.body.dataset.state") in ("done", "error"):
        break
      time.sleep(0.05)
    states = chromium.evaluate(tab, "window.states.concat([document.body.dataset.state])")
    answer = chromium.evaluate(tab, "document.getElementById('answer-1').textContent")
    user = chromium.evaluate(tab, "document.querySelector('.turn.user span').textContent")
    shot = chromium.call("Page.captureScreenshot", tab, format="png")["data"]
  assert states == ["idle", "streaming", "done"], states
  assert user == "reverse: value of" and answer == want and want
  (tmp_path / "chat.png").write_bytes(base64.b64decode(shot))  # the screenshot artefact
  assert (tmp_path / "chat.png").stat().st_size > 5000


@pytest.mark.slow  # two processes
def test_help_and_a_bad_flag_is_one_line(launches):
  out = launches["help"].result()
  assert out.returncode == 0 and "--max_batch" in out.stdout and "/v1/chat/completions" in out.stdout
  out = launches["bad_flag"].result()
  assert out.returncode == 1 and out.stderr.strip().splitlines()[-1] == "error: --max_batch must be >= 1, got 0"
  assert "Traceback" not in out.stderr
