"""Elementwise math shared by jmem's ops and their Pallas kernels (a low module: it imports
nothing from jmem, so kernels never import the ops that call them).

InPlace-ABN's activations and their inverses (`ABNConfig`), and the 2-bit quantizer's
per-group span, bfloat16 truncation, element hash and seeds.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

ACTIVATIONS = ("leaky_relu", "elu", "identity")


class ABNConfig(NamedTuple):
  """Static options of `inplace_abn` (hashable)."""

  activation: str = "leaky_relu"
  slope: float = 0.01       # leaky_relu negative slope, > 0
  alpha: float = 1.0        # elu alpha, > 0
  epsilon: float = 1e-5
  axis_name: str | tuple[str, ...] | None = None
  axis_index_groups: tuple[tuple[int, ...], ...] | None = None

  def validate(self) -> "ABNConfig":
    if self.activation == "relu":
      raise ValueError(
          "InPlace-ABN cannot use relu: it is not invertible (slope 0), so the input cannot "
          "be recovered from the output. Use activation='leaky_relu' with slope > 0 (e.g. "
          "0.01), 'elu' or 'identity'.")
    if self.activation not in ACTIVATIONS:
      raise ValueError(f"Unknown activation {self.activation!r}; InPlace-ABN supports "
                       f"{ACTIVATIONS}.")
    if self.activation == "leaky_relu" and not self.slope > 0:
      raise ValueError(f"leaky_relu slope must be > 0 to be invertible, got {self.slope}.")
    if self.activation == "elu" and not self.alpha > 0:
      raise ValueError(f"elu alpha must be > 0, got {self.alpha}.")
    if not self.epsilon > 0:
      raise ValueError(f"epsilon must be > 0, got {self.epsilon}.")
    return self


def apply_activation(y, cfg: ABNConfig):
  """``act(y)`` for an `ABNConfig` (pure jnp: also used inside the Pallas kernels)."""
  if cfg.activation == "leaky_relu":
    return jnp.where(y >= 0, y, y * cfg.slope)
  if cfg.activation == "elu":
    return jnp.where(y >= 0, y, cfg.alpha * jnp.expm1(jnp.minimum(y, 0.0)))
  return y


def invert_activation(z, dz, cfg: ABNConfig):
  """``(y, dy)`` from the activation output ``z`` and its cotangent ``dz`` (float32)."""
  if cfg.activation == "leaky_relu":
    neg = z < 0
    return jnp.where(neg, z / cfg.slope, z), jnp.where(neg, dz * cfg.slope, dz)
  if cfg.activation == "elu":
    neg = z < 0
    # z > -alpha in exact arithmetic; rounding can reach it, so keep log1p finite.
    ratio = jnp.maximum(z / cfg.alpha, -1.0 + 1e-7)
    y = jnp.where(neg, jnp.log1p(jnp.minimum(ratio, 0.0)), z)
    return y, jnp.where(neg, dz * (z + cfg.alpha), dz)
  return z, dz


def group_span(mn: jax.Array, mx: jax.Array) -> jax.Array:
  """``mx - mn`` widened by 2^-22 of the larger magnitude (about two float32 ulps) and by
  1e-30: positive for a constant group, and never much wider than the range (an absolute
  epsilon such as ActNN's 2e-6 stretches the span of groups with small ranges many times)."""
  return (mx - mn) + (jnp.maximum(jnp.abs(mn), jnp.abs(mx)) * 2.0**-22 + 1e-30)


_F32_MAX = 3.4028234663852886e38


def group_scale(levels, mn: jax.Array, mx: jax.Array) -> jax.Array:
  """``levels / group_span(mn, mx)`` rounded DOWN to bfloat16 (float32), kept at least at
  the smallest scale whose top code dequantizes to a finite float32 (``levels / scale``
  under float32's largest value) and at float32's smallest normal value.

  Without that floor a group whose range nears float32's (finite values around +-2e38, or
  around +-5e37 at 8 bits) overflowed the span to inf, the scale to 0 (or a flushed
  subnormal), and every dequantized value of the group to NaN. With it such a group's
  values beyond ``mn + levels / scale`` are clipped to its top code (finite, but no longer
  unbiased there); every group whose range float32 holds is as before, bit for bit.
  ``levels`` may be a traced scalar (`fake_quantize`).
  """
  return truncate_to_bfloat16(jnp.maximum(levels / group_span(mn, mx), scale_floor(levels)))


def scale_floor(levels) -> jax.Array:
  """The least scale `group_scale` gives (see there)."""
  return jnp.maximum(levels / (0.99 * _F32_MAX), 2.0**-126)


def truncate_to_bfloat16(v: jax.Array) -> jax.Array:
  """Positive float32 ``v`` rounded DOWN to the nearest bfloat16 value (still float32).

  Clearing the 16 low bits of the float32 pattern rounds toward zero, i.e. down for
  positive numbers; the result converts to bfloat16 exactly.
  """
  bits = jax.lax.bitcast_convert_type(v.astype(jnp.float32), jnp.uint32)
  return jax.lax.bitcast_convert_type(bits & jnp.uint32(0xFFFF0000), jnp.float32)


def _lowbias32(h: jax.Array) -> jax.Array:
  """Wellons' lowbias32 finaliser: a uint32 bijection whose output bits each depend on
  every input bit."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x7FEB352D)
  h = h ^ (h >> 15)
  h = h * jnp.uint32(0x846CA68B)
  return h ^ (h >> 16)


def hash_uniform(index: jax.Array, seed: jax.Array) -> jax.Array:
  """``U[0, 1)`` from a uint32 element index and seed (lowbias32 hash; Wellons).

  Elementwise, so it fuses into the quantization instead of materialising full-size
  random-bit arrays (threefry needs two uint32 and one float32 array of the input's size);
  the Pallas kernels compute the same values.
  """
  h = _lowbias32(index * jnp.uint32(0x9E3779B1) + seed)
  return (h >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)


def key_seed(key: jax.Array) -> jax.Array:
  """A uint32 seed from a PRNG key (typed, or raw ``uint32`` words): its words hashed.

  No threefry: a key's words are already pseudo-random, and a site of a converted model
  needs one seed per residual, not a random stream. Drawing each with ``fold_in`` and
  ``random.bits`` put two threefry loops per residual into the step: 135 rolled loops in
  a ResNet-20 ActNN L3 step, 13 without them, and its XLA:CPU compile (at -O0) took 9.0-10.6
  s against 4.1-4.5 s.
  """
  data = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
  words = jnp.ravel(data).astype(jnp.uint32)
  h = jnp.uint32(0x2545F491)
  for j in range(words.shape[0]):
    h = seed_fold_in(h ^ words[j], j)
  return h


def seed_fold_in(seed: jax.Array, i: int) -> jax.Array:
  """A uint32 seed derived from ``seed`` and a static index ``i`` (``fold_in`` for the
  seeds of `key_seed`): distinct ``i`` give unrelated seeds."""
  return _lowbias32(seed ^ jnp.uint32((i * 0x9E3779B1 + 0x7F4A7C15) % 2**32))
