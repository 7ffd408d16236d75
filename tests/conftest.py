"""Test set-up: 8 fake CPU devices, set before jax is imported anywhere; under CI, an unexpected skip fails.

Markers and options live in pytest.ini at the repository root.
"""

import os
import tempfile

# One persistent JAX compilation cache for the test run and every process it launches (CLI runs, the
# two-process tests): a program compiled once is loaded, not recompiled, by the next launch of the same config,
# the next test that builds the same step, and the next run of the suite. Set before jax is imported: jax reads
# these variables once, at import (set after it, the test processes ran without the cache, and cached only
# programs that took over a second to compile).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "t5x_like_test_jax_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

from t5x_like import garbage_collector  # pylint: disable=g-import-not-at-top

# The garbage collector as an entry point has it (t5x_like/garbage_collector.py): its thresholds raised
# before the test process imports TensorFlow and JAX, and what is alive once the tests are collected frozen out of
# its scans (pytest_collection_finish). Test files of in-process steps spent ~6% of their time collecting (4.5 s of
# 69 s of CPU in three files; 0.75 s with these settings).
garbage_collector.quiet_garbage_collector()

from t5x_like.parallel import distributed  # pylint: disable=g-import-not-at-top  (imports jax; no backend starts)

# Two kinds of test module. Most build many programs they run a few times: they compile with XLA's optimisation
# turned down (jax_disable_most_optimizations: level 0, about 40% less compile time), set before each test
# (pytest_runtest_setup below). On a fresh machine, with the compilation cache empty, compiling is most of the suite's
# time: XLA compiled 1,735 s of programs in one run with only 7 modules at level 0, 1,075 s with all of them; the whole
# run took 1,427 against 1,114 s (2-core AMD EPYC Zen 4, 6 Dec 2026). A module (or one test) marked `run_bound` runs
# its programs long enough that XLA:CPU's optimisation pays for itself once the cache is warm: it compiles as a user's
# run does, the expensive LLVM passes aside (with the cache warm those 6 modules took 69 s longer in all at level 0; a
# pair of modules on a 2-core AVX2 EPYC: 162 s at level 0, 81 s at the default level). Both sides of every in-process
# comparison are compiled alike. Launched processes compile at level 0 too (xla_flags(); JAX_DISABLE_MOST_OPTIMIZATIONS
# for those inheriting this environment) unless a test launches them as a user's shell would (user_env()).
TEST_XLA_FLAGS = "--xla_llvm_disable_expensive_passes=true"
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 " + TEST_XLA_FLAGS
TEST_SETTINGS = ("XLA_FLAGS", "JAX_DISABLE_MOST_OPTIMIZATIONS")  # what user_env() leaves out


def xla_flags(devices: int = 8, compile_flags: str = FAST_COMPILE_FLAGS) -> str:
  """XLA_FLAGS for a test process with `devices` fake CPU devices (0: the real device count), `compile_flags`, and
  the XLA:CPU flags every entry point runs with (distributed.cpu_xla_flags), so in-process tests compute as the CLI
  runs they compare with."""
  fake = f" --xla_force_host_platform_device_count={devices}" if devices else ""
  return " ".join((compile_flags, *distributed.cpu_xla_flags())) + fake


def user_env() -> dict:
  """The environment of a launch as a user's shell runs it: no test settings (TEST_SETTINGS: no fake devices, no
  reduced optimisation; the entry points add their own flags), for a launch that runs hundreds of steps and compares
  with nothing in process (level 0's code runs ~3× slower: llama_tiny at 16 × 128, 3,980 against 11,775 tokens/s,
  4 Dec 2026, 2-core AMD EPYC with AVX-512). The shared compilation cache stays: a cached program is the same."""
  return {k: v for k, v in os.environ.items() if k not in TEST_SETTINGS}


os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + xla_flags(8, TEST_XLA_FLAGS)).strip()
os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"  # for launches inheriting it (jax read it at its import, above)

import pytest  # pylint: disable=g-import-not-at-top

# Skips that stay skips under CI: the machine cannot give the test what it needs, and another test covers
# the logic. Matched against the start of the skip reason. Anything else that skips under CI fails.
ALLOWED_SKIPS = (
    # test_checkpoints: a real full disk needs a 1 MB tmpfs mount (root); the simulated ENOSPC test covers it.
    "cannot mount a small tmpfs here",
    # test_checkpoints: root on a file system without `chattr +i` cannot make a directory read-only.
    "cannot make a directory read-only here",
)


def on_ci() -> bool:
  return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _skip_reason(report) -> str:
  if isinstance(report.longrepr, tuple):  # (path, line, "Skipped: reason")
    return str(report.longrepr[2]).removeprefix("Skipped: ")
  return str(report.longrepr)


