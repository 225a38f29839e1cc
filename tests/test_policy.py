"""Per-site memory policies (`jmem.Policy`) and the stacks they make, on models jmem did not
write (tests/third_party_models.py).

Exact policies (save, recompute, offload at full precision) match the plain model to 1e-5.
Recomputation from a compressed input (``Policy("recompute_compressed")``, or `jmem.Remat`
with `jmem.ActNN` on the same sites) is held to ActNN's own bar: at 8 bits its gradient
error is at most 2x that of ActNN alone on the same sites, and at 2 bits the mean over 64
keys equals the exact gradient within 3 standard errors.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.flatten_util import ravel_pytree

import jmem
import third_party_models as tp
from jmem import bench, surgery, train
from jmem.ops import policy as policy_lib
from jmem.ops.actnn import quantize as q
from test_convert import X, Y, assert_same, linen_loss, nnx_loss, xent

EXACT = [jmem.Policy("save"), jmem.Policy("recompute"), jmem.Policy("offload"),
         jmem.Policy("recompute", checkpoint_policy=jax.checkpoint_policies.dots_saveable)]


@pytest.mark.slow
@pytest.mark.parametrize("technique", EXACT, ids=lambda t: t.kind)
def test_exact_policies_match_the_plain_model(technique):
  model = tp.ThirdPartyResNet()
  variables = model.init(jax.random.key(1), X)
  converted = jmem.convert(model, technique)
  assert_same(converted.init(jax.random.key(1), X), variables, tol=0)
  loss0, g0, upd0 = linen_loss(model, variables)
  loss1, g1, upd1 = linen_loss(converted, variables)
  np.testing.assert_allclose(loss1, loss0, rtol=1e-5)
  assert_same(g1, g0)
  assert_same(upd1, upd0)
  assert list(surgery.sites(converted, X).values()) == [
      ["BottleneckBlock_0", "BottleneckBlock_1", "bn_init", "conv_init"]]


@pytest.mark.slow
def test_nnx_policies():
  """NNX: exact policies match, and Remat + ActNN on the same blocks is recompute from a
  compressed input (close at 8 bits)."""
  plain = tp.NNXCNN(rngs=nnx.Rngs(0))
  loss0, g0, s0 = nnx_loss(plain)
  for technique in (jmem.Policy("offload"), jmem.Policy("recompute")):
    model = tp.NNXCNN(rngs=nnx.Rngs(0))
    jmem.convert(model, technique)
    loss1, g1, s1 = nnx_loss(model)
    np.testing.assert_allclose(loss1, loss0, rtol=1e-5)
    assert_same(g1, g0)
    assert_same(s1, s0)
  model = tp.NNXCNN(rngs=nnx.Rngs(0))
  jmem.convert(model, jmem.Remat(), jmem.ActNN("L3", bits=8))
  assert surgery.sites(model) == {"recompute_compressed": ["bn", "conv", "stem"]}
  loss1, g1, _ = nnx_loss(model)
  np.testing.assert_allclose(loss1, loss0, rtol=1e-5)      # the forward pass is exact
  a, b = ravel_pytree(g1)[0], ravel_pytree(g0)[0]
  assert 1e-5 < float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) < 0.05


# ------------------------------------------------------------------ approximate stacks

def _grad_fn(model, variables):
  @jax.jit
  def grads(key):
    def f(params):
      logits, _ = model.apply({**variables, "params": params}, X, mutable=["batch_stats"],
                              rngs={"actnn": key})
      return xent(logits, Y)
    return ravel_pytree(jax.grad(f)(variables["params"]))[0]
  return grads


def _mean_error(grads, exact, keys=4):
  return float(np.mean([jnp.linalg.norm(grads(jax.random.key(k)) - exact)
                        for k in range(keys)]) / jnp.linalg.norm(exact))


@pytest.mark.slow
def test_recompute_from_a_compressed_input_is_as_close_as_actnn():
  model = tp.ThirdPartyResNet()
  variables = model.init(jax.random.key(1), X)
  exact = _grad_fn(model, variables)(jax.random.key(0))
  err = lambda *ts: _mean_error(_grad_fn(jmem.convert(model, *ts), variables), exact)
  alone = err(jmem.ActNN("L3", bits=8))
  stacked = err(jmem.Remat(), jmem.ActNN("L3", bits=8))
  assert 0 < stacked <= 2 * alone, (stacked, alone)
  assert err(jmem.Policy("recompute_compressed", bits=8)) == pytest.approx(stacked, rel=1e-6)
  # Without the exact masks and statistics, masks near 0 flip: the error is several times
  # larger (measured: 6.3x ActNN's).
  loose = err(jmem.Policy("recompute_compressed", bits=8, keep_masks_and_statistics=False))
  assert loose > 3 * alone, (loose, alone)
  # Compression inside a recomputed block runs in the recomputation: ActNN L1's own error.
  l1 = err(jmem.ActNN("L1"))
  assert 0.5 * l1 < err(jmem.Remat(), jmem.ActNN("L1")) <= 2 * l1
  # Recomputation inside a compressing site recomputes from compressed residuals: it keeps
  # the masks and statistics exact too (without: 8.6x the error of the site alone).
  top = jmem.ActNN("L3", bits=8, where=tp.ThirdPartyResNet)
  top_alone = err(top)
  assert 0 < err(top, jmem.Remat()) <= 2 * top_alone


@pytest.mark.slow
def test_recompute_from_a_2bit_input_is_unbiased():
  """Mean of 64 keys within 3 standard errors of the exact gradient (the norm of the mean's
  error over the norm of its standard errors; ~1 for an unbiased estimate). Recomputed
  statistics were biased: 7 standard errors away without keep_masks_and_statistics."""
  model = tp.ThirdPartyResNet()
  variables = model.init(jax.random.key(1), X)
  exact = _grad_fn(model, variables)(jax.random.key(0))
  grads = jax.jit(jax.vmap(_grad_fn(jmem.convert(model, jmem.Remat(), jmem.ActNN(bits=2)),
                                    variables)))
  draws = grads(jax.random.split(jax.random.key(5), 64))
  mean, se = jnp.mean(draws, 0), jnp.std(draws, 0, ddof=1) / 8
  assert float(jnp.linalg.norm(draws[0] - exact)) > 0.1 * float(jnp.linalg.norm(exact))
  z = float(jnp.linalg.norm(mean - exact) / jnp.sqrt(jnp.sum(se ** 2)))
  assert z < 3, z


@pytest.mark.slow
def test_recompute_compressed_saves_what_it_says():
  """Compile-only, whole train step on a third-party ResNet: recomputing from a 2-bit input
  keeps far fewer bytes than recomputation alone, and the step's temp is lower too."""
  model = tp.ThirdPartyResNet(stage_sizes=(1, 1, 1), num_filters=8)
  x = jax.ShapeDtypeStruct((8, 64, 64, 3), jnp.float32)
  y = jax.ShapeDtypeStruct((8,), jnp.int32)
  measure = lambda *ts: bench.step_memory(train.model_fns(jmem.convert(model, *ts)),
                                          optax.sgd(0.1), x, y)
  remat = measure(jmem.Remat())
  both = measure(jmem.Remat(), jmem.ActNN(bits=2))
  assert both[0] < 0.6 * remat[0], (both, remat)     # measured 0.53: the stem's pool and
                                                     # ReLU are outside every site
  assert both[1] < remat[1], (both, remat)


