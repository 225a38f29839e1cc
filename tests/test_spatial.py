"""Spatially sharded convolution: equal to the unsharded op on 8 devices, fewer collectives."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jmem import bench, measure, models, train
from jmem.parallel import spatial
from helpers import assert_close_scaled

MESHES = {"w8": (1, 8), "h2w4": (2, 4)}


def _sharded_loss(mesh, op, *, sum_axes):
  spec = spatial.activation_spec(mesh)

  def local(x, w, ct):
    return jax.lax.psum(jnp.sum(op(x, w, (spec[1], spec[2])) * ct), sum_axes)
  return jax.shard_map(local, mesh=mesh, in_specs=(spec, P(), spec), out_specs=P())


CASES = [  # kernel, stride, dilation, groups, padding
    (7, 1, 1, 4, "SAME"), (3, 1, 1, 1, "SAME"), (3, 2, 1, 1, "SAME"), (1, 1, 1, 1, "SAME"),
    (5, 1, 1, 2, "SAME"), (3, 1, 2, 1, "SAME"), (2, 2, 1, 1, "VALID"), (4, 4, 1, 1, "VALID"),
    (3, 1, 1, 1, ((1, 1), (1, 1))),
    (7, 1, 2, 4, "SAME"),      # halo 6 over 4-wide blocks (w8): from two neighbours a side
    (3, 2, 1, 4, "SAME"),      # depthwise, stride 2, 2 outputs per input channel
]


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("k,s,d,g,pad", CASES)
def test_halo_conv_matches_unsharded(mesh_name, k, s, d, g, pad):
  mesh = spatial.spatial_mesh(1, *MESHES[mesh_name])
  rng = np.random.default_rng(k * 10 + s)
  x = jnp.asarray(rng.normal(size=(2, 8, 32, 4)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(k, k, 4 // g, 8)), jnp.float32)
  kw = dict(strides=s, dilation=d, feature_group_count=g, padding=pad)
  y_ref = spatial.halo_conv_reference(x, w, **kw)
  ct = jnp.asarray(rng.normal(size=y_ref.shape), jnp.float32)
  axes = tuple(a for a in ("h", "w") if dict(zip(mesh.axis_names, mesh.devices.shape))[a] > 1)
  f = _sharded_loss(mesh, lambda x, w, names: spatial.halo_conv(x, w, axis_names=names, **kw),
                    sum_axes=axes)
  got = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(x, w, ct)
  want = jax.value_and_grad(lambda x, w: jnp.sum(spatial.halo_conv_reference(x, w, **kw) * ct),
                            argnums=(0, 1))(x, w)
  # The loss sums terms of both signs: compare it against the sum of their magnitudes.
  np.testing.assert_allclose(got[0], want[0], atol=1e-5 * float(jnp.sum(jnp.abs(y_ref * ct))))
  spec = spatial.activation_spec(mesh)
  y = jax.jit(jax.shard_map(lambda x, w: spatial.halo_conv(x, w, axis_names=(spec[1], spec[2]),
                                                           **kw),
                            mesh=mesh, in_specs=(spec, P()), out_specs=spec))(x, w)
  assert_close_scaled(y, y_ref)
  assert_close_scaled(got[1][0], want[1][0])
  assert_close_scaled(got[1][1], want[1][1])


def test_fewer_collectives_and_less_memory_than_xla_partitioning():
  """k7 depthwise conv, W sharded on 8 devices: ours 4 CP + 1 AR; XLA's automatic 6 + 1."""
  mesh = jax.make_mesh((8,), ("w",), axis_types=(jax.sharding.AxisType.Auto,))
  spec = P(None, None, "w", None)
  x = jax.device_put(jnp.ones((4, 16, 128, 32)), NamedSharding(mesh, spec))
  w = jax.device_put(jnp.full((7, 7, 1, 32), 0.1), NamedSharding(mesh, P()))
  loss = lambda x, w: jnp.sum(spatial.halo_conv_reference(x, w, feature_group_count=32) ** 2)
  auto = measure.jit(jax.grad(loss, argnums=(0, 1)))

  def local(x, w):
    y = spatial.halo_conv(x, w, feature_group_count=32, axis_names=(None, "w"))
    return jax.lax.psum(jnp.sum(y ** 2), "w")
  ours = measure.jit(jax.grad(jax.shard_map(local, mesh=mesh, in_specs=(spec, P()),
                                            out_specs=P()), argnums=(0, 1)))
  c_auto, c_ours = (measure.collective_counts(f, x, w) for f in (auto, ours))
  assert c_ours["collective-permute"] == 4 and c_ours["all-reduce"] == 1, c_ours
  assert c_ours["all-gather"] == 0
  assert c_ours["collective-permute"] < c_auto["collective-permute"], (c_ours, c_auto)
  assert c_ours["all-reduce"] <= c_auto["all-reduce"]
  t_auto, t_ours = (measure.compiled_memory(f, x, w).temp_bytes for f in (auto, ours))
  assert t_ours <= t_auto, (t_ours, t_auto)
  for a, b in zip(ours(x, w), auto(x, w)):
    assert_close_scaled(a, b)


