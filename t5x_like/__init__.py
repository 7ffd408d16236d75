"""t5x_like: a TFRecord-centric GPT trainer on JAX."""

import os

__version__ = "0.1.0"

# TensorFlow only feeds data here. Without these, importing it (every entry point does, through tf.data) writes
# C++ INFO lines to stderr ahead of a command's output and its one-line error: on AVX-512 CPUs TF 2.21 announces
# its oneDNN ops even under TF_CPP_MIN_LOG_LEVEL=3, and that notice goes only with TF_ENABLE_ONEDNN_OPTS=0, which
# changes nothing tf.data computes. Set here, before any module imports tensorflow; a value the user set is kept.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
