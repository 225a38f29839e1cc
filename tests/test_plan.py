"""`jmem.plan`: per-site policies that fit a train step into a budget (small models; the
ResNet-50 figures are benchmarks/plan_resnet50.py's)."""

import dataclasses
import json
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jmem
import third_party_models as tp
from jmem import cli, models, planner as plan_lib, train
from jmem.planner import _inputs, _layouts, _report, _search

X = jax.ShapeDtypeStruct((64, 32, 32, 3), jnp.float32)
Y = jax.ShapeDtypeStruct((64,), jnp.int32)


def _search_over(sites, ladder, sensitivity=None):
  """A `jmem.planner.Search` of ``sites`` on ``ladder`` that compiles nothing (its walk,
  top rung and relaxing need no cost model)."""
  def no_compile(state, what):
    raise AssertionError(f"compiled {state} ({what})")
  return _search.Search(sites, ladder, batch=1, budget=0.0, fixed=0.0, working=0.0,
                        exact=plan_lib.Measured(0.0, 0.0), objective=plan_lib.Objective(),
                        sensitivity=sensitivity, compile=no_compile, compiles_left=lambda: 0)


@pytest.fixture(autouse=True)
def _compile_each_step_once(monkeypatch):
  """Within a test, a step lowered to the same program (text, compiler options, devices) is
  compiled by XLA once. The plans of one test compile many of the same steps (exact at two
  batch sizes, a walk's first points), and what a plan reads of one (bytes, FLOPs, the HLO)
  is a function of the program. The planner's own count of steps compiled is unchanged.
  Programs with host callbacks, and lowerings whose compile arguments this JAX keeps
  elsewhere, are compiled every time."""
  cache, compile_ = {}, jax.stages.Lowered.compile

  def compile_once(self, *args, **kwargs):
    lowering = getattr(self, "_lowering", None)
    options = getattr(lowering, "_compiler_options_kvs", None)
    devices = getattr(lowering, "_device_list", None)
    callbacks = getattr(lowering, "compile_args", {}).get("host_callbacks", True)
    if args or kwargs or options is None or callbacks:
      return compile_(self, *args, **kwargs)
    key = (self.as_text(), repr(options),
           None if devices is None else tuple(d.id for d in devices))
    if key not in cache:
      cache[key] = compile_(self)
    return cache[key]
  monkeypatch.setattr(jax.stages.Lowered, "compile", compile_once)


def _device_bytes(model, optimizer):
  """The device bytes of ``model``'s step compiled as `jmem.plan` compiles it (where the
  converted model lowers to the program the planner compiled, the fixture above hands back
  that compile)."""
  return plan_lib.step_cost(model, optimizer, X, Y)[0]


@pytest.mark.slow
def test_plans_fit_and_a_tighter_budget_never_needs_fewer_flops():
  model = tp.ThirdPartyResNet()
  optimizer = train.default_optimizer(1e-3, 100)
  plans = [plan_lib.plan(model, (X, Y), b, optimizer=optimizer, max_batch=i == 0)
           for i, b in enumerate(("80%", "65%"))]
  for p, share in zip(plans, (0.8, 0.65)):
    assert p.budget_bytes == int(share * p.exact_device_bytes)
    assert p.fits and p.device_bytes <= p.budget_bytes, p.table()
    assert p.compiles <= 8 + 1
  # The reported peak is the compiled step of the planned model.
  assert _device_bytes(jmem.convert(model, *plans[1].techniques), optimizer) == \
      plans[1].device_bytes
  assert plans[0].max_batch >= 64 > plans[0].exact_max_batch
  # Every step compiled at the batch is in the plan, the exact one and the plan's among them.
  for p in plans:
    assert p.measured[0] == ("exact", p.exact_device_bytes, p.exact_flops)
    assert ((p.device_bytes, p.flops) in [(b, f) for _, b, f in p.measured] and
            all(w.startswith("walk point") for w, _, _ in p.measured[1:])), p.measured
    # The front is what the compiles say: each compiled walk point's own figures.
    for w, b, f in p.measured[1:]:
      assert p.front[int(w.split()[-1])] == (b, f), (w, p.front)
    assert len(p.estimates) == len(p.front)
    assert not any("no batch is likely to fit" in n for n in p.notes), p.notes
    assert min(b for b, _ in p.front) > 0, p.front
  assert plans[1].flops >= plans[0].flops >= plans[0].exact_flops
  assert all(c.kind in ("save", "compress", "recompute_compressed") for c in plans[1].choices)
  # Every site climbs to 8 bits before one goes lower.
  bits = [c.bits for c in plans[0].choices if c.bits is not None]
  assert bits and (min(bits) == 8 or all(c.bits is not None for c in plans[0].choices))
  table = plans[1].table()
  assert "fits" in table and "BottleneckBlock_0" in table


@pytest.mark.slow
def test_exact_only_plans_keep_the_gradients_exact():
  model = models.create_model("resnet8", 10)
  x = jax.ShapeDtypeStruct((64, 16, 16, 1), jnp.float32)
  y = jax.ShapeDtypeStruct((64,), jnp.int32)
  first = plan_lib.plan(model, (x, y), 10**9, max_batch=False)    # exact fits: no technique
  assert first.fits and first.techniques == () and first.flops == first.exact_flops
  assert first.measured == (("exact", first.device_bytes, first.flops),)
  budget = int(first.exact_device_bytes * 0.8)
  p = plan_lib.plan(model, (x, y), budget, approximate=False, max_batch=False)
  assert {c.kind for c in p.choices} <= {"save", "recompute"}
  assert p.fits and not p.approximate
  tiny = plan_lib.plan(model, (x, y), 2**20, approximate=False, max_batch=False)
  assert not tiny.fits and all(c.kind == "recompute" for c in tiny.choices)
  assert "does NOT fit" in tiny.table() and "over" in tiny.table()
  # policies= allows some site policies: recompute alone is the exact ladder (the same
  # plan; sensitivities have no bit reduction to order), compress alone no recomputation.
  ones = {c.path: 1.0 for c in p.choices}
  same = plan_lib.plan(model, (x, y), budget, policies=("recompute",), max_batch=False,
                       sensitivities=ones)
  assert [c.label for c in same.choices] == [c.label for c in p.choices]
  assert (same.device_bytes, same.flops) == (p.device_bytes, p.flops) and not same.approximate
  assert "sensitivities unused: they order bit reductions, and the policies allowed " \
      "compress nothing" in same.notes and "site policies searched: save, recomputed" in same.notes
  packed = plan_lib.plan(model, (x, y), budget, policies="compress", max_batch=False)
  assert packed.fits and packed.approximate, packed.table()
  assert {c.kind for c in packed.choices} <= {"save", "compress"}
  assert "site policies searched: save, compressed at 8 bits, compressed at 4 bits, " \
      "compressed at 2 bits, compressed at 1 bit" in packed.notes, packed.notes
  for bad, match in ((("save",), r"policies= \(--policies\) takes site policies of"),
                     ((), "at least one"), (("compress",), "approximate=False keeps"),
                     (("compress", "offload"), "the planner does not search 'offload'")):
    with pytest.raises(ValueError, match=match):
      plan_lib.plan(model, (x, y), budget, policies=bad, approximate=bad != ("compress",))


@pytest.mark.slow
def test_where_nothing_fits_the_plan_is_the_smallest_step_compiled():
  """Past some rung the compiled step grows again (here the last walk point, recomputing
  from 2-bit inputs, compiles larger than an earlier one): the plan is the smallest."""
  model = models.create_model("resnet8", 10)
  x = jax.ShapeDtypeStruct((64, 16, 16, 1), jnp.float32)
  y = jax.ShapeDtypeStruct((64,), jnp.int32)
  p = plan_lib.plan(model, (x, y), 2**20, max_batch=False)
  walked = [b for what, b, _ in p.measured if what.startswith("walk point")]
  assert not p.fits and len(walked) >= 2 and walked[-1] > min(walked), p.measured
  assert p.device_bytes == min(walked) and p.chosen < len(p.front) - 1 and not p.off_walk
  assert (f"walk point {p.chosen}", p.device_bytes, p.flops) in p.measured, p.measured
  # The walk's end here has every site on the top rung already: no further try.
  assert all(w.startswith("walk point") for w, _, _ in p.measured[1:]), p.measured
  assert any(n.startswith("nothing fits: the plan is the smallest of the steps compiled "
                          f"for the walk (walk point {p.chosen}") and
             "the walk ended at its last point, every site on the highest rung" in n and
             n.endswith(f"walk point {len(p.front) - 1} ({_report._size(walked[-1])})")
             for n in p.notes), p.notes
  assert "the smallest step compiled on its layout" in p.table()
  step = plan_lib.compile_step(jmem.convert(model, *p.techniques),
                               train.default_optimizer(1e-3, 100), x, y)
  assert jmem.measure.device_bytes_and_flops(step)[0] == p.device_bytes


@pytest.mark.slow
def test_a_model_whose_mode_is_a_field():
  """The U-Net takes no ``train=`` at call time (its mode is a field): the loop and the
  planner call it without one; a converted U-Net too."""
  from jmem.models.segmentation import UNet   # pylint: disable=g-import-not-at-top
  model = UNet(3, widths=(4, 8))
  x = jax.ShapeDtypeStruct((2, 16, 16, 3), jnp.float32)
  y = jax.ShapeDtypeStruct((2, 16, 16), jnp.int32)
  for m in (model, jmem.convert(model, jmem.Remat())):
    fns = train.model_fns(m)
    params, state = jax.eval_shape(fns.init, jax.random.key(0), x)
    loss = train.make_loss(fns)
    out = jax.eval_shape(lambda *a: loss(*a, jax.random.key(1)), params, state, x, y)
    assert out[0].shape == ()
    # Evaluation runs the model in eval mode (its BatchNorm statistics are read, not
    # written: in training mode this raised, batch_stats being immutable).
    logits, _ = jax.eval_shape(lambda p, s, v: fns.apply(p, s, v, train=False), params,
                               state, x)
    assert logits.shape == (2, 16, 16, 3)
  p = plan_lib.plan(model, (x, y), 10**9, max_batch=False)
  assert sorted(c.path for c in p.choices) == ["dec0", "enc0", "enc1", "head"]


