"""Test set-up: 8 simulated CPU devices, LLVM code generation at -O0 (but for tests marked
`runs`) with XLA:CPU's earlier fusion emitters, one compilation cache for the run, slow tests
handed out first and one at a time. Runs before jax is imported."""

import os
import shutil
import tempfile

# LLVM code generation at -O0: the suite compiles far more than it runs (most tests are
# compile-only measurements or a few steps), and this level is the LLVM back end's alone:
# XLA's HLO passes, buffer assignment (the bytes the tests assert) and cost analysis (the
# FLOPs) are the same at every level. It took the suite from 766 s to 569 s on 2 cores.
# It is set through JAX's switch (`jax_disable_most_optimizations`: this level, and LLVM's
# expensive passes off), not XLA_FLAGS, so that a test marked `runs`, which spends more
# time running its steps than compiling them, compiles at the default level (the fixture
# below). A level the caller set, in XLA_FLAGS or JAX_DISABLE_MOST_OPTIMIZATIONS, is kept.
_flags = os.environ.get("XLA_FLAGS", "")
if ("xla_backend_optimization_level" not in _flags and
    "JAX_DISABLE_MOST_OPTIMIZATIONS" not in os.environ):
  os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
  os.environ["JMEM_TESTS_UNOPTIMIZED"] = "1"      # set here, so the workers may lift it
_UNOPTIMIZED = os.environ.get("JMEM_TESTS_UNOPTIMIZED") == "1"
# XLA:CPU's earlier (non-MLIR) fusion emitters: they compile the suite's steps in about half
# the time (ResNet-8 0.7 s against 2.3 s, U-Net 1.7 s against 5.2 s) and cut the suite from
# 27 to 22 minutes on 2 cores. Unlike the level above this is not the back end alone: a few
# fusions differ, so the XLA:CPU bytes the tests compare differ slightly from a user's
# default (ResNet-8's step: 2,390,752 bytes against 2,390,672; the U-Net's 0.7% more). The
# tests compare XLA:CPU compiles with each other, never with a committed XLA:CPU figure, and
# the GPU target (test_targets) is XLA:GPU's, which this flag does not touch. A setting
# given by the caller is kept.
if "xla_cpu_use_fusion_emitters" not in _flags:
  _flags += " --xla_cpu_use_fusion_emitters=false"
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
import pytest  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position


@pytest.fixture(autouse=True)
def _optimized_where_the_test_runs(request, monkeypatch):
  """A test marked `runs` compiles at XLA's default level, in its own process and in the
  processes it starts: its steps' execution outweighs their compiles (the ResNet that
  learns the digits took 33.6 s at -O0, 10.5 s at the default level)."""
  if not _UNOPTIMIZED or request.node.get_closest_marker("runs") is None:
    yield
    return
  monkeypatch.delenv("JAX_DISABLE_MOST_OPTIMIZATIONS")
  jax.config.update("jax_disable_most_optimizations", False)
  try:
    yield
  finally:
    jax.config.update("jax_disable_most_optimizations", True)


def pytest_report_header(config):
  del config
  return f"jax {jax.__version__}, {jax.device_count()} {jax.default_backend()} devices"


def pytest_unconfigure(config):
  if _CACHE_DIR is not None and not hasattr(config, "workerinput"):
    shutil.rmtree(_CACHE_DIR, ignore_errors=True)


def pytest_configure(config):
  """pytest-xdist hands out tests one at a time (``--maxschedchunk 1``) unless told
  otherwise. Its default sends each worker a quarter of the suite up front and refills in
  large chunks, so one worker held half of the slow tests while the other ran out: on 2
  cores the workers finished 360 s apart (994 s of tests against 1354 s)."""
  if getattr(config.option, "maxschedchunk", 0) is None:
    config.option.maxschedchunk = 1


def pytest_collection_modifyitems(config, items):
  """The slow tests first (stable order otherwise): pytest-xdist hands tests out in this
  order, and a long test started last keeps one worker busy after the other has finished
  (the longest, test_multiprocess's, runs 100 s)."""
  del config
  items.sort(key=lambda item: item.get_closest_marker("slow") is None)