@pytest.mark.parametrize("kind", ["max", "avg"])
@pytest.mark.parametrize("window,strides,padding", [(3, 1, "SAME"), (3, 2, "SAME"), (2, 2, "VALID"),
                                                    (11, 1, "SAME")])   # halo 5 over 4
def test_pooling_with_halos(kind, window, strides, padding):
  mesh = spatial.spatial_mesh(1, 2, 4)
  x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 8, 16, 3)) - 2.0, jnp.float32)
  ref = (nn.max_pool if kind == "max" else
         lambda *a, **k: nn.avg_pool(*a, **k, count_include_pad=False))
  want = ref(x, (window, window), (strides, strides), padding)
  spec = spatial.activation_spec(mesh)
  got = jax.jit(jax.shard_map(
      lambda v: spatial.halo_pool(v, window=window, strides=strides, padding=padding, kind=kind,
                                  axis_names=("h", "w")),
      mesh=mesh, in_specs=spec, out_specs=spec))(x)
  assert_close_scaled(got, want)


def test_global_pool_and_drop_path_agree_across_shards():
  mesh = spatial.spatial_mesh(1, 2, 4)
  spec = spatial.activation_spec(mesh)
  x = jnp.asarray(np.random.default_rng(2).normal(size=(16, 8, 16, 3)), jnp.float32)
  key = jax.random.key(3)

  def local(x, key):
    y = spatial.drop_path(x, 0.5, key, deterministic=False)
    return spatial.global_avg_pool(y, axis_names=("h", "w"))
  got = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec, P()), out_specs=P()))(x, key)
  want = jnp.mean(spatial.drop_path(x, 0.5, key, deterministic=False), axis=(1, 2))
  assert_close_scaled(got, want)
  dropped = np.asarray(jnp.all(got == 0, axis=-1))
  assert 0 < dropped.sum() < 16            # whole samples dropped, the same on every shard


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_convnext_train_step_on_spatial_mesh_equals_single_device(mesh_name):
  model = models.create_model("convnext-digits", 10, drop_path_rate=0.2)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 32, 64, 1)), jnp.float32)
  y = jnp.arange(4) % 10
  opt = optax.adamw(1e-3)
  fns = train.model_fns(model)
  state = train.init_state(fns, opt, jax.random.key(0), x)
  want, m_want = train.make_train_step(fns, opt, donate=False)(state, x, y)
  mesh = spatial.spatial_mesh(1, *MESHES[mesh_name])
  got, m_got = train.make_train_step(spatial.spatial_model_fns(model, mesh), opt,
                                     donate=False)(state, x, y)
  assert_close_scaled(m_got["loss"], m_want["loss"])
  for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params)):
    assert_close_scaled(a, b)


