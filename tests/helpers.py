"""Helpers shared by several test modules (imported as ``helpers``: pytest puts tests/ on
the path)."""

import jax.numpy as jnp
import numpy as np

# Per-dtype tolerances of exact techniques against their references.
TOL = {jnp.float32: dict(rtol=1e-5, atol=1e-5), jnp.bfloat16: dict(rtol=5e-2, atol=5e-2)}


def bn_data(shape, dtype=jnp.float32, seed=0):
  """``(x, scale, bias, cotangent)`` for a normalisation over the last axis of ``shape``."""
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=shape) * 3 + 1, dtype)
  g = jnp.asarray(rng.normal(size=shape[-1]), jnp.float32)
  b = jnp.asarray(rng.normal(size=shape[-1]), jnp.float32)
  ct = jnp.asarray(rng.normal(size=shape), dtype)
  return x, g, b, ct


def assert_close_scaled(got, want, *, rtol=1e-5, atol=1e-5):
  """``got`` equals ``want`` to the tolerances, both divided by ``max(1, max|want|)``."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  scale = max(1.0, float(np.abs(want).max()))
  np.testing.assert_allclose(got / scale, want / scale, rtol=rtol, atol=atol)


def assert_close_dtype(got, want, dtype):
  """`assert_close_scaled` with the tolerances of ``dtype`` (see `TOL`)."""
  assert_close_scaled(got, want, **TOL[dtype])
