"""The BatchNorm statistics core shared by SyncBN (`jmem.parallel.sync_bn`) and InPlace-ABN
(`jmem.ops.inplace_abn`), and by their Pallas kernels: exact per-device moments, their
one-all-gather merge, the one-all-reduce backward, masks and axis checks, and the Flax glue
(running statistics, a BatchNorm-like call on a module's own variables).

The method (Chan et al.'s merge of per-device counts, means and centred sums of squares) is
described in `jmem.parallel.sync_bn`; this module holds the code both techniques use, so
neither imports the other.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Sequence
from typing import NamedTuple

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
from jax import lax

from jmem import _backends
from jmem import _warn
from jmem import _context as context
from jmem._axes import AxisName, barrier, check_axis_name, varying_axes  # pylint: disable=unused-import
from jmem._axes import axes_tuple as _axes_tuple


class BatchStats(NamedTuple):
  """Per-channel statistics of a (global) batch, float32.

  Attributes:
    mean: ``float32[C]``.
    var: ``float32[C]`` biased (population) variance.
    count: ``float32[C]`` number of valid elements per channel over all devices.
  """

  mean: jax.Array
  var: jax.Array
  count: jax.Array


class Moments(NamedTuple):
  """Per-channel moments of a set of values that merge exactly (each ``float32[C]``).

  The mean is carried as two numbers, ``m0 + corr``: ``m0`` is a float32 close to it and
  ``corr`` the small remainder, so that ``x - m0`` is exact for ``x`` near the mean and the
  mean keeps more bits than one float32 (at 1e6 a float32 is good to 0.06 only).

  Attributes:
    count: number of values.
    m0: a float32 close to the mean (0 when ``count`` is 0).
    corr: the mean minus ``m0``.
    m2: centred sum of squares ``Σ(x - mean)²``.
  """

  count: jax.Array
  m0: jax.Array
  corr: jax.Array
  m2: jax.Array

  def stats(self) -> BatchStats:
    """`BatchStats`; a channel with no value gets mean 0, variance 1, count 0 (and is
    normalised to 0, see `inverse_std`)."""
    seen = self.count > 0
    var = jnp.where(seen, self.m2 / jnp.maximum(self.count, 1.0), 1.0)
    return BatchStats(jnp.where(seen, self.m0 + self.corr, 0.0), var, self.count)

  def inverse_std(self, stats: "BatchStats", epsilon: float) -> jax.Array:
    """``1 / sqrt(var + ε)``, and 0 for a channel with no value: its every entry is
    padding, normalised to 0 (``y = β``) rather than amplified by ``1 / sqrt(ε)``."""
    del self
    return jnp.where(stats.count > 0, lax.rsqrt(stats.var + epsilon), 0.0)

  def centre(self, xf: jax.Array) -> jax.Array:
    """``x - mean`` as ``(x - m0) - corr``: exact to float32 rounding of the result."""
    return (xf - self.m0) - self.corr


class LocalStatisticsWarning(UserWarning):
  """Batch statistics are per shard along a mesh axis that the input is split over.

  Issued when, under ``jax.shard_map`` with its varying types (``check_vma=True``, the
  default), a batch norm's input varies over a manual mesh axis that its ``axis_name``
  leaves out. That may be deliberate (local BN per data shard); silence it with
  ``warnings.filterwarnings("ignore", category=LocalStatisticsWarning)``.
  """


def _unchecked_manual_axes() -> frozenset:
  """The manual mesh axes (of size > 1) of an enclosing ``jax.shard_map`` traced with
  ``check_vma=False``, where JAX's types do not say which values vary over them; empty
  elsewhere (no shard_map, or one whose types say it)."""
  try:
    from jax._src import config as jax_config  # pylint: disable=g-import-not-at-top
    if jax_config._check_vma.value:  # pylint: disable=protected-access
      return frozenset()
    mesh = jax.sharding.get_abstract_mesh()
    return frozenset(a for a in getattr(mesh, "manual_axes", ()) if mesh.shape[a] > 1)
  except Exception:  # pylint: disable=broad-except  (a JAX without these internals)
    return frozenset()


def warn_if_unsynchronised(x, axis_name: AxisName, op: str) -> None:
  """Warns (`LocalStatisticsWarning`) if ``x`` varies over manual axes ``axis_name`` omits.

  Under ``shard_map`` with its varying types (``check_vma=True``) what they show is seen;
  under ``shard_map(check_vma=False)`` nothing says whether ``x`` is split over a manual
  axis, so every manual axis (of size > 1) that ``axis_name`` leaves out is warned about.
  Under ``pmap`` or ``vmap`` nothing is known and nothing is said.
  """
  named = set(_axes_tuple(axis_name))
  unchecked = _unchecked_manual_axes() - named
  if unchecked and not varying_axes(x):
    names = sorted(unchecked)
    suggest = names[0] if len(names) == 1 else tuple(names)
    _warn.warn(
        f"{op}: inside a shard_map traced with check_vma=False, over the mesh axes "
        f"{names} that axis_name={axis_name!r} leaves out: if the batch is split over "
        "them, the statistics are each shard's, not the whole batch's (JAX's types do not "
        f"say whether it is, with check_vma off). Pass axis_name={suggest!r} to synchronise "
        "over them; if per-shard (local) batch norm is intended, silence this "
        "with warnings.filterwarnings('ignore', category=jmem.parallel.sync_bn."
        "LocalStatisticsWarning).", LocalStatisticsWarning)
    return
  left_out = varying_axes(x) - named
  if left_out:
    every = tuple(sorted(varying_axes(x)))
    _warn.warn(
        f"{op}: the input varies over the mesh axes {sorted(left_out)} of the enclosing "
        f"shard_map, but axis_name={axis_name!r} leaves them out, so the statistics are "
        f"those of each shard along them, not of the whole batch. Pass "
        f"axis_name={every[0] if len(every) == 1 else every!r} to synchronise over every "
        "axis the batch is split over; if per-shard (local) batch norm is intended, silence "
        "this with warnings.filterwarnings('ignore', category=jmem.parallel.sync_bn."
        "LocalStatisticsWarning).", LocalStatisticsWarning)


def check_floating(x, op: str) -> None:
  """Raises TypeError unless ``x`` has a floating-point dtype.

  A batch norm of integers would be computed in float32 and rounded back to the input's
  integer dtype: a silently truncated result.
  """
  dtype = x.dtype if hasattr(x, "dtype") else jnp.result_type(x)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(
        f"{op} needs a floating-point input, got dtype {dtype}: the normalised output would "
        f"be rounded back to {dtype}. Cast the input first, e.g. x.astype(jnp.float32).")


def _groups(axis_index_groups):
  if axis_index_groups is None:
    return None
  return tuple(tuple(int(i) for i in g) for g in axis_index_groups)


def _psum(x, axis_name, axis_index_groups):
  if axis_name is None:
    return x
  return lax.psum(x, axis_name, axis_index_groups=axis_index_groups)


def _all_gather(x, axis_name, axis_index_groups):
  """``x`` of every device of the axis (or of this device's group), stacked: ``[G, *x.shape]``.

  Under ``jax.shard_map`` with its varying types (``check_vma``) and without groups, the
  result is typed invariant, as a ``psum``'s is, so what is computed from it may leave the
  map with ``out_specs=P()`` (with groups it does differ between groups: varying).
  Elsewhere (``pmap``, ``check_vma=False``, ``vmap``) a plain all-gather, whose transpose (a
  reduce-scatter) is the right one there. JAX's batched all-gather takes one name at a
  time, so ``vmap`` over several names gathers name by name (no collective is emitted).
  """
  names = _axes_tuple(axis_name)
  manual = set(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()))
  if set(names) <= manual:
    if axis_index_groups is None and varying_axes(x):
      return lax.all_gather(x, names, to="invarying")
    return lax.all_gather(x, names, axis_index_groups=axis_index_groups)
  if len(names) == 1:
    return lax.all_gather(x, names, axis_index_groups=axis_index_groups)
  for name in reversed(names):
    x = lax.all_gather(x, name, axis_index_groups=axis_index_groups)
  return x.reshape((-1,) + x.shape[len(names):])


def check_mask(x, mask):
  """Validates a boolean mask (same rank as ``x``, broadcastable) and returns it as an array.

  Raises:
    TypeError: if ``mask`` is not boolean (a float mask of 0.5 or NaN has no clear meaning).
    ValueError: if its shape does not broadcast to ``x``'s with the same rank.
  """
  if mask is None:
    return None
  mask = jnp.asarray(mask)
  if mask.dtype != jnp.bool_:
    raise TypeError(
        f"mask must be a boolean array (True = valid), got dtype {mask.dtype}: pass a boolean "
        "mask, e.g. `weights > 0`; a non-boolean mask is ambiguous (is 0.5, or NaN, valid?).")
  if mask.ndim != x.ndim or any(m not in (1, d) for m, d in zip(mask.shape, x.shape)):
    raise ValueError(
        f"mask of shape {mask.shape} does not broadcast to x of shape {x.shape}: give it "
        f"the same rank, each dim either 1 or x's (e.g. {(x.shape[0],) + (1,) * (x.ndim - 1)}"
        " to mask whole samples).")
  return mask


def pin(v: jax.Array) -> jax.Array:
  """``v`` (float32) with its last mantissa bit cleared: a value XLA cannot recompute.

  A pivot such as ``m0 = Σx / n`` is used twice: stored (the mean is ``m0 + corr``) and
  subtracted from the data (``x - m0``). XLA rewrites the division into ``Σx * (1/n)`` and
  may contract ``x - Σx * (1/n)`` into one fused multiply-add, which subtracts the exact
  product instead of the stored, rounded ``m0``: half a unit in the last place of the mean
  (0.03 at 1e6) goes missing between the two uses, and Chan's between-device term turns it
  into a variance error of up to ~0.4 for data of std 0.01. Passing the pivot through an
  integer operation that cannot be simplified away makes both uses read the same rounded
  float; the cleared bit moves it by at most one more unit, which the corrected two-pass
  sums absorb. (``lax.optimization_barrier`` is not kept by every jit path.)
  """
  bits = lax.bitcast_convert_type(v.astype(jnp.float32), jnp.uint32)
  return lax.bitcast_convert_type(bits & jnp.uint32(0xFFFFFFFE), jnp.float32)


def _local_moments(xf, mask, reduce_axes) -> Moments:
  """Valid count, mean and centred sum of squares of one device (float32).

  Corrected two-pass: a first mean ``m0`` (off by the float32 rounding of a long sum), then
  ``d = x - m0`` (exact-ish, x and m0 being close), ``mean = m0 + Σd/n`` and
  ``M2 = Σd² - (Σd)²/n``, which removes the first pass's error from the variance. Padding
  (``mask`` False) is selected away, never multiplied by 0, so a NaN or Inf there is inert.
  """
  if mask is None:
    n = jnp.full(xf.shape[-1:], float(xf.size // xf.shape[-1]), jnp.float32)
    m0 = pin(jnp.mean(xf, axis=reduce_axes))
    d = xf - m0
  else:
    mb = jnp.broadcast_to(mask, xf.shape)
    n = jnp.sum(mb, axis=reduce_axes, dtype=jnp.float32)
    m0 = pin(jnp.sum(jnp.where(mb, xf, 0.0), axis=reduce_axes) / jnp.maximum(n, 1.0))
    d = jnp.where(mb, xf - m0, 0.0)
  s1, s2 = jnp.sum(d, axis=reduce_axes), jnp.sum(d * d, axis=reduce_axes)
  safe = jnp.maximum(n, 1.0)
  # The mean as m0 + a small correction: a float32 near 1e4 is only good to 1e-3, too
  # coarse for the between-device term and for centring data of std 1e-2.
  return Moments(n, m0, s1 / safe, jnp.maximum(s2 - s1 * s1 / safe, 0.0))


def merge_moments(parts: Moments, axis: int = 0) -> Moments:
  """Exact `Moments` of the union of several sets stacked along ``axis`` (Chan et al.).

  With ``K`` the count-weighted mean of the sets' ``m0`` (a float32 within a few ulps of
  the mean, so ``m0_i - K`` is exact) and ``d_i = (m0_i - K) + corr_i`` each set's mean
  minus ``K``: ``mean = K + Σn_i d_i / N`` and
  ``M2 = ΣM2_i + Σn_i (d_i - Σn_j d_j / N)²``. Nothing cancels whatever the data's offset;
  empty sets contribute nothing and nothing divides by zero (an empty union gives zeros).
  """
  n = parts.count
  total = jnp.sum(n, axis=axis)
  safe = jnp.maximum(total, 1.0)
  has = n > 0
  pivot = pin(jnp.sum(jnp.where(has, n * parts.m0, 0.0), axis=axis) / safe)   # see `pin`
  d = jnp.where(has, (parts.m0 - jnp.expand_dims(pivot, axis)) + parts.corr, 0.0)
  corr = jnp.sum(n * d, axis=axis) / safe
  between = jnp.where(has, n * jnp.square(d - jnp.expand_dims(corr, axis)), 0.0)
  m2 = jnp.sum(jnp.where(has, parts.m2, 0.0), axis=axis) + jnp.sum(between, axis=axis)
  return Moments(total, pivot, corr, m2)


def gather_moments(local: Moments, *, axis_name: AxisName = None,
                   axis_index_groups: Sequence[Sequence[int]] | None = None) -> Moments:
  """Moments of the union over the devices of ``axis_name``: ONE all-gather, then a merge.

  Each device contributes ``4 C`` float32 numbers (``4 C G`` arrive on each of ``G``
  devices) and every device runs the same exact `merge_moments`, so the result is
  identical on all of them and exact in float32 whatever the data's offset.

  Args:
    local: this device's `Moments`.
    axis_name: named axis (or tuple of names) to gather over; ``None``: ``local`` itself.
    axis_index_groups: optional groups of axis indices to gather within.
  """
  if axis_name is None:
    return local
  gathered = _all_gather(jnp.stack(local), axis_name, _groups(axis_index_groups))   # [G, 4, C]
  return merge_moments(Moments(*jnp.moveaxis(gathered, 1, 0)), axis=0)


def batch_moments(x: jax.Array, *, axis_name: AxisName = None,
                  axis_index_groups: Sequence[Sequence[int]] | None = None,
                  mask: jax.Array | None = None, implementation: str = "xla",
                  interpret: bool | None = None) -> Moments:
  """`Moments` of the valid entries of ``x`` (``[..., C]``) over ``axis_name``, exact.

  ``implementation`` names a registered `BN_MOMENTS` backend (resolved already: the
  caller's `jmem._backends.choose`); ``interpret`` is the Pallas interpreter switch. Only
  the XLA reference is differentiable: the kernels run inside a custom VJP's forward.
  """
  mask = check_mask(x, mask)
  check_axis_name(axis_name)
  local = _backends.get(_backends.BN_MOMENTS, implementation)(x, mask=mask,
                                                              interpret=interpret)
  return gather_moments(local, axis_name=axis_name, axis_index_groups=axis_index_groups)


# BN_MOMENTS (`jmem._backends`): ``(x [..., C], *, mask, interpret) -> Moments`` of this
# device, reduced over every axis but the last, in float32.

def _moments_xla(x, *, mask=None, interpret=None):
  del interpret
  return _local_moments(x.astype(jnp.float32), mask, tuple(range(x.ndim - 1)))


def linen_has_bn_variables(module) -> bool:
  """Whether a linen module keeps BatchNorm statistics (``batch_stats`` ``mean``/``var``)."""
  try:
    return (module.has_variable("batch_stats", "mean") and
            module.has_variable("batch_stats", "var"))
  except Exception:  # pylint: disable=broad-except  (an unbound or odd module)
    return False


def nnx_has_bn_stats(module) -> bool:
  """Whether an NNX module keeps BatchNorm statistics (``mean``/``var`` BatchStats)."""
  return (isinstance(getattr(module, "mean", None), nnx.BatchStat) and
          isinstance(getattr(module, "var", None), nnx.BatchStat))


def kernels_take_no_mask(*, masked):
  return "the Pallas kernels take no mask (this batch is masked)" if masked else None


_backends.register(_backends.BN_MOMENTS, "xla", _moments_xla)
# Its "pallas" backend is registered by `jmem.parallel.sync_bn`, above this module and the
# kernel module (`pallas_kernels.inplace_abn`, which builds on this one's Moments).


def batch_stats(x: jax.Array, *, axis_name: AxisName = None,
                axis_index_groups: Sequence[Sequence[int]] | None = None,
                mask: jax.Array | None = None, shift: jax.Array | None = None) -> BatchStats:
  """Exact per-channel statistics of the valid entries of ``x`` over ``axis_name``.

  Args:
    x: ``[..., C]`` array, channels last; reduced over all other axes (and devices).
    axis_name: named axis (or tuple of names) of an enclosing shard_map / pmap / vmap to
      reduce across; ``None`` for local statistics.
    axis_index_groups: optional groups of axis indices to reduce within.
    mask: optional boolean array broadcastable to ``x`` (same rank): True = valid.
    shift: ignored; accepted for compatibility (it was the pivot of an earlier one-pass
      merge, whose precision depended on it; the merge is now exact without one).

  Returns:
    `BatchStats` in float32, identical on every device of a group (a channel with no valid
    entry: mean 0, variance 1, count 0). Gradients flow through mean and var (plain JAX;
    `sync_batch_norm` has the one-collective VJP).
  """
  del shift
  check_axis_name(axis_name)
  warn_if_unsynchronised(x, axis_name, "batch_stats")
  return batch_moments(x, axis_name=axis_name, axis_index_groups=axis_index_groups,
                       mask=mask).stats()


def combine_moments(n, m0, corr, m2, *, axis_name: AxisName = None,
                    axis_index_groups: Sequence[Sequence[int]] | None = None,
                    shift: jax.Array | None = None) -> BatchStats:
  """Global `BatchStats` from each device's local moments (`gather_moments`, then stats).

  Args:
    n: ``float32[C]`` local valid count.
    m0: ``float32[C]`` a first local mean (any value close to the mean).
    corr: ``float32[C]`` correction: the local mean is ``m0 + corr``.
    m2: ``float32[C]`` local centred sum of squares.
    axis_name, axis_index_groups: as in `batch_stats`.
    shift: ignored (compatibility).
  """
  del shift
  return gather_moments(Moments(n, m0, corr, m2), axis_name=axis_name,
                        axis_index_groups=axis_index_groups).stats()


def update_running_stats(running_mean, running_var, stats: BatchStats, *, momentum: float,
                         unbiased: bool = False):
  """Flax convention: ``new = momentum * running + (1 - momentum) * batch``.

  ``momentum`` is the decay of the old value: PyTorch's ``momentum=m`` (weight of the
  batch) is ``1 - m`` here (its default 0.1 is 0.9). ``unbiased=True`` stores the sample
  variance ``var * N / (N - 1)`` (PyTorch's choice), ``N`` being ``stats.count``, the
  global number of valid values per channel; the default stores the biased variance
  (Flax's choice). With ``N = 1`` the stored variance is 0 either way (``N / (N - 1)`` is
  undefined; PyTorch refuses such a batch). Channels with no valid element in the batch
  keep their running values.
  """
  var = stats.var
  if unbiased:
    var = var * stats.count / jnp.maximum(stats.count - 1.0, 1.0)
  seen = stats.count > 0
  new_mean = momentum * running_mean + (1.0 - momentum) * stats.mean
  new_var = momentum * running_var + (1.0 - momentum) * var
  return (jnp.where(seen, new_mean, running_mean).astype(running_mean.dtype),
          jnp.where(seen, new_var, running_var).astype(running_var.dtype))


# ----------------------------------------------------------------- one-collective backward

def tie_to_cotangent(residuals, cotangent):
  """Makes the backward's use of ``residuals`` wait for ``cotangent``.

  XLA otherwise hoists the parts of a backward pass that depend only on residuals (an
  activation's inverse, a per-channel factor broadcast to full size, a transposed copy)
  into the forward pass, where they stay alive until the backward: measured on a chain of
  10 InPlace-ABN + conv layers (64x32x32x16) on XLA:CPU, 164 MiB of temp without the
  barrier, 84 MiB with it (plain BN + activation: 124 MiB). The barrier over both pins the
  work after the cotangent exists. Needs `jmem.jit` on CPU (whose default pipeline strips barriers).
  """
  return barrier((residuals, cotangent))


def bn_backward(dy, xhat, mask, gamma_invstd, count, *, axis_name, axis_index_groups,
                param_varying: bool):
  """Shared BN backward: ONE psum of ``[Σdy, Σdy·x̂]`` (float32).

  Args:
    dy: cotangent of the normalised-and-affine output ``γ x̂ + β`` (float32).
    xhat: normalised input (float32), recomputed or reconstructed by the caller.
    mask: boolean mask or None. Padding (False) takes no part in the statistics, so its
      ``dx`` is ``γ/σ dy``; where its ``dy`` is 0 it adds nothing to the sums even if its
      ``x̂`` is not finite.
    gamma_invstd: ``γ / sqrt(var + eps)`` per channel.
    count: global valid count per channel.
    param_varying: whether γ, β vary over ``axis_name`` (then their cotangents are the
      local sums, else the global ones).

  Returns:
    ``(dx float32, dγ-like Σdy·x̂, dβ-like Σdy)``.
  """
  reduce_axes = tuple(range(dy.ndim - 1))
  dyx = dy * xhat
  if mask is not None:
    # Padding whose output the loss ignores (dy = 0) adds exactly 0, even where its x (so
    # x̂) is NaN or Inf: selected, not multiplied.
    dyx = jnp.where(mask | (dy != 0), dyx, 0.0)
  local = jnp.stack([jnp.sum(dy, axis=reduce_axes), jnp.sum(dyx, axis=reduce_axes)])
  glob = _psum(local, axis_name, axis_index_groups)
  g_dy, g_dyx = glob[0], glob[1]
  inv_n = 1.0 / jnp.maximum(count, 1.0)
  corr = (g_dy + xhat * g_dyx) * inv_n
  if mask is not None:
    corr = jnp.where(mask, corr, 0.0)   # padding does not feed the statistics: dx = γ/σ dy
  dx = gamma_invstd * (dy - corr)
  sums = local if (axis_name is None or param_varying) else glob
  return dx, sums[1], sums[0]


def params_stay_local(axis_name, dy, scale) -> bool:
  """Whether cotangents of γ/β should stay per-device (vmap/pmap, or varying params)."""
  names = set(_axes_tuple(axis_name))
  if not names:
    return True
  dy_v = varying_axes(dy)
  if not names & dy_v:      # not under shard_map's varying-type system (vmap, old pmap)
    return True
  return bool(names & varying_axes(scale))


# ---------------------------------------------------------------------------- Flax modules

def _to_last(x, axis):
  return x if axis in (-1, x.ndim - 1) else jnp.moveaxis(x, axis, -1)


def _from_last(x, axis):
  return x if axis in (-1, x.ndim - 1) else jnp.moveaxis(x, -1, axis)


def normalize_with_state(x, *, axis, scale, bias, running_mean, running_var, use_running_average,
                         mask, train_fn, eval_fn, momentum, unbiased_running_var=False,
                         op: str = "batch norm"):
  """What a BatchNorm-like layer does, on plain arrays (shared by linen and NNX modules).

  Moves the feature ``axis`` last, normalises with ``train_fn(x, scale, bias, mask, shift)``
  (returning ``(y, stats)``) or ``eval_fn(x, scale, bias, mean, var)`` and returns
  ``(y, new_running_mean, new_running_var)`` (see `update_running_stats`). Raises TypeError
  for a non-floating ``x`` (named ``op`` in the message), in both modes. With no ``mask``,
  training takes the one of an active `jmem.batch_mask` (as `jmem.convert`'s sites do), so
  jmem's own BatchNorm modules skip the padded rows of a batch too.
  """
  check_floating(x, op)
  if mask is None and not use_running_average:
    mask = context.mask_for(x, context.active_mask(), op)
  if not isinstance(axis, int):
    raise ValueError(f"Only a single feature axis is supported, got axis={axis!r}.")
  xl = _to_last(x, axis)
  if use_running_average:
    return _from_last(eval_fn(xl, scale, bias, running_mean, running_var), axis), \
        running_mean, running_var
  ml = None if mask is None else _to_last(check_mask(x, mask), axis)
  y, stats = train_fn(xl, scale, bias, ml, running_mean)
  new_mean, new_var = update_running_stats(running_mean, running_var, stats, momentum=momentum,
                                           unbiased=unbiased_running_var)
  return _from_last(y, axis), new_mean, new_var


def _bn_eval_fn(epsilon):
  def fn(x, scale, bias, mean, var):
    y = (x.astype(jnp.float32) - mean) * lax.rsqrt(var + epsilon)
    if scale is not None:
      y = y * scale
    if bias is not None:
      y = y + bias
    return y.astype(x.dtype)
  return fn


@contextlib.contextmanager
def _quiet_local_statistics():
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", LocalStatisticsWarning)
    yield


def output_dtype(dtype, x, scale, bias):
  """The dtype of a Flax BatchNorm's output: its ``dtype``, else that of the input promoted
  with the scale and bias (a bfloat16 input with float32 parameters gives float32)."""
  if dtype is not None:
    return dtype
  if not jnp.issubdtype(x.dtype, jnp.floating):
    return x.dtype                            # refused by normalize_with_state
  return jnp.result_type(x, *(p for p in (scale, bias) if p is not None))


def promote_input(x, out_dtype):
  """``x`` in the wider of its dtype and the output's, as Flax normalises: a bfloat16 input
  with a float32 output is normalised in float32, not rounded to bfloat16 first."""
  if not jnp.issubdtype(x.dtype, jnp.floating):
    return x                                  # refused by normalize_with_state
  return x.astype(jnp.promote_types(x.dtype, out_dtype))


# flax.linen.BatchNorm's fields that a BatchNorm-like module may leave out (their defaults,
# as flax.linen.BatchNorm has them): use_running_average can come with the call instead.
LINEN_BN_OPTIONAL = {"use_running_average": None, "scale_init": nn.initializers.ones,
                     "bias_init": nn.initializers.zeros, "param_dtype": jnp.float32,
                     "dtype": None}


def linen_norm_call(module, x, use_running_average, mask, *, train_fn, eval_fn, use_scale,
                    use_bias, unbiased_running_var=False):
  """Body of a linen BatchNorm-like ``__call__`` (variables named as flax.linen.BatchNorm).

  While initialising, statistics are local (``train_fn`` is built so) and no
  `LocalStatisticsWarning` is issued: ``init`` may run inside a shard_map.
  """
  # A BatchNorm look-alike named in where= may lack the fields that only set defaults:
  # flax.linen.BatchNorm's defaults stand in (LINEN_BN_OPTIONAL).
  field = lambda name: getattr(module, name, LINEN_BN_OPTIONAL.get(name))
  use_ra = nn.merge_param("use_running_average", field("use_running_average"),
                          use_running_average)
  c = x.shape[module.axis]
  ra_mean = module.variable("batch_stats", "mean", lambda s: jnp.zeros(s, jnp.float32), (c,))
  ra_var = module.variable("batch_stats", "var", lambda s: jnp.ones(s, jnp.float32), (c,))
  scale = (module.param("scale", field("scale_init"), (c,), field("param_dtype"))
           if use_scale else None)
  bias = (module.param("bias", field("bias_init"), (c,), field("param_dtype"))
          if use_bias else None)
  out_dtype = output_dtype(field("dtype"), x, scale, bias)
  with _quiet_local_statistics() if module.is_initializing() else contextlib.nullcontext():
    y, new_mean, new_var = normalize_with_state(
        promote_input(x, out_dtype), axis=module.axis, scale=scale, bias=bias, running_mean=ra_mean.value,
        running_var=ra_var.value, use_running_average=use_ra, mask=mask, train_fn=train_fn,
        eval_fn=eval_fn, momentum=module.momentum, unbiased_running_var=unbiased_running_var,
        op=type(module).__name__)
  if not use_ra and not module.is_initializing():
    ra_mean.value, ra_var.value = new_mean, new_var
  return y.astype(out_dtype)