def test_estimates_of_a_converted_model_are_its_own():
  """Planning a model converted first (with SyncBN, say): the sites are its block sites and
  the residuals are attributed to them through the convert wrapper's name scopes."""
  model = tp.ThirdPartyResNet()
  optimizer = train.default_optimizer(1e-3, 100)

  def estimates(m):
    # pylint: disable=protected-access
    paths = _inputs._default_sites(m, jnp.zeros(X.shape))
    sites, outside = _inputs._estimate_sites(m, optimizer, X, Y, paths)
    return {s.path: s.residual_bytes for s in sites}, outside

  plain, _ = estimates(model)
  assert set(plain) == {"conv_init", "bn_init", "BottleneckBlock_0", "BottleneckBlock_1"}
  got, _ = estimates(jmem.convert(model, jmem.SyncBN()))
  assert set(got) == set(plain)
  for path in ("BottleneckBlock_0", "BottleneckBlock_1"):   # jmem's BatchNorm keeps less
    assert 0.5 * plain[path] < got[path] <= 1.01 * plain[path], (path, got, plain)
  # Block techniques are the planner's to choose: a model that has them is refused.
  with pytest.raises(ValueError, match="before converting it"):
    plan_lib.plan(jmem.convert(model, jmem.Remat()), (X, Y), "1GiB")


@pytest.mark.slow
def test_nnx_models_are_planned_through_copies():
  """An NNX model (converted in place by jmem.convert) is planned on copies: yours is left as
  it was; its sites' residuals are found through name scopes of their paths; converting it
  with the plan gives the reported step. (Its sensitivities, through a probing copy too:
  tests/test_actnn.py.)"""
  model = tp.NNXViT(rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  x = rng.normal(size=(32, 16, 16, 3)).astype(np.float32)
  y = rng.integers(0, 10, 32).astype(np.int32)
  optimizer = train.default_optimizer(1e-3, 100)
  paths = _inputs._default_sites(model, x)   # pylint: disable=protected-access
  assert paths == ["blocks/0", "blocks/1", "norm", "patchify"]
  sites, outside = _inputs._estimate_sites(model, optimizer, x, y, paths)  # pylint: disable=protected-access
  got = {s.path: s for s in sites}
  # Each transformer block keeps the same; the head's residuals are the only ones outside.
  assert got["blocks/0"].residual_bytes == got["blocks/1"].residual_bytes > 20 * outside > 0
  assert got["blocks/0"].forward_flops > 0 and got["blocks/0"].input_bytes == 16 * 16 * 4
  p = plan_lib.plan(model, (x, y), "85%", optimizer=optimizer, max_batch=False)
  assert p.fits and p.techniques, p.table()
  assert jmem.surgery.sites(model) == {}                     # not converted by planning
  assert type(model.blocks[0]) is tp.NNXViTBlock
  converted = jmem.convert(model, *p.techniques)
  fns = train.model_fns(converted)
  abstract = jax.eval_shape(lambda k, v: train.init_state(fns, optimizer, k, v),
                            jax.random.key(0), x[:1])
  compiled = train.make_train_step(fns, optimizer, donate=True).lower(
      abstract, jax.ShapeDtypeStruct(x.shape, x.dtype),
      jax.ShapeDtypeStruct(y.shape, y.dtype)).compile()
  assert jmem.measure.device_bytes_and_flops(compiled)[0] == p.device_bytes
  with pytest.raises(ValueError, match="unconverted NNX model"):
    plan_lib.plan(converted, (x, y), "1GiB")


@pytest.mark.slow
def test_inplace_abn_alone_is_the_plan_where_it_fits_at_fewer_flops():
  """Where the exact step does not fit, the planner also compiles InPlace-ABN alone on every
  BatchNorm it can take (`jmem.surgery.inplace_abn_sites`) and takes it where it fits at
  fewer compiled FLOPs than the walk's plan: on the NNX CNN, whose stem has BatchNorm +
  leaky_relu in an nnx.Sequential, at 95% and 90% of exact's bytes (1.04x exact's FLOPs,
  where recomputing both sites costs 1.14x); at 80% it misses and the walk's plan fits,
  at no fewer FLOPs."""
  x = jax.ShapeDtypeStruct((64, 32, 32, 3), jnp.float32)
  assert jmem.surgery.inplace_abn_sites(tp.SequentialABNCNN(), jnp.zeros((2, 8, 8, 3))) == [
      "BatchNorm_0", "BatchNorm_1"]
  assert jmem.surgery.inplace_abn_sites(tp.ThirdPartyResNet(), jnp.zeros((2, 8, 8, 3)),
                                        train=True) == []
  model = tp.NNXCNN(rngs=nnx.Rngs(0))
  assert jmem.surgery.inplace_abn_sites(model) == ["stem/layers/1"]
  optimizer = train.default_optimizer(1e-3, 100)
  kw = dict(approximate=False, optimizer=optimizer, max_batch=False)
  loose, tight = (plan_lib.plan(model, (x, Y), b, **kw) for b in ("95%", "90%"))
  without = plan_lib.plan(model, (x, Y), "90%", inplace_abn=False, **kw)
  ratio = lambda p: p.flops / p.exact_flops
  for p in (loose, tight):
    assert p.fits and p.techniques == (jmem.InPlaceABN(where="stem/layers/1"),), p.table()
    assert ratio(p) < 1.05 < 1.1 < ratio(without) and not p.approximate, p.table()
    assert any("inplace_abn_params" in n for n in p.notes)
    assert any("the plan is InPlace-ABN" in n for n in p.notes), p.notes
  assert without.fits and "InPlaceABN" in tight.table()
  converted = jmem.convert(nnx.clone(model), *tight.techniques)
  assert plan_lib.step_cost(converted, optimizer, x, Y)[0] == tight.device_bytes
  tighter = plan_lib.plan(model, (x, Y), "80%", optimizer=optimizer, max_batch=False)
  assert tighter.fits and not tighter.base and ratio(tighter) >= ratio(tight), tighter.table()
  assert any("InPlace-ABN alone misses the budget" in n for n in tighter.notes), tighter.notes
  # A converted NNX model cannot be converted again: the planner says what to do instead.
  with pytest.raises(ValueError, match="unconverted NNX model"):
    plan_lib.plan(jmem.convert(nnx.clone(model), jmem.SyncBN()), (x, Y), "90%")


@pytest.mark.slow
def test_a_mesh_puts_spatial_under_every_plan_and_the_budget_is_per_device():
  """With ``mesh=`` every step is compiled with jmem.Spatial and the batch sharded over H x W
  (8 devices): the exact step is Spatial alone, the figures are per device, and the plan's
  peak is that of the converted model compiled with the same shardings by hand."""
  from jax.sharding import AxisType  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  mesh = jax.make_mesh((2, 4), ("h", "w"), axis_types=(AxisType.Auto,) * 2)
  model = tp.FunctionalCNN()
  x = jax.ShapeDtypeStruct((16, 32, 32, 3), jnp.float32)
  y = jax.ShapeDtypeStruct((16,), jnp.int32)
  optimizer = train.default_optimizer(1e-3, 100)
  p = plan_lib.plan(model, (x, y), "90%", mesh=mesh, optimizer=optimizer, max_batch=False)
  assert p.fits and p.techniques[0] == jmem.Spatial(mesh), p.table()
  assert any("per device" in n for n in p.notes) and "jmem.Spatial over" in p.table()
  # The walk's plan fits (walk point 2), but the estimate puts the top rung (every site
  # recomputed from a 2-bit input) at fewer FLOPs: the one more compile fits at 1.080x
  # exact's, and is the plan, off the walk.
  _TOP = _search.TOP_RUNG          # pylint: disable=invalid-name,protected-access
  assert [w for w, _, _ in p.measured] == ["exact", "walk point 1", "walk point 2", _TOP], \
      p.measured
  assert any(n.startswith("every site that saves anything on the top rung (recomputed from "
                          "a 2-bit input), which the estimate put at fewer FLOPs than the "
                          "walk's plan") and n.endswith("fitted at 1.080x: that is the plan")
             for n in p.notes), p.notes
  assert p.off_walk and p.chosen == len(p.front) - 1, p.front
  assert p.to_json()["off_walk"] and (_TOP, p.device_bytes, p.flops) in p.measured
  assert {(c.kind, c.bits) for c in p.choices if c.kind != "save"} == {
      ("recompute_compressed", 2)}, p.table()
  # At 80% the walk's end misses; every site on the top rung, tried after it, misses too,
  # and the smallest step compiled is the plan that does not fit.
  tight = plan_lib.plan(model, (x, y), "80%", mesh=mesh, optimizer=optimizer,
                        max_batch=False)
  assert not tight.fits and not tight.off_walk and tight.measured[-1][0] == _TOP
  assert tight.device_bytes == min(b for _, b, _ in tight.measured), tight.measured
  assert any(n.startswith("every site that saves anything on the top rung missed the "
                          "budget by") for n in tight.notes), tight.notes
  assert any(n.startswith("nothing fits: the plan is the smallest of the steps compiled for "
                          "the walk") for n in tight.notes), tight.notes
  # With 4 compiles the walk stops before its end: a note says so.
  short = plan_lib.plan(model, (x, y), "80%", mesh=mesh, optimizer=optimizer,
                        max_batch=False, max_compiles=4)
  assert not short.fits and short.compiles == 4 and not short.off_walk
  assert short.device_bytes == min(b for _, b, _ in short.measured), short.measured
  assert any(n.startswith("the per-site walk stopped over the budget at max_compiles=4")
             for n in short.notes), short.notes
  # At 95% the walk's first point fits (a BatchNorm at 8 bits); the top rung, tried, costs
  # more FLOPs than it, so the plan is the walk's.
  loose = plan_lib.plan(model, (x, y), "95%", mesh=mesh, optimizer=optimizer,
                        max_batch=False)
  assert [w for w, _, _ in loose.measured] == ["exact", "walk point 1", _TOP], loose.measured
  assert loose.fits and not loose.off_walk and loose.flops == loose.measured[1][2]
  assert any(n.endswith("the plan is the walk's") for n in loose.notes), loose.notes
  one_device = plan_lib.step_cost(model, optimizer, x, y)[0]
  assert p.exact_device_bytes < 0.5 * one_device
  assert plan_lib.step_cost(jmem.convert(model, *p.techniques), optimizer, x, y, mesh=mesh,
                            specs=(P(None, "h", "w"), P()))[0] == p.device_bytes
  with pytest.raises(ValueError, match="multiples"):
    plan_lib.plan(model, (jax.ShapeDtypeStruct((16, 32, 30, 3), jnp.float32), y), "90%",
                  mesh=mesh)
  with pytest.raises(ValueError, match="mesh="):
    plan_lib.plan(jmem.convert(model, jmem.Spatial(mesh)), (x, y), "90%")
  with pytest.raises(ValueError, match="other axes"):         # copies of the same work
    plan_lib.plan(model, (x, y), "90%", mesh=jax.make_mesh(
        (2, 2, 2), ("data", "h", "w"), axis_types=(AxisType.Auto,) * 3))


@pytest.mark.slow
def test_a_data_axis_splits_the_batch_with_or_without_spatial():
  """``data_axis=`` splits the batch over a mesh axis (data parallelism; the bytes, not the
  BatchNorm statistics, are checked): clips, which Spatial does not take, on 4 devices; the
  plan's bytes are the converted model's compiled with the batch split by hand, per device,
  and its batches are multiples of 4. On a data x H x W mesh Spatial takes the data axis."""
  from jax.sharding import AxisType  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  data = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,),
                       devices=jax.devices()[:4])
  model = tp.ClipClassifier()
  x = jax.ShapeDtypeStruct((16, 4, 16, 16, 1), jnp.float32)
  y = jax.ShapeDtypeStruct((16,), jnp.int32)
  optimizer = train.default_optimizer(1e-3, 100)
  p = plan_lib.plan(model, (x, y), "80%", mesh=data, data_axis="data", spatial_axes=None,
                    optimizer=optimizer)
  assert p.fits and p.techniques and not any(
      isinstance(t, jmem.Spatial) for t in p.techniques), p.table()
  assert any("the batch over 'data'" in n and "data_parallel" in n for n in p.notes), p.notes
  assert p.exact_device_bytes < 0.5 * plan_lib.step_cost(model, optimizer, x, y)[0]
  assert p.max_batch % 4 == 0 and p.exact_max_batch % 4 == 0
  assert p.max_batch >= 16 > p.exact_max_batch
  assert plan_lib.step_cost(jmem.convert(model, *p.techniques), optimizer, x, y, mesh=data,
                            specs=(P("data"), P("data")))[0] == p.device_bytes
  with pytest.raises(ValueError, match="multiple of 4"):
    plan_lib.plan(model, (x, y), "80%", batch_size=18, mesh=data, data_axis="data",
                  spatial_axes=None)
  with pytest.raises(ValueError, match="spatial_axes=None"):
    plan_lib.plan(model, (x, y), "80%", mesh=data, data_axis="data")
  with pytest.raises(ValueError, match="pass mesh="):
    plan_lib.plan(model, (x, y), "80%", data_axis="data")
  cube = jax.make_mesh((2, 2, 2), ("data", "h", "w"), axis_types=(AxisType.Auto,) * 3)
  images = jax.ShapeDtypeStruct((16, 32, 32, 3), jnp.float32)
  p = plan_lib.plan(tp.FunctionalCNN(), (images, y), "90%", mesh=cube, data_axis="data",
                    optimizer=optimizer, max_batch=False)
  assert p.techniques[0] == jmem.Spatial(cube, data_axis="data") and p.fits, p.table()
  assert plan_lib.step_cost(jmem.convert(tp.FunctionalCNN(), *p.techniques), optimizer,
                            images, y, mesh=cube, specs=(P("data", "h", "w"), P("data"))
                            )[0] == p.device_bytes
  with pytest.raises(ValueError, match="no mesh axis"):
    plan_lib.plan(model, (x, y), "80%", mesh=data, spatial_axes=None)