@pytest.mark.slow
def test_offload_lowers_to_host_placements_for_the_gpu():
  """On a CPU host and device memory are one memory; the GPU lowering carries a placement in
  pinned host memory for every offloaded residual, full precision or compressed."""
  w = jax.random.normal(jax.random.key(0), (64, 64)) * 0.1
  x = jax.random.normal(jax.random.key(1), (128, 64))
  f = lambda w, x: jnp.sum(jnp.tanh(jnp.tanh(x @ w) @ w))
  g = q.offload_residuals(f)
  for got, want in zip(jax.grad(g, (0, 1))(w, x), jax.grad(f, (0, 1))(w, x)):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
  for fn in (g, q.compress(f, bits=2, offload=True)):
    text = jax.jit(jax.grad(fn)).trace(w, x).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count('_xla_buffer_placement = "pinned_host"') >= 2
  text = jax.jit(jax.grad(f)).trace(w, x).lower(lowering_platforms=("cuda",)).as_text()
  assert "pinned_host" not in text
  # Through jmem.convert: every block's residuals.
  model = tp.ThirdPartyResNet()
  variables = model.init(jax.random.key(1), X)
  for technique, least in ((jmem.Policy("offload"), 4), (jmem.Policy("offload", bits=2), 4),
                           (None, 0)):
    m = model if technique is None else jmem.convert(model, technique)
    step = jax.jit(lambda p: jax.grad(lambda p: xent(m.apply(
        {**variables, "params": p}, X, mutable=["batch_stats"],
        rngs={"actnn": jax.random.key(0)})[0], Y))(p))
    text = step.trace(variables["params"]).lower(lowering_platforms=("cuda",)).as_text()
    count = text.count('_xla_buffer_placement = "pinned_host"')
    assert count >= least and (least or count == 0), (technique, count)


