"""Launches of `python -m t5x_like.<entry point>` forked from a process that has imported TensorFlow and JAX.

Every launch of an entry point spends its first seconds importing: TensorFlow (with ml_dtypes and numpy) and JAX
are most of it (`python -X importtime -c "import t5x_like.train"`: 7.5 of 9.2 s on a busy 2-core AVX2 EPYC), and
the suite launches entry points about 75 times. A fork server imports them (and t5x_like's library: PRELOAD) once;
each launch is then a fork of it that runs the module's `__main__` (runpy, as `python -m` does) with the launch's
argv, working directory, environment and stdin/stdout/stderr.

JAX reads its settings from the environment when it is imported (JAX_*; TensorFlow imports it, through TF Lite),
so a server serves only launches with its own JAX_* variables (the test settings), but for those of SET_IN_LAUNCH:
settings read when a program compiles, which the launch sets itself (jax.config.update) from its own environment
before its module runs, as its import would have. XLA reads XLA_FLAGS when a process's first backend starts, which
no server does: each launch's own XLA_FLAGS apply (tests/test_forkserver.py checks all three).

What stays as in a new process: the process id a test signals (kill -9, SIGTERM: the signalled process is the run
itself), the exit status (-9 for a SIGKILL), jemalloc as the allocator (the server restarts itself under it as the
entry points do, and its launches inherit it), atexit handlers and the join of non-daemon threads at exit (a launch
leaves the server's code before it runs the module: nothing of the server is on its stack). Two servers take turns,
so two consecutive launches (a run and its relaunch) never share a string-hash seed or numpy's global random state.
What differs: a launch that finishes (or exits through SystemExit) skips the interpreter's teardown of its modules
(`exit_launch`: 1.1-1.3 s a launch).

Not served (`Popen` starts a plain process instead): anything but `python -m t5x_like.…`, a script under tests/ or
a dataset's under data/, a stdin or keyword other than the defaults, or an environment that differs from the
server's in a variable its modules read at import (AT_IMPORT: Python's, the allocator's, TensorFlow's, JAX's...; a
value those imports set themselves, as TensorFlow's TPU_ML_PLATFORM, may be there already; SET_IN_LAUNCH's may
differ). Tests of import behaviour itself (test_imports, test_metrics_logger, test_host_allocator) launch plain
processes.

A server: `python tests/forkserver.py SOCKET`; it exits when its stdin (a pipe from the test process) closes.
"""

import atexit
import json
import os
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import types

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(REPO, "data")
PRELOAD = ("numpy", "ml_dtypes", "jax", "tensorflow", "flax", "optax", "absl.app", "absl.flags", "absl.logging",
           "gin",
           # the library every entry point imports (t5x_like.cli: the data, model, recipes, orbax; the trainer):
           # 0.6 s of each launch's imports on an idle 2-core AVX2 EPYC (more on a busy one). Not an entry point
           # itself (train, evaluate... define their flags at import: runpy runs them afresh as __main__), and not
           # lm-eval, Beam or matplotlib, whose packages read variables (HF_*, MPL*) at import that AT_IMPORT
           # does not hold.
           "t5x_like.cli", "t5x_like.training.trainer")
# environment variables read when the servers' modules are imported (Python, the allocator, numpy and its BLAS,
# TensorFlow, JAX, Flax, absl, gin, t5x_like's hardware catalogue): a launch must hold the values its server started
# with. Not KMP_*: no Intel OpenMP runtime is loaded by them (scikit-learn, which lm-eval imports in a test process,
# sets KMP_DUPLICATE_LIB_OK).
AT_IMPORT = ("PYTHON", "LD_", "MALLOC_", "T5X_LIKE_HOST_ALLOCATOR", "T5X_LIKE_HARDWARE", "OMP_", "OPENBLAS_", "GOTO",
             "MKL_", "NPY_", "NUMPY_", "TF_", "JAX_", "FLAX_", "ABSL_", "GIN_", "XLA_PYTHON_", "CUDA", "TPU_")
JEMALLOC_KEYS = ("LD_PRELOAD", "MALLOC_CONF", "T5X_LIKE_HOST_ALLOCATOR_RESTARTED")  # what the restart adds
# JAX settings a launch may hold at another value than its server: JAX reads them when it compiles, so the launch
# sets them from its own environment (absent: JAX's default) before its module runs. conftest.user_env()'s launches
# (XLA's optimisation on, as a user's) are served this way.
SET_IN_LAUNCH = {"JAX_DISABLE_MOST_OPTIMIZATIONS": ("jax_disable_most_optimizations", False)}
HEADER = struct.Struct("!Q")


# ---------------------------------------------------------------------------------------------------- the server

