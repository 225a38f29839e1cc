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
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jmem import _backends
from jmem._bn_core import (  # pylint: disable=unused-import
    AxisName,
    BatchStats,
    Moments,
    check_axis_name,
    LocalStatisticsWarning,
    warn_if_unsynchronised,
    check_floating,
    varying_axes,
    _groups,
    check_mask,
    pin,
    merge_moments,
    gather_moments,
    batch_moments,
    batch_stats,
    combine_moments,
    update_running_stats,
    tie_to_cotangent,
    bn_backward,
    params_stay_local,
    normalize_with_state,
    _bn_eval_fn,
    linen_norm_call,
    output_dtype,
    promote_input,
    kernels_take_no_mask,
)

__all__ = [
    "BatchStats", "Moments", "batch_moments", "batch_stats", "combine_moments", "gather_moments",
    "merge_moments", "sync_batch_norm", "sync_batch_norm_reference", "update_running_stats",
    "check_axis_name", "check_floating", "check_mask", "params_stay_local", "varying_axes",
    "warn_if_unsynchronised", "LocalStatisticsWarning",
]


# The op SyncBN's kernel replaces: the per-device moments (`jmem._backends.BN_MOMENTS`).
OPS = (_backends.BN_MOMENTS,)


def _moments_pallas(x, *, mask=None, interpret=None):
  if mask is not None:
    raise ValueError("The Pallas BatchNorm moments kernel takes no mask.")
  from pallas_kernels import inplace_abn as kernels  # pylint: disable=g-import-not-at-top
  return kernels.moments(x, interpret=interpret)


# Registered here rather than in jmem._bn_core (which holds the "xla" one): the kernel
# module imports _bn_core, and imports point down.
_backends.register(_backends.BN_MOMENTS, "pallas", _moments_pallas,
                   unsupported=kernels_take_no_mask, gpu_default=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def _sync_bn(x, scale, bias, mask, shift, axis_name, axis_index_groups, epsilon,
             implementation, interpret):
  return _sync_bn_fwd(x, scale, bias, mask, shift, axis_name, axis_index_groups, epsilon,
                      implementation, interpret)[0]


def _sync_bn_fwd(x, scale, bias, mask, shift, axis_name, axis_index_groups, epsilon,
                 implementation, interpret):
  del shift
  moments = batch_moments(x, axis_name=axis_name, axis_index_groups=axis_index_groups,
                          mask=mask, implementation=implementation, interpret=interpret)
  stats = moments.stats()
  invstd = moments.inverse_std(stats, epsilon)
  y = moments.centre(x.astype(jnp.float32)) * (invstd * scale) + bias
  return (y.astype(x.dtype), stats), (x, scale, mask, moments.m0, moments.corr, invstd,
                                      stats.count)


def _sync_bn_bwd(axis_name, axis_index_groups, epsilon, implementation, interpret, res, cts):
  del epsilon, implementation, interpret   # the backward is XLA: one psum and elementwise
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
                    epsilon: float = 1e-5, implementation: str | None = None,
                    interpret: bool | None = None) -> tuple[jax.Array, BatchStats]:
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
    implementation: the per-device moments (`jmem._backends.BN_MOMENTS`): ``"xla"``,
      ``"pallas"`` (the statistics kernel of `pallas_kernels.inplace_abn`; no mask), another
      registered backend, or ``None`` (default: the kernel on a GPU for unmasked batches,
      else XLA, with a warning for masked ones). The merge, the collective and the
      backward are XLA whatever the choice.
    interpret: Pallas interpret mode (``None``: on non-GPU backends, with a warning).
      Under ``jax.shard_map`` the interpreter needs ``check_vma=False``.

  Returns:
    ``(y, stats)``: ``y`` like ``x``; ``stats`` (`BatchStats`, no gradient, float32, exact
    to float32 rounding) for the running averages.

  Raises:
    TypeError: ``x`` not floating point; ``mask`` not boolean.
    NameError: ``axis_name`` not bound.
    ValueError: ``epsilon <= 0``; ``scale``/``bias``/``mask`` of the wrong shape; an
      unknown ``implementation``, or ``"pallas"`` with a mask.

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
  _backends.check_implementation(implementation, OPS, "sync_batch_norm")
  warn_if_unsynchronised(x, axis_name, "sync_batch_norm")
  scale, bias, mask, shift = _prepare(x, scale, bias, mask, shift)
  implementation = _backends.choose(implementation, OPS, "sync_batch_norm",
                                    masked=mask is not None)
  y, stats = _sync_bn(x, scale, bias, mask, shift, axis_name, _groups(axis_index_groups),
                      float(epsilon), implementation, interpret)
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


