"""Pallas kernels for InPlace-ABN: fused statistics, normalise+affine+activation, and backward.

The input ``[..., C]`` is viewed as ``[M, C]`` and tiled ``(block_rows, block_channels)``
over a 2-D grid, so every kernel has ``ceil(M/bm) * ceil(C/bc)`` independent programs.

Forward:
  1. ``_moments_kernel``: per tile, valid count, mean ``m0`` and the corrected two-pass
     ``(Σd/n, Σd² - (Σd)²/n)`` with ``d = x - m0``; the tiles (a few per channel) are merged
     exactly in XLA by `jmem._bn_core.merge_moments` (Chan's formula) and, with
     ``axis_name``, across devices by the one all-gather of
     `jmem._bn_core.gather_moments`.
  2. ``_forward_kernel``: ``z = act(((x - m0) - corr) · γ'/σ + β)`` in one read of ``x`` and
     one write; the mean is ``m0 + corr`` (two float32s, see `jmem._bn_core.Moments`).

Backward (saves only ``z``):
  3. ``_backward_sums_kernel``: inverts the activation and the affine step tile by tile and
     writes per-tile ``Σdy`` and ``Σdy·x̂``; summed in XLA (and psummed: one collective).
  4. ``_backward_dx_kernel``: ``dx = γ'/σ (dy - (Σdy + x̂ Σdy·x̂)/N)``, inverting again
     (recomputing is cheaper than storing ``y`` and ``dy``).

Triton constraints are respected: power-of-2 blocks, no value-level slicing. Every load and
store is masked to the rows and channels that exist (Pallas' Triton lowering does not mask a
partial tile by itself; an unmasked store past the end of an array corrupts its neighbour).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from jmem import _bn_core as bn_core
from jmem._elementwise import ABNConfig, apply_activation, invert_activation
from jmem._technique import keep_exact
from pallas_kernels._interpret import resolve_interpret

__all__ = ["Tiles", "inplace_abn_pallas", "moments"]


@dataclasses.dataclass(frozen=True)
class Tiles:
  """Tile sizes (powers of two; clipped to the array) and Triton warps per program."""

  block_rows: int = 128
  block_channels: int = 64
  num_warps: int = 4

  @classmethod
  def get_default(cls) -> "Tiles":
    return cls()

  def for_shape(self, rows: int, channels: int) -> tuple[int, int]:
    for b in (self.block_rows, self.block_channels):
      if b <= 0 or b & (b - 1):
        raise ValueError(f"Tile sizes must be powers of two, got {self}.")
    return (min(self.block_rows, pl.next_power_of_2(rows)),
            min(self.block_channels, pl.next_power_of_2(channels)))


class _Dims(NamedTuple):
  """Array extent and tile size: every kernel masks its loads and stores with them."""

  rows: int
  channels: int
  block_rows: int
  block_channels: int


def _masks(dims: _Dims):
  """``(rows bool[bm], channels bool[bc], tile bool[bm, bc])`` of this program's tile.

  Pallas' Triton lowering does not mask a partial last tile by itself: an unmasked store
  past the end of the array writes into whatever buffer follows, so every load and store
  here is masked (in interpret mode this changes nothing).
  """
  r = pl.program_id(0) * dims.block_rows + lax.broadcasted_iota(
      jnp.int32, (dims.block_rows,), 0) < dims.rows
  c = pl.program_id(1) * dims.block_channels + lax.broadcasted_iota(
      jnp.int32, (dims.block_channels,), 0) < dims.channels
  return r, c, r[:, None] & c[None, :]


def _load(ref, mask, other=0.0):
  return pl_triton.load(ref, mask=mask, other=other).astype(jnp.float32)


def _moments_kernel(x_ref, m0_ref, corr_ref, m2_ref, *, dims: _Dims):
  _, cvalid, tile = _masks(dims)
  x = _load(x_ref, tile)
  n = jnp.minimum(dims.rows - pl.program_id(0) * dims.block_rows,
                  dims.block_rows).astype(jnp.float32)
  # The pivot through an integer op (`jmem._bn_core.pin`), so that x - m0 and the stored
  # m0 are the same float: a fused multiply-add would subtract the unrounded one.
  m0 = bn_core.pin(jnp.sum(x, axis=0) / n)
  d = jnp.where(tile, x - m0, 0.0)
  s1 = jnp.sum(d, axis=0)
  pl_triton.store(m0_ref, m0, mask=cvalid)
  pl_triton.store(corr_ref, s1 / n, mask=cvalid)
  pl_triton.store(m2_ref, jnp.maximum(jnp.sum(d * d, axis=0) - s1 * s1 / n, 0.0), mask=cvalid)


def _forward_kernel(x_ref, m0_ref, corr_ref, a_ref, b_ref, z_ref, *, cfg, dims: _Dims):
  _, cvalid, tile = _masks(dims)
  x = _load(x_ref, tile)
  m0, corr = _load(m0_ref, cvalid), _load(corr_ref, cvalid)
  a, b = _load(a_ref, cvalid), _load(b_ref, cvalid)
  y = ((x - m0) - corr) * a + b
  pl_triton.store(z_ref, apply_activation(y, cfg).astype(z_ref.dtype), mask=tile)


def _reconstruct(z_ref, dz_ref, g_ref, b_ref, cfg, dims: _Dims):
  _, cvalid, tile = _masks(dims)
  y, dy = invert_activation(_load(z_ref, tile), _load(dz_ref, tile), cfg)
  xhat = (y - _load(b_ref, cvalid)) / _load(g_ref, cvalid, other=1.0)
  return jnp.where(tile, xhat, 0.0), jnp.where(tile, dy, 0.0)


def _backward_sums_kernel(z_ref, dz_ref, g_ref, b_ref, sdy_ref, sdyx_ref, *, cfg, dims: _Dims):
  xhat, dy = _reconstruct(z_ref, dz_ref, g_ref, b_ref, cfg, dims)
  _, cvalid, _ = _masks(dims)
  pl_triton.store(sdy_ref, jnp.sum(dy, axis=0), mask=cvalid)
  pl_triton.store(sdyx_ref, jnp.sum(dy * xhat, axis=0), mask=cvalid)


def _backward_dx_kernel(z_ref, dz_ref, g_ref, b_ref, k_ref, c1_ref, c2_ref, dx_ref, *, cfg,
                        dims: _Dims):
  xhat, dy = _reconstruct(z_ref, dz_ref, g_ref, b_ref, cfg, dims)
  _, cvalid, tile = _masks(dims)
  k, c1, c2 = _load(k_ref, cvalid), _load(c1_ref, cvalid), _load(c2_ref, cvalid)
  pl_triton.store(dx_ref, (k * (dy - c1 - xhat * c2)).astype(dx_ref.dtype), mask=tile)


def _same_varying(args):
  """Casts every operand to vary over the union of the operands' manual axes (shard_map)."""
  varying = [bn_core.varying_axes(a) for a in args]
  names = frozenset().union(*varying)
  if not names:
    return args
  return [a if v == names else lax.pcast(a, tuple(names - v), to="varying")
          for a, v in zip(args, varying)]


