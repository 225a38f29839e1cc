"""Memory targets: the device a step's memory figures are for, compiled for on this machine.

::

  h100 = jmem.measure.target("h100")         # no GPU needed: XLA:GPU's own buffer assignment
  h100.memory(step, state, x, y)              # a CompiledMemory for an H100
  fit = jmem.measure.fit_step(step, lambda b: (state, x_at(b), y_at(b)), target="h100")
  fit.per_example_temp_bytes, fit.max_batch   # what one more example costs; the largest batch

``target()`` (or ``"default"``) is JAX's default backend: on a CPU machine its figures are
XLA:CPU's, whose buffer assignment is not a GPU's (jmem's ResNet-50 224² step costs 126.8
MiB per example there against 88.4 on an H100). A GPU target (`TARGETS`: ``"h100"``; or a
path to a ``GpuTargetConfigProto`` text file) is compiled for without the device: JAX's
CUDA plugin, loaded for compiling only, takes XLA's description of the GPU (the spec files
of openxla/xla, ``xla/backends/gpu/target_config/specs/``, shipped in ``specs/`` with their
licence) and runs XLA:GPU's whole pipeline, buffer assignment included, on the CPU. Its
figures are the GPU's: on a real H100 (JAX 0.11.2) jmem's ResNet-50 step at batch 64 held
5,963,010,656 temp bytes; this target gives 5,962,633,824 on jaxlib 0.10.2 (0.006% less:
no autotuning runs here, so cuDNN's workspaces are not chosen the same way).

What a GPU target needs (``pip install 'jmem[gpu-target]'``): jaxlib `PINNED_JAXLIB`
(the compiler whose figures were checked against the device; another is refused unless
``JMEM_TARGET_ANY_JAXLIB=1``), ``jax-cuda12-plugin`` at exactly the installed jaxlib's
version and ``nvidia-cuda-nvcc-cu12`` (ptxas and libdevice, for the Pallas kernels' Triton
code); and JAX's platforms set to ``cpu`` before JAX starts
(``JAX_PLATFORMS=cpu``; the ``jmem`` command line does it for ``--target``), else the
plugin tries to open a GPU. Each missing piece is a `TargetError` saying what to do: a
GPU target never falls back to the host's figures.

Kernels are chosen as on the device: inside `Target.lowering` the automatic choice
(``implementation=None``) of jmem's ops is the one a GPU makes, and Pallas kernels are
lowered compiled (Triton), not interpreted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.metadata
import importlib.util
import os
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax

from jmem.measure._compiled import CompiledMemory, _memory_of, jit

__all__ = ["Target", "TargetError", "TargetFallbackWarning", "TARGETS", "target", "DEFAULT",
           "PINNED_JAXLIB"]

DEFAULT = "default"
_SPEC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "specs")


@dataclasses.dataclass(frozen=True)
class _Spec:
  file: str
  memory_limit: int
  limit_source: str


# name -> the GPU's spec file (in ``specs/``) and the bytes a step may hold on it.
_SPECS = {
    "h100": _Spec("h100_sxm.txtpb", 76_516_687_872,
                  "what JAX's allocator reported as bytes_limit on an H100 80GB HBM3 at "
                  "XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 (JAX 0.11.2, 2026-11-27)"),
}
TARGETS = (DEFAULT, *_SPECS)
# A spec file given by path: this fraction of its device_memory_size, the fraction the
# H100's limit was measured at (XLA_PYTHON_CLIENT_MEM_FRACTION=0.9, as benchmarks/gpu.py
# runs; JAX's own default is 0.75).
_PATH_MEMORY_FRACTION = 0.9
_PLUGINS = ("jax-cuda12-plugin", "jax-cuda13-plugin")
_EXTRA = "pip install 'jmem[gpu-target]'"
# The jaxlib whose deviceless XLA:GPU figures were checked against a real H100 (test_targets:
# 5,962,633,824 temp bytes against the device's 5,963,010,656), and the version the
# gpu-target extra pins jax, jaxlib and the plugin to. Another compiler assigns buffers its
# own way, so a GPU target refuses another jaxlib unless JMEM_TARGET_ANY_JAXLIB=1 says to
# take that compiler's figures.
PINNED_JAXLIB = "0.10.2"
_ANY_JAXLIB = "JMEM_TARGET_ANY_JAXLIB"


class TargetError(ValueError):
  """A target cannot be compiled for here; the message says why and what to do."""


class TargetFallbackWarning(UserWarning):
  """A deviceless compile needed an XLA option the device would not: its figures may differ
  slightly from the device's (the message says how)."""


# XLA:GPU's deviceless compile (no autotuning) of jaxlib 0.10.2 finds no Triton tiling for
# some large matrix products (the video ViT's at batch 128), where the device compiles.
_NO_TRITON_TILING = "Couldn't find output tile sizes"


