"""The measurement harness measures what it claims to."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jmem import measure
from jmem.measure import _compiled, _heap


def test_tanh_matmul_saves_only_its_intermediate():
  x, w = jnp.ones((4, 8)), jnp.ones((8, 16))
  report = measure.saved_residuals(lambda x, w: jnp.tanh(x @ w).sum(), x, w)
  acts = [r for r in report.residuals if r.source == "activation"]
  assert acts, "the tanh derivative needs a saved intermediate"
  assert all(r.shape == (4, 16) for r in acts)          # intermediate-shaped, not x or w
  assert report.activation_bytes == 4 * 16 * 4 * len(acts)
  assert report.argument_bytes == x.nbytes + w.nbytes   # x and w are resident anyway


def test_saved_residuals_is_compile_only_and_honours_argnums():
  x = jax.ShapeDtypeStruct((2048, 2048), jnp.float32)  # 16 MiB, never allocated
  w = jax.ShapeDtypeStruct((2048, 2048), jnp.float32)
  f = lambda w, x: jnp.sin(x @ w).sum()
  full = measure.saved_residuals(f, w, x)
  only_w = measure.saved_residuals(f, w, x, argnums=0)
  assert full.activation_bytes == only_w.activation_bytes == 2048 * 2048 * 4
  with pytest.raises(ValueError, match="argnums"):
    measure.saved_residuals(f, w, x, argnums=2)


def test_duplicate_residuals_counted_once():
  def f(x):
    y = jnp.sin(x)
    return (y * y).sum()   # y is needed twice by the product rule, stored once
  report = measure.saved_residuals(f, jnp.ones((100,)))
  assert report.activation_bytes <= 2 * 400


def _scan_loss(c, remat):
  def body(c, _):
    return jnp.tanh(jnp.sin(c) @ c), None
  body = jax.checkpoint(body) if remat else body
  return lax.scan(body, c, None, length=16)[0].sum()


def test_checkpoint_of_scan_body_lowers_temp_and_saved_bytes():
  c = jax.ShapeDtypeStruct((128, 128), jnp.float32)
  exact = measure.compiled_memory(jax.grad(functools.partial(_scan_loss, remat=False)), c)
  remat = measure.compiled_memory(jax.grad(functools.partial(_scan_loss, remat=True)), c)
  assert remat.temp_bytes < 0.5 * exact.temp_bytes
  s_exact = measure.saved_residuals(functools.partial(_scan_loss, remat=False), c)
  s_remat = measure.saved_residuals(functools.partial(_scan_loss, remat=True), c)
  assert s_remat.activation_bytes == 16 * 128 * 128 * 4   # only the carries
  assert s_exact.activation_bytes > 3 * s_remat.activation_bytes


def test_compiled_memory_accepts_jitted_functions_and_reports_arguments():
  f = jax.jit(lambda a: jnp.sin(a) @ a)
  mem = measure.compiled_memory(f, jnp.ones((64, 64)))
  assert mem.argument_bytes == 64 * 64 * 4 and mem.output_bytes == 64 * 64 * 4
  assert mem.total_bytes >= mem.argument_bytes + mem.output_bytes


def _mesh():
  return jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))


def test_psum_is_one_all_reduce():
  mesh = _mesh()
  f = jax.jit(jax.shard_map(lambda a: lax.psum(a, "d"), mesh=mesh, in_specs=P("d"),
                            out_specs=P()))
  a = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("d")))
  counts = measure.collective_counts(f, a)
  assert counts == {"all-reduce": 1, "all-gather": 0, "collective-permute": 0,
                    "all-to-all": 0, "reduce-scatter": 0}


def test_ppermute_and_all_gather_are_counted():
  mesh = _mesh()
  perm = [(i, (i + 1) % 8) for i in range(8)]
  f = jax.jit(jax.shard_map(
      lambda a: lax.all_gather(lax.ppermute(a, "d", perm), "d", tiled=True),
      mesh=mesh, in_specs=P("d"), out_specs=P("d")))
  a = jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P("d")))
  counts = measure.collective_counts(f, a)
  assert counts["collective-permute"] == 1 and counts["all-gather"] == 1
  assert counts["all-reduce"] == 0


def test_collective_regex_ignores_instruction_names():
  text = ("%all-reduce.1 = f32[] all-reduce(f32[] %x), to_apply=%sum\n"
          "%y = f32[] add(f32[] %all-reduce.1, f32[] %all-reduce.1)\n"
          "%cp = (f32[2], f32[2]) collective-permute-start(f32[2] %z)\n"
          "%cpd = f32[2] collective-permute-done((f32[2], f32[2]) %cp)\n")
  counts = measure.collective_counts(text)
  assert counts["all-reduce"] == 1 and counts["collective-permute"] == 1


def test_time_steps_ratio_and_errors():
  a = jnp.ones((256, 256))
  fast = jax.jit(lambda: a + 1)
  slow = jax.jit(lambda: functools.reduce(lambda x, _: jnp.tanh(x @ x), range(8), a))
  out = measure.time_steps({"fast": fast, "slow": slow}, warmup=1, repeats=5)
  assert out["fast"]["ratio"] == 1.0
  assert out["slow"]["ratio"] > 1.0
  assert out["slow"]["min_s"] <= out["slow"]["median_s"]
  with pytest.raises(ValueError, match="baseline"):
    measure.time_steps({"fast": fast}, baseline="nope")
  with pytest.raises(ValueError, match="repeats"):
    measure.time_steps({"fast": fast}, repeats=0)


def test_by_dtype_and_largest():
  def f(x):
    y = jnp.sin(x)
    m = (x > 0)                         # boolean residual
    return jnp.where(m, y * y, 0.0).sum()
  report = measure.saved_residuals(f, jnp.ones((10, 10)))
  by = report.by_dtype()
  assert by and sum(by.values()) == report.activation_bytes
  assert report.largest(1)[0].nbytes == max(r.nbytes for r in report.residuals
                                           if r.source == "activation")
  assert np.dtype("bool").name in by or "bool" in by


def _chain_loss(ws, x, remat):
  block = lambda w, x: jnp.tanh(jnp.sin(x @ w) @ w)
  block = jax.checkpoint(block) if remat else block
  for w in ws:
    x = block(w, x)
  return x.sum()


@pytest.mark.slow
def test_jmem_jit_keeps_unrolled_remat_on_cpu():
  ws = [jax.ShapeDtypeStruct((128, 128), jnp.float32)] * 12
  x = jax.ShapeDtypeStruct((512, 128), jnp.float32)
  grad = lambda remat: jax.grad(functools.partial(_chain_loss, remat=remat))
  exact = measure.compiled_memory(measure.jit(grad(False)), ws, x).temp_bytes
  remat = measure.compiled_memory(measure.jit(grad(True)), ws, x).temp_bytes
  assert remat < 0.5 * exact
  if jax.default_backend() == "cpu" and jax.__version_info__ < (0, 11):
    # What plain jax.jit gives on XLA:CPU of jaxlib 0.10: CSE folds the recomputation into
    # the forward. (XLA:CPU of jaxlib 0.11 keeps the barriers itself.)
    plain = measure.compiled_memory(jax.jit(grad(True)), ws, x).temp_bytes
    assert plain >= exact
  # The option changes memory, not results.
  w = [jnp.full((128, 128), 0.01)] * 12
  xv = jnp.ones((512, 128))
  np.testing.assert_array_equal(measure.jit(grad(True))(w, xv)[0], jax.jit(grad(False))(w, xv)[0])


def _dense_loss(w, b, x, act=jnp.tanh):
  return jnp.sum(act(x @ w + b))


def test_replicated_weights_under_shard_map_are_arguments_not_activations():
  """Each device's copy of a replicated weight (a pvary inside the map) is the weight, not
  an activation: the sharded figure equals the single-device one. Values computed from the
  weights, and the real activations, still count."""
  mesh = _mesh()
  w, b, x = jnp.ones((16, 32)), jnp.ones((32,)), jnp.ones((64, 16))

  def sharded(loss):
    return jax.shard_map(lambda w, b, x: lax.psum(loss(w, b, x), "d"), mesh=mesh,
                         in_specs=(P(), P(), P("d")), out_specs=P())

  single = measure.saved_residuals(_dense_loss, w, b, x)
  report = measure.saved_residuals(sharded(_dense_loss), w, b, x)
  assert single.activation_bytes >= 64 * 32 * 4                 # tanh's output, at least
  assert report.activation_bytes == single.activation_bytes
  copies = [r for r in report.residuals if r.description.startswith("copy of argument")]
  assert [(r.source, r.shape, r.nbytes) for r in copies] == [("argument", (8 * 16, 32),
                                                              8 * w.nbytes)]
  assert "index 0" in copies[0].description and "pvary" in copies[0].description
  # sin(w) is computed from the weight: its per-device copies are activations.
  computed = measure.saved_residuals(sharded(lambda w, b, x: _dense_loss(jnp.sin(w), b, x)),
                                     w, b, x)
  assert computed.activation_bytes >= report.activation_bytes + 8 * w.nbytes
  # Off the mesh too: a dtype cast of a weight is a copy of it, a broadcast to a batch-sized
  # array is not.
  cast = measure.saved_residuals(
      lambda w, x: jnp.sum(jnp.tanh(x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16))), w, x)
  assert [r.source for r in cast.residuals if r.shape == w.shape] == ["argument"]
  tiled = measure.saved_residuals(lambda b, x: jnp.sum(jnp.sin(x @ jnp.ones((16, 32)) *
                                                           jnp.broadcast_to(b, (64, 32)))), b, x)
  assert any(r.source == "activation" and r.shape == (64, 32) and "broadcast" in r.description
             for r in tiled.residuals)


def _mlp_gradient():
  """``(f, params, x)``: the gradient of a four-layer MLP (three tanh layers of 512 wide,
  named ``wide0``-``wide2``) at a batch of 256, its parameters and the batch."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      for i in range(3):
        x = jnp.tanh(nn.Dense(512, name=f"wide{i}")(x))
      return nn.Dense(10)(x)

  model, x = MLP(), jnp.ones((256, 64))
  params = model.init(jax.random.key(0), x)
  return jax.grad(lambda p, x: jnp.sum(model.apply(p, x) ** 2)), params, x


