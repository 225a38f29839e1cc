"""Choosing Pallas interpret mode, shared by the kernels."""

import contextlib
import contextvars
import warnings

import jax

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


@contextlib.contextmanager
def lowering_for_gpu(device_kind: str = "NVIDIA H100 80GB HBM3"):
  """Lower for CUDA from a machine without a GPU: compiled kernels (`compiled_kernels`),
  and on JAX versions whose Triton lowering asks for the target GPU (0.11+), an abstract
  one-device mesh of ``device_kind``.

  Use around ``jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))``; make the
  arguments before entering (eager operations need a concrete device).
  """
  with contextlib.ExitStack() as stack:
    stack.enter_context(compiled_kernels())
    from jax._src import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
    if hasattr(mesh_lib, "AbstractDevice") and jax.__version_info__ >= (0, 11):
      device = mesh_lib.AbstractDevice(device_kind=device_kind, num_cores=None,
                                       platform="cuda")
      stack.enter_context(jax.sharding.use_abstract_mesh(
          jax.sharding.AbstractMesh((1,), ("_gpu",), abstract_device=device)))
    yield


def targets_gpu() -> bool:
  """Whether ``implementation=None`` should pick the kernels: on a GPU backend, and inside
  `compiled_kernels` / `lowering_for_gpu` (lowering for a GPU from another machine)."""
  return jax.default_backend() == "gpu" or _FORCE_COMPILED.get()


def resolve_interpret(interpret: bool | None, what: str, *, stacklevel: int = 4) -> bool:
  """``interpret`` as given, or (``None``) True exactly when the backend is not a GPU.

  The automatic choice warns: the interpreter is far slower than the XLA path, and a slower
  path is never taken silently. Inside `compiled_kernels` the automatic choice is False.
  """
  if interpret is None:
    interpret = jax.default_backend() != "gpu" and not _FORCE_COMPILED.get()
    if interpret:
      warnings.warn(f"{what} on a non-GPU backend runs the Pallas kernels in interpret mode, "
                    "which is much slower than implementation='xla' (the default).",
                    stacklevel=stacklevel)
  return bool(interpret)