def _fail_unexpected_skip(report) -> None:
  if not (report.skipped and on_ci()) or hasattr(report, "wasxfail"):
    return
  reason = _skip_reason(report)
  if not reason.startswith(ALLOWED_SKIPS):
    report.outcome = "failed"
    report.longrepr = (f"unexpected skip under CI={os.environ['CI']!r}: {reason!r}. Install or provide what the "
                       f"test needs, or add the reason to ALLOWED_SKIPS in tests/conftest.py with why it is "
                       f"acceptable")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):  # pylint: disable=unused-argument
  outcome = yield
  _fail_unexpected_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):  # pylint: disable=unused-argument
  # a module-level pytest.importorskip / pytest.skip
  outcome = yield
  _fail_unexpected_skip(outcome.get_result())


# The files that take longest on 2 cores (seconds of one worker, cold cache, 4 Dec 2026: 258, 240, 208, ~200, 147,
# 136, 122, 120, 119, 108, 105, 104, 94, 92, 87, 84, 84), run first: pytest-xdist hands whole files to its two
# workers in collection order (pytest.ini: --no-loadscope-reorder; its default reorder puts the files with the
# fewest tests, these among them, last), so the long ones run beside the many short ones rather than alone at
# the end (longest first; 10 of 36 minutes of a run went to such a tail).
LONGEST_FILES = ("test_multihost.py", "test_rl_resume.py", "test_sweep.py", "test_marker_rows.py",
                 "test_optimizer_resume.py", "test_families.py", "test_readme_demo.py", "test_lora.py", "test_ppo.py",
                 "test_fault_tolerance.py", "test_engine.py", "test_parallelism.py", "test_online_dpo.py",
                 "test_moe.py", "test_lm_eval.py", "test_interop.py", "test_orpo_kto.py")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
  """Before a test and its fixtures: XLA's optimisation on for a run_bound module or test, turned down for any other."""
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_disable_most_optimizations", item.get_closest_marker("run_bound") is None)


def pytest_collection_finish(session):  # pylint: disable=unused-argument
  garbage_collector.quiet_garbage_collector()


