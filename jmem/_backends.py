"""The kernel backends of jmem's ops: one registry, one validation, one automatic choice.

Each op that has a kernel maps implementation names to functions. ``"xla"`` is the plain
JAX reference, registered by the op's own module; ``"pallas"`` is its Pallas kernel
(Triton today, `pallas_kernels`), registered beside it with a lazy import. The ops:

* `QUANTIZE_PACK`, `UNPACK_DEQUANTIZE`: ActNN's grouped statistics + dither + quantize +
  pack, and its inverse (`jmem.ops.actnn.quantize`);
* `INPLACE_ABN`: InPlace-ABN's training-mode forward and its custom VJP
  (`jmem.ops.inplace_abn`);
* `BN_MOMENTS`: one device's exact per-channel BatchNorm moments (`jmem._bn_core`).

Callers never name a backend: they validate ``implementation=`` with `check_implementation`,
pick one with `choose` and call `get(op, name)`. Another backend (a Mosaic GPU one,
``"pallas_mosaic"``) is a `register` call for each op it implements; every layer above
(modules, `jmem.convert` techniques, the bench's ``name:implementation`` suffixes) then
takes its name.

Private and low: imports nothing of jmem, so that every op module can register here; it
also says whether the kernels target a GPU (`targets_gpu`, `compiled_kernels`), which the
kernels in `pallas_kernels` read from here.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Sequence

import jax

from jmem import _warn

__all__ = ["QUANTIZE_PACK", "UNPACK_DEQUANTIZE", "INPLACE_ABN", "BN_MOMENTS", "XLA",
           "Backend", "register", "ops", "implementations", "check_implementation", "get",
           "choose"]

QUANTIZE_PACK = "actnn.quantize_pack"
UNPACK_DEQUANTIZE = "actnn.unpack_dequantize"
INPLACE_ABN = "inplace_abn.train"
BN_MOMENTS = "bn.moments"

XLA = "xla"   # every op's reference, and the automatic choice off the GPU


@dataclasses.dataclass(frozen=True)
class Backend:
  """One implementation of one op.

  Attributes:
    fn: the implementation (its signature is the op's, see the op's module).
    unsupported: ``unsupported(**config) -> str | None``, why this backend cannot take a
      call's configuration (None: it can); e.g. Triton's power-of-two blocks.
    gpu_default: the automatic choice (``implementation=None``) on a GPU.
  """

  fn: Callable
  unsupported: Callable[..., str | None] | None = None
  gpu_default: bool = False


_REGISTRY: dict[str, dict[str, Backend]] = {}


def register(op: str, implementation: str, fn: Callable, *,
             unsupported: Callable[..., str | None] | None = None,
             gpu_default: bool = False) -> None:
  """Registers ``fn`` as ``op``'s ``implementation`` (replacing one of that name).

  ``gpu_default=True`` makes it what ``implementation=None`` picks on a GPU (at most one
  per op: the previous default stops being one).
  """
  if not isinstance(implementation, str) or not implementation or ":" in implementation:
    raise ValueError(f"An implementation name is a non-empty string without ':' (the "
                     f"bench's name:implementation separator), got {implementation!r}.")
  backends = _REGISTRY.setdefault(op, {})
  if gpu_default:
    for name, b in backends.items():
      if b.gpu_default:
        backends[name] = dataclasses.replace(b, gpu_default=False)
  backends[implementation] = Backend(fn, unsupported, gpu_default)


def ops() -> tuple[str, ...]:
  """Every op with a registered implementation."""
  return tuple(_REGISTRY)


def implementations(*op_names: str) -> tuple[str, ...]:
  """The names registered for every one of ``op_names`` (``"xla"`` first)."""
  if not op_names:
    raise ValueError("implementations() needs at least one op name.")
  for op in op_names:
    if op not in _REGISTRY:
      raise KeyError(f"No op {op!r} is registered; registered ops: {', '.join(_REGISTRY)}.")
  names = [n for n in _REGISTRY[op_names[0]] if all(n in _REGISTRY[o] for o in op_names)]
  return tuple(sorted(names, key=lambda n: n != XLA))


def check_implementation(implementation, op_names: Sequence[str], what: str) -> None:
  """Raises ValueError unless ``implementation`` is None or registered for every op."""
  names = implementations(*op_names)
  if implementation is not None and (not isinstance(implementation, str)
                                     or implementation not in names):
    raise ValueError(f"{what}: implementation must be one of {names} or None (the "
                     f"automatic choice), got {implementation!r}.")


def get(op: str, implementation: str) -> Callable:
  """``op``'s function of name ``implementation`` (validated: a clear error otherwise)."""
  check_implementation(implementation, (op,), op)
  if implementation is None:
    raise ValueError(f"get({op!r}, None): resolve None with choose() first.")
  return _REGISTRY[op][implementation].fn


