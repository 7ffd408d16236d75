"""tests/forkserver.py: a launch forked from the fork server sees its process as a plain launch does."""

import importlib
import json
import os
import signal
import subprocess
import sys

import pytest

from tests import forkserver

# Every test here starts processes, plain or forked, to compare them: all are slow (pytest.ini).
pytestmark = pytest.mark.slow

PROBE = [sys.executable, "tests/forkserver_probe.py", "3"]


def env(**extra) -> dict:
  return dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=3", T5X_LIKE_PROBE="yes", **extra)


def user_env() -> dict:
  """env() without the test settings (conftest.user_env): JAX's optimisation on."""
  return {k: v for k, v in env().items() if k != "JAX_DISABLE_MOST_OPTIMIZATIONS"}


def probe(run) -> dict:
  assert run.returncode == 3 and run.stderr == "to stderr\n", (run.returncode, run.stderr[-2000:])
  first, *exit_lines = run.stdout.splitlines()
  return dict(json.loads(first), exit_lines=exit_lines)


def test_a_served_launch_sees_what_a_plain_launch_sees():
  """The same argv, sys.argv, working directory, sys.path[0], environment (XLA_FLAGS read by this launch's own
  backend: 3 devices where the test process has 8; JAX's settings: the test settings' optimisation off), __main__,
  output streams and exit code; at the exit, a non-daemon thread joined, then the atexit handlers, then the output
  flushed (the served launch skips the interpreter's teardown: forkserver.exit_launch); and jemalloc."""
  served = forkserver.Popen(PROBE, cwd=forkserver.REPO, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
  assert isinstance(served, forkserver.Launched)  # not a plain process
  out, err = served.communicate(timeout=120)
  forked = probe(subprocess.CompletedProcess(PROBE, served.returncode, out, err))
  plain = probe(subprocess.run(PROBE, cwd=forkserver.REPO, env=env(), capture_output=True, text=True, timeout=120))
  assert forked["pid"] == served.pid != plain["pid"]
  assert forked["jemalloc"]  # the server's allocator, as an entry point's restart gives it
  for key in ("argv", "orig_argv", "cwd", "path0", "probe", "devices", "level_0", "main", "exit_lines"):
    assert forked[key] == plain[key], (key, forked[key], plain[key])
  assert forked["devices"] == 3 and forked["main"] and forked["level_0"]
  assert forked["exit_lines"] == ["thread", "atexit"]


def test_kill_9_reaches_the_launch_and_its_status_is_popens():
  proc = forkserver.Popen([sys.executable, "tests/forkserver_probe.py", "wait"], cwd=forkserver.REPO,
                          stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
  assert isinstance(proc, forkserver.Launched) and proc.poll() is None
  proc.send_signal(signal.SIGKILL)
  assert proc.wait(timeout=60) == -signal.SIGKILL
  assert not os.path.exists(f"/proc/{proc.pid}")  # reaped by its server before the status came


def test_two_launches_in_a_row_never_share_a_string_hash_seed():
  """A run and its relaunch come from the two servers in turn, as two new processes would (random seeds)."""
  seeds = [probe(forkserver.run(PROBE, cwd=forkserver.REPO, env=env(), capture_output=True, text=True))["hash"]
           for _ in range(3)]
  assert seeds[0] != seeds[1] != seeds[2]


def test_jax_settings_other_than_the_servers_get_their_own_values_or_a_plain_process():
  """JAX read its settings when the server imported it. A launch without the test settings (conftest.user_env) is
  served and compiles with JAX's optimisation on, as a plain launch does (forkserver.SET_IN_LAUNCH: read when a
  program compiles); another JAX setting (read at import) gets a plain process."""
  for environ in (user_env(), dict(user_env(), JAX_DISABLE_MOST_OPTIMIZATIONS="1")):
    served = forkserver.Popen(PROBE, cwd=forkserver.REPO, env=environ, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    assert isinstance(served, forkserver.Launched)
    level_0 = probe(subprocess.CompletedProcess(PROBE, served.wait(timeout=120), *served.communicate()))["level_0"]
    assert level_0 == ("JAX_DISABLE_MOST_OPTIMIZATIONS" in environ)
  other = dict(env(), JAX_ENABLE_X64="1")
  proc = forkserver.Popen(PROBE, cwd=forkserver.REPO, env=other, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)
  assert not isinstance(proc, forkserver.Launched)
  assert probe(subprocess.CompletedProcess(PROBE, proc.wait(timeout=120), *proc.communicate()))["x64"]


def test_a_variable_the_servers_imports_set_is_served_at_their_value_only():
  """TensorFlow's import sets TPU_ML_PLATFORM (as in the test process, once it has imported TensorFlow): a launch
  holding that value is served; another value, read by a plain launch's own import, is not."""
  importlib.import_module("tensorflow")  # (the suite's other tests import it; alone, this test does)
  assert os.environ.get("TPU_ML_PLATFORM") == "Tensorflow"  # set here too, by the import of TensorFlow
  served = forkserver.Popen(PROBE, cwd=forkserver.REPO, env=env(), stdout=subprocess.DEVNULL)
  other = forkserver.Popen(PROBE, cwd=forkserver.REPO, env=env(TPU_ML_PLATFORM="other"), stdout=subprocess.DEVNULL)
  assert isinstance(served, forkserver.Launched) and not isinstance(other, forkserver.Launched)
  assert served.wait(timeout=120) == other.wait(timeout=120) == 3


def test_a_variable_no_server_module_reads_is_served():
  """scikit-learn (imported by lm-eval in a test process) sets KMP_DUPLICATE_LIB_OK, which only Intel's OpenMP runtime
  reads, and no server module loads it: launches after such a test stay served."""
  proc = forkserver.Popen(PROBE, cwd=forkserver.REPO, env=env(KMP_DUPLICATE_LIB_OK="True"), stdout=subprocess.DEVNULL)
  assert isinstance(proc, forkserver.Launched) and proc.wait(timeout=120) == 3


def test_a_variable_the_preloaded_library_reads_gets_a_plain_process(tmp_path):
  """t5x_like.observe.hardware, which the servers import with t5x_like.cli (forkserver.PRELOAD), reads
  T5X_LIKE_HARDWARE at import: a launch that sets it gets a plain process, whose import reads its value."""
  proc = forkserver.Popen(PROBE, cwd=forkserver.REPO, env=env(T5X_LIKE_HARDWARE=str(tmp_path / "hardware.json")),
                          stdout=subprocess.DEVNULL)
  assert not isinstance(proc, forkserver.Launched)
  proc.kill()
  proc.wait(timeout=60)


def test_entry_points_and_the_repositorys_scripts_are_served_nothing_else():
  served = lambda *args: forkserver._served_argv([sys.executable, *args])  # pylint: disable=protected-access
  assert served("-m", "t5x_like.train", "--x") == ["-m", "t5x_like.train", "--x"]
  assert served("tests/forkserver_probe.py", "3") == ["tests/forkserver_probe.py", "3"]
  assert served(os.path.join(forkserver.REPO, "data", "pystdlib", "prepare.py")) is not None
  for args in (("-m", "pytest"), ("bench/decode.py",), ("data/x.py",), ("-c", "print(1)")):
    assert served(*args) is None, args
  assert forkserver._served_argv(["python3", "-m", "t5x_like.train"]) is None  # pylint: disable=protected-access
