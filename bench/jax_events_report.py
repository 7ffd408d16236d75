"""Summary of the events bench/jax_events/sitecustomize.py logged: where a run's JAX time went.

    python bench/jax_events_report.py EVENTS_DIR [--top 20]

Prints the seconds and count of each kind of event (trace, lower, compile, cache) for the pytest workers (in-process
tests) and for the processes they launched, then the programs XLA spent longest compiling, the test files whose
processes compiled longest, and the call sites that traced longest.
"""

import argparse
import collections
import glob
import json
import os


def read(directory: str) -> list:
  records = []
  for path in sorted(glob.glob(os.path.join(directory, "*.jsonl"))):
    with open(path, encoding="utf-8") as f:
      records.extend(json.loads(line) for line in f if line.strip())
  return records


def test_file(record: dict) -> str:
  return record["test"].split("::")[0] or "(no test)"


def totals(records: list) -> dict:
  """{(where, kind): [seconds, count]}, where is 'workers' or 'launched'."""
  out = collections.defaultdict(lambda: [0.0, 0])
  for r in records:
    key = ("workers" if r["pytest"] else "launched", r["ev"])
    out[key][0] += r["wall"]
    out[key][1] += 1
  return dict(out)


def top(records: list, kind: str, key, n: int) -> list:
  """The `n` largest (seconds, count, key) over the records of `kind`, grouped by key(record)."""
  seconds, count = collections.Counter(), collections.Counter()
  for r in records:
    if r["ev"] == kind:
      k = key(r)
      seconds[k] += r["wall"]
      count[k] += 1
  return [(s, count[k], k) for k, s in seconds.most_common(n)]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("events_dir")
  parser.add_argument("--top", type=int, default=20)
  args = parser.parse_args()
  records = read(args.events_dir)
  if not records:
    raise SystemExit(f"error: no events in {args.events_dir} (run with JAX_EVENTS_DIR={args.events_dir} and "
                     f"PYTHONPATH=bench/jax_events)")
  print(f"{len(records)} events from {len({r['pid'] for r in records})} processes")
  for (where, kind), (seconds, count) in sorted(totals(records).items()):
    print(f"  {where:8s} {kind:7s} {seconds:8.1f} s  {count:6d}")
  sections = [("compile", lambda r: r["fn"], "programs compiled longest"),
              ("compile", test_file, "test files whose processes compiled longest"),
              ("trace", lambda r: f"{r['fn']} < " + " < ".join(reversed(r.get("site", []))), "traced longest")]
  for kind, key, title in sections:
    print(f"\n{title} (seconds, count):")
    for seconds, count, name in top(records, kind, key, args.top):
      print(f"  {seconds:8.1f} {count:6d}  {name}")


if __name__ == "__main__":
  main()
