"""The context variables of `jmem.convert`'s sites: the batch mask and the RNG keys (a low
module: the training loop enters them without importing the model surgery)."""

from __future__ import annotations

import contextlib
import contextvars
import zlib

import jax
import jax.numpy as jnp

_MASK: contextvars.ContextVar = contextvars.ContextVar("jmem_batch_mask", default=None)
_RNGS: contextvars.ContextVar = contextvars.ContextVar("jmem_rngs", default=None)


@contextlib.contextmanager
def batch_mask(mask: jax.Array):
  """Gives every BatchNorm site that `jmem.convert` made (`SyncBN`, `InPlaceABN`) a validity
  ``mask`` when the model's own calls pass none.

  ``mask``: boolean, True = a valid example, over the leading axes of the BatchNorm inputs
  (``[N]`` for ``[N, H, W, C]`` activations; trailing axes are broadcast). Use it inside the
  traced function, around the model call::

    def loss(params, x, y, valid):
      with jmem.surgery.batch_mask(valid):
        logits, updates = model.apply({"params": params, **state}, x, mutable=["batch_stats"])

  A BatchNorm-like module that runs inside the context without being a jmem site raises
  (it would ignore the mask).
  """
  mask = jnp.asarray(mask)
  if mask.dtype != jnp.bool_:
    raise TypeError(f"batch_mask takes a boolean mask (True = valid), got dtype {mask.dtype}; "
                    "use mask.astype(bool) or mask > 0.")
  token = _MASK.set(mask)
  try:
    yield
  finally:
    _MASK.reset(token)


def active_mask():
  return _MASK.get()


def mask_for(x, mask, path: str):
  """The context mask broadcast to ``x``'s rank (trailing axes of size 1)."""
  if mask is None:
    return None
  if mask.ndim > x.ndim or x.shape[:mask.ndim] != mask.shape:
    raise ValueError(f"jmem.surgery.batch_mask: the mask of shape {mask.shape} does not cover "
                     f"the leading axes of the BatchNorm input of shape {x.shape} at "
                     f"{path or '<top>'}; give one entry per example (shape {x.shape[:1]}).")
  return mask.reshape(mask.shape + (1,) * (x.ndim - mask.ndim))


@contextlib.contextmanager
def rngs(*, actnn: jax.Array | None = None, sbp: jax.Array | None = None):
  """Keys of the RNG streams of converted sites, for code with no Flax RNG stream (NNX,
  or a linen ``apply`` without ``rngs={"actnn": ..., "sbp": ...}``): each site folds in its
  path. ``actnn``: ActNN's stochastic rounding; ``sbp``: SBP's kept nodes."""
  token = _RNGS.set({"actnn": actnn, "sbp": sbp})
  try:
    yield
  finally:
    _RNGS.reset(token)


def current_rngs() -> dict | None:
  """The keys `rngs` holds now (``{"actnn": ..., "sbp": ...}``), None outside it."""
  keys = _RNGS.get()
  if keys is None or all(v is None for v in keys.values()):
    return None
  return dict(keys)


def context_key(stream: str, path: str, args=(), fold: str | None = None):
  """The ``stream`` key of `rngs` for the site at ``path`` (None without one), folded with
  ``fold`` (default ``path``; one string for several sites gives them one key).

  Raises if the key is a constant of a trace whose site arguments are traced: the context
  was entered outside the jitted function, so every later call would reuse this one key.
  """
  keys = _RNGS.get()
  key = None if keys is None else keys.get(stream)
  if key is None:
    return None
  traced = any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves(args))
  if traced and not isinstance(key, jax.core.Tracer) and _under_jit():
    raise ValueError(
        f"jmem.surgery.rngs({stream}=...) holds a concrete key while the site {path!r} is being "
        "traced: the context was entered outside the jitted function, so the compiled step "
        "would reuse this key on every call. Pass the key into the jitted step as an argument "
        "and enter `with jmem.surgery.rngs(...)` inside it (linen: apply(..., rngs={...}) "
        "inside it).")
  if not jax.dtypes.issubdtype(jnp.asarray(key).dtype, jax.dtypes.prng_key):
    key = jax.random.wrap_key_data(key) if key.dtype == jnp.uint32 else key
  fold = path if fold is None else fold
  return jax.random.fold_in(key, zlib.crc32(fold.encode()) & 0x7FFFFFFF)


def _under_jit() -> bool:
  """Whether the current trace is staged for compilation (JAX's own check where it has one;
  without it, no check: a concrete key under eager grad is fine)."""
  from jax._src import core as jax_core  # pylint: disable=g-import-not-at-top
  check = getattr(jax_core, "unsafe_am_i_under_a_jit", None)
  return bool(check()) if check is not None else False


def data_key(flat_args) -> jax.Array:
  """A PRNG key from the arguments' values (so it changes when the data change): what a
  site uses when no key reached it."""
  acc = jnp.uint32(0x9E3779B9)
  for a in flat_args:
    if hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating) and a.size:
      s = jnp.sum(a.astype(jnp.float32)) + jnp.float32(a.size)
      acc = acc * jnp.uint32(16777619) ^ jax.lax.bitcast_convert_type(s, jnp.uint32)
  return jax.random.key(jax.lax.stop_gradient(acc))
