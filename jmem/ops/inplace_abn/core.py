"""In-Place Activated BatchNorm: BN + invertible activation whose VJP needs only the output.

Forward: ``y = γ' (x - μ) / sqrt(σ² + ε) + β`` with ``γ' = |γ| + ε`` (never zero, so always
invertible), ``z = act(y)``. Only ``z`` (plus per-channel statistics) is saved. Backward
inverts the activation (``y`` and ``dy = dz · act'(y)`` from ``z``), then the affine step
(``x̂ = (y - β) / γ'``), and runs the one-collective BN backward of `jmem.parallel.sync_bn`
with the GLOBAL count: ``dx = γ'/σ (dy - (Σdy + x̂ Σx̂dy) / N)``, ``dγ = sign(γ) Σx̂dy``,
``dβ = Σdy``. The next layer (a convolution) saves ``z`` anyway, so the BN input ``x`` no
longer needs to be kept at all.

Activations: ``leaky_relu`` (slope > 0), ``elu`` (alpha > 0) and ``identity``. ReLU is not
invertible and is refused.

Weight mapping to plain BN: a plain BN with scale ``s`` equals InPlace-ABN with
``γ = s - ε`` if ``s > ε`` (in general ``γ = sign(s)(|s| - ε)`` needs ``|s| ≥ ε`` and gives
``|s|``: negative scales become positive, so flip the sign of the next layer's weights);
InPlace-ABN's ``γ`` is plain BN's ``|γ| + ε``. See `to_batch_norm_scale` and
`from_batch_norm_scale`.

References:
  Rota Bulò, Porzi & Kontschieder, In-Place Activated BatchNorm for Memory-Optimized
  Training of DNNs, CVPR 2018, https://arxiv.org/abs/1712.02616
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jmem import _backends
from jmem import _bn_core as bn_core
from jmem._technique import keep_exact
from jmem._elementwise import (  # pylint: disable=unused-import
    ACTIVATIONS, ABNConfig, apply_activation, invert_activation)

__all__ = [
    "ACTIVATIONS", "ABNConfig", "inplace_abn", "inplace_abn_reference",
    "to_batch_norm_scale", "from_batch_norm_scale",
]

def _gamma(scale, epsilon):
  return jnp.abs(scale) + epsilon


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _abn_train(x, scale, bias, mask, shift, cfg: ABNConfig):
  del shift   # ignored: the statistics are exact without one
  moments = bn_core.batch_moments(x, axis_name=cfg.axis_name,
                                  axis_index_groups=cfg.axis_index_groups, mask=mask)
  stats = moments.stats()
  invstd = moments.inverse_std(stats, cfg.epsilon)
  y = moments.centre(x.astype(jnp.float32)) * (invstd * _gamma(scale, cfg.epsilon)) + bias
  return apply_activation(y, cfg).astype(x.dtype), stats


def _abn_train_fwd(x, scale, bias, mask, shift, cfg):
  z, stats = _abn_train(x, scale, bias, mask, shift, cfg)
  # Saved: the OUTPUT z and per-channel vectors; neither x nor the mean. z is inverted in
  # the backward pass, so a compression around this site must keep it exact.
  invstd = jnp.where(stats.count > 0, lax.rsqrt(stats.var + cfg.epsilon), 0.0)
  return (z, stats), (keep_exact(z), scale, bias, mask, invstd, stats.count)


def _abn_train_bwd(cfg, res, cts):
  param_varying = bn_core.params_stay_local(cfg.axis_name, cts[0], res[1])
  sign = jnp.sign(res[1])   # before the barrier, which makes everything device-varying
  res, cts = bn_core.tie_to_cotangent(res, cts)
  z, scale, bias, mask, invstd, count = res
  y, dy = invert_activation(z.astype(jnp.float32), cts[0].astype(jnp.float32), cfg)
  g = _gamma(scale, cfg.epsilon)
  xhat = (y - bias) / g
  dx, dg, db = bn_core.bn_backward(
      dy, xhat, mask, g * invstd, count, axis_name=cfg.axis_name,
      axis_index_groups=cfg.axis_index_groups, param_varying=param_varying)
  return dx.astype(z.dtype), (sign * dg).astype(scale.dtype), db.astype(bias.dtype), None, None


_abn_train.defvjp(_abn_train_fwd, _abn_train_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _abn_eval(x, scale, bias, mean, var, cfg: ABNConfig):
  invstd = lax.rsqrt(var.astype(jnp.float32) + cfg.epsilon)
  y = (x.astype(jnp.float32) - mean) * (invstd * _gamma(scale, cfg.epsilon)) + bias
  return apply_activation(y, cfg).astype(x.dtype)


def _abn_eval_fwd(x, scale, bias, mean, var, cfg):
  z = _abn_eval(x, scale, bias, mean, var, cfg)
  return z, (keep_exact(z), scale, bias, lax.rsqrt(var.astype(jnp.float32) + cfg.epsilon))


def _abn_eval_bwd(cfg, res, dz):
  param_varying = bn_core.params_stay_local(cfg.axis_name, dz, res[1])
  sign = jnp.sign(res[1])
  res, dz = bn_core.tie_to_cotangent(res, dz)
  z, scale, bias, invstd = res
  y, dy = invert_activation(z.astype(jnp.float32), dz.astype(jnp.float32), cfg)
  g = _gamma(scale, cfg.epsilon)
  xhat = (y - bias) / g
  axes = tuple(range(z.ndim - 1))
  sums = jnp.stack([jnp.sum(dy, axis=axes), jnp.sum(dy * xhat, axis=axes)])
  if not param_varying:
    sums = lax.psum(sums, cfg.axis_name, axis_index_groups=cfg.axis_index_groups)
  dx = dy * (g * invstd)
  return (dx.astype(z.dtype), (sign * sums[1]).astype(scale.dtype),
          sums[0].astype(bias.dtype), None, None)


_abn_eval.defvjp(_abn_eval_fwd, _abn_eval_bwd)


def _config(activation, slope, alpha, epsilon, axis_name, axis_index_groups) -> ABNConfig:
  groups = None if axis_index_groups is None else tuple(tuple(int(i) for i in g)
                                                        for g in axis_index_groups)
  if isinstance(axis_name, list):
    axis_name = tuple(axis_name)
  return ABNConfig(activation, float(slope), float(alpha), float(epsilon), axis_name,
                   groups).validate()


def inplace_abn(x: jax.Array, scale: jax.Array, bias: jax.Array, *,
                activation: str = "leaky_relu", slope: float = 0.01, alpha: float = 1.0,
                epsilon: float = 1e-5, axis_name: str | tuple[str, ...] | None = None,
                axis_index_groups: Sequence[Sequence[int]] | None = None,
                mask: jax.Array | None = None, shift: jax.Array | None = None,
                use_running_average: bool = False, running_mean: jax.Array | None = None,
                running_var: jax.Array | None = None,
                implementation: str | None = None,
                interpret: bool | None = None) -> tuple[jax.Array, bn_core.BatchStats | None]:
  """Batch norm + invertible activation that saves only its output for the backward pass.

  Args:
    x: ``[..., C]`` input, channels last (float32, bfloat16 or float16; statistics and
      the backward reductions run in float32). Integer and boolean inputs raise TypeError.
    scale: ``float[C]`` γ; the effective scale is ``|γ| + epsilon``.
    bias: ``float[C]`` β.
    activation: ``"leaky_relu"``, ``"elu"`` or ``"identity"`` (``"relu"`` is refused).
    slope: leaky_relu negative slope, > 0.
    alpha: elu alpha, > 0.
    epsilon: variance epsilon (also the |γ| offset), > 0.
    axis_name: reduce statistics over this named axis (InPlace-ABN-Sync): one all-gather
      forward and one all-reduce backward (`jmem.parallel.sync_bn`), global counts in the
      backward; exact in float32 whatever the data's offset. An unbound name raises
      NameError; in training mode under ``jax.shard_map`` an ``x`` that varies over a mesh
      axis this leaves out gets a `jmem.parallel.bn_core.LocalStatisticsWarning`.
    axis_index_groups: optional groups within the axis.
    mask: optional boolean array (other dtypes raise TypeError), broadcastable to ``x``
      with the same rank; True = valid. As in `jmem.parallel.bn_core.sync_batch_norm`:
      padding is selected away (NaN/Inf there is inert) and a channel with no valid entry
      is normalised to 0 (``z = act(β)``).
    shift: ignored; accepted for compatibility (the statistics are exact without one).
    use_running_average: eval mode: normalise with ``running_mean`` / ``running_var``, no
      collective in the forward pass.
    running_mean: ``float[C]``, required in eval mode.
    running_var: ``float[C]``, required in eval mode.
    implementation: ``"xla"`` (reference and CPU path), ``"pallas"`` (the training-mode
      kernels of `pallas_kernels.inplace_abn`; no mask; eval mode is one elementwise op and
      stays XLA), another backend registered in `jmem._backends`, or ``None`` (default: the
      kernels on a GPU for unmasked batches, else XLA with a warning for masked ones).
    interpret: Pallas interpret mode (``None``: on non-GPU backends, with a warning).

  Returns:
    ``(z, stats)``: ``z`` like ``x``; ``stats`` the batch `BatchStats` (None in eval mode).

  Raises:
    TypeError: ``x`` not floating point; ``mask`` not boolean.
    NameError: ``axis_name`` not bound.
    ValueError: a bad option (ReLU, slope or alpha ≤ 0, epsilon ≤ 0, implementation), or
      ``scale``/``bias``/``mask`` of the wrong shape.
  """
  cfg = _config(activation, slope, alpha, epsilon, axis_name, axis_index_groups)
  bn_core.check_floating(x, "inplace_abn")
  bn_core.check_axis_name(cfg.axis_name)
  c = x.shape[-1]
  scale = jnp.asarray(scale, jnp.float32)
  bias = jnp.asarray(bias, jnp.float32)
  if scale.shape != (c,) or bias.shape != (c,):
    raise ValueError(f"scale and bias must have shape ({c},) for x of shape {x.shape}, got "
                     f"{scale.shape} and {bias.shape}.")
  _backends.check_implementation(implementation, OPS, "inplace_abn")
  if use_running_average:
    if running_mean is None or running_var is None:
      raise ValueError("Eval mode (use_running_average=True) needs running_mean and running_var.")
    z = _abn_eval(x, scale, bias, jnp.asarray(running_mean, jnp.float32),
                  jnp.asarray(running_var, jnp.float32), cfg)
    return z, None
  mask = bn_core.check_mask(x, mask)
  bn_core.warn_if_unsynchronised(x, cfg.axis_name, "inplace_abn")
  shift = jnp.zeros((c,), jnp.float32) if shift is None else jnp.asarray(shift, jnp.float32)
  implementation = _backends.choose(implementation, OPS, "inplace_abn",
                                    masked=mask is not None)
  z, stats = _backends.get(_backends.INPLACE_ABN, implementation)(
      x, scale, bias, cfg, mask=mask, shift=shift, interpret=interpret)
  return z, jax.tree.map(lax.stop_gradient, stats)


# ------------------------------------------------- the op's backends (`jmem._backends`)
# INPLACE_ABN: ``(x [..., C], scale float32[C], bias float32[C], cfg: ABNConfig, *, mask,
# shift, interpret) -> (z like x, BatchStats)``, differentiable (custom VJP saving z).

OPS = (_backends.INPLACE_ABN,)


def _train_xla(x, scale, bias, cfg, *, mask=None, shift=None, interpret=None):
  del interpret
  return _abn_train(x, scale, bias, mask, shift, cfg)


def _train_pallas(x, scale, bias, cfg, *, mask=None, shift=None, interpret=None):
  if mask is not None:
    raise ValueError("The Pallas InPlace-ABN kernels take no mask.")
  from pallas_kernels import inplace_abn as kernels  # pylint: disable=g-import-not-at-top
  return kernels.inplace_abn_pallas(x, scale, bias, cfg, shift=shift, interpret=interpret)


_backends.register(_backends.INPLACE_ABN, "xla", _train_xla)
_backends.register(_backends.INPLACE_ABN, "pallas", _train_pallas,
                   unsupported=bn_core.kernels_take_no_mask, gpu_default=True)


def inplace_abn_reference(x, scale, bias, *, activation="leaky_relu", slope=0.01, alpha=1.0,
                          epsilon=1e-5, axis_name=None, axis_index_groups=None, mask=None,
                          shift=None, use_running_average=False, running_mean=None,
                          running_var=None):
  """BN then activation by plain autodiff (saves x): the oracle of `inplace_abn`."""
  cfg = _config(activation, slope, alpha, epsilon, axis_name, axis_index_groups)
  bn_core.check_floating(x, "inplace_abn_reference")
  bn_core.check_axis_name(cfg.axis_name)
  g = _gamma(jnp.asarray(scale, jnp.float32), epsilon)
  del shift
  if use_running_average:
    xc = x.astype(jnp.float32) - running_mean
    var, stats = running_var, None
  else:
    bn_core.warn_if_unsynchronised(x, cfg.axis_name, "inplace_abn_reference")
    moments = bn_core.batch_moments(x, axis_name=axis_name,
                                    axis_index_groups=cfg.axis_index_groups, mask=mask)
    stats = moments.stats()
    xc, var = moments.centre(x.astype(jnp.float32)), stats.var
  invstd = lax.rsqrt(var + epsilon)
  if stats is not None:
    invstd = jnp.where(stats.count > 0, invstd, 0.0)
  y = xc * invstd * g + bias
  return apply_activation(y, cfg).astype(x.dtype), stats


def to_batch_norm_scale(scale: jax.Array, epsilon: float = 1e-5) -> jax.Array:
  """The plain-BN scale that InPlace-ABN's ``scale`` acts as: ``|γ| + ε``."""
  return jnp.abs(scale) + epsilon


