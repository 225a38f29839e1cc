"""Compiled memory and FLOPs of a step, and `jit`: ``jax.jit`` with the XLA options under
which rematerialisation is honoured on the platform a step is compiled for."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax

__all__ = ["xla_compiler_options", "jit", "CompiledMemory", "compiled_memory",
           "device_bytes_and_flops", "platform_of", "step_flops", "lowered_flops",
           "platform_of_args"]


def xla_compiler_options(backend: str | None = None) -> dict[str, str]:
  """XLA options under which rematerialisation is honoured on ``backend``.

  XLA:CPU runs the ``cse_barrier_expander`` pass, which deletes the optimization barriers
  that ``jax.checkpoint`` places on recomputation inputs *before* common-subexpression
  elimination; CSE then merges the recomputation back into the forward pass, so a
  rematerialised step keeps every forward activation and compiles to *more* temp memory
  than the exact step (measured on ResNet-20: 80.1 vs 73.1 MiB). With that one pass off the
  barriers stay and the same step compiles to 26.1 MiB, with bit-identical results and no
  slow-down (jaxlib 0.10). XLA:CPU of jaxlib 0.11 keeps the barriers by itself; the option
  is harmless there. GPU and TPU keep the barriers already, so nothing is changed there
  (XLA:GPU refuses a step compiled with this option: "Unsupported instruction opcode:
  opt-barrier").
  """
  backend = backend or jax.default_backend()
  if backend == "cpu":
    return {"xla_disable_hlo_passes": "cse_barrier_expander"}
  return {}


def platform_of_args(*trees) -> str | None:
  """The platform (``"cpu"``, ``"gpu"``, ...) of the first leaf of ``trees`` placed on a
  device (an array, or a `jax.ShapeDtypeStruct` with a sharding, e.g. for a compile-only
  device of `jmem.measure.target`); None where no leaf says."""
  for leaf in jax.tree.leaves(trees):
    devices = getattr(getattr(leaf, "sharding", None), "device_set", None)
    if devices:
      return next(iter(devices)).platform
  return None


class _Jitted:
  """``jax.jit(f)`` with `xla_compiler_options` of the platform it is compiled for: the
  default backend's when called, the arguments' when lowered or traced (so a step lowered
  for a compile-only GPU from a CPU machine gets the GPU's options, not XLA:CPU's). Other
  attributes are the default backend's ``jax.jit`` object's."""

  def __init__(self, f, options, kwargs):
    self._f, self._options, self._kwargs = f, dict(options), kwargs
    self._jits: dict[str, Any] = {}
    functools.update_wrapper(self, f)

  def _jit(self, platform: str):
    if platform not in self._jits:
      options = {**xla_compiler_options(platform), **self._options}
      self._jits[platform] = jax.jit(self._f, compiler_options=options or None,
                                     **self._kwargs)
    return self._jits[platform]

  def _for(self, args, kwargs):
    return self._jit(platform_of_args(args, kwargs) or jax.default_backend())

  def __call__(self, *args, **kwargs):
    return self._jit(jax.default_backend())(*args, **kwargs)

  def lower(self, *args, **kwargs):
    return self._for(args, kwargs).lower(*args, **kwargs)

  def trace(self, *args, **kwargs):
    return self._for(args, kwargs).trace(*args, **kwargs)

  def eval_shape(self, *args, **kwargs):
    return self._for(args, kwargs).eval_shape(*args, **kwargs)

  def __getattr__(self, name):
    if name.startswith("__") or name in ("_f", "_options", "_kwargs", "_jits"):
      raise AttributeError(name)
    return getattr(self._jit(jax.default_backend()), name)


def jit(f: Callable[..., Any], **kwargs) -> Callable[..., Any]:
  """``jax.jit`` with `xla_compiler_options` for the platform the step is compiled for.

  Every training step in jmem is compiled through this, so the memory a technique saves in
  the measurement is the memory it saves when the step runs. Called, it compiles for the
  default backend; ``.lower(*args)`` / ``.trace(*args)`` for the platform of ``args``
  (their shardings: a step lowered for a `jmem.measure.target` GPU from a CPU machine gets
  no XLA:CPU option, which XLA:GPU would refuse: "Unsupported instruction opcode:
  opt-barrier"). ``compiler_options`` given here are added to them.
  """
  options = kwargs.pop("compiler_options", None) or {}
  return _Jitted(f, options, kwargs)


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
  """XLA buffer-assignment figures of one compiled function, in bytes.

  Attributes:
    temp_bytes: scratch buffers live during the computation (activations, workspace). The
      figure techniques are judged by; on CPU ``peak_bytes`` does not include it.
    argument_bytes: input buffers.
    output_bytes: output buffers.
    alias_bytes: output bytes aliased to (donated) inputs.
    generated_code_bytes: size of the generated code.
    peak_bytes: XLA's peak figure where the backend reports one (on CPU only arguments +
      outputs; on GPU the true peak).
  """

  temp_bytes: int
  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  generated_code_bytes: int
  peak_bytes: int

  @property
  def total_bytes(self) -> int:
    """Arguments + outputs − aliased + temporaries: an upper bound of device memory."""
    return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes


def _compile(f, args, kwargs):
  if not hasattr(f, "lower"):
    f = jit(f)
  return f.lower(*args, **kwargs).compile()


def compiled_memory(f: Callable[..., Any], *args, **kwargs) -> CompiledMemory:
  """Compiles ``f`` for ``args`` (arrays or ShapeDtypeStructs) and reads its memory figures.

  ``f`` may be a plain function (it is jitted with `jit`, so rematerialisation is honoured
  on CPU) or an already jitted one (its options, donation and shardings are kept).

  Returns:
    A `CompiledMemory` from ``compiled.memory_analysis()``.
  """
  return _memory_of(_compile(f, args, kwargs))


def device_bytes_and_flops(compiled, lowered=None) -> tuple[int, float]:
  """``(device bytes, FLOPs)`` of a compiled step: its `CompiledMemory.total_bytes`
  (arguments + outputs - donated + temp) and `step_flops` (``lowered``: the
  ``jax.stages.Lowered`` it was compiled from, whose FLOPs count off the CPU)."""
  return _memory_of(compiled).total_bytes, step_flops(compiled, lowered)


def platform_of(compiled) -> str:
  """The platform (``"cpu"``, ``"gpu"``, ...) a ``jax.stages.Compiled`` runs on."""
  return _devices_of(compiled)[0]


def _devices_of(compiled) -> tuple[str, int]:
  """``(platform, number of devices)`` a compiled step runs on (its first sharding's)."""
  shardings = (getattr(compiled, "input_shardings", None),
               getattr(compiled, "output_shardings", None))
  for sharding in jax.tree.leaves(shardings):
    devices = getattr(sharding, "device_set", ())
    for device in devices:
      return device.platform, len(devices)
  return jax.default_backend(), 1


_WARNED_FLOPS: set[str] = set()


def step_flops(compiled, lowered=None) -> float:
  """A step's FLOPs by XLA's cost analysis (0.0 where the backend gives none): the compiled
  module's on CPU; off the CPU, the lowered (unoptimised) module's, ``lowered`` being the
  ``jax.stages.Lowered`` that ``compiled`` came from.

  On a GPU, XLA compiles convolutions (and likely matrix products) into library calls
  (cuDNN, cuBLAS) that its cost analysis of the compiled module counts as nothing: jmem's
  ResNet-50 224² train step compiled on an H100 had 0.27 GFLOP per example
  (benchmarks/results/gpu/gpu_nvidia_h100_80gb_hbm3_run4.json, exact at batch 32 and 64), where
  XLA:CPU counts 23.9 (exact at batch 256: docs/decisions.md, "Planner"). The
  lowered module still holds them as convolution and dot ops. Its cost analysis is XLA's
  for the CPU client (``Lowered.cost_analysis`` has none under a PJRT plugin such as JAX's
  CUDA one); on CPU its count is within 2% of the compiled one's for jmem's steps, and the
  module lowered for CUDA counts what the one lowered for CPU does (tests/test_measure.py).
  This path has not yet run on a GPU.

  The lowered module is the whole program where XLA partitions it (GSPMD): on several
  devices its count is then divided by their number (replicated work, e.g. the optimiser
  update under data parallelism, is under-counted: ResNet-8 with its batch split 8 ways on
  CPU, 2.1% below the compiled per-device count). Under ``jax.shard_map`` (`jmem.Spatial`)
  the body is lowered at one shard's shapes and the count is taken as it is (ResNet-8 over a
  2 x 4 mesh on CPU: 12% above the compiled per-device count). Work that a Pallas kernel
  does on the GPU (a custom call there) is counted in neither. Off the CPU without a count
  of ``lowered``, the compiled one is returned with a warning (once per platform).
  """
  platform, devices = _devices_of(compiled)
  if platform == "cpu":
    return _flops_of(compiled) or 0.0
  flops = None if lowered is None else lowered_flops(lowered)
  if flops is not None:
    return flops if devices == 1 or _is_shard_mapped(lowered) else flops / devices
  if platform not in _WARNED_FLOPS:
    _WARNED_FLOPS.add(platform)
    why = ("no lowered module was given (lowered=)" if lowered is None else
           "the lowered module could not be counted")
    warnings.warn(
        f"FLOPs of a step compiled for {platform!r} from the compiled module's cost analysis, "
        f"which counts library calls (cuDNN convolutions, likely cuBLAS matrix products) as "
        f"nothing: {why}.", stacklevel=2)
  return _flops_of(compiled) or 0.0


def _flops_of(stage) -> float | None:
  """XLA's FLOPs of a ``jax.stages.Compiled`` or ``Lowered`` (None where it gives none)."""
  cost = stage.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) and cost else cost
  flops = (cost or {}).get("flops") if isinstance(cost, Mapping) or cost is None else None
  return None if flops is None else float(flops)


def lowered_flops(lowered) -> float | None:
  """FLOPs of a lowered step's unoptimised module by the CPU client's cost analysis (JAX's
  private ``hlo_module_cost_analysis``, the function ``Lowered.cost_analysis`` calls with the
  step's own client, which a PJRT plugin lacks); where that cannot be reached, the step's
  own ``Lowered.cost_analysis``; None where neither counts."""
  try:
    from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
    from jax._src.lib import _jax  # pylint: disable=g-import-not-at-top
    cost = _jax.hlo_module_cost_analysis(xla_bridge.get_backend("cpu"),
                                         lowered.compiler_ir("hlo").as_hlo_module())
    if cost.get("flops") is not None:
      return float(cost["flops"])
  except Exception:  # pylint: disable=broad-except
    pass
  try:
    return _flops_of(lowered)
  except Exception:  # pylint: disable=broad-except
    return None


def _is_shard_mapped(lowered) -> bool:
  """Whether a lowered step has ``jax.shard_map`` regions (bodies at one shard's shapes)."""
  try:
    text = lowered.as_text()
  except Exception:  # pylint: disable=broad-except
    return False
  return "manual_computation" in text or "SPMDFullToShardShape" in text


def _memory_of(compiled) -> CompiledMemory:
  stats = compiled.memory_analysis()
  if stats is None:
    raise RuntimeError(
        f"The {jax.default_backend()!r} backend returned no memory analysis for this "
        "function; jmem's memory figures need a backend that reports buffer assignment.")
  return CompiledMemory(
      temp_bytes=int(stats.temp_size_in_bytes),
      argument_bytes=int(stats.argument_size_in_bytes),
      output_bytes=int(stats.output_size_in_bytes),
      alias_bytes=int(stats.alias_size_in_bytes),
      generated_code_bytes=int(stats.generated_code_size_in_bytes),
      peak_bytes=int(getattr(stats, "peak_memory_in_bytes", 0) or 0),
  )