@pytest.mark.slow
def test_devices_are_laid_out_batch_first_then_h_and_w():
  """``devices=N``: the batch over the most devices that divide it, H x W over the rest
  (each split's exact step compiled: of those within 2% of the fewest bytes, the fewest
  collectives); the plan's bytes are the converted model's compiled on that mesh, and
  trained there (plan.model_fns) it gives one device's losses; what cannot be laid out is
  refused."""
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  images = lambda b, h=32, w=32: jax.ShapeDtypeStruct((b, h, w, 3), jnp.float32)
  shape = lambda mesh: {a: n for a, n in mesh.shape.items() if n > 1}
  lay_out = _layouts._lay_out                  # pylint: disable=protected-access
  meshes = lambda *a: [(shape(m), d, axes) for m, d, axes in lay_out(*a)[0]]
  assert meshes(8, 16, images(16)) == [({"data": 8}, "data", None)]
  assert lay_out(1, 2, images(2))[0] == [(None, None, None)]
  assert meshes(jax.devices()[2:6], 4, images(4)) == [({"data": 4}, "data", None)]
  # 3 divides none of 8: H x W takes all, the fewest halo values per device first.
  assert [m for m, _, _ in meshes(8, 3, images(3))] == [
      {"h": 2, "w": 4}, {"h": 4, "w": 2}, {"w": 8}, {"h": 8}]
  assert meshes(8, 2, images(2, 32, 64))[0] == ({"data": 2, "w": 4}, "data", (None, "w"))
  with pytest.raises(ValueError, match="NHWC images"):
    lay_out(8, 2, jax.ShapeDtypeStruct((2, 4, 16, 16, 1), jnp.float32))
  with pytest.raises(ValueError, match="no h x w = 8 divides"):
    lay_out(8, 1, images(1, 30, 30))
  with pytest.raises(ValueError, match="from 1 to 8"):
    lay_out(9, 8, images(8))
  for bad in (["gpu:0"], [jax.devices()[0]] * 2, True, 8.0):   # repeated, not a count
    with pytest.raises(TypeError, match="distinct jax.Device"):
      lay_out(bad, 8, images(8))

  model, y = tp.FunctionalCNN(), jax.ShapeDtypeStruct((2,), jnp.int32)
  optimizer = train.default_optimizer(1e-3, 100)
  p = plan_lib.plan(model, (images(2), y), "2MiB", devices=8, optimizer=optimizer)
  assert any(n.startswith("devices=8: the batch of 2 is split over 2") for n in p.notes)
  # H x W over the other 4 every way (1x4, 4x1, 2x2), each exact step compiled by hand:
  # the plan's mesh is, of those within 2% of the fewest bytes, the one with the fewest
  # collectives (then bytes).
  exact = {}
  for mesh, data, axes in lay_out(8, 2, images(2))[0]:
    step = plan_lib.compile_step(
        jmem.convert(model, jmem.Spatial(mesh, axes=axes, data_axis=data)), optimizer,
        images(2), y, mesh=mesh, specs=(P(data, *axes), P(data)))
    exact[tuple(mesh.shape.values())] = (
        jmem.measure.device_bytes_and_flops(step)[0],
        sum(jmem.measure.collective_counts(step.as_text()).values()))
  assert sorted(exact) == [(2, 1, 4), (2, 2, 2), (2, 4, 1)]
  # Each split's own compile is in the notes (2x2 has more collectives than the others).
  note = next(n for n in p.notes if n.startswith("H x W split every way"))
  for (_, h, w), (_, count) in exact.items():
    assert f"{h}x{w} " in note and f"{h}x{w} {_report._size(exact[(2, h, w)][0])} with " \
        f"{count} collectives" in note, (exact, note)   # pylint: disable=protected-access
  assert exact[(2, 2, 2)][1] > exact[(2, 1, 4)][1]
  least = min(b for b, _ in exact.values())
  best = min((k for k in exact if exact[k][0] <= 1.02 * least),
             key=lambda k: exact[k][::-1])
  assert tuple(p.mesh.shape.values()) == best and p.devices == 8, (exact, p.table())
  assert min(exact, key=lambda k: exact[k][0]) != best     # bytes alone would pick 2x2
  assert p.exact_device_bytes == exact[best][0] and p.measured[0][0] == "exact"
  assert p.to_json()["mesh"] == dict(zip(("data", "h", "w"), best))
  assert json.loads(json.dumps(p.to_json()))["base"][0].startswith("jmem.Spatial")
  assert p.compiles == 4 and p.max_batch % 2 == 0 and p.max_batch >= 2   # 3 splits, small
  spatial = p.techniques[0]
  assert isinstance(spatial, jmem.Spatial) and spatial.mesh == p.mesh
  assert plan_lib.step_cost(jmem.convert(model, *p.techniques), optimizer, images(2), y,
                            mesh=p.mesh, specs=(P("data", *spatial.axes), P("data"))
                            )[0] == p.device_bytes
  for both in (dict(mesh=p.mesh), dict(data_axis="data"), dict(spatial_axes=None)):
    with pytest.raises(ValueError, match="not both"):
      plan_lib.plan(model, (images(2), y), "2MiB", devices=8, **both)
  with pytest.raises(ValueError, match="together"):
    plan_lib.compile_step(model, optimizer, images(2), y, mesh=p.mesh, specs=P("data", "w"))

  # Trained on the plan's mesh (plan.model_fns), two steps give one device's losses.
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  xb = rng.normal(size=(2, 32, 32, 3)).astype(np.float32)
  yb = rng.integers(0, 10, 2).astype(np.int32)
  losses = []
  for fns in (train.model_fns(model), p.model_fns(model)):
    state = train.init_state(fns, optimizer, jax.random.key(0), xb[:1])
    xs, ys = xb, yb
    if fns.batch_sharding is not None:
      assert fns.batch_sharding.spec == p.batch_specs[0]
      state = jax.device_put(state, fns.sharding)
      xs = jax.device_put(xb, fns.batch_sharding)
      ys = jax.device_put(yb, NamedSharding(p.mesh, p.batch_specs[1]))
    step = train.make_train_step(fns, optimizer)
    for _ in range(2):
      state, metrics = step(state, xs, ys)
      losses.append(float(metrics["loss"]))
  np.testing.assert_allclose(losses[2:], losses[:2], rtol=1e-5)


