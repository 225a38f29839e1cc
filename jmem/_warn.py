"""`warn`: a warning attributed to the user's code, wherever in jmem it is raised.

jmem's warnings are mostly raised while a model is traced, under flax's and jax's frames; a
fixed ``stacklevel`` would name a line of flax or jax. This one names the innermost frame
outside jmem and the libraries it runs under: the user's model code (a module's
``__call__``), their training step, or the script that called jmem.
"""

from __future__ import annotations

import sys
import warnings

_LIBRARIES = frozenset({"jmem", "pallas_kernels", "flax", "jax", "jaxlib", "optax", "orbax",
                        "chex", "contextlib", "functools"})


def user_stacklevel() -> int:
  """`warnings.warn`'s ``stacklevel``, for a warn called in the caller of this function,
  of the innermost frame outside `_LIBRARIES` (where there is none: 2, the line that
  called the caller)."""
  frame, level = sys._getframe(1), 1  # pylint: disable=protected-access
  while frame is not None:
    if frame.f_globals.get("__name__", "").split(".")[0] not in _LIBRARIES:
      return level
    frame, level = frame.f_back, level + 1
  return 2


def warn(message: str, category: type[Warning] = UserWarning) -> None:
  """`warnings.warn` of ``message`` at the user's frame (module docstring)."""
  warnings.warn(message, category, stacklevel=user_stacklevel())
