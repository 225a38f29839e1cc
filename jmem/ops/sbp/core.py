"""Stochastic Backpropagation: forward on every node, backward on a sampled subset.

`sbp(f, keep_ratio=r, axis=a)` turns ``f(params, x)``, independent per node along axis
``a`` (frames of a clip, for a per-frame CNN), into ``g(params, x, key)``:

* forward: exactly ``f(params, x)`` on all ``n`` nodes, nothing of it saved;
* saved for backward: the kept slice ``x[idx]`` (``k = ceil(r n)`` nodes, a static count),
  the indices and the parameters;
* backward: re-runs ``f`` on the kept slice under autodiff with the kept rows of the
  output cotangent; parameter gradients come from the kept nodes only, the input gradient
  is scattered into zeros (dropped nodes get none). No ``1/r`` rescaling, as the original.

So the gradients are the exact gradients of the same loss with the dropped nodes' outputs
held constant (``stop_gradient``), and the memory the backward needs for ``f`` falls to
about ``r`` of exact backprop's.

For token models, where a block mixes nodes (attention), `sbp_rows` is the layer-level
variant: it saves the block input, and its backward recomputes only the kept rows of the
output (queries of kept tokens against ALL keys and values).

Samplers (``sampler=``): ``"uniform_chunk"`` (default: one random node in each of the ``k``
chunks of length ``n/k``), ``"strided"`` (every ``n/k``-th node, centred in its chunk),
``"random"`` (``k`` distinct nodes), ``"diverse_feature"`` (nodes ordered by feature
magnitude, then one per chunk of that order), and `checkerboard` for ``(t, h, w)`` token
grids. All are deterministic functions of the key and return sorted ``int32[k]`` indices.

References:
  Cheng et al., Stochastic Backpropagation: A Memory Efficient Strategy for Training Video
  Models, CVPR 2022, https://arxiv.org/abs/2203.16755
  Cheng et al., Stochastic Backpropagation for training (ViT, ConvNeXt), NeurIPS 2022,
  https://arxiv.org/abs/2210.00129
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmem._axes import barrier

__all__ = [
    "SAMPLERS", "Sampler", "sbp", "sbp_reference", "sbp_rows", "sbp_rows_reference",
    "num_kept", "sample_indices", "checkerboard", "get_sampler",
]

# (key, x, num_nodes, num_kept, axis) -> sorted int32[num_kept]
Sampler = Callable[[jax.Array, jax.Array, int, int, int], jax.Array]


def num_kept(num_nodes: int, keep_ratio: float) -> int:
  """``ceil(r n)`` (with a tolerance for ratios like 1/3 that are not exact in binary)."""
  check_keep_ratio(keep_ratio)
  if num_nodes < 1:
    raise ValueError("The node axis is empty: SBP would keep zero nodes. Check the axis "
                     "argument and that the input has at least one node along it.")
  k = math.ceil(keep_ratio * num_nodes - 1e-9)
  if k < 1:
    raise ValueError(f"keep_ratio={keep_ratio} keeps no node out of {num_nodes}; use "
                     f"keep_ratio >= {1 / num_nodes:.4g}.")
  return k


def check_keep_ratio(keep_ratio: float) -> None:
  """Raises ValueError unless ``keep_ratio`` is a real number in (0, 1].

  NaN, infinities and booleans are refused (``True`` is not a ratio); NumPy scalars are
  accepted.
  """
  if (isinstance(keep_ratio, (bool, np.bool_)) or not isinstance(keep_ratio, numbers.Real)
      or not 0.0 < keep_ratio <= 1.0):
    raise ValueError(f"keep_ratio must be in (0, 1], got {keep_ratio!r} (1 = exact "
                     "backpropagation; 0.25 keeps a quarter of the nodes).")


def _chunk_bounds(n, k):
  edges = np.floor(np.arange(k + 1) * n / k).astype(np.int32)
  return jnp.asarray(edges[:-1]), jnp.asarray(edges[1:] - edges[:-1])


def _uniform_chunk(key, x, n, k, axis):
  del x, axis
  start, length = _chunk_bounds(n, k)
  u = jax.random.uniform(key, (k,))
  return start + jnp.minimum(jnp.floor(u * length).astype(jnp.int32), length - 1)


def _strided(key, x, n, k, axis):
  del key, x, axis
  start, length = _chunk_bounds(n, k)
  return start + length // 2


def _random(key, x, n, k, axis):
  del x, axis
  return jnp.sort(jax.random.permutation(key, n)[:k]).astype(jnp.int32)


def _diverse_feature(key, x, n, k, axis):
  """Nodes sorted by the L2 norm of their features, then one per chunk of that order."""
  feats = jnp.moveaxis(x, axis, 0).reshape(n, -1).astype(jnp.float32)
  order = jnp.argsort(jnp.sum(feats * feats, axis=1))
  picks = order[_uniform_chunk(key, None, n, k, 0)]
  return jnp.sort(picks).astype(jnp.int32)


SAMPLERS: dict[str, Sampler] = {
    "uniform_chunk": _uniform_chunk,
    "strided": _strided,
    "random": _random,
    "diverse_feature": _diverse_feature,
}


def checkerboard(grid: Sequence[int], block: Sequence[int] = (1, 1, 1)) -> Sampler:
  """3-D checkerboard over a ``(t, h, w)`` token grid flattened in that order.

  Keeps tokens whose block coordinates satisfy ``(t/bt + h/bh + w/bw) mod m == c`` with
  ``m = 1/keep_ratio`` (an integer) and a random offset ``c``. ``block`` aligns the pattern
  with later patch merging (e.g. ``(1, 2, 2)``). The count is ``n/m`` for every ``c`` when
  one block-grid side is a multiple of ``m``.
  """
  grid, block = tuple(int(g) for g in grid), tuple(int(b) for b in block)
  if len(grid) != 3 or len(block) != 3 or any(g % b for g, b in zip(grid, block)):
    raise ValueError(f"checkerboard needs a (t, h, w) grid divisible by the block, got grid "
                     f"{grid} and block {block}.")
  coarse = tuple(g // b for g, b in zip(grid, block))

  def sample(key, x, n, k, axis):
    del x, axis
    if n != int(np.prod(grid)):
      raise ValueError(f"checkerboard grid {grid} has {int(np.prod(grid))} tokens but the "
                       f"node axis has {n}: pass the grid of the tokens being sampled.")
    m = n // k
    if m * k != n or not any(c % m == 0 for c in coarse):
      raise ValueError(
          f"checkerboard keeps 1 in m tokens: keep_ratio must be 1/m with some side of the "
          f"block grid {coarse} a multiple of m; got {k} of {n} tokens.")
    t, h, w = np.meshgrid(*(np.arange(g) for g in grid), indexing="ij")
    colour = ((t // block[0]) + (h // block[1]) + (w // block[2])).reshape(-1) % m
    table = jnp.asarray(np.stack([np.nonzero(colour == c)[0] for c in range(m)]), jnp.int32)
    return table[jax.random.randint(key, (), 0, m)]

  return sample


def get_sampler(sampler: str | Sampler) -> Sampler:
  if callable(sampler):
    return sampler
  if sampler not in SAMPLERS:
    raise ValueError(f"Unknown sampler {sampler!r}; valid samplers: {', '.join(SAMPLERS)} "
                     "(or jmem.ops.sbp.checkerboard(grid) for token grids).")
  return SAMPLERS[sampler]


def sample_indices(key: jax.Array, x: jax.Array, *, keep_ratio: float, axis: int = 0,
                   sampler: str | Sampler = "uniform_chunk") -> jax.Array:
  """Sorted ``int32[ceil(r n)]`` indices of the kept nodes of ``x`` along ``axis``."""
  axis = _check_axis(axis, x.ndim)
  n = x.shape[axis]
  k = num_kept(n, keep_ratio)
  if k == n:
    return jnp.arange(n, dtype=jnp.int32)
  return get_sampler(sampler)(key, x, n, k, axis)


def _check_axis(axis: int, ndim: int) -> int:
  if not -ndim <= axis < ndim:
    raise ValueError(f"axis {axis} is out of range for an input of rank {ndim}.")
  return axis % ndim


def _scatter(rows, idx, axis, size):
  out = jnp.zeros(rows.shape[:axis] + (size,) + rows.shape[axis + 1:], rows.dtype)
  return out.at[(slice(None),) * axis + (idx,)].set(rows)


def _float0_like(idx):
  return np.zeros(idx.shape, jax.dtypes.float0)


def _sbp_independent(f, axis, out_axis):
  @jax.custom_vjp
  def call(params, x, idx):
    return f(params, x)

  def fwd(params, x, idx):
    # Saved: the kept slice of x (and params, indices); nothing computed by f.
    return f(params, x), (params, jnp.take(x, idx, axis=axis), idx)

  def bwd(res, dy):
    params, x_kept, idx = res
    n = jax.tree.leaves(dy)[0].shape[out_axis]
    dy_kept = jax.tree.map(lambda d: jnp.take(d, idx, axis=out_axis), dy)
    _, vjp = jax.vjp(f, params, x_kept)
    d_params, dx_kept = vjp(dy_kept)
    return d_params, _scatter(dx_kept, idx, axis, n), _float0_like(idx)

  call.defvjp(fwd, bwd)
  return call


def sbp(f: Callable[[Any, jax.Array], Any], *, keep_ratio: float, axis: int = 0,
        out_axis: int | None = None,
        sampler: str | Sampler = "uniform_chunk") -> Callable[..., Any]:
  """Stochastic backpropagation of ``f(params, x)`` over the nodes of ``x`` along ``axis``.

  Args:
    f: ``f(params, x) -> y``, independent per node along ``axis`` (and ``y`` has the
      nodes along ``out_axis``). Any pytree of ``params``.
    keep_ratio: fraction ``r`` in (0, 1] of nodes that get a backward pass
      (``ceil(r n)`` of them). ``1`` is exact backpropagation.
    axis: node axis of ``x``.
    out_axis: node axis of every output leaf (default ``axis``).
    sampler: a name from `SAMPLERS` or a callable (e.g. `checkerboard`).

  Returns:
    ``g(params, x, key) -> y``, with ``y == f(params, x)``; its VJP is that of ``f`` on the
    kept nodes (see the module docstring). Works under jit, grad, vmap and scan.

  Raises:
    ValueError: keep ratio outside (0, 1] or keeping no node, axis out of range, unknown
      sampler.
  """
  check_keep_ratio(keep_ratio)
  sampler_fn = get_sampler(sampler)
  out_axis = axis if out_axis is None else out_axis

  def g(params, x, key):
    ax = _check_axis(axis, x.ndim)
    idx = jax.lax.stop_gradient(
        sample_indices(key, x, keep_ratio=keep_ratio, axis=ax, sampler=sampler_fn))
    return _sbp_independent(f, ax, out_axis)(params, x, idx)

  return g


def sbp_reference(f: Callable[[Any, jax.Array], Any], *, keep_ratio: float, axis: int = 0,
                  out_axis: int | None = None,
                  sampler: str | Sampler = "uniform_chunk") -> Callable[..., Any]:
  """The oracle of `sbp` by plain autodiff: dropped nodes' outputs under ``stop_gradient``.

  Same signature and same sampled nodes as `sbp`; saves everything ``f`` saves.
  """
  check_keep_ratio(keep_ratio)
  out_axis = axis if out_axis is None else out_axis

  def g(params, x, key):
    ax = _check_axis(axis, x.ndim)
    idx = sample_indices(key, x, keep_ratio=keep_ratio, axis=ax, sampler=sampler)
    return jax.tree.map(lambda y: _hold_dropped(y, idx, out_axis), f(params, x))

  return g


def _hold_dropped(y, idx, axis):
  """``y`` with the entries along ``axis`` not in ``idx`` under ``stop_gradient``."""
  shape = [1] * y.ndim
  shape[axis] = y.shape[axis]
  keep = jnp.zeros((y.shape[axis],), bool).at[idx].set(True).reshape(shape)
  return jnp.where(keep, y, jax.lax.stop_gradient(y))


def sbp_rows_reference(f_full, params, x, idx, *, axis: int = 1):
  """The oracle of `sbp_rows`: the full block with the dropped output rows held constant."""
  return _hold_dropped(f_full(params, x), idx, axis)


def sbp_rows(f_full: Callable[[Any, jax.Array], jax.Array],
             f_rows: Callable[[Any, jax.Array, jax.Array], jax.Array], params, x: jax.Array,
             idx: jax.Array, *, axis: int = 1) -> jax.Array:
  """Layer-level SBP for a block that mixes nodes (a transformer block over tokens).

  Forward: ``f_full(params, x)`` on every token. Saved: ``x`` and ``idx`` only (none of the
  block's intermediates). Backward: the kept rows of the cotangent through
  ``f_rows(params, x, idx)``, which computes the output rows ``idx`` only (queries of the
  kept tokens, ALL keys and values), re-run under autodiff; the dropped rows get no
  gradient through this block, except through the keys and values of the kept ones.

  Args:
    f_full: ``(params, x) -> y`` with ``y`` shaped like ``x``.
    f_rows: ``(params, x, idx) -> y[idx]`` along ``axis``.
    params, x: as for ``f_full``.
    idx: ``int32[k]`` kept token indices, shared by every SBP block of a stage.
    axis: token axis.
  """
  return _sbp_rows(f_full, f_rows, axis)(params, x, idx)


def _sbp_rows(f_full, f_rows, axis):
  @jax.custom_vjp
  def call(params, x, idx):
    return f_full(params, x)

  def fwd(params, x, idx):
    return f_full(params, x), (params, x, idx)

  def bwd(res, dy):
    params, x, idx = res
    dy_kept = jnp.take(dy, idx, axis=axis)
    # The re-run depends on x only; without this tie to the cotangent XLA schedules every
    # block's kept-rows forward early, right after the forward pass, and their attention
    # maps are all live at once under the exact blocks' backward (video-vit at r = 0.25:
    # temp 0.55x exact without the tie, 0.34x with it).
    x, dy_kept = barrier((x, dy_kept))
    _, vjp = jax.vjp(lambda p, v: f_rows(p, v, idx), params, x)
    d_params, dx = vjp(dy_kept)
    return d_params, dx, _float0_like(idx)

  call.defvjp(fwd, bwd)
  return call
