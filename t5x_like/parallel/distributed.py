"""Multi-process start-up through JAX's own runtime (`jax.distributed`), before anything touches devices."""

import atexit
import faulthandler
import importlib.metadata
import os
import sys
import threading
import time
import traceback
from typing import Optional

from absl import flags
from absl import logging
import jax
from jax.experimental import multihost_utils

from t5x_like import errors

# XLA:CPU flags a run starts with unless XLA_FLAGS already names them (they must be set before the backend starts;
# other backends ignore xla_cpu_* flags). Library (YNN/XNNPACK) fusions for dots only: with its elementwise and
# reduction fusions on too, XLA:CPU materialises every operand it hands to the library, e.g. the loss's (B, L, V)
# float32 one-hot select and the transposed logits gradient; dots only takes 20-26% off a gpt_tiny training step
# (docs/performance.md, bench/torch_reference.py).
CPU_XLA_FLAGS = ("--xla_cpu_experimental_ynn_fusion_type=dot",)
# The jaxlib releases whose XLA is known to have CPU_XLA_FLAGS: XLA aborts at start-up on a flag it does not know, so
# under any other jaxlib a run starts without them (set_cpu_xla_flags does nothing) until they are checked against it.
CPU_XLA_FLAGS_JAXLIB = ("0.10.",)

# Environment variables that mean "a cluster launched us" and that jax.distributed can read by itself.
_AUTO_DETECT_ENV = ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS")


def define_flags() -> None:
  flags.DEFINE_string("coordinator_address", None, "host:port of process 0's coordinator (multi-process runs).")
  flags.DEFINE_integer("num_processes", None, "Number of processes in the run.")
  flags.DEFINE_integer("process_id", None, "This process's index, 0..num_processes-1.")
  flags.DEFINE_enum("multihost", "auto", ["auto", "on", "off"],
                    "auto: initialise jax.distributed when the flags above are set or a SLURM / Open MPI / "
                    "Cloud TPU environment is detected; on: always (cluster auto-detection); off: never.")
  flags.DEFINE_integer("initialization_timeout", 300, "Seconds to wait for every process to connect.")
  flags.DEFINE_integer("heartbeat_timeout", 100, "Seconds without a heartbeat after which a process is "
                       "declared dead and every other process exits with an error naming it.")
  flags.DEFINE_integer("shutdown_timeout", 60, "Seconds a finishing process waits for its peers.")


def wanted(mode: str, coordinator_address: Optional[str]) -> bool:
  if mode == "off":
    return False
  if mode == "on" or coordinator_address:
    return True
  if os.environ.get("TPU_WORKER_HOSTNAMES", "").count(",") >= 1:
    return True
  return any(name in os.environ for name in _AUTO_DETECT_ENV if name != "TPU_WORKER_HOSTNAMES") and int(
      os.environ.get("SLURM_NTASKS", os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))) > 1


def initialize(coordinator_address: Optional[str] = None, num_processes: Optional[int] = None,
               process_id: Optional[int] = None, *, mode: str = "auto", initialization_timeout: int = 300,
               heartbeat_timeout: int = 100, shutdown_timeout: int = 60) -> bool:
  """Joins the multi-process run (or does nothing for a single process). Returns whether it joined.

  With explicit flags every process passes the same coordinator address and process count and its own
  id. Without them, on SLURM, Open MPI and Cloud TPU pods, JAX reads the cluster's environment.
  """
  if not wanted(mode, coordinator_address):
    return False
  if coordinator_address and (num_processes is None or process_id is None):
    raise ValueError("--coordinator_address needs --num_processes and --process_id as well")
  if process_id is not None and num_processes is not None and not 0 <= process_id < num_processes:
    raise ValueError(f"--process_id={process_id} is outside 0..{num_processes - 1} (--num_processes={num_processes})")
  _HEARTBEAT_TIMEOUT[0], _SHUTDOWN_TIMEOUT[0] = heartbeat_timeout, shutdown_timeout
  # A dead peer is not fatal to the coordination service: without this, jaxlib's client aborts every survivor
  # the moment the service sees a task die (a C++ check failure and exit 134). With it, the survivor's next
  # collective fails as a Python error, and `explain` names the dead process(es) in the one-line exit.
  jax.config.update("jax_enable_recoverability", True)
  jax.distributed.initialize(coordinator_address, num_processes, process_id,
                             initialization_timeout=initialization_timeout,
                             heartbeat_timeout_seconds=heartbeat_timeout,
                             shutdown_timeout_seconds=shutdown_timeout)
  logging.info("process %d of %d; %d local / %d global devices", jax.process_index(), jax.process_count(),
               jax.local_device_count(), jax.device_count())
  _exit_hard_on_uncaught_exceptions()
  _watch_peers(heartbeat_timeout)
  errors.set_exit_reason(lambda e: f"process {jax.process_index()}: {explain(e)}")
  return True