def from_batch_norm_scale(bn_scale: jax.Array, epsilon: float = 1e-5) -> jax.Array:
  """InPlace-ABN ``γ`` reproducing a plain-BN scale ``s`` with ``s ≥ ε``: ``s - ε``.

  Raises:
    ValueError: (when concrete) if some ``s < ε``: such a BN is not expressible exactly,
      because InPlace-ABN's effective scale is always ≥ ε (a negative scale must be moved
      into the next layer's weights first).
  """
  bn_scale = jnp.asarray(bn_scale)
  if not isinstance(bn_scale, jax.core.Tracer) and bool(jnp.any(bn_scale < epsilon)):
    raise ValueError(f"Plain-BN scales below epsilon={epsilon} (including negative ones) have "
                     "no exact InPlace-ABN equivalent; fold their sign into the next layer.")
  return bn_scale - epsilon


# ---------------------------------------------------------------------------- Flax modules

def _abn_fns(cfg: ABNConfig, implementation: str):
  kw = dict(activation=cfg.activation, slope=cfg.slope, alpha=cfg.alpha, epsilon=cfg.epsilon,
            axis_name=cfg.axis_name, axis_index_groups=cfg.axis_index_groups,
            implementation=implementation)

  def train_fn(x, scale, bias, mask, shift):
    return inplace_abn(x, scale, bias, mask=mask, shift=shift, **kw)

  def eval_fn(x, scale, bias, mean, var):
    return inplace_abn(x, scale, bias, use_running_average=True, running_mean=mean,
                       running_var=var, **kw)[0]

  return train_fn, eval_fn


