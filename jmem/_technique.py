"""What every technique package builds on: the `jmem.convert` technique base (``where=``),
the bench's technique record, and the backend names. Private and low: the technique
packages (`jmem.ops.*`, `jmem.parallel.*`) each define their objects on top of it, and
`jmem.techniques` gathers them into the one registry of names.

``where`` is a module class, a regular expression over module paths, or a tuple of them:

* a class matches every module that is an instance of it (subclasses included);
* a string matches the module paths it ``re.fullmatch``-es. Paths are "/"-joined names from
  the top module: linen scope names (``"ResNetBlock_3/Conv_0"``, ``"stage1_block0"``), NNX
  attribute paths (``"blocks/0/conv1"``). The top module's own path is ``""``.

``where=None`` (the default) is each technique's own choice, given in its docstring.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any, Union

__all__ = ["IMPLEMENTATIONS", "Where", "Technique", "BenchTechnique",
           "EXACT_RESIDUAL", "keep_exact"]

# The name (``jax.ad_checkpoint.checkpoint_name``) of a residual that must stay exact when
# another technique stores the residuals around it: InPlace-ABN's saved OUTPUT, which its
# backward inverts (dividing by the activation's slope, so an error in it grows 100-fold).
# ActNN's `compress` keeps residuals of this name as they are.
EXACT_RESIDUAL = "jmem_exact_residual"


def keep_exact(x):
  """``x`` named `EXACT_RESIDUAL`: a residual no enclosing compression may quantize."""
  from jax.ad_checkpoint import checkpoint_name  # pylint: disable=g-import-not-at-top
  return checkpoint_name(x, EXACT_RESIDUAL)


# The built-in kernel backends of a technique with kernels (None: the kernels on a GPU, XLA
# elsewhere). Which names an op takes is `jmem._backends`' registry: these and any added.
IMPLEMENTATIONS = ("xla", "pallas")

Where = Union[None, type, str, tuple]


def _check_where(where, name: str) -> tuple:
  items = () if where is None else (where if isinstance(where, tuple) else (where,))
  for item in items:
    if isinstance(item, str):
      try:
        re.compile(item)
      except re.error as e:
        raise ValueError(f"{name}(where=...): {item!r} is not a regular expression ({e}).") \
            from None
    elif not isinstance(item, type):
      raise TypeError(f"{name}(where=...) takes module classes and/or regular expressions over "
                      f"module paths (or a tuple of them), got {item!r} of type "
                      f"{type(item).__name__}.")
  return items


@dataclasses.dataclass(frozen=True)
class Technique:
  """Base of the `jmem.convert` technique objects (`jmem.Remat`, `jmem.ActNN`,
  `jmem.SyncBN`, `jmem.InPlaceABN`): their options plus ``where``, the sites they apply to
  (module docstring)."""

  where: Where = dataclasses.field(default=None, kw_only=True)

  def __post_init__(self):
    _check_where(self.where, type(self).__name__)

  @property
  def where_items(self) -> tuple:
    return _check_where(self.where, type(self).__name__)

  def names(self, module_type: type, path: str) -> bool:
    """Whether ``where`` names this module explicitly: its exact class, or its path."""
    return any((isinstance(w, str) and re.fullmatch(w, path)) or w is module_type
               for w in self.where_items)

  def matches_user(self, module: Any, path: str) -> bool:
    return any((isinstance(w, str) and re.fullmatch(w, path) is not None) or
               (isinstance(w, type) and isinstance(module, w)) for w in self.where_items)


@dataclasses.dataclass(frozen=True)
class BenchTechnique:
  """A memory-saving technique as ``jmem bench`` sees it (``jmem.bench.Technique``).

  Attributes:
    name: registry name (what ``--techniques`` takes).
    apply: maps the exact linen model to the model with the technique switched on (a
      module, or `jmem.train.ModelFns` when the technique changes how it is run).
    description: one line for tables and ``--help``.
    prepare: optional data-dependent set-up used instead of ``apply``:
      ``prepare(model, dataset, batch_size) -> model`` (e.g. ActNN's bit allocation from
      gradient sensitivity on a training batch).
    has_kernels: the technique has Pallas kernels; ``apply`` and ``prepare`` then take an
      ``implementation`` keyword, chosen with a name suffix: ``"actnn-L3:pallas"``,
      ``"inplace-abn:xla"`` (no suffix: the kernels on a GPU, XLA elsewhere).
    kernel_ops: the `jmem._backends` ops its kernels implement: a suffix must name an
      implementation registered for all of them (empty: one of `IMPLEMENTATIONS`).
    implementation: the suffix's implementation (None: automatic).
    convert: ``convert(implementation) -> Technique | None``, the `jmem.convert` technique of
      the same name (`jmem.technique`; None from it: nothing to convert, as for
      ``"exact"``). Left None, the name is the bench's only (jmem's own models).
  """

  name: str
  apply: Callable[..., Any]
  description: str = ""
  prepare: Callable[..., Any] | None = None
  has_kernels: bool = False
  kernel_ops: tuple[str, ...] = ()
  implementation: str | None = None
  convert: Callable[[str | None], Technique | None] | None = None

  def build(self, model, dataset, batch_size: int):
    """``model`` with the technique on: ``prepare`` when there is one, else ``apply``."""
    kw = {"implementation": self.implementation} if self.has_kernels else {}
    if self.prepare is not None:
      return self.prepare(model, dataset, batch_size, **kw)
    return self.apply(model, **kw)