def _recv_exactly(conn, n: int) -> bytes:
  data = b""
  while len(data) < n:
    chunk = conn.recv(n - len(data))
    if not chunk:
      raise ConnectionError("the client closed the connection")
    data += chunk
  return data


def _receive(conn) -> tuple:
  """(request, [stdin, stdout, stderr] fds): one length-prefixed JSON message, the fds sent with its first bytes."""
  first, fds, _, _ = socket.recv_fds(conn, HEADER.size, 3)
  size, = HEADER.unpack(first + _recv_exactly(conn, HEADER.size - len(first)))
  return json.loads(_recv_exactly(conn, size)), fds


def serve(path: str) -> dict:
  """Serves launches on the Unix socket `path` until stdin closes (then exits). Returns only in a forked launch,
  with its request, its stdio in place."""
  listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  listener.bind(path)
  listener.listen(16)
  selector = selectors.DefaultSelector()
  selector.register(listener, selectors.EVENT_READ, "accept")
  selector.register(sys.stdin, selectors.EVENT_READ, "stdin")
  print("ready " + json.dumps(dict(os.environ)), flush=True)  # as its imports (and jemalloc's restart) left it
  running = {}  # pidfd -> (pid, connection)
  while True:
    for key, _ in selector.select():
      if key.data == "stdin":
        if not os.read(sys.stdin.fileno(), 4096):
          os._exit(0)  # pylint: disable=protected-access  (the test process is gone)
      elif key.data == "accept":
        conn, _ = listener.accept()
        try:
          request, fds = _receive(conn)
        except (ConnectionError, ValueError, OSError):
          conn.close()
          continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the launch: nothing of the server stays open
          selector.close()
          for sock in [listener, conn, *(c for _, c in running.values())]:
            sock.close()
          for fd in running:
            os.close(fd)
          for target, fd in enumerate(fds):
            os.dup2(fd, target)
          for fd in set(fds):
            if fd > 2:
              os.close(fd)
          return request
        for fd in fds:
          os.close(fd)
        conn.sendall(HEADER.pack(pid))
        pidfd = os.pidfd_open(pid)
        running[pidfd] = (pid, conn)
        selector.register(pidfd, selectors.EVENT_READ, "exit")
      else:  # a launch ended: its exit status to its client, as Popen.returncode has it
        pid, conn = running.pop(key.fd)
        selector.unregister(key.fd)
        os.close(key.fd)
        _, status = os.waitpid(pid, 0)
        try:
          conn.sendall(struct.pack("!q", os.waitstatus_to_exitcode(status)))
        except OSError:
          pass  # the client went away
        conn.close()


def run_launch(request: dict) -> None:
  """In the forked launch: the process as `python ARGV` would have it, then the module's or script's __main__."""
  import runpy  # pylint: disable=g-import-not-at-top
  os.chdir(request["cwd"])
  os.environ.clear()
  os.environ.update(request["env"])
  import jax  # pylint: disable=g-import-not-at-top  (imported by the server: PRELOAD)
  from jax._src import config as jax_config  # pylint: disable=g-import-not-at-top  (JAX's reader of its variables)
  for variable, (name, default) in SET_IN_LAUNCH.items():
    jax.config.update(name, jax_config.bool_env(variable, default))  # as JAX's import reads it
  signal.signal(signal.SIGINT, signal.default_int_handler)
  argv = request["argv"]
  sys.orig_argv = [sys.executable, *argv]
  if argv[0] == "-m":
    sys.argv = [argv[1], *argv[2:]]
    sys.path[0] = request["cwd"]
    runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
  else:  # as `python SCRIPT` runs it: sys.argv[0] as given, __main__.__file__ absolute
    sys.argv = list(argv)
    path = os.path.abspath(argv[0])
    sys.path[0] = os.path.dirname(path)
    main = types.ModuleType("__main__")
    main.__file__, main.__cached__ = path, None
    sys.modules["__main__"] = main
    with open(path, "rb") as f:
      exec(compile(f.read(), path, "exec"), main.__dict__)  # pylint: disable=exec-used


def server_main(path: str) -> None:
  from t5x_like import jemalloc  # pylint: disable=g-import-not-at-top  (t5x_like first: it hides Keras from TF)
  jemalloc.preload_jemalloc()  # restarts this process under jemalloc, as an entry point does
  from t5x_like import garbage_collector  # pylint: disable=g-import-not-at-top
  garbage_collector.quiet_garbage_collector()  # as t5x_like/__init__.py does for `-m t5x_like.<entry point>`
  import importlib  # pylint: disable=g-import-not-at-top
  for name in PRELOAD:
    importlib.import_module(name)
  garbage_collector.quiet_garbage_collector()  # the imported modules frozen once, for every fork
  request = serve(path)
  try:
    run_launch(request)
    code = 0
  except SystemExit as e:  # any other exception leaves as Python leaves (its traceback, status 1)
    code = _exit_status(e)
  exit_launch(code)


