"""ActNN's compressed operations, each beside its ``*_reference`` (plain autodiff).

* Ops whose backward needs an activation (dense, conv, batch norm, layer norm, gelu, softmax
  attention) save it quantized to ``bits`` per value (`jmem.ops.actnn.quantize.compress`);
  weights are never compressed.
* ReLU / leaky ReLU and dropout save a 1-bit mask packed eight per byte, max pooling the
  index of the maximum within its window (uint8): their gradients stay EXACT.
* Average pooling is linear: it saves nothing (and stays an average, never a max).

Shapes are channels last; ``key`` (optional) seeds the stochastic rounding;
``implementation`` (``"xla"``, ``"pallas"``, ``None`` = automatic: XLA) picks the
quantizer's backend (`jmem.ops.actnn.quantize.quantize`).

References:
  Chen et al., ActNN, ICML 2021, https://arxiv.org/abs/2104.14129
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmem import _window
from jmem.ops.actnn import quantize as q

__all__ = [
    "dense", "dense_reference", "conv", "conv_reference", "batch_norm", "batch_norm_reference",
    "layer_norm", "layer_norm_reference", "gelu", "gelu_reference", "relu", "leaky_relu",
    "leaky_relu_reference", "dropout", "dropout_reference", "max_pool", "max_pool_reference",
    "avg_pool", "avg_pool_reference", "softmax_attention", "softmax_attention_reference",
]


def _compressed(reference, param_argnums, bits, group_size, key, *args, implementation=None):
  fn = q.compress(reference, bits=bits, group_size=group_size, param_argnums=param_argnums,
                  min_size=1, implementation=implementation)
  return fn(*args, key=key)


# ------------------------------------------------------------ quantized-activation ops

def dense_reference(x, kernel, bias=None):
  y = x @ kernel
  return y if bias is None else y + bias


def dense(x, kernel, bias=None, *, bits=2, group_size=256, key=None, implementation=None):
  """``x @ kernel + bias`` saving a ``bits``-bit copy of ``x``."""
  return _compressed(dense_reference, (1, 2), bits, group_size, key, x, kernel, bias,
                     implementation=implementation)


def conv_reference(x, kernel, *, strides=1, padding="SAME", dilation=1, feature_group_count=1):
  """The plain N-D convolution (the same oracle as `jmem.parallel.spatial.halo_conv`'s)."""
  return _window.conv_reference(x, kernel, strides=strides, padding=padding,
                                dilation=dilation, feature_group_count=feature_group_count)


def conv(x, kernel, *, strides: int | Sequence[int] = 1, padding="SAME",
         dilation: int | Sequence[int] = 1, feature_group_count: int = 1, bits=2,
         group_size=256, key=None, implementation=None):
  """N-D convolution (``[N, *spatial, C]``, kernel ``[*window, C/groups, F]``) saving a
  ``bits``-bit copy of ``x``."""
  ref = functools.partial(conv_reference, strides=strides, padding=padding, dilation=dilation,
                          feature_group_count=feature_group_count)
  return _compressed(lambda x, k: ref(x, k), (1,), bits, group_size, key, x, kernel,
                     implementation=implementation)


def batch_norm_reference(x, scale, bias, *, epsilon=1e-5):
  axes = tuple(range(x.ndim - 1))
  mean = jnp.mean(x, axes)
  var = jnp.mean(jnp.square(x - mean), axes)
  return (x - mean) * lax.rsqrt(var + epsilon) * scale + bias


def batch_norm(x, scale, bias, *, epsilon=1e-5, bits=2, group_size=256, key=None,
               implementation=None):
  """Training-mode batch norm (batch statistics) saving quantized intermediates."""
  ref = functools.partial(batch_norm_reference, epsilon=epsilon)
  return _compressed(ref, (1, 2), bits, group_size, key, x, scale, bias,
                     implementation=implementation)


def layer_norm_reference(x, scale, bias, *, epsilon=1e-6):
  mean = jnp.mean(x, -1, keepdims=True)
  var = jnp.mean(jnp.square(x - mean), -1, keepdims=True)
  return (x - mean) * lax.rsqrt(var + epsilon) * scale + bias


def layer_norm(x, scale, bias, *, epsilon=1e-6, bits=2, group_size=256, key=None,
               implementation=None):
  ref = functools.partial(layer_norm_reference, epsilon=epsilon)
  return _compressed(ref, (1, 2), bits, group_size, key, x, scale, bias,
                     implementation=implementation)


def gelu_reference(x):
  return jax.nn.gelu(x)


def gelu(x, *, bits=2, group_size=256, key=None, implementation=None):
  return _compressed(lambda p, x: gelu_reference(x), (0,), bits, group_size, key, None, x,
                     implementation=implementation)


def softmax_attention_reference(q_, k, v):
  """``softmax(q kᵀ / sqrt(d)) v`` for ``[B, T, H, D]`` queries, keys and values."""
  logits = jnp.einsum("bqhd,bkhd->bhqk", q_, k) / np.sqrt(q_.shape[-1]).astype(q_.dtype)
  return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)


