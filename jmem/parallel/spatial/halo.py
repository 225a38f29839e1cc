"""Spatial tensor parallelism: activations sharded along H and/or W, halos by ``ppermute``.

Inside ``jax.shard_map`` each device holds a block of the image (channels last,
``[N, H, W, C]`` or any ``[N, *spatial, C]``), weights are replicated. A window op (conv,
pooling) on a sharded dimension needs only a thin halo from each neighbour:

* A dimension of global size ``L`` split in ``n`` blocks of ``l = L/n``, window ``k`` with
  dilation ``d`` (extent ``e = d(k-1)+1``), stride ``s`` and padding ``(p_lo, p_hi)``.
  When the global output has ``L/s`` positions and ``s`` divides ``l`` (every "same"-style
  conv, strided or not, and patchify convs with ``k = s``), output block ``i`` is exactly
  what block ``i``'s input, extended by ``p_lo`` positions on the left and ``e - s - p_lo``
  on the right, gives with no padding. A negative right extension trims the block.
* The halos come from the neighbours by one ``lax.ppermute`` per side and sharded
  dimension (a halo wider than a block: one per block it spans); ``ppermute`` with a
  non-cyclic permutation yields zeros at the global edges, which is the zero padding
  (pooling sets its own pad value there). H is exchanged first, then W on the H-extended
  block, so corners travel too.
* Gradients: pooling differentiates the exchange (the transpose of ``ppermute`` sends
  each halo's cotangent back to its owner). The convolution has a custom VJP instead: it
  saves ``x`` and the thin received strips, rebuilds the haloed input for the kernel
  gradient (no exchange), and gets its input gradient from the neighbours' overlapping
  output cotangents with a transposed convolution of exactly the block's size (autodiff of
  the exchange needs one over the haloed width, 1.8x slower on XLA:CPU). 4
  collective-permutes + 1 all-reduce for a k7 conv sharded on W, where XLA's automatic
  partitioning of the same conv emits 6 + 1. On CPU a depthwise kernel's gradient is a
  convolution with feature groups (the batch moved into the features): the batch-grouped
  one autodiff writes becomes a dense C x C convolution on XLA:CPU (115 MB of temp for a
  7x7 kernel of 768 channels; 3.9 MB this way).

Anything else that a spatially sharded CNN needs is here too: global average pooling (one
psum), window pooling with halos, per-sample DropPath with one draw per sample on every
shard; the Flax module and mesh helpers are in `jmem.parallel.spatial.modules`.
BatchNorm over the whole image is `jmem.parallel.sync_bn` with
``axis_name`` set to the spatial (and data) axes; layer norm over channels is local.

References:
  PyTorch DTensor convolution ops (``torch/distributed/tensor/_tp_conv.py``);
  Dryden et al., Channel and filter parallelism for large-scale CNN training, SC'19.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmem import _axes, _window
from jmem._window import dimension_numbers as _dimension_numbers
from jmem._window import pair as _pair
from jmem._window import padding_pairs as _padding

__all__ = [
    "HaloPlan", "plan_halo", "plan_split", "halo_exchange", "halo_conv", "halo_conv_reference", "halo_pool",
    "global_avg_pool", "drop_path",
]

AxisNames = Sequence[str | None]


@dataclasses.dataclass(frozen=True)
class HaloPlan:
  """How one spatial dimension of a window op is handled on one device.

  Attributes:
    axis_name: mesh axis it is sharded over (None: not sharded).
    left: input positions received from the left neighbour (the global left padding).
    right: input positions received from the right neighbour; negative: trim that many.
    padding: ``(lo, hi)`` for the local window op (0 on a sharded dim).
    out_left, out_right: output positions whose cotangents the backward of a convolution
      receives from the left / right neighbour (their windows overlap this block).
    grad_padding: padding of the convolution whose input-VJP, applied to the cotangent
      extended by ``out_left``/``out_right``, is this block's input gradient.
  """

  axis_name: str | None
  left: int
  right: int
  padding: tuple[int, int]
  out_left: int = 0
  out_right: int = 0
  grad_padding: tuple[int, int] = (0, 0)


def plan_halo(local_size: int, *, window: int, stride: int = 1, dilation: int = 1,
              padding: tuple[int, int] = (0, 0), axis_name: str | None = None,
              dim_name: str = "W") -> HaloPlan:
  """The halo of one spatial dimension (see the module docstring); raises if impossible.

  Args:
    local_size: per-device size ``l`` of the dimension.
    window, stride, dilation, padding: the window op's, as for the unsharded array.
    axis_name: the mesh axis the dimension is sharded over (None: local dim).
    dim_name: for error messages.
  """
  if axis_name is None:
    return HaloPlan(None, 0, 0, tuple(padding), grad_padding=tuple(padding))
  return plan_split(local_size, lax.axis_size(axis_name), window=window, stride=stride,
                    dilation=dilation, padding=padding, axis_name=axis_name,
                    dim_name=dim_name)


def plan_split(local_size: int, n: int, *, window: int, stride: int = 1, dilation: int = 1,
               padding: tuple[int, int] = (0, 0), axis_name: str = "?",
               dim_name: str = "W") -> HaloPlan:
  """`plan_halo` for ``n`` devices on ``axis_name``, outside any map (raises if impossible)."""
  size = local_size * n
  extent = dilation * (window - 1) + 1
  lo, hi = padding
  out = (size + lo + hi - extent) // stride + 1
  if local_size % stride or out * stride != size:
    raise ValueError(
        f"{dim_name} sharded over {axis_name!r} ({n} devices x {local_size}): a window of "
        f"{window} (dilation {dilation}, stride {stride}, padding {padding}) gives {out} "
        f"outputs for {size} inputs, which does not split into equal blocks of "
        f"{local_size}/{stride}. Use 'SAME' padding (output = input/stride) and a per-device "
        f"size divisible by the stride, or do not shard this dim (an all-gather would be "
        f"needed).")
  left, right = lo, extent - stride - lo
  # Outputs of the neighbours whose windows reach into this block (for the input VJP).
  out_left = max(0, (extent - 1 - lo) // stride)
  out_right = (lo - 1) // stride + 1 if lo >= 1 else 0
  if left < 0 or -right >= local_size:
    raise ValueError(
        f"{dim_name} sharded over {axis_name!r} ({n} devices x {local_size}): the padding "
        f"{padding} leaves a block {left} positions on the left and {right} on the right of "
        f"its own (negative: cut off), which does not split into equal blocks. Use "
        f"non-negative padding or do not shard this dim.")
  grad_padding = (out_left * stride + lo, (out_right - 1) * stride - lo + extent)
  return HaloPlan(axis_name, left, right, (0, 0), out_left, out_right, grad_padding)


def _receive(x, *, dim, axis_name, left, right, pad_value=0.0):
  """The strips this block gets from its left and right neighbours (None where empty).

  A strip wider than a block comes from several neighbours, one ``ppermute`` per block it
  spans (hop ``j`` sends block ``i``'s edge to block ``i + j``); past the image's edges it is
  ``pad_value``.
  """
  n = lax.axis_size(axis_name)
  size = x.shape[dim]
  idx = lax.axis_index(axis_name)

  def strip(width, from_left):
    parts = []
    for hop in range(1, -(-width // size) + 1):
      take = min(size, width - (hop - 1) * size)
      if from_left:       # the last `take` positions of block idx - hop
        edge = lax.slice_in_dim(x, size - take, size, axis=dim)
        perm = [(i, i + hop) for i in range(n - hop)]
        outside = idx < hop
      else:               # the first `take` positions of block idx + hop
        edge = lax.slice_in_dim(x, 0, take, axis=dim)
        perm = [(i + hop, i) for i in range(n - hop)]
        outside = idx >= n - hop
      got = lax.ppermute(edge, axis_name, perm=perm) if perm else jnp.zeros_like(edge)
      if pad_value != 0.0:
        got = jnp.where(outside, jnp.asarray(pad_value, x.dtype), got)
      parts.append(got)
    if from_left:
      parts.reverse()     # farthest block first
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=dim)

  return (strip(left, True) if left > 0 else None, strip(right, False) if right > 0 else None)


def _attach(x, strips, *, dim, right):
  """``x`` with its received strips concatenated along ``dim`` (trimmed if ``right < 0``)."""
  got_left, got_right = strips
  body = x if right >= 0 else lax.slice_in_dim(x, 0, x.shape[dim] + right, axis=dim)
  parts = [p for p in (got_left, body, got_right) if p is not None]
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=dim)


def halo_exchange(x: jax.Array, *, dim: int, axis_name: str, left: int, right: int,
                  pad_value: float = 0.0) -> jax.Array:
  """``x`` extended along ``dim`` by ``left``/``right`` positions of its mesh neighbours.

  Must run inside ``shard_map`` (or pmap) binding ``axis_name``. The blocks at the global
  edges receive ``pad_value``. ``right < 0`` trims the block instead.
  """
  strips = _receive(x, dim=dim, axis_name=axis_name, left=left, right=right,
                    pad_value=pad_value)
  return _attach(x, strips, dim=dim, right=right)


def _check_axes(axis_names: AxisNames, nd: int) -> tuple[str | None, ...]:
  axis_names = tuple(axis_names) if axis_names is not None else (None,) * nd
  if len(axis_names) != nd:
    raise ValueError(f"axis_names needs one entry per spatial dim ({nd}), got {axis_names}.")
  _axes.check_axis_name(tuple(a for a in axis_names if a is not None) or None)
  return axis_names


def _check_split(x, axis_names: tuple[str | None, ...]) -> None:
  """Raises if ``x`` is typed identical on every device of an axis it is said to be split over.

  Only under ``jax.shard_map`` with its varying types (``check_vma=True``, seen from
  ``axis_index`` being typed varying); elsewhere nothing is known and nothing is checked.
  Which dimension an axis splits is not visible inside the map (the local block's type
  has no partition spec), so names swapped between two dimensions that are both split
  cannot be detected.
  """
  for i, name in enumerate(axis_names):
    if name is None or lax.axis_size(name) == 1:
      continue
    if name not in _axes.varying_axes(lax.axis_index(name)):
      continue                       # no varying types here (check_vma=False, pmap, vmap)
    if name not in _axes.varying_axes(x):
      dim = "HWD"[i] if len(axis_names) > 1 else "W"
      raise ValueError(
          f"axis_names says {dim} is split over mesh axis {name!r}, but the input is the "
          f"same on every device of {name!r} (typed invariant), so it holds no block of "
          f"{dim}: the result would be the convolution of {lax.axis_size(name)} tiled copies. "
          f"Name the mesh axes as in the input's shard_map in_specs (spatial dims only; "
          f"None for a dim that is not split).")


def _plans(x, *, window, strides, dilation, padding, axis_names,
           check_split: bool = True) -> tuple[HaloPlan, ...]:
  nd = x.ndim - 2
  axis_names = _check_axes(axis_names, nd)
  if check_split:
    _check_split(x, axis_names)
  global_sizes = [x.shape[1 + i] * (1 if a is None else lax.axis_size(a))
                  for i, a in enumerate(axis_names)]
  pads = _padding(padding, window, strides, dilation, global_sizes)
  return tuple(plan_halo(x.shape[1 + i], window=k, stride=s, dilation=d, padding=p,
                         axis_name=a, dim_name="HWD"[i] if nd > 1 else "W")
               for i, (a, k, s, d, p) in enumerate(zip(axis_names, window, strides, dilation,
                                                       pads)))


def _extend(x, plans, *, pad_value=0.0, out=False):
  """Exchanges along every sharded dim in order (H, then W on the H-extended block, ...).

  Returns ``(extended x, received strips)``. ``out=True`` uses the output-side halos.
  """
  strips = []
  for i, plan in enumerate(plans):
    if plan.axis_name is None:
      strips.append((None, None))
      continue
    left, right = (plan.out_left, plan.out_right) if out else (plan.left, plan.right)
    got = _receive(x, dim=1 + i, axis_name=plan.axis_name, left=left, right=right,
                   pad_value=pad_value)
    x = _attach(x, got, dim=1 + i, right=right)
    strips.append(got)
  return x, tuple(strips)


def _rebuild(x, strips, plans):
  """The extended input from ``x`` and the strips received in the forward (no exchange)."""
  for i, (plan, got) in enumerate(zip(plans, strips)):
    if plan.axis_name is not None:
      x = _attach(x, got, dim=1 + i, right=plan.right)
  return x


def _haloed(x, *, window, strides, dilation, padding, axis_names, pad_value=0.0,
            check_split=True):
  """``(x with halos, local padding)`` for a window op over x's spatial dims 1..nd."""
  plans = _plans(x, window=window, strides=strides, dilation=dilation, padding=padding,
                 axis_names=axis_names, check_split=check_split)
  return _extend(x, plans, pad_value=pad_value)[0], tuple(p.padding for p in plans)


@dataclasses.dataclass(frozen=True)
class _ConvSpec:
  plans: tuple[HaloPlan, ...]
  strides: tuple[int, ...]
  dilation: tuple[int, ...]
  groups: int
  precision: Any
  preferred_element_type: Any

  def conv(self, x, kernel, padding):
    return lax.conv_general_dilated(
        x, kernel, window_strides=self.strides, padding=padding, rhs_dilation=self.dilation,
        dimension_numbers=_dimension_numbers(x.ndim - 2), feature_group_count=self.groups,
        precision=self.precision, preferred_element_type=self.preferred_element_type)

  def depthwise_kernel_grad(self, x, dy, padding, kernel):
    """The kernel gradient of a depthwise convolution (groups == input channels) on this
    block as a convolution with feature groups instead of batch groups: the batch moves
    into the features (``C`` groups of ``N``) and ``dy`` is the window, dilated by the
    stride. Summed over the mesh axes ``x`` varies on and the kernel does not, as autodiff
    of `conv` sums it."""
    nd = x.ndim - 2
    n, c, window = x.shape[0], x.shape[-1], kernel.shape[:nd]
    dtype = jnp.promote_types(x.dtype, dy.dtype)    # a bf16 input, a float32 cotangent
    x = jnp.pad(x, ((0, 0), *padding, (0, 0))).astype(dtype)
    dy = dy.astype(dtype)
    lhs = jnp.moveaxis(x, 0, -1).reshape(1, *x.shape[1:-1], c * n)      # features (c, n)
    rhs = jnp.moveaxis(dy, 0, -2)                                        # [*out, N, C*m]
    dk = lax.conv_general_dilated(
        lhs, rhs, window_strides=self.dilation, padding=((0, 0),) * nd,
        rhs_dilation=self.strides, dimension_numbers=_dimension_numbers(nd),
        feature_group_count=c, precision=self.precision,
        preferred_element_type=self.preferred_element_type)
    dk = dk[(0, *(slice(0, k) for k in window))].reshape(*window, 1, dy.shape[-1])
    dk = dk.astype(kernel.dtype)
    summed = tuple(sorted(_axes.varying_axes(x) - _axes.varying_axes(kernel)))
    return lax.psum(dk, summed) if summed else dk


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _halo_conv(x, kernel, spec: _ConvSpec):
  x_ext, _ = _extend(x, spec.plans)
  return spec.conv(x_ext, kernel, tuple(p.padding for p in spec.plans))


def _halo_conv_fwd(x, kernel, spec):
  x_ext, strips = _extend(x, spec.plans)
  y = spec.conv(x_ext, kernel, tuple(p.padding for p in spec.plans))
  # Saved: x and the thin received strips (not a second full-size haloed copy).
  return y, (x, strips, kernel)


def _halo_conv_bwd(spec, res, dy):
  x, strips, kernel = res
  # Kernel gradient: the forward's halos are reused, no exchange. Autodiff of the local conv
  # sums it over the shards when the kernel is replicated (check_vma's pvary transposes to
  # psum); under pmap or check_vma=False it stays per-device, as autodiff would leave it.
  x_ext = _rebuild(x, strips, spec.plans)
  pads = tuple(p.padding for p in spec.plans)

  def kernel_grad(x_ext, dy):
    _, vjp_kernel = jax.vjp(lambda k: spec.conv(x_ext, k, pads), kernel)
    return vjp_kernel(dy)[0]   # for a replicated kernel under shard_map: summed over shards

  if spec.groups > 1 and spec.groups == x.shape[-1]:
    # Depthwise: XLA:CPU computes this kernel gradient (a convolution with batch groups)
    # as a dense one of C x C channels (for a 7x7 kernel of 768 channels a 115 MB
    # temporary), so on CPU it is a feature-grouped convolution instead; elsewhere
    # autodiff's.
    dk = lax.platform_dependent(
        x_ext, dy, cpu=lambda v, g: spec.depthwise_kernel_grad(v, g, pads, kernel),
        default=kernel_grad)
  else:
    dk = kernel_grad(x_ext, dy)
  # Input gradient: the cotangents of the neighbours' outputs that read this block, then
  # the local transposed convolution, whose output is exactly this block's size.
  dy_ext, _ = _extend(dy, spec.plans, out=True)
  _, vjp_x = jax.vjp(lambda v: spec.conv(v, kernel, tuple(p.grad_padding for p in spec.plans)),
                     x)
  (dx,) = vjp_x(dy_ext.astype(dy.dtype))
  return dx, dk


_halo_conv.defvjp(_halo_conv_fwd, _halo_conv_bwd)


def halo_conv(x: jax.Array, kernel: jax.Array, *, strides: int | Sequence[int] = 1,
              padding: str | int | Sequence = "SAME", dilation: int | Sequence[int] = 1,
              feature_group_count: int = 1, axis_names: AxisNames | None = None,
              precision=None, preferred_element_type=None) -> jax.Array:
  """Convolution of a spatially sharded activation with a replicated kernel.

  Forward: one ``ppermute`` per side and sharded dim (per block the halo spans, where it is
  wider than a block) brings the input halos, then a local convolution with no padding on
  the sharded dims. Backward (custom VJP): the kernel gradient reuses the forward's halos
  (saved as thin strips beside ``x``, no exchange) and is summed over the shards (one
  all-reduce); the input gradient gets the cotangents of the neighbours' overlapping
  outputs (one ``ppermute`` per side and hop) and runs a local transposed convolution of
  exactly the block's size. A k7 conv sharded on W: 4 collective-permutes +
  1 all-reduce for forward + backward (XLA's automatic partitioning: 6 + 1).

  Args:
    x: ``[N, *spatial, C_in]`` local block (channels last), inside ``shard_map``.
    kernel: ``[*window, C_in / groups, C_out]`` (flax's layout), replicated.
    strides, padding, dilation: as for the unsharded ``lax.conv_general_dilated``
      (``padding`` "SAME", "VALID", an int or ``(lo, hi)`` pairs; the global image's).
    feature_group_count: groups (``C_in`` for depthwise).
    axis_names: per spatial dim, the mesh axis it is sharded over or None. ``None``:
      nothing sharded (a plain convolution: the same code runs unsharded). Every name
      must be bound by the enclosing shard_map (NameError otherwise). Under
      ``check_vma=True``, naming an axis of size > 1 that ``x`` is not split over
      (typed invariant) raises ValueError. Not detectable from inside the map: names
      left out or swapped between dims that are split (an axis that splits the batch
      is indistinguishable from one that splits H or W), which give per-block or wrong
      results silently; `spatial_model_fns` derives both the specs and the names from
      one mesh.

  Returns:
    ``[N, *spatial / strides, C_out]``: this device's block of the global output.

  Raises:
    ValueError: if the global output does not split into equal blocks (e.g. a per-device
      width that is not a multiple of the stride), or ``x`` is not split over a named axis
      (see ``axis_names``).
    NameError: if an axis name is not bound by an enclosing shard_map / pmap.
  """
  nd = x.ndim - 2
  if kernel.ndim != nd + 2:
    raise ValueError(f"kernel of rank {kernel.ndim} does not match x of rank {x.ndim} "
                     f"({nd} spatial dims): expected [*window, C_in/groups, C_out].")
  window = kernel.shape[:nd]
  strides, dilation = _pair(strides, nd, "strides"), _pair(dilation, nd, "dilation")
  plans = _plans(x, window=window, strides=strides, dilation=dilation, padding=padding,
                 axis_names=axis_names)
  spec = _ConvSpec(plans, strides, dilation, feature_group_count, precision,
                   preferred_element_type)
  if all(p.axis_name is None for p in plans):
    return spec.conv(x, kernel, tuple(p.padding for p in plans))
  return _halo_conv(x, kernel, spec)


def halo_conv_reference(x, kernel, *, strides=1, padding="SAME", dilation=1,
                        feature_group_count=1):
  """The unsharded convolution on the full array: the oracle of `halo_conv`."""
  return _window.conv_reference(x, kernel, strides=strides, padding=padding,
                                dilation=dilation, feature_group_count=feature_group_count)


def halo_pool(x: jax.Array, *, window: int | Sequence[int], strides: int | Sequence[int] | None
              = None, padding: str | Sequence = "VALID", kind: str = "max",
              axis_names: AxisNames | None = None) -> jax.Array:
  """Max or average pooling of a spatially sharded activation (halos as `halo_conv`).

  Average pooling divides by the number of in-image positions of each window (padding
  excluded), as ``flax.linen.avg_pool(count_include_pad=False)``.
  """
  nd = x.ndim - 2
  window = _pair(window, nd, "window")
  strides = window if strides is None else _pair(strides, nd, "strides")
  if kind not in ("max", "avg"):
    raise ValueError(f"kind must be 'max' or 'avg', got {kind!r}.")
  dims, ones = (1,) + window + (1,), (1,) * nd
  st = (1,) + strides + (1,)

  def pool(v, init, op, pad_value, check_split=True):
    v, pads = _haloed(v, window=window, strides=strides, dilation=ones, padding=padding,
                      axis_names=axis_names, pad_value=pad_value, check_split=check_split)
    return lax.reduce_window(v, init, op, dims, st, ((0, 0),) + pads + ((0, 0),))

  if kind == "max":
    return pool(x, -jnp.inf, lax.max, -jnp.inf)
  total = pool(x, 0.0, lax.add, 0.0)
  # The window counts: the same ones on every device (typed invariant), by design.
  count = pool(jnp.ones(x.shape[:-1] + (1,), x.dtype), 0.0, lax.add, 0.0, check_split=False)
  return total / count


def global_avg_pool(x: jax.Array, *, axis_names: AxisNames | None = None) -> jax.Array:
  """Mean over the spatial dims ``[N, *spatial, C] -> [N, C]``, one psum when sharded."""
  nd = x.ndim - 2
  axis_names = _check_axes(axis_names, nd)
  names = tuple(a for a in axis_names if a is not None)
  total = jnp.sum(x, axis=tuple(range(1, 1 + nd)), dtype=jnp.float32)
  count = float(np.prod(x.shape[1:-1]))
  if names:
    total = lax.psum(total, names)
    count *= float(np.prod([lax.axis_size(a) for a in names]))
  return (total / count).astype(x.dtype)


def drop_path(x: jax.Array, rate: float, key: jax.Array | None, *, deterministic: bool,
              data_axis: str | None = None) -> jax.Array:
  """Stochastic depth: drop whole samples of a residual branch, rescale the rest.

  The draw depends only on the key and the sample, so every spatial shard of a sample
  makes the same choice as long as the key is replicated over the spatial axes; with
  ``data_axis``, samples on different data shards get independent draws.
  """
  if not 0.0 <= rate < 1.0:
    raise ValueError(f"drop_path rate must be in [0, 1), got {rate}.")
  if deterministic or rate == 0.0:
    return x
  if key is None:
    raise ValueError("drop_path needs a PRNG key in training mode (deterministic=False).")
  if data_axis is not None:
    key = jax.random.fold_in(key, lax.axis_index(data_axis))
  keep = jax.random.bernoulli(key, 1.0 - rate, (x.shape[0],) + (1,) * (x.ndim - 1))
  return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))
