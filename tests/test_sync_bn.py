"""SyncBN: exact for masked, unbalanced, offset batches on 8 devices, one collective each way."""

import contextlib
import functools
import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jmem import measure
from jmem.ops import inplace_abn as iabn
from jmem.parallel import sync_bn
from helpers import (EPS, OFFSET_CAP, check_exact, exact_stats,  # pylint: disable=g-multiple-import
                     offset_data, sharded_running_stats, torch_running_stats)

COUNTS = [5, 0, 3, 8, 1, 0, 2, 7]
CAP, C = 8, 3


def _mesh():
  return jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))


def _data(seed=0, offset=1.0, spread=2.0, counts=COUNTS):
  rng = np.random.default_rng(seed)
  x = (rng.normal(size=(8 * CAP, 4, C)) * spread + offset).astype(np.float32)
  mask = np.zeros((8 * CAP, 1, 1), bool)
  for d, c in enumerate(counts):
    mask[d * CAP:d * CAP + c] = True
  g = rng.normal(size=C).astype(np.float32)
  b = rng.normal(size=C).astype(np.float32)
  ct = rng.normal(size=x.shape).astype(np.float32)
  return x, mask, g, b, ct


def _plain_bn(x, g, b, eps=1e-5):
  """Oracle: textbook BN on one device (two-pass)."""
  axes = tuple(range(x.ndim - 1))
  mean = x.mean(axis=axes)
  var = ((x - mean) ** 2).mean(axis=axes)
  return (x - mean) / jnp.sqrt(var + eps) * g + b


def _sharded_loss(fn, mesh):
  def f(x, g, b, m, ct):
    y, _ = fn(x, g, b, axis_name="d", mask=m)
    return jax.lax.psum(jnp.sum(jnp.where(m, y * ct, 0.0)), "d"), y
  return jax.shard_map(f, mesh=mesh, in_specs=(P("d"), P(), P(), P("d"), P("d")),
                       out_specs=(P(), P("d")))


@pytest.mark.slow
@pytest.mark.parametrize("fn", [sync_bn.sync_batch_norm, sync_bn.sync_batch_norm_reference])
def test_unbalanced_masked_matches_plain_bn_on_valid_samples(fn):
  mesh = _mesh()
  x, mask, g, b, ct = _data()
  valid = mask[:, 0, 0]
  want_y = _plain_bn(x[valid], g, b)
  want = jax.grad(lambda x, g, b: jnp.sum(_plain_bn(x, g, b) * ct[valid]), argnums=(0, 1, 2))(
      x[valid], g, b)
  specs = (P("d"), P(), P(), P("d"), P("d"))
  args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, g, b, mask, ct), specs)]
  loss = _sharded_loss(fn, mesh)
  (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(*args)
  y, dx = np.asarray(y), np.asarray(grads[0])
  assert np.isfinite(y).all() and np.isfinite(dx).all()     # empty devices: no NaN
  np.testing.assert_allclose(y[valid], want_y, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dx[valid], want[0], rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(dx[~valid], 0.0)
  np.testing.assert_allclose(grads[1], want[1], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(grads[2], want[2], rtol=1e-5, atol=1e-5)


def test_one_all_gather_forward_one_all_reduce_backward():
  mesh = _mesh()
  x, mask, g, b, ct = _data()
  specs = (P("d"), P(), P(), P("d"))
  args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, g, b, mask), specs)]
  f = jax.shard_map(lambda x, g, b, m: sync_bn.sync_batch_norm(x, g, b, axis_name="d", mask=m)[0],
                    mesh=mesh, in_specs=specs, out_specs=P("d"))
  ctd = jax.device_put(ct, NamedSharding(mesh, P("d")))
  fwd = measure.collective_counts(jax.jit(f), *args)
  both = measure.collective_counts(
      jax.jit(lambda x, g, b, m, ct: jax.vjp(lambda x, g, b: f(x, g, b, m), x, g, b)[1](ct)),
      *args, ctd)
  assert fwd["all-gather"] == 1 and sum(fwd.values()) == 1, fwd
  assert both["all-gather"] == 1 and both["all-reduce"] == 1 and sum(both.values()) == 2, both