def _sync_train_fn(axis_name, axis_index_groups, epsilon, implementation=None):
  def fn(x, scale, bias, mask, shift):
    return sync_batch_norm(x, scale, bias, axis_name=axis_name,
                           axis_index_groups=axis_index_groups, mask=mask, shift=shift,
                           epsilon=epsilon, implementation=implementation)
  return fn


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
    implementation: the statistics' backend, as in `sync_batch_norm` (None: the Pallas
      kernel on a GPU for unmasked batches, else XLA).
    Other fields: as `flax.linen.BatchNorm`'s.
  """

  _jmem_reads_batch_mask = True   # training takes an active jmem.batch_mask

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
  implementation: str | None = None

  @nn.compact
  def __call__(self, x, use_running_average: bool | None = None, *, mask=None):
    if not self.epsilon > 0:
      raise ValueError(f"epsilon must be > 0, got {self.epsilon}.")
    _backends.check_implementation(self.implementation, OPS, type(self).__name__)
    return linen_norm_call(
        self, x, use_running_average, mask,
        # Like flax: no collective while initialising (init may run outside the mapping).
        train_fn=_sync_train_fn(None if self.is_initializing() else self.axis_name,
                                self.axis_index_groups, self.epsilon, self.implementation),
        eval_fn=_bn_eval_fn(self.epsilon), use_scale=self.use_scale, use_bias=self.use_bias,
        unbiased_running_var=self.unbiased_running_var)


@contextlib.contextmanager
def sync_batch_norm_interceptor(axis_name: AxisName = None, axis_index_groups=None, *,
                                unbiased_running_var: bool = False,
                                implementation: str | None = None):
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
  count). ``implementation``: the statistics' backend, as in `sync_batch_norm`.

  Examples:
    >>> with sync_batch_norm_interceptor(axis_name="batch"):
    ...   y, updates = model.apply(variables, x, mutable=["batch_stats"])  # doctest: +SKIP
  """
  _backends.check_implementation(implementation, OPS, "sync_batch_norm_interceptor")

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
        train_fn=_sync_train_fn(name, groups, mod.epsilon, implementation),
        eval_fn=_bn_eval_fn(mod.epsilon),
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
  ``N`` the global valid count per channel). ``implementation``: the statistics' backend,
  as in `sync_batch_norm`.
  """

  _jmem_reads_batch_mask = True   # training takes an active jmem.batch_mask

  def __init__(self, num_features: int, *, use_running_average: bool = False, axis: int = -1,
               momentum: float = 0.99, epsilon: float = 1e-5, dtype=None,
               param_dtype=jnp.float32, use_bias: bool = True, use_scale: bool = True,
               bias_init=nnx.initializers.zeros_init(), scale_init=nnx.initializers.ones_init(),
               axis_name: AxisName = None, axis_index_groups=None,
               use_fast_variance: bool = True, unbiased_running_var: bool = False,
               implementation: str | None = None, rngs: nnx.Rngs | None = None):
    del use_fast_variance  # always the stable form
    if not epsilon > 0:
      raise ValueError(f"epsilon must be > 0, got {epsilon}.")
    _backends.check_implementation(implementation, OPS, type(self).__name__)
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
    self.implementation = implementation

  def __call__(self, x, use_running_average: bool | None = None, *, mask=None):
    use_ra = self.use_running_average if use_running_average is None else use_running_average
    y, mean, var = normalize_with_state(
        x, axis=self.axis, scale=None if self.scale is None else self.scale[...],
        bias=None if self.bias is None else self.bias[...], running_mean=self.mean[...],
        running_var=self.var[...], use_running_average=use_ra, mask=mask,
        train_fn=_sync_train_fn(self.axis_name, self.axis_index_groups, self.epsilon,
                                self.implementation),
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
                        axis_index_groups=None, unbiased_running_var: bool = False,
                        implementation: str | None = None) -> int:
  """Replaces every `flax.nnx.BatchNorm` in ``model`` by `NNXSyncBatchNorm`, keeping weights.

  ``unbiased_running_var`` and ``implementation`` are given to every new module (see
  `NNXSyncBatchNorm`; the default keeps ``flax.nnx.BatchNorm``'s biased running variance).
  """
  _backends.check_implementation(implementation, OPS, "swap_nnx_batch_norm")

  def make(bn):
    new = NNXSyncBatchNorm(
        bn.num_features, use_running_average=bn.use_running_average, axis=bn.axis,
        momentum=bn.momentum, epsilon=bn.epsilon, dtype=bn.dtype,
        use_bias=bn.bias is not None, use_scale=bn.scale is not None,
        axis_name=axis_name if axis_name is not None else bn.axis_name,
        axis_index_groups=axis_index_groups if axis_index_groups is not None
        else bn.axis_index_groups, unbiased_running_var=unbiased_running_var,
        implementation=implementation)
    new.mean, new.var = bn.mean, bn.var
    new.scale, new.bias = bn.scale, bn.bias
    return new

  return replace_nnx_modules(model, lambda m: type(m) is nnx.BatchNorm, make)  # pylint: disable=unidiomatic-typecheck