def cpu_xla_flags() -> tuple:
  """CPU_XLA_FLAGS under a jaxlib release of CPU_XLA_FLAGS_JAXLIB, else () (read from the package metadata: nothing
  is imported and no backend starts)."""
  try:
    version = importlib.metadata.version("jaxlib")
  except importlib.metadata.PackageNotFoundError:
    return ()
  return CPU_XLA_FLAGS if version.startswith(CPU_XLA_FLAGS_JAXLIB) else ()


def set_cpu_xla_flags() -> None:
  """Appends cpu_xla_flags() to $XLA_FLAGS, except those it already sets; every entry point calls it (cli.run)
  before the backend starts, and so do the benches."""
  current = os.environ.get("XLA_FLAGS", "")
  extra = [flag for flag in cpu_xla_flags() if flag.split("=")[0] not in current]
  if extra:
    os.environ["XLA_FLAGS"] = " ".join([current] + extra).strip()


def initialize_from_flags() -> bool:
  f = flags.FLAGS
  return initialize(f.coordinator_address, f.num_processes, f.process_id, mode=f.multihost,
                    initialization_timeout=f.initialization_timeout, heartbeat_timeout=f.heartbeat_timeout,
                    shutdown_timeout=f.shutdown_timeout)


def _exit_hard_on_uncaught_exceptions() -> None:
  """A process that dies on an exception must leave at once: a graceful shutdown would wait for peers
  that are blocked in a collective with it, and hang for shutdown_timeout."""
  faulthandler.enable()

  def hook(exc_type, exc, tb):
    traceback.print_exception(exc_type, exc, tb)
    print(f"error: process {jax.process_index()}: {explain(exc, with_type=True)}", file=sys.stderr, flush=True)
    os._exit(1)

  sys.excepthook = hook
  threading.excepthook = lambda args: hook(args.exc_type, args.exc_value, args.exc_traceback)


_HEARTBEAT_TIMEOUT = [100]


def explain(exc: BaseException, with_type: bool = False) -> str:
  """The one-line reason for an error that ends a process; in a multi-process run, an error that may be a peer's
  death (may_be_a_dead_peer) waits up to the heartbeat timeout for the coordination service and names the
  processes it no longer sees: "process(es) [1] stopped responding (<the error>)"."""
  reason = errors.first_line(exc, with_type=with_type)
  if jax.distributed.is_initialized() and may_be_a_dead_peer(type(exc), exc.__traceback__):
    missing = missing_processes(_HEARTBEAT_TIMEOUT[0])
    if missing:
      return f"process(es) {missing} stopped responding ({reason})"
  return reason


_FINISHING = threading.Event()  # set once this process leaves on purpose: the peer watcher stops
_SHUTDOWN_TIMEOUT = [60]