@pytest.mark.slow
def test_budgets_and_bad_input():
  assert plan_lib.parse_bytes("16GiB") == 16 * 2**30
  assert plan_lib.parse_bytes("800 MiB") == 800 * 2**20
  assert plan_lib.parse_bytes("12GB") == 12 * 10**9
  assert plan_lib.parse_bytes(10_000) == 10_000
  assert plan_lib.parse_bytes(np.int64(10_000)) == 10_000
  # An int under 1 KiB holds no train step: a number of GiB written as an int, surely.
  with pytest.raises(ValueError, match=r"budget 16 is 16 bytes \(an int is bytes\).*give "
                                       r"'16GiB' or 16 \* 2\*\*30"):
    plan_lib.parse_bytes(16)
  # One meaning for a bare number: GiB in a string (the command line's), bytes in an int; a
  # float is refused as ambiguous, and a size of zero as zero, not as "not a size".
  assert plan_lib.parse_bytes("1.5") == int(1.5 * 2**30) == plan_lib.parse_bytes("1.5GiB")
  for bad in ("16 GiBs", "", True, "lots"):
    with pytest.raises(ValueError, match="is not a size|must be a size"):
      plan_lib.parse_bytes(bad)
  for bad in ("0GiB", "-1GiB", "0", 0, -5, "1e-12"):
    with pytest.raises(ValueError, match="more than 0 bytes"):
      plan_lib.parse_bytes(bad)
  for bad in (1.5, 0.5, np.float32(16.0), float("nan")):
    with pytest.raises(ValueError, match="ambiguous"):
      plan_lib.parse_bytes(bad)
  # A NaN in the calibration batch would make every sensitivity NaN: refused before compiling.
  xs, ys = np.ones((4, 8, 8, 3), np.float32), np.zeros((4,), np.int32)
  xs[1, 2, 3, 0] = np.nan
  with pytest.raises(ValueError, match="calibration_batch's x holds 1 non-finite"):
    plan_lib.plan(tp.FunctionalCNN(), (jax.ShapeDtypeStruct((4, 8, 8, 3), jnp.float32),
                                       jax.ShapeDtypeStruct((4,), jnp.int32)), "1GiB",
                  calibration_batch=(xs, ys), max_batch=False)
  assert plan_lib.budget_share("50%") == 0.5 and plan_lib.budget_share("16GiB") is None
  for bad in ("0%", "150%", "x%"):
    with pytest.raises(ValueError, match="share"):
      plan_lib.budget_share(bad)
  # The largest batch on the line through two compiled points; none if even those are over.
  assert _report._largest((4, 100), (8, 200), 500) == 20   # pylint: disable=protected-access
  assert _report._largest((4, 100), (8, 100), 50) == 0     # pylint: disable=protected-access
  assert _report._largest((4, 100), (8, 200), 260, 4) == 8   # pylint: disable=protected-access
  with pytest.raises(ValueError, match="max_compiles"):
    plan_lib.plan(tp.FunctionalCNN(), (X, Y), "1GiB", max_compiles=2)
  # Sites that hold (next to) none of the saved activations: where exact does not fit,
  # refused, not a plan that changes nothing (a ViT that applies its blocks detached);
  # where it fits, the exact plan with a note.
  y4 = jax.ShapeDtypeStruct((4,), jnp.int32)
  detached = (tp.DetachedBlocksViT(), (jax.ShapeDtypeStruct((4, 16, 16, 3), jnp.float32), y4))
  with pytest.raises(ValueError, match="hold .* of the train step's saved activations"):
    plan_lib.plan(detached[0], detached[1], "50%")
  fits = plan_lib.plan(*detached, 2**40, max_batch=False)
  assert fits.fits and not fits.techniques and any("block sites hold" in n for n in fits.notes)
  with pytest.raises(ValueError, match="one label"):
    plan_lib.plan(tp.FunctionalCNN(), (X, jax.ShapeDtypeStruct((8,), jnp.int32)), "50%")
  # No labels, or float ones (issue 48): said before any compile, with the fix.
  with pytest.raises(ValueError, match=r"example_batch must be \(x, y\).*got "
                                       r"ShapeDtypeStruct \(64, 32, 32, 3\)"):
    plan_lib.plan(tp.FunctionalCNN(), X, "50%")
  with pytest.raises(ValueError, match="integer class labels.*dtype float32.*astype"):
    plan_lib.plan(tp.FunctionalCNN(), (X, jax.ShapeDtypeStruct((64,), jnp.float32)), "50%")
  # A budget under what does not grow with the batch: the plan says no batch is likely to.
  with pytest.warns(plan_lib.BudgetNotMetWarning,
                    match=r"nothing found fits the budget of 9\.8 KiB at batch 64.*over"):
    tiny = plan_lib.plan(tp.FunctionalCNN(), (X, Y), 10_000, max_batch=False, max_compiles=3)
  assert not tiny.fits and any(
      n.startswith("the exact step's line through batch 32 and 64 puts") and
      n.endswith("so no batch is likely to fit") for n in tiny.notes), tiny.notes


@pytest.mark.slow
def test_jmem_video_models_have_sites_and_a_dominant_site_is_split(monkeypatch):
  # jmem's own video models call their blocks as bound submodules: the ViT's sites are its
  # blocks. The per-frame CNN of stt-resnet8 holds most of the saved activations as one
  # site: it is planned per block inside it (traces only, nothing compiled).
  monkeypatch.setattr(jmem.surgery._common, "_WARNED", set())  # pylint: disable=protected-access
  clips = jnp.zeros((2, 4, 16, 16, 1))
  y2 = jax.ShapeDtypeStruct((2,), jnp.int32)
  assert _inputs._default_sites(models.create_model("video-vit", 10), clips) == [
      "block0", "block1", "block2", "block3", "norm", "patch_embed"]
  model, optimizer = models.create_model("stt-resnet8", 10), train.default_optimizer(1e-3, 10)
  paths = _inputs._default_sites(model, clips)
  assert paths == ["norm", "spatial", "temporal0", "temporal1"]
  sites, outside = _inputs._estimate_sites(model, optimizer, clips, y2, paths)
  paths, sites, outside, notes = _inputs._split_dominant(model, optimizer, clips, y2, paths,
                                                          sites, outside)
  inner = ["spatial/cnn/head", "spatial/cnn/stage1_block1", "spatial/cnn/stage2_block1",
           "spatial/cnn/stage3_block1", "spatial/cnn/stem"]   # inside the encoder's one CNN
  assert paths == ["norm"] + inner + ["temporal0", "temporal1"]
  assert [s.path for s in sites] == paths and len(notes) == 1
  assert re.fullmatch(r"the site 'spatial' held 9\d% of the saved activations: planned per "
                      r"module inside it \(5 sites\)", notes[0]), notes
  held = {s.path: s.residual_bytes for s in sites}
  assert min(held[p] for p in inner[1:]) > 0 and max(held.values()) < 0.5 * (
      sum(held.values()) + outside)
  # NNX too: an encoder of two blocks holding nearly all is planned per block.
  net, x = _NNXEncoderNet(nnx.Rngs(0)), jax.ShapeDtypeStruct((2, 16, 16, 3), jnp.float32)
  paths = _inputs._default_sites(net, jnp.zeros(x.shape))
  sites, outside = _inputs._estimate_sites(net, optimizer, x, y2, paths)
  paths, sites, outside, notes = _inputs._split_dominant(net, optimizer, x, y2, paths, sites,
                                                          outside)
  assert paths == ["conv", "enc/b1", "enc/b2"] and len(notes) == 1, (paths, notes)
  assert all(s.residual_bytes > 0 for s in sites[1:])


class _NNXBlock(nnx.Module):
  def __init__(self, cin, cout, rngs):
    self.conv = nnx.Conv(cin, cout, (3, 3), rngs=rngs)

  def __call__(self, x):
    return nnx.relu(self.conv(x))


class _NNXEncoder(nnx.Module):
  def __init__(self, rngs):
    self.b1, self.b2 = _NNXBlock(3, 8, rngs), _NNXBlock(8, 8, rngs)

  def __call__(self, x):
    return self.b2(self.b1(x))


class _NNXEncoderNet(nnx.Module):
  def __init__(self, rngs):
    self.enc = _NNXEncoder(rngs)
    self.conv = nnx.Conv(8, 4, (3, 3), strides=(4, 4), rngs=rngs)
    self.head = nnx.Linear(64, 10, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.conv(self.enc(x)))
    return self.head(x.reshape(x.shape[0], -1))


