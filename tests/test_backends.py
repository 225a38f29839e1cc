"""One test body per op, run against every backend registered for it (`jmem._backends`).

XLA is the reference; a Pallas backend runs here in interpret mode (its compiled form is
checked by lowering for CUDA: the Triton custom calls are counted). The assertions are the
same for every backend. Tiny shapes: the module runs in well under a minute on 2 cores.
"""

import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmem
from jmem import _backends as backends
from jmem import _bn_core as bn_core
from jmem.ops import inplace_abn as iabn
from jmem.ops.actnn import quantize as Q
from jmem.parallel import sync_bn
from pallas_kernels import compiled_kernels, lowering_for_gpu

ACTNN = backends.implementations(*Q.OPS)
ABN = backends.implementations(backends.INPLACE_ABN)
MOMENTS = backends.implementations(backends.BN_MOMENTS)
TRITON = "__gpu$xla.gpu.triton"


def _interpret(implementation):
  """Off the GPU a Pallas backend runs in interpret mode (asked for: no warning)."""
  return None if implementation == "xla" else True


def _x(shape, dtype=jnp.float32, seed=0):
  return (jax.random.normal(jax.random.key(seed), shape) * 3 + 1).astype(dtype)


# ------------------------------------------------------------------ ActNN quantizer

@pytest.mark.slow
@pytest.mark.parametrize("implementation", ACTNN)
@pytest.mark.parametrize("bits,dtype", [(1, jnp.float32), (2, jnp.bfloat16),
                                        (8, jnp.float32)])
def test_quantize_round_trip_is_bounded_and_unbiased(implementation, bits, dtype):
  """2 samples of 80 values, groups of 32 (the last one padded): codes, metadata and the
  round trip have their documented shapes and dtypes; every draw lies within one step of
  its group's range; the mean over 256 keys is within 5 standard errors of ``x``."""
  group, keys = 32, jax.random.split(jax.random.key(1), 256)
  x = _x((2, 80), dtype)
  kw = dict(bits=bits, group_size=group, implementation=implementation,
            interpret=_interpret(implementation))
  qx = jax.eval_shape(lambda x: Q.quantize(x, keys[0], **kw), x)
  assert qx.codes.shape == (2, 3 * group * bits // 8) and qx.codes.dtype == jnp.uint8
  assert qx.minimum.shape == (2, 3) and qx.minimum.dtype == jnp.float32
  assert qx.scale.shape == (2, 3) and qx.scale.dtype == jnp.bfloat16
  y = jax.eval_shape(lambda q: Q.dequantize(q, x.shape, x.dtype, **kw), qx)
  assert y.shape == x.shape and y.dtype == x.dtype

  samples = np.asarray(jax.jit(jax.vmap(
      lambda k: Q.dequantize(Q.quantize(x, k, **kw), x.shape, x.dtype, **kw)))(keys),
      np.float64)
  xs = np.asarray(x, np.float64)
  padded = np.concatenate([xs, np.repeat(xs[:, 64:65], 16, axis=1)], axis=1)
  step = np.repeat(np.ptp(padded.reshape(2, 3, group), axis=-1) / (2**bits - 1), group,
                   axis=1)[:, :80]
  # bfloat16 outputs round each dequantized value to 8 bits of mantissa on top.
  slack = 1e-5 + (2.0**-8 * np.abs(xs) if dtype == jnp.bfloat16 else 0.0)
  assert np.all(np.abs(samples - xs) <= step * 1.01 + slack)
  mean_err = np.abs(samples.mean(0) - xs)
  assert np.all(mean_err <= 5 * (step / 2) / np.sqrt(len(keys)) + slack), mean_err.max()


@pytest.mark.parametrize("implementation", ACTNN)
def test_compress_8_bits_is_close_to_exact(implementation):
  w = jax.random.normal(jax.random.key(0), (32, 32)) * 0.2
  x = jax.random.normal(jax.random.key(1), (8, 32))
  f = lambda w, x: jnp.tanh(x @ w) * 2.0
  g = Q.compress(f, bits=8, group_size=32, min_size=1, implementation=implementation,
                 interpret=_interpret(implementation))
  loss = lambda f: lambda w, x: jnp.sum(f(w, x) ** 2)
  got = jax.jit(jax.grad(loss(g), argnums=(0, 1)))(w, x)
  want = jax.jit(jax.grad(loss(f), argnums=(0, 1)))(w, x)
  for a, b in zip(got, want):
    assert a.shape == b.shape and a.dtype == b.dtype
    assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) < 0.02


