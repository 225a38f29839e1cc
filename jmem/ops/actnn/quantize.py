"""Per-group stochastic-rounding quantization packed into bytes, and `compress`.

`quantize` flattens each sample (axis 0), pads it to groups of ``group_size``, and per
group stores the minimum ``mn`` (float32, exact) and the scale ``s = (2^b - 1) / span``
rounded DOWN to bfloat16, so that every code lands in ``[0, 2^b - 1]``; ``span`` is
``mx - mn`` widened by the float32 resolution of the group's values (`group_span`). Codes
``q = floor((x - mn) s + u)``, ``u ~ U[0, 1)`` (stochastic rounding, so
``E[q / s + mn] = x`` exactly for the stored ``mn`` and ``s``), packed ``8 / b`` per byte.
Metadata: 6 bytes per group (9.4% on top of the 64 bytes of 2-bit codes of a group of 256).
The minimum is kept in float32 because a bfloat16 minimum can sit far below the group's
values when they are far from 0 compared with their range (1001.5 + U(0, 1): a bf16
minimum of 1000.0 stretches the span 2.5x and the 2-bit variance about 6x); the scale's
relative rounding error is below 2^-7, so the span used is at most 1% wider than the
group's range plus 2^-22 of the group's largest magnitude (below float32's resolution
there is nothing left to quantize).

Layout: within a group, byte ``k`` holds the values ``k + j * n`` (``n = group_size * b /
8``) at bit ``j * b`` (plane ``j``); the Pallas kernels of `pallas_kernels.quantize` read
and write each plane as one contiguous slice. `compress` quantizes a residual of 3 or more
dims in rows of its last two dims (`_row_layout`: where the shards of a spatially sharded
activation lie), else per sample.

`compress(f)` is the GACT idea as a JAX transform: a function with ``f``'s signature whose
backward uses 2-bit (or ``bits``) copies of ``f``'s floating-point residuals. The residuals
are the leaves of ``jax.vjp(f, ...)``'s VJP function; the ones that are ``f``'s own
arguments (parameters, inputs) are kept as they are (they are alive anyway), booleans are
bit-packed, scalars broadcast to full size (the zeros an activation's derivative selects
from) are stored as the one number, other integers kept. Max pooling inside ``f``
(``reduce_window_max``, e.g. ``nn.max_pool`` in a stem) saves the uint8 index of each
window's maximum instead of its input, so its gradient stays exact and its backward needs
no ``select_and_scatter`` (`jmem._window.indexed_max_pool`). Residuals that are linear in
other values (BatchNorm's ``x - mean`` and ``2 x``, a ReLU's output, a bfloat16 copy of a
weight) are not stored: each convolution output (or other source) is quantized once and
they are rebuilt from it in the backward pass (`jmem.ops.actnn._derive`). Each residual is
compressed where the forward pass makes it (the next reader waits for its copy), and a
site's backward releases its input cotangents only with its parameter gradients, so that
neither pass keeps more float copies alive than its current layer needs.

Implementations (`jmem._backends`, ops `QUANTIZE_PACK` and `UNPACK_DEQUANTIZE`):
``implementation="xla"`` (pure JAX, the reference and the default off GPUs), ``"pallas"``
(the fused kernels; in interpret mode, with a warning, off GPUs), any other registered
backend, or ``None`` (automatic: XLA, on GPUs too, where a whole step with the kernels is
slower and bigger; see the registration below).

References:
  Chen et al., ActNN: Reducing Training Memory Footprint via 2-Bit Activation Compressed
  Training, ICML 2021, https://arxiv.org/abs/2104.14129
  Liu et al., GACT: Activation Compressed Training for Generic Network Architectures,
  ICML 2022, https://arxiv.org/abs/2206.11357
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np

from jmem import _backends
from jmem import _window
from jmem._axes import barrier
from jmem._context import data_key
from jmem._elementwise import group_scale, group_span, hash_uniform, key_seed, scale_floor, seed_fold_in, truncate_to_bfloat16  # pylint: disable=unused-import
from jmem._technique import EXACT_RESIDUAL
from jmem._technique import IMPLEMENTATIONS  # pylint: disable=unused-import
from jmem.ops.actnn import _derive

__all__ = ["SUPPORTED_BITS", "Quantized", "quantize", "dequantize", "packed_nbytes",
           "pack_bits", "unpack_bits", "compress", "group_statistics", "hash_uniform",
           "check_config", "fake_quantize", "probe", "truncate_to_bfloat16", "group_span",
           "resolve_implementation", "OPS", "offload_residuals"]

SUPPORTED_BITS = (1, 2, 4, 8)


class Quantized(NamedTuple):
  """A quantized array: ``codes`` ``uint8[N, groups * group_size * bits / 8]``,
  ``minimum`` ``float32[N, groups]`` and ``scale`` ``bfloat16[N, groups]`` (shape and
  dtype are static)."""

  codes: jax.Array
  minimum: jax.Array
  scale: jax.Array


def check_config(bits: int, group_size: int) -> None:
  """Raises a clear ValueError for unsupported ``bits`` or a bad ``group_size``."""
  if isinstance(bits, bool) or bits not in SUPPORTED_BITS or not isinstance(bits, int):
    raise ValueError(f"bits must be one of {SUPPORTED_BITS} (an int), got {bits!r}.")
  if (isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0
      or (group_size * bits) % 8):
    raise ValueError(f"group_size must be a positive integer with group_size * bits a "
                     f"multiple of 8, got group_size={group_size!r} (bits={bits}).")


OPS = (_backends.QUANTIZE_PACK, _backends.UNPACK_DEQUANTIZE)   # what ActNN's kernels replace
# The name scope of the quantize + pack: the packed codes' op_name in a compiled step holds
# it (their bytes scale with the bits; `jmem.plan` resizes them in a step's heap layout).
CODES_SCOPE = "actnn_codes"


def resolve_implementation(implementation: str | None, *, bits: int, group_size: int) -> str:
  """The registered implementation that runs ``(bits, group_size)`` (`jmem._backends.choose`).

  ``None`` is the XLA path everywhere, GPUs included, where a step with the Pallas kernels
  was slower and bigger (the registration below). A named backend is validated against
  the registry; one that cannot take the configuration raises ValueError.
  """
  return _backends.choose(implementation, OPS, "ActNN", bits=bits,
                          group_size=group_size)


def pack_bits(codes: jax.Array, bits: int) -> jax.Array:
  """``uint8[..., n]`` codes below ``2^bits`` -> ``uint8[..., n * bits / 8]`` (consecutive
  codes share a byte; used for boolean masks)."""
  per = 8 // bits
  c = codes.reshape(codes.shape[:-1] + (-1, per)).astype(jnp.uint8)
  shifts = jnp.arange(per, dtype=jnp.uint8) * bits
  return jnp.sum(c << shifts, axis=-1, dtype=jnp.uint8) if per > 1 else c[..., 0]


def unpack_bits(packed: jax.Array, bits: int) -> jax.Array:
  """Inverse of `pack_bits`."""
  per = 8 // bits
  shifts = jnp.arange(per, dtype=jnp.uint8) * bits
  c = (packed[..., None] >> shifts) & jnp.uint8((1 << bits) - 1)
  return c.reshape(packed.shape[:-1] + (-1,))


def _pack_planes(q, bits):
  """``uint8[..., group_size]`` codes -> ``uint8[..., group_size * bits / 8]``, plane
  layout (byte k holds values k + j n at bit j bits)."""
  per = 8 // bits
  c = q.reshape(q.shape[:-1] + (per, -1)).astype(jnp.uint8)
  shifts = (jnp.arange(per, dtype=jnp.uint8) * bits)[:, None]
  return jnp.sum(c << shifts, axis=-2, dtype=jnp.uint8) if per > 1 else c[..., 0, :]


def _unpack_planes(packed, bits):
  per = 8 // bits
  shifts = (jnp.arange(per, dtype=jnp.uint8) * bits)[:, None]
  c = (packed[..., None, :] >> shifts) & jnp.uint8((1 << bits) - 1)
  return c.reshape(packed.shape[:-1] + (-1,))


def _flat(x):
  n = x.shape[0] if x.ndim else 1
  return x.reshape(n, -1), n


def _range_safe_groups(x, group_size, dtype=jnp.float32):
  """``dtype[N, G, group_size]`` groups of each flattened sample; pad positions repeat the
  group's first value (padding must not widen the group's range). No copy is made when
  the sample size is a multiple of ``group_size``."""
  flat, n = _flat(x)
  flat = flat.astype(dtype)
  per = flat.shape[1]
  g = -(-per // group_size)
  if per == g * group_size:
    return flat.reshape(n, g, group_size)
  grouped = jnp.pad(flat, ((0, 0), (0, g * group_size - per))).reshape(n, g, group_size)
  valid = (jnp.arange(g * group_size) < per).reshape(g, group_size)
  return jnp.where(valid, grouped, grouped[..., :1])


def _ungroup(values, shape, dtype):
  """Grouped values (any layout of ``N * G * group_size``) back to ``shape``: drops the
  padding."""
  n = shape[0] if shape else 1
  per = int(np.prod(shape[1:])) if len(shape) else 1
  flat = values.reshape(n, -1)
  if flat.shape[1] != per:
    flat = flat[:, :per]
  return flat.reshape(shape).astype(dtype)


def group_statistics(x: jax.Array, *, bits: int, group_size: int):
  """``(groups float32[N, G, group_size], minimum float32[N, G], scale bf16[N, G])``.

  Pad positions repeat the group's first value (padding must not widen the range); the
  scale is rounded down to bfloat16, so that every code of ``(x - minimum) * scale`` lies
  in ``[0, 2^bits - 1]``. A NaN anywhere in a group makes its minimum NaN.
  """
  levels = float(2**bits - 1)
  grouped = _range_safe_groups(x, group_size)
  mn = jnp.min(grouped, axis=-1)
  return grouped, mn, group_scale(levels, mn, jnp.max(grouped, axis=-1)).astype(jnp.bfloat16)


def dither_seed(key: jax.Array) -> jax.Array:
  """The uint32 seed of the dither (`hash_uniform`) that ``key`` gives."""
  return key_seed(key)


def quantize(x: jax.Array, key: jax.Array, *, bits: int = 2, group_size: int = 256,
             implementation: str | None = None, interpret: bool | None = None) -> Quantized:
  """Per-sample, per-group stochastic-rounding quantization of a float array.

  Args:
    x: float array (float32, bfloat16 or float16); axis 0 is the sample axis.
    key: PRNG key of the stochastic rounding.
    bits: 1, 2, 4 or 8.
    group_size: values per group (``group_size * bits`` a multiple of 8).
    implementation: ``"xla"``, ``"pallas"`` (the fused statistics + quantize + pack kernel
      of `pallas_kernels.quantize`; bit-identical codes in interpret mode), another name
      registered in `jmem._backends`, or ``None`` (`resolve_implementation`: XLA, on a
      GPU too).
    interpret: Pallas interpret mode (``None``: on non-GPU backends, with a warning).

  Returns:
    `Quantized`; `dequantize` with ``x``'s shape and dtype restores an unbiased estimate.
  """
  check_config(bits, group_size)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"quantize takes a float array, got dtype {x.dtype}; integer and boolean "
                    "arrays need no quantization (booleans: pack_bits(x, 1)).")
  if x.size == 0:
    raise ValueError(f"quantize got an empty array of shape {x.shape}: nothing to compress "
                     "(keep empty residuals as they are).")
  implementation = resolve_implementation(implementation, bits=bits, group_size=group_size)
  return _quantize_seeded(x, dither_seed(key), bits=bits, group_size=group_size,
                          implementation=implementation, interpret=interpret)


def _quantize_seeded(x, seed, *, bits, group_size, implementation, interpret) -> Quantized:
  """`quantize` with the dither's uint32 ``seed`` (value ``i`` of ``x``, in row-major order,
  rounds with ``hash_uniform(i, seed)``)."""
  grouped = _range_safe_groups(x, group_size, dtype=x.dtype)
  n, g = grouped.shape[:2]
  with jax.named_scope(CODES_SCOPE):     # names the packed codes in the compiled step
    codes, mn, scale = _backends.get(_backends.QUANTIZE_PACK, implementation)(
        grouped.reshape(n * g, group_size), seed, bits=bits, interpret=interpret)
    codes = codes.reshape(n, -1)
  return Quantized(codes, mn.reshape(n, g), scale.reshape(n, g))


def dequantize(qx: Quantized, shape: tuple[int, ...], dtype, *, bits: int = 2,
               group_size: int = 256, implementation: str | None = None,
               interpret: bool | None = None) -> jax.Array:
  """``x̂ = q / s + mn`` back to ``shape`` and ``dtype`` (``implementation`` as `quantize`)."""
  check_config(bits, group_size)
  implementation = resolve_implementation(implementation, bits=bits, group_size=group_size)
  n, g = qx.minimum.shape
  x = _backends.get(_backends.UNPACK_DEQUANTIZE, implementation)(
      qx.codes.reshape(n * g, -1), qx.minimum.reshape(-1), qx.scale.reshape(-1), bits=bits,
      dtype=dtype, interpret=interpret)
  return _ungroup(x, shape, dtype)


# ----------------------------------------------- the op's backends (`jmem._backends`)
# QUANTIZE_PACK: ``(groups float[rows, group_size], seed uint32[], *, bits, interpret) ->
# (codes uint8[rows, group_size * bits / 8], minimum float32[rows], scale bfloat16[rows])``.
# UNPACK_DEQUANTIZE: ``(codes, minimum, scale, *, bits, dtype, interpret) ->
# dtype[rows, group_size]``. ``interpret`` is the Pallas interpreter switch (None:
# automatic, with a warning off the GPU); the XLA reference ignores it.
# The XLA functions also take leading dims before ``rows`` (``seed`` then one per leading
# index), which `compress`'s row layout uses in place of a vmap.

def _quantize_pack_xla(groups, seed, *, bits, interpret=None):
  del interpret
  levels = float(2**bits - 1)
  grouped = groups.astype(jnp.float32)
  mn = jnp.min(grouped, axis=-1)
  scale = group_scale(levels, mn, jnp.max(grouped, axis=-1))
  v = (grouped - mn[..., None]) * scale[..., None]
  # Value j of each [rows, group_size] slab rounds with hash_uniform(j, its seed).
  index = jnp.arange(grouped.shape[-2] * grouped.shape[-1], dtype=jnp.uint32)
  seed = jnp.reshape(seed, jnp.shape(seed) + (1, 1))
  q = hash_uniform(index.reshape(grouped.shape[-2:]), seed)
  q = jnp.clip(jnp.floor(v + q), 0.0, levels).astype(jnp.uint8)
  return _pack_planes(q, bits), mn, scale.astype(jnp.bfloat16)


def _unpack_dequantize_xla(codes, minimum, scale, *, bits, dtype, interpret=None):
  del interpret
  q = _unpack_planes(codes, bits).astype(jnp.float32)
  return (q / scale.astype(jnp.float32)[..., None] + minimum[..., None]).astype(dtype)


def _quantize_pack_pallas(groups, seed, *, bits, interpret=None):
  from pallas_kernels import quantize as kernels  # pylint: disable=g-import-not-at-top
  return kernels.quantize_pack(groups, seed, bits=bits, interpret=interpret)


def _unpack_dequantize_pallas(codes, minimum, scale, *, bits, dtype, interpret=None):
  from pallas_kernels import quantize as kernels  # pylint: disable=g-import-not-at-top
  return kernels.unpack_dequantize(codes, minimum, scale, bits=bits, dtype=dtype,
                                   interpret=interpret)


def _triton_blocks(*, bits, group_size):
  """Why the Triton kernels cannot take ``(bits, group_size)`` (None: they can)."""
  from pallas_kernels import quantize as kernels  # pylint: disable=g-import-not-at-top
  if kernels.supports(bits, group_size):
    return None
  return (f"the Pallas kernels need group_size and group_size * bits / 8 to be powers of "
          f"two, got group_size={group_size}, bits={bits}")


_backends.register(_backends.QUANTIZE_PACK, "xla", _quantize_pack_xla)
_backends.register(_backends.UNPACK_DEQUANTIZE, "xla", _unpack_dequantize_xla)
# The kernels are not the GPU default: alone they move more bytes per second than the XLA
# path, but a step built with them is slower and bigger, since each is a custom call that XLA
# cannot fuse with the op producing or consuming the residual. ResNet-50 224² at batch 128 on
# an H200 (benchmarks/results/gpu/gpu_nvidia_h200_2026-11-28.md): L3 steps at 1.21x exact's
# time with XLA against 1.44x with the kernels in float32, 1.52x against 1.91x in bfloat16,
# and the kernels' step was bigger on the H100 target; an H100 gave the same order. (Both
# before commit a4ac081 changed what is stored; docs/gpu.md has today's figures.)
_backends.register(_backends.QUANTIZE_PACK, "pallas", _quantize_pack_pallas,
                   unsupported=_triton_blocks)
_backends.register(_backends.UNPACK_DEQUANTIZE, "pallas", _unpack_dequantize_pallas,
                   unsupported=_triton_blocks)


def packed_nbytes(shape: tuple[int, ...], *, bits: int = 2, group_size: int = 256) -> int:
  """Bytes of a `Quantized` array of ``shape``: codes plus a float32 minimum and a bf16
  scale per group."""
  n = shape[0] if shape else 1
  per = int(np.prod(shape[1:])) if len(shape) > 1 else 1
  g = -(-per // group_size)
  return n * g * (group_size * bits // 8 + 6)


# ------------------------------------------------------------------ max pooling

# Calls whose bodies are inlined to find max pools (``jax.jit`` inside a site). Pools inside
# other higher-order primitives (``jax.checkpoint``, ``scan``, ``cond``, ``shard_map``) keep
# ``lax.reduce_window``'s VJP: their input is then quantized like any other residual.
_INLINED_CALLS = ("pjit", "jit")


def _indexable(eqn) -> bool:
  p = eqn.params
  return (eqn.primitive.name == "reduce_window_max"
          and all(d == 1 for d in p["base_dilation"])
          and all(d == 1 for d in p["window_dilation"])
          and _window.indexable_max_pool(eqn.invars[0].aval.shape, eqn.invars[0].aval.dtype,
                                         p["window_dimensions"], p["window_strides"],
                                         p["padding"]))


def _inner(eqn):
  inner = eqn.params.get("jaxpr") if eqn.primitive.name in _INLINED_CALLS else None
  return getattr(inner, "jaxpr", inner), getattr(inner, "consts", ())


def _max_pools(jaxpr) -> bool:
  """Whether ``jaxpr`` (or a jit call inside it) has a max pool `_indexable` takes."""
  for eqn in jaxpr.eqns:
    inner, _ = _inner(eqn)
    if _indexable(eqn) or (inner is not None and _max_pools(inner)):
      return True
  return False


def _with_indexed_max_pools(f):
  """``f`` with each max pooling it traces (``reduce_window_max``, e.g. ``nn.max_pool``)
  replaced by `jmem._window.indexed_max_pool`: the same values, an exact gradient, and a
  uint8 index per output as its residual instead of the pooled input (which `compress`
  would otherwise quantize, moving the maximum) and a backward without
  ``select_and_scatter``. Floating pools of 16 bits or more, undilated, with at most 256
  positions per window and a non-empty output; others keep ``lax.reduce_window``'s. ``f``
  without such a pool is called as it is (after one trace to look). A ``jax.jit`` inside
  ``f`` that pools is inlined."""

  def g(*args):
    flat, tree = jax.tree.flatten(args)
    box = {}

    def flat_f(*flat):
      out = f(*jax.tree.unflatten(tree, flat))
      leaves, box["tree"] = jax.tree.flatten(out)
      return leaves

    closed = jax.make_jaxpr(flat_f)(*flat)
    if not _max_pools(closed.jaxpr):
      return f(*args)
    return jax.tree.unflatten(box["tree"], _eval_pools_indexed(closed.jaxpr, closed.consts,
                                                               flat))
  return g


def _eval_pools_indexed(jaxpr, consts, args):
  env = dict(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  read = lambda v: v.val if isinstance(v, jax.extend.core.Literal) else env[v]
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    inner, inner_consts = _inner(eqn)
    if _indexable(eqn):
      p = eqn.params
      outs = _bind(eqn, ins, lambda x: [_window.indexed_max_pool(
          x, p["window_dimensions"], p["window_strides"], p["padding"])])
    elif inner is not None and _max_pools(inner):
      outs = _bind(eqn, ins, lambda *a: _eval_pools_indexed(inner, inner_consts, a))
    else:
      outs = _bind(eqn, ins)
    env.update(zip(eqn.outvars, outs))
  return [read(v) for v in jaxpr.outvars]


# ------------------------------------------------------------------------ the transform

def _is_arg(leaf, args):
  return any(leaf is a for a in args)


def _param_leaves(args, param_argnums):
  return jax.tree.leaves([a for i, a in enumerate(args) if i in param_argnums])


def _vjp_with_constants(f, args, *, index_max_pools=False, store=None, derive=None):
  """``(y, residual leaves, vjp treedef, {leaf index: scalar}, zero inputs)`` of
  ``jax.vjp(f, *args)``; zero inputs: the positions of ``args``' leaves whose cotangent is
  zero (`_zero_cotangents`).

  ``index_max_pools``: if ``f`` max-pools, the VJP of `_with_indexed_max_pools` ``(f)``
  instead (traced again only then: a site without a max pool costs no extra trace).

  The VJP is traced to a jaxpr once and evaluated in the caller's trace, so each residual
  is known both as a value and as the jaxpr variable that made it. Residuals that are a
  scalar literal (or one broadcast to full size, e.g. the zeros an activation's derivative
  selects from) are listed with their value: they cost a full-size buffer and carry one
  number, so `compress` stores the number and rebuilds the array in the backward pass.
  (Quantizing one also made XLA constant-fold a min/max over the whole broadcast at compile
  time, which grows with the batch.) Residuals named `EXACT_RESIDUAL` (by the op that saved
  them, e.g. InPlace-ABN's output, which its backward inverts) are listed as ``_EXACT``:
  `compress` keeps them as they are, and the value they name where it is a residual too.
  Only names at the top level of ``f``'s trace are seen: one inside a ``jax.jit`` called by
  ``f`` is not (the residual then comes out of the call).

  ``store(indices, leaf, constant) -> leaf``: called once for each value that is a residual
  (at the positions ``indices``) as soon as the forward pass has made it (``constant(i)``:
  position ``i``'s entry of the returned dict, or None), before any later operation runs;
  the value it returns stands for the residual in the rest of the forward pass (`compress`
  returns it tied to the residual's compressed copy, so that the copy is made while the
  residual is fresh and the float buffer dies with its last forward use, not at the end of
  the site). Without it the VJP's forward is evaluated whole.

  ``derive(jaxpr, number of outputs, VJP treedef, output treedef) -> ({position: recipe},
  extra variables)`` (with ``store``; the jaxpr's outputs are ``f``'s, then the
  residuals): the residuals at the returned positions are not stored but rebuilt in the
  backward pass from the extra variables and the stored residuals
  (`jmem.ops.actnn._derive`); ``store`` is called on the extras too, at positions after
  the residuals'.
  """
  box = {}

  def traced(fn):
    def vjp(*a):
      y, vjp_fn = jax.vjp(fn, *a)
      leaves, box["treedef"] = jax.tree.flatten(vjp_fn)
      box["y"] = jax.tree.structure(y)
      return jax.tree.leaves(y), leaves
    return vjp

  closed = jax.make_jaxpr(traced(f))(*args)
  if index_max_pools and _max_pools(closed.jaxpr):
    closed = jax.make_jaxpr(traced(_with_indexed_max_pools(f)))(*args)
  n_y = box["y"].num_leaves
  producers = {v: e for e in closed.jaxpr.eqns for v in e.outvars}
  # The value an EXACT_RESIDUAL name wraps is the same buffer, read elsewhere under its own
  # variable (the next layer's input): kept once, not also quantized beside it.
  exact = set()
  for e in closed.jaxpr.eqns:
    if e.primitive.name == "name" and e.params.get("name") == EXACT_RESIDUAL:
      exact.update(v for v in (e.invars[0], e.outvars[0])
                   if not isinstance(v, jax.extend.core.Literal))
  constants = {}
  for i, v in enumerate(closed.jaxpr.outvars[n_y:]):
    if not isinstance(v, jax.extend.core.Literal) and v in exact:
      constants[i] = _EXACT
      continue
    if isinstance(v, jax.extend.core.Literal):
      value = v.val
    else:
      eqn = producers.get(v)
      if (eqn is None or eqn.primitive.name != "broadcast_in_dim"
          or not isinstance(eqn.invars[0], jax.extend.core.Literal)):
        continue
      value = eqn.invars[0].val
    if np.ndim(value) == 0:
      constants[i] = np.asarray(value).item()
  if store is None:
    flat = jax.extend.core.jaxpr_as_fun(closed)(*jax.tree.leaves(args))
  else:
    residuals = closed.jaxpr.outvars[n_y:]
    recipes, extras = (derive(closed.jaxpr, n_y, box["treedef"], box["y"]) if derive
                       else ({}, []))
    targets = [None if i in recipes else v for i, v in enumerate(residuals)] + list(extras)
    flat = _eval_storing(closed, jax.tree.leaves(args), targets,
                         lambda indices, leaf: store(indices, leaf, constants.get))
  y, leaves = jax.tree.unflatten(box["y"], flat[:n_y]), list(flat[n_y:])
  zero = _zero_cotangents(box["treedef"], [v.aval for v in closed.jaxpr.outvars[n_y:]],
                          [v.aval for v in closed.jaxpr.outvars[:n_y]], box["y"])
  return y, leaves, box["treedef"], constants, zero


# One-operand ops that keep a zero a zero (what the zeros JAX instantiates pass through).
_ZERO_PRESERVING = ("broadcast_in_dim", "pvary", "convert_element_type", "reshape", "copy",
                    "copy_p", "squeeze", "expand_dims", "transpose")


def _zero_cotangents(treedef, residuals, outputs, out_tree) -> frozenset:
  """Positions of the inputs whose cotangent the VJP (``treedef`` over ``residuals``, for
  cotangents of ``outputs``) computes as zeros: its traced backward returns a literal 0 or
  a broadcast of one there (what ``jax.vjp`` instantiates for a symbolic zero), whatever
  custom rules or effects led to it."""
  backward = _backward_jaxpr(treedef, residuals, outputs, out_tree).jaxpr
  producers = {v: e for e in backward.eqns for v in e.outvars}

  def is_zero(v):
    if _literal(v):
      return not np.any(v.val)
    e = producers.get(v)
    # (Under shard_map the zeros are also marked as varying: a pvary of the broadcast.)
    return (e is not None and e.primitive.name in _ZERO_PRESERVING
            and len(e.invars) == 1 and is_zero(e.invars[0]))
  return frozenset(i for i, v in enumerate(backward.outvars) if is_zero(v))


def _bind(eqn, ins, instead=None):
  """``eqn`` applied to ``ins`` in the caller's trace (or ``instead(*ins)``, a list of its
  outputs), under its own name scope (what `jmem.measure.peak_buffers` reports) and context
  (``compute_on``, metadata), as ``jax.core.eval_jaxpr`` does; returns the list of its
  outputs."""
  scope = str(eqn.source_info.name_stack)
  with jax.named_scope(scope) if scope else contextlib.nullcontext(), eqn.ctx.manager:
    if instead is not None:
      return list(instead(*ins))
    outs = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
  return list(outs) if eqn.primitive.multiple_results else [outs]


def _literal(v) -> bool:
  return isinstance(v, jax.extend.core.Literal)


def _eval_storing(closed, args, residuals, store):
  """``closed`` evaluated eqn by eqn, ``store(indices, value)`` called once on each
  variable of ``residuals`` (``residuals[i]`` for ``i`` in ``indices``; None: nothing to
  store there) where it is made (arguments and constants first), its result used for the
  variable from there on."""
  jaxpr = closed.jaxpr
  where: dict[Any, list[int]] = {}
  for i, v in enumerate(residuals):
    if v is not None and not _literal(v):
      where.setdefault(v, []).append(i)
  env = {}

  def write(v, value):
    env[v] = store(where[v], value) if v in where else value

  read = lambda v: v.val if _literal(v) else env[v]
  for v, value in zip(jaxpr.constvars, closed.consts):
    write(v, value)
  for v, value in zip(jaxpr.invars, args):
    write(v, value)
  for eqn in jaxpr.eqns:
    for v, value in zip(eqn.outvars, _bind(eqn, [read(v) for v in eqn.invars])):
      write(v, value)
  for i, v in enumerate(residuals):      # literals: nothing to wait for
    if v is not None and _literal(v):
      store([i], v.val)
  return [read(v) for v in jaxpr.outvars]


def _is_array(value) -> bool:
  """Whether ``value`` is a non-empty array a barrier can hold (not float0)."""
  return (hasattr(value, "dtype") and value.dtype != jax.dtypes.float0 and
          np.size(value) > 0)


_EXACT = object()   # `_vjp_with_constants`'s mark of a residual named EXACT_RESIDUAL


def _residual_kind(leaf, kept, min_size, constant=None, inputs=None) -> str:
  """How `compress` stores a residual: "quant" (floats), "bool" (bit-packed), "const" (a
  broadcast scalar, rebuilt in the backward) or "keep" (parameters, small, integer, named
  `EXACT_RESIDUAL` by the op that saved it, or, given the ``inputs``, a float that is not
  one of them)."""
  if _is_arg(leaf, kept) or leaf.size == 0 or constant is _EXACT:
    return "keep"
  if constant is not None:
    return "const"
  if jnp.issubdtype(leaf.dtype, jnp.floating) and leaf.size >= min_size:
    return "quant" if inputs is None or _is_arg(leaf, inputs) else "keep"
  if leaf.dtype == jnp.bool_ and leaf.size % 8 == 0 and leaf.size >= min_size:
    return "bool"
  return "keep"


def compress(f: Callable[..., Any], *, bits: int = 2, group_size: int = 256,
             min_size: int = 1024, param_argnums: tuple[int, ...] = (0,),
             offload: bool = False, implementation: str | None = None,
             interpret: bool | None = None,
             arguments_only: bool = False,
             missing_key: Callable[[], None] | None = None) -> Callable[..., Any]:
  """``f`` whose backward pass uses ``bits``-bit copies of its floating residuals.

  Residuals that are leaves of the ``param_argnums`` arguments (parameters) are kept as
  they are; every other floating residual is quantized, the other arguments (activations
  entering ``f``) included: inside a network nothing else keeps them. (If the caller keeps
  such an input alive anyway, its compressed copy is extra memory: pass its position in
  ``param_argnums``.)

  Args:
    f: any function of arrays (pytrees allowed) that ``jax.vjp`` can differentiate.
    bits: bits per stored value (1, 2, 4, 8).
    group_size: quantization group size.
    min_size: residuals with fewer elements are kept as they are (metadata would cost
      more than it saves).
    param_argnums: positions of the arguments never compressed (default: the first,
      ``f(params, x)``).
    offload: move the compressed residuals to host memory (``pinned_host``) until the
      backward pass (ActNN's L4).
    implementation: ``"xla"``, ``"pallas"`` or ``None`` (automatic), as in `quantize`;
      used for both the quantization and the dequantization.
    interpret: Pallas interpret mode, as in `quantize`.
    arguments_only: quantize only residuals that are ``f``'s own (non-parameter)
      arguments, and keep every other residual as it is (booleans still bit-packed): for a
      ``jax.checkpoint``-ed ``f``, whose residuals are its inputs plus what its policy
      chose to keep exactly (`jmem.ops.policy.save_masks_and_statistics`).
    missing_key: called when ``g`` is differentiated without a ``key``, before the key is
      derived from the data (`jmem.convert`'s sites raise there: a forward pass alone
      needs no key).

  Returns:
    ``g(*args, key=None)`` with ``g(*args) == f(*args)`` in the forward pass. The
    stochastic-rounding key defaults to one derived from the arguments' values (different
    every step as the data change); pass ``key`` to control it. Composes with
    jit, grad, vmap, scan and checkpoint (it is a ``custom_vjp``).

  Raises:
    ValueError: unsupported ``bits``, bad ``group_size`` or unknown ``implementation``.
  """
  check_config(bits, group_size)
  if implementation is not None:   # a named backend is checked now; None is chosen when traced
    implementation = resolve_implementation(implementation, bits=bits, group_size=group_size)
  return _saving_residuals(f, bits=bits, group_size=group_size, min_size=min_size,
                           param_argnums=param_argnums, offload=offload,
                           implementation=implementation, interpret=interpret,
                           arguments_only=arguments_only, missing_key=missing_key)


def offload_residuals(f: Callable[..., Any], *, min_size: int = 1024,
                      param_argnums: tuple[int, ...] = (0,)) -> Callable[..., Any]:
  """``f`` whose floating residuals wait for the backward pass in host memory
  (``pinned_host``), at full precision: `compress`'s rules for what is a residual worth
  moving (not the ``param_argnums`` arguments, not small, broadcast scalars stored as the
  number, booleans bit-packed), without the quantization. The gradient is exact.

  ``jax.checkpoint``'s public policies offload only named values or dots; this moves every
  floating residual of ``f`` of at least ``min_size`` values (smaller, integer and
  parameter residuals stay on the device). On a CPU, host and device memory are the same
  memory: the transfers happen, nothing is saved. Returns ``g(*args, key=None)`` (``key``
  unused), like `compress`.
  """
  return _saving_residuals(f, bits=None, group_size=256, min_size=min_size,
                           param_argnums=param_argnums, offload=True, implementation="xla",
                           interpret=None)


def _saving_residuals(f, *, bits, group_size, min_size, param_argnums, offload,
                      implementation, interpret, arguments_only=False, missing_key=None):
  """`compress` (``bits``) or `offload_residuals` (``bits=None``: floats kept as they are)."""
  kernel_kw = dict(bits=bits, group_size=group_size)

  def g(*args, key=None):
    # One custom_vjp per call: the residual layout (static) is shared by its fwd and bwd.
    layout: dict[str, Any] = {}

    @jax.custom_vjp
    def call(args, key):
      return f(*args)

    def fwd(args, key):
      kept = _param_leaves(args, param_argnums)
      inputs = jax.tree.leaves(args) if arguments_only else None
      if key is None and missing_key is not None:
        missing_key()
      key = data_key(jax.tree.leaves(args)) if key is None else key
      # Resolved here, where the kernels first run (so a wrapper built outside
      # `lowering_for_gpu` makes the choice for a GPU inside it); the backward reuses it.
      impl = (implementation if bits is None or implementation else
              resolve_implementation(None, bits=bits, group_size=group_size))
      layout["kw"] = kw = dict(kernel_kw, implementation=impl,
                               interpret=_interpret_once(impl, interpret))
      seed = dither_seed(key)     # one per call; residual i's is seed_fold_in(seed, i)
      plan, saved = {}, {}

      def store(indices, leaf, constant):
        packed = []
        for i in indices:
          kind = _residual_kind(leaf, kept, min_size, constant(i), inputs)
          if kind == "const":
            plan[i], saved[i] = ("const", leaf.shape, (leaf.dtype, constant(i))), None
          elif kind == "quant" and bits is None:
            plan[i], saved[i] = ("raw", None, None), leaf
          elif kind == "quant":
            plan[i] = ("quant", leaf.shape, leaf.dtype)
            packed.append((i, _quantize_residual(leaf, seed_fold_in(seed, i), **kw)))
          elif kind == "bool":
            plan[i] = ("bool", leaf.shape, None)
            packed.append((i, _pack_mask(leaf)))
          else:                                   # parameters (alive anyway), small, ints
            plan[i], saved[i] = ("keep", None, None), leaf
        if not packed:
          return leaf
        # Compressed where it is made: what reads the residual next waits for its copy, so
        # the float buffer dies with its last forward use (not at the end of the site,
        # where a scheduler with memory to spare may leave its compression).
        copies, leaf = barrier(([c for _, c in packed], leaf))
        saved.update((i, c) for (i, _), c in zip(packed, copies))
        return leaf

      def derive(jaxpr, n_y, treedef, out_tree):
        residuals = jaxpr.outvars[n_y:]
        if bits is None or arguments_only:
          return {}, []
        backward = _backward_jaxpr(treedef, [v.aval for v in residuals],
                                   [v.aval for v in jaxpr.outvars[:n_y]], out_tree)
        params = {id(leaf) for leaf in kept}
        free = {v for v, leaf in zip(jaxpr.invars, jax.tree.leaves(args))
                if id(leaf) in params}
        recipes, extras = _derive.derivations(jaxpr, residuals, min_size=min_size,
                                              backward=backward, free=free)
        for i, r in recipes.items():
          plan[i], saved[i] = ("derived", r, None), None
        # Where the backward finds each value a recipe reads: a stored residual or an extra.
        where = {v: i for i, v in enumerate(residuals)
                 if i not in recipes and not _literal(v)}
        where.update((v, len(residuals) + k) for k, v in enumerate(extras))
        layout["where"] = where
        return recipes, extras

      y, leaves, layout["treedef"], _, layout["zero"] = _vjp_with_constants(
          f, args, index_max_pools=True, store=store, derive=derive)
      plan = layout["plan"] = [plan[i] for i in range(len(plan))]
      saved = [saved[i] for i in range(len(plan))]
      layout["n"] = len(leaves)
      layout["avals"] = [jax.typeof(leaf) for leaf in leaves]
      # The output is released only once the residuals are compressed, so the next layer
      # cannot run while this one's float residuals are still alive.
      packed = [v for p, v in zip(plan, saved) if p[0] in _STORED]
      y, packed = barrier((y, packed))
      it = iter(packed)
      saved = [next(it) if p[0] in _STORED else v for p, v in zip(plan, saved)]
      if offload:
        saved = [_to_space(v, jax.memory.Space.Host) if p[0] in _STORED else v
                 for p, v in zip(plan, saved)]
      return y, saved

    def bwd(saved, ct):
      # Pin the decompression after the cotangent exists: otherwise XLA hoists it into the
      # forward pass and the float copies live until the backward (no saving at all).
      saved, ct = barrier((saved, ct))
      if offload:
        saved = [_to_space(v, jax.memory.Space.Device) if p[0] in _STORED else v
                 for p, v in zip(layout["plan"], saved)]
      kw, made, values = layout["kw"], {}, {}

      def materialize(i, after=()):
        """Residual ``i``, decompressed (its sources, for a derived one) once ``after``
        (values of the backward pass) exist."""
        if i not in made:
          kind, what, dtype = layout["plan"][i]
          stored = saved[i]
          if kind == "quant" and after:
            # Quantized codes only. A packed mask unpacks to a quarter of a float32's bytes,
            # and ordering masks too changed nothing on the H100 target but grew XLA:CPU's
            # heap layout (a video model's frame encoder at 1 bit: temp 8.65 MiB with them
            # ordered, 6.66 without). An uncompressed ("raw", offloaded) residual is not
            # ordered either: it is brought back to the device at the backward's start.
            stored = barrier((stored, list(after)))[0]
          if kind == "const":
            made[i] = jnp.full(what, dtype[1], dtype[0])
          elif kind == "quant":
            made[i] = _dequantize_residual(stored, what, dtype, **kw)
          elif kind == "bool":
            made[i] = _unpack_mask(stored, what)
          elif kind == "derived":     # rebuilt from its (dequantized) sources
            for u in what.inputs:
              if u not in values:
                values[u] = materialize(layout["where"][u], after)
            made[i] = _derive.replay(what, values, _bind)
          else:
            made[i] = stored
        return made[i]

      flat, out_tree = _backward_at_first_use(layout["treedef"], layout["avals"], ct,
                                              materialize)
      # An input the backward gives zeros (one the outputs do not read: a dict of features
      # passed along, say) gets None, a symbolic zero, rather than a full-size array of
      # zeros that every later site's barrier would carry to the end of the backward.
      flat = [None if i in layout["zero"] else v for i, v in enumerate(flat)]
      # The inputs' cotangents are released with the parameters' gradients, so that the
      # previous site's backward cannot start while this one's working set (the float
      # copies its weight gradients read) is still alive (docs/decisions.md: without it
      # XLA:GPU ran the sites' weight gradients late, and the peak grew).
      tied = [i for i, v in enumerate(flat) if _is_array(v)]
      for i, v in zip(tied, barrier([flat[i] for i in tied])):
        flat[i] = v
      return tuple(jax.tree.unflatten(out_tree, flat)), None

    call.defvjp(fwd, bwd)
    return call(tuple(args), key)

  return g


_STORED = ("quant", "bool", "raw")    # what the barrier orders and offload moves


def _backward_jaxpr(treedef, residuals, outputs, out_tree):
  """The jaxpr of the VJP function's call (``treedef``: its leaves the residuals), traced
  from the avals of its ``residuals`` and of cotangents for ``outputs`` (avals, with the
  structure ``out_tree``; float0 for integer ones): what `jmem.ops.actnn._derive` reads to
  see which residuals the backward pass multiplies together."""
  def call(res, cts):
    return jax.tree.leaves(jax.tree.unflatten(treedef, res)(jax.tree.unflatten(out_tree, cts)))

  cts = [a if jnp.issubdtype(a.dtype, jnp.inexact) else
         jax.core.ShapedArray(a.shape, jax.dtypes.float0) for a in outputs]
  return jax.make_jaxpr(call)(list(residuals), cts)


def _backward_at_first_use(treedef, avals, ct, materialize):
  """``(leaves, treedef)`` of the VJP function (``treedef`` over residuals of ``avals``)
  applied to ``ct``, its traced backward evaluated equation by equation with each residual
  made (``materialize(i, after)``) just before the first equation that reads it, ``after``
  that equation's other operands: a residual is decompressed once the backward reaches
  the layer that reads it, not when the site's backward starts (XLA schedules an
  unconstrained decompression as early as it can: a ResNet block's input, read by its
  first convolution's weight gradient, lived through the whole block's backward)."""
  box = {}

  def call(res, cts):
    out = jax.tree.unflatten(treedef, res)(jax.tree.unflatten(box["ct"], cts))
    leaves, box["out"] = jax.tree.flatten(out)
    return leaves

  ct_leaves, box["ct"] = jax.tree.flatten(ct)
  closed = jax.make_jaxpr(call)(list(avals), [jax.typeof(c) for c in ct_leaves])
  jaxpr = closed.jaxpr
  position = {v: i for i, v in enumerate(jaxpr.invars[:len(avals)])}
  env = dict(zip(jaxpr.constvars, closed.consts))
  env.update(zip(jaxpr.invars[len(avals):], ct_leaves))

  def read(v, after=()):
    if _literal(v):
      return v.val
    if v not in env:
      env[v] = materialize(position[v], after)
    return env[v]

  made = set(jaxpr.invars[len(avals):])        # what the backward has computed so far
  for eqn in jaxpr.eqns:
    # Only before a convolution or matrix product, whose operands are materialised for the
    # library call anyway: a barrier on an operand that would fuse into its consumer makes
    # XLA materialise it (ResNet-50 in bf16 at 1 bit: temp 1399 MiB against 904), and one
    # on a single element of it adds a kernel per residual (about 4% of the step).
    after = ([env[v] for v in eqn.invars if not _literal(v) and v in made
              and _is_array(env[v])] if eqn.primitive.name in _LIBRARY_OPS else [])
    outs = _bind(eqn, [read(v, after) for v in eqn.invars])
    env.update(zip(eqn.outvars, outs))
    made.update(eqn.outvars)
  return [read(v) for v in jaxpr.outvars], box["out"]


# Primitives a GPU runs as library calls (cuDNN, cuBLAS), with their operands in memory.
_LIBRARY_OPS = ("conv_general_dilated", "dot_general")


def _row_layout(shape, unit: int) -> bool:
  """Whether `compress` stores a residual of ``shape`` in rows of its last two dims
  (``[..., W, C] -> [..., W * C]``) instead of flattened per sample: for an array of 3 or
  more dims whose rows split into whole units (quantization groups; bytes of packed bits).
  Rows keep every leading dim apart, so an activation sharded over H and W (`jmem.Spatial`)
  is stored where it lies, as long as each device's part of a row (``W / devices * C``
  values) holds whole groups (else XLA gathers the groups that straddle two devices):
  flattening each sample crosses the shards, and XLA gathered the whole activation on every
  device (a U-Net's 1024 x 2048 step took 1.30x exact's temp per device, 81 all-gathers).
  The codes are bit-identical to the per-sample layout's (the same
  groups, each value rounded with the dither of its row-major index).
  """
  return len(shape) >= 3 and (shape[-2] * shape[-1]) % unit == 0


def _rows_map(fn, lead: int):
  for _ in range(lead):
    fn = jax.vmap(fn)
  return fn


def _quantize_residual(x, seed, *, bits, group_size, implementation, interpret) -> Quantized:
  """`quantize` of one residual, per row (`_row_layout`) or per sample."""
  kw = dict(bits=bits, group_size=group_size, implementation=implementation,
            interpret=interpret)
  if not _row_layout(x.shape, group_size):
    n = x.shape[0] if x.ndim else 1
    return _quantize_seeded(x.reshape(n, -1), seed, **kw)
  lead, per = x.shape[:-2], x.shape[-2] * x.shape[-1]
  # Row r's values have row-major indices r * per + j: its seed carries the offset.
  row = jnp.arange(int(np.prod(lead)), dtype=jnp.uint32).reshape(lead)
  seeds = seed + row * jnp.uint32(per % 2**32) * jnp.uint32(0x9E3779B1)
  if implementation == _backends.XLA:
    # The XLA reference takes a seed per row itself: no vmap (two levels of it traced each
    # residual's quantizer in about 40 ms, half of an ActNN step's trace).
    g = per // group_size
    with jax.named_scope(CODES_SCOPE):
      codes, mn, scale = _quantize_pack_xla(x.reshape(lead + (g, group_size)), seeds,
                                            bits=bits)
    return Quantized(codes.reshape(lead + (1, -1)), mn.reshape(lead + (1, g)),
                     scale.reshape(lead + (1, g)))
  return _rows_map(lambda r, sd: _quantize_seeded(r[None], sd, **kw), len(lead))(
      x.reshape(lead + (per,)), seeds)


def _dequantize_residual(qx: Quantized, shape, dtype, *, group_size, **kw) -> jax.Array:
  """The inverse of `_quantize_residual` for a residual of ``shape`` and ``dtype``."""
  if not _row_layout(shape, group_size):
    n = shape[0] if len(shape) else 1
    per = int(np.prod(shape[1:])) if len(shape) > 1 else 1
    return dequantize(qx, (n, per), dtype, group_size=group_size, **kw).reshape(shape)
  if kw["implementation"] == _backends.XLA:
    lead, g = tuple(shape[:-2]), qx.minimum.shape[-1]
    x = _unpack_dequantize_xla(qx.codes.reshape(lead + (g, -1)), qx.minimum.reshape(lead + (g,)),
                               qx.scale.reshape(lead + (g,)), bits=kw["bits"], dtype=dtype)
    return x.reshape(shape)
  per = shape[-2] * shape[-1]
  return _rows_map(lambda q: dequantize(q, (1, per), dtype, group_size=group_size, **kw)[0],
                   len(shape) - 2)(qx).reshape(shape)


def _pack_mask(mask):
  """A boolean residual bit-packed, per row of its last two dims where they hold whole bytes
  (`_row_layout`), else flattened."""
  rows = mask.shape[:-2] + (-1,) if _row_layout(mask.shape, 8) else (-1,)
  return pack_bits(mask.reshape(rows).astype(jnp.uint8), 1)


def _unpack_mask(packed, shape):
  return unpack_bits(packed, 1).astype(jnp.bool_).reshape(shape)


def _interpret_once(implementation: str, interpret: bool | None) -> bool | None:
  """``interpret`` resolved once per call of a compressed function: off the GPU a Pallas
  backend warns once for the call, not once per quantized and dequantized residual."""
  if implementation == _backends.XLA or interpret is not None:
    return interpret
  from pallas_kernels import resolve_interpret  # pylint: disable=g-import-not-at-top
  return resolve_interpret(None, f"ActNN compress(implementation={implementation!r})")


def fake_quantize(x: jax.Array, levels: jax.Array, seed: jax.Array, *,
                  group_size: int = 256) -> jax.Array:
  """``x`` stochastically rounded to ``levels + 1`` values per group, as float again.

  The same per-sample, per-group rounding as `quantize` (``levels = 2^bits - 1``) but with
  ``levels`` a traced scalar and nothing packed, so ONE compiled function can measure the
  gradient noise of any bit width at any site (`probe`). ``levels == 0`` returns ``x``.
  """
  grouped = _range_safe_groups(x, group_size)
  mn = jnp.min(grouped, axis=-1, keepdims=True)
  used = jnp.maximum(levels, 1.0)      # not rounded to bfloat16: a probe, not stored
  scale = jnp.maximum(used / group_span(mn, jnp.max(grouped, axis=-1, keepdims=True)),
                      scale_floor(used))
  index = jnp.arange(grouped.size, dtype=jnp.uint32).reshape(grouped.shape)
  q = jnp.floor((grouped - mn) * scale + hash_uniform(index, seed))
  return jnp.where(levels > 0, _ungroup(q / scale + mn, x.shape, x.dtype), x)


def probe(f: Callable[..., Any], *, group_size: int = 256, min_size: int = 1024,
          param_argnums: tuple[int, ...] = (0,),
          on_residuals: Callable[[int], None] | None = None,
          arguments_only: bool = False) -> Callable[..., Any]:
  """``f`` whose backward uses residuals rounded to a RUNTIME number of levels.

  The sensitivity probe of GACT's bit allocation: ``g(levels, seed, *args)`` equals
  ``f(*args)`` forward; its backward sees the residuals that `compress` would quantize,
  passed through `fake_quantize` with ``levels`` (``2^b - 1``, or 0 for exact) and dither
  ``seed`` (uint32). ``on_residuals(n)`` is told, at trace time, how many values `compress`
  would quantize (the site's weight in the bit budget). ``arguments_only`` as `compress`'s.
  """
  def g(levels, seed, *args):
    @jax.custom_vjp
    def call(levels, seed, args):
      return f(*args)

    def fwd(levels, seed, args):
      # The residuals `compress` sees: max pools keep their exact index there, too.
      y, leaves, treedef, constants, _ = _vjp_with_constants(f, args, index_max_pools=True)
      kept = _param_leaves(args, param_argnums)
      inputs = jax.tree.leaves(args) if arguments_only else None
      kinds = [_residual_kind(leaf, kept, min_size, constants.get(i), inputs)
               for i, leaf in enumerate(leaves)]
      if on_residuals is not None:
        on_residuals(sum(leaf.size for leaf, k in zip(leaves, kinds) if k == "quant"))
      leaves = [fake_quantize(leaf, levels, seed + jnp.uint32(i), group_size=group_size)
                if k == "quant" else leaf for i, (leaf, k) in enumerate(zip(leaves, kinds))]
      return y, (jax.tree.unflatten(treedef, leaves), levels, seed)

    def bwd(res, ct):
      vjp_fn, levels, seed = res
      return jnp.zeros_like(levels), np.zeros(np.shape(seed), jax.dtypes.float0), vjp_fn(ct)

    call.defvjp(fwd, bwd)
    return call(jnp.asarray(levels, jnp.float32), jnp.asarray(seed, jnp.uint32), tuple(args))

  return g


def _to_space(tree, space):
  return jax.tree.map(lambda v: jax.device_put(v, space), tree)
