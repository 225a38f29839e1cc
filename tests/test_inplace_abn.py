"""InPlace-ABN: exact against BN + activation, saves only its output, refuses ReLU."""


import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jmem
from jmem import bench, measure, models, train
from jmem.ops import inplace_abn as iabn
from helpers import (assert_close_dtype, bn_data,  # pylint: disable=g-multiple-import
                     sharded_running_stats, torch_running_stats)


def _data(dtype=jnp.float32, seed=0, shape=(16, 5, 5, 8)):
  return bn_data(shape, dtype, seed)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("activation,kw", [("leaky_relu", dict(slope=0.1)),
                                           ("elu", dict(alpha=0.7)), ("identity", {})])
@pytest.mark.parametrize("eval_mode", [False, True])
def test_forward_and_vjp_match_reference(dtype, activation, kw, eval_mode):
  x, g, b, ct = _data(dtype)
  kw = dict(kw, activation=activation, use_running_average=eval_mode,
            running_mean=jnp.linspace(0, 1, 8), running_var=jnp.linspace(1, 4, 8))
  f = lambda x, g, b: iabn.inplace_abn(x, g, b, **kw)[0]
  r = lambda x, g, b: iabn.inplace_abn_reference(x, g, b, **kw)[0]
  z, vjp = jax.vjp(f, x, g, b)
  z_ref, vjp_ref = jax.vjp(r, x, g, b)
  assert z.dtype == dtype
  assert_close_dtype(z, z_ref, dtype)
  for a, e in zip(vjp(ct), vjp_ref(ct)):
    assert_close_dtype(a, e, dtype)


def test_saves_only_its_output():
  x, g, b, ct = _data()
  loss = lambda fn: (lambda x, g, b: jnp.sum(fn(x, g, b)[0] * ct))
  ours = measure.saved_residuals(loss(iabn.inplace_abn), x, g, b)
  full = [r for r in ours.residuals if r.source == "activation" and r.shape == x.shape]
  assert len(full) == 1                              # z, nothing else of x's size
  assert ours.activation_bytes <= x.nbytes + 1024
  ref = measure.saved_residuals(loss(iabn.inplace_abn_reference), x, g, b)
  assert ref.activation_bytes >= 2 * x.nbytes


