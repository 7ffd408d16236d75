"""t5x_like: a TFRecord-centric GPT trainer on JAX."""

import importlib.abc
import importlib.machinery
import os
import sys

__version__ = "0.1.0"

# TensorFlow only feeds data here. Without these, importing it (every entry point does, through tf.data) writes
# C++ INFO lines to stderr ahead of a command's output and its one-line error: on AVX-512 CPUs TF 2.21 announces
# its oneDNN ops even under TF_CPP_MIN_LOG_LEVEL=3, and that notice goes only with TF_ENABLE_ONEDNN_OPTS=0, which
# changes nothing tf.data computes. Set here, before any module imports tensorflow; a value the user set is kept.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

# `python -m t5x_like.<entry point>`: jemalloc as the host allocator where it is installed, loaded by restarting the
# process before anything else is imported (parallel/host_allocator.py; T5X_LIKE_HOST_ALLOCATOR=glibc opts out);
# then the garbage collector's thresholds raised before the imports allocate (garbage_collector.py).
if "-m" in sys.orig_argv[:-1] and sys.orig_argv[sys.orig_argv.index("-m") + 1].startswith("t5x_like."):
  from t5x_like import jemalloc as _jemalloc  # pylint: disable=g-import-not-at-top
  _jemalloc.preload_jemalloc()
  from t5x_like import garbage_collector as _garbage_collector  # pylint: disable=g-import-not-at-top
  _garbage_collector.quiet_garbage_collector()


class _TensorFlowWithoutKeras(importlib.abc.MetaPathFinder):
  """The first `import tensorflow` after this package's runs TF's __init__ with Keras hidden. That __init__
  imports Keras (and scikit-learn through it, where installed) eagerly, but inside `try: ... except
  ImportError`; nothing here uses Keras, and it was about 2 s of every command's start-up. Keras is visible
  again once TF is imported: `import keras` and `tf.keras` (which TF loads lazily) still work afterwards."""

  def find_spec(self, name, path=None, target=None):
    if name != "tensorflow":
      return None
    sys.meta_path.remove(self)  # the first import only
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is None or spec.loader is None or "keras" in sys.modules:
      return spec
    run_init = spec.loader.exec_module

    def exec_module(module):
      sys.modules["keras"] = None  # `import keras` raises ImportError; importlib.util.find_spec('keras') is None
      try:
        run_init(module)
      finally:
        if "keras" in sys.modules and sys.modules["keras"] is None:
          del sys.modules["keras"]

    spec.loader.exec_module = exec_module
    return spec


if "tensorflow" not in sys.modules:
  sys.meta_path.insert(0, _TensorFlowWithoutKeras())
