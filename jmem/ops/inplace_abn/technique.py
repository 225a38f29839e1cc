"""InPlace-ABN as a technique: the `jmem.convert` object (`InPlaceABN`) and the
``jmem bench`` name ``inplace-abn``."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn

from jmem._backends import check_implementation
from jmem._technique import BenchTechnique, Technique
from jmem.ops.inplace_abn import core

__all__ = ["InPlaceABN", "BENCH_TECHNIQUES"]


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


def _apply(model, implementation=None):
  """jmem's own models: their ``norm_act`` becomes InPlace-ABN, with leaky_relu 0.01 for
  their relu everywhere (InPlace-ABN needs an invertible activation)."""
  if not hasattr(model, "norm_act"):
    raise ValueError(f"Technique 'inplace-abn' needs a model with a norm_act field (jmem's "
                     f"own models; any other model: jmem.convert(model, jmem.InPlaceABN())); "
                     f"{type(model).__name__} has none.")
  return model.clone(norm_act=functools.partial(core.InPlaceABN, activation="leaky_relu",
                                                slope=0.01, implementation=implementation),
                     act=functools.partial(nn.leaky_relu, negative_slope=0.01))


# A converted model keeps its own (invertible) activations: the bench's relu swap is for
# jmem's models only.
BENCH_TECHNIQUES = (
    BenchTechnique("inplace-abn", _apply,
                   "In-Place Activated BatchNorm (leaky_relu 0.01), saves only outputs",
                   has_kernels=True, kernel_ops=core.OPS,
                   convert=lambda implementation: InPlaceABN(implementation=implementation)),
)
