"""Pallas kernels for ActNN: fused statistics + dither + quantize + pack, and unpack + dequantize.

Both work on the grouped view ``[rows = N * G, group_size]``; one program handles
``block_rows`` whole groups, so the per-group minimum and scale are computed inside the
kernel from the values it has already loaded: the quantize kernel reads each value ONCE from
HBM (in its own dtype, no float32 copy) and writes the packed codes and the metadata once;
the dequantize kernel reads the codes once and writes the values once, in the residual's
dtype.

Layout (`jmem.ops.actnn.quantize`'s, shared with the XLA path): within a group of ``group_size``
values, byte ``k`` holds the values ``k + j * n`` (``n = group_size * bits / 8``) at bit
``j * bits``. Each of the ``8 / bits`` planes is a contiguous slice ``[:, j*n:(j+1)*n]`` of
the block, so every load and store is coalesced (Triton blocks, no value-level slicing).
Every load and store is masked to the rows that exist: Pallas' Triton lowering does not
mask a partial last block by itself, and an unmasked store past the end of the array
writes into whatever buffer follows (seen on an H100: garbage minima, NaN gradients).
The dither is `jmem.ops.actnn.quantize.hash_uniform` of the flat element index, so in interpret
mode the codes are bit-identical to the XLA path's.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from jmem._elementwise import group_scale, hash_uniform
from pallas_kernels._interpret import resolve_interpret

__all__ = ["Tiles", "quantize_pack", "unpack_dequantize", "supports"]


@dataclasses.dataclass(frozen=True)
class Tiles:
  """Groups per program (a power of two) and Triton warps per program."""

  block_rows: int = 32
  num_warps: int = 4

  @classmethod
  def get_default(cls) -> "Tiles":
    return cls()

  def check(self) -> "Tiles":
    if self.block_rows <= 0 or self.block_rows & (self.block_rows - 1):
      raise ValueError(f"block_rows must be a power of two, got {self.block_rows}.")
    return self


def supports(bits: int, group_size: int) -> bool:
  """Whether the kernels take this configuration (Triton needs power-of-two blocks)."""
  n = group_size * bits // 8
  return group_size & (group_size - 1) == 0 and n > 0 and n & (n - 1) == 0


def _check_group(group_size, bits):
  if not supports(bits, group_size):
    raise ValueError(f"The Pallas kernels need group_size and group_size * bits / 8 to be "
                     f"powers of two (Triton blocks), got group_size={group_size}, "
                     f"bits={bits}; use implementation='xla' for this configuration.")
  return 8 // bits, group_size * bits // 8


def _row_mask(rows, block_rows):
  """``bool[block_rows]``: which rows of this program's block exist."""
  start = pl.program_id(0) * block_rows
  return start + lax.broadcasted_iota(jnp.int32, (block_rows,), 0) < rows


def _quantize_kernel(x_ref, seed_ref, codes_ref, mn_ref, sc_ref, *, bits, group_size,
                     block_rows, rows):
  per, n = 8 // bits, group_size * bits // 8
  levels = float(2**bits - 1)
  valid = _row_mask(rows, block_rows)
  tile = jnp.broadcast_to(valid[:, None], (block_rows, n))
  planes = [pl_triton.load(x_ref.at[:, pl.ds(j * n, n)], mask=tile, other=0.0
                           ).astype(jnp.float32) for j in range(per)]
  lo = functools.reduce(jnp.minimum, planes)
  hi = functools.reduce(jnp.maximum, planes)
  bad = functools.reduce(jnp.maximum, [jnp.where(p != p, 1.0, 0.0) for p in planes])
  # A NaN in a group must not be hidden (min/max reductions may drop it): the stored
  # minimum becomes NaN, and so does every dequantized value of the group.
  mn = jnp.where(jnp.max(bad, axis=1) > 0, jnp.nan, jnp.min(lo, axis=1))
  sc = group_scale(levels, mn, jnp.max(hi, axis=1))
  pl_triton.store(mn_ref, mn, mask=valid)
  pl_triton.store(sc_ref, sc.astype(sc_ref.dtype), mask=valid)
  seed = pl_triton.load(seed_ref)[0]
  row = (pl.program_id(0) * block_rows +
         lax.broadcasted_iota(jnp.int32, (block_rows, n), 0)).astype(jnp.uint32)
  col = lax.broadcasted_iota(jnp.int32, (block_rows, n), 1).astype(jnp.uint32)
  acc = jnp.zeros((block_rows, n), jnp.uint32)
  for j, x in enumerate(planes):
    index = row * jnp.uint32(group_size) + col + jnp.uint32(j * n)
    q = jnp.clip(jnp.floor((x - mn[:, None]) * sc[:, None] + hash_uniform(index, seed)),
                 0.0, levels)
    acc = acc | (q.astype(jnp.uint32) << jnp.uint32(j * bits))
  pl_triton.store(codes_ref, acc.astype(jnp.uint8), mask=tile)


