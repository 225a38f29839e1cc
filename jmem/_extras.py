"""jmem's optional dependencies, imported where they are used.

``import jmem`` needs jax, jaxlib, flax, optax, chex and numpy only (flax brings rich and
orbax, which the training loop's progress bar and checkpoints use). The bench's data
(scikit-learn's digits, resized with scipy) and figures (matplotlib) come with the ``cli``
extra (``pip install 'jmem[cli]'``); using one of them without it raises an ImportError
that names the extra.
"""

from __future__ import annotations

import importlib
from types import ModuleType

EXTRA = "cli"
# module -> the distribution that provides it
DISTRIBUTIONS = {"sklearn": "scikit-learn", "scipy": "scipy", "matplotlib": "matplotlib"}


class MissingExtra(ImportError):
  """An optional dependency of jmem is not installed."""


def require(module: str, purpose: str) -> ModuleType:
  """``module`` imported, or `MissingExtra` saying that ``purpose`` needs it and the pip line."""
  try:
    return importlib.import_module(module)
  except ImportError as e:
    top = module.split(".")[0]
    dist = DISTRIBUTIONS.get(top, top)
    raise MissingExtra(f"{purpose} needs {dist}, which is not installed: pip install "
                       f"'jmem[{EXTRA}]' (or pip install {dist}).") from e


def available(module: str) -> bool:
  """Whether ``module`` can be imported."""
  try:
    importlib.import_module(module)
  except ImportError:
    return False
  return True