def test_all_devices_empty_is_finite():
  mesh = _mesh()
  x, mask, g, b, ct = _data(counts=[0] * 8)
  specs = (P("d"), P(), P(), P("d"), P("d"))
  args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, g, b, mask, ct), specs)]
  (_, y), grads = jax.jit(jax.value_and_grad(_sharded_loss(sync_bn.sync_batch_norm, mesh),
                                             argnums=(0, 1, 2), has_aux=True))(*args)
  for a in (y, *grads):
    assert np.isfinite(np.asarray(a)).all()


@pytest.mark.slow
def test_pmap_and_vmap_give_per_device_parameter_grads():
  x, mask, g, b, ct = _data(1)
  valid = mask[:, 0, 0]
  want = jax.grad(lambda g, b: jnp.sum(_plain_bn(x[valid], g, b) * ct[valid]),
                  argnums=(0, 1))(g, b)
  xs, ms, cts = (a.reshape((8, CAP) + a.shape[1:]) for a in (x, mask, ct))

  def local(x, m, ct, g, b):
    def loss(g, b):
      y, _ = sync_bn.sync_batch_norm(x, g, b, axis_name="i", mask=m)
      return jnp.sum(jnp.where(m, y * ct, 0.0))
    return jax.grad(loss, argnums=(0, 1))(g, b)

  for transform in (functools.partial(jax.pmap, axis_name="i", in_axes=(0, 0, 0, None, None)),
                    functools.partial(jax.vmap, axis_name="i", in_axes=(0, 0, 0, None, None))):
    dg, db = transform(local)(xs, ms, cts, g, b)
    # Per-device partial gradients, as plain autodiff gives there: their sum is the total.
    np.testing.assert_allclose(dg.sum(0), want[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(db.sum(0), want[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("transform", ["pmap", "shard_map"])
def test_axis_index_groups(transform):
  x, mask, g, b, _ = _data(2)
  groups = [[0, 2, 4, 6], [1, 3, 5, 7]]
  bn = lambda x, m, name: sync_bn.sync_batch_norm(x, g, b, axis_name=name, mask=m,
                                                  axis_index_groups=groups)[0]
  if transform == "pmap":
    xs, ms = x.reshape((8, CAP) + x.shape[1:]), mask.reshape((8, CAP, 1, 1))
    ys = np.asarray(jax.pmap(lambda x, m: bn(x, m, "i"), axis_name="i")(xs, ms)).reshape(x.shape)
  else:
    mesh = _mesh()
    f = jax.shard_map(lambda x, m: bn(x, m, "d"), mesh=mesh, in_specs=(P("d"), P("d")),
                      out_specs=P("d"))
    ys = np.asarray(jax.jit(f)(*[jax.device_put(a, NamedSharding(mesh, P("d")))
                                 for a in (x, mask)]))
  for grp in groups:
    rows = np.zeros(len(x), bool)
    for d in grp:
      rows[d * CAP:(d + 1) * CAP] = True
    sel = rows & mask[:, 0, 0]
    np.testing.assert_allclose(ys[sel], _plain_bn(x[sel], g, b), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_tuple_of_axis_names():
  """Statistics over two named axes, under nested vmap and under a 2-D shard_map."""
  x, _, _, _, _ = _data(6)
  want = sync_bn.batch_stats(jnp.asarray(x))
  inner = lambda x: sync_bn.batch_stats(x, axis_name=("a", "b"))
  got = jax.vmap(jax.vmap(inner, axis_name="b"), axis_name="a")(
      x.reshape((4, 2, CAP) + x.shape[1:]))
  np.testing.assert_allclose(got.var[0, 0], want.var, rtol=1e-6)
  mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  f = jax.shard_map(lambda x: inner(x).var, mesh=mesh, in_specs=P(("a", "b")), out_specs=P())
  got = jax.jit(f)(jax.device_put(x, NamedSharding(mesh, P(("a", "b")))))
  np.testing.assert_allclose(got, want.var, rtol=1e-6)


def test_large_offset_is_stable():
  rng = np.random.default_rng(3)
  x = (1e4 + 0.01 * rng.normal(size=(8 * 64, C))).astype(np.float32)
  true_var = x.astype(np.float64).var(axis=0)
  # Single device: two-pass, no shift needed.
  local = sync_bn.batch_stats(jnp.asarray(x))
  np.testing.assert_allclose(local.var, true_var, rtol=1e-4)
  # 8 devices under vmap, one all-gather and an exact merge: no shift needed.
  f = jax.vmap(lambda x: sync_bn.batch_stats(x, axis_name="i"), axis_name="i")
  stats = f(jnp.asarray(x.reshape(8, 64, C)))
  np.testing.assert_allclose(stats.var[0], true_var, rtol=1e-4)
  np.testing.assert_allclose(stats.mean[0], x.astype(np.float64).mean(0), rtol=1e-7)
  # What E[x^2] - E[x]^2 gives in float32 (MXNet's / Flax's form): useless.
  naive = (x ** 2).mean(0) - x.mean(0) ** 2
  assert np.abs(naive - true_var).max() > 10 * true_var.max()


def test_running_stats_and_eval_mode():
  stats = sync_bn.BatchStats(jnp.array([1.0, 2.0]), jnp.array([4.0, 9.0]), jnp.array([4.0, 0.0]))
  m, v = sync_bn.update_running_stats(jnp.zeros(2), jnp.ones(2), stats, momentum=0.9)
  np.testing.assert_allclose(m, [0.1, 0.0])                  # channel 2 saw nothing: kept
  np.testing.assert_allclose(v, [0.9 + 0.4, 1.0])
  _, vu = sync_bn.update_running_stats(jnp.zeros(2), jnp.ones(2), stats, momentum=0.0,
                                       unbiased=True)
  np.testing.assert_allclose(vu, [4.0 * 4 / 3, 1.0])
  # Eval mode of the module: no collective at all.
  mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  model = sync_bn.SyncBatchNorm(use_running_average=True, axis_name="d")
  x = jnp.ones((16, 3))
  variables = model.init(jax.random.key(0), x)
  f = jax.jit(jax.shard_map(lambda v, x: model.apply(v, x), mesh=mesh, in_specs=(P(), P("d")),
                            out_specs=P("d")))
  assert sum(measure.collective_counts(f, variables, x).values()) == 0


@pytest.mark.slow
def test_linen_module_matches_flax_batch_norm():
  x = jax.random.normal(jax.random.key(0), (8, 5, 5, 4)) * 3 + 2
  ours, theirs = sync_bn.SyncBatchNorm(momentum=0.9), nn.BatchNorm(momentum=0.9)
  v = theirs.init(jax.random.key(1), x, use_running_average=False)
  assert jax.tree.structure(ours.init(jax.random.key(1), x, use_running_average=False)) == \
      jax.tree.structure(v)

  def run(m):
    def loss(p):
      y, upd = m.apply({"params": p, "batch_stats": v["batch_stats"]}, x,
                       use_running_average=False, mutable=["batch_stats"])
      return jnp.sum(jnp.sin(y)), (y, upd)
    return jax.grad(loss, has_aux=True)(v["params"])

  (g1, (y1, u1)), (g2, (y2, u2)) = run(ours), run(theirs)
  np.testing.assert_allclose(y1, y2, rtol=1e-5, atol=1e-5)
  for a, b in zip(jax.tree.leaves((g1, u1)), jax.tree.leaves((g2, u2))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  # The interceptor turns an unmodified flax BatchNorm into ours.
  with sync_bn.sync_batch_norm_interceptor():
    y3, u3 = theirs.apply(v, x, use_running_average=False, mutable=["batch_stats"])
  np.testing.assert_allclose(y3, y2, rtol=1e-5, atol=1e-5)
  eval_y = ours.apply(u1 | {"params": v["params"]}, x, use_running_average=True)
  np.testing.assert_allclose(eval_y, theirs.apply(u2 | {"params": v["params"]}, x,
                                                  use_running_average=True), rtol=1e-5, atol=1e-5)


def test_nnx_module_and_swap():
  x = jax.random.normal(jax.random.key(0), (8, 4)) * 2 + 1

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.bn = nnx.BatchNorm(4, momentum=0.9, rngs=rngs)
      self.more = nnx.List([nnx.BatchNorm(4, momentum=0.9, rngs=rngs)])

    def __call__(self, x):
      return self.more[0](self.bn(x))

  net, ref = Net(nnx.Rngs(0)), Net(nnx.Rngs(0))
  assert sync_bn.swap_nnx_batch_norm(net) == 2
  assert isinstance(net.bn, sync_bn.NNXSyncBatchNorm)
  np.testing.assert_allclose(net(x), ref(x), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(net.bn.mean[...], ref.bn.mean[...], rtol=1e-6)
  net.eval(), ref.eval()
  np.testing.assert_allclose(net(x), ref(x), rtol=1e-5, atol=1e-5)


def test_bf16_input_float32_reductions():
  x = (jax.random.normal(jax.random.key(0), (64, 8)) * 3 + 5).astype(jnp.bfloat16)
  y, stats = sync_bn.sync_batch_norm(x)
  assert y.dtype == jnp.bfloat16 and stats.var.dtype == jnp.float32
  want = _plain_bn(x.astype(jnp.float32), jnp.ones(8), jnp.zeros(8))
  np.testing.assert_allclose(y.astype(jnp.float32), want, atol=2e-2)   # bf16 output rounding


def test_bad_input_errors():
  x = jnp.ones((4, 3))
  with pytest.raises(NameError, match="not bound"):
    sync_bn.sync_batch_norm(x, axis_name="batch")
  with pytest.raises(ValueError, match="mask"):
    sync_bn.sync_batch_norm(x, mask=jnp.ones((4,), bool))
  with pytest.raises(ValueError, match="epsilon"):
    sync_bn.sync_batch_norm(x, epsilon=0.0)
  with pytest.raises(ValueError, match="scale"):
    sync_bn.sync_batch_norm(x, jnp.ones(4))


# ------------------------------------------------ precision on offset data, bad padding

def _on_mesh(f, x, mask, out_specs):
  mesh = _mesh()
  args = [jax.device_put(a, NamedSharding(mesh, P("d"))) for a in (x, mask)]
  return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("d"), P("d")),
                               out_specs=out_specs))(*args)


def test_offset_data_is_exact_without_a_shift():
  """Means 1e2..1e6, std 1e-2..1, unbalanced counts with empty devices; shift=None."""
  x, mask = offset_data()

  def f(x, m):
    y, stats = sync_bn.sync_batch_norm(x, axis_name="d", mask=m, epsilon=EPS)
    return y, stats.mean, stats.var
  y, mean, var = _on_mesh(f, x, mask, (P("d"), P(), P()))
  check_exact(x, mask, y, mean, var)
  # The shift is accepted for compatibility and changes nothing.
  for shift in (jnp.zeros(x.shape[-1]), jnp.full(x.shape[-1], 1e6), jnp.asarray(mean)):
    g = lambda x, m, s=shift: sync_bn.sync_batch_norm(x, axis_name="d", mask=m, shift=s,
                                                       epsilon=EPS)[0]
    np.testing.assert_array_equal(_on_mesh(g, x, mask, P("d")), y)


# Every mean 1e2..1e6 x std 1e-2..1 (the 1e6 / 1e-2 channel is float32-rounded data, compared
# on the rounded values), and counts large enough per device (up to 100) that XLA's rewrite of
# a per-device mean into a fused multiply-add showed: before `jmem._bn_core.pin`, masked variances
# were off by up to 0.39 (relative) on shard_map and pmap alike.
ALL_CHANNELS = tuple((m, s) for m in (1e2, 1e3, 1e4, 1e5, 1e6) for s in (1e-2, 1e-1, 1.0))


@pytest.mark.parametrize("path", ["sync_bn-shard_map", "sync_bn-pmap", "sync_bn-pallas-unmasked",
                                  "abn-shard_map", "abn-pmap", "abn-pallas-unmasked"])
def test_offset_data_large_unbalanced_counts_every_path(path):
  counts, cap = ((60, 0, 30, 100, 1, 0, 20, 90), 100)
  if path.endswith("pallas-unmasked"):
    counts, cap = (37,) * 8, 37
  x, mask = offset_data(channels=ALL_CHANNELS, counts=counts, cap=cap)
  c = x.shape[-1]
  if path.startswith("sync_bn"):
    impl = "pallas" if "pallas" in path else "xla"
    fn = lambda x, m: (lambda r: (r[0], r[1].mean, r[1].var))(sync_bn.sync_batch_norm(
        x, axis_name="d", mask=None if impl == "pallas" else m, epsilon=EPS,
        implementation=impl, interpret=True if impl == "pallas" else None))
  else:
    impl = "pallas" if "pallas" in path else "xla"
    fn = lambda x, m: (lambda r: (r[0], r[1].mean, r[1].var))(iabn.inplace_abn(
        x, jnp.ones(c), jnp.zeros(c), activation="identity", epsilon=EPS, axis_name="d",
        mask=None if impl == "pallas" else m, implementation=impl,
        interpret=True if impl == "pallas" else None))
  if path.endswith("pmap"):
    y, mean, var = jax.pmap(fn, axis_name="d")(x.reshape(8, cap, c), mask.reshape(8, cap, 1))
    y, mean, var = y.reshape(x.shape), mean[0], var[0]
  else:
    args = [jax.device_put(a, NamedSharding(_mesh(), P("d"))) for a in (x, mask)]
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")      # interpret mode off the GPU
      y, mean, var = jax.jit(jax.shard_map(fn, mesh=_mesh(), in_specs=(P("d"), P("d")),
                                           out_specs=(P("d"), P(), P()),
                                           check_vma="pallas" not in path))(*args)
  check_exact(x, mask, y, mean, var)


@pytest.mark.slow
def test_offset_data_module_first_step():
  """SyncBatchNorm(momentum=0.9): the running mean (the old shift) starts at 0."""
  x, mask = offset_data()
  model = sync_bn.SyncBatchNorm(momentum=0.9, axis_name="d", epsilon=EPS)
  v = model.init(jax.random.key(0), x[:OFFSET_CAP], use_running_average=False)

  def f(x, m):
    y, upd = model.apply(v, x, use_running_average=False, mask=m, mutable=["batch_stats"])
    return y, upd["batch_stats"]["mean"]
  y, running_mean = _on_mesh(f, x, mask, (P("d"), P()))
  check_exact(x, mask, y)
  np.testing.assert_allclose(running_mean, 0.1 * exact_stats(x, mask)[0], rtol=1e-6)


def test_offset_data_inplace_abn_sync():
  x, mask = offset_data()
  c = x.shape[-1]

  def f(x, m):
    z, stats = iabn.inplace_abn(x, jnp.ones(c), jnp.zeros(c), activation="identity",
                                epsilon=EPS, axis_name="d", mask=m)
    return z, stats.mean, stats.var
  z, mean, var = _on_mesh(f, x, mask, (P("d"), P(), P()))
  check_exact(x, mask, z, mean, var)


def test_bf16_inputs_offset_float32_statistics():
  """bf16 inputs: statistics to float32's tolerance (they are float32 sums of the bf16
  values), outputs to 2e-2 absolute (one bf16 rounding, 2^-9 relative, of |y| <= ~6)."""
  x, mask = offset_data(channels=((10.0, 1.0), (1e2, 1.0), (1e3, 8.0), (1e4, 64.0)),
                         dtype=jnp.bfloat16)

  def f(x, m):
    y, stats = sync_bn.sync_batch_norm(x, axis_name="d", mask=m, epsilon=EPS)
    return y, stats.mean, stats.var
  y, mean, var = _on_mesh(f, x, mask, (P("d"), P(), P()))
  assert y.dtype == jnp.bfloat16 and var.dtype == jnp.float32
  check_exact(np.asarray(x, np.float32), mask, np.asarray(y, np.float32), mean, var, y_atol=2e-2)


def _inplace_abn_sync(x, g, b, *, axis_name, mask):
  return iabn.inplace_abn(x, g, b, axis_name=axis_name, mask=mask)


@pytest.mark.parametrize("fn", [sync_bn.sync_batch_norm, _inplace_abn_sync])
def test_non_finite_padding_is_isolated(fn):
  """NaN / Inf in masked-out samples (an empty device's included) change nothing valid."""
  mesh = _mesh()
  x, mask, g, b, ct = _data(4)
  bad = x.copy()
  bad[CAP - 1, 0] = np.nan                 # device 0 holds 5 valid rows of 8
  bad[CAP + 2, 1] = np.inf                 # device 1 holds none
  bad[5 * CAP:6 * CAP] = -np.inf           # device 5 holds none
  bad[2 * CAP + 4, :, 2] = np.nan          # device 2 holds 3

  def f(x, g, b, m, ct):
    def loss(x, g, b):
      y, stats = fn(x, g, b, axis_name="d", mask=m)
      return jax.lax.psum(jnp.sum(jnp.where(m, y * ct, 0.0)), "d"), (y, stats.mean, stats.var)
    (_, aux), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(x, g, b)
    return aux, grads
  specs = (P("d"), P(), P(), P("d"), P("d"))
  step = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=specs,
                               out_specs=((P("d"), P(), P()), (P("d"), P(), P()))))
  put = lambda *a: [jax.device_put(v, NamedSharding(mesh, s)) for v, s in zip(a, specs)]
  (y0, mean0, var0), grads0 = step(*put(x, g, b, mask, ct))
  (y1, mean1, var1), grads1 = step(*put(bad, g, b, mask, ct))
  valid = mask[:, 0, 0]
  for a in (mean1, var1, *grads1):
    assert np.isfinite(np.asarray(a)).all()
  np.testing.assert_array_equal(mean1, mean0)
  np.testing.assert_array_equal(var1, var0)
  np.testing.assert_array_equal(np.asarray(y1)[valid], np.asarray(y0)[valid])
  np.testing.assert_array_equal(np.asarray(grads1[0])[valid], np.asarray(grads0[0])[valid])
  np.testing.assert_array_equal(np.asarray(grads1[0])[~valid], 0.0)   # dy = 0 there
  np.testing.assert_allclose(grads1[1], grads0[1], rtol=1e-6)
  np.testing.assert_allclose(grads1[2], grads0[2], rtol=1e-6)


@pytest.mark.slow
def test_all_masked_batch_is_identity_statistics():
  """No valid sample anywhere: statistics mean 0 / var 1 / count 0, normalised to 0: y = β
  (not amplified by 1/sqrt(ε)), no gradient."""
  mesh = _mesh()
  x, mask, g, b, ct = _data(5, counts=[0] * 8)

  def f(x, g, b, m, ct):
    def loss(x, g, b):
      y, stats = sync_bn.sync_batch_norm(x, g, b, axis_name="d", mask=m)
      return jax.lax.psum(jnp.sum(y * ct), "d"), (y, stats)
    return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(x, g, b)
  specs = (P("d"), P(), P(), P("d"), P("d"))
  args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, g, b, mask, ct), specs)]
  (_, (y, stats)), (dx, _, _) = jax.jit(jax.shard_map(
      f, mesh=mesh, in_specs=specs, out_specs=((P(), (P("d"), P())), (P("d"), P(), P()))))(*args)
  np.testing.assert_array_equal(stats.mean, 0.0)
  np.testing.assert_array_equal(stats.var, 1.0)
  np.testing.assert_array_equal(stats.count, 0.0)
  np.testing.assert_array_equal(y, np.broadcast_to(b, x.shape))
  np.testing.assert_array_equal(dx, 0.0)
  # The module keeps its running statistics.
  model = sync_bn.SyncBatchNorm(momentum=0.9, axis_name="d")
  v = model.init(jax.random.key(0), x[:CAP], use_running_average=False)
  v = {"params": v["params"], "batch_stats": {"mean": jnp.array([1.0, 2.0, 3.0]),
                                              "var": jnp.array([4.0, 5.0, 6.0])}}
  apply = jax.jit(jax.shard_map(
      lambda x, m: model.apply(v, x, use_running_average=False, mask=m, mutable=["batch_stats"]),
      mesh=mesh, in_specs=(P("d"), P("d")), out_specs=(P("d"), P())))
  y, upd = apply(args[0], args[3])
  assert np.isfinite(np.asarray(y)).all()
  for name in ("mean", "var"):
    np.testing.assert_array_equal(upd["batch_stats"][name], v["batch_stats"][name])