@pytest.mark.slow
def test_peak_buffers_names_the_layer_and_the_pass():
  """A four-layer MLP's gradient: at the peak, buffers of the forward pass (saved for the
  backward), of the backward pass and the arguments, each with its layer's path."""
  f, params, x = _mlp_gradient()
  report = measure.peak_buffers(f, params, x)
  kinds = report.by("kind")
  assert kinds.get("argument", 0) >= 256 * 64 * 4, kinds        # x is live
  mem = measure.compiled_memory(f, params, x)     # the heap at its peak fits the allocations
  assert report.total_bytes <= mem.temp_bytes + mem.argument_bytes + mem.output_bytes
  # The report carries its own compile's figures: the same step's, so the same temp.
  assert report.memory == mem
  assert report.live_temp_bytes == report.total_bytes - kinds["argument"]
  assert report.layout_bytes == mem.temp_bytes - report.live_temp_bytes
  # A tanh output saved for the backward (the tanh is the MLP's own code: top level), and
  # the backward's working set in a named layer.
  assert any(b.kind == "forward" and b.op == "tanh" and b.bytes == 256 * 512 * 4
             for b in report.buffers), report.table()
  assert any(b.kind == "backward" and b.scope.startswith("wide") and b.bytes == 256 * 512 * 4
             for b in report.buffers), report.table()
  assert sum(report.by("scope").values()) == report.total_bytes
  assert report.table(3).count("\n") == 4