class _Launch:
  """Grid and block specs for an ``[M, C]`` array with given tiles."""

  def __init__(self, x2, tiles: Tiles, interpret: bool):
    (self.rows, self.channels), self.dtype = x2.shape, x2.dtype
    # Inside shard_map (check_vma) outputs must say how they vary: as the input does.
    self.mat = getattr(jax.typeof(x2), "manual_axis_type", None)
    self.bm, self.bc = tiles.for_shape(self.rows, self.channels)
    self.dims = _Dims(self.rows, self.channels, self.bm, self.bc)
    self.grid = (pl.cdiv(self.rows, self.bm), pl.cdiv(self.channels, self.bc))
    self.interpret = interpret
    # Explicit Triton params: the default GPU backend of pallas_call is now Mosaic GPU.
    self.params = pl_triton.CompilerParams(num_warps=tiles.num_warps)
    self.tile = pl.BlockSpec((self.bm, self.bc), lambda i, j: (i, j))
    self.vec = pl.BlockSpec((self.bc,), lambda i, j: (j,))
    self.partial = pl.BlockSpec((None, self.bc), lambda i, j: (i, j))

  def struct(self, shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=self.mat)

  def partial_shape(self):
    return self.struct((self.grid[0], self.channels), jnp.float32)

  def full_shape(self):
    return self.struct((self.rows, self.channels), self.dtype)

  def call(self, kernel, in_specs, out_specs, out_shape, *args):
    args = _same_varying(args)
    return pl.pallas_call(kernel, grid=self.grid, in_specs=in_specs, out_specs=out_specs,
                          out_shape=out_shape, interpret=self.interpret,
                          compiler_params=self.params)(*args)

  def tile_counts(self):
    counts = jnp.full((self.grid[0],), float(self.bm), jnp.float32)
    return counts.at[-1].set(float(self.rows - (self.grid[0] - 1) * self.bm))[:, None]


def _local_moments(x2, launch: _Launch) -> bn_core.Moments:
  """This device's `Moments` of ``[M, C]``: per-tile moments, merged exactly in XLA."""
  kern = functools.partial(_moments_kernel, dims=launch.dims)
  shape = launch.partial_shape()
  m0_t, corr_t, m2_t = launch.call(kern, [launch.tile], [launch.partial] * 3, [shape] * 3, x2)
  n_t = jnp.broadcast_to(launch.tile_counts(), m0_t.shape)
  return bn_core.merge_moments(bn_core.Moments(n_t, m0_t, corr_t, m2_t), axis=0)


