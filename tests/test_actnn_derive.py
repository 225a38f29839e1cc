"""ActNN's residuals that are linear in others: stored once, rebuilt in the backward pass
(`jmem.ops.actnn._derive`), through `compress` on blocks jmem did not write."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmem import measure
from jmem.ops.actnn import _derive
from jmem.ops.actnn import quantize as Q


class ConvBNReLU(nn.Module):
  """Two convolution + BatchNorm + ReLU layers, in ``dtype`` with float32 parameters."""

  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    for _ in range(2):
      x = nn.Conv(16, (3, 3), dtype=self.dtype)(x)
      x = nn.BatchNorm(use_running_average=False, dtype=self.dtype)(x)
      x = nn.relu(x)
    return x


def _block(dtype=jnp.float32):
  model = ConvBNReLU(dtype)
  x = jax.random.normal(jax.random.key(0), (4, 8, 8, 16), dtype)
  variables = model.init(jax.random.key(1), x)

  def f(params, x):
    y, state = model.apply({"params": params, "batch_stats": variables["batch_stats"]}, x,
                           mutable=["batch_stats"])
    return y, state
  return f, variables["params"], x


def _forward_jaxpr(f, *args):
  """The forward jaxpr of ``jax.vjp(f, *args)`` (outputs: ``f``'s, then the residuals), its
  number of outputs and the backward jaxpr, as `compress` sees them."""
  box = {}

  def traced(*a):
    y, vjp_fn = jax.vjp(f, *a)
    leaves, box["treedef"] = jax.tree.flatten(vjp_fn)
    box["y"] = jax.tree.structure(y)
    return jax.tree.leaves(y), leaves
  closed = jax.make_jaxpr(traced)(*args)
  n_y = box["y"].num_leaves
  outs = closed.jaxpr.outvars
  backward = Q._backward_jaxpr(  # pylint: disable=protected-access
      box["treedef"], [v.aval for v in outs[n_y:]], [v.aval for v in outs[:n_y]], box["y"])
  return closed, n_y, backward


def _values(closed, args):
  """Every variable of ``closed``'s evaluation on ``args`` (through `compress`'s own
  evaluator, storing nothing)."""
  seen = {}
  everything = list(closed.jaxpr.invars) + [v for e in closed.jaxpr.eqns for v in e.outvars]

  def store(indices, value):
    seen[everything[indices[0]]] = value
    return value
  Q._eval_storing(  # pylint: disable=protected-access
      closed, jax.tree.leaves(args), everything, store)
  return seen


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_batchnorm_and_relu_residuals_are_rebuilt_exactly_from_the_convolution(dtype):
  f, params, x = _block(dtype)
  closed, n_y, backward = _forward_jaxpr(f, params, x)
  residuals = closed.jaxpr.outvars[n_y:]
  free = set(closed.jaxpr.invars[:len(jax.tree.leaves(params))])
  recipes, extras = _derive.derivations(closed.jaxpr, residuals, min_size=1024,
                                        backward=backward, free=free)
  producer = {v: e.primitive.name for e in closed.jaxpr.eqns for v in e.outvars}
  rebuilt = sorted(producer[residuals[i]] for i in recipes)
  # Per layer: BatchNorm's x - mean and 2x (its mean of squares), and the ReLU's output
  # (the next convolution's input); in bfloat16 also the bf16 copy of the second weight.
  want = ["custom_jvp_call", "mul", "mul", "sub", "sub"]
  if dtype == jnp.bfloat16:
    want = sorted(want + ["convert_element_type"] * 2)
  assert rebuilt == want, rebuilt
  # What is stored instead: each convolution's output (and, in bf16, nothing for weights).
  full = [v for v in extras if v.aval.size >= 1024 and v not in free]
  assert sorted(producer.get(v, "input") for v in full) == ["conv_general_dilated"] * 2
  # Rebuilt from the exact sources, each residual is the one the VJP saves, bit for bit.
  values = _values(closed, (params, x))
  for i, recipe in recipes.items():
    bind = Q._bind  # pylint: disable=protected-access
    got = _derive.replay(recipe, {u: values[u] for u in recipe.inputs}, bind)
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(values[residuals[i]], np.float32))


def test_residuals_that_a_product_reads_together_are_stored_apart():
  """tanh's derivative reads k = tanh(z) and 1 - k in one product: rebuilt from one rounded
  k they would make it biased, so 1 - k is stored on its own."""
  w = jax.random.normal(jax.random.key(0), (64, 64)) / 8
  x = jax.random.normal(jax.random.key(1), (32, 64))
  closed, n_y, backward = _forward_jaxpr(lambda w, x: jnp.tanh(x @ w), w, x)
  residuals = closed.jaxpr.outvars[n_y:]
  producer = {v: e.primitive.name for e in closed.jaxpr.eqns for v in e.outvars}
  assert {"tanh", "sub"} <= {producer.get(v) for v in residuals}
  assert _derive.derivations(closed.jaxpr, residuals, min_size=1024, backward=backward) \
      == ({}, [])
  # Without the backward to check, nothing is rebuilt.
  f, params, xb = _block()
  closed, n_y, _ = _forward_jaxpr(f, params, xb)
  assert _derive.derivations(closed.jaxpr, closed.jaxpr.outvars[n_y:], min_size=1024) \
      == ({}, [])


def test_compressed_block_stores_each_convolution_output_once():
  """The 2-bit codes `compress` keeps are the block input's and each convolution output's
  (not BatchNorm's two copies and the ReLU output beside them), plus 1-bit ReLU masks."""
  f, params, x = _block()
  g = Q.compress(f, bits=2)
  loss = lambda p, x: jnp.sum(g(p, x)[0] ** 2)
  codes = sum(r.nbytes for r in measure.saved_residuals(loss, params, x).residuals
              if r.dtype == jnp.uint8)
  per = x.size * 2 // 8           # one tensor's 2-bit codes (its minima, scales: float)
  masks = 2 * x.size // 8
  assert codes == 3 * per + masks, (codes, per, masks)


@pytest.mark.slow
def test_rebuilt_residuals_keep_the_gradient_unbiased():
  """The mean of 300 two-bit gradients of the block approaches the exact one as 1/sqrt(300)
  (the ReLU masks and small statistics exact, each convolution output rounded once)."""
  f, params, x = _block()
  ct = jax.random.normal(jax.random.key(5), x.shape)
  loss = lambda f: lambda p: jnp.sum(f(p, x)[0] * ct)
  exact = jax.grad(loss(f))(params)
  g = Q.compress(f, bits=2)
  grad = jax.jit(lambda p, key: jax.grad(lambda p: jnp.sum(g(p, x, key=key)[0] * ct))(p))
  runs = [jax.tree.leaves(grad(params, k)) for k in jax.random.split(jax.random.key(9), 300)]
  for j, (path, want) in enumerate(jax.tree_util.tree_leaves_with_path(exact)):
    stack = np.stack([np.asarray(r[j]) for r in runs])
    single = np.linalg.norm(stack[0] - want) / np.linalg.norm(want)
    mean = np.linalg.norm(stack.mean(0) - want) / np.linalg.norm(want)
    assert mean < single / 8 + 1e-5, (jax.tree_util.keystr(path), single, mean)