class _TinyCNN(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.gelu(nn.Conv(8, (3, 3))(x))
    x = jnp.tanh(nn.Conv(8, (3, 3))(x))
    return nn.Dense(4)(jnp.mean(x, axis=(1, 2)))


@pytest.mark.slow
@pytest.mark.parametrize("implementation", ACTNN)
def test_convert_actnn_l3_gradient(implementation):
  """``jmem.convert(model, ActNN("L3", implementation=...))``: the same gradient as XLA's
  (same rounding key: the kernels' codes are bit-identical), and within ActNN's 2-bit
  error of the exact gradient."""
  got = _tiny_cnn_gradient(implementation)
  ref, exact = _tiny_cnn_gradient("xla"), _tiny_cnn_gradient(None)
  np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-6)
  rel = float(np.linalg.norm(got - exact) / np.linalg.norm(exact))
  assert 0 < rel < 0.3, rel


@functools.cache
def _tiny_cnn_gradient(implementation):
  """The flattened parameter gradient of `_TinyCNN` converted to ActNN L3 at
  ``implementation`` (None: the exact model), with a fixed rounding key."""
  x = jax.random.normal(jax.random.key(0), (4, 8, 8, 3))
  model = _TinyCNN()
  params = model.init(jax.random.key(1), x)["params"]
  if implementation is not None:
    model = jmem.convert(model, jmem.ActNN("L3", implementation=implementation))
  loss = lambda p: jnp.sum(model.apply({"params": p}, x, rngs={"actnn": jax.random.key(7)})**2)
  with warnings.catch_warnings():
    # jmem.ActNN has no interpret switch: off the GPU a Pallas backend warns (once).
    warnings.simplefilter("ignore")
    grads = jax.jit(jax.grad(loss))(params)
  return np.concatenate([np.ravel(v) for v in jax.tree.leaves(grads)])


# ----------------------------------------------------------------------- InPlace-ABN

@pytest.mark.parametrize("implementation", ABN)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_inplace_abn_forward_and_vjp_match_the_reference(implementation, dtype):
  """37 rows x 6 channels (partial tiles), elu: output, statistics and the VJP of a random
  cotangent against `inplace_abn_reference` (plain autodiff)."""
  k = jax.random.split(jax.random.key(0), 4)
  x = (jax.random.normal(k[0], (37, 6)) * 2 + 0.5).astype(dtype)
  g = jax.random.uniform(k[1], (6,), minval=0.5, maxval=1.5)
  b = jax.random.normal(k[2], (6,)) * 0.1
  ct = jax.random.normal(k[3], (37, 6)).astype(dtype)
  f = lambda x, g, b: iabn.inplace_abn(x, g, b, activation="elu", alpha=0.7,
                                       implementation=implementation,
                                       interpret=_interpret(implementation))
  r = lambda x, g, b: iabn.inplace_abn_reference(x, g, b, activation="elu", alpha=0.7)

  @jax.jit
  def forward_and_vjp(x, g, b, ct):
    out = []
    for fn in (f, r):
      (z, stats), vjp = jax.vjp(fn, x, g, b)
      out.append((z, stats, vjp((ct, jax.tree.map(jnp.zeros_like, stats)))))
    return out
  (z, stats, grads), (z_ref, stats_ref, grads_ref) = forward_and_vjp(x, g, b, ct)
  tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
  assert z.dtype == dtype and z.shape == x.shape
  np.testing.assert_allclose(np.asarray(z, np.float32), np.asarray(z_ref, np.float32), **tol)
  for a, e in zip(stats, stats_ref):
    np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5)
  for a, e in zip(grads, grads_ref):
    assert a.dtype == e.dtype
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(e, np.float32), **tol)


# ------------------------------------------------------------------- BatchNorm moments