# ------------------------------------------------------------------ what is refused

def test_policy_bad_input_and_conflicts():
  with pytest.raises(ValueError, match="not one of"):
    jmem.Policy("quantize")
  with pytest.raises(ValueError, match="takes no bits"):
    jmem.Policy("recompute", bits=2)
  with pytest.raises(ValueError, match="bits"):
    jmem.Policy("compress", bits=3)
  with pytest.raises(ValueError, match="takes no checkpoint_policy"):
    jmem.Policy("offload", checkpoint_policy=jax.checkpoint_policies.dots_saveable)
  with pytest.raises(ValueError, match="group_size.*only with bits"):
    jmem.Policy("recompute", group_size=128)
  with pytest.raises(ValueError, match="keep_masks_and_statistics"):
    jmem.Policy("compress", keep_masks_and_statistics=False)
  with pytest.raises(ValueError, match="implementation.*only with bits"):
    jmem.Policy("offload", implementation="xla")
  with pytest.raises(TypeError, match="checkpoint_policy.*callable"):
    jmem.Policy("recompute", checkpoint_policy="dots_saveable")
  assert jmem.Policy("compress").spec().bits == 2
  assert jmem.Policy("offload", bits=4).spec().name == "offload"
  model = tp.ThirdPartyResNet()
  variables = model.init(jax.random.key(1), X)
  run = lambda *ts: jmem.convert(model, *ts).apply(variables, X, mutable=True,
                                                     rngs={"actnn": jax.random.key(0)})
  with pytest.raises(ValueError, match="module at 'conv_init'.*Policy says all"):
    run(jmem.Policy("compress"), jmem.Remat())
  with pytest.raises(ValueError, match="twice"):
    run(jmem.Remat(), jmem.Remat(where="BottleneckBlock_0"))
  with pytest.raises(ValueError, match="already stores every residual"):
    run(jmem.ActNN("L3"), jmem.Policy("offload", where="BottleneckBlock_0/Conv_0"))
  with pytest.raises(ValueError, match="save site 'BottleneckBlock_0/Conv_0' is inside"):
    run(jmem.ActNN("L3"), jmem.Policy("save", where="BottleneckBlock_0/Conv_0"))
  with pytest.raises(ValueError, match="ActNN.*and ActNN.*compression twice"):
    run(jmem.Remat(), jmem.ActNN("L3"), jmem.ActNN("L3", bits=4, where="BottleneckBlock_0"))
  net = tp.NNXCNN(rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="'bn'.*Policy says all"):
    jmem.convert(net, jmem.Policy("offload"), jmem.ActNN("L3"))


