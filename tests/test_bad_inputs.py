"""The bad-input table: every public entry point, given what a user may get wrong.

Each row either raises a clear error (type and the words that say what was wrong) or gives
a correct result. The CLI's rows are `test_bench.test_cli_bad_flags_exit_2_with_a_clear_message`;
an empty training batch is `test_train.test_empty_batch_is_refused_before_any_update`.
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import flax.linen as nn
import pytest
from jax.sharding import PartitionSpec as P

import jmem
from jmem import models
from jmem.ops import inplace_abn as iabn
from jmem.ops.actnn import quantize as Q
from jmem.ops.sbp import sbp
from jmem.parallel import spatial, sync_bn

X = jnp.linspace(-2.0, 2.0, 4 * 300).reshape(4, 300)
KEY = jax.random.key(0)
G, B = jnp.ones((4,)), jnp.zeros((4,))
XC = jnp.linspace(-1.0, 3.0, 32).reshape(8, 4)          # channels last, 4 channels


def _abn(x=XC, **kw):
  return iabn.inplace_abn(x, G, B, **kw)


def _halo(width, kernel, mesh_w=8, padding="SAME"):
  mesh = jax.make_mesh((mesh_w,), ("w",), axis_types=(jax.sharding.AxisType.Auto,))
  x = jnp.ones((1, 4, width, 1))
  k = jnp.ones((kernel, kernel, 1, 1))
  f = jax.shard_map(lambda x: spatial.halo_conv(x, k, padding=padding, axis_names=(None, "w")), mesh=mesh,
                    in_specs=P(None, None, "w"), out_specs=P(None, None, "w"))
  return jax.jit(f).trace(x)


ERRORS = {
    # Stochastic backpropagation: keep ratio 0, > 1, NaN, a bool.
    "sbp keep_ratio 0": (lambda: sbp(jnp.tanh, keep_ratio=0.0), ValueError, "keep_ratio"),
    "sbp keep_ratio 1.5": (lambda: sbp(jnp.tanh, keep_ratio=1.5), ValueError, "keep_ratio"),
    "sbp keep_ratio nan": (lambda: sbp(jnp.tanh, keep_ratio=float("nan")), ValueError,
                           "keep_ratio"),
    "sbp keep_ratio True": (lambda: sbp(jnp.tanh, keep_ratio=True), ValueError, "keep_ratio"),
    "SBP technique keep_ratio 1.5": (
        lambda: jmem.SBP(keep_ratio=1.5, where="block0"), ValueError, "keep_ratio"),
    # Technique objects and names: an unknown remat policy, a name that is not a string.
    "Remat policy 'bogus'": (lambda: jmem.Remat(policy="bogus"), TypeError,
                             "jax.checkpoint_policies function"),
    "Remat policy by name": (lambda: jmem.Remat(policy="dots_saveable"), TypeError,
                             r"did you mean jax.checkpoint_policies.dots_saveable"),
    "technique None": (lambda: jmem.technique(None), TypeError, "'exact' for none"),
    # plan: a batch size of 0 planned at x's batch before.
    "plan batch_size 0": (lambda: jmem.plan(
        nn.Dense(3), (jnp.ones((4, 2)), jnp.zeros((4,), jnp.int32)), "1GiB", batch_size=0),
        ValueError, "batch_size must be a positive integer"),
    # The quantizer: bits 0, 3, 16, a float, a bool; group sizes; dtypes; empty.
    "bits 0": (lambda: Q.quantize(X, KEY, bits=0), ValueError, "bits must be one of"),
    "bits 3": (lambda: Q.quantize(X, KEY, bits=3), ValueError, "bits must be one of"),
    "bits 16": (lambda: Q.quantize(X, KEY, bits=16), ValueError, "bits must be one of"),
    "bits 2.0": (lambda: Q.quantize(X, KEY, bits=2.0), ValueError, "bits must be one of"),
    "bits True": (lambda: Q.quantize(X, KEY, bits=True), ValueError, "bits must be one of"),
    "group_size 0": (lambda: Q.quantize(X, KEY, group_size=0), ValueError, "group_size"),
    "group_size 12 on the kernels": (
        lambda: Q.quantize(X, KEY, group_size=12, implementation="pallas", interpret=True),
        ValueError, "powers of two"),
    "quantize integers": (lambda: Q.quantize(jnp.arange(8), KEY), TypeError, "float array"),
    "quantize empty": (lambda: Q.quantize(jnp.zeros((0, 8)), KEY), ValueError, "empty"),
    "unknown implementation": (lambda: Q.quantize(X, KEY, implementation="triton"),
                               ValueError, "implementation"),
    # InPlace-ABN: ReLU, slopes <= 0, eps <= 0, integer inputs, masks.
    "abn relu": (lambda: _abn(activation="relu"), ValueError, "not invertible"),
    "abn slope 0": (lambda: _abn(slope=0.0), ValueError, "slope must be > 0"),
    "abn slope -0.1": (lambda: _abn(slope=-0.1), ValueError, "slope must be > 0"),
    "abn eps 0": (lambda: _abn(epsilon=0.0), ValueError, "epsilon must be > 0"),
    "abn integer input": (lambda: _abn(jnp.arange(32).reshape(8, 4)), TypeError, "float"),
    "abn mask of the wrong shape": (lambda: _abn(mask=jnp.ones((3, 1), bool)), ValueError,
                                    "mask of shape"),
    "abn float mask": (lambda: _abn(mask=jnp.full((8, 1), 0.5)), TypeError, "boolean"),
    # SyncBN: unbound axis name, masks, integers.
    "syncbn unbound axis": (lambda: sync_bn.sync_batch_norm(XC, axis_name="batch"),
                            NameError, "not bound"),
    "syncbn float mask": (lambda: sync_bn.sync_batch_norm(XC, mask=jnp.full((8, 1), 0.5)),
                          TypeError, "boolean"),
    "syncbn integer input": (lambda: sync_bn.sync_batch_norm(jnp.arange(32).reshape(8, 4)),
                             TypeError, "float"),
    # Spatial: unbound axis names, negative padding, output not divisible.
    "halo_conv unbound axis": (
        lambda: spatial.halo_conv(jnp.ones((1, 8, 8, 1)), jnp.ones((3, 3, 1, 1)),
                                  axis_names=(None, "w")), NameError, "not bound"),
    "halo_conv negative padding": (
        lambda: _halo(width=16, kernel=3, padding=((1, 1), (-1, 3))), ValueError,
        "non-negative padding"),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_bad_input_raises_a_clear_error(name):
  fn, exc, words = ERRORS[name]
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")          # interpret-mode warnings are not the point
    with pytest.raises(exc, match=words):
      fn()


@pytest.mark.slow
def test_a_nan_is_not_hidden_by_the_quantizer():
  """A NaN in a residual makes its group's dequantized values NaN, on both backends, so the
  gradient shows it instead of a 2-bit code making it look finite."""
  x = X.at[1, 7].set(jnp.nan)
  for impl in ("xla", "pallas"):
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      y = Q.dequantize(Q.quantize(x, KEY, implementation=impl, interpret=True), x.shape,
                       x.dtype, implementation=impl, interpret=True)
    assert bool(jnp.isnan(y[1, :256]).all()), impl          # the NaN's group
    assert bool(jnp.isfinite(y[0]).all() and jnp.isfinite(y[1, 256:]).all()), impl
  f = Q.compress(lambda w, x: jnp.tanh(x * w), bits=2, min_size=1)
  g = jax.grad(lambda w: jnp.sum(f(w, x)))(jnp.float32(0.5))
  assert bool(jnp.isnan(g))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_inputs_work_with_float32_statistics(dtype):
  """bf16 and fp16 inputs: outputs in the input dtype, statistics in float32; tolerance of
  one rounding of |y| <= ~3 in that dtype."""
  x = XC.astype(dtype)
  want = np.asarray(sync_bn.sync_batch_norm_reference(XC)[0])
  for y in (sync_bn.sync_batch_norm(x)[0], _abn(x, activation="identity")[0]):
    assert y.dtype == dtype
    np.testing.assert_allclose(np.asarray(y, np.float32), want, atol=3e-2)


def test_widths_not_divisible_by_the_mesh_are_refused():
  mesh = spatial.spatial_mesh(1, 1, 8)
  fns = spatial.spatial_model_fns(models.create_model("convnext-digits", 10), mesh)
  with pytest.raises(ValueError, match="not divisible by the mesh"):
    jax.eval_shape(functools.partial(fns.apply, train=False), *jax.eval_shape(
        fns.init, KEY, jnp.ones((1, 32, 32, 1))), jnp.ones((2, 32, 36, 1)))