@pytest.mark.slow
def test_sync_unbalanced_matches_single_device():
  counts, cap = [5, 0, 3, 8, 1, 0, 2, 7], 8
  x, g, b, ct = _data(shape=(8 * cap, 3, 4), seed=1)
  mask = np.zeros((8 * cap, 1, 1), bool)
  for d, c in enumerate(counts):
    mask[d * cap:d * cap + c] = True
  valid = mask[:, 0, 0]
  want = jax.grad(lambda x, g, b: jnp.sum(iabn.inplace_abn_reference(x, g, b)[0] * ct[valid]),
                  argnums=(0, 1, 2))(x[valid], g, b)
  mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
  specs = (P("d"), P(), P(), P("d"), P("d"))

  def local(x, g, b, m, ct):
    z, _ = iabn.inplace_abn(x, g, b, axis_name="d", mask=m)
    return jax.lax.psum(jnp.sum(jnp.where(m, z * ct, 0.0)), "d")

  f = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P())
  args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, g, b, mask, ct), specs)]
  grads = jax.jit(jax.grad(f, argnums=(0, 1, 2)))(*args)
  dx = np.asarray(grads[0])
  assert np.isfinite(dx).all()
  np.testing.assert_allclose(dx[valid], want[0], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(grads[1], want[1], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(grads[2], want[2], rtol=1e-5, atol=1e-5)
  counted = measure.collective_counts(jax.jit(jax.grad(f, argnums=(0, 1, 2))), *args)
  # Statistics: one all-gather forward; one all-reduce backward and one for the loss psum
  # (which XLA may combine into one).
  assert counted["all-gather"] == 1 and counted["all-reduce"] <= 2, counted


@pytest.mark.slow
def test_elu_saturation_has_no_nan():
  x = jnp.concatenate([jnp.full((4, 2), -1e4), jnp.ones((4, 2))], 0)
  g = jax.grad(lambda x: jnp.sum(iabn.inplace_abn(x, jnp.ones(2), jnp.zeros(2),
                                                  activation="elu")[0]))(x)
  assert np.isfinite(np.asarray(g)).all()


def test_weight_mapping_to_plain_batch_norm():
  x, _, b, _ = _data()
  s = jnp.linspace(0.5, 2.0, 8)
  z, _ = iabn.inplace_abn(x, iabn.from_batch_norm_scale(s), b)
  mean, var = x.mean((0, 1, 2)), x.var((0, 1, 2))
  plain = nn.leaky_relu((x - mean) / jnp.sqrt(var + 1e-5) * s + b, 0.01)
  np.testing.assert_allclose(z, plain, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(iabn.to_batch_norm_scale(iabn.from_batch_norm_scale(s)), s, rtol=1e-6)
  with pytest.raises(ValueError, match="epsilon"):
    iabn.from_batch_norm_scale(jnp.array([-1.0, 1.0]))


def test_bad_input_errors():
  x, g, b, _ = _data()
  with pytest.raises(ValueError, match="relu"):
    iabn.inplace_abn(x, g, b, activation="relu")
  with pytest.raises(ValueError, match="slope"):
    iabn.inplace_abn(x, g, b, slope=0.0)
  with pytest.raises(ValueError, match="slope"):
    iabn.inplace_abn(x, g, b, slope=-0.1)
  with pytest.raises(ValueError, match="alpha"):
    iabn.inplace_abn(x, g, b, activation="elu", alpha=0.0)
  with pytest.raises(ValueError, match="epsilon"):
    iabn.inplace_abn(x, g, b, epsilon=0.0)
  with pytest.raises(NameError, match="not bound"):
    iabn.inplace_abn(x, g, b, axis_name="batch")
  with pytest.raises(ValueError, match="mask"):
    iabn.inplace_abn(x, g, b, mask=jnp.ones((16,), bool))
  with pytest.raises(TypeError, match="boolean"):
    iabn.inplace_abn(x, g, b, mask=jnp.full((16, 1, 1, 1), 0.5))
  with pytest.raises(ValueError, match="implementation"):
    iabn.inplace_abn(x, g, b, implementation="cuda")
  with pytest.raises(ValueError, match="axis_name"):
    iabn.InPlaceABNSync().init(jax.random.key(0), x, use_running_average=False)


def test_modules_linen_and_nnx():
  x, _, _, _ = _data()
  m = iabn.InPlaceABN(momentum=0.9)
  v = m.init(jax.random.key(0), x, use_running_average=False)
  z, upd = m.apply(v, x, use_running_average=False, mutable=["batch_stats"])
  bn_vars = {"params": {"scale": jnp.ones(8) + 1e-5, "bias": jnp.zeros(8)},
             "batch_stats": v["batch_stats"]}
  ref = nn.leaky_relu(nn.BatchNorm(momentum=0.9).apply(
      bn_vars, x, use_running_average=False, mutable=["batch_stats"])[0], 0.01)
  np.testing.assert_allclose(z, ref, rtol=1e-5, atol=1e-5)
  assert float(jnp.abs(upd["batch_stats"]["mean"]).sum()) > 0
  n = iabn.NNXInPlaceABN(8, momentum=0.9)
  np.testing.assert_allclose(n(x), z, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(n.mean[...], upd["batch_stats"]["mean"], rtol=1e-6)
  n.eval()
  assert n(x).shape == x.shape


def _step_memory(model):
  x = jax.ShapeDtypeStruct((32, 16, 16, 1), jnp.float32)
  y = jax.ShapeDtypeStruct((32,), jnp.int32)
  return bench.step_memory(train.model_fns(model), train.default_optimizer(1e-3, 10), x, y)


@pytest.mark.slow
def test_preactivation_step_saves_memory():
  twin = models.create_model("preact20", 10)          # its activation: leaky_relu 0.01
  pairs = jmem.surgery.inplace_abn_sites(twin, jnp.zeros((2, 16, 16, 1)))
  assert len(pairs) == 18, pairs                      # two per block
  abn = jmem.convert(twin, jmem.InPlaceABN(where=tuple(pairs)))
  (s_bn, t_bn), (s_abn, t_abn) = _step_memory(twin), _step_memory(abn)
  assert s_abn <= 0.6 * s_bn
  assert t_abn < 0.8 * t_bn


def _leaky(y, slope=0.01):
  return np.where(y >= 0, y, slope * y)


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_running_stats_follow_pytorch_update_rule(api):
  """momentum=0.9 here is PyTorch's 0.1; both variance conventions over three steps; eval
  mode normalises with the stored statistics and the effective scale |γ| + ε."""
  rng = np.random.default_rng(7)
  batches = [jnp.asarray(rng.normal(size=(6, 2, 3)) * 2 + 3, jnp.float32) for _ in range(3)]
  for unbiased in (False, True):
    if api == "linen":
      m = iabn.InPlaceABN(momentum=0.9, unbiased_running_var=unbiased)
      v = m.init(jax.random.key(0), batches[0], use_running_average=False)
      for x in batches:
        _, upd = m.apply(v, x, use_running_average=False, mutable=["batch_stats"])
        v = {"params": v["params"], **upd}
      mean, var = v["batch_stats"]["mean"], v["batch_stats"]["var"]
      y = m.apply(v, batches[0], use_running_average=True)
    else:
      m = iabn.NNXInPlaceABN(3, momentum=0.9, unbiased_running_var=unbiased)
      for x in batches:
        m(x, use_running_average=False)
      mean, var, y = m.mean[...], m.var[...], m(batches[0], use_running_average=True)
    want_mean, want_var = torch_running_stats([np.asarray(b).reshape(-1, 3) for b in batches],
                                              torch_momentum=0.1, unbiased=unbiased)
    np.testing.assert_allclose(mean, want_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(var, want_var, rtol=1e-5)
    xhat = (np.asarray(batches[0], np.float64) - want_mean) / np.sqrt(want_var + 1e-5)
    np.testing.assert_allclose(y, _leaky(xhat * (1 + 1e-5)), rtol=1e-5, atol=1e-5)


def test_sync_running_stats_masked_unbalanced_on_eight_devices():
  """InPlaceABNSync: N is the global valid count (26 rows x 2 positions)."""
  counts, cap = [5, 0, 3, 8, 1, 0, 2, 7], 8
  rng = np.random.default_rng(8)
  mask = np.zeros((8 * cap, 1, 1), bool)
  for d, c in enumerate(counts):
    mask[d * cap:d * cap + c] = True
  batches = [(rng.normal(size=(8 * cap, 2, 3)) * 2 + 3).astype(np.float32) for _ in range(2)]
  models = [iabn.InPlaceABNSync(momentum=0.9, axis_name="d", unbiased_running_var=u)
            for u in (False, True)]
  got = sharded_running_stats(models, batches, mask)
  valid = [b[mask[:, 0, 0]].reshape(-1, 3) for b in batches]
  for (mean, var), unbiased in zip(got, (False, True)):
    want_mean, want_var = torch_running_stats(valid, torch_momentum=0.1, unbiased=unbiased)
    np.testing.assert_allclose(mean, want_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(var, want_var, rtol=1e-5)


def test_non_floating_inputs_are_refused():
  """Integers (or booleans) would come back rounded to the input's dtype: TypeError."""
  xf, g, b, _ = _data()
  variables = iabn.InPlaceABN().init(jax.random.key(0), xf, use_running_average=False)
  for x in (xf.astype(jnp.int32), xf > 0):
    for call in (lambda: iabn.inplace_abn(x, g, b),
                 lambda: iabn.inplace_abn(x, g, b, use_running_average=True,
                                          running_mean=jnp.zeros(8), running_var=jnp.ones(8)),
                 lambda: iabn.inplace_abn(x, g, b, implementation="pallas"),
                 lambda: iabn.inplace_abn_reference(x, g, b),
                 lambda: iabn.InPlaceABN().init(jax.random.key(0), x, use_running_average=False),
                 lambda: iabn.InPlaceABN().apply(variables, x, use_running_average=True),
                 lambda: iabn.NNXInPlaceABN(8)(x)):
      with pytest.raises(TypeError, match="floating-point input"):
        call()