@pytest.mark.slow
def test_a_technique_on_a_site_inside_its_own_and_another():
  """A technique covering an inner site through an enclosing one of its own leaves the other
  technique of that inner site to apply there (it was dropped); NNX's nested compression
  reads its key inside the enclosing recomputation (it raised eagerly)."""
  model = jmem.convert(tp.ThirdPartyResNet(),
                       jmem.Remat(where=r"BottleneckBlock_0(/Conv_0)?"),
                       jmem.ActNN("L3", bits=2, where="BottleneckBlock_0/Conv_0"))
  assert sorted(surgery.sites(model, X).values()) == [["BottleneckBlock_0"],
                                                      ["BottleneckBlock_0/Conv_0"]]
  plain = tp.NNXCNN(rngs=nnx.Rngs(0))
  _, g0, _ = nnx_loss(plain)
  net = tp.NNXCNN(rngs=nnx.Rngs(0))
  jmem.convert(net, jmem.Remat(where="stem"), jmem.ActNN(bits=2, where="stem/layers/0"))
  assert surgery.sites(net) == {"remat": ["stem"], "compress": ["stem/layers/0"]}
  _, g1, _ = nnx_loss(net)
  a, b = ravel_pytree(g1)[0], ravel_pytree(g0)[0]
  assert 1e-3 < float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) < 1.0


def test_policy_spec_names():
  spec = policy_lib.SiteSpec
  assert [spec(recompute=True).name, spec(bits=2).name, spec(recompute=True, bits=2).name,
          spec(offload=True).name, spec(offload=True, bits=2).name, spec().name] == [
              "recompute", "compress", "recompute_compressed", "offload", "offload", "save"]
  assert isinstance(jmem.convert(tp.FunctionalCNN(), jmem.Policy("save")), nn.Module)


@pytest.mark.slow
def test_policies_with_spatial_sharding():
  """Spatial (plain jit, H x W over 8 devices) stacked with block policies: recomputation
  and full-precision offload stay exact against one device; recomputing from an 8-bit
  input is as close to exact as on one device (the same key)."""
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P
  mesh = jax.make_mesh((2, 4), ("h", "w"), axis_types=(AxisType.Auto,) * 2)
  model = tp.FunctionalCNN()
  x = jax.random.normal(jax.random.key(0), (4, 32, 32, 3))
  y = jnp.arange(4) % 10
  variables = model.init(jax.random.key(1), x)
  xs = jax.device_put(x, NamedSharding(mesh, P(None, "h", "w", None)))

  def step(m):
    def f(params, inputs):
      out, _ = m.apply({**variables, "params": params}, inputs, mutable=["batch_stats"],
                       rngs={"actnn": jax.random.key(3)})
      return xent(out, y)
    return jax.jit(jax.grad(f))

  def grads(m, inputs):
    return ravel_pytree(step(m)(variables["params"], inputs))[0]

  exact = grads(model, x)
  spatial = jmem.Spatial(mesh, axes=("h", "w"))
  for policy in (jmem.Policy("recompute"), jmem.Policy("offload")):
    np.testing.assert_allclose(grads(jmem.convert(model, spatial, policy), xs), exact,
                               atol=1e-5 * float(jnp.max(jnp.abs(exact))))
  stack = (jmem.Remat(where="Conv_1|BatchNorm_1"),
           jmem.ActNN("L3", bits=8, where="Conv_1|BatchNorm_1"))
  err = lambda g: float(jnp.linalg.norm(g - exact) / jnp.linalg.norm(exact))
  one = err(grads(jmem.convert(model, *stack), x))
  assert 0 < err(grads(jmem.convert(model, spatial, *stack), xs)) <= 2 * one
  # The compressed residuals are quantized in rows of W x C, where the shards lie: no more
  # all-gathers than Spatial alone (per-sample groups gathered every activation).
  gathers = lambda m: jmem.collective_counts(step(m).lower(variables["params"], xs).compile()
                                             .as_text())["all-gather"]
  assert gathers(jmem.convert(model, spatial, *stack)) <= gathers(jmem.convert(model, spatial))