def _exit_status(e: SystemExit) -> int:
  """The exit status Python gives SystemExit(e.code), printing a code that is not a number as it does."""
  if e.code is None:
    return 0
  if isinstance(e.code, int):
    return e.code
  print(e.code, file=sys.stderr)
  return 1


def exit_launch(code: int) -> None:
  """Ends a launch whose module has finished as the interpreter would (its non-daemon threads joined, then its
  atexit handlers, then its output flushed) without the interpreter's teardown of every module TensorFlow and JAX
  loaded: 1.1-1.3 s of each launch of a 12-step run on an idle 2-core AVX2 EPYC (os._exit after the handlers:
  0.2 s). Files a launch leaves open unflushed would lose their tail here, and in a killed run too."""
  threading._shutdown()  # pylint: disable=protected-access  (what Py_FinalizeEx does first)
  atexit._run_exitfuncs()  # pylint: disable=protected-access
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (OSError, ValueError):
      pass
  os._exit(code)  # pylint: disable=protected-access


# ---------------------------------------------------------------------------------------------------- the client

def _at_import(env) -> dict:
  """The variables of `env` that the servers' modules read when they are imported and a launch cannot set itself."""
  return {k: v for k, v in env.items() if k.startswith(AT_IMPORT) and k not in SET_IN_LAUNCH}


