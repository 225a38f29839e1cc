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


# The built-in kernel backends of a technique with kernels (None: the automatic choice of
# `jmem._backends.choose`). Which names an op takes is `jmem._backends`' registry: these and any added.
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
  def compacts_between_sites(self) -> bool:
    """Whether, with this technique on, `jmem.convert` also gives the ReLUs and max pools
    that run outside every site their exact, smaller residuals (a 1-bit mask, a uint8
    index: `jmem.ops.actnn.between`): ActNN (L1-L5) and the `Policy` kinds that compress or
    offload."""
    return False

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
  """A registered technique name (``jmem.bench.Technique``): what ``jmem bench
  --techniques``, ``jmem train --technique`` and `jmem.technique` take.

  The bench builds every technique as a user does: ``jmem.convert(model, *techniques)`` on
  the plain model (`jmem.bench.build_model`), never through fields of jmem's own models.

  Attributes:
    name: registry name (what ``--techniques`` takes).
    convert: ``convert(implementation) -> Technique | tuple | None``: the `jmem.convert`
      technique(s) of the name (None: nothing to convert, as for ``"exact"``). None for a
      name whose techniques come from ``prepare`` alone.
    description: one line for tables and ``--help``.
    prepare: optional data-dependent set-up, ``prepare(model, dataset, batch_size,
      techniques, *, target) -> techniques``: from ``convert``'s techniques (a tuple) to
      the ones the model is converted with (e.g. `jmem.plan`'s policies for a batch).
    calibrate: ActNN L3-L5: per-site bits from gradient sensitivity measured on a training
      batch first (`jmem.surgery.calibrate`), else at the level's bits everywhere.
    has_kernels: the technique has Pallas kernels; ``convert`` then takes an
      implementation chosen with a name suffix: ``"actnn-L3:pallas"``,
      ``"inplace-abn:xla"`` (no suffix: the automatic choice, `jmem._backends.choose`).
    kernel_ops: the `jmem._backends` ops its kernels implement: a suffix must name an
      implementation registered for all of them (empty: one of `IMPLEMENTATIONS`).
    implementation: the suffix's implementation (None: automatic).
  """

  name: str
  convert: Callable[[str | None], Any] | None
  description: str = ""
  prepare: Callable[..., tuple] | None = None
  calibrate: bool = False
  has_kernels: bool = False
  kernel_ops: tuple[str, ...] = ()
  implementation: str | None = None

  def __post_init__(self):
    if self.convert is None and self.prepare is None:
      raise ValueError(f"Technique {self.name!r} needs convert= (implementation -> "
                       "jmem.convert technique) or prepare=.")
    if self.convert is not None and not callable(self.convert):
      raise TypeError(f"Technique {self.name!r}: convert must be a function of the "
                      f"implementation returning jmem.convert techniques, got "
                      f"{type(self.convert).__name__}.")

  def techniques(self) -> tuple:
    """``convert``'s techniques for `implementation`, as a tuple (empty: exact)."""
    if self.convert is None:
      return ()
    t = self.convert(self.implementation)
    return () if t is None else (tuple(t) if isinstance(t, (tuple, list)) else (t,))