@dataclasses.dataclass(frozen=True)
class Target:
  """A device whose compiled memory figures jmem reports (`target` builds one).

  Attributes:
    name: ``"default"``, a name of `TARGETS` (``"h100"``) or the spec file's path.
    platform: the XLA platform its figures are from (``"cpu"``, ``"gpu"``).
    device_kind: the device's name (``"NVIDIA H100 80GB HBM3"``).
    memory_limit: the bytes a step may hold on it (arguments + outputs not aliased to a
      donated argument + temp), the default budget of `fit_step`; None where not known
      (the default backend on a CPU).
    deviceless: compiled for without the device (a GPU target on this machine).
    spec_path: the ``GpuTargetConfigProto`` text file of a GPU target.
    limit_source: where ``memory_limit`` comes from.
  """

  name: str
  platform: str
  device_kind: str
  memory_limit: int | None
  deviceless: bool = False
  spec_path: str | None = None
  limit_source: str = ""

  @property
  def short(self) -> str:
    """A few words for a column header: ``"H100 target"``, ``"XLA:CPU"``."""
    if self.deviceless:
      return f"{self.name.upper() if self.name in _SPECS else self.device_kind} target"
    return f"XLA:{'GPU' if self.platform in ('gpu', 'cuda', 'rocm') else self.platform.upper()}"

  @property
  def label(self) -> str:
    """What a table of this target's figures says they are."""
    if self.deviceless:
      return (f"{self.short} ({self.device_kind}: XLA:GPU's buffer assignment, compiled "
              f"without the device, jaxlib {_jaxlib_version()})")
    return f"{self.short} ({self.device_kind}, this machine's default backend)"

  @property
  def device(self):
    """The device steps are compiled for (a compile-only one for a deviceless target)."""
    if self.deviceless:
      return _compile_only_devices(self.spec_path)[0]
    return jax.devices()[0]

  def place(self, tree):
    """``tree``'s arrays and `jax.ShapeDtypeStruct`s as ShapeDtypeStructs on `device`.

    A deviceless target is one device: a leaf sharded over several devices is refused."""
    device = self.device
    sharding = jax.sharding.SingleDeviceSharding(device)

    def put(leaf):
      if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
        return leaf
      own = getattr(leaf, "sharding", None)
      devices = getattr(own, "device_set", None) or ()
      if len(devices) > 1:
        raise TargetError(
            f"The {self.name} target compiles for one device, but an argument of shape "
            f"{tuple(leaf.shape)} is sharded over {len(devices)}: multi-device layouts "
            "are measured on the devices themselves (target 'default').")
      return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
    return jax.tree.map(put, tree)

  @contextlib.contextmanager
  def lowering(self) -> Iterator[None]:
    """The context a step is traced and lowered in for this target: on a GPU target from
    another machine, jmem's ops choose and lower their kernels as on the GPU."""
    if self.deviceless:
      from jmem import _backends  # pylint: disable=g-import-not-at-top
      with _backends.compiled_kernels():
        yield
    else:
      yield

  def lower(self, f: Callable[..., Any], *args, **kwargs):
    """``f`` (jitted with `jmem.measure.jit` unless it has ``.lower``) lowered for this
    target at ``args`` (arrays or ShapeDtypeStructs, placed on `device`)."""
    if not hasattr(f, "lower"):
      f = jit(f)
    with self.lowering():
      if self.deviceless:
        args, kwargs = self.place(args), self.place(kwargs)
      return f.lower(*args, **kwargs)

  def compile(self, f: Callable[..., Any], *args, **kwargs):
    """`lower`, compiled: a ``jax.stages.Compiled`` (on a deviceless target: for its
    memory and cost analysis only, it cannot run)."""
    return self.compile_lowered(self.lower(f, *args, **kwargs))

  def compile_lowered(self, lowered):
    """``lowered.compile()``; on a deviceless GPU target where XLA finds no Triton tiling
    for a matrix product of the step (jaxlib 0.10.2 does not autotune there, and fails on
    some large products the device compiles), again with Triton's matrix products off
    (cuBLAS's instead), with a `TargetFallbackWarning`: the buffer assignment can differ
    slightly from the device's (+0.24% temp bytes on the video ViT at batch 64, where
    both compile)."""
    try:
      return lowered.compile()
    except Exception as e:  # pylint: disable=broad-except  (jax.errors.JaxRuntimeError)
      if not self.deviceless or _NO_TRITON_TILING not in str(e):
        raise
      first = str(e).split(", metadata")[0][:200]
      warnings.warn(
          f"The {self.name} target's compile found no Triton tiling for a matrix product "
          f"({first}); compiled again with xla_gpu_enable_triton_gemm=False (cuBLAS for "
          "matrix products), whose buffer assignment can differ slightly from the device's.",
          TargetFallbackWarning, stacklevel=2)
      return lowered.compile(compiler_options={"xla_gpu_enable_triton_gemm": False})

  def memory(self, f: Callable[..., Any], *args, **kwargs) -> CompiledMemory:
    """XLA's memory figures of ``f`` compiled for this target."""
    return _memory_of(self.compile(f, *args, **kwargs))


