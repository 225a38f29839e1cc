"""Synchronised BatchNorm, exact for masked, unbalanced, offset batches: one collective each way.

The statistics of a channel are those of the concatenation of every *valid* sample on every
device of the named axis, whatever each device holds, a device with no valid sample
included (it takes part in the collective with zeros; nothing divides by its zero count).

Forward: each device computes, per channel, its valid count ``n``, its mean as two float32s
``m0 + corr`` and centred sum of squares ``M2`` (two local passes: stable), then ONE
all-gather of these ``4 C`` numbers per device (`gather_moments`); every device merges them
the same way with Chan et al.'s parallel formula (`merge_moments`): around a pivot ``K``
within a few ulps of the mean, ``mean = K + Σn_i d_i / N`` with ``d_i = (m0_i - K) + corr_i``
and ``M2 = ΣM2_i + Σn_i (d_i - Σn_j d_j / N)²``, where nothing cancels. The variance is
exact to float32 rounding whatever the data's offset (mean 1e6, std 0.1 included) and needs
no shift; inputs are then centred as ``(x - m0) - corr``, so the outputs are centred to
float32 rounding too. Inputs of any float dtype are reduced in float32.

Backward (custom VJP): ONE ``psum`` of ``[Σdy, Σdy·x̂]``; then
``dx = γ/σ (dy - mask (Σdy + x̂ Σdy·x̂) / N)``, ``dγ = Σdy·x̂``, ``dβ = Σdy``.

Cost of exactness: the forward collective carries ``4 C`` floats per device, so ``4 C G``
arrive on each of ``G`` devices (an all-reduce of moments would carry ``4 C``, but merges
them around a shared shift and loses the variance when ``|mean - shift| ≫ std``).
PyTorch's SyncBatchNorm also all-gathers per-device statistics.

Contrast (see references): Flax's ``BatchNorm(axis_name, mask)`` averages per-device means
(wrong for unequal counts, NaN for a device with none); MXNet averages E[x], E[x^2]
(unweighted, and E[x^2] - E[x]^2 cancels).

References:
  Ioffe & Szegedy, Batch Normalization, https://arxiv.org/abs/1502.03167
  Chan, Golub & LeVeque, Updating formulae and a pairwise algorithm for computing sample
  variances (1979); Algorithms for computing the sample variance (1983).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

__all__ = [
    "BatchStats", "Moments", "batch_moments", "batch_stats", "combine_moments", "gather_moments",
    "merge_moments", "sync_batch_norm", "sync_batch_norm_reference", "update_running_stats",
    "check_axis_name", "check_floating", "check_mask", "params_stay_local", "varying_axes",
    "warn_if_unsynchronised", "LocalStatisticsWarning",
]

AxisName = str | tuple[str, ...] | None


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


def _axes_tuple(axis_name: AxisName) -> tuple[str, ...]:
  if axis_name is None:
    return ()
  return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def check_axis_name(axis_name: AxisName) -> None:
  """Raises a clear error when ``axis_name`` is not bound by an enclosing transform."""
  for name in _axes_tuple(axis_name):
    try:
      lax.axis_size(name)
    except (NameError, ValueError, KeyError) as e:
      raise NameError(
          f"axis_name {name!r} is not bound: call this inside jax.shard_map, jax.pmap or "
          f"jax.vmap with axis_name={name!r} (or pass axis_name=None for local batch norm)."
      ) from e


class LocalStatisticsWarning(UserWarning):
  """Batch statistics are per shard along a mesh axis that the input is split over.

  Issued when, under ``jax.shard_map`` with its varying types (``check_vma=True``, the
  default), a batch norm's input varies over a manual mesh axis that its ``axis_name``
  leaves out. That may be deliberate (local BN per data shard); silence it with
  ``warnings.filterwarnings("ignore", category=LocalStatisticsWarning)``.
  """


def warn_if_unsynchronised(x, axis_name: AxisName, op: str, *, stacklevel: int = 3) -> None:
  """Warns (`LocalStatisticsWarning`) if ``x`` varies over manual axes ``axis_name`` omits.

  Only what JAX's types show is seen: under ``shard_map`` with ``check_vma=False``, under
  ``pmap`` or ``vmap`` nothing is known and nothing is said.
  """
  left_out = varying_axes(x) - set(_axes_tuple(axis_name))
  if left_out:
    every = tuple(sorted(varying_axes(x)))
    warnings.warn(
        f"{op}: the input varies over the mesh axes {sorted(left_out)} of the enclosing "
        f"shard_map, but axis_name={axis_name!r} leaves them out, so the statistics are "
        f"those of each shard along them, not of the whole batch. Pass "
        f"axis_name={every[0] if len(every) == 1 else every!r} to synchronise over every "
        "axis the batch is split over; if per-shard (local) batch norm is intended, silence "
        "this with warnings.filterwarnings('ignore', category=jmem.parallel.sync_bn."
        "LocalStatisticsWarning).", LocalStatisticsWarning, stacklevel=stacklevel)


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


def varying_axes(x) -> frozenset:
  """The manual (shard_map) axes over which ``x`` varies; empty outside shard_map."""
  aval = jax.typeof(x)
  mat = getattr(aval, "manual_axis_type", None)
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", ()))


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
                  mask: jax.Array | None = None) -> Moments:
  """`Moments` of the valid entries of ``x`` (``[..., C]``) over ``axis_name``, exact."""
  mask = check_mask(x, mask)
  check_axis_name(axis_name)
  local = _local_moments(x.astype(jnp.float32), mask, tuple(range(x.ndim - 1)))
  return gather_moments(local, axis_name=axis_name, axis_index_groups=axis_index_groups)


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
  return lax.optimization_barrier((residuals, cotangent))


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _sync_bn(x, scale, bias, mask, shift, axis_name, axis_index_groups, epsilon):
  return _sync_bn_fwd(x, scale, bias, mask, shift, axis_name, axis_index_groups, epsilon)[0]


def _sync_bn_fwd(x, scale, bias, mask, shift, axis_name, axis_index_groups, epsilon):
  del shift
  moments = batch_moments(x, axis_name=axis_name, axis_index_groups=axis_index_groups,
                          mask=mask)
  stats = moments.stats()
  invstd = moments.inverse_std(stats, epsilon)
  y = moments.centre(x.astype(jnp.float32)) * (invstd * scale) + bias
  return (y.astype(x.dtype), stats), (x, scale, mask, moments.m0, moments.corr, invstd,
                                      stats.count)


def _sync_bn_bwd(axis_name, axis_index_groups, epsilon, res, cts):
  del epsilon
  param_varying = params_stay_local(axis_name, cts[0], res[1])
  res, cts = tie_to_cotangent(res, cts)
  x, scale, mask, m0, corr, invstd, count = res
  dy = cts[0].astype(jnp.float32)
  xhat = ((x.astype(jnp.float32) - m0) - corr) * invstd
  dx, dscale, dbias = bn_backward(
      dy, xhat, mask, scale * invstd, count, axis_name=axis_name,
      axis_index_groups=axis_index_groups, param_varying=param_varying)
  return (dx.astype(x.dtype), dscale.astype(scale.dtype), dbias.astype(scale.dtype), None, None)


_sync_bn.defvjp(_sync_bn_fwd, _sync_bn_bwd)


def _prepare(x, scale, bias, mask, shift):
  c = x.shape[-1]
  scale = jnp.ones((c,), jnp.float32) if scale is None else jnp.asarray(scale, jnp.float32)
  bias = jnp.zeros((c,), jnp.float32) if bias is None else jnp.asarray(bias, jnp.float32)
  if scale.shape != (c,) or bias.shape != (c,):
    raise ValueError(f"scale and bias must have shape ({c},) for x of shape {x.shape}, got "
                     f"{scale.shape} and {bias.shape}.")
  shift = jnp.zeros((c,), jnp.float32) if shift is None else jnp.asarray(shift, jnp.float32)
  return scale, bias, check_mask(x, mask), shift


def sync_batch_norm(x: jax.Array, scale: jax.Array | None = None, bias: jax.Array | None = None,
                    *, axis_name: AxisName = None,
                    axis_index_groups: Sequence[Sequence[int]] | None = None,
                    mask: jax.Array | None = None, shift: jax.Array | None = None,
                    epsilon: float = 1e-5) -> tuple[jax.Array, BatchStats]:
  """Training-mode batch norm over ``axis_name``: one all-gather forward, one psum backward.

  Args:
    x: ``[..., C]`` input (float32, bfloat16 or float16; reductions run in float32).
      Integer and boolean inputs raise TypeError (the output would be rounded to them).
    scale: ``float[C]`` γ (default ones).
    bias: ``float[C]`` β (default zeros).
    axis_name: named axis (or tuple) of an enclosing shard_map / pmap / vmap; ``None`` for
      local batch norm (also right under SPMD jit on sharded arrays, where XLA inserts the
      reduction). A name no enclosing transform binds raises NameError. Under
      ``jax.shard_map`` (``check_vma=True``) an ``x`` that varies over a mesh axis this
      leaves out gives per-shard statistics along it and a `LocalStatisticsWarning`.
    axis_index_groups: optional groups within the axis (under ``jax.shard_map`` and
      ``jax.pmap``; JAX's ``vmap`` collectives take no groups).
    mask: optional boolean array (other dtypes raise TypeError), broadcastable to ``x``
      with the same rank; True = valid. Statistics use valid entries only, selected with
      ``where``: a NaN or Inf in padding changes neither the statistics nor any valid
      output or gradient. Every entry is normalised (padding outputs follow their inputs).
      A channel with no valid entry on any device (all padding) is normalised to zeros,
      ``y = β`` (gradient 0), its ``stats`` are mean 0, variance 1, count 0, and the
      modules keep its running statistics.
    shift: ignored; accepted for compatibility (it was the pivot of an earlier one-pass
      merge whose precision depended on it; the statistics are now exact without one).
    epsilon: added to the variance; must be > 0.

  Returns:
    ``(y, stats)``: ``y`` like ``x``; ``stats`` (`BatchStats`, no gradient, float32, exact
    to float32 rounding) for the running averages.

  Raises:
    TypeError: ``x`` not floating point; ``mask`` not boolean.
    NameError: ``axis_name`` not bound.
    ValueError: ``epsilon <= 0``; ``scale``/``bias``/``mask`` of the wrong shape.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> y, stats = sync_batch_norm(jnp.arange(8.0).reshape(4, 2))
    >>> stats.mean
    Array([3., 4.], dtype=float32)
  """
  if not epsilon > 0:
    raise ValueError(f"epsilon must be > 0, got {epsilon}.")
  check_floating(x, "sync_batch_norm")
  check_axis_name(axis_name)
  warn_if_unsynchronised(x, axis_name, "sync_batch_norm")
  scale, bias, mask, shift = _prepare(x, scale, bias, mask, shift)
  y, stats = _sync_bn(x, scale, bias, mask, shift, axis_name, _groups(axis_index_groups),
                      float(epsilon))
  return y, jax.tree.map(lax.stop_gradient, stats)


def sync_batch_norm_reference(x, scale=None, bias=None, *, axis_name: AxisName = None,
                              axis_index_groups=None, mask=None, shift=None,
                              epsilon: float = 1e-5):
  """`sync_batch_norm` by plain autodiff (the oracle of the tests)."""
  check_floating(x, "sync_batch_norm_reference")
  check_axis_name(axis_name)
  warn_if_unsynchronised(x, axis_name, "sync_batch_norm_reference")
  scale, bias, mask, _ = _prepare(x, scale, bias, mask, shift)
  moments = batch_moments(x, axis_name=axis_name, axis_index_groups=axis_index_groups, mask=mask)
  stats = moments.stats()
  y = moments.centre(x.astype(jnp.float32)) * moments.inverse_std(stats, epsilon) * scale + bias
  return y.astype(x.dtype), jax.tree.map(lax.stop_gradient, stats)


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
  for a non-floating ``x`` (named ``op`` in the message), in both modes.
  """
  check_floating(x, op)
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


def _sync_train_fn(axis_name, axis_index_groups, epsilon):
  def fn(x, scale, bias, mask, shift):
    return sync_batch_norm(x, scale, bias, axis_name=axis_name,
                           axis_index_groups=axis_index_groups, mask=mask, shift=shift,
                           epsilon=epsilon)
  return fn


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


def linen_norm_call(module, x, use_running_average, mask, *, train_fn, eval_fn, use_scale,
                    use_bias, unbiased_running_var=False):
  """Body of a linen BatchNorm-like ``__call__`` (variables named as flax.linen.BatchNorm).

  While initialising, statistics are local (``train_fn`` is built so) and no
  `LocalStatisticsWarning` is issued: ``init`` may run inside a shard_map.
  """
  use_ra = nn.merge_param("use_running_average", module.use_running_average,
                          use_running_average)
  c = x.shape[module.axis]
  ra_mean = module.variable("batch_stats", "mean", lambda s: jnp.zeros(s, jnp.float32), (c,))
  ra_var = module.variable("batch_stats", "var", lambda s: jnp.ones(s, jnp.float32), (c,))
  scale = (module.param("scale", module.scale_init, (c,), module.param_dtype)
           if use_scale else None)
  bias = module.param("bias", module.bias_init, (c,), module.param_dtype) if use_bias else None
  with _quiet_local_statistics() if module.is_initializing() else contextlib.nullcontext():
    y, new_mean, new_var = normalize_with_state(
        x, axis=module.axis, scale=scale, bias=bias, running_mean=ra_mean.value,
        running_var=ra_var.value, use_running_average=use_ra, mask=mask, train_fn=train_fn,
        eval_fn=eval_fn, momentum=module.momentum, unbiased_running_var=unbiased_running_var,
        op=type(module).__name__)
  if not use_ra and not module.is_initializing():
    ra_mean.value, ra_var.value = new_mean, new_var
  dtype = module.dtype or x.dtype
  return y.astype(dtype)


class SyncBatchNorm(nn.Module):
  """Drop-in for `flax.linen.BatchNorm`, exact for masked, unbalanced batches across devices.

  Same fields, same variable names (``params/scale``, ``params/bias``,
  ``batch_stats/mean``, ``batch_stats/var``), so checkpoints are interchangeable. One
  all-gather forward and one all-reduce backward when ``axis_name`` is set; none in eval
  mode. ``use_fast_variance`` and ``force_float32_reductions`` are accepted for
  compatibility: reductions are always float32 and always the exact two-pass form, whatever
  the running mean (see `sync_batch_norm`). ``mask`` (call argument) must be boolean; a
  channel with no valid entry in the batch is normalised to 0 (output = bias) and keeps
  its running statistics. Inputs must be floating point (TypeError otherwise).

  Conventions (see `update_running_stats`), ``N`` the global number of valid values of a
  channel in the batch (all devices of ``axis_name``):

  * ``momentum`` is Flax's decay, ``running = momentum * running + (1 - momentum) * batch``;
    PyTorch's ``momentum=m`` is ``1 - m`` here (its default 0.1 is 0.9; Flax's is 0.99).
  * The batch is normalised with its biased variance (as in both frameworks). The running
    variance is the biased one (Flax's convention) unless ``unbiased_running_var=True``,
    which stores ``var * N / (N - 1)`` (PyTorch's): set it for statistics that go to or
    come from PyTorch. Eval mode normalises with the stored variance as it is.

  Attributes:
    unbiased_running_var: store the unbiased (PyTorch) running variance instead of the
      biased (Flax) one.
    Other fields: as `flax.linen.BatchNorm`'s.
  """

  use_running_average: bool | None = None
  axis: int = -1
  momentum: float = 0.99
  epsilon: float = 1e-5
  dtype: Any = None
  param_dtype: Any = jnp.float32
  use_bias: bool = True
  use_scale: bool = True
  bias_init: Callable[..., Any] = nn.initializers.zeros
  scale_init: Callable[..., Any] = nn.initializers.ones
  axis_name: str | tuple[str, ...] | None = None
  axis_index_groups: Any = None
  use_fast_variance: bool = True
  force_float32_reductions: bool = True
  unbiased_running_var: bool = False

  @nn.compact
  def __call__(self, x, use_running_average: bool | None = None, *, mask=None):
    if not self.epsilon > 0:
      raise ValueError(f"epsilon must be > 0, got {self.epsilon}.")
    return linen_norm_call(
        self, x, use_running_average, mask,
        # Like flax: no collective while initialising (init may run outside the mapping).
        train_fn=_sync_train_fn(None if self.is_initializing() else self.axis_name,
                                self.axis_index_groups, self.epsilon),
        eval_fn=_bn_eval_fn(self.epsilon), use_scale=self.use_scale, use_bias=self.use_bias,
        unbiased_running_var=self.unbiased_running_var)


@contextlib.contextmanager
def sync_batch_norm_interceptor(axis_name: AxisName = None, axis_index_groups=None, *,
                                unbiased_running_var: bool = False):
  """Runs every `flax.linen.BatchNorm` inside the context as jmem's `SyncBatchNorm`.

  Subclasses that keep BatchNorm's ``__call__`` are handled too; one with its own
  ``__call__``, or a look-alike keeping ``batch_stats`` mean/var, raises ValueError (its
  statistics would silently stay local). `jmem.convert` with `jmem.SyncBN` is the general
  form (``where=``, NNX, masks).

  For existing models, without editing their code: the BatchNorm's own fields and
  variables are used; ``axis_name`` (if given) overrides the module's. Conventions as
  `SyncBatchNorm`'s: ``momentum`` is Flax's decay (PyTorch's 0.1 is 0.9); the running
  variance is biased (Flax's, and ``flax.linen.BatchNorm``'s own) unless
  ``unbiased_running_var=True`` (PyTorch's ``var * N / (N - 1)``, ``N`` the global valid
  count).

  Examples:
    >>> with sync_batch_norm_interceptor(axis_name="batch"):
    ...   y, updates = model.apply(variables, x, mutable=["batch_stats"])  # doctest: +SKIP
  """

  def interceptor(next_fun, args, kwargs, context):
    mod = context.module
    if context.method_name != "__call__":
      return next_fun(*args, **kwargs)
    if not isinstance(mod, nn.BatchNorm):
      y = next_fun(*args, **kwargs)
      if _keeps_bn_statistics(mod):
        raise ValueError(
            f"sync_batch_norm_interceptor: {type(mod).__qualname__} at "
            f"{'/'.join(mod.scope.path) or '<top>'!r} keeps BatchNorm statistics (batch_stats "
            "mean/var) but is not a flax.linen.BatchNorm, so its statistics would stay local. "
            "Use jmem.convert(model, jmem.SyncBN(axis_name=..., where=<its class or path>)) "
            "if it has BatchNorm's fields, or replace it by nn.BatchNorm.")
      return y
    if type(mod).__call__ is not nn.BatchNorm.__call__:
      raise ValueError(
          f"sync_batch_norm_interceptor: {type(mod).__qualname__} at "
          f"{'/'.join(mod.scope.path) or '<top>'!r} subclasses nn.BatchNorm with its own "
          "__call__, so jmem cannot know what it computes and would leave its statistics "
          "local. Use jmem.convert(model, jmem.SyncBN(axis_name=..., where=<its class>)) to "
          "replace its call, or give it the axis_name itself.")
    x, *rest = args
    use_ra = rest[0] if rest else kwargs.get("use_running_average")
    name = axis_name if axis_name is not None else mod.axis_name
    name = None if mod.is_initializing() else name
    groups = axis_index_groups if axis_index_groups is not None else mod.axis_index_groups
    return linen_norm_call(
        mod, x, use_ra, kwargs.get("mask"),
        train_fn=_sync_train_fn(name, groups, mod.epsilon), eval_fn=_bn_eval_fn(mod.epsilon),
        use_scale=mod.use_scale, use_bias=mod.use_bias,
        unbiased_running_var=unbiased_running_var)

  with nn.intercept_methods(interceptor):
    yield


def _keeps_bn_statistics(mod) -> bool:
  try:
    return mod.has_variable("batch_stats", "mean") and mod.has_variable("batch_stats", "var")
  except Exception:  # pylint: disable=broad-except
    return False


class NNXSyncBatchNorm(nnx.Module):
  """Drop-in for `flax.nnx.BatchNorm` (same arguments and variable names), exact when synced.

  Behaves as `SyncBatchNorm`: boolean ``mask`` only; floating-point inputs only; a channel
  with no valid entry is normalised to 0 (output = bias) and keeps its running
  statistics. Same conventions: ``momentum`` is Flax's decay (``running = momentum *
  running + (1 - momentum) * batch``; PyTorch's 0.1 is 0.9 here); the running variance is
  biased (Flax's) unless ``unbiased_running_var=True`` (PyTorch's ``var * N / (N - 1)``,
  ``N`` the global valid count per channel).
  """

  def __init__(self, num_features: int, *, use_running_average: bool = False, axis: int = -1,
               momentum: float = 0.99, epsilon: float = 1e-5, dtype=None,
               param_dtype=jnp.float32, use_bias: bool = True, use_scale: bool = True,
               bias_init=nnx.initializers.zeros_init(), scale_init=nnx.initializers.ones_init(),
               axis_name: AxisName = None, axis_index_groups=None,
               use_fast_variance: bool = True, unbiased_running_var: bool = False,
               rngs: nnx.Rngs | None = None):
    del use_fast_variance  # always the stable form
    if not epsilon > 0:
      raise ValueError(f"epsilon must be > 0, got {epsilon}.")
    key = rngs.params() if rngs is not None else jax.random.key(0)
    shape = (num_features,)
    self.mean = nnx.BatchStat(jnp.zeros(shape, jnp.float32))
    self.var = nnx.BatchStat(jnp.ones(shape, jnp.float32))
    self.scale = nnx.Param(scale_init(key, shape, param_dtype)) if use_scale else None
    self.bias = nnx.Param(bias_init(key, shape, param_dtype)) if use_bias else None
    self.num_features = num_features
    self.use_running_average = use_running_average
    self.axis, self.momentum, self.epsilon, self.dtype = axis, momentum, epsilon, dtype
    self.axis_name, self.axis_index_groups = axis_name, axis_index_groups
    self.unbiased_running_var = unbiased_running_var

  def __call__(self, x, use_running_average: bool | None = None, *, mask=None):
    use_ra = self.use_running_average if use_running_average is None else use_running_average
    y, mean, var = normalize_with_state(
        x, axis=self.axis, scale=None if self.scale is None else self.scale[...],
        bias=None if self.bias is None else self.bias[...], running_mean=self.mean[...],
        running_var=self.var[...], use_running_average=use_ra, mask=mask,
        train_fn=_sync_train_fn(self.axis_name, self.axis_index_groups, self.epsilon),
        eval_fn=_bn_eval_fn(self.epsilon), momentum=self.momentum,
        unbiased_running_var=self.unbiased_running_var, op=type(self).__name__)
    if not use_ra:
      self.mean[...], self.var[...] = mean, var
    return y.astype(self.dtype or x.dtype)


def replace_nnx_modules(model: nnx.Module, match: Callable[[Any], bool],
                        make: Callable[[Any], nnx.Module]) -> int:
  """Replaces, in place, every submodule ``m`` with ``match(m)`` by ``make(m)``.

  Looks in module attributes and in lists/tuples of modules. Returns how many were replaced.
  """
  count = 0
  for _, parent in list(nnx.iter_graph(model)):
    if not isinstance(parent, nnx.Module):
      continue
    for name, value in list(vars(parent).items()):
      if match(value):
        setattr(parent, name, make(value))
        count += 1
      elif isinstance(value, (list, nnx.List)):
        for i, item in enumerate(list(value)):
          if match(item):
            value[i] = make(item)
            count += 1
  return count


def swap_nnx_batch_norm(model: nnx.Module, *, axis_name: AxisName = None,
                        axis_index_groups=None, unbiased_running_var: bool = False) -> int:
  """Replaces every `flax.nnx.BatchNorm` in ``model`` by `NNXSyncBatchNorm`, keeping weights.

  ``unbiased_running_var`` is given to every new module (see `NNXSyncBatchNorm`; the
  default keeps ``flax.nnx.BatchNorm``'s biased running variance).
  """

  def make(bn):
    new = NNXSyncBatchNorm(
        bn.num_features, use_running_average=bn.use_running_average, axis=bn.axis,
        momentum=bn.momentum, epsilon=bn.epsilon, dtype=bn.dtype,
        use_bias=bn.bias is not None, use_scale=bn.scale is not None,
        axis_name=axis_name if axis_name is not None else bn.axis_name,
        axis_index_groups=axis_index_groups if axis_index_groups is not None
        else bn.axis_index_groups, unbiased_running_var=unbiased_running_var)
    new.mean, new.var = bn.mean, bn.var
    new.scale, new.bias = bn.scale, bn.bias
    return new

  return replace_nnx_modules(model, lambda m: type(m) is nnx.BatchNorm, make)  # pylint: disable=unidiomatic-typecheck