@pytest.mark.slow
def test_plan_cli(tmp_path, capsys, monkeypatch):
  out = tmp_path / "out"
  trained, train_ = [], train.train             # what --verify-steps trains
  monkeypatch.setattr(train, "train", lambda model, *a, **k: trained.append(
      (model, train_(model, *a, **k))) or trained[-1][1])
  code = cli.main(["plan", "--model", "resnet8", "--image-size", "16", "--batch-size", "32",
                   "--budget", "4MiB", "--devices", "2", "--output-dir", str(out), "--json",
                   "--verify-steps", "2", "--bits", "4,8"])
  written = json.loads((out / "plan.json").read_text())
  assert code == (0 if written["fits"] else 1)
  # --verify-steps: the planned model (approximate policies here) and exact, each trained
  # 2 steps on the embedded digits at 16x16, on one device; both accuracies in the output.
  printed = json.loads(capsys.readouterr().out)
  assert any(c["kind"] in ("compress", "recompute_compressed") for c in written["choices"])
  # --bits 4,8: no value below 4 bits, recomputation from a 4-bit input.
  assert all(c["bits"] in (None, 4, 8) for c in written["choices"]), written["choices"]
  assert "site policies searched: save, compressed at 8 bits, compressed at 4 bits, " \
      "recomputed from a 4-bit input" in written["notes"], written["notes"]
  verify = printed.pop("verify")                  # printed, and in plan.json too
  assert written.pop("verify") == verify
  assert printed == written and verify["steps"] == 2 and verify["image_size"] == 16
  assert sorted(verify["accuracy"]) == ["exact", "plan"], verify
  assert all(0.0 < a <= 1.0 for a in verify["accuracy"].values()), verify
  # Exact, then the model converted with the plan's techniques (a data mesh: no Spatial).
  (exact, exact_run), (planned, plan_run) = trained
  assert not hasattr(exact, "techniques") and written["techniques"]
  assert [repr(t) for t in planned.techniques] == written["techniques"], written["techniques"]
  assert verify["accuracy"] == {"exact": exact_run.test_accuracy,
                                "plan": plan_run.test_accuracy}
  assert written["budget_bytes"] == 4 * 2**20 and written["choices"]
  assert any("per device (2 devices)" in n for n in written["notes"]), written["notes"]
  assert written["devices"] == 2 and "per device of 2" in (out / "plan.md").read_text()
  assert written["mesh"] == {"data": 2}          # 32 splits over both: data parallelism
  for best in (written["max_batch"], written["exact_max_batch"]):   # batches the 2 divide
    assert isinstance(best, int) and best % 2 == 0, written
  assert (out / "plan.md").exists() and (out / "plan_front.png").exists()
  for bad in (["--budget", "sixteen"], ["--mesh", "2y4"], ["--mesh", "0x2x4"], ["--mesh", "2x4"],
              ["--mesh", "2x4x4"],                 # 32 devices: the tests have 8
              ["--devices", "9"], ["--devices", "2", "--mesh", "2"],
              ["--policies", "save"], ["--policies", "offload"],
              ["--policies", "compress", "--exact-only"],
              ["--bits", "3"], ["--bits", "8,8"], ["--bits", "8", "--exact-only"],
              ["--bits", "eight"],
              ["--verify-steps", "1", "--verify-image-size", "-4"], ["--verify-steps", "-1"],
              ["--devices", "0"]):
    with pytest.raises(SystemExit):
      cli.main(["plan", *bad, "--output-dir", str(out)])
    err = capsys.readouterr().err   # refused before any trace or plan
    if "--exact-only" in bad:
      assert ("approximate=False keeps the gradients exact" in err or
              "approximate=False (--exact-only) quantizes nothing: drop bits" in err), err
    if bad[0] == "--bits" and "--exact-only" not in bad:
      assert ("integers separated by commas" if bad[1] == "eight" else
              "bits= (--bits) takes the bit widths a quantized value may have") in err, err
    if bad == ["--policies", "save"]:
      assert "policies= (--policies) takes site policies of" in err, err
    if bad == ["--policies", "offload"]:
      assert "does not search 'offload'" in err and "jmem.Policy('offload'" in err, err
    if "-4" in bad:
      assert "--verify-image-size must be positive" in err
    if bad == ["--devices", "0"]:
      assert "--devices must be at least 1, got 0" in err, err
    if bad == ["--verify-steps", "-1"]:
      assert "--verify-steps must be 0 (no verification) or more, got -1" in err, err
  # --verify-image-size: by default the plan's image size (224 by default) up to 32.
  # pylint: disable=protected-access
  size = lambda *flags: cli._verify_size(cli._parser().parse_args(["plan", *flags]))
  assert size() == 32 and size("--image-size", "24") == 24
  assert size("--verify-image-size", "16") == 16
  # ... rounded up to what the model and its clips need (58 for 40 frames, then to video-vit's
  # patches of 8); a --verify-image-size too small for the clips is refused before planning.
  assert size("--model", "video-vit", "--image-size", "64", "--num-frames", "40") == 64
  assert size("--model", "convnext-t", "--image-size", "16") == 32
  with pytest.raises(SystemExit):
    cli.main(["plan", "--model", "video-vit", "--num-frames", "40", "--image-size", "64",
              "--verify-steps", "1", "--verify-image-size", "32", "--output-dir", str(out)])
  assert "--verify-image-size 58 or more" in capsys.readouterr().err


@pytest.mark.slow
def test_gact_sensitivities_give_fewer_bits_where_gradients_tolerate_them(monkeypatch):
  """Down the compression rungs (the same FLOPs per byte at every site) the walk lowers
  first the site that adds the least gradient variance per byte saved; without
  sensitivities it goes by bytes. Measured sensitivities reach the plan's table."""
  # pylint: disable=protected-access
  sites = [_inputs._Site("big", residual_bytes=4e6, values=1e6, input_bytes=4e5,
                          input_values=1e5, forward_flops=1e8),
           _inputs._Site("small", residual_bytes=2e6, values=5e5, input_bytes=2e5,
                          input_values=5e4, forward_flops=5e7)]
  ladder = plan_lib.site_ladder(None, True)

  def first_to(bits, sensitivity):
    for state in _search_over(sites, ladder, sensitivity).walk:
      lowered = [s.path for s, r in zip(sites, state) if ladder[r] == ("compress", bits)]
      if lowered:
        return lowered
  assert first_to(4, None) == ["big"]                       # most bytes first
  assert first_to(4, {"big": 1.0, "small": 100.0}) == ["big"]
  assert first_to(4, {"big": 100.0, "small": 1.0}) == ["small"]   # 2x fewer bytes, 100x safer
  assert first_to(2, {"big": 100.0, "small": 1.0}) == ["small"]
  assert first_to(1, {"big": 100.0, "small": 1.0}) == ["small"]
  # The rungs, in the walk's order: every site at 2 bits before any goes to 1 bit, every
  # site at 1 bit before any recomputes (which adds FLOPs) from a 2-bit input.
  assert ladder == (("save", None), ("compress", 8), ("compress", 4), ("compress", 2),
                    ("compress", 1), ("recompute_compressed", 2))
  walk = _search_over(sites, ladder).walk
  assert all(max(state) - min(state) <= 1 for state in walk), walk
  assert walk[-1] == (len(ladder) - 1,) * len(sites)      # every rung is taken
  with pytest.raises(ValueError, match="no value for the sites"):
    plan_lib.plan(tp.ThirdPartyResNet(), (X, Y), "1GiB", sensitivities={"conv_init": 1.0})

  model = tp.ThirdPartyResNet()
  rng = np.random.default_rng(0)
  batch = (rng.normal(size=(4,) + X.shape[1:]).astype(np.float32),
           rng.integers(0, 10, 4).astype(np.int32))
  optimizer = train.default_optimizer(1e-3, 100)
  loose = plan_lib.plan(model, (X, Y), "75%", max_batch=False, optimizer=optimizer,
                        calibration_batch=batch)
  assert any("measured at 2 bits on 4 examples" in n for n in loose.notes), loose.notes
  slopes = []                     # the undo step's line: (miss, plan) as (estimate, compiled)
  slope_of = _inputs._compiled_slope

  def recorded(miss, fit, *bounds):
    if not bounds:                             # the walk's steps pass their own bounds
      slopes.append((miss, fit))
    return slope_of(miss, fit, *bounds)
  monkeypatch.setattr(_search, "_compiled_slope", recorded)
  covered, prediction = [], _search._heap_prediction     # the heap layout's sites

  def recorded_prediction(heap, at, at_bytes, paths, ladder):
    covered.append({_search._site_of_codes(b, paths) for b in heap.buffers} - {None})
    return prediction(heap, at, at_bytes, paths, ladder)
  monkeypatch.setattr(_search, "_heap_prediction", recorded_prediction)
  known, undo_tries = [], _search._undo_tries       # what the tries know compiled

  def recorded_tries(*args):
    known.append((args[9](args[0]), args[1][0]))     # the plan's compiled bytes, as known
    return undo_tries(*args)
  monkeypatch.setattr(_search, "_undo_tries", recorded_tries)
  tight = plan_lib.plan(model, (X, Y), "60%", max_batch=False, optimizer=optimizer,
                        sensitivities={c.path: c.sensitivity for c in loose.choices})
  assert len(known) == 1 and known[0][0] == known[0][1], known
  # The undo tries are predicted from the plan's heap layout: every site the plan
  # compresses has its codes named there (a linen model's names carry its module paths).
  compressed = {i for i, c in enumerate(tight.choices) if c.kind == "compress"}
  assert covered and covered[0] == compressed, (covered, tight.table())
  # It runs through the walk's plan from the last compiled miss.
  (miss, fit) = slopes[0]                 # the first try's; the tries after it add theirs
  assert miss[0] > fit[0] and miss[1] > tight.budget_bytes >= fit[1], (miss, fit)
  assert fit[1] in [b for _, b, _ in tight.measured], tight.measured
  # The plan follows them: the stem's BatchNorm, the least sensitive, is compressed and has
  # no more bits than any other site. (Since the stem's inline ReLU and max pool keep a
  # mask and an index, `jmem.ops.actnn.between`, 60% is met with 8 bits at the three
  # compressed sites. The walk's order by sensitivity is asserted above, on two synthetic
  # sites; on this model at 56-58% the compiled plan lowers BottleneckBlock_0 below
  # bn_init, which is not asserted.)
  bits = {c.path: c.bits for c in tight.choices if c.bits is not None}
  sens = {c.path: c.sensitivity for c in tight.choices}
  assert min(sens, key=sens.get) == "bn_init", tight.table()
  assert "bn_init" in bits and bits["bn_init"] == min(bits.values()), tight.table()
  for p in (loose, tight):
    assert not any("no site's packed codes" in n for n in p.notes), p.notes
    assert all(c.sensitivity is not None and c.sensitivity >= 0 for c in p.choices)
    assert any(c.sensitivity > 0 for c in p.choices)
    assert "gradient sensitivity C" in p.table() and p.fits
  # On this path too: the reported peak is the planned model's compiled one, and a tighter
  # budget needs no fewer FLOPs.
  assert _device_bytes(jmem.convert(model, *tight.techniques), optimizer) == tight.device_bytes
  assert tight.flops >= loose.flops and tight.chosen > loose.chosen
  for bad in (batch[0], (batch[0][:, :8], batch[1]), (batch[0][:1], batch[1][:1]),
              (batch[0], batch[1][:, None])):
    with pytest.raises(ValueError, match="calibration_batch must be"):
      plan_lib.plan(model, (X, Y), "70%", calibration_batch=bad)
  with pytest.raises(ValueError, match="not both"):
    plan_lib.plan(model, (X, Y), "70%", calibration_batch=batch,
                  sensitivities={c.path: 1.0 for c in loose.choices})
  with pytest.raises(ValueError, match="finite"):
    plan_lib.plan(model, (X, Y), "70%", sensitivities={c.path: float("nan")
                                                       for c in loose.choices})