def test_heap_layout_reads_a_step_the_persistent_cache_holds():
  """A compile JAX's persistent compilation cache answers writes no dump (the cache key
  leaves the dump options out): `heap_layout` compiles with the cache off, so a step
  compiled before (the tests share one cache directory) still gives its layout."""
  assert jax.config.jax_compilation_cache_dir, "tests/conftest.py sets a cache directory"
  least = jax.config.jax_persistent_cache_min_compile_time_secs
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)   # cache every step
  try:
    f = measure.jit(lambda w, x: jax.grad(lambda v: jnp.sum(jnp.sin(x @ v) ** 3))(w))
    w, x = jnp.ones((48, 40)), jnp.ones((72, 48))
    f.lower(w, x).compile()                           # now in the cache
    heap = measure.heap_layout(f, w, x)
    assert heap.buffers and heap.extent == heap.memory.temp_bytes
    assert jax.config.jax_enable_compilation_cache     # on again afterwards
  finally:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", least)


def test_best_fit_takes_the_smallest_gap_among_the_buffers_live_at_once():
  """The placement `HeapLayout.simulate` sizes: the largest first; a buffer shares the
  addresses of one not live at the same time, and of two gaps takes the smaller."""
  size = np.array([100, 50, 40, 30, 25, 24])
  start, end = np.array([0, 0, 0, 0, 0, 5]), np.array([9, 2, 9, 2, 9, 9])
  # At 5-9 only 0-100, 150-190 and 220-245 are taken: gaps of 50 (100-150) and 30
  # (190-220). The last buffer takes the 30, where a first fit would take the 50.
  assert _heap._best_fit(size, start, end).tolist() == [0, 100, 150, 190, 220, 190]


