"""Test set-up: 8 simulated CPU devices, LLVM code generation at -O0, one compilation cache
for the run. Runs before jax is imported."""

import os
import shutil
import tempfile

# LLVM code generation at -O0: the suite compiles far more than it runs (most tests are
# compile-only measurements or a few steps), and this level is the LLVM back end's alone:
# XLA's HLO passes, buffer assignment (the bytes the tests assert) and cost analysis (the
# FLOPs) are the same at every level. It took the suite from 766 s to 569 s on 2 cores.
# A level set by the caller is kept.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_backend_optimization_level" not in _flags:
  _flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One XLA compilation cache for the run: many tests compile the same train steps (the exact
# ResNet-20 step, the planner's walks), and most of the suite's time is compiling. The
# pytest-xdist workers inherit this process's environment, so they share the directory; it
# holds only what this run compiled (a fresh directory, removed at the end), never a
# previous run's programs. A cache directory set by the caller is used as it is.
_CACHE_DIR = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _CACHE_DIR = tempfile.mkdtemp(prefix="jmem-tests-xla-cache-")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE_DIR

import jax  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position


def pytest_report_header(config):
  del config
  return f"jax {jax.__version__}, {jax.device_count()} {jax.default_backend()} devices"


def pytest_unconfigure(config):
  if _CACHE_DIR is not None and not hasattr(config, "workerinput"):
    shutil.rmtree(_CACHE_DIR, ignore_errors=True)
