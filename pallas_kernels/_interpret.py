"""Choosing Pallas interpret mode, shared by the kernels."""

import contextlib

import jax

# Whether the kernels target a GPU lives below every op, in jmem._backends (its automatic
# choice reads it); the kernels share it from there.
from jmem import _warn
from jmem._backends import _FORCE_COMPILED, compiled_kernels


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


def resolve_interpret(interpret: bool | None, what: str) -> bool:
  """``interpret`` as given, or (``None``) True exactly when the backend is not a GPU.

  The automatic choice warns: the interpreter is far slower than the XLA path, and a slower
  path is never taken silently. Inside `compiled_kernels` the automatic choice is False.
  """
  if interpret is None:
    interpret = jax.default_backend() != "gpu" and not _FORCE_COMPILED.get()
    if interpret:
      _warn.warn(f"{what} on a non-GPU backend runs the Pallas kernels in interpret mode, "
                 "which is much slower than implementation='xla' (the default).")
  return bool(interpret)
