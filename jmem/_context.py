"""The context variables of `jmem.convert`'s sites: the batch mask and the RNG keys
(`rngs`, public as ``jmem.rngs``), and whether a site without a key may draw one from the
data (`data_keys`). A low module: the training step enters them without importing the
model surgery."""

from __future__ import annotations

import contextlib
import contextvars
import zlib

import jax
import jax.numpy as jnp
import numpy as np

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


# The streams `rngs(key)` makes from one key. "dropout" is the key itself (what
# ``rngs={"dropout": key}`` gives a linen model, so its dropout draws as before); jmem's
# sites fold a constant into it: 0x61 ("a") for ActNN's rounding, 0x73 ("s") for SBP's nodes.
_FOLDS = {"actnn": 0x61, "sbp": 0x73}


class RngStreams(dict):
  """Keys of RNG streams by name (`rngs` makes it): a mapping and a context manager.

  As a mapping it is what linen's ``apply(..., rngs=...)`` takes; as a context manager it
  gives the keys to `jmem.convert`'s sites that no Flax stream reaches (NNX, plain code):
  each site folds in its path. A pytree (its keys are leaves), so it can cross ``jax.jit``.
  """

  def __enter__(self) -> "RngStreams":
    self.__dict__.setdefault("_tokens", []).append(_RNGS.set(dict(self)))
    return self

  def __exit__(self, *exc) -> None:
    _RNGS.reset(self.__dict__["_tokens"].pop())

  def __repr__(self) -> str:
    return f"jmem.rngs({{{', '.join(repr(k) for k in self)}}})"


jax.tree_util.register_pytree_node(
    RngStreams, lambda r: (tuple(r[k] for k in sorted(r)), tuple(sorted(r))),
    lambda names, keys: RngStreams(zip(names, keys)))


def check_key(key, name: str):
  """``key`` if it is a PRNG key (typed, or raw ``uint32``), else a TypeError."""
  dtype = getattr(key, "dtype", None)
  if dtype is not None and (jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) or (
      dtype == jnp.uint32 and np.ndim(key) == 1)):
    return key
  raise TypeError(f"{name} must be a PRNG key, e.g. jax.random.key(0) (a new key "
                  f"per step: jax.random.fold_in(key, step)), got {type(key).__name__}"
                  f"{'' if dtype is None else f' of dtype {dtype}'}.")


def rngs(key: jax.Array | None = None, /, *, dropout: jax.Array | None = None,
         actnn: jax.Array | None = None, sbp: jax.Array | None = None) -> RngStreams:
  """Every RNG stream a model converted by `jmem.convert` draws from, out of one key.

  Converted ActNN sites round stochastically (stream ``"actnn"``), SBP sites sample the
  nodes they keep (``"sbp"``), and dropout draws from ``"dropout"``. A site that is
  differentiated without its key raises, naming the streams; inference needs no key.

  Args:
    key: one PRNG key (``jax.random.key(seed)``; a new one each step, e.g.
      ``jax.random.fold_in(key, step)``). ``"dropout"`` is ``key`` itself (as
      ``rngs={"dropout": key}``), ``"actnn"`` and ``"sbp"`` are keys folded from it.
    dropout, actnn, sbp: a key for that stream alone, instead of (or replacing) the one
      derived from ``key``. ``jmem.surgery.rngs(actnn=k, sbp=k2)`` is this.

  Returns:
    A `RngStreams`, a ``dict`` of stream name -> key (the streams given), used either way:

    * linen: ``model.apply(variables, x, train=True, rngs=jmem.rngs(key))``;
    * NNX or plain code: ``with jmem.rngs(key): y = model(x)`` (enter it inside the jitted
      step, with a key that is an argument of the step: a concrete key captured by the
      trace would be reused every step, and raises).

  Examples:
    >>> key = jax.random.fold_in(jax.random.key(0), step)
    >>> logits = model.apply(variables, x, train=True, rngs=jmem.rngs(key))
    >>> with jmem.rngs(key):
    ...   logits = nnx_model(x)
  """
  out = {}
  if key is not None:
    key = check_key(key, "jmem.rngs's key")
    out = {"dropout": key, **{s: jax.random.fold_in(key, c) for s, c in _FOLDS.items()}}
  for name, k in (("dropout", dropout), ("actnn", actnn), ("sbp", sbp)):
    if k is not None:
      out[name] = check_key(k, f"jmem.rngs's {name}")
  return RngStreams(out)


def current_rngs() -> dict | None:
  """The keys `rngs` holds now as a context (stream -> key), None outside it."""
  keys = _RNGS.get()
  if not keys:
    return None
  return dict(keys)


_DATA_KEYS: contextvars.ContextVar = contextvars.ContextVar("jmem_data_keys", default=False)


@contextlib.contextmanager
def data_keys():
  """Lets the sites of `jmem.convert` that no key reaches draw one from the data.

  Without a key (no Flax stream, no `rngs` context) an ActNN or SBP site that is
  differentiated raises, naming the streams it needs. Inside this context it instead
  derives its key from the values of its arguments: it changes as the data change, but
  repeats for a repeated batch, so prefer `rngs`. Enter it where the model is called (and
  traced), e.g. inside the loss::

    with jmem.surgery.data_keys():
      logits = model.apply(variables, x, train=True)
  """
  token = _DATA_KEYS.set(True)
  try:
    yield
  finally:
    _DATA_KEYS.reset(token)


def data_keys_allowed() -> bool:
  """Whether `data_keys` is entered."""
  return _DATA_KEYS.get()


def missing_key(stream: str, path: str, what: str, streams=None):
  """The hook a site with no ``stream`` key runs when it is differentiated: None inside
  `data_keys` (the site then draws a key from the data), else one that raises ValueError
  naming the ``streams`` (default: just ``stream``) the model needs and how to pass them."""
  if data_keys_allowed():
    return None
  names = sorted(set(streams or ()) | {stream})
  listed = " and ".join(repr(n) for n in names)

  def raise_():
    raise ValueError(
        f"jmem.convert: the {what} at {path or '<top>'!r} is differentiated without a key: no "
        f"{stream!r} RNG stream reached it. This model needs the RNG stream"
        f"{'s' * (len(names) > 1)} {listed}; give one key per step, inside the jitted step: "
        "linen: model.apply(variables, x, train=True, rngs=jmem.rngs(key)) (inside nn.scan / "
        f"nn.vmap, add {listed} to split_rngs); NNX or plain code: `with jmem.rngs(key): y = "
        "model(x)`. jmem.train_step and jmem.train.train do this for you. Inference needs no "
        "key. To draw the keys from the data instead (they repeat for a repeated batch), call "
        "the model inside `with jmem.surgery.data_keys():`.")
  return raise_


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
        f"jmem.rngs holds a concrete {stream!r} key while the site {path!r} is being traced: "
        "the context was entered outside the jitted function, so the compiled step would "
        "reuse this key on every call. Pass the key into the jitted step as an argument and "
        "enter `with jmem.rngs(key):` inside it (linen: apply(..., rngs=jmem.rngs(key)) "
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
  site uses when no key reached it (inside `data_keys`, or in a forward pass, which draws
  nothing that is used)."""
  acc = jnp.uint32(0x9E3779B9)
  for a in flat_args:
    if hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating) and a.size:
      s = jnp.sum(a.astype(jnp.float32)) + jnp.float32(a.size)
      acc = acc * jnp.uint32(16777619) ^ jax.lax.bitcast_convert_type(s, jnp.uint32)
  return jax.random.key(jax.lax.stop_gradient(acc))