def _watch_peers(heartbeat_timeout: int) -> None:
  """A daemon thread asks the coordination service which processes are alive (`live_processes`, a barrier every
  live process's watcher joins) and, when one is gone, ends this process with one line naming it and exit 1: the
  survivor's own collectives would otherwise wait on the dead peer forever. It stops when this process finishes
  (`finish`, or atexit, which runs before jax.distributed's shutdown)."""
  atexit.register(_FINISHING.set)
  interval = max(1.0, heartbeat_timeout / 10)

  def watch():
    while not _FINISHING.wait(interval):
      missing = missing_processes(0)
      if missing and not _FINISHING.is_set():
        print(f"error: process {jax.process_index()}: process(es) {missing} stopped responding (found by the "
              "coordination service's liveness check)", file=sys.stderr, flush=True)
        exit_now(1)

  threading.Thread(target=watch, name="t5x_like-peer-watch", daemon=True).start()


def finish() -> None:
  """A multi-process run's normal end, called by every process once its work is done: all processes meet at a
  barrier (a peer still saving or logging is not taken for dead), the peer watchers stop, and process 0, which hosts
  the coordination service, waits for the others to disconnect before it shuts the service down. Recoverable tasks
  (see `initialize`) skip jax.distributed's own shutdown barrier, so without this a process that ends first looks
  dead to a slower peer's watcher, and process 0 ending first takes the service from under a peer's shutdown (a
  jaxlib abort). A no-op in a single-process run."""
  if not jax.distributed.is_initialized():
    return
  multihost_utils.sync_global_devices("t5x_like.finished")
  _FINISHING.set()
  if jax.process_index() != 0:
    return
  deadline = time.time() + _SHUTDOWN_TIMEOUT[0]
  while time.time() < deadline:  # the live-process query returns once every live process asked, or disconnected
    live = []

    def ask():
      try:
        live.append(live_processes())
      except Exception:  # pylint: disable=broad-except  # (a thread's exception would end the process)
        live.append(None)

    query = threading.Thread(target=ask, daemon=True)
    query.start()
    query.join(max(0.0, deadline - time.time()))
    if live and live[0] == {0}:
      return
    time.sleep(0.2)


def may_be_a_dead_peer(exc_type, tb) -> bool:
  """Whether an uncaught exception can be the symptom of a peer process dying: a failed collective
  (JaxRuntimeError), or an error raised inside orbax while processes save or restore a checkpoint together
  (a peer killed mid-save leaves its part of the metadata missing, and orbax says so with a ValueError).
  Only those wait for the coordination service's verdict; a bad config fails at once."""
  if "JaxRuntimeError" in exc_type.__name__:
    return True
  return any(f"{os.sep}orbax{os.sep}" in frame.filename for frame in traceback.extract_tb(tb))


def live_processes() -> set:
  """Process ids the coordination service sees alive (`multihost_utils.live_devices`, jax >= 0.7)."""
  alive, failed = set(), set()
  try:
    with multihost_utils.live_devices(jax.devices()) as devices:
      alive = {d.process_index for d in devices}
  except multihost_utils.ProcessFailureError as e:  # died since the previous query
    failed = {d.process_index for d in e.failed_devices}
  return alive - failed


def missing_processes(wait_seconds: float) -> list:
  """Process ids the coordination service no longer sees alive, waiting up to `wait_seconds` for it to
  notice (a collective usually fails on a closed connection before the heartbeat times out)."""
  if not jax.distributed.is_initialized() or not hasattr(multihost_utils, "live_devices"):
    return []
  everyone = list(range(jax.process_count()))
  deadline = time.time() + wait_seconds
  while True:
    try:
      live = live_processes()
    except Exception:  # pylint: disable=broad-except  # the coordinator itself may be gone
      return [0] if jax.process_index() != 0 else []
    missing = [p for p in everyone if p not in live]
    if missing or time.time() > deadline:
      return missing
    time.sleep(1.0)


def exit_now(code: int) -> None:
  """Ends a multi-process run's process without waiting on peers (after its error was reported)."""
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)
