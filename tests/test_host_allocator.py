"""parallel/host_allocator.py and t5x_like/jemalloc.py: with glibc set to keep freed memory, a repeated XLA:CPU program
takes no page faults; entry points run on jemalloc where it is installed; t5x_like/garbage_collector.py: their garbage
collector skips what their imports left."""

import gc
import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests import conftest
from t5x_like import garbage_collector
from t5x_like import jemalloc
from t5x_like.parallel import host_allocator

# As cli.run does it: jax imported, its backend not started yet. Then a program whose 64 MiB output is allocated
# and freed on every call; prints whether the settings took and the minor page faults of each of WINDOWS windows
# of CALLS calls, after 10.
CALLS = 8
WINDOWS = 4
SCRIPT = textwrap.dedent(f"""
    import resource
    import jax
    import jax.numpy as jnp
    from t5x_like.parallel import host_allocator
    took = host_allocator.keep_freed_memory()
    f = jax.jit(lambda x: x * 2.0 + 1.0)
    x = jnp.ones((16, 1024, 1024), jnp.float32)
    for _ in range(10):  # the heap grows to its steady size (freed buffers are released a call or two late)
      f(x).block_until_ready()
    faults = []
    for _ in range({WINDOWS}):
      before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
      for _ in range({CALLS}):
        f(x).block_until_ready()
      faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(took, *faults)
""")
PAGES_PER_CALL = 64 * 2**20 // 4096


def _faults(allocator_env: str) -> tuple:
  env = dict(os.environ, XLA_FLAGS=conftest.xla_flags(1), JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
  env[host_allocator.ENV] = allocator_env
  out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  took, *faults = out.stdout.split()
  return took == "True", [int(f) for f in faults]


@pytest.mark.slow  # a Python process of its own
def test_freed_memory_is_reused_without_page_faults():
  took, faults = _faults("")
  assert took
  # Mostly 0. Now and then a small allocation splits the freed block and the output moves up the heap's top pad
  # for a few calls (seen: 4 of 8, and 6 of 8 in a CI run on a loaded machine) before the heap settles again, so
  # the best window is checked; glibc's defaults fault in every call of every window.
  assert min(faults) <= CALLS // 2 * PAGES_PER_CALL, faults


@pytest.mark.slow  # a Python process of its own
def test_glibc_defaults_fault_every_call_in_again():  # what the settings save; T5X_LIKE_HOST_ALLOCATOR=default
  took, faults = _faults("default")
  assert not took
  assert min(faults) >= CALLS * PAGES_PER_CALL, faults  # glibc maps and unmaps the 64 MiB block on every call


def _entry_point_allocator(**env_vars) -> subprocess.CompletedProcess:
  """`python -m t5x_like.parallel.host_allocator` (an entry point's start: t5x_like/__init__.py restarts it with
  jemalloc where installed): its report of the allocator that serves it."""
  env = {k: v for k, v in os.environ.items() if k not in (host_allocator.ENV, "MALLOC_CONF", "LD_PRELOAD")}
  return subprocess.run([sys.executable, "-m", "t5x_like.parallel.host_allocator"], capture_output=True, text=True,
                        env={**env, **env_vars}, timeout=120)


@pytest.mark.slow  # three launches
def test_entry_points_run_on_jemalloc_where_it_is_installed():
  """Under `python -m t5x_like.<entry point>` the process restarts once with jemalloc preloaded and MALLOC_CONF =
  JEMALLOC_CONF (a MALLOC_CONF the user set is kept); T5X_LIKE_HOST_ALLOCATOR=glibc keeps glibc. (.ci/run installs
  Debian's libjemalloc2; where it is missing, asking for jemalloc is a one-line error naming the package.)"""
  if jemalloc.jemalloc_library() is None:
    out = _entry_point_allocator(**{host_allocator.ENV: "jemalloc"})
    assert out.returncode != 0 and "libjemalloc2" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    pytest.skip("libjemalloc2 is not installed (bash .ci/run installs it)")
  report = json.loads(_entry_point_allocator().stdout)
  assert report == {"jemalloc": True, "malloc_conf": jemalloc.JEMALLOC_CONF, "mode": "",
                    "gc_threshold": list(garbage_collector.GC_THRESHOLDS)}
  report = json.loads(_entry_point_allocator(MALLOC_CONF="narenas:2").stdout)
  assert report["jemalloc"] and report["malloc_conf"] == "narenas:2"
  report = json.loads(_entry_point_allocator(**{host_allocator.ENV: "glibc"}).stdout)
  assert not report["jemalloc"]


def test_entry_points_freeze_their_imports_out_of_the_garbage_collectors_scans(monkeypatch):
  """`python -m t5x_like.<entry point>` raises the collector's thresholds before its imports (t5x_like/__init__.py;
  the report above), and cli.run, which every entry point's main runs under, sets them again and freezes what is
  alive (the imports): the collector's passes then walk only what the run allocates. Run here in this process,
  from Python's defaults and nothing frozen."""
  from t5x_like import cli  # pylint: disable=g-import-not-at-top
  seen = []
  gc.set_threshold(700, 10, 10)
  gc.unfreeze()
  try:
    assert conftest.run_cli_in_process(monkeypatch, lambda: cli.run(lambda argv: seen.append(
        (gc.get_threshold(), gc.get_freeze_count(), len(gc.get_objects())))), ["probe"]) in (None, 0)
  finally:
    garbage_collector.quiet_garbage_collector()  # as conftest left this process
  (threshold, frozen, tracked), = seen
  assert threshold == garbage_collector.GC_THRESHOLDS
  assert frozen > 100_000 and tracked < frozen // 10, (frozen, tracked)  # TensorFlow, JAX, t5x_like...: ~380,000