def test_heap_layout_reads_the_temp_allocation_and_places_it_again():
  """An MLP's gradient: the buffers of the temp allocation with their live ranges and
  names; placed again as they are they take XLA's temp bytes, and a resized one changes
  the size."""
  f, params, x = _mlp_gradient()
  heap = measure.heap_layout(f, params, x)
  assert heap.memory == measure.compiled_memory(f, params, x)
  assert heap.extent == heap.memory.temp_bytes
  assert heap.simulate() == pytest.approx(heap.extent, rel=0.02)
  assert all(0 <= b.start <= b.end for b in heap.buffers)
  # Values XLA keeps in one buffer (an in-place update's input and output) are one buffer:
  # none shares its address and size with another whose live range meets its own.
  for a in heap.buffers:
    for b in heap.buffers:
      assert a is b or (a.offset, a.bytes) != (b.offset, b.bytes) or (
          a.end < b.start or b.end < a.start), (a, b)
  # A tanh output saved for the backward: made forward, last read by a backward op.
  saved = [b for b in heap.buffers if b.op_name.endswith("/tanh") and
           "transpose(" not in b.op_name and "transpose(" in b.end_op_name]
  assert saved and saved[0].bytes == 256 * 512 * 4, heap.buffers
  twice = heap.simulate(lambda b: 2 * b.bytes if b in saved else b.bytes)
  assert twice > heap.simulate() > heap.simulate(lambda b: 0 if b in saved else b.bytes)
  assert heap.simulate(lambda b: 0) == 0
  with pytest.raises(ValueError, match="0 bytes or more"):
    heap.simulate(lambda b: -1)


class _FakeCompiled:
  """What `fit_batch` reads of a compiled step, for a step whose memory is given."""

  def __init__(self, temp, args=1000):
    self.temp, self.args = temp, args

  def memory_analysis(self):
    import types  # pylint: disable=g-import-not-at-top
    return types.SimpleNamespace(argument_size_in_bytes=self.args, output_size_in_bytes=self.args,
                                 alias_size_in_bytes=self.args, temp_size_in_bytes=self.temp,
                                 generated_code_size_in_bytes=0)

  def cost_analysis(self):
    return {"flops": 7.0}

  def as_text(self):
    return ("%ar = f32[4] all-reduce(f32[4] %g), replica_groups={}\n"
            "%cp-start = f32[4] collective-permute-start(f32[4] %h)\n")


