"""Spatial sharding of a model that runs under plain ``jax.jit``: its convolutions exchange
halos themselves (`halo_conv` in a nested ``jax.shard_map``), everything else is partitioned
by XLA.

The model keeps its global semantics: its input is a global array sharded over the mesh's
H and W axes (and the batch over a data axis, if one is given), and every layer jmem does
not know (normalisation, pooling, a global mean, attention) is computed by XLA's own
partitioner, which is exact for any layer. Only the convolutions are replaced: by
`sharded_conv`, a drop-in for ``lax.conv_general_dilated`` that runs `halo_conv` on each
device's block (4 collective-permutes + 1 all-reduce for a k7 conv sharded on W, forward
and backward, where XLA's partitioning of the same conv emits 6 + 1).

A spatial dim whose blocks would not be equal (a side the mesh does not divide, a stride
that does not divide the per-device size) is padded with zeros up to ``n`` blocks of
``ceil(length / n)`` rounded up to the stride: XLA's own layout of such a dim, so padding it
and cutting the outputs off move no data. The zeros are the convolution's own zero padding;
its right padding is set so that every block gives ``block / stride`` outputs, and the
outputs past the true ones are cut off. A halo wider than a block comes from several
neighbours (`halo_conv`). Where a dim still cannot be split (negative padding, left padding
past the window) it is gathered for that convolution (``with_sharding_constraint`` to a spec
without its axis); a convolution `halo_conv` does not cover at all (input dilation, batch
groups, not 2-D) runs on the whole gathered image. Either way a `SpatialFallbackWarning`
says so, once per reason. Uneven shards are not left to XLA's spatial partitioning: on
XLA:CPU (JAX 0.10.2) a stride-2 convolution of 15-row blocks (a 30-row image on 2 devices)
gets gradients off by up to 0.13 that way, where jmem is exact
(`tests/test_convert_spatial.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jmem import _axes, _warn, _window
from jmem.parallel.spatial.halo import halo_conv, plan_split

__all__ = ["SpatialFallbackWarning", "sharded_conv", "check_mesh"]


class SpatialFallbackWarning(UserWarning):
  """A convolution of a spatially sharded model runs on the whole (gathered) image instead of
  with jmem's halo exchange (still exact; more memory and communication). Silence with
  ``warnings.filterwarnings("ignore", category=SpatialFallbackWarning)``."""


_WARNED: set = set()


def _fallback(reason: str, where: str, gathered: str) -> None:
  if reason not in _WARNED:
    _WARNED.add(reason)
    _warn.warn(f"jmem.Spatial: the convolution at {where or '<top>'!r} {reason}, so its "
               f"input is gathered over {gathered} (exact; more memory and "
               "communication). Later convolutions for the same reason are not reported.",
               SpatialFallbackWarning)


def check_mesh(mesh: Mesh, axes: Sequence[str | None], data_axis: str | None) -> None:
  """Raises unless ``axes`` (H, W) and ``data_axis`` name distinct axes of ``mesh``."""
  if not isinstance(mesh, Mesh):
    raise TypeError(f"jmem.Spatial needs a jax.sharding.Mesh, got {type(mesh).__name__}.")
  axes = tuple(axes)
  if len(axes) != 2:
    raise ValueError(f"jmem.Spatial(axes=...) names the mesh axes of H and W (None: not "
                     f"sharded), got {axes!r}.")
  named = [a for a in (*axes, data_axis) if a is not None]
  for a in named:
    if a not in mesh.axis_names:
      raise ValueError(f"jmem.Spatial: {a!r} is not an axis of the mesh {mesh.axis_names}.")
  if len(set(named)) != len(named):
    raise ValueError(f"jmem.Spatial: axes={axes!r} and data_axis={data_axis!r} must name "
                     "different mesh axes.")
  if not any(a is not None for a in axes):
    raise ValueError("jmem.Spatial(axes=...) shards nothing: name the mesh axis of H or W.")
  types = dict(zip(mesh.axis_names, getattr(mesh, "axis_types", ()) or ()))
  explicit = [a for a in named if "Explicit" in str(types.get(a, ""))]
  if explicit:
    raise ValueError(
        f"jmem.Spatial: the mesh axes {explicit} are AxisType.Explicit; a Spatial model is "
        "global code under plain jit, and Flax's layers take no out_sharding, so build the "
        "mesh with axis_types=(AxisType.Auto,) * n.")


def sharded_conv(mesh: Mesh, axes: Sequence[str | None], data_axis: str | None = None,
                 where: str = ""):
  """A ``lax.conv_general_dilated`` for channels-last 2-D convolutions whose input is a
  global array sharded over ``axes`` (H, W) of ``mesh``: `halo_conv` per device block."""
  axes = tuple(axes)
  size = dict(zip(mesh.axis_names, mesh.devices.shape))

  def conv(lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
           dimension_numbers=None, feature_group_count=1, batch_group_count=1,
           precision=None, preferred_element_type=None, out_sharding=None):
    def plain():
      kw = {} if out_sharding is None else {"out_sharding": out_sharding}
      return lax.conv_general_dilated(
          lhs, rhs, window_strides, padding, lhs_dilation=lhs_dilation,
          rhs_dilation=rhs_dilation, dimension_numbers=dimension_numbers,
          feature_group_count=feature_group_count, batch_group_count=batch_group_count,
          precision=precision, preferred_element_type=preferred_element_type, **kw)

    if _axes.varying_axes(lhs):
      raise ValueError(
          f"jmem.Spatial: the convolution at {where or '<top>'!r} runs inside shard_map (its "
          f"input varies over {sorted(_axes.varying_axes(lhs))}); a Spatial model runs under "
          "plain jax.jit on global arrays and shards its convolutions itself.")
    if 0 in jax.eval_shape(lambda a, b: lax.conv_general_dilated(
        a, b, window_strides, padding, lhs_dilation=lhs_dilation, rhs_dilation=rhs_dilation,
        dimension_numbers=dimension_numbers, feature_group_count=feature_group_count,
        batch_group_count=batch_group_count), lhs, rhs).shape:
      return plain()                   # an empty output: nothing to shard
    batch = data_axis if data_axis is not None and size[data_axis] > 1 else None
    reason = "has an out_sharding of its own" if out_sharding is not None else _unsupported(
        lhs, rhs, padding, lhs_dilation, dimension_numbers, batch_group_count, batch, size)
    names = [a if a is not None and size[a] > 1 else None for a in axes]
    home = NamedSharding(mesh, P(batch, *names, None))   # the layout the model runs in
    plans = {}
    if reason is None:                 # the dims that do not split are gathered, the others
      plans, unsplit = _split_plans(lhs, rhs, window_strides, padding, rhs_dilation, names,
                                    size)
      for dim, why in unsplit.items():
        _fallback(why, where, gathered=names[dim])
        names[dim] = None
      if all(n is None for n in names):
        reason = "splits on no spatial axis"
    if reason is not None:
      _fallback(reason, where, gathered="every spatial axis")
      if lhs.ndim == 4 and (batch is None or lhs.shape[0] % size[batch] == 0):
        whole = NamedSharding(mesh, P(batch))       # every device: the whole image
        lhs = jax.lax.with_sharding_constraint(lhs, whole)
        return jax.lax.with_sharding_constraint(plain(), whole)
      return plain()
    # Uneven dims: zeros appended up to equal blocks (they are the convolution's own zero
    # padding), the padding on the right set so that every block gives length/stride
    # outputs, and the outputs past the true ones cut off.
    window = rhs.shape[:2]
    dilation = tuple(rhs_dilation or (1, 1))
    pads = list(_window.padding_pairs(padding, window, tuple(window_strides), dilation,
                                      lhs.shape[1:3]))
    extra, outs = [(0, 0)] * 4, []
    for dim in range(2):
      padded, pads[dim], out = plans.get(dim, (lhs.shape[1 + dim], pads[dim], None))
      extra[1 + dim] = (0, padded - lhs.shape[1 + dim])
      outs.append(out)
    if any(e != (0, 0) for e in extra):
      lhs = jax.numpy.pad(lhs, extra)
    spec = P(batch, names[0], names[1], None)
    lhs = jax.lax.with_sharding_constraint(lhs, NamedSharding(mesh, spec))

    def local(x, kernel):
      return halo_conv(x, kernel, strides=tuple(window_strides), padding=tuple(pads),
                       dilation=dilation, feature_group_count=feature_group_count,
                       axis_names=tuple(names), precision=precision,
                       preferred_element_type=preferred_element_type)
    y = jax.shard_map(local, mesh=mesh, in_specs=(spec, P()), out_specs=spec)(lhs, rhs)
    if any(o is not None for o in outs):
      y = y[:, :y.shape[1] if outs[0] is None else outs[0],
            :y.shape[2] if outs[1] is None else outs[1]]
    if unsplit:
      y = jax.lax.with_sharding_constraint(y, home)
    return y

  return conv


def _unsupported(lhs, rhs, padding, lhs_dilation, dimension_numbers, batch_group_count,
                 batch, size) -> str | None:
  """Why `halo_conv` cannot compute this convolution at all (None: it can)."""
  if lhs.ndim != 4:
    return f"is not 2-D (input of rank {lhs.ndim})"
  if dimension_numbers is not None:
    dn = lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
    if tuple(dn.lhs_spec) != (0, 3, 1, 2) or tuple(dn.rhs_spec) != (3, 2, 0, 1) or \
        tuple(dn.out_spec) != (0, 3, 1, 2):
      return "is not channels-last (NHWC input, HWIO kernel)"
  if lhs_dilation is not None and any(d != 1 for d in lhs_dilation):
    return "has input dilation (a transposed convolution)"
  if batch_group_count != 1:
    return "has batch groups"
  if isinstance(padding, str) and padding.upper() not in ("SAME", "VALID"):
    return f"has {padding!r} padding"
  if batch is not None and lhs.shape[0] % size[batch]:
    return (f"has a batch of {lhs.shape[0]}, which the {size[batch]} devices of {batch!r} "
            "do not divide")
  return None


def _split_plans(lhs, rhs, strides, padding, rhs_dilation, names, size):
  """``({dim: (padded length, padding, true output length)}, {dim: why not})``: how each
  sharded spatial dim splits into equal blocks, padded with zeros where the mesh does not
  divide it (or the stride does not divide a block), or why it cannot (negative padding,
  left padding past the window)."""
  dilation = tuple(rhs_dilation or (1, 1))
  window = rhs.shape[:2]
  pads = _window.padding_pairs(padding, window, tuple(strides), dilation, lhs.shape[1:3])
  plans, unsplit = {}, {}
  for dim, (axis, name) in enumerate(zip(names, ("H", "W"))):
    if axis is None:
      continue
    n, length, stride = size[axis], lhs.shape[1 + dim], strides[dim]
    lo, hi = pads[dim]
    extent = dilation[dim] * (window[dim] - 1) + 1
    out = (length + lo + hi - extent) // stride + 1
    try:
      plan_split(length // n, n, window=window[dim], stride=stride, dilation=dilation[dim],
                 padding=(lo, hi), axis_name=axis, dim_name=name)
      if length % n == 0:
        continue                                      # even: as it is
    except ValueError:
      pass
    if not 0 <= lo < extent or hi < 0:
      unsplit[dim] = (f"cannot split {name} = {length} into equal blocks (padding {(lo, hi)} "
                      f"with a window of {extent})")
      continue
    # Zeros appended up to n blocks of ceil(length / n) positions rounded up to the stride:
    # XLA's own layout of an uneven dim (ceil(length / n) per device, the last ones padded)
    # wherever the stride divides that block, so padding and cutting off move no data.
    # A window past the image reads the edge's zeros, so only the true outputs must fit.
    block = -(-length // n)
    block = -(-block // stride) * stride
    block = max(block, -(-out // n) * stride)
    padded, right = n * block, extent - stride - lo  # every block: block/stride outputs
    try:
      plan_split(block, n, window=window[dim], stride=stride, dilation=dilation[dim],
                 padding=(lo, right), axis_name=axis, dim_name=name)
    except ValueError as e:
      unsplit[dim] = f"cannot split {name} = {length} into equal blocks ({e})"
      continue
    plans[dim] = (padded, (lo, right), out)
  return plans, unsplit