def pytest_collection_modifyitems(config, items):  # pylint: disable=unused-argument
  rank = {name: i for i, name in enumerate(LONGEST_FILES)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: every other file keeps its place


def write_corpus(directory, files=8, lines=300, seed=0):
  """Sentences from a tiny grammar (that of shared/checks/contracts.sh): learnable structure far below
  the unigram entropy."""
  import random  # pylint: disable=g-import-not-at-top
  rng = random.Random(seed)
  subj = ["the trainer", "a shard", "the mesh", "every host", "the optimizer", "a checkpoint"]
  verb = ["reads", "writes", "shards", "restores", "packs", "streams"]
  obj = ["tokens", "parameters", "batches", "gradients", "records", "layers"]
  os.makedirs(directory, exist_ok=True)
  for f in range(files):
    with open(os.path.join(directory, f"doc{f}.txt"), "w") as out:
      for _ in range(lines):
        out.write(f"{rng.choice(subj)} {rng.choice(verb)} {rng.choice(obj)}.\n")


def built_once(tmp_path_factory, name: str, build):
  """`build(directory)`'s JSON-able result, built once per test run in a directory every pytest-xdist worker of the
  run shares (the workers' base temporary directories' parent; a file lock makes a second worker wait for the
  first's build and read its result), so a prepared corpus or an SFT run several files start from is made once,
  not once per worker or per module."""
  import fcntl  # pylint: disable=g-import-not-at-top
  import json  # pylint: disable=g-import-not-at-top
  root = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    root = root.parent
  directory, done = root / name, root / f"{name}.json"
  with open(root / f"{name}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not done.exists():
      directory.mkdir(parents=True, exist_ok=True)
      result = build(directory)
      done.write_text(json.dumps(result))
    return json.loads(done.read_text())


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> str:
  """One prepared DATA_DIR shared by the whole test run (train/e2e, fault tolerance, multi-host), both workers
  (built_once): 8 × 300 generated lines, SentencePiece vocabulary 400, 4 train shards, 20% validation."""
  from t5x_like.data import preprocessing  # pylint: disable=g-import-not-at-top  (after the XLA flags above)

  def build(root) -> str:
    write_corpus(str(root / "raw"))
    preprocessing.preprocess([str(root / "raw" / "*.txt")], str(root / "ds"), vocab_size=400, num_train_shards=4,
                             validation_fraction=0.2, num_workers=1, progress=False, cache_dir=None)
    return str(root / "ds")

  return built_once(tmp_path_factory, "corpus", build)


def rewind(model_dir, to_dir, step: int) -> str:
  """A copy of run `model_dir` as it was when checkpoint `step` was its newest: the later checkpoints, the
  metrics and the event files left out. Resuming the copy and comparing with the original's later steps
  tests exact resume with one training run fewer than "N steps, stop, resume" against "2N straight"."""
  import shutil  # pylint: disable=g-import-not-at-top
  src, dst = str(model_dir), str(to_dir)

  def skip(folder, names):
    if os.path.basename(folder) == "checkpoints" and os.path.dirname(folder) == src:
      return [n for n in names if not (n.isdigit() and int(n) <= step)]
    return [n for n in names if folder == src and (n == "metrics.jsonl" or n.startswith("events.out"))]

  shutil.copytree(src, dst, ignore=skip)
  assert str(step) in os.listdir(os.path.join(dst, "checkpoints")), f"{src} has no checkpoint {step}"
  return dst


def run_cli_in_process(monkeypatch, run, argv) -> object:
  """Runs a command-line entry point (`run`: what its `__main__` calls, e.g. `cli.run(main)`) in this process
  with sys.argv = argv, absl parsing the flags as a launch would; returns its exit code (None or 0: success).
  Saves a process start (~10 s of imports) where the test needs no process of its own."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(sys, "argv", [str(a) for a in argv])
  verbosity = absl_logging.get_verbosity()
  flags.FLAGS.unparse_flags()  # every flag at its default, as in a new process (not an earlier run's --step)
  try:
    with pytest.raises(SystemExit) as exit_info:
      run()
  finally:
    flags.FLAGS.unparse_flags()
    absl_logging.set_verbosity(verbosity)  # the entry points quiet absl for the CLI
  return exit_info.value.code


def _t5x_like_flags() -> dict:
  """name → Flag of every flag a t5x_like module defined (not absl's own)."""
  from absl import flags as absl_flags  # pylint: disable=g-import-not-at-top
  return {f.name: f for f in absl_flags.FLAGS._flags().values()  # pylint: disable=protected-access
          if (absl_flags.FLAGS.find_module_defining_flag(f.name) or "").startswith("t5x_like")}


def run_entry_point(monkeypatch, module: str, argv) -> object:
  """`python -m t5x_like.<module> *argv` in this process (run_cli_in_process; returns the exit code):
  the module imported afresh and its flags defined (at import, or by its define_flags), every other t5x_like
  flag set aside meanwhile (checkpoints' --step, plot's --out, another entry point's: absl refuses a flag
  defined twice) and put back after, with absl's module registries; gin's config cleared before and after.
  (A module the entry point imports for the first time that defines flags at import would lose them after:
  train, evaluate, infer and convert import none.)"""
  import importlib  # pylint: disable=g-import-not-at-top
  from absl import flags as absl_flags  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  import gin  # pylint: disable=g-import-not-at-top
  from t5x_like import cli  # pylint: disable=g-import-not-at-top
  name, fv = f"t5x_like.{module}", absl_flags.FLAGS
  registries = (fv.flags_by_module_dict(), fv.flags_by_module_id_dict(), fv.key_flags_by_module_dict())
  saved_registries = [{k: list(v) for k, v in r.items()} for r in registries]
  aside, previous = _t5x_like_flags(), sys.modules.pop(name, None)
  for flag in aside:
    delattr(fv, flag)
  gin.clear_config()
  try:
    entry = importlib.import_module(name)
    if hasattr(entry, "define_flags"):
      entry.define_flags()
    return run_cli_in_process(monkeypatch, lambda: cli.run(entry.main), [module, *argv])
  finally:
    gin.clear_config()
    for flag in _t5x_like_flags():
      delattr(fv, flag)
    for flag_name, flag in aside.items():
      fv[flag_name] = flag
    for registry, saved in zip(registries, saved_registries):
      registry.clear()
      registry.update(saved)
    if previous is None:
      sys.modules.pop(name, None)
    else:
      sys.modules[name] = previous
      setattr(sys.modules["t5x_like"], module, previous)


def finished(proc, timeout: float = 300):
  """The subprocess.CompletedProcess of a started Popen (stdout and stderr piped, text), once it has ended: tests
  start independent launches together and collect them with this."""
  import subprocess  # pylint: disable=g-import-not-at-top
  out, err = proc.communicate(timeout=timeout)
  return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def launch_each(module: str, runs, env=None, timeout: float = 300) -> list:
  """`python -m module argv` for each argv of `runs`, one after another in one process (tests/launch_each.py: each
  through the module's own `__main__`, flags and gin reset between them; the process forked from tests/forkserver.py's
  server where it serves `env`): a CompletedProcess per run, the last one's return code the process's own."""
  import json  # pylint: disable=g-import-not-at-top
  import re  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  from tests import forkserver  # pylint: disable=g-import-not-at-top
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  done = forkserver.run([sys.executable, os.path.join(root, "tests", "launch_each.py"), module, json.dumps(runs)],
                        cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
  marker = re.compile(r"^=== exit (-?\d+)\n", re.M)
  out, err = marker.split(done.stdout), marker.split(done.stderr)
  if len(out) != 2 * len(runs) - 1 or len(err) != len(out):
    raise AssertionError(f"{module}: {len(runs)} runs expected, the process ended early:\n{done.stderr[-3000:]}")
  codes = [int(c) for c in out[1::2]] + [done.returncode]
  return [subprocess.CompletedProcess([module, *argv], code, o, e)
          for argv, code, o, e in zip(runs, codes, out[0::2], err[0::2])]
