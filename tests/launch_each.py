"""`python tests/launch_each.py MODULE RUNS_JSON`: runs `python -m MODULE ARGV` for each ARGV of the JSON list in
this one process, each through the module's own `__main__` block (runpy), as a new launch would: the flags the run
defined (t5x_like's; absl's own are defined once, before the runs) are deleted and gin's configuration cleared
after it. One import of the package serves every run: a test that needs several launches of one entry point, none
of them killed or signalled, pays one start-up.

Every run but the last ends with a line "=== exit CODE" on both stdout and stderr; the last ends the process as a
launch would (its exit status, its one-line error), so `conftest.launch_each` can split the output per run.
"""

import json
import runpy
import sys

from absl import app  # pylint: disable=unused-import  (defines its flags once, before the runs)
from absl import flags
from absl import logging  # pylint: disable=unused-import  (the same)
import gin


def main():
  module, runs = sys.argv[1], json.loads(sys.argv[2])
  for i, argv in enumerate(runs):
    sys.argv = [module, *argv]
    if i == len(runs) - 1:
      runpy.run_module(module, run_name="__main__", alter_sys=True)
      return
    defined = set(flags.FLAGS)
    try:
      runpy.run_module(module, run_name="__main__", alter_sys=True)
      code = 0
    except SystemExit as e:
      code = 0 if e.code is None else e.code
    for name in set(flags.FLAGS) - defined:  # the run's own (absl's, imported once, stay)
      if flags.FLAGS.find_module_defining_flag(name).split(".")[0] in ("__main__", "t5x_like"):
        delattr(flags.FLAGS, name)
    flags.FLAGS.unparse_flags()
    gin.clear_config()
    for stream in (sys.stdout, sys.stderr):
      print(f"=== exit {code}", file=stream, flush=True)


if __name__ == "__main__":
  main()
