"""Window-op arithmetic shared by the techniques: argument normalisation, the plain
(unsharded, uncompressed) convolution and pooling that are their references, and max
pooling whose backward reads a uint8 index (`indexed_max_pool`).

Private and low: ActNN's compressed ops (`jmem.ops.actnn.compressed`) and the spatial halo
ops (`jmem.parallel.spatial`) both build on it, neither on the other.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
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


def indexed_max_pool(x, window_dimensions, window_strides, padding):
  """``lax.reduce_window`` max over ``x`` (full-rank window, strides and ``(low, high)``
  padding, as the ``reduce_window_max`` primitive takes them) whose backward reads a uint8
  index per output (the position of the first maximum in its window) instead of ``x``:
  8 bits per OUTPUT value saved, and a backward that is one fused loop (no
  ``select_and_scatter``, whose XLA:CPU form keeps several int32 copies of the input's
  size). The gradient is exact."""
  window_dimensions = tuple(int(w) for w in window_dimensions)
  why = _not_indexable(x.shape, x.dtype, window_dimensions, window_strides, padding)
  if why:
    raise ValueError(f"indexed_max_pool: {why}.")
  return _indexed_max_pool(x, window_dimensions, tuple(int(s) for s in window_strides),
                           tuple((int(lo), int(hi)) for lo, hi in padding))


def indexable_max_pool(shape, dtype, window_dimensions, window_strides, padding) -> bool:
  """Whether `indexed_max_pool` takes this pool (else keep ``lax.reduce_window``'s)."""
  return not _not_indexable(shape, dtype, window_dimensions, window_strides, padding)


def _not_indexable(shape, dtype, window_dimensions, window_strides, padding) -> str:
  if not (jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits >= 16):
    return (f"it pools floats of 16 bits or more (whose padding is -inf), not {jnp.dtype(dtype)}")
  if int(np.prod(window_dimensions)) > 256:
    return (f"the index within the window is a uint8, so windows of "
            f"{int(np.prod(window_dimensions))} > 256 positions are not supported")
  for n, w, s, (lo, hi) in zip(shape, window_dimensions, window_strides, padding):
    if n + lo + hi < w:
      return "the output is empty"
  return ""


def _window_slices(x, window, strides, padding, out_shape):
  """The strided slice of the -inf-padded x at each position in the window, in order."""
  xp = lax.pad(x, jnp.array(-jnp.inf, x.dtype), [(lo, hi, 0) for lo, hi in padding])
  for offset in np.ndindex(*window):
    yield lax.slice(xp, offset, [o + (n - 1) * s + 1 for o, n, s in
                                 zip(offset, out_shape, strides)], strides)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _indexed_max_pool(x, window, strides, padding):
  return lax.reduce_window(x, jnp.array(-jnp.inf, x.dtype), lax.max, window, strides, padding)


def _indexed_max_pool_fwd(x, window, strides, padding):
  y = _indexed_max_pool(x, window, strides, padding)
  k_max = int(np.prod(window))
  index = jnp.full(y.shape, k_max, jnp.int32)
  for k, part in enumerate(_window_slices(x, window, strides, padding, y.shape)):
    index = jnp.where((index == k_max) & (part == y), k, index)
  index = jnp.where(index == k_max, 0, index)          # no match: a window holding NaN
  # x's shape and dtype travel in a zero-size carrier (nothing is stored).
  return y, (index.astype(jnp.uint8), jnp.zeros((0,) + x.shape, x.dtype))


def _indexed_max_pool_bwd(window, strides, padding, res, dy):
  index, carrier = res
  x_shape = carrier.shape[1:]
  dx = None
  for k, offset in enumerate(np.ndindex(*window)):
    # dy placed at offset + i * stride of the padded input, cropped to x (negative padding).
    config = []
    for d, (o, n, s) in enumerate(zip(offset, dy.shape, strides)):
      low = o - padding[d][0]
      config.append((low, x_shape[d] - low - (n - 1) * s - 1, s - 1))
    part = lax.pad(jnp.where(index == k, dy, jnp.zeros((), dy.dtype)),
                   jnp.zeros((), dy.dtype), config)
    dx = part if dx is None else dx + part
  return (dx,)


_indexed_max_pool.defvjp(_indexed_max_pool_fwd, _indexed_max_pool_bwd)