def test_fit_batch_confirms_the_largest_batch_where_memory_is_not_linear():
  # Linear: the line's guess is the answer, one compile per budget.
  fit = measure.fit_batch(lambda b: _FakeCompiled(100 * b), (4, 8), (10_000 + 1000,))
  assert fit.per_example_bytes == 100 and fit.fixed_bytes == 1000 and fit.flops == 7.0
  assert fit.collectives == {"all-reduce": 1, "collective-permute": 1}   # those it has
  assert fit.max_batch == {11_000: 100} and fit.compiles == 3
  # Superlinear beyond 50 examples: the line's guess (100) does not fit; compiles walk down
  # to a batch that does, and the answer is bounded by the smallest batch seen not to fit.
  temp = lambda b: 100 * b + (0 if b <= 50 else 60 * (b - 50))
  fit = measure.fit_batch(lambda b: _FakeCompiled(temp(b)), (4, 8), (11_000,), max_compiles=4)
  best, over = fit.max_batch[11_000], fit.over_budget[11_000]
  assert 1000 + temp(best) <= 11_000 < 1000 + temp(over) and best < over <= 100
  assert best >= 78                                      # exact answer: 81
  # Steeper beyond the fit's batches, so steep that the line's guess is far off: the search
  # walks down to batch 1 when only it fits.
  steep = lambda b: 100 * b + (0 if b <= 1 else 10_000 * b)
  fit = measure.fit_batch(lambda b: _FakeCompiled(steep(b)), (4, 8), (1000 + 15_000,),
                          max_compiles=8)
  assert fit.max_batch[16_000] == 1 and fit.over_budget[16_000] == 2
  # A budget below the fixed bytes: nothing fits.
  assert measure.fit_batch(lambda b: _FakeCompiled(100 * b), (4, 8), (500,)).max_batch == {500: 0}
  # Memory that does not grow with the batch: no largest batch (None), nothing compiled more.
  flat = measure.fit_batch(lambda b: _FakeCompiled(50), (4, 8), (10_000,))
  assert flat.max_batch == {10_000: None} and flat.compiles == 2
  with pytest.raises(ValueError, match="two different"):
    measure.fit_batch(lambda b: _FakeCompiled(b), (4, 4))


def _step_and_args(technique):
  """A small third-party-free train step (jmem's ResNet-8, 16², batch 8) under
  ``technique`` (a registry name, or None: exact), and its abstract arguments."""
  import jmem  # pylint: disable=g-import-not-at-top
  from jmem import models, planner, train  # pylint: disable=g-import-not-at-top
  model = models.create_model("resnet8", 10)
  model = model if technique is None else jmem.convert(model, jmem.technique(technique))
  x = jax.ShapeDtypeStruct((8, 16, 16, 1), jnp.float32)
  y = jax.ShapeDtypeStruct((8,), jnp.int32)
  # pylint: disable-next=protected-access
  return planner._train_step(model, train.default_optimizer(1e-3, 10), x, y)


@pytest.mark.slow
def test_step_flops_of_the_lowered_module_count_what_the_compiled_one_does_on_cpu():
  """Off the CPU `step_flops` takes the lowered module's FLOPs (a GPU's compiled module
  counts cuDNN and cuBLAS calls as nothing). That figure is sound where it can be checked:
  on CPU it is within 2% of the compiled module's, for exact, remat and ActNN steps, and the
  module lowered for CUDA counts what the one lowered for CPU does."""
  for technique in (None, "remat", "actnn-L3"):
    step, args = _step_and_args(technique)
    lowered = step.lower(*args)
    compiled = lowered.compile()
    on_cpu = measure.step_flops(compiled, lowered)        # the compiled module's, on CPU
    assert on_cpu == measure.step_flops(compiled) > 0
    low = _compiled._flops_of(lowered)  # pylint: disable=protected-access
    assert abs(low / on_cpu - 1) < 0.02, (technique, low, on_cpu)
    if technique != "actnn-L3":     # its quantizer is a Pallas call when lowered for a GPU
      cuda = step.trace(*args).lower(lowering_platforms=("cuda",))
      cuda_flops = _compiled._flops_of(cuda)  # pylint: disable=protected-access
      assert cuda_flops == pytest.approx(low, rel=1e-6), technique


