"""Test set-up: 8 simulated CPU devices. Runs before jax is imported."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position


def pytest_report_header(config):
  del config
  return f"jax {jax.__version__}, {jax.device_count()} {jax.default_backend()} devices"
