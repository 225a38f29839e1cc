"""ActNN compression levels for Flax linen models: compressed ops and compressed blocks.

Two ways, one quantizer (`jmem.ops.quantize`):

* ActNN's way (L1, L2): swap the convolution (and, at L2, BatchNorm) module classes of a
  model for compressed ones: each saves a 4-bit copy of its input instead of the input.
* GACT's way (L3-L5): wrap each residual block (the model's ``block_transform`` hook, as
  ``nn.remat`` is used) in `compressed`, so that EVERY floating residual inside the block -
  convolution inputs, normalisation intermediates, activation inputs, the block's own
  input - is stored at 2 bits; parameters are never compressed.

Levels (frozen `Level` objects; build your own the same way):

====  =============================================================================
L0    exact
L1    4-bit convolutions (ActNN way); BatchNorm and activations uncompressed
L2    L1 + 4-bit BatchNorm
L3    2 bits for every floating residual of every block and of the stem (GACT way);
      only the classifier head (a pooled vector) stays exact
L4    L3 with the compressed residuals moved to host memory (``pinned_host``) until the
      backward pass
L5    L4 with groups of 1024 instead of 256: the bf16 min/scale metadata falls from
      4/256 to 4/1024 bytes per value, i.e. from 6.25% to 1.6% on top of the 2-bit codes
      (ActNN's L5 was allocator defragmentation, which XLA's static buffer assignment
      makes moot)
====  =============================================================================

ActNN's L3 chooses bits per layer and per sample from gradient sensitivity, with an average
of 2; jmem's L3 uses 2 bits everywhere (the allocation is not implemented yet).

The individual compressed operations (dense, conv, norms, gelu, attention, 1-bit ReLU /
dropout masks, max-pool indices) are in `jmem.ops.compressed`.

References:
  Chen et al., ActNN, ICML 2021, https://arxiv.org/abs/2104.14129
  Liu et al., GACT, ICML 2022, https://arxiv.org/abs/2206.11357
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.core.lift as lift
import flax.linen as nn
import jax
import numpy as np
from flax import nnx
from flax.linen import transforms as nn_transforms

from jmem.ops import quantize as q

__all__ = ["Level", "LEVELS", "get_level", "compressed", "convert", "CompressedNNX", "convert_nnx"]


def _lift_compress(fn, variables=True, rngs=True, *, bits, group_size, offload):
  """Core-scope version of `quantize.compress` (variables and rngs are never compressed)."""

  def inner(scope_fn, repack_fn, variable_groups, rng_groups, *args, **kwargs):
    # Python values (e.g. ``train=True``) are closed over; arrays go through compress.
    is_array = [isinstance(a, (jax.Array, np.ndarray)) for a in args]
    arrays = [a for a, k in zip(args, is_array) if k]

    def pure(variable_groups, rng_groups, *arrays):
      it = iter(arrays)
      full = [next(it) if k else a for a, k in zip(args, is_array)]
      scope = scope_fn(variable_groups, rng_groups)
      y = fn(scope, *full, **kwargs)
      return y, repack_fn(scope)
    g = q.compress(pure, bits=bits, group_size=group_size, param_argnums=(0, 1),
                   offload=offload)
    return g(variable_groups, rng_groups, *arrays)

  return lift.pack(inner, (variables,), (variables,), (rngs,), name="compress",
                   enable_kwargs=True)


def compressed(target, *, bits: int = 2, group_size: int = 256, offload: bool = False,
               methods=None):
  """Lifted `jmem.ops.quantize.compress` for a linen Module class (like ``nn.remat``).

  ``compressed(nn.Conv, bits=4)`` is a Conv whose backward uses a 4-bit copy of its input;
  ``compressed(BasicBlock)`` compresses everything a block saves. Static (non-array)
  arguments of the wrapped method must be passed as module attributes.
  """
  q.check_config(bits, group_size)
  return nn_transforms.lift_transform(_lift_compress, target, bits=bits,
                                      group_size=group_size, offload=offload, methods=methods)


@dataclasses.dataclass(frozen=True)
class Level:
  """An ActNN-style compression level.

  Attributes:
    name: "L0".."L5" or your own.
    conv_bits: bits of compressed convolutions (ActNN way), or None.
    norm_bits: bits of compressed BatchNorm (ActNN way), or None.
    block_bits: bits of whole compressed blocks and stem (GACT way), or None.
    offload: compressed residuals live in host memory until the backward.
    group_size: quantization group size.
  """

  name: str
  conv_bits: int | None = None
  norm_bits: int | None = None
  block_bits: int | None = None
  offload: bool = False
  group_size: int = 256

  def __post_init__(self):
    for bits in (self.conv_bits, self.norm_bits, self.block_bits):
      if bits is not None:
        q.check_config(bits, self.group_size)


LEVELS: dict[str, Level] = {
    "L0": Level("L0"),
    "L1": Level("L1", conv_bits=4),
    "L2": Level("L2", conv_bits=4, norm_bits=4),
    "L3": Level("L3", block_bits=2),
    "L4": Level("L4", block_bits=2, offload=True),
    "L5": Level("L5", block_bits=2, offload=True, group_size=1024),
}


def get_level(level: str | Level) -> Level:
  if isinstance(level, Level):
    return level
  if level not in LEVELS:
    raise ValueError(f"Unknown compression level {level!r}; valid levels: "
                     f"{', '.join(LEVELS)} (or a jmem.ops.actnn.Level).")
  return LEVELS[level]


def convert(model: nn.Module, level: str | Level = "L3") -> nn.Module:
  """The linen ``model`` with the compression of ``level``, its code untouched.

  Uses the model's ``conv`` / ``norm`` fields (L1, L2) and ``block_transform`` /
  ``stem_transform`` (L3+), as `jmem.models.ResNet` has. ``L0`` returns the model itself
  (outputs and gradients exactly the original's).
  """
  lv = get_level(level)
  updates: dict[str, Any] = {}
  kw = dict(group_size=lv.group_size, offload=lv.offload)
  if lv.conv_bits is not None:
    _need(model, "conv", lv)
    updates["conv"] = compressed(model.conv, bits=lv.conv_bits, **kw)
  if lv.norm_bits is not None:
    _need(model, "norm", lv)
    updates["norm"] = compressed(model.norm, bits=lv.norm_bits, **kw)
  if lv.block_bits is not None:
    wrap = functools.partial(compressed, bits=lv.block_bits, **kw)
    for field in ("block_transform", "stem_transform"):
      _need(model, field, lv)
      inner = getattr(model, field)
      updates[field] = wrap if inner is None else (lambda c, inner=inner: wrap(inner(c)))
  return model.clone(**updates) if updates else model


def _need(model, field, lv):
  if not hasattr(model, field):
    raise ValueError(f"Level {lv.name} needs a model with a {field!r} field (such as "
                     f"jmem.models.ResNet); {type(model).__name__} has none.")


# ------------------------------------------------------------------------------ Flax NNX

class CompressedNNX(nnx.Module):
  """An NNX module whose call saves ``bits``-bit copies of its residuals.

  The inner module's state (parameters, batch statistics, RNG counters) goes through
  `jmem.ops.quantize.compress` as the never-compressed first argument, and the updated state
  is written back, so BatchNorm statistics and dropout streams behave as before.
  """

  def __init__(self, inner: nnx.Module, *, bits: int = 2, group_size: int = 256,
               offload: bool = False):
    self.inner = inner
    self.bits, self.group_size, self.offload = bits, group_size, offload

  def __call__(self, *args):
    graphdef, state = nnx.split(self.inner)

    def pure(state, *args):
      module = nnx.merge(graphdef, state)
      return module(*args), nnx.state(module)
    fn = q.compress(pure, bits=self.bits, group_size=self.group_size, param_argnums=(0,),
                    offload=self.offload)
    y, new_state = fn(state, *args)
    nnx.update(self.inner, new_state)
    return y


def convert_nnx(model: nnx.Module, level: str | Level = "L3", *,
                block_types: tuple[type, ...] = ()) -> nnx.Module:
  """Graph surgery on an NNX model, in place (and returned): `convert` for Flax NNX.

  L1/L2 wrap every ``nnx.Conv`` (and, at L2, ``nnx.BatchNorm``) in `CompressedNNX` at 4
  bits. L3+ wrap every instance of ``block_types`` at ``block_bits`` (the GACT way); with no
  ``block_types`` they wrap convolutions and batch norms at ``block_bits``. ``L0`` changes
  nothing.
  """
  from jmem.parallel.sync_bn import replace_nnx_modules  # pylint: disable=g-import-not-at-top
  lv = get_level(level)
  kw = dict(group_size=lv.group_size, offload=lv.offload)
  plan = []
  if lv.conv_bits is not None:
    plan.append(((nnx.Conv,), lv.conv_bits))
  if lv.norm_bits is not None:
    plan.append(((nnx.BatchNorm,), lv.norm_bits))
  if lv.block_bits is not None:
    plan.append((tuple(block_types) or (nnx.Conv, nnx.BatchNorm), lv.block_bits))
  for types, bits in plan:
    replace_nnx_modules(model, lambda m, t=types: isinstance(m, t),
                        lambda m, b=bits: CompressedNNX(m, bits=b, **kw))
  return model