def _dequantize_kernel(codes_ref, mn_ref, sc_ref, out_ref, *, bits, group_size, block_rows,
                       rows):
  per, n = 8 // bits, group_size * bits // 8
  valid = _row_mask(rows, block_rows)
  tile = jnp.broadcast_to(valid[:, None], (block_rows, n))
  mn = pl_triton.load(mn_ref, mask=valid, other=0.0).astype(jnp.float32)[:, None]
  sc = pl_triton.load(sc_ref, mask=valid, other=1.0).astype(jnp.float32)[:, None]
  codes = pl_triton.load(codes_ref, mask=tile, other=0).astype(jnp.uint32)
  for j in range(per):
    q = (codes >> jnp.uint32(j * bits)) & jnp.uint32(2**bits - 1)
    pl_triton.store(out_ref.at[:, pl.ds(j * n, n)],
                    (q.astype(jnp.float32) / sc + mn).astype(out_ref.dtype), mask=tile)


def quantize_pack(groups: jax.Array, seed: jax.Array, *, bits: int, scale_dtype=jnp.bfloat16,
                  interpret: bool | None = None, tiles: Tiles | None = None):
  """Codes and metadata of ``float[rows, group_size]`` groups (any float dtype).

  Returns:
    ``(codes uint8[rows, group_size * bits / 8], minimum float32[rows],
    scale scale_dtype[rows])`` with the layout and rounding of `jmem.ops.actnn.quantize.quantize`.
  """
  rows, group_size = groups.shape
  _, n = _check_group(group_size, bits)
  tiles = (tiles or Tiles.get_default()).check()
  bm = tiles.block_rows
  kernel = functools.partial(_quantize_kernel, bits=bits, group_size=group_size, block_rows=bm,
                             rows=rows)
  return pl.pallas_call(
      kernel, grid=(pl.cdiv(rows, bm),),
      in_specs=[pl.BlockSpec((bm, group_size), lambda i: (i, 0)),
                pl.BlockSpec((1,), lambda i: (0,))],
      out_specs=[pl.BlockSpec((bm, n), lambda i: (i, 0)),
                 pl.BlockSpec((bm,), lambda i: (i,)),
                 pl.BlockSpec((bm,), lambda i: (i,))],
      out_shape=[jax.ShapeDtypeStruct((rows, n), jnp.uint8),
                 jax.ShapeDtypeStruct((rows,), jnp.float32),
                 jax.ShapeDtypeStruct((rows,), scale_dtype)],
      interpret=resolve_interpret(interpret, "ActNN (implementation='pallas')"),
      compiler_params=pl_triton.CompilerParams(num_warps=tiles.num_warps),
  )(groups, jnp.reshape(seed, (1,)).astype(jnp.uint32))


def unpack_dequantize(codes: jax.Array, minimum: jax.Array, scale: jax.Array, *, bits: int,
                      dtype=jnp.float32, interpret: bool | None = None,
                      tiles: Tiles | None = None) -> jax.Array:
  """``dtype[rows, group_size]`` from packed codes and the per-row minimum and scale."""
  rows, n = codes.shape
  group_size = n * (8 // bits)
  _check_group(group_size, bits)
  tiles = (tiles or Tiles.get_default()).check()
  bm = tiles.block_rows
  kernel = functools.partial(_dequantize_kernel, bits=bits, group_size=group_size,
                             block_rows=bm, rows=rows)
  return pl.pallas_call(
      kernel, grid=(pl.cdiv(rows, bm),),
      in_specs=[pl.BlockSpec((bm, n), lambda i: (i, 0)),
                pl.BlockSpec((bm,), lambda i: (i,)),
                pl.BlockSpec((bm,), lambda i: (i,))],
      out_specs=pl.BlockSpec((bm, group_size), lambda i: (i, 0)),
      out_shape=jax.ShapeDtypeStruct((rows, group_size), dtype),
      interpret=resolve_interpret(interpret, "ActNN (implementation='pallas')"),
      compiler_params=pl_triton.CompilerParams(num_warps=tiles.num_warps),
  )(codes, minimum, scale)
