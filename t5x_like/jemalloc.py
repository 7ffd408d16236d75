"""jemalloc as the host allocator of an entry point, loaded before the process starts (parallel/host_allocator.py
has the why, the measurements and the glibc fallback). A root-level helper: `t5x_like/__init__.py` calls
`preload_jemalloc` first thing under `python -m t5x_like.<entry point>`, before any layer is imported."""

import os
import sys

ENV = "T5X_LIKE_HOST_ALLOCATOR"
JEMALLOC = "libjemalloc.so.2"
JEMALLOC_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
                 "/usr/local/lib")
# One arena (XLA's threads would otherwise each keep their own freed pages); freed pages stay mapped for the next
# step, never returned to the system (no page faults, as with the glibc settings). A MALLOC_CONF the user set wins.
JEMALLOC_CONF = "narenas:1,dirty_decay_ms:-1,muzzy_decay_ms:-1"
RESTARTED = "T5X_LIKE_HOST_ALLOCATOR_RESTARTED"  # set in the restarted process: never restart twice


def jemalloc_library() -> str | None:
  """The path of an installed jemalloc shared library, or None."""
  return next((os.path.join(d, JEMALLOC) for d in JEMALLOC_DIRS if os.path.isfile(os.path.join(d, JEMALLOC))), None)


def jemalloc_loaded() -> bool:
  """Whether jemalloc serves this process's malloc (it is mapped into the process)."""
  try:
    with open("/proc/self/maps", encoding="utf-8") as f:
      return "libjemalloc" in f.read()
  except OSError:
    return False


def preload_jemalloc() -> None:
  """Restarts this process with jemalloc preloaded (module docstring) when the mode allows it, jemalloc is installed
  and not loaded yet, and this is not already the restarted process; otherwise returns. Call before the process
  starts threads or imports much.

  Raises:
    SystemExit: T5X_LIKE_HOST_ALLOCATOR=jemalloc and no jemalloc is installed (one line naming the package).
  """
  mode = os.environ.get(ENV, "").lower()
  if mode not in ("", "jemalloc") or not sys.platform.startswith("linux") or os.environ.get(RESTARTED):
    return
  if jemalloc_loaded():
    return
  path = jemalloc_library()
  if path is None:
    if mode == "jemalloc":
      raise SystemExit(f"{ENV}=jemalloc but no {JEMALLOC} under {', '.join(JEMALLOC_DIRS)}: install Debian's "
                       "libjemalloc2 (apt-get install libjemalloc2), or unset it")
    return
  env = dict(os.environ, **{RESTARTED: "1"})
  env["LD_PRELOAD"] = " ".join(p for p in (path, os.environ.get("LD_PRELOAD", "")) if p)
  env.setdefault("MALLOC_CONF", JEMALLOC_CONF)
  sys.stdout.flush()
  sys.stderr.flush()
  os.execve(sys.executable, sys.orig_argv, env)