def test_bits_are_the_compression_rungs_and_the_recomputed_inputs():
  """``bits=`` keeps quantized values to some widths: the compress rungs are those, and
  recomputation is from a 2-bit input, or the fewest bits allowed above 1."""
  ladder = plan_lib.site_ladder
  assert ladder(None, True, (4, 8)) == (("save", None), ("compress", 8), ("compress", 4),
                                        ("recompute_compressed", 4))
  # NumPy integers are taken as Python ints (Policy takes no other).
  for given in (np.array([8, 4]), (np.int64(4), 8), {8, 4}, (b for b in (4, 8))):
    rungs = ladder(None, True, given)
    assert rungs == ladder(None, True, (4, 8)) and all(
        type(b) is int for _, b in rungs[1:]), rungs  # pylint: disable=unidiomatic-typecheck
  assert ladder(None, True, (8, 4, 2)) == ladder(None, True)[:4] + ladder(None, True)[5:]
  assert ladder(None, True, 1) == (("save", None), ("compress", 1),
                                   ("recompute_compressed", 1))
  assert ladder("recompute_compressed", True, (8, 1)) == (("save", None),
                                                          ("recompute_compressed", 8))
  for bad in ((), (3,), (2, 2), (True,), (np.True_,), (8.0, 4.0), 8.0, "8", [8, [4]],
              object()):
    with pytest.raises(ValueError, match=r"bits= \(--bits\) takes the bit widths"):
      ladder(None, True, bad)
  for policies, approximate, match in (
      (None, False, r"approximate=False \(--exact-only\) quantizes nothing: drop bits"),
      ("recompute", True, r"the policies allowed \(recompute\) quantize nothing")):
    with pytest.raises(ValueError, match=match):
      ladder(policies, approximate, (8,))


def test_the_top_rung_try_moves_only_sites_it_shrinks():
  """The one compile off the walk moves every site that saves anything to the top rung;
  after the walk's end missed (``smaller``), a plain recomputation above compression rungs
  only where it keeps less than the site's rung (a recomputed input can keep more than a
  block at 1 bit)."""
  # pylint: disable=protected-access
  sites = [_inputs._Site("a", residual_bytes=100.0, values=25.0, input_bytes=50.0,
                          input_values=50.0),
           _inputs._Site("b", residual_bytes=100.0, values=25.0, input_bytes=2.0),
           _inputs._Site("c", residual_bytes=0.0, input_bytes=2.0)]    # saves nothing
  ladder = plan_lib.site_ladder(("compress", "recompute"), True)
  one_bit, top = ladder.index(("compress", 1)), len(ladder) - 1
  assert ladder[top] == ("recompute", None)
  state = (one_bit, one_bit, 0)
  assert _search_over(sites, ladder).top_of(state) == (top, top, 0)
  assert _search_over(sites, ladder).top_of(state, smaller=True) == (one_bit, top, 0)
  # Recomputing from a 2-bit input (the default top) may compile smaller than estimated:
  # it is tried everywhere, though a's estimate keeps 14.8 bytes there against 3.9 at 1 bit;
  # from an 8-bit input (bits=(8, 1)) only where the estimate keeps less.
  ladder = plan_lib.site_ladder()
  assert _search_over(sites, ladder).top_of(state, smaller=True) == (len(ladder) - 1,) * 2 + (0,)
  ladder = plan_lib.site_ladder(bits=(8, 1))
  assert ladder[-1] == ("recompute_compressed", 8)
  top = len(ladder) - 1
  assert _search_over(sites, ladder).top_of((2, 2, 0), smaller=True) == (2, top, 0)
  assert _search_over(sites, ladder).top_of((2, 2, 0)) == (top, top, 0)


def _three_sites():
  """Three equal sites of sensitivity 1, 10 and 100, the default ladder (0 save, 1: 8 bits,
  2: 4 bits), and the estimated bytes a state keeps."""
  # pylint: disable=protected-access
  sites = [_inputs._Site(p, residual_bytes=4.0, values=1.0) for p in "abc"]
  ladder = plan_lib.site_ladder(None, True)
  kept = lambda state: sum(_inputs._kept(s, ladder[r])[0] for s, r in zip(sites, state))
  return sites, ladder, {"a": 1.0, "b": 10.0, "c": 100.0}, kept


def test_relaxing_undoes_the_reductions_the_budget_does_not_need():
  """After the walk, the bit reductions a budget does not need are undone, the one adding
  the most gradient variance first; save -> compress rungs (which add FLOPs) stay."""
  # pylint: disable=protected-access
  sites, ladder, sens, kept = _three_sites()
  budget = kept((2, 2, 1)) + 1e-9                        # room for one site at 8 bits
  assert _search_over(sites, ladder, sens).relax((2, 2, 2), lambda s: kept(s) <= budget) == \
      (2, 2, 1)                                          # c, the most sensitive, goes back
  assert _search_over(sites, ladder, sens).relax((1, 1, 1), lambda s: True) == (1, 1, 1)
  # ``least``: a reduction whose undoing takes off less than that share of the variance the
  # state adds is left (a: 1 of 111).
  assert _search_over(sites, ladder, sens).relax((2, 2, 2), lambda s: True, 0.05) == (2, 1, 1)
  assert _search_over(sites, ladder, sens).relax((2, 2, 2), lambda s: True, 0.005) == (1, 1, 1)
  # The undo step's line runs through the plan at the compiled slope from the last miss:
  # a compile that saved half the estimate's bytes leaves room for twice the estimate.
  assert _inputs._compiled_slope((10.0, 90.0), (2.0, 86.0)) == 0.5
  assert _inputs._compiled_slope((10.0, 90.0), (2.0, 89.9)) == 0.1      # at least 0.1
  assert _inputs._compiled_slope((10.0, 90.0), (2.0, 74.0)) == 2.0      # not capped at 1
  assert _inputs._compiled_slope((2.0, 90.0), (2.0, 86.0)) == 1.0       # no estimated drop


def test_undo_tries_follow_the_compiled_cost_of_undoing():
  """While compiles are left, the undoing goes on: after a try that fits, by the slope of
  what undoing cost compiled (a secant: cheaper than estimated, so more is undone); after
  one that misses, by the slope to it (steeper, so less is undone)."""
  # pylint: disable=protected-access
  sites, ladder, sens, kept = _three_sites()
  relax = _search_over(sites, ladder, sens).relax
  plan, undo = (2, 2, 2), kept((2, 2, 1)) - kept((2, 2, 2))     # 0.5 estimated per site

  def tries(true_slope, room, affordable=lambda s: True):
    cost = lambda s: plan_lib.Measured(100.0 + true_slope * (kept(s) - kept(plan)), 0.0)
    anchor = (kept(plan) + 10.0, 110.0)                # the walk's last miss: slope 1
    compiled = []
    state, at, notes = _search._undo_tries(
        plan, cost(plan), anchor, kept, relax, lambda s: compiled.append(s) or cost(s),
        affordable, 100.0 + room)
    return state, at.bytes, compiled, notes

  # Undoing costs a fifth of the estimate: slope 1 leaves room for c alone (0.5 of 0.6);
  # its compile costs 0.1, and at that slope a and b fit too (0.2 more).
  state, device_bytes, compiled, notes = tries(0.2, 1.2 * undo)
  assert compiled == [(2, 2, 1), (1, 1, 1)] and state == (1, 1, 1), (compiled, notes)
  assert device_bytes == pytest.approx(100.0 + 0.6 * undo) and len(notes) == 2
  # Undoing costs three times the estimate: all three (1.5 of 1.6) miss at 4.5; at the
  # slope to that miss, c alone (1.5).
  state, device_bytes, compiled, notes = tries(3.0, 3.2 * undo)
  assert compiled == [(1, 1, 1), (2, 2, 1)] and state == (2, 2, 1), (compiled, notes)
  assert "missed" in notes[0] and "fitted" in notes[1] and len(notes) == 2
  # No compile left: the plan stays, and the note says why.
  state, _, compiled, notes = tries(0.2, 1.2 * undo, affordable=lambda s: False)
  assert (state, compiled) == (plan, []) and "no compile left" in notes[0]