def _jaxlib_version() -> str:
  import jaxlib  # pylint: disable=g-import-not-at-top
  return jaxlib.__version__


def _plugin_line(version: str, plugin: str = "jax-cuda12-plugin") -> str:
  # CUDA 13's compiler wheel carries no -cu13 suffix (jax-cuda13-plugin's own with-cuda extra).
  nvcc = "nvidia-cuda-nvcc" if "cuda13" in plugin else "nvidia-cuda-nvcc-cu12"
  return f"pip install {plugin}=={version} {nvcc}"


def _check_install() -> None:
  """Raises `TargetError` unless a CUDA plugin at jaxlib's version and ptxas are here."""
  jaxlib_version = _jaxlib_version()
  if jaxlib_version != PINNED_JAXLIB and os.environ.get(_ANY_JAXLIB) != "1":
    raise TargetError(
        f"A GPU target's figures are checked against a real H100 with jaxlib {PINNED_JAXLIB} "
        f"only, and this environment has jaxlib {jaxlib_version}, whose XLA may assign "
        f"buffers differently: {_EXTRA} (it pins jax, jaxlib and jax-cuda12-plugin to "
        f"{PINNED_JAXLIB}), or set {_ANY_JAXLIB}=1 to take jaxlib {jaxlib_version}'s figures "
        "as they are.")
  found = {}
  for name in _PLUGINS:
    try:
      found[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      pass
  if not found:
    raise TargetError(
        "A GPU target needs JAX's CUDA plugin (to compile for the GPU) and ptxas, neither "
        f"of which is installed here: {_EXTRA} (or {_plugin_line(jaxlib_version)}).")
  if jaxlib_version not in found.values():
    have = ", ".join(f"{n} {v}" for n, v in found.items())
    raise TargetError(
        f"JAX's CUDA plugin must be exactly the installed jaxlib's version, {jaxlib_version}; "
        f"this environment has {have}. Install the matching one: "
        f"{_plugin_line(jaxlib_version, next(iter(found)))} (or {_EXTRA}, which pins jax, "
        "jaxlib and the plugin together).")
  if shutil.which("ptxas") is None and not any(
      _has_module(m) for m in ("nvidia.cuda_nvcc", "nvidia.cu13")):
    nvcc = ("nvidia-cuda-nvcc" if found.get("jax-cuda13-plugin") == jaxlib_version
            else "nvidia-cuda-nvcc-cu12")
    raise TargetError(
        "A GPU target compiles the Pallas kernels' Triton code with ptxas, which is not "
        "installed here (XLA would say 'No PTX compilation provider is available'): "
        f"pip install {nvcc} (or {_EXTRA}).")


def _has_module(name: str) -> bool:
  try:
    return importlib.util.find_spec(name) is not None
  except ModuleNotFoundError:  # its parent package is missing
    return False


def _check_platforms() -> None:
  platforms = jax.config.jax_platforms
  names = [p.strip() for p in (platforms or "").split(",") if p.strip()]
  if names != ["cpu"]:
    raise TargetError(
        "A GPU target is compiled for with JAX's CUDA plugin loaded for compiling only, which "
        "needs JAX's platforms to be just 'cpu' before JAX starts (else the plugin tries to "
        f"open a GPU); in this process they are {platforms!r}. Set JAX_PLATFORMS=cpu in the "
        "environment (or jax.config.update('jax_platforms', 'cpu') before any JAX "
        "computation), in a fresh process; the jmem command line does this for --target.")


@functools.lru_cache(maxsize=None)
def _compile_only_devices(spec_path: str):
  try:
    with open(spec_path) as f:
      text = f.read()
  except OSError as e:
    raise TargetError(f"Cannot read the GPU spec file {spec_path!r}: {e.strerror}.") from None
  # XLA takes a spec without the device's description (an empty file, say) and then fails
  # in native code when compiling (a floating point exception, killing Python).
  missing = [f for f in ("gpu_device_info", "device_memory_size", "cuda_compute_capability",
                         "device_description_str") if not re.search(rf"^\s*{f}\b", text, re.M)]
  if missing:
    raise TargetError(
        f"The GPU spec file {spec_path!r} does not describe a GPU: it has no "
        f"{', '.join(missing)}. Use one of openxla/xla's "
        "xla/backends/gpu/target_config/specs/*.txtpb (a GpuTargetConfigProto in text "
        "format), or a target name: " + ", ".join(TARGETS) + ".")
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  try:
    topology = topologies.get_topology_desc(platform="cuda", topology="1x1x1",
                                            target_config=text)
  except Exception as e:  # pylint: disable=broad-except  (jax.errors.JaxRuntimeError)
    message = str(e).splitlines()[0] if str(e) else type(e).__name__
    raise TargetError(
        f"XLA could not use the GPU spec file {spec_path!r} ({message}). It must be a "
        "GpuTargetConfigProto in text format, as openxla/xla's "
        "xla/backends/gpu/target_config/specs/*.txtpb; a field newer than this jaxlib "
        f"({_jaxlib_version()}) is refused: XLA names it on stderr ('has no field named "
        "...'): delete that line.") from None
  devices = list(topology.devices)
  if not devices:
    raise TargetError(f"XLA made no device of the GPU spec file {spec_path!r}.")
  return devices


def _device_memory_size(spec_path: str) -> int | None:
  try:
    with open(spec_path) as f:
      for line in f:
        key, _, value = line.strip().partition(":")
        if key == "device_memory_size":
          return int(value.strip())
  except (OSError, ValueError):
    return None
  return None


@functools.lru_cache(maxsize=None)
def _target(name: str, memory_limit: int | None) -> Target:
  if name == DEFAULT:
    device = jax.devices()[0]
    limit = memory_limit
    source = "given" if memory_limit is not None else ""
    if limit is None:
      stats = device.memory_stats() or {}
      limit = stats.get("bytes_limit")
      source = "the device's bytes_limit" if limit is not None else ""
    return Target(DEFAULT, device.platform, str(device.device_kind),
                  None if limit is None else int(limit), False, None, source)
  if name in _SPECS:
    spec = _SPECS[name]
    path = os.path.join(_SPEC_DIR, spec.file)
    limit, source = spec.memory_limit, spec.limit_source
  else:
    path = os.path.abspath(name)
    size = _device_memory_size(path) if os.path.exists(path) else None
    limit = None if size is None else int(size * _PATH_MEMORY_FRACTION)
    source = (f"{_PATH_MEMORY_FRACTION} of the spec file's device_memory_size"
              if size is not None else "")
  if memory_limit is not None:
    limit, source = int(memory_limit), "given"
  device = _compile_only_devices(path)[0]
  return Target(name, device.platform, str(device.device_kind), limit, True, path, source)


def target(name: str | Target | None = None, *, memory_limit: int | None = None) -> Target:
  """The `Target` ``name``: ``None`` or ``"default"`` (JAX's default backend), a name of
  `TARGETS` (``"h100"``: an NVIDIA H100 80GB SXM, deviceless), or the path of a
  ``GpuTargetConfigProto`` text file (a GPU of openxla/xla's spec files; its memory limit
  is 0.9 of the file's ``device_memory_size`` unless ``memory_limit`` is given).

  Raises:
    TargetError: (a ValueError) an unknown name, a spec file that does not parse, a GPU
      target without its packages (``pip install 'jmem[gpu-target]'``), with a CUDA
      plugin of another version than jaxlib, with a jaxlib other than `PINNED_JAXLIB`
      (unless the environment sets ``JMEM_TARGET_ANY_JAXLIB=1``), or a process whose JAX platforms are not
      just ``cpu``.
  """
  if isinstance(name, Target):
    if memory_limit is not None:
      return dataclasses.replace(name, memory_limit=int(memory_limit), limit_source="given")
    return name
  name = DEFAULT if name is None else name
  if not isinstance(name, str) or not name:
    raise TargetError(f"A target is a name ({', '.join(TARGETS)}) or the path of a GPU spec "
                      f"file (.txtpb), got {name!r}.")
  if memory_limit is not None and (isinstance(memory_limit, bool) or
                                   not isinstance(memory_limit, int) or memory_limit < 1):
    raise TargetError(f"memory_limit must be a positive number of bytes, got {memory_limit!r}.")
  key = name.lower() if name.lower() in TARGETS else name
  if key not in TARGETS and not (key.endswith((".txtpb", ".pbtxt", ".txt")) or
                                 os.path.exists(key)):
    raise TargetError(f"Unknown target {name!r}: use one of {', '.join(TARGETS)}, or the path "
                      "of a GPU spec file (a GpuTargetConfigProto in text format, as "
                      "openxla/xla's xla/backends/gpu/target_config/specs/*.txtpb).")
  if key not in TARGETS and not os.path.exists(key):
    raise TargetError(f"No GPU spec file at {name!r}.")
  if key != DEFAULT:
    _check_install()
    _check_platforms()
  return _target(key, memory_limit)
