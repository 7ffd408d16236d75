"""`python tests/forkserver_probe.py CODE`: prints what a launch sees of its process as JSON, then exits with CODE,
printing "thread" from a non-daemon thread still running at the exit and then "atexit" from an atexit handler
(tests/test_forkserver.py compares a launch through the fork server with a plain one).
`python tests/forkserver_probe.py wait`: sleeps, a launch still running when a test signals it."""

import atexit
import io
import json
import os
import sys
import threading
import time

import jax


def main():
  if sys.argv[1] == "wait":
    time.sleep(600)
  print("to stderr", file=sys.stderr)
  print(json.dumps({
      "pid": os.getpid(), "argv": sys.argv, "orig_argv": sys.orig_argv[1:], "cwd": os.getcwd(), "path0": sys.path[0],
      "probe": os.environ.get("T5X_LIKE_PROBE"), "devices": jax.device_count(),
      "level_0": jax.config.read("jax_disable_most_optimizations"), "x64": jax.config.read("jax_enable_x64"),
      "hash": hash("t5x_like"),
      "jemalloc": "libjemalloc" in open("/proc/self/maps", encoding="utf-8").read(),
      "main": sys.modules["__main__"].__file__ == os.path.abspath(__file__)}))
  # block-buffered whatever PYTHONUNBUFFERED says: the last two lines come out only if the exit flushes sys.stdout
  sys.stdout = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)))
  atexit.register(print, "atexit")
  threading.Thread(target=lambda: (time.sleep(0.3), print("thread"))).start()
  sys.exit(int(sys.argv[1]))


if __name__ == "__main__":
  main()