def test_non_boolean_mask_is_refused():
  x = jnp.ones((4, 3))
  for bad in (jnp.full((4, 1), 0.5), jnp.array([[1.0], [np.nan], [0.0], [1.0]]),
              jnp.ones((4, 1), jnp.int32)):
    with pytest.raises(TypeError, match="boolean"):
      sync_bn.sync_batch_norm(x, mask=bad)
    with pytest.raises(TypeError, match="boolean"):
      sync_bn.SyncBatchNorm().init(jax.random.key(0), x, use_running_average=False, mask=bad)


# --------------------------------------- running statistics: Flax's and PyTorch's conventions

def _linen_steps(model, batches, **interceptor):
  """Running stats and the eval output of a linen module after one step per batch."""
  ctx = (sync_bn.sync_batch_norm_interceptor(**interceptor) if interceptor
         else contextlib.nullcontext())
  with ctx:
    v = model.init(jax.random.key(0), batches[0], use_running_average=False)
    for x in batches:
      _, upd = model.apply(v, x, use_running_average=False, mutable=["batch_stats"])
      v = {"params": v["params"], **upd}
    y = model.apply(v, batches[0], use_running_average=True)
  return v["batch_stats"]["mean"], v["batch_stats"]["var"], y


def _nnx_steps(module, batches):
  for x in batches:
    module(x, use_running_average=False)
  y = module(batches[0], use_running_average=True)
  bn = module.bn if hasattr(module, "bn") else module
  return bn.mean[...], bn.var[...], y


