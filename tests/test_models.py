"""Reference models: shapes, and the scanned/rematerialised variants compute the same thing."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmem
from jmem import models
from jmem.train import make_loss, model_fns


@pytest.mark.parametrize("name,size", [("resnet8", 8), ("resnet20", 16), ("resnet18", 32),
                                       ("resnet50", 64)])
def test_output_shapes(name, size):
  model = models.create_model(name, 7)
  x = jax.ShapeDtypeStruct((2, size, size, 3), jnp.float32)
  variables = jax.eval_shape(lambda x: model.init(jax.random.key(0), x, train=False), x)
  out = jax.eval_shape(lambda v, x: model.apply(v, x, train=False), variables, x)
  assert out.shape == (2, 7) and out.dtype == jnp.float32


def test_unknown_model_lists_valid_names():
  with pytest.raises(ValueError, match="resnet20"):
    models.create_model("resnet9000", 10)
  with pytest.raises(ValueError, match="stem"):
    models.resnet("resnet8", 10, stem="tiny").init(jax.random.key(0), jnp.ones((1, 8, 8, 1)))


def _stack_blocks(params, stage_sizes):
  """Exact (unrolled) parameters -> the scan_blocks layout."""
  out = {k: v for k, v in params.items() if "_block" not in k or k.endswith("_block1")}
  for i, size in enumerate(stage_sizes):
    if size > 1:
      blocks = [params[f"stage{i + 1}_block{j + 1}"] for j in range(1, size)]
      out[f"stage{i + 1}_blocks"] = {"block": jax.tree.map(lambda *a: jnp.stack(a), *blocks)}
  return out


@pytest.mark.slow
@pytest.mark.parametrize("transform", [None, nn.remat])
def test_scanned_and_remat_equal_exact(transform):
  exact = models.resnet("resnet20", 10, num_filters=4)
  other = exact.clone(scan_blocks=True)
  if transform is not None:              # remat on the default sites: stem, blocks, scans
    other = jmem.convert(other, jmem.Remat())
  x = jax.random.normal(jax.random.key(1), (4, 8, 8, 1))
  y = jnp.arange(4) % 10
  v = exact.init(jax.random.key(0), x, train=False)
  params = v["params"]
  state = {"batch_stats": v["batch_stats"]}
  sparams = _stack_blocks(params, exact.stage_sizes)
  sstate = {"batch_stats": _stack_blocks(v["batch_stats"], exact.stage_sizes)}
  loss_e = make_loss(model_fns(exact))
  loss_o = make_loss(model_fns(other))
  (le, _), ge = jax.value_and_grad(loss_e, has_aux=True)(params, state, x, y, None)
  (lo, _), go = jax.value_and_grad(loss_o, has_aux=True)(sparams, sstate, x, y, None)
  np.testing.assert_allclose(le, lo, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(_stack_blocks(ge, exact.stage_sizes)), jax.tree.leaves(go)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