def softmax_attention(q_, k, v, *, bits=2, group_size=256, key=None, recompute=False,
                      implementation=None):
  """Attention saving compressed probabilities and inputs, or (``recompute``) only the
  inputs, recomputing the probabilities in the backward pass."""
  if recompute:
    return jax.checkpoint(softmax_attention_reference)(q_, k, v)
  return _compressed(lambda p, *a: softmax_attention_reference(*a), (0,), bits, group_size,
                     key, None, q_, k, v, implementation=implementation)


# --------------------------------------------------------------------- 1-bit masks

def _pack_mask(mask):
  flat = mask.reshape(-1).astype(jnp.uint8)
  pad = (-flat.size) % 8
  return q.pack_bits(jnp.pad(flat, (0, pad)), 1)


def _unpack_mask(packed, shape):
  n = int(np.prod(shape))
  return q.unpack_bits(packed, 1)[:n].astype(jnp.bool_).reshape(shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def leaky_relu(x, slope: float = 0.01):
  """Leaky ReLU saving one bit per value (``x >= 0``); the gradient is exact."""
  return jnp.where(x >= 0, x, x * slope)


def _leaky_fwd(x, slope):
  return leaky_relu(x, slope), _pack_mask(x >= 0)


def _leaky_bwd(slope, packed, dy):
  pos = _unpack_mask(packed, dy.shape)
  return (jnp.where(pos, dy, dy * slope),)


leaky_relu.defvjp(_leaky_fwd, _leaky_bwd)


def leaky_relu_reference(x, slope=0.01):
  return jnp.where(x >= 0, x, x * slope)


def relu(x):
  """ReLU saving one bit per value (gradient 0 at 0, as ``jax.nn.relu``'s)."""
  return _relu(x)


@jax.custom_vjp
def _relu(x):
  return jnp.maximum(x, 0)


_relu.defvjp(lambda x: (_relu(x), _pack_mask(x > 0)),
             lambda packed, dy: (jnp.where(_unpack_mask(packed, dy.shape), dy, 0),))


def dropout_reference(x, rate, key):
  keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), 0)


def dropout(x, rate: float, key: jax.Array):
  """Inverted dropout saving the keep mask as one bit per value."""
  if not 0.0 <= rate < 1.0:
    raise ValueError(f"dropout rate must be in [0, 1), got {rate}.")
  keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
  return _masked_scale(x, _pack_mask(keep), 1.0 / (1.0 - rate))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _masked_scale(x, packed, factor):
  return jnp.where(_unpack_mask(packed, x.shape), x * factor, 0)


_masked_scale.defvjp(
    lambda x, packed, factor: (_masked_scale(x, packed, factor), packed),
    lambda factor, packed, dy: (jnp.where(_unpack_mask(packed, dy.shape), dy * factor, 0),
                                np.zeros(packed.shape, jax.dtypes.float0)))


# ------------------------------------------------------------------------ pooling

def max_pool_reference(x, window, strides=None, padding="VALID"):
  return _window.pool_reference(x, window=tuple(window), strides=strides, padding=padding,
                               kind="max")


def max_pool(x, window: Sequence[int], strides: Sequence[int] | None = None,
             padding: str = "VALID"):
  """Max pooling saving the index of each window's maximum (uint8); exact gradient.

  Ties go to the first maximum in the window, as ``jax``'s own VJP sends them.
  """
  window = tuple(window)
  strides = window if strides is None else tuple(strides)
  pads = lax.padtype_to_pads(x.shape[1:-1], window, strides, padding)
  return _window.indexed_max_pool(x, (1,) + window + (1,), (1,) + strides + (1,),
                          ((0, 0),) + tuple(pads) + ((0, 0),))




def avg_pool_reference(x, window, strides=None, padding="VALID"):
  return _window.pool_reference(x, window=tuple(window), strides=strides, padding=padding,
                               kind="avg")


def avg_pool(x, window, strides=None, padding="VALID"):
  """Average pooling (padding excluded from the count). Linear, so plain autodiff already
  saves nothing: this is the reference itself, kept an average (never a max)."""
  return avg_pool_reference(x, window, strides, padding)
