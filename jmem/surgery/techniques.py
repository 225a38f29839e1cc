"""Technique objects for `jmem.convert`: what to apply, and where (``where=``).

A technique is a frozen dataclass: its options plus ``where``, the sites it applies to.
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
from typing import Any, Union

from jmem.ops import actnn as actnn_lib
from jmem.ops import quantize as q

__all__ = ["Technique", "Remat", "ActNN", "SyncBN", "InPlaceABN", "Where", "technique",
           "technique_names"]

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
  """Base of the technique objects (`Remat`, `ActNN`, `SyncBN`, `InPlaceABN`)."""

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


def _check_implementation(implementation, name):
  if implementation not in (None, *q.IMPLEMENTATIONS):
    raise ValueError(f"{name}(implementation=...) must be one of {q.IMPLEMENTATIONS} or None "
                     f"(the kernels on a GPU, XLA elsewhere), got {implementation!r}.")


@dataclasses.dataclass(frozen=True)
class Remat(Technique):
  """Recompute each site's forward pass in the backward (``jax.checkpoint``), exactly.

  Default sites: the direct children of the top module (its blocks, stem layers), except a
  final ``nn.Dense`` / ``nnx.Linear`` head. ``policy``: a ``jax.checkpoint_policies`` entry
  (None: save nothing inside a site). Works under ``jit`` and under ``shard_map``.
  """

  policy: Any = None


@dataclasses.dataclass(frozen=True)
class ActNN(Technique):
  """ActNN / GACT activation compression (`jmem.ops.actnn`) at ``level``.

  ``ActNN("L3")`` (the default), ``ActNN(bits=2)`` (L3 at ``bits``), or a
  `jmem.ops.actnn.Level` (e.g. from `jmem.ops.actnn.calibrate`). L1/L2 sites default to
  every convolution (and, at L2, BatchNorm-like module); L3-L5 sites (whole blocks: every
  floating residual inside is compressed) default to the direct children of the top module
  except a final ``nn.Dense`` / ``nnx.Linear`` head, as `Remat`'s. L0 changes nothing.
  Per-site bits of a calibrated level are keyed by the site's path. The rounding key comes
  from the RNG stream ``"actnn"`` (``apply(..., rngs={"actnn": key})`` in linen,
  `jmem.surgery.rngs` in both APIs); without it, from the data, with a one-time warning.
  """

  level: Any = "L3"
  bits: int | None = None
  implementation: str | None = None
  # Set by `jmem.surgery.calibrate` only: the sites then probe gradient sensitivity.
  probe: Any = dataclasses.field(default=None, repr=False, compare=False)

  def __post_init__(self):
    super().__post_init__()
    _check_implementation(self.implementation, "ActNN")
    lv = self.resolved_level()
    if self.where is not None and lv.block_bits is None and lv.conv_bits is None and \
        lv.norm_bits is None:
      raise ValueError(f"ActNN level {lv.name} compresses nothing, so where={self.where!r} "
                       "would select sites for nothing; drop where= (or pick L1-L5).")

  def resolved_level(self) -> actnn_lib.Level:
    lv = actnn_lib.get_level(self.level)
    if self.bits is not None:
      if isinstance(self.bits, bool) or not isinstance(self.bits, int):
        raise TypeError(f"ActNN(bits=...) must be an int, got {self.bits!r}.")
      if lv.block_bits is None:
        raise ValueError(f"ActNN(bits={self.bits}) sets the bits of block sites; level "
                         f"{lv.name} has none (use L3-L5).")
      lv = dataclasses.replace(lv, name=f"{lv.name}@{self.bits}b", block_bits=self.bits)
    return lv


@dataclasses.dataclass(frozen=True)
class SyncBN(Technique):
  """Batch statistics over a named mesh axis (`jmem.parallel.sync_bn`), exact for masked,
  unbalanced batches.

  Default sites: every BatchNorm-like module (``flax.linen.BatchNorm`` / ``nnx.BatchNorm``
  and their subclasses that do not override ``__call__``; a subclass that does, or a
  look-alike with ``batch_stats`` ``mean``/``var``, must be named in ``where=``). The
  module's own fields and variables are used; ``axis_name`` (None: the module's own, and
  local statistics if it has none) needs ``shard_map``: under plain ``jit`` over sharded
  arrays XLA already computes global statistics. Masks from `jmem.surgery.batch_mask`.
  """

  axis_name: Any = None
  axis_index_groups: Any = None
  unbiased_running_var: bool = False


@dataclasses.dataclass(frozen=True)
class InPlaceABN(Technique):
  """In-Place Activated BatchNorm (`jmem.ops.inplace_abn`) on BatchNorm + activation pairs.

  Default sites: every BatchNorm-like module, each of which must be in a recognised pair
  (else it raises, naming it: narrow ``where=`` to the pairs). A pair is recognised where a
  BatchNorm-like module is immediately followed by ``leaky_relu`` or ``elu`` (a function, or
  a ``functools.partial`` of one) in an ``nn.Sequential`` / ``nnx.Sequential``; the
  activation is then applied inside the site. With ``activation="identity"`` any
  BatchNorm-like module can be a site. A BatchNorm whose activation the model applies in its
  own code cannot be seen: such a site raises, and the fix is a one-line edit to
  `jmem.ops.inplace_abn.InPlaceABN` (linen) or `jmem.ops.NNXInPlaceABN`,
  argument-compatible with BatchNorm plus the activation's.

  ``activation`` None takes the pair's own activation; given, it must equal it. The
  effective scale is ``|scale| + epsilon``: map plain-BN parameters with
  `jmem.surgery.inplace_abn_params`.
  """

  activation: str | None = None
  slope: float | None = None
  alpha: float | None = None
  axis_name: Any = None
  axis_index_groups: Any = None
  implementation: str | None = None
  unbiased_running_var: bool = False

  def __post_init__(self):
    super().__post_init__()
    _check_implementation(self.implementation, "InPlaceABN")
    if self.activation not in (None, "leaky_relu", "elu", "identity"):
      hint = (" ReLU is not invertible: use leaky_relu with a small slope." 
              if self.activation == "relu" else "")
      raise ValueError(f"InPlaceABN(activation=...) must be 'leaky_relu', 'elu', 'identity' or "
                       f"None (the model's own), got {self.activation!r}.{hint}")


# ------------------------------------------------------------ the bench's names for them

def _from_bench(name: str) -> Technique | None:
  base, _, implementation = name.partition(":")
  impl = implementation or None
  if base == "exact":
    return None
  if base == "remat":
    return Remat()
  if base in _LEVEL_NAMES:
    return ActNN(base[len("actnn-"):], implementation=impl)
  if base == "inplace-abn":
    # The bench also swaps jmem's models' relu for leaky_relu 0.01; a converted model keeps
    # its own (invertible) activations.
    return InPlaceABN(implementation=impl)
  return None


def technique(name: str, **overrides) -> Technique | None:
  """The `jmem.convert` technique of a ``jmem bench`` technique name (``"actnn-L3"``,
  ``"actnn-L3:pallas"``, ``"remat"``, ``"inplace-abn"``; ``"exact"`` gives None), with
  ``overrides`` (e.g. ``where=``) applied. The names are the bench's (`jmem.bench`); SBP and
  spatial sharding are not `jmem.convert` techniques yet.
  """
  base, colon, implementation = name.partition(":")
  if colon and implementation not in q.IMPLEMENTATIONS:
    raise ValueError(f"Unknown implementation {implementation!r} in {name!r}; use "
                     f"{' or '.join(q.IMPLEMENTATIONS)} (or no suffix for automatic).")
  if colon and base not in _WITH_KERNELS:
    raise ValueError(f"Technique {base!r} has no kernels, so it takes no ':{implementation}' "
                     f"suffix; techniques with kernels: {', '.join(_WITH_KERNELS)}.")
  if base in _BENCH_ONLY:
    raise ValueError(f"Technique {name!r} runs in jmem bench on jmem's own models but is not a "
                     "jmem.convert technique yet (SBP and spatial sharding of any model are "
                     f"planned); convert techniques: {', '.join(technique_names())}.")
  if base != "exact" and _from_bench(base) is None:
    raise ValueError(f"Unknown technique {base!r}; jmem.convert techniques: "
                     f"{', '.join(technique_names())}.")
  t = _from_bench(name)
  return dataclasses.replace(t, **overrides) if (t is not None and overrides) else t


_LEVEL_NAMES = tuple(f"actnn-L{i}" for i in range(6))
_WITH_KERNELS = (*_LEVEL_NAMES, "inplace-abn")
_BENCH_ONLY = ("spatial-8", "sbp-0.5", "sbp-0.25", "sbp-0.125")


def technique_names() -> tuple[str, ...]:
  """The bench names `technique` turns into `jmem.convert` techniques."""
  return ("exact", "remat", *_LEVEL_NAMES, "inplace-abn")
