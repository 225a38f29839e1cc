"""InPlace-ABN as a technique: the `jmem.convert` object (`InPlaceABN`). Its ``jmem bench``
name ``inplace-abn`` is registered by `jmem.surgery` (it finds the model's pairs)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jmem._backends import check_implementation
from jmem._technique import Technique
from jmem.ops.inplace_abn import core

__all__ = ["InPlaceABN"]


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
    check_implementation(self.implementation, core.OPS, "InPlaceABN")
    if self.activation not in (None, *core.ACTIVATIONS):
      hint = (" ReLU is not invertible: use leaky_relu with a small slope."
              if self.activation == "relu" else "")
      raise ValueError(f"InPlaceABN(activation=...) must be 'leaky_relu', 'elu', 'identity' or "
                       f"None (the model's own), got {self.activation!r}.{hint}")
