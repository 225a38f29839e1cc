"""Choosing Pallas interpret mode, shared by the kernels."""

import warnings

import jax


def resolve_interpret(interpret: bool | None, what: str) -> bool:
  """``interpret`` as given, or (``None``) True exactly when the backend is not a GPU.

  The automatic choice warns: the interpreter is far slower than the XLA path, and a slower
  path is never taken silently.
  """
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
    if interpret:
      warnings.warn(f"{what} on a non-GPU backend runs the Pallas kernels in interpret mode, "
                    "which is much slower than implementation='xla' (the default).",
                    stacklevel=4)
  return bool(interpret)
