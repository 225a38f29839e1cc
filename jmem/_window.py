"""Window-op arithmetic shared by the techniques: argument normalisation and the plain
(unsharded, uncompressed) convolution and pooling that are their references.

Private and low: ActNN's compressed ops (`jmem.ops.actnn.compressed`) and the spatial halo
ops (`jmem.parallel.spatial`) both build on it, neither on the other.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax


def pair(v, n: int, name: str) -> tuple:
  """``v`` as ``n`` values (one per spatial dim): an int is repeated."""
  if isinstance(v, int):
    return (v,) * n
  v = tuple(v)
  if len(v) != n:
    raise ValueError(f"{name} needs {n} values (one per spatial dim), got {v}.")
  return v


def padding_pairs(padding, window, strides, dilation, in_sizes) -> tuple:
  """Explicit ``(lo, hi)`` per spatial dim, XLA's rules for "SAME" and "VALID"."""
  n = len(window)
  if isinstance(padding, str):
    if padding.upper() not in ("SAME", "VALID"):
      raise ValueError(f"padding must be 'SAME', 'VALID' or explicit pairs, got {padding!r}.")
    extents = [d * (k - 1) + 1 for k, d in zip(window, dilation)]
    return tuple(tuple(p) for p in lax.padtype_to_pads(in_sizes, extents, strides,
                                                        padding.upper()))
  if isinstance(padding, int):
    return ((padding, padding),) * n
  pads = tuple((p, p) if isinstance(p, int) else tuple(p) for p in padding)
  if len(pads) != n:
    raise ValueError(f"padding needs {n} pairs, got {padding!r}.")
  return pads


def dimension_numbers(nd: int) -> tuple[str, str, str]:
  """Channels-last convolution dimension numbers for ``nd`` spatial dims."""
  sp = "HWD"[:nd] if nd > 1 else "W"
  return ("N" + sp + "C", sp + "IO", "N" + sp + "C")


def conv_reference(x, kernel, *, strides=1, padding="SAME", dilation=1,
                   feature_group_count=1) -> jax.Array:
  """The plain N-D convolution ``[N, *spatial, C]`` x ``[*window, C/groups, F]``."""
  nd = x.ndim - 2
  strides, dilation = pair(strides, nd, "strides"), pair(dilation, nd, "dilation")
  pads = padding_pairs(padding, kernel.shape[:nd], strides, dilation, x.shape[1:-1])
  return lax.conv_general_dilated(x, kernel, strides, pads, rhs_dilation=dilation,
                                  dimension_numbers=dimension_numbers(nd),
                                  feature_group_count=feature_group_count)


def pool_reference(x, *, window: int | Sequence[int], strides=None, padding="VALID",
                   kind: str = "max") -> jax.Array:
  """Max or average pooling of ``[N, *spatial, C]``; the average divides by the in-image
  positions of each window (padding excluded, ``count_include_pad=False``)."""
  nd = x.ndim - 2
  window = pair(window, nd, "window")
  strides = window if strides is None else pair(strides, nd, "strides")
  if kind not in ("max", "avg"):
    raise ValueError(f"kind must be 'max' or 'avg', got {kind!r}.")
  pads = ((0, 0),) + padding_pairs(padding, window, strides, (1,) * nd, x.shape[1:-1]) + \
      ((0, 0),)
  dims, st = (1,) + window + (1,), (1,) + strides + (1,)
  if kind == "max":
    return lax.reduce_window(x, -jnp.inf, lax.max, dims, st, pads)
  total = lax.reduce_window(x, 0.0, lax.add, dims, st, pads)
  count = lax.reduce_window(jnp.ones(x.shape[:-1] + (1,), x.dtype), 0.0, lax.add, dims, st,
                            pads)
  return total / count