class _NNXNet(nnx.Module):
  def __init__(self):
    self.bn = nnx.BatchNorm(C, momentum=0.9, rngs=nnx.Rngs(0))

  def __call__(self, x, use_running_average=None):
    return self.bn(x, use_running_average=use_running_average)


def _swapped(unbiased):
  net = _NNXNet()
  assert sync_bn.swap_nnx_batch_norm(net, unbiased_running_var=unbiased) == 1
  return net


RUNNERS = {
    "SyncBatchNorm": lambda u, b: _linen_steps(
        sync_bn.SyncBatchNorm(momentum=0.9, unbiased_running_var=u), b),
    "interceptor": lambda u, b: _linen_steps(nn.BatchNorm(momentum=0.9), b,
                                             unbiased_running_var=u),
    "NNXSyncBatchNorm": lambda u, b: _nnx_steps(
        sync_bn.NNXSyncBatchNorm(C, momentum=0.9, unbiased_running_var=u), b),
    "swap_nnx_batch_norm": lambda u, b: _nnx_steps(_swapped(u), b),
}


@pytest.mark.parametrize("module", list(RUNNERS))
def test_running_stats_follow_pytorch_update_rule(module):
  """momentum=0.9 here is PyTorch's 0.1; both variance conventions over three steps, and
  eval mode normalises with the stored statistics as PyTorch's eval does."""
  rng = np.random.default_rng(7)
  batches = [(rng.normal(size=(6, 2, C)) * 2 + 3).astype(np.float32) for _ in range(3)]
  valid = [b.reshape(-1, C) for b in batches]
  for unbiased in (False, True):
    mean, var, y = RUNNERS[module](unbiased, [jnp.asarray(b) for b in batches])
    want_mean, want_var = torch_running_stats(valid, torch_momentum=0.1, unbiased=unbiased)
    np.testing.assert_allclose(mean, want_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(var, want_var, rtol=1e-5)
    want_y = (batches[0].astype(np.float64) - want_mean) / np.sqrt(want_var + 1e-5)
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_running_stats_masked_unbalanced_on_eight_devices():
  """N is the global valid count (26 rows x 2 positions), not a device's or the padded one."""
  rng = np.random.default_rng(8)
  _, mask, _, _, _ = _data()
  batches = [(rng.normal(size=(8 * CAP, 2, C)) * 2 + 3).astype(np.float32) for _ in range(2)]
  models = [sync_bn.SyncBatchNorm(momentum=0.9, axis_name="d", unbiased_running_var=u)
            for u in (False, True)]
  got = sharded_running_stats(models, batches, mask)
  valid = [b[mask[:, 0, 0]].reshape(-1, C) for b in batches]
  for (mean, var), unbiased in zip(got, (False, True)):
    want_mean, want_var = torch_running_stats(valid, torch_momentum=0.1, unbiased=unbiased)
    np.testing.assert_allclose(mean, want_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(var, want_var, rtol=1e-5)


def test_axes_left_out_under_shard_map_without_varying_types_warn_too():
  """Under ``shard_map(check_vma=False)`` JAX's types do not say whether x is split: a batch
  norm whose axis_name leaves out a manual axis warns (it used per-shard statistics, up to
  0.35 off global BatchNorm, without a word); one over every axis stays quiet."""
  mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  x = jnp.asarray(_data()[0][:, 0])
  trace = lambda f: jax.make_jaxpr(jax.shard_map(
      f, mesh=mesh, in_specs=P(("a", "b")), out_specs=P(("a", "b")), check_vma=False))(x)
  model = sync_bn.SyncBatchNorm(use_running_average=False)
  variables = model.init(jax.random.key(0), x)
  run = lambda name: lambda v: model.clone(axis_name=name).apply(
      variables, v, mutable=["batch_stats"])[0]
  for name, left_out in ((None, "['a', 'b']"), ("a", "['b']")):
    with pytest.warns(sync_bn.LocalStatisticsWarning, match=rf"check_vma=False.*"
                                                            rf"{re.escape(left_out)}"):
      trace(run(name))
  with warnings.catch_warnings():
    warnings.simplefilter("error", sync_bn.LocalStatisticsWarning)
    trace(run(("a", "b")))


def test_non_floating_inputs_are_refused():
  """Integers (or booleans) would come back rounded to the input's dtype: TypeError."""
  xf = jnp.arange(12.0).reshape(4, 3)
  variables = sync_bn.SyncBatchNorm().init(jax.random.key(0), xf, use_running_average=False)
  for x in (xf.astype(jnp.int32), xf > 5):
    for call in (lambda: sync_bn.sync_batch_norm(x),
                 lambda: sync_bn.sync_batch_norm_reference(x),
                 lambda: sync_bn.SyncBatchNorm().init(jax.random.key(0), x,
                                                      use_running_average=False),
                 lambda: sync_bn.SyncBatchNorm().apply(variables, x, use_running_average=True),
                 lambda: sync_bn.NNXSyncBatchNorm(3)(x),
                 lambda: sync_bn.NNXSyncBatchNorm(3, use_running_average=True)(x)):
      with pytest.raises(TypeError, match="floating-point input"):
        call()


def test_axes_left_out_inside_shard_map_warn_and_unbound_names_raise():
  """x split over ('a', 'b'): statistics over fewer axes are per shard (a warning: it may be
  deliberate local BN); an unbound name is an error; init inside the map stays quiet."""
  mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  x = jnp.asarray(_data()[0][:, 0])                                  # [64, C]

  def trace(f, spec=P(("a", "b"))):
    return jax.make_jaxpr(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec))(x)

  calls = {
      "sync_batch_norm": lambda name: lambda v: sync_bn.sync_batch_norm(v, axis_name=name)[0],
      "batch_stats": lambda name: lambda v: v + sync_bn.batch_stats(v, axis_name=name).mean,
      "inplace_abn": lambda name: lambda v: iabn.inplace_abn(v, jnp.ones(C), jnp.zeros(C),
                                                            axis_name=name)[0],
  }
  for op, call in calls.items():
    for name, left_out in ((None, "['a', 'b']"), ("a", "['b']"), (("b",), "['a']")):
      with pytest.warns(sync_bn.LocalStatisticsWarning, match=rf"{op}.*{re.escape(left_out)}"):
        trace(call(name))
    with pytest.raises(NameError, match="'batch' is not bound"):
      trace(call("batch"))
    with warnings.catch_warnings():
      warnings.simplefilter("error", sync_bn.LocalStatisticsWarning)
      trace(call(("a", "b")))                      # synchronised over every axis
      trace(call(None), spec=P())                  # replicated input: nothing is split
  model = sync_bn.SyncBatchNorm(axis_name=("a", "b"))
  with warnings.catch_warnings():
    warnings.simplefilter("error", sync_bn.LocalStatisticsWarning)
    trace(lambda v: v * model.init(jax.random.key(0), v, use_running_average=False)[
        "params"]["scale"])                        # init is local, by design: quiet
  variables = model.init(jax.random.key(0), x, use_running_average=False)
  with pytest.warns(sync_bn.LocalStatisticsWarning, match=r"\['b'\]"):
    trace(lambda v: model.clone(axis_name="a").apply(
        variables, v, use_running_average=False, mutable=["batch_stats"])[0])
