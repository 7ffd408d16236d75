"""The host allocator of a process that runs XLA:CPU: jemalloc where it is installed, else glibc set to keep memory.

jemalloc (Debian's libjemalloc2) must be loaded before the process starts: `preload_jemalloc`, called by
`t5x_like/__init__.py` first thing when Python runs a `-m t5x_like.<entry point>`, restarts the process (the same
interpreter and command line) with it in LD_PRELOAD and MALLOC_CONF = JEMALLOC_CONF: one arena, freed pages kept
for the next step. Measured on gpt_25m (bench/torch_reference.py, docs/performance.md): a speed like the glibc
settings' at about half their resident memory. Without jemalloc the glibc settings below apply.

XLA:CPU allocates every step's temporary and output buffers with malloc and frees them when the step ends. glibc
serves blocks over 32 MiB (the mmap threshold's ceiling) with a fresh mmap and returns them with munmap, and threads
other than the main one allocate from their own arenas, which map big blocks the same way. Each step then touches
all of its memory as new pages: gpt_25m (16 × 256 tokens, float32) took ~700,000 minor page faults and 2.8 s of
kernel time per 8 s step on the 2-core CPU (bench/torch_reference.py). `keep_freed_memory` makes every thread
allocate from the main heap, never mmap, and never trims the heap: after the first step (which grows the heap once)
a step reuses the pages of the last and takes no page faults (6.9 s per step).

The cost: the process's resident memory never shrinks below its high-water mark, the price of any caching
allocator (PyTorch's CUDA allocator, TCMalloc). The settings must be made before XLA's threads first allocate,
i.e. before the jax backend starts: `cli.run` makes them for every entry point, and the benches at their top.
`T5X_LIKE_HOST_ALLOCATOR`: unset or `jemalloc` (jemalloc when installed; `jemalloc` makes a missing one an error),
`glibc` (the glibc settings even where jemalloc is installed), `default` (nothing: glibc as it is). Elsewhere than
Linux with glibc (macOS, musl) nothing is changed.
"""

import ctypes
import gc
import json
import os
import sys

from t5x_like.jemalloc import ENV
from t5x_like.jemalloc import jemalloc_loaded

# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX, M_ARENA_MAX = -1, -2, -4, -8
TOP_PAD_BYTES = 1 << 30  # the heap grows by at least this much at once: one expensive first step, not several


def _mallopt():
  """glibc's mallopt, or None where the C library is not glibc."""
  if not sys.platform.startswith("linux"):
    return None
  try:
    libc = ctypes.CDLL(None)
    libc.gnu_get_libc_version  # pylint: disable=pointless-statement  (glibc only: musl's mallopt does nothing)
    return libc.mallopt
  except (OSError, AttributeError):
    return None


def keep_freed_memory() -> bool:
  """Sets glibc's malloc to keep freed memory for reuse (module docstring); True when the settings took. Nothing
  when jemalloc serves malloc.

  Call before the jax backend starts (before any jax.devices() or computation); later calls still set the
  parameters but threads that already allocated keep their own arenas."""
  if os.environ.get(ENV, "").lower() == "default" or jemalloc_loaded():
    return False
  mallopt = _mallopt()
  if mallopt is None:
    return False
  settings = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, -1), (M_TOP_PAD, TOP_PAD_BYTES))
  return all(mallopt(param, value) == 1 for param, value in settings)


def main() -> None:
  """`python -m t5x_like.parallel.host_allocator`: prints which allocator serves this process and the garbage
  collector's thresholds (what an entry point gets)."""
  print(json.dumps({"jemalloc": jemalloc_loaded(), "malloc_conf": os.environ.get("MALLOC_CONF", ""),
                    "mode": os.environ.get(ENV, ""), "gc_threshold": list(gc.get_threshold())}))


if __name__ == "__main__":
  main()