@pytest.mark.parametrize("implementation", MOMENTS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_bn_moments_are_exact(implementation, dtype):
  """Channels at offsets 0 .. 1e4 with std 1e-2 .. 1, 3 x 7 x 5 rows: the mean and the
  variance of the float32 values to float32 rounding, whatever the offset."""
  offsets = jnp.asarray([0.0, 1e2, 1e4, -3.0])
  stds = jnp.asarray([1.0, 1e-2, 1e-1, 0.5])
  x = (jax.random.normal(jax.random.key(0), (3, 7, 5, 4)) * stds + offsets).astype(dtype)
  got = jax.jit(lambda x: bn_core.batch_moments(x, implementation=implementation,
                                                interpret=_interpret(implementation)))(x)
  stats = got.stats()
  xs = np.asarray(x, np.float64).reshape(-1, 4)
  np.testing.assert_array_equal(got.count, np.full(4, 105.0))
  np.testing.assert_allclose(np.asarray(got.m0, np.float64) + np.asarray(got.corr),
                             xs.mean(0), rtol=1e-7, atol=1e-6)
  np.testing.assert_allclose(stats.var, xs.var(0), rtol=1e-4, atol=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("implementation", MOMENTS)
def test_sync_batch_norm_over_eight_devices_matches_the_full_batch(implementation):
  """`sync_batch_norm(implementation=...)` under shard_map over 8 devices: output and VJP
  equal the single-device reference on the whole batch (one all-gather, one psum)."""
  k = jax.random.split(jax.random.key(0), 2)
  x = jax.random.normal(k[0], (8 * 3, 5)) * 2 + 100.0
  ct = jax.random.normal(k[1], (8 * 3, 5))
  g, b = jnp.linspace(0.5, 1.5, 5), jnp.linspace(-0.1, 0.1, 5)
  mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
  spec = jax.sharding.PartitionSpec("d")

  def local(x, g, b, ct):
    y, _ = sync_bn.sync_batch_norm(x, g, b, axis_name="d", implementation=implementation,
                                   interpret=_interpret(implementation))
    return jax.lax.psum(jnp.sum(y * ct), "d")
  # check_vma=False: the Pallas interpreter (not the GPU lowering) trips the check.
  replicated = jax.sharding.PartitionSpec()
  loss = jax.shard_map(local, mesh=mesh, in_specs=(spec, replicated, replicated, spec),
                       out_specs=replicated, check_vma=False)
  put = lambda a, s: jax.device_put(a, jax.sharding.NamedSharding(mesh, s))
  got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(
      put(x, spec), put(g, replicated), put(b, replicated), put(ct, spec))
  want = jax.value_and_grad(lambda x, g, b: jnp.sum(
      sync_bn.sync_batch_norm_reference(x, g, b)[0] * ct), argnums=(0, 1, 2))(x, g, b)
  for a, e in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-4)


# --------------------------------------------------- every op, lowered for CUDA per backend

def _case(op, implementation, dtype):
  """``(function, arguments, Triton launches of its "pallas" backend)`` of one op."""
  interp = None if implementation == "xla" else False
  if op == backends.QUANTIZE_PACK:
    fn = backends.get(op, implementation)
    return (lambda g, s: fn(g, s, bits=2, interpret=interp),
            (jnp.ones((64, 256), dtype), jnp.uint32(3)), 1)
  if op == backends.UNPACK_DEQUANTIZE:
    fn = backends.get(op, implementation)
    return (lambda c, m, s: fn(c, m, s, bits=2, dtype=dtype, interpret=interp),
            (jnp.ones((64, 64), jnp.uint8), jnp.zeros(64), jnp.ones(64, jnp.bfloat16)), 1)
  if op == backends.INPLACE_ABN:
    def loss(x, g, b):   # forward and backward: statistics, normalise, sums, dx
      z, _ = iabn.inplace_abn(x, g, b, activation="elu", implementation=implementation,
                              interpret=interp)
      return jnp.sum(z.astype(jnp.float32) ** 2)
    return (jax.grad(loss, argnums=(0, 1, 2)),
            (jnp.ones((4, 8, 8, 48), dtype), jnp.ones(48), jnp.zeros(48)), 4)
  if op == backends.BN_MOMENTS:
    return (lambda x: bn_core.batch_moments(x, implementation=implementation,
                                            interpret=interp),
            (jnp.ones((4, 8, 8, 48), dtype),), 1)
  raise AssertionError(f"op {op!r} is registered but has no lowering case here")


def test_every_registered_op_has_a_lowering_case():
  for op in backends.ops():
    _case(op, "xla", jnp.float32)


@pytest.mark.parametrize("op", backends.ops())
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_each_backend_lowers_for_cuda(op, dtype):
  """The XLA reference lowers with no Triton call; the Pallas backend with its launches."""
  for implementation in backends.implementations(op):
    if implementation not in ("xla", "pallas"):
      continue    # another backend brings its own lowering check
    fn, args, launches = _case(op, implementation, dtype)
    with lowering_for_gpu():
      text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    want = 0 if implementation == "xla" else launches
    assert text.count(TRITON) == want, (op, implementation, text.count(TRITON))


# ----------------------------------------------------- the automatic choice and its warnings

def test_automatic_choice_takes_the_kernels_only_for_a_gpu():
  """``implementation=None``: XLA off the GPU; for one, the InPlace-ABN and SyncBN kernels
  (XLA, with a warning, for a configuration they do not take) and ActNN's XLA path, which
  a whole step runs faster than with its kernels (benchmarks/results/gpu/)."""
  x = jnp.ones((4, 8, 8, 48))

  def actnn(group_size):
    return lambda x: Q.dequantize(Q.quantize(x, jax.random.key(0), group_size=group_size),
                                  x.shape, x.dtype, group_size=group_size)

  def abn(mask):
    return jax.grad(lambda x: jnp.sum(iabn.inplace_abn(x, jnp.ones(48), jnp.zeros(48),
                                                       mask=mask)[0] ** 2))
  def bn(mask):
    return jax.grad(lambda x: jnp.sum(sync_bn.sync_batch_norm(x, mask=mask)[0] ** 2))

  def count(fn):
    return jax.jit(fn).trace(x).lower(lowering_platforms=("cuda",)).as_text().count(TRITON)

  with warnings.catch_warnings():
    warnings.simplefilter("error")    # off the GPU, the automatic choice says nothing
    assert count(actnn(256)) == 0 and count(abn(None)) == 0 and count(bn(None)) == 0
  with lowering_for_gpu():
    assert count(abn(None)) == 4 and count(bn(None)) == 1
    with warnings.catch_warnings():
      warnings.simplefilter("error")  # ActNN's XLA path is the GPU's choice: no warning
      assert count(actnn(256)) == 0 and count(actnn(24)) == 0
    explicit = lambda x: Q.dequantize(Q.quantize(x, jax.random.key(0), implementation="pallas"),
                                      x.shape, x.dtype, implementation="pallas")
    assert count(explicit) == 2       # the kernels still run where they are named
  mask = jnp.ones((4, 1, 1, 1), bool)
  with compiled_kernels():
    with pytest.warns(UserWarning, match="no mask.*slower XLA"):
      assert count(abn(mask)) == 0
    with pytest.warns(UserWarning, match="no mask.*slower XLA"):
      assert count(bn(mask)) == 0


def test_automatic_choice_is_made_where_the_step_is_traced():
  """A function built outside `lowering_for_gpu` picks the kernels inside it (the choice was
  once fixed when the wrapper was built: no kernels in the lowering); an `automatic_xla`
  context (data_parallel's sharded batch) makes it XLA, with a warning."""
  x = jnp.ones((4, 8, 8, 48))
  layer = functools.partial(iabn.inplace_abn, scale=jnp.ones(48), bias=jnp.zeros(48))

  def count():    # a new function each time: JAX's trace cache does not key on the context
    g = jax.grad(lambda x: jnp.sum(layer(x)[0] ** 2))
    return jax.jit(g).trace(x).lower(lowering_platforms=("cuda",)).as_text().count(TRITON)

  with lowering_for_gpu():
    assert count() > 0
    with backends.automatic_xla("a sharded batch"):
      with pytest.warns(UserWarning, match="a sharded batch; using the XLA path"):
        assert count() == 0
      # ActNN's GPU choice is XLA anyway: nothing to warn about.
      with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert backends.choose(None, Q.OPS, "ActNN", bits=2, group_size=256) == "xla"


def _interpret_warnings(fn, *args, **kwargs):
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    fn(*args, **kwargs)
  return [w for w in caught if "interpret mode" in str(w.message)]


@pytest.mark.slow
def test_explicit_pallas_off_the_gpu_warns_once_per_call():
  """No ``interpret``: the kernels run in interpret mode and say so, once per call (a
  compressed function's gradient warns once, not once per residual and direction)."""
  x, key = _x((4, 64)), jax.random.key(0)
  kw = dict(group_size=32, implementation="pallas")
  trace = lambda f, *a: jax.jit(f).trace(*a)     # the choice is made while tracing
  assert len(_interpret_warnings(trace, lambda x: Q.quantize(x, key, **kw), x)) == 1
  qx = Q.quantize(x, key, interpret=True, **kw)
  assert len(_interpret_warnings(
      trace, lambda q: Q.dequantize(q, x.shape, x.dtype, **kw), qx)) == 1
  w = jax.random.normal(jax.random.key(1), (64, 64)) * 0.1
  g = Q.compress(lambda w, x: jnp.tanh(jnp.tanh(x @ w) @ w), bits=2, min_size=1, **kw)
  grad = jax.grad(lambda w, x: jnp.sum(g(w, x)), argnums=(0, 1))
  assert len(_interpret_warnings(trace, grad, w, x)) == 1
  assert len(_interpret_warnings(trace, lambda x: iabn.inplace_abn(
      x, jnp.ones(64), jnp.zeros(64), implementation="pallas"), x)) == 1
  assert len(_interpret_warnings(trace, lambda x: sync_bn.sync_batch_norm(
      x, implementation="pallas"), x)) == 1


def test_unknown_or_unsupported_implementations_are_refused():
  x = _x((4, 64))
  for call in (lambda: Q.quantize(x, jax.random.key(0), implementation="triton"),
               lambda: iabn.inplace_abn(x, jnp.ones(64), jnp.zeros(64), implementation="cuda"),
               lambda: jmem.ActNN("L3", implementation="mosaic"),
               lambda: jmem.InPlaceABN(implementation="Pallas"),
               lambda: jmem.SyncBN(implementation="triton"),
               lambda: sync_bn.sync_batch_norm(x, implementation="cuda"),
               lambda: sync_bn.SyncBatchNorm(implementation="xla ").init(jax.random.key(0), x),
               lambda: sync_bn.NNXSyncBatchNorm(64, implementation="gpu")):
    with pytest.raises(ValueError, match=r"one of \('xla', 'pallas'\)"):
      call()
  with pytest.raises(ValueError, match="group_size=24.*implementation='xla'"):
    Q.quantize(x, jax.random.key(0), group_size=24, implementation="pallas", interpret=True)
  with pytest.raises(ValueError, match="no mask.*implementation='xla'"):
    iabn.inplace_abn(x, jnp.ones(64), jnp.zeros(64), mask=jnp.ones((4, 1), bool),
                     implementation="pallas", interpret=True)
  with pytest.raises(ValueError, match="no mask.*implementation='xla'"):
    sync_bn.sync_batch_norm(x, mask=jnp.ones((4, 1), bool), implementation="pallas",
                            interpret=True)


def test_a_registered_backend_is_taken_by_every_layer(monkeypatch):
  """A new backend (here the XLA functions under another name, as a Mosaic GPU backend
  would be registered) is accepted from the op up to the bench names, without touching
  a caller."""
  monkeypatch.setattr(backends, "_REGISTRY", {op: dict(b) for op, b in
                                              backends._REGISTRY.items()})   # pylint: disable=protected-access
  for op in backends.ops():
    backends.register(op, "xla_copy", backends.get(op, "xla"))
  x = _x((4, 64))

  @jax.jit
  def run(x):
    return [(Q.quantize(x, jax.random.key(0), group_size=32, implementation=i),
             iabn.inplace_abn(x, jnp.ones(64), jnp.zeros(64), implementation=i)[0],
             sync_bn.sync_batch_norm(x, implementation=i)[0]) for i in ("xla_copy", "xla")]
  for a, b in zip(*run(x)):
    assert all(jnp.array_equal(u, v) for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
  assert jmem.ActNN("L3", implementation="xla_copy").implementation == "xla_copy"
  assert jmem.technique("inplace-abn:xla_copy") == jmem.InPlaceABN(implementation="xla_copy")
  assert jmem.technique("sync-bn:xla_copy") == jmem.SyncBN(implementation="xla_copy")
