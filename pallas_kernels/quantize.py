"""Pallas kernels for ActNN: fused dither + quantize + pack, and fused unpack + dequantize.

Both work on the grouped view ``[rows = N * G, group_size]`` with per-row minimum and scale
computed by `jmem.ops.quantize.group_statistics` (a cheap reduction). One program handles
``block_rows`` groups: the quantize kernel reads each value once and writes the packed byte
once; the ``8 / bits`` values that share a byte are read with strided ref loads
(``pl.ds(j, n, stride=8 / bits)``), so no value-level slicing or gather is needed (Triton
lowering). The dither is `jmem.ops.quantize.hash_uniform` of the flat element index, so the
codes are bit-identical to the XLA path.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from jmem.ops.quantize import hash_uniform
from pallas_kernels._interpret import resolve_interpret

__all__ = ["quantize_pack", "unpack_dequantize", "BLOCK_ROWS"]

BLOCK_ROWS = 16


def _check_group(group_size, bits):
  per = 8 // bits
  n = group_size // per
  if group_size % per or n & (n - 1):
    raise ValueError(f"The Pallas kernels need group_size * bits / 8 to be a power of two "
                     f"(Triton blocks), got group_size={group_size}, bits={bits}.")
  return per, n


def _quantize_kernel(x_ref, mn_ref, sc_ref, seed_ref, codes_ref, *, bits, group_size,
                     block_rows):
  per = 8 // bits
  n = group_size // per
  levels = float(2**bits - 1)
  mn = mn_ref[...].astype(jnp.float32)[:, None]
  sc = sc_ref[...].astype(jnp.float32)[:, None]
  seed = seed_ref[0]
  row = (pl.program_id(0) * block_rows +
         lax.broadcasted_iota(jnp.int32, (block_rows, n), 0)).astype(jnp.uint32)
  col = lax.broadcasted_iota(jnp.int32, (block_rows, n), 1).astype(jnp.uint32)
  acc = jnp.zeros((block_rows, n), jnp.uint32)
  for j in range(per):
    x = x_ref[:, pl.ds(j, n, stride=per)]
    index = row * jnp.uint32(group_size) + col * jnp.uint32(per) + jnp.uint32(j)
    q = jnp.clip(jnp.floor((x - mn) * sc + hash_uniform(index, seed)), 0.0, levels)
    acc = acc | (q.astype(jnp.uint32) << jnp.uint32(j * bits))
  codes_ref[...] = acc.astype(jnp.uint8)


def _dequantize_kernel(codes_ref, mn_ref, sc_ref, out_ref, *, bits, group_size):
  per = 8 // bits
  n = group_size // per
  mn = mn_ref[...].astype(jnp.float32)[:, None]
  sc = sc_ref[...].astype(jnp.float32)[:, None]
  codes = codes_ref[...].astype(jnp.uint32)
  for j in range(per):
    q = (codes >> jnp.uint32(j * bits)) & jnp.uint32(2**bits - 1)
    out_ref[:, pl.ds(j, n, stride=per)] = q.astype(jnp.float32) / sc + mn


def quantize_pack(groups: jax.Array, minimum: jax.Array, scale: jax.Array, seed: jax.Array, *,
                  bits: int, interpret: bool | None = None,
                  block_rows: int = BLOCK_ROWS) -> jax.Array:
  """``uint8[rows, group_size * bits / 8]`` codes of ``float32[rows, group_size]`` groups."""
  rows, group_size = groups.shape
  _, n = _check_group(group_size, bits)
  kernel = functools.partial(_quantize_kernel, bits=bits, group_size=group_size,
                             block_rows=block_rows)
  return pl.pallas_call(
      kernel, grid=(pl.cdiv(rows, block_rows),),
      in_specs=[pl.BlockSpec((block_rows, group_size), lambda i: (i, 0)),
                pl.BlockSpec((block_rows,), lambda i: (i,)),
                pl.BlockSpec((block_rows,), lambda i: (i,)),
                pl.BlockSpec((1,), lambda i: (0,))],
      out_specs=pl.BlockSpec((block_rows, n), lambda i: (i, 0)),
      out_shape=jax.ShapeDtypeStruct((rows, n), jnp.uint8),
      interpret=resolve_interpret(interpret, "ActNN (implementation='pallas')"),
      compiler_params=pl_triton.CompilerParams(num_warps=4),
  )(groups.astype(jnp.float32), minimum, scale, jnp.reshape(seed, (1,)).astype(jnp.uint32))


def unpack_dequantize(codes: jax.Array, minimum: jax.Array, scale: jax.Array, *, bits: int,
                      interpret: bool | None = None,
                      block_rows: int = BLOCK_ROWS) -> jax.Array:
  """``float32[rows, group_size]`` from packed codes and the per-row minimum and scale."""
  rows, n = codes.shape
  group_size = n * (8 // bits)
  _check_group(group_size, bits)
  kernel = functools.partial(_dequantize_kernel, bits=bits, group_size=group_size)
  return pl.pallas_call(
      kernel, grid=(pl.cdiv(rows, block_rows),),
      in_specs=[pl.BlockSpec((block_rows, n), lambda i: (i, 0)),
                pl.BlockSpec((block_rows,), lambda i: (i,)),
                pl.BlockSpec((block_rows,), lambda i: (i,))],
      out_specs=pl.BlockSpec((block_rows, group_size), lambda i: (i, 0)),
      out_shape=jax.ShapeDtypeStruct((rows, group_size), jnp.float32),
      interpret=resolve_interpret(interpret, "ActNN (implementation='pallas')"),
      compiler_params=pl_triton.CompilerParams(num_warps=4),
  )(codes, minimum, scale)
