"""`jmem.surgery.CoverageWarning`: a technique that leaves most of what it is for out says
what, why and how to include it (and says nothing where it covers the model)."""

import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import AxisType

import jmem
import third_party_models as tp
from jmem.surgery import CoverageWarning


class _OwnConv(nn.Module):
  """A convolution computed in the module's own code (as a model zoo's depthwise conv)."""

  features: int

  @nn.compact
  def __call__(self, x):
    k = self.param("kernel", nn.initializers.lecun_normal(), (3, 3, x.shape[-1],
                                                              self.features))
    return jax.lax.conv_general_dilated(x, k, (1, 1), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))


class _MixedConvs(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool = True):
    del train
    x = nn.relu(nn.Conv(8, (3, 3))(x))
    x = nn.relu(_OwnConv(8, name="dwconv")(x))
    return nn.Dense(10)(jnp.mean(x, axis=(1, 2)))


class _FlatNNX(nnx.Module):
  def __init__(self, *, rngs):
    self.conv1 = nnx.Conv(3, 8, (3, 3), rngs=rngs)
    self.bn1 = nnx.BatchNorm(8, rngs=rngs)
    self.conv2 = nnx.Conv(8, 8, (3, 3), rngs=rngs)
    self.head = nnx.Linear(8, 10, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.bn1(self.conv1(x)))
    return self.head(jnp.mean(nnx.relu(self.conv2(x)), axis=(1, 2)))


def _coverage_warnings(fn):
  from jmem.surgery import _common  # pylint: disable=g-import-not-at-top
  _common._WARNED.clear()       # once per technique and model class: start afresh
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    fn()
  return [str(w.message) for w in caught if issubclass(w.category, CoverageWarning)]


def test_remat_on_a_flat_model_says_its_sites_are_single_layers():
  x = jnp.ones((2, 8, 8, 3))
  flat = jmem.convert(tp.FunctionalCNN(), jmem.Remat())
  got = _coverage_warnings(lambda: flat.init(jax.random.key(0), x))
  assert len(got) == 1, got
  assert "jmem.Remat on FunctionalCNN" in got[0] and "single layers here (4: Conv_0 (Conv)" \
      in got[0] and "where=" in got[0], got
  nnx_flat = _FlatNNX(rngs=nnx.Rngs(0))
  got = _coverage_warnings(lambda: jmem.convert(nnx_flat, jmem.Policy("recompute")))
  assert len(got) == 1 and "jmem.Policy on _FlatNNX" in got[0] and "conv1 (Conv)" in got[0], got
  # Blocks (an nnx.Sequential among the sites), or sites named by where=: nothing to say.
  assert not _coverage_warnings(lambda: jmem.convert(tp.NNXCNN(rngs=nnx.Rngs(0)),
                                                     jmem.Remat()))
  named = jmem.convert(tp.FunctionalCNN(), jmem.Remat(where=r"Conv_\d"))
  assert not _coverage_warnings(lambda: named.init(jax.random.key(0), x))
  # ActNN compresses what each layer saves: single layers are its sites as they are.
  actnn = jmem.convert(tp.FunctionalCNN(), jmem.ActNN("L3"))
  assert not _coverage_warnings(lambda: actnn.init(jax.random.key(0), x))


@pytest.mark.slow
def test_spatial_names_the_convolutions_it_cannot_see():
  mesh = jax.make_mesh((2, 4), ("h", "w"), axis_types=(AxisType.Auto,) * 2)
  x = jnp.ones((2, 16, 16, 3))
  model = jmem.convert(_MixedConvs(), jmem.Spatial(mesh, axes=("h", "w")))
  got = _coverage_warnings(lambda: jax.jit(functools.partial(model.init, x=x))(
      jax.random.key(0)))
  assert len(got) == 1, got
  assert "took 1 of the 2 modules with a convolution kernel; not 1: dwconv (_OwnConv)" \
      in got[0] and "feature_group_count" in got[0], got
  covered = jmem.convert(tp.FunctionalCNN(), jmem.Spatial(mesh, axes=("h", "w")))
  assert not _coverage_warnings(lambda: jax.jit(functools.partial(covered.init, x=x))(
      jax.random.key(0)))


def test_spatial_with_where_says_nothing():
  mesh = jax.make_mesh((2, 4), ("h", "w"), axis_types=(AxisType.Auto,) * 2)
  x = jnp.ones((2, 16, 16, 3))
  model = jmem.convert(_MixedConvs(), jmem.Spatial(mesh, axes=("h", "w"), where=r"Conv_0"))
  assert not _coverage_warnings(lambda: jax.jit(functools.partial(model.init, x=x))(
      jax.random.key(0)))
