"""The suite's own measuring tools: bench/jax_events (where a run's JAX time goes)."""

import importlib.util
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import jax_events_report  # pylint: disable=g-import-not-at-top,wrong-import-position

# a jitted program compiled, then read back from the persistent cache once the in-memory caches are cleared, and a
# decoder's abstract init traced in t5x_like/model/decoder.py
PROGRAM = """
import jax, jax.numpy as jnp
from t5x_like.model import decoder
double = jax.jit(lambda x: 2 * x)
double(jnp.ones(3)).block_until_ready()
jax.clear_caches()
double(jnp.ones(3)).block_until_ready()
decoder.count_params(decoder.GPTConfig(num_layers=1, num_heads=1, d_model=8, d_ff=8, max_len=4, vocab_size=16))
"""


@pytest.mark.slow  # starts a Python process
def test_jax_events_logs_traces_lowerings_compiles_and_cache_reads_with_their_sites(tmp_path, monkeypatch, capsys):
  events = tmp_path / "events"
  env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
  env.update(JAX_EVENTS_DIR=str(events), PYTHONPATH=os.path.join(ROOT, "bench", "jax_events"), JAX_PLATFORMS="cpu",
             JAX_COMPILATION_CACHE_DIR=str(tmp_path / "cache"), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  subprocess.run([sys.executable, "-c", PROGRAM], cwd=ROOT, env=env, check=True, capture_output=True)
  records = jax_events_report.read(str(events))
  totals = jax_events_report.totals(records)
  assert {kind for where, kind in totals if where == "launched"} == {"trace", "lower", "compile", "cache"}
  assert not any(where == "workers" for where, _ in totals)  # the process imported no pytest
  compiled = [r["fn"] for r in records if r["ev"] == "compile"]
  assert compiled.count("jit__lambda") == 1 and all(r["cpu"] >= 0 and r["wall"] > 0 for r in records
                                                    if r["ev"] == "compile")
  assert any(r["ev"] == "cache" for r in records)  # the second call of `double`
  init = [r for r in records if r["ev"] == "trace" and r["site"] and r["site"][-1].startswith("t5x_like/model/")]
  assert len(init) == 1 and init[0]["fn"] == "<lambda>", [r["site"] for r in records if r["ev"] == "trace"]

  monkeypatch.setattr(sys, "argv", ["jax_events_report.py", str(events), "--top", "50"])  # every one
  jax_events_report.main()
  out = capsys.readouterr().out
  assert "launched compile" in " ".join(out.split()) and "jit__lambda" in out and "t5x_like/model/" in out
  monkeypatch.setattr(sys, "argv", ["jax_events_report.py", str(tmp_path / "none")])
  with pytest.raises(SystemExit, match=re.escape(f"no events in {tmp_path / 'none'}")):
    jax_events_report.main()


def test_a_sites_list_ends_with_the_innermost_repository_frame():
  spec = importlib.util.spec_from_file_location("jax_events_hook", os.path.join(ROOT, "bench", "jax_events",
                                                                               "sitecustomize.py"))
  hook = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(hook)  # (without JAX_EVENTS_DIR it patches nothing)
  def outer(): return middle()  # pylint: disable=multiple-statements
  def middle(): return inner()  # pylint: disable=multiple-statements
  def inner(): return hook.sites(2)  # pylint: disable=multiple-statements
  here = os.path.relpath(__file__, ROOT)
  assert outer() == [f"{here}:{middle.__code__.co_firstlineno}", f"{here}:{inner.__code__.co_firstlineno}"]