def _gpu_default(op_names) -> str:
  names = [n for n in implementations(*op_names)
           if all(_REGISTRY[o][n].gpu_default for o in op_names)]
  return names[0] if names else XLA


def _reason(implementation, op_names, config) -> str | None:
  for op in op_names:
    unsupported = _REGISTRY[op][implementation].unsupported
    reason = unsupported(**config) if unsupported is not None else None
    if reason:
      return reason
  return None


def choose(implementation, op_names: Sequence[str], what: str, **config) -> str:
  """The implementation that runs a call of ``op_names`` with ``config``.

  ``implementation`` is validated (`check_implementation`). ``None`` is the automatic
  choice: XLA unless the default backend is a GPU (or inside
  `pallas_kernels.compiled_kernels`, lowering for one); there, the ops' GPU default (XLA
  where none is registered: ActNN's, whose kernels make a step slower) when it takes
  ``config`` and no `automatic_xla` context says otherwise, else XLA with a warning saying
  why (a slower path is never taken silently). A named backend that cannot take ``config``
  raises ValueError.
  """
  check_implementation(implementation, op_names, what)
  if implementation is None:
    if not targets_gpu():
      return XLA
    name = _gpu_default(op_names)
    if name == XLA:               # nothing to fall back from: no warning
      return XLA
    if _AUTOMATIC_XLA.get() is not None:
      _warn.warn(f"{what}: {_AUTOMATIC_XLA.get()}; using the XLA path (name "
                 "implementation='pallas' to run the kernels anyway).")
      return XLA
    reason = _reason(name, op_names, config)
    if reason:
      _warn.warn(f"{what}: {reason}; using the slower XLA path.")
      return XLA
    return name
  reason = _reason(implementation, op_names, config)
  if reason:
    raise ValueError(f"{what}(implementation={implementation!r}): {reason}; use "
                     f"implementation='xla' for this call.")
  return implementation


# ---------------------------------------------------------------- is the target a GPU?

_FORCE_COMPILED = contextvars.ContextVar("jmem_pallas_force_compiled", default=False)


@contextlib.contextmanager
def compiled_kernels():
  """Within this context ``interpret=None`` means compiled kernels on every backend.

  For lowering a whole step for a GPU from a machine without one:
  ``with compiled_kernels(): jax.jit(step).trace(*a).lower(lowering_platforms=("cuda",))``.
  """
  token = _FORCE_COMPILED.set(True)
  try:
    yield
  finally:
    _FORCE_COMPILED.reset(token)


_AUTOMATIC_XLA = contextvars.ContextVar("jmem_automatic_xla", default=None)


@contextlib.contextmanager
def automatic_xla(reason: str):
  """Within this context ``implementation=None`` picks XLA even on a GPU, warning with
  ``reason`` (e.g. a batch that ``jax.jit`` shards over devices: XLA's partitioner cannot
  split a Pallas call, it would gather the operands onto every device)."""
  token = _AUTOMATIC_XLA.set(reason)
  try:
    yield
  finally:
    _AUTOMATIC_XLA.reset(token)


def targets_gpu() -> bool:
  """Whether ``implementation=None`` makes a GPU's choice (`choose`): on a GPU backend, and
  inside `compiled_kernels` / `pallas_kernels.lowering_for_gpu` (lowering for a GPU from
  another machine)."""
  return jax.default_backend() == "gpu" or _FORCE_COMPILED.get()
