"""`python tests/forkserver_probe.py CODE`: prints what a launch sees of its process as JSON, then exits with CODE
(tests/test_forkserver.py compares a launch through the fork server with a plain one)."""

import json
import os
import sys

import jax


def main():
  print("to stderr", file=sys.stderr)
  print(json.dumps({
      "pid": os.getpid(), "argv": sys.argv, "orig_argv": sys.orig_argv[1:], "cwd": os.getcwd(), "path0": sys.path[0],
      "probe": os.environ.get("T5X_LIKE_PROBE"), "devices": jax.device_count(),
      "level_0": jax.config.read("jax_disable_most_optimizations"), "hash": hash("t5x_like"),
      "jemalloc": "libjemalloc" in open("/proc/self/maps", encoding="utf-8").read(),
      "main": sys.modules["__main__"].__file__ == os.path.abspath(__file__)}))
  sys.exit(int(sys.argv[1]))


if __name__ == "__main__":
  main()
