"""The ops that run between a model's sites (`jmem.ops.actnn.between`), and the zero
cotangents of a site's unread inputs: exact, and what they store.

A model someone else wrote calls ReLU and max pooling inline (flaxmodels' ResNet50 stem,
tests/third_party_models.py), outside every module jmem converts; and it may pass a site
values it never reads (flaxmodels hands each block a dict of earlier activations).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jmem
import third_party_models as tp
from jmem import measure
from jmem.ops.actnn import between
from jmem.ops.actnn import quantize as q
from test_convert import X, assert_same, linen_loss, nnx_loss

@jax.custom_jvp
def _straight_through_relu(x):
  return jnp.maximum(x, 0.0)

# Its own derivative (1 everywhere): must not be taken for jax.nn.relu, nor this one, whose
# function IS jax.nn.relu's.
_straight_through_relu.defjvps(lambda g, ans, x: g)
_relu_with_own_rule = jax.custom_jvp(jax.nn.relu.fun)
_relu_with_own_rule.defjvps(lambda g, ans, x: g * 0.5)

def _stem(x, w):
  y = jax.nn.relu(x * w)
  y = nn.max_pool(y, (3, 3), strides=(2, 2), padding="SAME")
  y = jax.jit(jax.nn.relu)(y - 0.1)                      # inside a jit: inlined
  return jnp.sum(_straight_through_relu(y - 0.2) * jnp.cos(y) + _relu_with_own_rule(y - 0.3))

def test_the_rewrite_keeps_values_and_gradients_and_stores_a_mask_and_an_index():
  x = jax.random.normal(jax.random.key(0), (2, 12, 12, 8))
  x = x.at[0, :2, :2].set(0.0)                  # ReLU at 0 and ties within pool windows
  w = jnp.float32(1.5)
  compact = between.compact_between_sites(_stem)
  np.testing.assert_array_equal(compact(x, w), _stem(x, w))
  for argnums in (0, 1):
    want = jax.grad(_stem, argnums)(x, w)
    np.testing.assert_array_equal(jax.grad(compact, argnums)(x, w), want)
  plain = measure.saved_residuals(_stem, x, w)
  small = measure.saved_residuals(compact, x, w)
  # The first ReLU's float input (and the pool's) become a packed mask and a uint8 index:
  # only the straight-through ReLU's own residuals stay float.
  floats = lambda r: sum(v for k, v in r.by_dtype().items() if k.startswith("float"))
  assert floats(small) < floats(plain) - x.size * 4
  assert small.by_dtype().get("uint8", 0) > 0
  assert small.activation_bytes < plain.activation_bytes / 2

def test_a_function_without_relu_or_max_pool_runs_as_it_is():
  f = lambda x: jnp.sum(jnp.tanh(x) ** 2)
  x = jnp.linspace(-2.0, 2.0, 64)
  assert str(jax.make_jaxpr(between.compact_between_sites(f))(x)) == str(jax.make_jaxpr(f)(x))

def _barrier_operands(jaxpr, shape) -> int:
  """How many operands of shape ``shape`` the optimization barriers of ``jaxpr`` (and of
  the jaxprs inside it) hold."""
  n = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "optimization_barrier":
      n += sum(tuple(v.aval.shape) == shape for v in eqn.invars)
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      n += _barrier_operands(sub, shape)
  return n


def test_an_unread_site_input_gets_no_zero_cotangent_through_the_barriers():
  """Three compressing sites that each get an array they never read: its cotangent is a
  symbolic zero (the bwd's None), not a float buffer that each site's backward barrier
  carries to the end of the backward."""
  site = q.compress(lambda w, x, unused: jnp.tanh(x @ w), bits=8, param_argnums=(0,))
  extra = jnp.ones((24, 40))

  def loss(ws, x, extra):
    for i, w in enumerate(ws):
      x = site(w, x, extra, key=jax.random.key(i))
    return jnp.sum(x)

  ws = [jnp.eye(64) * 0.5 for _ in range(3)]
  x = jnp.ones((128, 64))
  grad = jax.make_jaxpr(jax.grad(loss, argnums=(0, 2)))(ws, x, extra)
  assert _barrier_operands(grad.jaxpr, (128, 64)) > 0        # the barriers are there ...
  assert _barrier_operands(grad.jaxpr, extra.shape) == 0      # ... without the zeros
  _, g_extra = jax.grad(loss, argnums=(0, 2))(ws, x, extra)
  assert g_extra.shape == extra.shape and not np.any(np.asarray(g_extra))


@pytest.mark.parametrize("make", [q.compress, q.offload_residuals], ids=["compress", "offload"])
def test_a_cotangent_from_a_custom_rule_is_kept(make):
  """An input the primal ignores but a custom VJP rule sends a gradient to is not a zero."""
  @jax.custom_vjp
  def scaled(x, s):
    return x * 2.0

  scaled.defvjp(lambda x, s: (scaled(x, s), x), lambda x, g: (g * 2.0, jnp.sum(g * x)))
  kw = dict(bits=8) if make is q.compress else {}
  site = make(lambda x, s: jnp.tanh(scaled(x, s)), **kw)
  x, s = jnp.linspace(0.1, 1.0, 2048).reshape(32, 64), jnp.float32(3.0)
  want = jax.grad(lambda x, s: jnp.sum(jnp.tanh(scaled(x, s))), argnums=1)(x, s)
  got = jax.grad(lambda x, s: jnp.sum(site(x, s, key=jax.random.key(0))), argnums=1)(x, s)
  assert abs(float(want)) > 1.0
  np.testing.assert_allclose(got, want, rtol=0.05)


class _DictPassingNet(nn.Module):
  """Blocks that take a dict of earlier features and never read it (flaxmodels' ``act``)."""

  @nn.compact
  def __call__(self, x, train: bool = True):
    act = {"stem": nn.Conv(8, (3, 3), name="stem")(x)}
    x = act["stem"]
    for i in range(2):
      x = _Block(name=f"block{i}")(x, act)
    return nn.Dense(10)(jnp.mean(x, axis=(1, 2)))

class _Block(nn.Module):
  @nn.compact
  def __call__(self, x, act):
    del act
    return nn.relu(nn.Conv(8, (3, 3))(x)) + x

def test_a_linen_model_passing_unread_features_keeps_its_gradients():
  model = _DictPassingNet()
  variables = model.init(jax.random.key(1), X)
  loss0, g0, _ = linen_loss(model, variables)
  # Offload (full precision) stores through the compressing sites' custom VJP.
  loss1, g1, _ = linen_loss(jmem.convert(model, jmem.Policy("offload")), variables)
  np.testing.assert_allclose(loss1, loss0, rtol=1e-6)
  assert_same(g1, g0)

@pytest.mark.parametrize("technique", [jmem.Policy("offload"), jmem.ActNN(bits=8)],
                         ids=["offload", "actnn-8bit"])
def test_convert_compacts_a_linen_inline_stem(technique):
  """ThirdPartyResNet's stem (conv, BatchNorm, then nn.relu and nn.max_pool inline in the
  top module): under the technique its ReLU and pool keep a mask and an index; exact
  policies stay exact."""
  model = tp.ThirdPartyResNet()
  variables = model.init(jax.random.key(1), X)
  converted = jmem.convert(model, technique)
  state = {k: v for k, v in variables.items() if k != "params"}

  def loss(m):
    def f(params):
      y, _ = m.apply({"params": params, **state}, X, mutable=list(state),
                     rngs={"actnn": jax.random.key(7)})
      return jnp.sum(y)
    return f
  stem = (X.shape[0], 8, 8, 8)           # the stem's ReLU output (16x16 input, stride 2)
  plain = measure.saved_residuals(loss(model), variables["params"])
  conv = measure.saved_residuals(loss(converted), variables["params"])
  size = int(np.prod(stem))
  f32_stem = lambda r: [x for x in r.residuals if x.source == "activation" and
                        np.dtype(x.dtype) == np.float32 and int(np.prod(x.shape)) == size]
  assert f32_stem(plain)                 # the float ReLU input the plain model keeps ...
  assert len(f32_stem(conv)) < len(f32_stem(plain))      # ... is gone under the technique
  assert conv.activation_bytes < plain.activation_bytes
  if isinstance(technique, jmem.Policy):
    loss0, g0, _ = linen_loss(model, variables)
    loss1, g1, _ = linen_loss(converted, variables)
    np.testing.assert_allclose(loss1, loss0, rtol=1e-6)
    assert_same(g1, g0)

def test_convert_compacts_an_nnx_inline_relu_exactly(monkeypatch):
  """NNXCNN calls nnx.relu inline in its __call__: with an exact policy it goes through the
  1-bit ReLU, the gradients and batch statistics match, and the model is still reported by
  its sites only."""
  plain = tp.NNXCNN(rngs=nnx.Rngs(0))
  loss0, g0, s0 = nnx_loss(plain)
  model = tp.NNXCNN(rngs=nnx.Rngs(0))
  jmem.convert(model, jmem.Policy("offload"))
  assert "between" not in jmem.surgery.sites(model)
  shapes = []
  relu = between.compressed_ops.relu
  monkeypatch.setattr(between.compressed_ops, "relu", lambda x: shapes.append(x.shape) or relu(x))
  loss1, g1, s1 = nnx_loss(model)
  assert (X.shape[0], 8, 8, 16) in shapes         # bn's output, the inline nnx.relu's input
  np.testing.assert_allclose(loss1, loss0, rtol=1e-6)
  assert_same(g1, g0)
  assert_same(s1, s0)
  with pytest.raises(ValueError, match="already converted"):
    jmem.convert(model, jmem.Policy("save"))


class _DropoutNet(nn.Module):
  """No ReLU, no max pool: nothing to replace, and dropout between its sites."""

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.gelu(nn.Conv(8, (3, 3), name="a")(x))
    x = nn.Dropout(0.5, deterministic=not train)(x)
    x = nn.tanh(nn.Conv(8, (3, 3), name="b")(x))
    return nn.Dense(10)(jnp.mean(x, axis=(1, 2)))


def test_the_model_runs_once_so_its_random_numbers_and_init_stay_the_same():
  model = _DropoutNet()
  variables = model.init(jax.random.key(1), X)
  converted = jmem.convert(model, jmem.Policy("offload"))
  assert_same(converted.init(jax.random.key(1), X), variables, tol=0)
  rngs = {"dropout": jax.random.key(3)}
  np.testing.assert_array_equal(converted.apply(variables, X, rngs=rngs),
                                model.apply(variables, X, rngs=rngs))
  grads = lambda m: jax.grad(lambda p: jnp.sum(m.apply({"params": p}, X, rngs=rngs)))(
      variables["params"])
  assert_same(grads(converted), grads(model))


class _NNXDropoutNet(nnx.Module):
  def __init__(self, rngs):
    self.conv = nnx.Conv(3, 4, (3, 3), rngs=rngs)
    self.drop = nnx.Dropout(0.5)
    self.head = nnx.Linear(4, 2, rngs=rngs)

  def __call__(self, x, rngs):
    x = nnx.relu(self.conv(x))
    return self.head(self.drop(x, rngs=rngs).mean((1, 2)))


def test_nnx_rngs_passed_to_the_call_advance_as_in_the_plain_model():
  x = jnp.ones((2, 8, 8, 3))
  runs = []
  for technique in (None, jmem.Policy("offload")):
    model = _NNXDropoutNet(nnx.Rngs(0))
    if technique is not None:
      jmem.convert(model, technique)
    rngs = nnx.Rngs(dropout=1)
    runs.append((np.asarray(model(x, rngs)), np.asarray(model(x, rngs)),
                 int(rngs.dropout.count[...])))
  (a0, b0, n0), (a1, b1, n1) = runs
  assert n1 == n0 == 2 and not np.array_equal(a0, b0)
  np.testing.assert_array_equal(a1, a0)
  np.testing.assert_array_equal(b1, b0)


def test_an_nnx_top_module_that_is_a_site_stays_one():
  model = _NNXDropoutNet(nnx.Rngs(0))
  jmem.convert(model, jmem.Policy("offload", where=_NNXDropoutNet))
  assert jmem.surgery.sites(model) == {"offload": [""]}


def test_save_and_recompute_policies_leave_the_model_differentiable_forward():
  """Only the policies that store through a custom VJP rewrite the ops between sites (a
  custom VJP has no forward-mode derivative): jax.jvp still runs through save/recompute."""
  model = tp.ThirdPartyResNet()
  variables = model.init(jax.random.key(1), X)
  for kind in ("save", "recompute"):
    converted = jmem.convert(model, jmem.Policy(kind))
    f = lambda x, m=converted: m.apply(variables, x, mutable=["batch_stats"])[0]
    _, tangent = jax.jvp(f, (X,), (jnp.ones_like(X),))
    _, want = jax.jvp(lambda x: model.apply(variables, x, mutable=["batch_stats"])[0],
                      (X,), (jnp.ones_like(X),))
    np.testing.assert_allclose(tangent, want, rtol=1e-5, atol=1e-5)
  assert not jmem.Policy("save").compacts_between_sites
  assert jmem.Policy("offload").compacts_between_sites
  assert not jmem.ActNN("L0").compacts_between_sites
