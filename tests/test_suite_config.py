"""The suite's own configuration: pytest.ini's strict markers and -ra, and tests/conftest.py turning an
unexpected skip into a failure under CI (allowed reasons stay skips). Each case runs pytest (in this process,
through pytester) on a few throwaway tests with the repository's pytest.ini and conftest.py."""

import os
import shutil

import pytest

from tests import conftest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SKIPS = '''
import pytest

def test_passes():
  pass

def test_unexpected_skip():
  pytest.skip("something is missing")

@pytest.mark.skipif(True, reason="a marker skip")
def test_marked_skip():
  pass

def test_allowed_skip():
  pytest.skip("cannot mount a small tmpfs here (needs root)")

@pytest.mark.xfail(reason="known")
def test_expected_failure():
  assert False
'''


@pytest.fixture
def run_pytest(pytester, monkeypatch):
  """pytest on `files` with the repository's pytest.ini and a copy of tests/conftest.py, run inside this process
  (pytester: its own session, its modules unloaded after): (exit code, output). CI is unset unless `ci` is given."""
  def run(files: dict, ci=None):
    for name, text in files.items():
      (pytester.path / name).write_text(text)
    shutil.copy(os.path.join(ROOT, "tests", "conftest.py"), pytester.path / "conftest.py")
    monkeypatch.setenv("XLA_FLAGS", os.environ["XLA_FLAGS"])  # restored after: the copy appends the test flags
    monkeypatch.delenv("CI", raising=False)
    if ci is not None:
      monkeypatch.setenv("CI", ci)
    result = pytester.runpytest_inprocess("-c", os.path.join(ROOT, "pytest.ini"), "--rootdir", str(pytester.path),
                                          "-p", "no:cacheprovider", "-n", "0", str(pytester.path))
    return int(result.ret), "\n".join(result.outlines + result.errlines)
  return run


def test_skips_are_listed_and_pass_outside_ci(run_pytest):
  code, out = run_pytest({"test_skips.py": SKIPS})
  assert code == 0, out
  assert "1 passed, 3 skipped, 1 xfailed" in out
  assert "SKIPPED [1] test_skips.py:8: something is missing" in out  # -ra lists each skip with its reason


@pytest.mark.parametrize("ci", ["true", "1"])
def test_unexpected_skips_fail_under_ci_and_allowed_ones_stay_skips(run_pytest, ci):
  code, out = run_pytest({"test_skips.py": SKIPS}, ci=ci)
  assert code == 1, out
  assert "1 failed, 1 passed, 1 skipped, 1 xfailed, 1 error" in out  # a skip marker fails at set-up: an error
  assert f"FAILED test_skips.py::test_unexpected_skip - unexpected skip under CI='{ci}': 'something is missing'" in out
  assert f"ERROR test_skips.py::test_marked_skip - unexpected skip under CI='{ci}': 'a marker skip'" in out
  assert "SKIPPED [1] test_skips.py:15: cannot mount a small tmpfs here" in out


def test_ci_false_does_not_fail_skips(run_pytest):
  code, out = run_pytest({"test_skips.py": SKIPS}, ci="false")
  assert code == 0 and "3 skipped" in out, out


def test_a_module_skipped_at_import_fails_under_ci(run_pytest):
  files = {"test_missing.py": 'import pytest\npytest.importorskip("no_such_module_here")\n',
           "test_present.py": "def test_x():\n  pass\n"}
  code, out = run_pytest(files, ci="true")
  assert code == 2 and "Interrupted: 1 error during collection" in out, out  # the session stops there
  assert "ERROR test_missing.py - unexpected skip under CI='true': \"could not import 'no_such_module_here'" in out
  code, out = run_pytest(files)
  assert code == 0 and "1 passed, 1 skipped" in out, out


def test_unknown_marker_is_an_error_and_slow_is_registered(run_pytest):
  marked = 'import pytest\n\n@pytest.mark.slow\ndef test_a():\n  pass\n\n@pytest.mark.sloww\ndef test_b():\n  pass\n'
  code, out = run_pytest({"test_marked.py": marked})
  assert code != 0 and "'sloww' not found in `markers` configuration option" in out, out
  assert "'slow' not found" not in out


def test_the_test_processes_use_the_persistent_compilation_cache():
  """tests/conftest.py's JAX variables reach jax itself (jax reads them once, at import: set after it, the test
  processes ran with no persistent cache and cached only compiles over a second)."""
  import jax  # pylint: disable=g-import-not-at-top
  assert jax.config.jax_compilation_cache_dir == os.environ["JAX_COMPILATION_CACHE_DIR"]
  assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
  assert jax.config.jax_persistent_cache_min_entry_size_bytes == 0
  assert jax.config.jax_platforms == os.environ["JAX_PLATFORMS"]


def test_run_bound_modules_compile_as_a_user_run_and_the_others_at_level_0(run_pytest):
  """tests/conftest.py sets XLA's optimisation before each test: on in a module or test marked run_bound (its
  fixtures included), turned down elsewhere; a launched process inherits the turned-down setting, user_env() does
  not."""
  check = ("import jax, os, pytest\n{mark}\n@pytest.fixture(scope='module')\ndef level():\n"
           "  return jax.config.read('jax_disable_most_optimizations')\n\n"
           "def test_level(level):\n"
           "  assert level is {expected} and jax.config.read('jax_disable_most_optimizations') is {expected}\n"
           "  assert os.environ['JAX_DISABLE_MOST_OPTIMIZATIONS'] == '1'\n")
  files = {"test_a_level0.py": check.format(mark="", expected=True),
           "test_b_run.py": check.format(mark="pytestmark = pytest.mark.run_bound\n", expected=False),
           "test_c_level0.py": check.format(mark="", expected=True),
           "test_d_one.py": ("import jax, pytest\n\n@pytest.mark.run_bound\ndef test_marked():\n"
                             "  assert jax.config.read('jax_disable_most_optimizations') is False\n\n"
                             "def test_unmarked():\n"
                             "  assert jax.config.read('jax_disable_most_optimizations') is True\n")}
  code, out = run_pytest(files)
  assert code == 0 and "5 passed" in out, out
  assert not {"XLA_FLAGS", "JAX_DISABLE_MOST_OPTIMIZATIONS"} & set(conftest.user_env())
  assert "--xla_backend_optimization_level=0" in conftest.xla_flags(2)


def test_built_once_builds_one_directory_for_every_worker_of_the_run(tmp_path, monkeypatch):
  """conftest.built_once: two pytest-xdist workers of one run (base temporary directories popen-gw0 and popen-gw1
  under the run's) asking at the same time get one build, the second waiting for the first's result."""
  import threading  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  import types  # pylint: disable=g-import-not-at-top
  monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
  builds = []

  def build(directory):
    builds.append(directory)
    time.sleep(0.2)  # the other worker asks meanwhile
    (directory / "data.txt").write_text("built")
    return str(directory / "data.txt"), {"rows": 3}

  results = {}

  def worker(name):
    factory = types.SimpleNamespace(getbasetemp=lambda: tmp_path / f"popen-{name}")
    results[name] = conftest.built_once(factory, "prepared", build)

  threads = [threading.Thread(target=worker, args=(name,)) for name in ("gw0", "gw1")]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  assert builds == [tmp_path / "prepared"]
  assert results["gw0"] == results["gw1"] == [str(tmp_path / "prepared" / "data.txt"), {"rows": 3}]
  assert (tmp_path / "prepared" / "data.txt").read_text() == "built"