def _check_affine(use_scale, use_bias, name):
  if not (use_scale and use_bias):
    raise ValueError(f"{name} needs use_scale=True and use_bias=True: InPlace-ABN inverts its "
                     "affine step to recompute the normalised input from the output.")


class InPlaceABN(nn.Module):
  """BatchNorm followed by its activation, saving only the output (Flax linen).

  Replaces ``act(BatchNorm()(x))``. Variable names are flax.linen.BatchNorm's. Set
  ``axis_name`` for the synchronised variant (`InPlaceABNSync`). Inputs must be floating
  point (TypeError otherwise).

  Conventions, ``N`` the global number of valid values of a channel in the batch:

  * The effective scale is ``|scale| + epsilon``, never 0, so the activation's input can be
    recovered from its output: a plain BN's scale ``s >= epsilon`` is ``scale = s -
    epsilon`` here (`from_batch_norm_scale`, `to_batch_norm_scale`).
  * ``momentum`` is Flax's decay, ``running = momentum * running + (1 - momentum) * batch``;
    PyTorch's ``momentum=m`` is ``1 - m`` here (its default 0.1 is 0.9).
  * The batch is normalised with its biased variance. The running variance is the biased
    one (Flax's convention) unless ``unbiased_running_var=True``, which stores
    ``var * N / (N - 1)`` (PyTorch's): set it for statistics that go to or come from
    PyTorch. Eval mode normalises with the stored variance as it is.

  Attributes:
    use_running_average: eval mode (may be given at call time instead).
    axis: feature axis.
    momentum: running-average decay (Flax convention; PyTorch's 0.1 is 0.9 here).
    epsilon: variance epsilon and |γ| offset, > 0.
    activation: ``"leaky_relu"``, ``"elu"`` or ``"identity"``.
    slope: leaky_relu slope, > 0.
    alpha: elu alpha, > 0.
    axis_name: named axis to synchronise statistics over (None: local).
    axis_index_groups: optional groups within the axis.
    implementation: ``"xla"``, ``"pallas"`` or ``None`` (the kernels on a GPU for unmasked
      batches, else XLA; see `inplace_abn`).
    unbiased_running_var: store the unbiased (PyTorch) running variance instead of the
      biased (Flax) one.
    use_scale, use_bias: must stay True (InPlace-ABN inverts its affine step); accepted so
      that the module takes ``flax.linen.BatchNorm``'s arguments.
    use_fast_variance, force_float32_reductions: accepted for the same reason; the
      statistics are always the exact two-pass form in float32.
  """

  _jmem_reads_batch_mask = True   # training takes an active jmem.batch_mask

  use_running_average: bool | None = None
  axis: int = -1
  momentum: float = 0.99
  epsilon: float = 1e-5
  activation: str = "leaky_relu"
  slope: float = 0.01
  alpha: float = 1.0
  dtype: Any = None
  param_dtype: Any = jnp.float32
  bias_init: Callable[..., Any] = nn.initializers.zeros
  scale_init: Callable[..., Any] = nn.initializers.ones
  axis_name: str | tuple[str, ...] | None = None
  axis_index_groups: Any = None
  implementation: str | None = None
  unbiased_running_var: bool = False
  use_scale: bool = True
  use_bias: bool = True
  use_fast_variance: bool = True
  force_float32_reductions: bool = True

  @nn.compact
  def __call__(self, x, use_running_average: bool | None = None, *, mask=None):
    _check_affine(self.use_scale, self.use_bias, type(self).__name__)
    axis_name = None if self.is_initializing() else self.axis_name   # as flax's BatchNorm
    cfg = _config(self.activation, self.slope, self.alpha, self.epsilon, axis_name,
                  self.axis_index_groups)
    train_fn, eval_fn = _abn_fns(cfg, self.implementation)
    return bn_core.linen_norm_call(self, x, use_running_average, mask, train_fn=train_fn,
                                   eval_fn=eval_fn, use_scale=True, use_bias=True,
                                   unbiased_running_var=self.unbiased_running_var)