@pytest.mark.slow
def test_per_device_temp_of_a_convnext_stage_on_eight_devices():
  """A ConvNeXt stage (3 blocks, dim 64, 64x256) on a 2x4 mesh: <= 0.15x one device's temp."""
  block_stack = models.ConvNeXt(depths=(3,), dims=(64,), num_classes=10, stem_patch=1)
  x = jax.ShapeDtypeStruct((2, 64, 256, 3), jnp.float32)
  y = jax.ShapeDtypeStruct((2,), jnp.int32)
  opt = optax.sgd(0.1)

  single = bench.step_memory(train.model_fns(block_stack), opt, x, y)[1]
  sharded = bench.step_memory(
      spatial.spatial_model_fns(block_stack, spatial.spatial_mesh(1, 2, 4)), opt, x, y)[1]
  assert sharded <= 0.15 * single, (sharded, single)


def test_bad_input_errors():
  mesh = spatial.spatial_mesh(1, 1, 8)
  spec = spatial.activation_spec(mesh)
  w3 = jnp.ones((3, 3, 2, 2))

  def run(fn, x):
    return jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec)(x)
  with pytest.raises(NameError, match="not bound"):
    run(lambda v: spatial.halo_conv(v, w3, axis_names=(None, "width")), jnp.ones((1, 4, 16, 2)))
  with pytest.raises(ValueError, match="non-negative padding"):
    run(lambda v: spatial.halo_conv(v, w3, padding=((1, 1), (-1, 3)), axis_names=(None, "w")),
        jnp.ones((1, 4, 16, 2)))
  with pytest.raises(ValueError, match="divisible by the stride"):
    run(lambda v: spatial.halo_conv(v, w3, strides=2, axis_names=(None, "w")),
        jnp.ones((1, 4, 24, 2)))
  with pytest.raises(ValueError, match="number of devices"):
    spatial.spatial_mesh(1, 3, 3)
  fns = spatial.spatial_model_fns(models.create_model("convnext-digits", 10), mesh)
  with pytest.raises(ValueError, match="not divisible"):
    fns.apply({}, {}, jnp.ones((1, 32, 36, 1)), train=False)
  with pytest.raises(ValueError, match="axis_names"):
    spatial.spatial_model_fns(models.create_model("resnet8", 10), mesh)


@pytest.mark.slow
def test_bench_technique_spatial_8():
  rows = bench.run_bench(bench.BenchConfig(model="convnext-digits", techniques=("spatial-8",),
                                           batch_size=8, image_size=32, memory_only=True,
                                           budgets_gib=()),
                         quiet=True)
  assert [r["technique"] for r in rows] == ["exact", "spatial-8"]
  assert rows[1]["temp_ratio"] < 0.25, rows[1]
  # The collectives of each compiled step: none on one device, halo exchanges on 2 x 4.
  assert rows[0]["collectives"] == {} and rows[1]["collectives"]["collective-permute"] > 0


def test_axis_names_that_do_not_split_the_input():
  """Unbound names raise NameError; naming an axis the input is not split over (typed
  invariant under check_vma) raises ValueError. Swapped names between two split dims are
  not visible inside the map (the local block carries no partition spec): not tested."""
  mesh = spatial.spatial_mesh(1, 2, 4)
  w3 = jnp.ones((3, 3, 2, 2))
  x = jnp.ones((1, 8, 16, 2))

  def trace(names, spec, **kw):
    f = lambda v: spatial.halo_conv(v, w3, axis_names=names)
    return jax.make_jaxpr(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec, **kw))(x)
  with pytest.raises(NameError, match="'height' is not bound"):
    trace(("height", "w"), P(None, "h", "w"))
  with pytest.raises(ValueError, match="H is split over mesh axis 'h'.*same on every device"):
    trace(("h", "w"), P(None, None, "w"))           # H is not split over 'h'
  with pytest.raises(ValueError, match="W is split over mesh axis 'w'"):
    trace((None, "w"), P())                         # replicated input
  trace(("h", "w"), P(None, "h", "w"))              # the right names
  trace(("h", "w"), P(None, None, "w"), check_vma=False)   # no types there: unchecked
