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

# Its own derivative (1 everywhere): must not be taken for jax.nn.relu.
_straight_through_relu.defjvps(lambda g, ans, x: g)

def _stem(x, w):
  y = jax.nn.relu(x * w)
  y = nn.max_pool(y, (3, 3), strides=(2, 2), padding="SAME")
  y = jax.jit(jax.nn.relu)(y - 0.1)                      # inside a jit: inlined
  return jnp.sum(_straight_through_relu(y - 0.2) * jnp.cos(y))

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

def _lower(f, *args):
  return jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes

def test_an_unread_site_input_costs_no_zero_cotangent_in_the_backward():
  """Three compressing sites that each get a large array they never read: its cotangent is a
  symbolic zero (the bwd's None), not a float buffer carried to the end of the backward."""
  site = q.compress(lambda w, x, unused: jnp.tanh(x @ w), bits=8, param_argnums=(0,))
  big = jnp.ones((256, 1024))        # 1 MiB

  def loss(ws, x, extra):
    for i, w in enumerate(ws):
      x = site(w, x, extra, key=jax.random.key(i))
    return jnp.sum(x)

  ws = [jnp.eye(64) * 0.5 for _ in range(3)]
  x = jnp.ones((128, 64))
  with_big = _lower(jax.grad(loss), ws, x, big)
  with_small = _lower(jax.grad(loss), ws, x, jnp.ones((1, 1)))
  assert with_big - with_small < big.nbytes / 4, (with_big, with_small)
  grads = jax.grad(loss, argnums=(0, 2))(ws, x, big)
  assert not np.any(np.asarray(grads[1]))

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
  loss1, g1, _ = linen_loss(jmem.convert(model, jmem.Policy("save")), variables)
  np.testing.assert_allclose(loss1, loss0, rtol=1e-6)
  assert_same(g1, g0)

@pytest.mark.parametrize("technique", [jmem.Policy("save"), jmem.ActNN(bits=8)],
                         ids=["save", "actnn-8bit"])
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
  jmem.convert(model, jmem.Policy("save"))
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
