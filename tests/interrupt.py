"""A signal to a running launch at a point of its run that the test checked on a frozen launch.

A test that polls a launch's MODEL_DIR and then signals it lands the signal some time after its check held: on a
loaded machine the launch may log more steps, or commit a checkpoint it was saving in the background, in between.
`signal_when` checks twice: when the check holds it stops the launch and its children (SIGSTOP: none of their
threads runs, nothing more is logged or committed), checks again on what they left, and signals only if it still
holds; otherwise it lets them go on and polls again. What the test then finds in MODEL_DIR is what the check saw.
`logged`, `by_step` and `losses` read what a launch logged, while it runs too.
"""

import json
import os
import signal
import time


def _stat(path: str) -> list:
  """The fields of a /proc stat file after the command's name (state first, then the parent's pid); [] once gone."""
  try:
    with open(path) as f:
      return f.read().rsplit(")", 1)[1].split()
  except (OSError, IndexError):
    return []


def _descendants(pid: int) -> list:
  parents = {}
  for entry in os.listdir("/proc"):
    if entry.isdigit() and (fields := _stat(f"/proc/{entry}/stat")):
      parents.setdefault(int(fields[1]), []).append(int(entry))
  out, todo = [], [pid]
  while todo:
    children = parents.get(todo.pop(), [])
    out += children
    todo += children
  return out


def _ended(pid: int) -> bool:
  """Whether `pid` has exited (a zombie not yet reaped, or gone)."""
  return (_stat(f"/proc/{pid}/stat") or ["X"])[0] in "ZX"


def _running_threads(pid: int) -> int:
  """How many of `pid`'s threads are neither stopped nor ended."""
  try:
    tids = os.listdir(f"/proc/{pid}/task")
  except OSError:
    return 0
  return sum((_stat(f"/proc/{pid}/task/{tid}/stat") or ["X"])[0] not in "TtZX" for tid in tids)


def _freeze(pid: int, frozen: list) -> None:
  """Stops `pid` and then its descendants, adding each to `frozen`; returns once no thread of theirs runs."""
  for target in [pid] + _descendants(pid):
    try:
      os.kill(target, signal.SIGSTOP)
      frozen.append(target)
    except ProcessLookupError:
      pass
  deadline = time.time() + 30
  while any(_running_threads(p) for p in frozen):
    assert time.time() < deadline, f"processes {frozen} did not stop in 30 s"
    time.sleep(0.001)


def _thaw(frozen) -> None:
  for target in frozen:
    try:
      os.kill(target, signal.SIGCONT)
    except ProcessLookupError:
      pass


def _tail(log) -> str:
  try:
    with open(log, errors="replace") as f:
      return "\n" + f.read()[-2000:]
  except (OSError, TypeError):
    return ""


def signal_when(proc, ready, sig, *, what: str, log=None, timeout: float = 240, poll: float = 0.02) -> None:
  """Sends `sig` to the launch `proc` (a Popen) once `ready()` holds of a frozen launch (see the module docstring).

  SIGKILL ends the launch stopped (its children die with it where they ask to, as a sweep's runs do); any other
  signal is handled once the launch goes on. Fails, naming `what` and showing the end of the launch's `log` file,
  if the launch ends first or `timeout` passes. `ready` runs every `poll` seconds while the launch trains beside
  it: cheap tests first (orbax's listing of committed steps costs ≈ 3.5 ms)."""
  deadline = time.time() + timeout
  while True:
    assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before {what}" + _tail(log)
    assert time.time() < deadline, f"no {what} in {timeout:.0f} s" + _tail(log)
    if ready():
      frozen = []
      try:  # whatever happens, nothing stays stopped
        _freeze(proc.pid, frozen)
        if proc.pid in frozen and not _ended(proc.pid) and ready():  # an ended launch: poll() reports it
          os.kill(proc.pid, sig)
          if sig == signal.SIGKILL:
            proc.wait(timeout=60)  # its children, thawed below, go on only if they do not die with it
          return
      finally:
        _thaw(frozen)
    time.sleep(poll)


def logged(model_dir) -> list:
  """The records a launch has written to MODEL_DIR/metrics.jsonl so far: the lines it finished ([] before any)."""
  try:
    with open(os.path.join(model_dir, "metrics.jsonl")) as f:
      return [json.loads(line) for line in f if line.endswith("\n")]
  except FileNotFoundError:
    return []


def by_step(model_dir) -> dict:
  """{step: [its training record, once per launch that logged it]}: a step redone after a kill appears twice."""
  out = {}
  for r in logged(model_dir):
    if "loss" in r:
      out.setdefault(r["step"], []).append(r)
  return out


def losses(model_dir) -> dict:
  """{step: [loss, once per launch that logged it]}."""
  return {step: [r["loss"] for r in records] for step, records in by_step(model_dir).items()}


def signal_at_step(launch, model_dir, at_step: int, sig) -> int:
  """Starts `launch()` (a Popen) and sends it `sig` once it has logged a training step >= at_step (past the records
  of earlier launches), checked on the frozen launch; returns its exit code. Its log: MODEL_DIR + ".log"."""
  seen = len(logged(model_dir))
  proc = launch()
  steps = lambda: [r["step"] for r in logged(model_dir)[seen:] if "loss" in r]
  signal_when(proc, lambda: max(steps(), default=0) >= at_step, sig, what=f"step {at_step}", log=f"{model_dir}.log")
  return proc.wait(timeout=240)