class _Server:
  """One fork server of this test process, started with its environment at the time."""

  def __init__(self):
    self.dir = tempfile.mkdtemp(prefix="t5x_like_forkserver_")
    atexit.register(shutil.rmtree, self.dir, True)
    self.path = os.path.join(self.dir, "socket")
    self.before = _at_import(os.environ)
    self.proc = subprocess.Popen([sys.executable, os.path.join(REPO, "tests", "forkserver.py"), self.path],
                                 cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    ready = self.proc.stdout.readline()
    if not ready.startswith(b"ready "):
      raise RuntimeError(f"the fork server did not start (exit {self.proc.wait()})")
    after = json.loads(ready[len(b"ready "):])
    self.jemalloc = {k: after[k] for k in JEMALLOC_KEYS if k in after}
    # what the imports themselves set (TensorFlow sets TPU_ML_PLATFORM, KMP_INIT_AT_FORK..., JAX TPU_SKIP_MDS_QUERY,
    # t5x_like TF_CPP_MIN_LOG_LEVEL): a launch may hold those values already (its test process imported the same)
    after = _at_import(after)
    self.set_by_imports = {k: after.get(k) for k in set(after) | set(self.before)
                           if after.get(k) != self.before.get(k)}

  def serves(self, env) -> bool:
    """Whether a launch with environment `env` imports as this server did: each variable read at import as the
    server started with it, or as its imports set it."""
    env = _at_import(env)
    return all(env.get(k) == self.before.get(k) or (k in self.set_by_imports and env.get(k) == self.set_by_imports[k])
               for k in set(env) | set(self.before) | set(self.set_by_imports))


_SERVERS = [None, None]  # each started at its first turn
_TURN = [0]
_LOCK = threading.Lock()


def _server(env):
  """The next of the two servers (started on first use), or None where it does not serve `env` (_Server.serves)."""
  with _LOCK:
    turn = _TURN[0] % 2
    _TURN[0] += 1
    if _SERVERS[turn] is None:
      if _SERVERS[1 - turn] is not None and not _SERVERS[1 - turn].serves(env):
        return None  # this one would start with the same environment: not worth starting for this launch
      _SERVERS[turn] = _Server()
    server = _SERVERS[turn]
  return server if server.serves(env) else None


def _served_argv(args):
  """The argv after `python` when the fork server can run `args`, else None."""
  args = [os.fspath(a) for a in args]
  if len(args) < 2 or args[0] != sys.executable:
    return None
  if args[1] == "-m" and len(args) > 2 and args[2].startswith("t5x_like."):
    return args[1:]
  folder = os.path.dirname(os.path.abspath(args[1]))
  if args[1].endswith(".py") and (folder == os.path.join(REPO, "tests") or os.path.dirname(folder) == DATA):
    return args[1:]  # a script under tests/, or a dataset's under data/ (data/pystdlib/prepare.py)
  return None


class Launched:
  """A launch through a fork server, with the part of subprocess.Popen the tests use: pid, args, returncode,
  stdout / stderr (file objects for PIPE), poll, wait, send_signal, terminate, kill, communicate. Its stdin is
  /dev/null (no launch reads one; a plain Popen would share the test worker's)."""

  def __init__(self, server, args, argv, cwd, env, stdout, stderr, text):
    self.args, self.returncode, self._status = args, None, b""
    mode = "r" if text else "rb"
    fds, mine, theirs = [os.open(os.devnull, os.O_RDONLY)], [], []
    for target, default in ((stdout, 1), (stderr, 2)):
      if target is None:
        fds.append(default)
      elif target == subprocess.STDOUT:
        fds.append(fds[1])
      elif target == subprocess.PIPE:
        read, write = os.pipe()
        mine.append(open(read, mode))  # pylint: disable=consider-using-with
        theirs.append(write)
        fds.append(write)
      elif target == subprocess.DEVNULL:
        theirs.append(os.open(os.devnull, os.O_WRONLY))
        fds.append(theirs[-1])
      else:
        fds.append(target if isinstance(target, int) else target.fileno())
    self.stdout = mine.pop(0) if stdout == subprocess.PIPE else None
    self.stderr = mine.pop(0) if stderr == subprocess.PIPE else None
    env = dict(os.environ if env is None else env)
    env.update({k: v for k, v in server.jemalloc.items() if k not in env})
    payload = json.dumps({"argv": argv, "cwd": os.path.abspath(cwd or os.getcwd()), "env": env}).encode()
    self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
      self._conn.connect(server.path)
      socket.send_fds(self._conn, [HEADER.pack(len(payload))], fds)
      self._conn.sendall(payload)
      self.pid, = HEADER.unpack(_recv_exactly(self._conn, HEADER.size))
    finally:
      for fd in [fds[0], *theirs]:
        os.close(fd)

  def _read_status(self, timeout) -> bool:
    self._conn.settimeout(timeout)
    try:
      while len(self._status) < 8:
        chunk = self._conn.recv(8 - len(self._status))
        if not chunk:
          raise RuntimeError(f"the fork server of {self.args} went away")
        self._status += chunk
    except (socket.timeout, BlockingIOError):
      return False
    self.returncode, = struct.unpack("!q", self._status)
    self._conn.close()
    return True

  def poll(self):
    if self.returncode is None:
      self._read_status(0)
    return self.returncode

  def wait(self, timeout=None):
    if self.returncode is None and not self._read_status(timeout):
      raise subprocess.TimeoutExpired(self.args, timeout)
    return self.returncode

  def send_signal(self, sig):
    if self.poll() is None:
      os.kill(self.pid, sig)

  def terminate(self):
    self.send_signal(signal.SIGTERM)

  def kill(self):
    self.send_signal(signal.SIGKILL)

  def communicate(self, timeout=None):
    """(stdout, stderr) as Popen.communicate gives them (None where not piped), once the launch has ended; after a
    TimeoutExpired, a second call goes on collecting the same output."""
    deadline = None if timeout is None else time.monotonic() + timeout
    if not hasattr(self, "_readers"):
      self._outputs = {}
      self._readers = [threading.Thread(target=lambda f=f: self._outputs.__setitem__(f, f.read()), daemon=True)
                       for f in (self.stdout, self.stderr) if f is not None]
      for t in self._readers:
        t.start()
    for t in self._readers:
      t.join(None if deadline is None else max(0, deadline - time.monotonic()))
      if t.is_alive():
        raise subprocess.TimeoutExpired(self.args, timeout)
    self.wait(None if deadline is None else max(0, deadline - time.monotonic()))
    for f in (self.stdout, self.stderr):
      if f is not None:
        f.close()
    return self._outputs.get(self.stdout), self._outputs.get(self.stderr)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.wait()


# pylint: disable-next=invalid-name
def Popen(args, *, cwd=None, env=None, stdin=None, stdout=None, stderr=None, text=False, **kwargs):
  """subprocess.Popen(args, ...) for a launch of an entry point (or a script under tests/): forked from a fork
  server when one serves it (module docstring), else a plain process (as for any other keyword argument)."""
  argv = _served_argv(args) if stdin is None and not kwargs else None
  server = _server(os.environ if env is None else env) if argv is not None else None
  if server is None:
    return subprocess.Popen(args, cwd=cwd, env=env, stdin=stdin, stdout=stdout, stderr=stderr, text=text, **kwargs)
  return Launched(server, [os.fspath(a) for a in args], argv, cwd, env, stdout, stderr, text)


def run(args, *, cwd=None, env=None, stdout=None, stderr=None, capture_output=False, text=False, timeout=None,
        check=False) -> subprocess.CompletedProcess:
  """subprocess.run for `Popen` above."""
  if capture_output:
    stdout = stderr = subprocess.PIPE
  proc = Popen(args, cwd=cwd, env=env, stdout=stdout, stderr=stderr, text=text)
  try:
    out, err = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    proc.kill()
    proc.wait()
    raise
  done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
  if check:
    done.check_returncode()
  return done


if __name__ == "__main__":
  server_main(sys.argv[1])