class InPlaceABNSync(InPlaceABN):
  """`InPlaceABN` with statistics synchronised over ``axis_name`` (which must be set).

  Same fields and conventions as `InPlaceABN` (``N`` counts the valid values of every
  device of ``axis_name``).
  """

  @nn.compact
  def __call__(self, x, use_running_average: bool | None = None, *, mask=None):
    if self.axis_name is None:
      raise ValueError("InPlaceABNSync needs axis_name (the mapped axis to synchronise over); "
                       "use InPlaceABN for local statistics.")
    return super().__call__(x, use_running_average, mask=mask)


class NNXInPlaceABN(nnx.Module):
  """`InPlaceABN` for Flax NNX (variables named as flax.nnx.BatchNorm's).

  Same arguments and conventions as `InPlaceABN`, and ``nnx.BatchNorm``'s (``scale_init``,
  ``bias_init`` with ``rngs``; ``use_scale``/``use_bias`` must stay True;
  ``use_fast_variance``, ``promote_dtype`` accepted): effective scale ``|scale| + epsilon``;
  ``momentum`` is Flax's decay (PyTorch's 0.1 is 0.9 here); the running variance is biased
  (Flax's) unless ``unbiased_running_var=True`` (PyTorch's ``var * N / (N - 1)``).
  """

  _jmem_reads_batch_mask = True   # training takes an active jmem.batch_mask

  def __init__(self, num_features: int, *, use_running_average: bool = False, axis: int = -1,
               momentum: float = 0.99, epsilon: float = 1e-5, activation: str = "leaky_relu",
               slope: float = 0.01, alpha: float = 1.0, dtype=None, param_dtype=jnp.float32,
               axis_name=None, axis_index_groups=None, implementation: str | None = None,
               unbiased_running_var: bool = False, use_scale: bool = True,
               use_bias: bool = True, scale_init=nnx.initializers.ones,
               bias_init=nnx.initializers.zeros, use_fast_variance: bool = True,
               promote_dtype=None, scale_metadata=None, bias_metadata=None,
               rngs: nnx.Rngs | None = None):
    del use_fast_variance, promote_dtype          # exact float32 statistics, always
    _check_affine(use_scale, use_bias, type(self).__name__)
    self.cfg = _config(activation, slope, alpha, epsilon, axis_name, axis_index_groups)
    self.mean = nnx.BatchStat(jnp.zeros((num_features,), jnp.float32))
    self.var = nnx.BatchStat(jnp.ones((num_features,), jnp.float32))
    key = rngs.params() if rngs is not None else jax.random.key(0)
    self.scale = nnx.Param(scale_init(key, (num_features,), param_dtype),
                           **dict(scale_metadata or {}))
    self.bias = nnx.Param(bias_init(key, (num_features,), param_dtype),
                          **dict(bias_metadata or {}))
    self.use_running_average = use_running_average
    self.axis, self.momentum, self.dtype = axis, momentum, dtype
    self.implementation = implementation
    self.unbiased_running_var = unbiased_running_var

  def __call__(self, x, use_running_average: bool | None = None, *, mask=None):
    use_ra = self.use_running_average if use_running_average is None else use_running_average
    train_fn, eval_fn = _abn_fns(self.cfg, self.implementation)
    out_dtype = bn_core.output_dtype(self.dtype, x, self.scale[...], self.bias[...])
    y, mean, var = bn_core.normalize_with_state(
        bn_core.promote_input(x, out_dtype), axis=self.axis, scale=self.scale[...],
        bias=self.bias[...], running_mean=self.mean[...],
        running_var=self.var[...], use_running_average=use_ra, mask=mask, train_fn=train_fn,
        eval_fn=eval_fn, momentum=self.momentum, unbiased_running_var=self.unbiased_running_var,
        op=type(self).__name__)
    if not use_ra:
      self.mean[...], self.var[...] = mean, var
    return y.astype(out_dtype)
