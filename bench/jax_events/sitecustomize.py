"""Where a process's JAX time goes: every Python process started with this folder on PYTHONPATH and JAX_EVENTS_DIR set
appends one JSON line per event to $JAX_EVENTS_DIR/<pid>.jsonl (a forked child writes its own file):

  trace    a function traced to a jaxpr (`fn`: its name; `site`: the innermost repository frames that asked for it)
  lower    a jaxpr lowered to an MLIR module (`fn`, `site`)
  compile  a program XLA compiled (`fn`: the module's name; `cpu`: the process's CPU-seconds meanwhile)
  cache    a program read back from the persistent compilation cache instead

each with `wall` seconds, `pid`, `argv` (the process's first arguments), `pytest` (whether the process runs pytest:
a test worker, not a process a test launched) and `test` (pytest's current test; a launch inherits its test's).
Summarise with `python bench/jax_events_report.py $JAX_EVENTS_DIR`. For measurement only: the hook patches a private
jax function (`jax._src.compiler.backend_compile_and_load`) when jax is first imported, and walks the stack on every
trace and lowering.

  JAX_EVENTS_DIR=/tmp/events PYTHONPATH=bench/jax_events python -m pytest -q tests
"""

import importlib.abc
import importlib.util
import json
import os
import sys
import time

_DIR = os.environ.get("JAX_EVENTS_DIR")
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep
_EVENTS = {"jaxpr_trace_duration": "trace", "jaxpr_to_mlir_module_duration": "lower",
           "cache_retrieval_time_sec": "cache"}
_out = {"pid": None, "file": None}


def write(record: dict) -> None:
  pid = os.getpid()
  if _out["pid"] != pid:  # the first event of this process, or of a forked child
    _out["pid"], _out["file"] = pid, open(os.path.join(_DIR, f"{pid}.jsonl"), "a", buffering=1, encoding="utf-8")
  record.update(pid=pid, argv=" ".join(sys.argv[:3])[-160:], pytest="_pytest" in sys.modules,
                test=os.environ.get("PYTEST_CURRENT_TEST", ""))
  _out["file"].write(json.dumps(record) + "\n")


def sites(depth: int = 3) -> list:
  """The innermost `depth` frames of the stack in this repository's own files (not its virtual environment's),
  outermost first; walked from the caller outwards only until `depth` are found (no source lines read)."""
  own, frame = [], sys._getframe(1)  # pylint: disable=protected-access
  while frame is not None and len(own) < depth:
    name = frame.f_code.co_filename
    if name.startswith(_REPO) and os.sep + ".venv" + os.sep not in name and not name.endswith("sitecustomize.py"):
      own.append(f"{name[len(_REPO):]}:{frame.f_lineno}")
    frame = frame.f_back
  return own[::-1]


def _listener(event: str, duration: float, **kwargs) -> None:
  kind = _EVENTS.get(event.rsplit("/", 1)[-1])
  if kind:
    record = {"ev": kind, "wall": duration, "fn": kwargs.get("fun_name", "")}
    if kind != "cache":
      record["site"] = sites()
    write(record)


def _patch(compiler) -> None:
  compile_and_load = compiler.backend_compile_and_load

  def timed(backend, module, *args, **kwargs):
    wall, cpu = time.time(), time.process_time()
    try:
      return compile_and_load(backend, module, *args, **kwargs)
    finally:
      write({"ev": "compile", "wall": time.time() - wall, "cpu": time.process_time() - cpu,
             "fn": str(module.operation.attributes["sym_name"]).strip('"')})
  compiler.backend_compile_and_load = timed
  from jax._src import monitoring  # pylint: disable=g-import-not-at-top
  monitoring.register_event_duration_secs_listener(_listener)


class _PatchOnImport(importlib.abc.MetaPathFinder):
  """Patches jax._src.compiler as it is first imported (jax reads its own names from it at import)."""

  def find_spec(self, name, path, target=None):  # pylint: disable=unused-argument
    if name != "jax._src.compiler":
      return None
    sys.meta_path.remove(self)
    spec = importlib.util.find_spec(name)
    exec_module = spec.loader.exec_module

    def patched(module):
      exec_module(module)
      _patch(module)
    spec.loader.exec_module = patched
    return spec


if _DIR:
  os.makedirs(_DIR, exist_ok=True)
  sys.meta_path.insert(0, _PatchOnImport())
