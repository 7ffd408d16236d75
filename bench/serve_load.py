"""Load on `python -m t5x_like.serve` over loopback: 1, 8 and 32 concurrent clients streaming completions.

  python bench/serve_load.py [--levels 1,8,32 --requests 64 --seconds 60 --max_tokens 32 --slots 32]
                             [--serve_args "--gin_file=... --gin.MODEL_DIR=... --gin.DATA_DIR=..."]

Without --serve_args it serves the tests' tiny model (tests/serve_fixtures.py: 1 layer, d_model 32, random
weights, context 64) from a temporary folder. The server runs as a subprocess on 127.0.0.1 (a free port) with
--max_batch=--slots. At each level, C client threads send streamed greedy /v1/completions requests one after
another (each prompt unique), until --requests are answered or --seconds have passed (bounded in count and
time; nothing leaves the machine). Per level: tokens/s (completion tokens over the level's wall time), p50/p99
request latency and time to first token (first text chunk). Checks: every request answered exactly once
(its own id, one [DONE], usage present; the server's request counter moved by the count sent) and the highest
level's throughput ≥ 4x one-at-a-time. Exits 1 when a check fails.
"""

import argparse
import collections
import concurrent.futures
import http.client
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests import serve_fixtures as sf  # pylint: disable=wrong-import-position


def stream_one(host: str, port: int, model: str, prompt: str, max_tokens: int) -> dict:
  """One streamed greedy completion: {"id", "latency", "ttft", "tokens", "done", "text"}."""
  start = time.monotonic()
  conn = http.client.HTTPConnection(host, port, timeout=300)
  body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                     "stream_options": {"include_usage": True}})
  conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
  response = conn.getresponse()
  if response.status != 200:
    raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
  out = {"ids": set(), "ttft": None, "tokens": None, "done": 0, "text": ""}
  for line in response:
    line = line.strip()
    if not line.startswith(b"data: "):
      continue
    data = line[6:]
    if data == b"[DONE]":
      out["done"] += 1
      continue
    chunk = json.loads(data)
    out["ids"].add(chunk["id"])
    for c in chunk["choices"]:
      if c["text"] and out["ttft"] is None:
        out["ttft"] = time.monotonic() - start
      out["text"] += c["text"]
    if chunk.get("usage"):
      out["tokens"] = chunk["usage"]["completion_tokens"]
  conn.close()
  out["latency"] = time.monotonic() - start
  return out


def percentile(values, q: float) -> float:
  values = sorted(values)
  return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))] if values else float("nan")


def level(url: str, model: str, clients: int, requests: int, seconds: float, max_tokens: int, tag: str) -> dict:
  """C clients, each sending requests one after another until `requests` are sent or `seconds` pass."""
  parsed = urllib.parse.urlparse(url)
  lock, counter = threading.Lock(), [0]
  deadline = time.monotonic() + seconds
  words = ["value", "of", "path", "self", "reverse:", "again,", "two", "be", "brief"]

  def client(_):
    results = []
    while time.monotonic() < deadline:
      with lock:
        if counter[0] >= requests:
          break
        i = counter[0]
        counter[0] += 1
      prompt = f"{tag} {i}: " + " ".join(words[(i + k) % len(words)] for k in range(3 + i % 5))
      results.append((i, stream_one(parsed.hostname, parsed.port, model, prompt, max_tokens)))
    return results

  start = time.monotonic()
  with concurrent.futures.ThreadPoolExecutor(clients) as pool:
    results = [r for rs in pool.map(client, range(clients)) for r in rs]
  wall = time.monotonic() - start
  sent = counter[0]
  by_index = collections.Counter(i for i, _ in results)
  ids = collections.Counter(next(iter(r["ids"])) for _, r in results if len(r["ids"]) == 1)
  ok = (len(results) == sent and all(v == 1 for v in by_index.values()) and all(v == 1 for v in ids.values())
        and len(ids) == sent and all(r["done"] == 1 and r["tokens"] for _, r in results))
  tokens = sum(r["tokens"] or 0 for _, r in results)
  latencies = [r["latency"] for _, r in results]
  ttfts = [r["ttft"] for _, r in results if r["ttft"] is not None]
  return {"clients": clients, "requests": sent, "tokens": tokens, "seconds": wall, "tokens_per_second": tokens / wall,
          "p50": percentile(latencies, 50), "p99": percentile(latencies, 99), "ttft_p50": percentile(ttfts, 50),
          "ttft_p99": percentile(ttfts, 99), "exactly_once": ok}


