"""Test set-up: 8 fake CPU devices, set before jax is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # pylint: disable=g-import-not-at-top


def pytest_configure(config):
  config.addinivalue_line("markers", "slow: end-to-end tests (run in CI; skip locally with -m 'not slow')")