@pytest.mark.slow
def test_step_flops_of_a_sharded_step_off_the_cpu_are_about_one_devices(monkeypatch):
  """With the platform said to be a GPU, a sharded step's `step_flops` come from its lowered
  module: the whole program under XLA's partitioning (the batch split 8 ways), divided by
  the devices, within 3% of the CPU's compiled per-device count; under ``shard_map``
  (`jmem.Spatial` over 2 x 4) the body is lowered per shard and not divided, within 15%."""
  import jmem  # pylint: disable=g-import-not-at-top
  from jax.sharding import AxisType, Mesh  # pylint: disable=g-import-not-at-top
  from jmem import models, planner, train  # pylint: disable=g-import-not-at-top
  optimizer = train.default_optimizer(1e-3, 10)
  data = Mesh(np.array(jax.devices()[:8]), ("data",))
  hw = jax.make_mesh((2, 4), ("h", "w"), axis_types=(AxisType.Auto,) * 2)
  cases = ((models.create_model("resnet8", 10), data, (64, 16, 16, 1), P("data"), 0.03),
           (jmem.convert(models.create_model("resnet8", 10), jmem.Spatial(hw)), hw,
            (8, 32, 32, 3), P(None, "h", "w"), 0.15))
  for model, mesh, shape, spec, within in cases:
    x = jax.ShapeDtypeStruct(shape, jnp.float32)
    y = jax.ShapeDtypeStruct(shape[:1], jnp.int32)
    # pylint: disable-next=protected-access
    step, args = planner._train_step(model, optimizer, x, y, mesh=mesh,
                                     specs=(spec, P(spec[0])))
    lowered = step.lower(*args)
    compiled = lowered.compile()
    on_cpu = measure.step_flops(compiled)                   # one device's, compiled
    assert _compiled._devices_of(compiled) == ("cpu", 8)  # pylint: disable=protected-access
    with monkeypatch.context() as m:
      m.setattr(_compiled, "_devices_of", lambda c: ("gpu", 8))
      off_cpu = measure.step_flops(compiled, lowered)
    whole = measure.lowered_flops(lowered)
    assert off_cpu == (whole if mesh is hw else whole / 8)
    assert abs(off_cpu / on_cpu - 1) < within, (mesh.axis_names, off_cpu, on_cpu)


def test_lowered_flops_count_where_the_steps_own_client_cannot(monkeypatch):
  """Under a PJRT plugin (JAX's CUDA one) ``Lowered.cost_analysis`` gives None;
  `lowered_flops` counts the module with the CPU client, the same figure."""
  step, args = _step_and_args(None)
  lowered = step.lower(*args)
  own = _compiled._flops_of(lowered)  # pylint: disable=protected-access
  monkeypatch.setattr(jax.stages.Lowered, "cost_analysis", lambda self: None)
  assert _compiled._flops_of(lowered) is None  # pylint: disable=protected-access
  assert measure.lowered_flops(lowered) == own > 0


class _OnPlatform:
  """A compiled or lowered step as `step_flops` reads it: a platform, a number of devices
  and a FLOP count."""

  def __init__(self, platform, flops, devices=1):
    device_set = {type("Device", (), {"platform": platform})() for _ in range(devices)}
    self.input_shardings = (type("Sharding", (), {"device_set": device_set})(),)
    self.flops = flops

  def cost_analysis(self):
    return None if self.flops is None else {"flops": self.flops}


def test_step_flops_off_the_cpu_take_the_lowered_module_or_warn():
  assert measure.platform_of(_OnPlatform("gpu", 1.0)) == "gpu"
  assert measure.step_flops(_OnPlatform("cpu", 5.0), _OnPlatform("cpu", 9.0)) == 5.0
  assert measure.step_flops(_OnPlatform("gpu", 5.0), _OnPlatform("gpu", 9.0)) == 9.0
  assert measure.step_flops(_OnPlatform("gpu", 5.0, 3), _OnPlatform("gpu", 9.0)) == 3.0
  _compiled._WARNED_FLOPS.discard("gpu")  # pylint: disable=protected-access
  with pytest.warns(UserWarning, match="counts library calls .* no lowered module was given"):
    assert measure.step_flops(_OnPlatform("gpu", 5.0)) == 5.0
  _compiled._WARNED_FLOPS.discard("gpu")  # pylint: disable=protected-access
  with pytest.warns(UserWarning, match="the lowered module could not be counted"):
    assert measure.step_flops(_OnPlatform("gpu", 5.0), _OnPlatform("gpu", None)) == 5.0