def requests_counted(url: str) -> float:
  text = sf.get(url + "/metrics")
  return sum(float(v) for v in re.findall(r'^t5x_like_requests_total{endpoint="completions",status="200"} (\S+)$',
                                          text, re.M))


def cpu_name() -> str:
  try:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return re.search(r"Model name:\s*(.+)", out).group(1).strip()
  except (OSError, AttributeError):
    return platform.processor() or "unknown CPU"


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--levels", default="1,8,32", help="concurrent clients per level, comma-separated")
  parser.add_argument("--requests", type=int, default=64, help="requests per level at most")
  parser.add_argument("--seconds", type=float, default=60.0, help="time per level at most")
  parser.add_argument("--max_tokens", type=int, default=32, help="completion tokens per request")
  parser.add_argument("--slots", type=int, default=32, help="the server's --max_batch")
  parser.add_argument("--serve_args", default="", help="flags for t5x_like.serve (default: the tests' tiny model)")
  args = parser.parse_args()
  levels = [int(c) for c in args.levels.split(",")]
  with tempfile.TemporaryDirectory() as tmp:
    if args.serve_args:
      flags = shlex.split(args.serve_args)
      proc = sf.ServerProcess(None, f"--max_batch={args.slots}", *flags)
    else:
      proc = sf.ServerProcess(sf.make_run(tmp), f"--max_batch={args.slots}")
    try:
      model = json.loads(sf.get(proc.url + "/v1/models"))["data"][0]["id"]
      stream_one(urllib.parse.urlparse(proc.url).hostname, urllib.parse.urlparse(proc.url).port, model, "warm up",
                 args.max_tokens)  # compiles the remaining prefill widths
      counted = requests_counted(proc.url)
      rows = []
      for c in levels:
        rows.append(level(proc.url, model, c, args.requests, args.seconds, args.max_tokens, tag=f"c{c}"))
      counted = requests_counted(proc.url) - counted
    finally:
      code, _ = proc.terminate()
  print(f"# {cpu_name()}, {os.cpu_count()} CPUs; server: {proc.banner}; max_tokens {args.max_tokens}, greedy, "
        f"streamed; SIGTERM exit {code}")
  print("| clients | requests | tokens | seconds | tokens/s | p50 latency s | p99 latency s | p50 TTFT s | p99 TTFT s "
        "| exactly once |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['clients']} | {r['requests']} | {r['tokens']} | {r['seconds']:.1f} | {r['tokens_per_second']:.0f} | "
          f"{r['p50']:.3f} | {r['p99']:.3f} | {r['ttft_p50']:.3f} | {r['ttft_p99']:.3f} | {r['exactly_once']} |")
  sent = sum(r["requests"] for r in rows)
  speedup = rows[-1]["tokens_per_second"] / rows[0]["tokens_per_second"]
  print(f"# {levels[-1]} clients / {levels[0]}: {speedup:.1f}x throughput (target >= 4x); server counted {counted:.0f} "
        f"answered requests of {sent} sent")
  good = all(r["exactly_once"] for r in rows) and counted == sent and speedup >= 4 and code == 0
  print("# PASS" if good else "# FAIL")
  sys.exit(0 if good else 1)


if __name__ == "__main__":
  main()
