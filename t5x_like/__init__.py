"""t5x_like: a TFRecord-centric GPT trainer on JAX."""

__version__ = "0.1.0"
