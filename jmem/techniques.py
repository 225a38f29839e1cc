"""Every technique of jmem by name: the one registry that ``jmem bench`` and `jmem.convert`
share.

Each technique package defines its records (``BENCH_TECHNIQUES``: a name and its
`jmem.convert` object, which the bench applies to any model with `jmem.convert`, as a user
does); this module gathers them. ``get_technique("actnn-L3")`` is the bench's record,
``technique("actnn-L3")`` the `jmem.convert` object of the same name.
"""

from __future__ import annotations

import dataclasses

from jmem import _backends
from jmem._technique import IMPLEMENTATIONS, BenchTechnique, Technique
from jmem.ops import remat
from jmem.ops.actnn import technique as actnn_technique
from jmem.ops.sbp import technique as sbp_technique
from jmem.parallel.spatial import technique as spatial_technique
from jmem.parallel.sync_bn import technique as sync_bn_technique

__all__ = ["register_technique", "get_technique", "technique_names", "technique",
           "convert_technique_names"]

_TECHNIQUES: dict[str, BenchTechnique] = {}


def register_technique(record: BenchTechnique) -> BenchTechnique:
  """Adds ``record`` to the registry (its name must be new); returns it."""
  if ":" in record.name:
    raise ValueError(f"Technique names may not contain ':' (it selects an implementation), "
                     f"got {record.name!r}.")
  if record.name in _TECHNIQUES:
    raise ValueError(f"A technique named {record.name!r} is already registered.")
  _TECHNIQUES[record.name] = record
  return record


def technique_names() -> tuple[str, ...]:
  """Every registered name (the bench's ``--techniques``)."""
  return tuple(_TECHNIQUES)


def convert_technique_names() -> tuple[str, ...]:
  """The names that `technique` turns into `jmem.convert` techniques."""
  return tuple(n for n, t in _TECHNIQUES.items() if t.convert is not None)


def get_technique(name: str) -> BenchTechnique:
  """The registered technique ``name``; ``"<name>:xla"`` / ``"<name>:pallas"`` pick the
  implementation of a technique with kernels."""
  if not isinstance(name, str):
    raise TypeError(f"A technique name is a string such as 'actnn-L3' or 'remat' ('exact' for "
                    f"none); got {name!r}. Registered: {', '.join(_TECHNIQUES)}.")
  base, colon, implementation = name.partition(":")
  if base not in _TECHNIQUES:
    raise ValueError(f"Unknown technique {base!r}; valid techniques: "
                     f"{', '.join(_TECHNIQUES)}.")
  record = _TECHNIQUES[base]
  if not colon:
    return record
  if not record.has_kernels:
    with_kernels = [n for n, t in _TECHNIQUES.items() if t.has_kernels]
    raise ValueError(f"Technique {base!r} has no kernels, so it takes no ':{implementation}' "
                     f"suffix; techniques with kernels: {', '.join(with_kernels)}.")
  names = (_backends.implementations(*record.kernel_ops) if record.kernel_ops
           else IMPLEMENTATIONS)
  if implementation not in names:
    raise ValueError(f"Unknown implementation {implementation!r} in {name!r}; use "
                     f"{' or '.join(names)} (or no suffix for automatic).")
  return dataclasses.replace(record, name=name, implementation=implementation)


def technique(name: str, **overrides) -> Technique | None:
  """The `jmem.convert` technique of a registered name (``"actnn-L3"``,
  ``"actnn-L3:pallas"``, ``"remat"``, ``"inplace-abn"``; ``"exact"`` gives None), with
  ``overrides`` (e.g. ``where=``) applied."""
  record = get_technique(name)
  if record.convert is None:
    raise ValueError(f"Technique {name!r} is made for a batch by jmem bench (e.g. a plan: "
                     "jmem.plan(model, (x, y), budget).techniques); jmem.convert techniques: "
                     f"{', '.join(convert_technique_names())}.")
  t = record.convert(record.implementation)
  return dataclasses.replace(t, **overrides) if (t is not None and overrides) else t


register_technique(BenchTechnique("exact", lambda implementation: None,
                                  "plain backprop (the baseline)"))
for _module in (remat, spatial_technique, actnn_technique, sbp_technique,
                sync_bn_technique):
  for _record in _module.BENCH_TECHNIQUES:
    register_technique(_record)