def test_undo_tries_take_the_heap_layouts_prediction_until_it_misses():
  """Where the plan's heap layout predicts a try, the prediction decides what is undone
  (not the estimate's line), a reduction of under 1% of the variance only in a try of its
  own once no other is predicted to fit; after a try it predicted misses, or where it
  predicts none to fit, the line does. A state compiled before is never tried again."""
  # pylint: disable=protected-access
  sites, ladder, sens, kept = _three_sites()
  relax = _search_over(sites, ladder, sens).relax
  plan, undo = (2, 2, 2), kept((2, 2, 1)) - kept((2, 2, 2))     # 0.5 estimated per site
  # Compiled: undoing c (the most sensitive) costs 5, b and a nothing (dead at the peak).
  truth = lambda s: 100.0 + 5.0 * (s[2] < 2)

  compiled = []                                      # the tries compiled, in order

  def tries(layout, truth=truth, known=lambda s: None):
    compiled.clear()
    state, at, notes = _search._undo_tries(
        plan, plan_lib.Measured(truth(plan), 0.0), (kept(plan) + 10.0, 110.0), kept, relax,
        lambda s: compiled.append(s) or plan_lib.Measured(truth(s), 0.0), lambda s: True,
        100.0 + 1.2 * undo, lambda at: layout, known)
    return state, at.bytes, list(compiled), notes

  # The estimate's line would undo c alone (0.5 of 0.6), which compiles 5 over. The layout
  # sees that c costs 5 and b nothing; a (under 1% of the variance) is left out of that
  # try, and tried alone after it. Then the layout has no undo fit, and the line's try (c)
  # spends the compile left, and misses.
  state, device_bytes, tried, notes = tries(truth)
  assert tried == [(2, 1, 2), (1, 1, 2), (1, 1, 1)] and state == (1, 1, 2), (tried, notes)
  assert device_bytes == 100.0 and "heap layout predicted to fit fitted" in notes[0]
  assert "fit (each under 1% of the gradient variance the plan adds) fitted" in notes[1]
  assert "predicted no undo to fit: the estimate's line was asked instead" in notes[2]
  assert "estimate did not need missed" in notes[3] and len(notes) == 4, notes
  # Where a costs 1 compiled, which the layout does not see, a's own try misses and the
  # plan keeps b's undo; the line, at the slope to that miss, undoes nothing more.
  state, device_bytes, tried, notes = tries(truth, lambda s: truth(s) + (s[0] < 2))
  assert tried == [(2, 1, 2), (1, 1, 2)] and state == (2, 1, 2), (tried, notes)
  assert device_bytes == 100.0 and "adds) missed the budget" in notes[1], notes
  # A state compiled before (a walk point) is known: no prediction overrides its bytes, so
  # a's undo, known to miss, is tried neither by the layout nor by the line after it.
  state, _, tried, notes = tries(truth, lambda s: truth(s) + (s[0] < 2),
                                 lambda s: 101.0 if s == (1, 1, 2) else None)
  assert tried[0] == (2, 1, 2) and (1, 1, 2) not in tried and state == (2, 1, 2), tried
  assert "line was asked instead" in notes[1], notes
  # A layout that calls everything free: its try (b and c) misses, and it is not asked
  # again; the line, at the slope to that miss (5 compiled for 1.0 estimated), undoes
  # nothing more.
  asked = []                                         # tries compiled when it is asked
  state, device_bytes, tried, notes = tries(lambda s: asked.append(len(compiled)) or 100.0)
  assert tried == [(2, 1, 1)] and state == plan and device_bytes == 100.0, (tried, notes)
  assert asked and max(asked) == 0 and "heap layout predicted to fit missed" in notes[0]
  # No layout for the plan (None): the line alone, as without one.
  state, _, tried, _ = tries(None)
  assert tried[0] == (2, 2, 1)


@pytest.mark.slow
def test_a_plan_says_where_the_heap_layout_names_no_sites_codes(monkeypatch):
  """NNX modules leave their paths out of the compiled step's names: the heap layout cannot
  be told site by site, and the plan says the undoing uses the per-site estimate alone."""
  model = tp.NNXCNN(rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  batch = (rng.normal(size=(4,) + X.shape[1:]).astype(np.float32),
           rng.integers(0, 10, 4).astype(np.int32))
  leasts, relax = [], _search.Search.relax
  monkeypatch.setattr(_search.Search, "relax", lambda self, state, fits, least=0.0: (
      leasts.append(least) or relax(self, state, fits, least)))
  # A budget halfway between every site at 8 bits and at 1 bit, compiled (XLA:CPU: 7.48 and
  # 6.88 MiB, exact 11.5): the walk must go below 8 bits, whatever the compiler's figures.
  optimizer = train.default_optimizer(1e-3, 100)
  at = lambda bits: plan_lib.step_cost(jmem.convert(tp.NNXCNN(rngs=nnx.Rngs(0)), jmem.Policy(
      "compress", bits=bits)), optimizer, X, Y)[0]
  p = plan_lib.plan(model, (X, Y), (at(8) + at(1)) // 2, max_batch=False,
                    calibration_batch=batch)
  assert p.fits and any(c.kind == "compress" and c.bits < 8 for c in p.choices), p.table()
  assert any("no site's packed codes are named" in n for n in p.notes), p.notes
  assert leasts and set(leasts) == {0.0}            # the estimate's tries, as without layouts


def _resnet8_at_64_with_calibration():
  """jmem's ResNet-8 at 16², a batch of 64 (shapes), and 4 calibration examples."""
  model = models.create_model("resnet8", 10)
  x = jax.ShapeDtypeStruct((64, 16, 16, 1), jnp.float32)
  y = jax.ShapeDtypeStruct((64,), jnp.int32)
  rng = np.random.default_rng(0)
  batch = (rng.normal(size=(4, 16, 16, 1)).astype(np.float32),
           rng.integers(0, 10, 4).astype(np.int32))
  return model, x, y, batch


@pytest.mark.slow
def test_a_backend_without_dumps_plans_on_the_estimate_and_says_so(monkeypatch):
  """Where the backend writes no buffer-assignment dump, the first walk compile finds out,
  the plan says so, and no other compile asks again."""
  from jmem import measure  # pylint: disable=g-import-not-at-top
  asked = []

  def no_dump(*args):
    asked.append(args)
    raise measure.DumpUnavailableError("no live-range dump here")
  monkeypatch.setattr(measure, "heap_layout", no_dump)
  model, x, y, batch = _resnet8_at_64_with_calibration()
  p = plan_lib.plan(model, (x, y), "40%", max_batch=False, calibration_batch=batch)
  assert len(asked) == 1 and p.compiles > 3, (len(asked), p.compiles)
  assert sum("heap layouts could not be read (no live-range dump here)" in n
             for n in p.notes) == 1, p.notes


def test_heap_prediction_resizes_the_codes_in_the_plans_heap_layout():
  """`_heap_prediction`: the packed codes of each site changed between two compression
  rungs, resized by the bits, and the heap placed again; codes dead at the same time share
  addresses, so undoing both of two sites costs what undoing one does."""
  # pylint: disable=protected-access
  from jmem import measure  # pylint: disable=g-import-not-at-top
  codes = lambda site: f"jit(step)/jvp(Converted.apply)/model/{site}/vmap(actnn_codes)/reduce_sum"
  buf = lambda name, size, a, b, op, shape="u8[100]": measure.HeapBuffer(
      name, size, 0, a, b, shape, op, "jit(step)/transpose(jvp(Converted.apply))/x")
  heap = measure.HeapLayout((
      buf("other", 320, 0, 9, "jit(step)/jvp(Converted.apply)/model/c/conv", "f32[80]"),
      buf("codes_a", 128, 0, 5, codes("a")), buf("codes_b", 128, 6, 9, codes("b")),
      buf("mask_a", 64, 0, 9, "jit(step)/jvp(Converted.apply)/model/a/reduce_sum"),
      # The quantizer's group minima (float) and a backward buffer are not codes.
      buf("minima_a", 64, 0, 9, codes("a").replace("reduce_sum", "reduce_min"), "f32[16]"),
      buf("grad_a", 64, 7, 9, codes("a").replace("jvp(", "transpose(jvp("))),
      measure.CompiledMemory(0, 0, 0, 0, 0, 0))
  assert [_search._site_of_codes(b, ["a", "b", "c"]) for b in heap.buffers] == \
      [None, 0, 1, None, None, None]
  ladder = plan_lib.site_ladder(None, True)              # 0 save, 1 8-bit, 2 4-bit
  # 320 + 64 + 64 live throughout, 64 from 7 on; a's codes (0-5) and b's (6-9) share 128
  # bytes above them: XLA's temp allocation, 640 bytes, placed so too.
  assert heap.simulate() == 640
  heap = dataclasses.replace(heap, memory=measure.CompiledMemory(640, 0, 0, 0, 0, 0))
  predict = _search._heap_prediction(heap, (2, 2, 2), 1000, ["a", "b", "c"], ladder)
  assert predict((2, 2, 2)) == 1000
  assert predict((2, 1, 2)) == predict((1, 1, 2)) == 1000 + 2 * 128 - 128
  assert predict((0, 2, 2)) is None                      # to save: not a bit change
  assert predict((2, 2, 1)) is None                      # c has no codes in the layout
  # Where XLA placed the same buffers in 40 bytes less (or more), a change is predicted
  # 40 bytes larger: the simulation's own error on the step is the prediction's slack.
  for temp in (600, 680):
    other = dataclasses.replace(heap, memory=measure.CompiledMemory(temp, 0, 0, 0, 0, 0))
    predict = _search._heap_prediction(other, (2, 2, 2), 1000, ["a", "b", "c"], ladder)
    assert predict((2, 2, 2)) == 1000 and predict((2, 1, 2)) == 1000 + 128 + 40
  # A layout naming no site's codes predicts nothing (the undo tries use the estimate).
  assert _search._heap_prediction(heap, (2, 2, 2), 1000, ["x", "y", "z"], ladder) is None


def test_the_walk_steps_by_the_compiled_slope_and_comes_back_to_the_fewest_reductions():
  """The next walk point: where a line through the last two compiled misses (compiled
  against predicted bytes) meets the budget, its slope clamped to [0.1, 1], but not into
  recomputation before the last point without it missed; once a point fits, where the
  line between the last miss and it does (regula falsi), or halfway where it meets none."""
  # pylint: disable=protected-access
  walk = list(range(11))
  estimate = lambda i: 100.0 - 10 * i                    # predicted bytes, 10 per point
  truth = {0: 100.0, 2: 96.0}                            # compiled: 2 per point, a fifth
  step = lambda misses, hi, budget, compiled=truth, stop=None: _search._next_point(
      walk, misses, hi, estimate, compiled.__getitem__, budget, stop)
  # The offset correction (slope 1) would try point 3 (96 - 10 = 86); the slope 0.2
  # reaches the budget of 90 three points past 2.
  assert step([0, 2], None, 90.0) == 5
  assert step([0, 2], None, 50.0) == 10                   # past the walk: its end
  # Recomputation from point 7 on: a step from before it stops at 6, and goes on once 6
  # missed too.
  assert step([0, 2], None, 50.0, stop=6) == 6
  assert step([0, 2], None, 90.0, stop=6) == 5
  assert step([0, 2, 6], None, 50.0, {**truth, 6: 88.0}, stop=6) == 10
  assert step([0, 2], None, 90.0, {0: 100.0, 2: 101.0}) == 10   # grew: slope 0.1, 13 > 10
  assert step([0, 2], None, 95.0, {0: 100.0, 2: 99.0}) == 6      # 0.05 clamped to 0.1 (10)
  assert step([0, 2], None, 45.0, {0: 100.0, 2: 60.0}) == 4     # slope 2 (3), clamped to 1
  # The line is through the last two misses, not exact: 2 -> 4 fell 8 (slope 0.4).
  assert step([0, 2, 4], None, 80.0, {**truth, 4: 88.0}) == 6    # 0 -> 4's 0.3: 7
  # A fit at 10 (60) after a miss at 2 (96): the line between says 4 (87) is within 90.
  assert step([0, 2], 10, 90.0, {**truth, 10: 60.0}) == 4
  # None between within it by the line: the point halfway, a compile that may find one.
  assert step([0, 2], 10, 50.0, {**truth, 10: 49.0}) == 6
  assert step([0, 2, 6], 10, 50.0, {**truth, 6: 70.0, 10: 49.0}) == 8
  assert step([0, 2], 10, 60.0, {**truth, 10: 0.0}) == 5         # slope 1.2, not clamped
  assert step([0, 2, 4], 10, 80.0, {**truth, 4: 88.0, 10: 60.0}) == 6   # a miss after a fit
  assert step([0, 2], 3, 90.0) is None                   # nothing between a miss and a fit
  assert step([0, 10], None, 50.0, {0: 100.0, 10: 60.0}) is None  # a miss at the end


def test_the_compiled_front_keeps_the_points_nothing_beats():
  """The plan's PNG draws the compiled steps' front: at each FLOPs, the fewest bytes."""
  # pylint: disable=protected-access
  points = [(1.0, 90.0), (1.02, 70.0), (1.02, 75.0), (1.05, 80.0), (1.08, 40.0), (1.0, 90.0)]
  assert _report._pareto(points) == [(1.0, 90.0), (1.02, 70.0), (1.08, 40.0)]
  assert _report._pareto([]) == []


def test_the_offload_note_names_the_platform_the_plan_compiles_for():
  """Offload is not searched, and the plan says why for its own platform: on CPU it saves
  nothing; elsewhere the walk's cost (FLOPs) counts none of its host transfers."""
  # pylint: disable=protected-access
  cpu = _inputs._offload_note(None)                 # the default backend's
  assert ("on CPU" in cpu) == (jax.default_backend() == "cpu"), cpu
  mesh_of = lambda platform: type("M", (), {"devices": np.array(
      [type("D", (), {"platform": platform})()])})()
  gpu = _inputs._offload_note(mesh_of("gpu"))
  assert "on CPU" not in gpu and gpu.startswith("offload not searched (gpu)")
  assert "host transfers" in gpu
  assert "on CPU" in _inputs._offload_note(mesh_of("cpu"))
  h100 = jmem.measure.target("h100")                 # compiled for a GPU from this CPU
  assert _inputs._offload_note(None, h100).startswith("offload not searched (gpu)")


@pytest.mark.slow
def test_offload_by_hand_beside_a_plans_policies():
  """What the refusal of policies=('offload',) advises: jmem.Policy('offload', where=...)
  beside a plan's techniques converts on a site the plan leaves at save, and its step's
  gradients match those of the plan's techniques alone (offload at full precision is exact);
  on a site the plan already has, the two policies are refused."""
  model = tp.FunctionalCNN()
  x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 16, 16, 1)), jnp.float32)
  y = jnp.arange(4) % 10
  base = jmem.convert(model, jmem.Remat())          # the model's sites, for their paths
  paths = sorted(p for ps in jmem.surgery.sites(base, x, train=True).values() for p in ps)
  assert len(paths) >= 2, paths
  choice = plan_lib.SiteChoice(paths[0], "compress", 8, 0.0, 0.0, None)
  planned = (choice.technique(),)                   # as Plan.techniques gives it
  by_hand = planned + (jmem.Policy("offload", where=re.escape(paths[1])),)
  grads = []
  for techniques in (planned, by_hand):
    fns = train.model_fns(jmem.convert(model, *techniques))
    params, model_state = fns.init(jax.random.key(0), x)

    def loss(params, fns=fns, model_state=model_state):
      logits, _ = fns.apply(params, model_state, x, train=True, rng=jax.random.key(1))
      return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))
    grads.append(jax.grad(loss)(params))
  assert jax.tree.structure(grads[0]) == jax.tree.structure(grads[1])
  for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  sites = jmem.surgery.sites(jmem.convert(model, *by_hand), x, train=True)
  assert sorted(p for ps in sites.values() for p in ps) == paths[:2], sites
  with pytest.raises(ValueError, match=re.escape(paths[0])):
    jmem.surgery.sites(jmem.convert(model, *planned, jmem.Policy("offload",
                                                                  where=re.escape(paths[0]))),
                       x, train=True)