def moments(x: jax.Array, *, tiles: Tiles | None = None,
            interpret: bool | None = None) -> bn_core.Moments:
  """This device's exact per-channel `jmem._bn_core.Moments` of ``x`` (``[..., C]``).

  The statistics kernel of the InPlace-ABN forward pass on its own (SyncBN's local
  moments): per-tile moments, merged exactly in XLA. Not differentiable (run it inside a
  custom VJP's forward). ``interpret`` as in `inplace_abn_pallas`.
  """
  interpret = resolve_interpret(interpret, "BatchNorm moments (implementation='pallas')")
  x2 = x.reshape(-1, x.shape[-1])
  return _local_moments(x2, _Launch(x2, Tiles.get_default() if tiles is None else tiles,
                                    interpret))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _abn(x2, scale, bias, shift, cfg: ABNConfig, tiles: Tiles, interpret: bool):
  del shift   # ignored: the statistics are exact without one
  launch = _Launch(x2, tiles, interpret)
  moments = bn_core.gather_moments(_local_moments(x2, launch), axis_name=cfg.axis_name,
                                   axis_index_groups=cfg.axis_index_groups)
  stats = moments.stats()
  a = lax.rsqrt(stats.var + cfg.epsilon) * (jnp.abs(scale) + cfg.epsilon)
  z = launch.call(functools.partial(_forward_kernel, cfg=cfg, dims=launch.dims),
                  [launch.tile] + [launch.vec] * 4,
                  launch.tile, launch.full_shape(), x2, moments.m0, moments.corr, a, bias)
  return z, stats


def _abn_fwd(x2, scale, bias, shift, cfg, tiles, interpret):
  z, stats = _abn(x2, scale, bias, shift, cfg, tiles, interpret)
  # z is inverted in the backward pass: a compression around this site keeps it exact.
  return (z, stats), (keep_exact(z), scale, bias, lax.rsqrt(stats.var + cfg.epsilon),
                      stats.count)


def _abn_bwd(cfg, tiles, interpret, res, cts):
  param_varying = bn_core.params_stay_local(cfg.axis_name, cts[0], res[1])
  sign = jnp.sign(res[1])
  res, cts = bn_core.tie_to_cotangent(res, cts)
  z, scale, bias, invstd, count = res
  dz = cts[0]
  launch = _Launch(z, tiles, interpret)
  g = jnp.abs(scale) + cfg.epsilon
  kern = functools.partial(_backward_sums_kernel, cfg=cfg, dims=launch.dims)
  shape = launch.partial_shape()
  sdy_t, sdyx_t = launch.call(kern, [launch.tile] * 2 + [launch.vec] * 2, [launch.partial] * 2,
                              [shape] * 2, z, dz, g, bias)
  local = jnp.stack([jnp.sum(sdy_t, axis=0), jnp.sum(sdyx_t, axis=0)])
  glob = local if cfg.axis_name is None else lax.psum(
      local, cfg.axis_name, axis_index_groups=cfg.axis_index_groups)
  inv_n = 1.0 / jnp.maximum(count, 1.0)
  dx = launch.call(functools.partial(_backward_dx_kernel, cfg=cfg, dims=launch.dims),
                   [launch.tile] * 2 + [launch.vec] * 5, launch.tile,
                   launch.full_shape(), z, dz, g, bias, g * invstd,
                   glob[0] * inv_n, glob[1] * inv_n)
  sums = local if (cfg.axis_name is None or param_varying) else glob
  return (dx, (sign * sums[1]).astype(scale.dtype), sums[0].astype(bias.dtype), None)


_abn.defvjp(_abn_fwd, _abn_bwd)


def inplace_abn_pallas(x: jax.Array, scale: jax.Array, bias: jax.Array, cfg: ABNConfig, *,
                       shift: jax.Array | None = None, tiles: Tiles | None = None,
                       interpret: bool | None = None):
  """InPlace-ABN training-mode forward and VJP as Pallas kernels.

  Args:
    x: ``[..., C]`` float input (channels last).
    scale, bias: ``float32[C]``.
    cfg: validated `ABNConfig` (activation, epsilon, optional ``axis_name``: statistics
      synchronised by one all-gather forward and one psum backward, as the XLA path).
    shift: ignored; accepted for compatibility (the merge is exact without one).
    tiles: `Tiles` (default `Tiles.get_default()`).
    interpret: run the kernels in the Pallas interpreter. ``None``: only when the default
      backend is not a GPU, with a warning (the interpreter is far slower than the XLA path).
      Under ``jax.shard_map`` the interpreter needs ``check_vma=False`` (it evaluates the
      kernel's literals as non-varying values); the GPU lowering does not.

  Returns:
    ``(z, BatchStats)`` as `jmem.ops.inplace_abn.inplace_abn`.
  """
  interpret = resolve_interpret(interpret, "inplace_abn(implementation='pallas')")
  tiles = Tiles.get_default() if tiles is None else tiles
  c = x.shape[-1]
  shift = jnp.zeros((c,), jnp.float32) if shift is None else jnp.asarray(shift, jnp.float32)
  z, stats = _abn(x.reshape(-1, c), scale, bias, shift, cfg, tiles, interpret)
  return z.reshape(x.shape), stats