@pytest.mark.slow
def test_row_layout_is_the_per_sample_quantization_where_the_shards_lie():
  """`compress` stores residuals of 3+ dims in rows of their last two dims: the same codes as
  per-sample groups (bit for bit), old-style uint32 keys included; masks packed per row. On
  a U-Net (ReLU masks, skip concatenations) sharded 2 x 4 over H x W, ActNN L3 adds no
  all-gather or collective-permute to Spatial's own (per sample: one gather per residual)."""
  x = jax.random.normal(jax.random.key(0), (2, 4, 8, 32))
  kw = dict(bits=2, group_size=256, implementation="xla", interpret=None)
  seed = q.dither_seed(jax.random.key(3))
  rows = q._quantize_residual(x, seed, **kw)  # pylint: disable=protected-access
  flat = q.quantize(x.reshape(2, -1), jax.random.key(3), **kw)
  for a, b in zip(rows, flat):
    np.testing.assert_array_equal(np.ravel(a), np.ravel(b))
  # The kernels' rows (a vmap of per-row calls; the XLA path takes a seed per row itself).
  kernel_rows = q._quantize_residual(  # pylint: disable=protected-access
      x, seed, **dict(kw, implementation="pallas", interpret=True))
  for a, b in zip(kernel_rows, rows):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  f = lambda x: jnp.sum(jnp.maximum(x, 0.0) ** 2)
  np.testing.assert_allclose(jax.grad(q.compress(f, bits=8))(x, key=jax.random.PRNGKey(0)),
                             jax.grad(f)(x), atol=0.05)
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P
  from jmem import models
  mesh = jax.make_mesh((2, 4), ("h", "w"), axis_types=(AxisType.Auto,) * 2)
  model = models.UNet(5, widths=(4, 8, 16))
  # Each device's rows (W / 4 x C values) hold whole groups of 256 at every stage: groups
  # straddling two devices are gathered (a 256-wide image: 64 x 3 values per device).
  images = jax.random.normal(jax.random.key(0), (1, 32, 1024, 3))
  labels = jnp.zeros((1, 32, 1024), jnp.int32)
  variables = model.init(jax.random.key(1), images)
  xs = jax.device_put(images, NamedSharding(mesh, P(None, "h", "w", None)))

  def collectives(*techniques):
    m = jmem.convert(model, *techniques)

    def loss(params, x):
      out, _ = m.apply({**variables, "params": params}, x, mutable=["batch_stats"],
                       rngs={"actnn": jax.random.key(0)})
      return models.pixel_cross_entropy(out, labels)
    text = jax.jit(jax.grad(loss)).lower(variables["params"], xs).compile().as_text()
    counts = jmem.collective_counts(text)
    return counts["all-gather"], counts["collective-permute"]

  spatial = jmem.Spatial(mesh, axes=("h", "w"))
  alone, stacked = collectives(spatial), collectives(spatial, jmem.ActNN("L3"))
  assert stacked[0] <= alone[0] and stacked[1] <= alone[1], (stacked, alone)


@pytest.mark.slow
def test_policies_with_inplace_abn():
  """InPlace-ABN (its backward inverts its saved output) under every policy: the exact ones
  equal InPlace-ABN alone; compressing, or recomputing from a compressed input, keeps that
  output exact (its name, `EXACT_RESIDUAL`, is saved by the recomputation too: recomputed
  from the 8-bit input it made the stack's error 2.02x ActNN's alone), within 2x of ActNN
  alone at 8 bits."""
  model = tp.SequentialABNCNN()
  x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 16, 16, 3)), jnp.float32)

  def grads(m, variables):
    def f(p):
      out, _ = m.apply({**variables, "params": p}, x, mutable=["batch_stats"],
                       rngs={"actnn": jax.random.key(1)})
      return jnp.sum(jnp.sin(out))
    return ravel_pytree(jax.jit(jax.grad(f))(variables["params"]))[0]

  err = lambda g, ref: float(jnp.linalg.norm(g - ref) / jnp.linalg.norm(ref))
  plain = model.init(jax.random.key(0), x)
  abn = jmem.InPlaceABN()
  variables = jmem.convert(model, abn).init(jax.random.key(0), x)
  exact, exact_abn = grads(model, plain), grads(jmem.convert(model, abn), variables)
  alone = err(grads(jmem.convert(model, jmem.ActNN(bits=8, where="features")), plain), exact)
  for kind in ("save", "recompute", "offload"):
    got = grads(jmem.convert(model, abn, jmem.Policy(kind, where="features")), variables)
    assert err(got, exact_abn) < 1e-5, kind
  for kind in ("compress", "recompute_compressed"):
    got = grads(jmem.convert(model, abn, jmem.Policy(kind, bits=8, where="features")),
                variables)
    assert 0 < err(got, exact_abn) <= 2 * alone, (kind, err(got, exact_abn), alone)
