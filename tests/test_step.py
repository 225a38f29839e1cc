"""`jmem.rngs`, the error for a converted site without a key, and its opt-in
(`jmem.surgery.data_keys`)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jmem
import third_party_models as tp

X = jax.random.normal(jax.random.key(0), (4, 8, 8, 3))
CLIPS = jax.random.normal(jax.random.key(1), (2, 4, 8, 8, 3))
KEY = jax.random.key(7)


def _same(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


class _DropoutCNN(nn.Module):
  """Two conv blocks (ActNN's default sites), dropout, a head."""

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.relu(nn.Conv(8, (3, 3), name="block1")(x))
    x = nn.relu(nn.Conv(8, (3, 3), name="block2")(x))
    x = nn.Dropout(0.5, deterministic=not train)(jnp.mean(x, axis=(1, 2)))
    return nn.Dense(10)(x)


def _linen_grads(model, variables, x, **apply_kw):
  loss = lambda p: jnp.sum(model.apply({**variables, "params": p}, x, mutable=True,
                                       **apply_kw)[0] ** 2)
  return jax.grad(loss)(variables["params"])


def test_rngs_in_linen_apply_is_the_explicit_streams():
  model = jmem.convert(_DropoutCNN(), jmem.ActNN("L3", bits=2))
  variables = model.init(jax.random.key(0), X, train=False)
  explicit = {"dropout": KEY, "actnn": jax.random.fold_in(KEY, 0x61),
              "sbp": jax.random.fold_in(KEY, 0x73)}
  rngs = jmem.rngs(KEY)
  assert isinstance(rngs, dict) and set(rngs) == {"dropout", "actnn", "sbp"}
  _same(_linen_grads(model, variables, X, rngs=rngs),
        _linen_grads(model, variables, X, rngs=explicit))
  # A pytree: it crosses jit as the keys it holds.
  jitted = jax.jit(lambda p, r: jax.grad(lambda q: jnp.sum(model.apply(
      {"params": q}, X, rngs=r) ** 2))(p))(variables["params"], rngs)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), jitted,
               _linen_grads(model, variables, X, rngs=explicit))


def test_rngs_as_a_context_for_nnx_is_the_explicit_keys():
  model = jmem.convert(tp.NNXCNN(rngs=nnx.Rngs(0)), jmem.ActNN("L3", bits=2))

  def grads(context):
    def loss(m):
      with context():
        return jnp.sum(m(X) ** 2)
    return nnx.grad(loss)(nnx.clone(model))

  new = grads(lambda: jmem.rngs(KEY))
  _same(new, grads(lambda: jmem.surgery.rngs(actnn=jax.random.fold_in(KEY, 0x61))))
  other = grads(lambda: jmem.rngs(jax.random.key(8)))
  assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(new),
                                                      jax.tree.leaves(other)))


def test_rngs_refuses_what_is_not_a_key():
  with pytest.raises(TypeError, match=r"must be a PRNG key, e\.g\. jax\.random\.key\(0\)"):
    jmem.rngs(0)
  with pytest.raises(TypeError, match="jmem.rngs's actnn must be a PRNG key"):
    jmem.rngs(actnn=jnp.ones(3))
  raw = jmem.rngs(jax.random.PRNGKey(0))           # raw uint32 keys are keys too
  assert set(raw) == {"dropout", "actnn", "sbp"}


def test_a_site_differentiated_without_a_key_names_the_streams():
  """ActNN and SBP sites without a key raise when differentiated, naming every stream the
  model needs and the call that gives them; a forward pass (inference) needs none."""
  model = jmem.convert(tp.ClipClassifier(), jmem.SBP(keep_ratio=0.5, axis=1, where="frames"),
                       jmem.ActNN("L3", bits=2, where="Dense_0"))
  variables = model.init(jax.random.key(0), CLIPS)
  model.apply(variables, CLIPS, mutable=True)                # forward: no key needed
  jax.eval_shape(lambda: model.apply(variables, CLIPS, train=False))
  with pytest.raises(ValueError, match=r"differentiated without a key.*needs the RNG streams "
                                       r"'actnn' and 'sbp'.*rngs=jmem\.rngs\(key\).*with "
                                       r"jmem\.rngs\(key\).*jmem\.surgery\.data_keys\(\)"):
    _linen_grads(model, variables, CLIPS)
  _linen_grads(model, variables, CLIPS, rngs=jmem.rngs(KEY))
  # NNX: the same error, and inference without a key.
  net = jmem.convert(tp.NNXCNN(rngs=nnx.Rngs(0)), jmem.ActNN("L3", bits=2))
  net.eval()
  assert net(X).shape == (4, 10)
  net.train()
  with pytest.raises(ValueError, match=r"the compressing site .* at 'stem' is differentiated "
                                       r"without a key: no 'actnn' RNG stream"):
    nnx.grad(lambda m: jnp.sum(m(X) ** 2))(net)


def test_data_keys_is_the_opt_in_to_keys_from_the_data():
  model = jmem.convert(_DropoutCNN(), jmem.ActNN("L3", bits=2))
  variables = model.init(jax.random.key(0), X, train=False)
  with jmem.surgery.data_keys():
    got = _linen_grads(model, variables, X, train=False)
    again = _linen_grads(model, variables, X, train=False)
    shifted = _linen_grads(model, variables, X + 1.0, train=False)
  _same(got, again)                              # the key is a function of the data
  assert all(np.all(np.isfinite(a)) for a in jax.tree.leaves(got))
  assert jax.tree.structure(shifted) == jax.tree.structure(got)
  with pytest.raises(ValueError, match="without a key"):   # the context is left: it raises
    _linen_grads(model, variables, X, train=False)