@pytest.mark.slow
def test_off_the_cpu_the_planner_counts_the_lowered_steps_flops(monkeypatch):
  """On a GPU the compiled step's FLOPs leave out cuDNN and cuBLAS calls, so off the CPU
  every step the planner compiles (heap-layout compiles included) and `step_cost` hand
  `jmem.measure.step_flops` the lowered step: with the platform said to be a GPU, no step
  falls back to the compiled count (which warns), and the FLOPs are the lowered step's."""
  monkeypatch.setattr(jmem.measure._compiled, "_devices_of", lambda compiled: ("gpu", 1))
  monkeypatch.setattr(jmem.measure._compiled, "_WARNED_FLOPS", set())
  layouts, heap_layout = [], jmem.measure.heap_layout
  monkeypatch.setattr(jmem.measure, "heap_layout",
                      lambda *a: layouts.append(1) or heap_layout(*a))
  model, x, y, batch = _resnet8_at_64_with_calibration()
  optimizer = train.default_optimizer(1e-3, 10)
  step, args = plan_lib._train_step(model, optimizer, x, y)  # pylint: disable=protected-access
  low = step.lower(*args)
  lowered = jmem.measure._compiled._flops_of(low)  # pylint: disable=protected-access
  compiled = jmem.measure._compiled._flops_of(low.compile())  # pylint: disable=protected-access
  assert lowered != compiled                # so the figure below says which was taken
  with warnings.catch_warnings():
    warnings.filterwarnings("error", message=".*counts library calls")
    assert plan_lib.step_cost(model, optimizer, x, y)[1] == lowered
    # 85%: one walk point, compiled with its heap layout (a tighter budget compiles more
    # of the same kind of step, and took twice as long).
    p = plan_lib.plan(model, (x, y), "85%", max_batch=False, calibration_batch=batch)
  assert p.exact_flops == lowered and len(p.measured) >= 2, p.measured
  assert layouts, "no step was compiled with its heap layout: that path went untested"


def test_the_front_is_the_estimate_through_the_compiled_points():
  """Plan.front: compiled figures where a walk point was compiled; between two, bytes linear
  in the estimate through them and FLOPs corrected by theirs, interpolated; past the last,
  the line through the last two (slope within [0.1, 1]) and the last's FLOPs correction."""
  # pylint: disable=protected-access
  estimated = [(100.0, 1.0), (80.0, 2.0), (60.0, 3.0), (40.0, 4.0), (20.0, 5.0)]
  front = _report._calibrated(estimated, {0: (100, 1), 2: (80, 3.5)})
  assert front == ((100.0, 1.0), (90.0, 2.25), (80.0, 3.5), (70.0, 4.5), (60.0, 5.5))
  # Exact alone compiled: the estimate itself. A compile that saved more than estimated:
  # slope 1. Never below the floor (what does not grow with the batch).
  assert _report._calibrated(estimated[:2], {0: (100, 1)})[1] == (80.0, 2.0)
  assert _report._calibrated(estimated, {0: (100, 1), 1: (50, 2)})[2] == (30.0, 3.0)
  assert _report._calibrated(estimated, {0: (100, 1), 1: (50, 2)}, floor=15.0)[3:] == (
      (15.0, 4.0), (15.0, 5.0))
  assert _report._calibrated([(100.0, 1.0), (-20.0, 2.0)], {0: (100, 1)}) == (
      (100.0, 1.0), (0.0, 2.0))


@pytest.mark.slow
def test_plan_takes_where():
  """Issue 48, defect 3: jmem.plan raised NothingMatched '... Give where=' on a zoo's model
  but took no where=. It plans the sites ``where=`` names, and says when it names none."""
  model = tp.ThirdPartyResNet(stage_sizes=(1, 1, 1))
  with pytest.raises(jmem.surgery.NothingMatched, match=r"jmem.plan\(where='Block_.*\) matched no "
                                                         r"module call.*BottleneckBlock_0"):
    plan_lib.plan(model, (X, Y), "50%", where=r"Block_\d+")
  p = plan_lib.plan(model, (X, Y), "50%", where=r"BottleneckBlock_[01]", max_batch=False,
                    max_compiles=3, inplace_abn=False)
  assert {c.path for c in p.choices} == {"BottleneckBlock_0", "BottleneckBlock_1"}, p.table()


@pytest.mark.slow
def test_plan_cli_takes_where(tmp_path, capsys):
  """``jmem plan --where REGEX``: the sites it names are planned (and only they), and one
  naming no module is refused with the model's paths."""
  argv = ["plan", "--model", "resnet8", "--image-size", "16", "--batch-size", "8",
          "--budget", "90%", "--no-inplace-abn", "--max-compiles", "3", "--json",
          "--output-dir", str(tmp_path)]
  cli.main(argv + ["--where", "stage1_block1"])
  written = json.loads((tmp_path / "plan.json").read_text())
  assert {c["path"] for c in written["choices"]} == {"stage1_block1"}, written["choices"]
  capsys.readouterr()
  with pytest.raises(SystemExit) as exited:
    cli.main(argv + ["--where", "nomatch"])
  err = capsys.readouterr().err
  assert exited.value.code == 2 and "where='nomatch') matched no module call" in err, err
  assert "stage1_block1" in err, err
