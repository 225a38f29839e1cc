"""InPlace-ABN Pallas kernels: tiles, offsets, sync and masking in interpret mode (the shared
forward + VJP body and the CUDA lowering of every backend are in test_backends.py)."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jmem import measure
from jmem.ops import inplace_abn as iabn
from pallas_kernels import inplace_abn as kernels
from helpers import (EPS, assert_close_dtype, bn_data, check_exact, offset_data,
                     unmasked_kernel_accesses)

SMALL = kernels.Tiles(block_rows=16, block_channels=4)   # several tiles on tiny shapes


def _pallas(cfg_kw, tiles=SMALL):
  cfg = iabn.ABNConfig(**cfg_kw).validate()

  def f(x, g, b):
    return kernels.inplace_abn_pallas(x, g, b, cfg, tiles=tiles, interpret=True)[0]
  return f


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(4, 3, 5, 6), (37, 3), (40, 8)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("activation,kw", [("leaky_relu", dict(slope=0.1)),
                                           ("elu", dict(alpha=0.7)), ("identity", {})])
def test_kernels_match_reference(shape, dtype, activation, kw):
  """Rows and channels that do not fill the tiles (37 rows, 3 or 6 channels) included."""
  x, g, b, ct = bn_data(shape, dtype)
  f = _pallas(dict(kw, activation=activation))
  r = lambda x, g, b: iabn.inplace_abn_reference(x, g, b, activation=activation, **kw)[0]
  z, vjp = jax.vjp(f, x, g, b)
  z_ref, vjp_ref = jax.vjp(r, x, g, b)
  assert z.dtype == dtype
  assert_close_dtype(z, z_ref, dtype)
  for a, e in zip(vjp(ct), vjp_ref(ct)):
    assert_close_dtype(a, e, dtype)


@pytest.mark.parametrize("axis_name", [None, "d"])
def test_offset_statistics_are_exact(axis_name):
  """Means 1e2..1e6, std 1e-2..1, devices shifted apart: tiles and devices merge exactly."""
  x, mask = offset_data(channels=((1e2, 1e-2), (1e4, 1e-2), (1e6, 1e-1), (0.0, 1.0)),
                        counts=(8,) * 8, cap=8)
  cfg = iabn.ABNConfig(activation="identity", epsilon=EPS, axis_name=axis_name).validate()
  tiles = kernels.Tiles(block_rows=4, block_channels=4)    # 2 tiles a device, 16 in all

  def f(x):
    z, stats = kernels.inplace_abn_pallas(x, jnp.ones(4), jnp.zeros(4), cfg, tiles=tiles,
                                          interpret=True)
    return z, stats.mean, stats.var
  if axis_name is not None:
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    f = jax.shard_map(f, mesh=mesh, in_specs=P("d"), out_specs=(P("d"), P(), P()),
                      check_vma=False)
    x = jax.device_put(x, NamedSharding(mesh, P("d")))
  z, mean, var = jax.jit(f)(x)
  check_exact(np.asarray(x), mask, z, mean, var)


@pytest.mark.slow
def test_public_switch_and_sync_over_eight_devices():
  """``implementation="pallas"`` with axis_name: one collective each way, equals the full batch."""
  x, g, b, ct = bn_data((8 * 6, 5))
  want = jax.grad(lambda x, g, b: jnp.sum(iabn.inplace_abn_reference(x, g, b)[0] * ct),
                  argnums=(0, 1, 2))(x, g, b)
  mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
  specs = (P("d"), P(), P(), P("d"))

  def local(x, g, b, ct):
    z, _ = iabn.inplace_abn(x, g, b, axis_name="d", implementation="pallas", interpret=True)
    return jax.lax.psum(jnp.sum(z * ct), "d")

  # check_vma=False: the Pallas *interpreter* evaluates the kernel's literals as
  # non-varying values next to varying blocks and trips the check (not the GPU lowering).
  step = jax.jit(jax.grad(jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P(),
                                        check_vma=False), argnums=(0, 1, 2)))
  args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, g, b, ct), specs)]
  for got, exp in zip(step(*args), want):
    np.testing.assert_allclose(got, exp, rtol=1e-5, atol=1e-5)
  counted = measure.collective_counts(step, *args)
  assert counted["all-gather"] == 1 and counted["all-reduce"] <= 2, counted   # + the loss psum


def test_kernels_mask_every_access():
  """37 rows x 6 channels leave partial tiles: every kernel load and store is masked."""
  x, g, b, ct = bn_data((37, 6))
  f = _pallas(dict(activation="leaky_relu", slope=0.1))
  assert unmasked_kernel_accesses(lambda *a: jax.vjp(f, *a)[1](ct), x, g, b) == []


def test_interpret_on_cpu_warns_and_mask_is_refused():
  x, g, b, _ = bn_data((8, 4))
  with pytest.warns(UserWarning, match="interpret mode") as caught:
    line = inspect.currentframe().f_lineno + 1
    iabn.inplace_abn(x, g, b, implementation="pallas")
  # The warning names the caller's line, not a frame inside jmem, the kernels or JAX.
  assert {(w.filename, w.lineno) for w in caught if "interpret" in str(w.message)} == {
      (__file__, line)}
  with pytest.raises(ValueError, match="mask"):
    iabn.inplace_abn(x, g, b, implementation="pallas", mask=jnp.ones((8, 1), bool))
  with pytest.raises(ValueError, match="powers of two"):
    _pallas({}, kernels.Tiles(block_rows=24))(x, g, b)
