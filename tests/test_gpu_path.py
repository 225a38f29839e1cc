"""The GPU path from a CPU machine: whole train steps with the Pallas kernels lower for CUDA."""

import jax
import jax.numpy as jnp
import pytest

from jmem import bench, models, train
from pallas_kernels import lowering_for_gpu


@pytest.mark.parametrize("technique,dtype", [("actnn-L3:pallas", jnp.float32),
                                             ("inplace-abn:pallas", jnp.bfloat16),
                                             ("actnn-L3", jnp.bfloat16),   # automatic
                                             ("inplace-abn", jnp.float32)])
def test_train_step_lowers_for_cuda_with_its_kernels(technique, dtype):
  tech = bench.get_technique(technique)
  model = tech.apply(models.create_model("resnet8", 10, dtype=dtype),
                     implementation=tech.implementation)
  fns = train.model_fns(model)
  opt = train.default_optimizer(1e-3, 10)
  one = jax.ShapeDtypeStruct((1, 16, 16, 1), jnp.float32)
  state = jax.eval_shape(lambda k, x: train.init_state(fns, opt, k, x), jax.random.key(0), one)
  x = jax.ShapeDtypeStruct((8, 16, 16, 1), jnp.float32)
  y = jax.ShapeDtypeStruct((8,), jnp.int32)
  step = train.make_train_step(fns, opt)     # outside: it makes a key eagerly
  with lowering_for_gpu():
    text = step.trace(state, x, y).lower(lowering_platforms=("cuda",)).as_text()
  # Each compressed residual: one quantize and one dequantize launch; InPlace-ABN: four
  # launches per layer (statistics, normalise, backward sums, dx).
  assert text.count("__gpu$xla.gpu.triton") >= 8


def test_technique_implementation_suffix():
  assert bench.get_technique("actnn-L3:pallas").implementation == "pallas"
  assert bench.get_technique("inplace-abn:xla").implementation == "xla"
  assert bench.get_technique("actnn-L3").implementation is None
  with pytest.raises(ValueError, match="has no kernels"):
    bench.get_technique("remat:pallas")
  for bad in ("actnn-L3:triton", "actnn-L3:"):
    with pytest.raises(ValueError, match="Unknown implementation"):
      bench.get_technique(bad)
