"""`jmem.convert` on models jmem did not write: gradient agreement and memory.

Writes benchmarks/results/any_model.{json,md}:

  python benchmarks/any_model.py [--parts small,resnet50]

(1) small: every third-party model of tests/third_party_models.py (plain Flax: linen ResNet
with its own BatchNorm subclass and inline stem, linen CNN with functional activations and
a global mean, linen Sequential BN + leaky_relu/elu, linen ViT with Flax attention, NNX CNN,
NNX ViT) x every technique that applies: the gradient's largest deviation from the
unconverted model's (relative to its largest entry; InPlace-ABN with its scale mapping;
ActNN L3 one draw) and the whole train step's saved activation bytes and compiled temp bytes
against exact (compile-only, CPU).
(2) resnet50: the third-party ResNet-50 at 224x224, batch 16 and 32, exact / Remat / ActNN L3
via jmem.convert, and jmem's own ResNet-50 at L3 (``jmem.convert``, 2 bits, no
calibration) in the same run: temp ratio at batch 32, and the temp one more example costs
(slope between the two batches).
(3) sbp: jmem.SBP on third-party video models (a per-frame ResNet-8 with BatchNorm + temporal
transformer, and a ViT over the tokens of every frame): the whole step's temp bytes and
FLOPs at keep ratios 0.5 / 0.25 / 0.125 against exact (16 frames of 24x24, batch 32), and
the gradient's deviation from the stop_gradient oracle on small shapes.
(4) sbp-accuracy: the StT result of benchmarks/results/sbp_stt_pretrained.md with the
converted third-party model: its per-frame ResNet-8 pretrained on single frames, then exact
vs ``jmem.convert(model, jmem.SBP(keep_ratio=0.25, where=ResNetFrameEncoder))`` from the same
weights, seeds and steps (the frame CNN at 0.1x the learning rate). ``--seeds`` and
``--steps`` as given (default here: seed 0, 600 steps); seeds run apart with the same
settings are merged into one row (``--seeds 1,2`` after seed 0).

(5) spatial: jmem.Spatial on a 2 x 4 mesh of simulated CPU devices (H x W): ConvNeXt-T
(jmem's, 224x224, batch 8) and the third-party CNN with a global mean (128x128, batch 8),
the whole step under plain jit with the input sharded over H and W: collective-permutes,
all-reduces and temp bytes against XLA's own partitioning of the unconverted model, and the
loss/gradient deviation from one device (ConvNeXt-T at 64x64, batch 2).

Parts not run keep their rows from the last any_model.json.
"""

import json
import os
import sys
import time

# The spatial part needs 8 devices: simulated on CPU, set before jax starts.
if "host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.flatten_util import ravel_pytree

from _common import RESULTS, parser

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import third_party_models as tp  # pylint: disable=g-import-not-at-top,wrong-import-position

import jmem  # pylint: disable=g-import-not-at-top,wrong-import-position
from jmem import bench, data, models, surgery, train  # pylint: disable=wrong-import-position
from jmem.models import video  # pylint: disable=wrong-import-position
from jmem.ops import sbp as sbp_lib  # pylint: disable=wrong-import-position

MIB = 2**20


def _grads(model, params, state, x, y):
  fns = train.model_fns(model)
  loss = train.make_loss(fns)
  return ravel_pytree(jax.jit(jax.grad(lambda p: loss(p, state, x, y, jax.random.key(3))[0]))(
      params))[0]


SMALL = [  # name, builder, input shape, techniques
    ("linen ResNet (own BN subclass, inline stem)", lambda: tp.ThirdPartyResNet(
        stage_sizes=(1, 1, 1), num_filters=8), (8, 64, 64, 3),
     [jmem.Remat(), jmem.SyncBN(), jmem.ActNN("L0"), jmem.ActNN("L1"), jmem.ActNN("L2"),
      jmem.ActNN("L3")]),
    ("linen CNN (functional gelu/tanh, global mean)", tp.FunctionalCNN, (8, 32, 32, 3),
     [jmem.Remat(), jmem.SyncBN(), jmem.ActNN("L0"), jmem.ActNN("L3")]),
    ("linen Sequential BN + leaky_relu/elu", tp.SequentialABNCNN, (8, 32, 32, 3),
     [jmem.Remat(where="features"), jmem.SyncBN(), jmem.InPlaceABN(),
      jmem.ActNN("L3", where="features")]),
    ("linen ViT (nn.MultiHeadDotProductAttention)", lambda: tp.LinenViT(dim=32, depth=2),
     (8, 32, 32, 3), [jmem.Remat(where=r"block\d"), jmem.ActNN("L3", where=r"block\d")]),
    ("NNX CNN (nnx.Sequential BN + leaky_relu)", lambda: tp.NNXCNN(rngs=nnx.Rngs(0)),
     (8, 32, 32, 3), [jmem.Remat(), jmem.SyncBN(), jmem.InPlaceABN(where="stem/.*"),
                      jmem.ActNN("L3")]),
    ("NNX ViT (nnx.MultiHeadAttention)", lambda: tp.NNXViT(dim=32, rngs=nnx.Rngs(0)),
     (8, 32, 32, 3), [jmem.Remat(where=r"blocks/\d"), jmem.ActNN("L3", where=r"blocks/\d")]),
]


def small():
  rows = []
  opt = optax.sgd(0.1)
  for name, make, shape, techniques in SMALL:
    x = jax.random.normal(jax.random.key(0), shape)
    y = jnp.arange(shape[0]) % 10
    x_spec, y_spec = jax.ShapeDtypeStruct(shape, jnp.float32), jax.ShapeDtypeStruct(
        (shape[0],), jnp.int32)
    base = make()
    params, state = train.model_fns(base).init(jax.random.key(1), x[:1])
    g0 = _grads(base, params, state, x, y)
    saved0, temp0 = bench.step_memory(train.model_fns(base), opt, x_spec, y_spec)
    rows.append(dict(model=name, technique="exact", grad_max_rel_dev=0.0, saved_bytes=saved0,
                     temp_bytes=temp0, saved_ratio=1.0, temp_ratio=1.0))
    for t in techniques:
      model = jmem.convert(make(), t)
      given = params
      if isinstance(t, jmem.InPlaceABN):
        paths = next(iter(surgery.sites(model, x).values())) if not isinstance(
            model, nnx.Module) else surgery.sites(model)["abn"]
        given = surgery.inplace_abn_params(params, paths)
      g1 = _grads(model, given, state, x, y)
      dev = float(jnp.max(jnp.abs(g1 - g0)) / jnp.max(jnp.abs(g0)))
      saved, temp = bench.step_memory(train.model_fns(model), opt, x_spec, y_spec)
      label = type(t).__name__ + (f"({t.level})" if isinstance(t, jmem.ActNN) else "")
      rows.append(dict(model=name, technique=label, where=None if t.where is None else
                       str(t.where), grad_max_rel_dev=dev, saved_bytes=saved, temp_bytes=temp,
                       saved_ratio=saved / saved0, temp_ratio=temp / temp0))
      print(f"{name:48s} {label:12s} dev {dev:.1e} saved {saved / saved0:.3f} "
            f"temp {temp / temp0:.3f}", flush=True)
  return rows


def resnet50():
  rows = []
  opt = optax.sgd(0.1)
  third = tp.resnet50(1000)
  own = models.create_model("resnet50", 1000)
  cases = [("third-party ResNet-50", "exact", third),
           ("third-party ResNet-50", "Remat (jmem.convert)", jmem.convert(third, jmem.Remat())),
           ("third-party ResNet-50", "ActNN L3 (jmem.convert)",
            jmem.convert(third, jmem.ActNN("L3"))),
           ("jmem ResNet-50", "exact", own),
           ("jmem ResNet-50", "ActNN L3 (jmem.convert)", jmem.convert(own, jmem.ActNN("L3")))]
  for model_name, label, model in cases:
    temps = {}
    for b in (16, 32):
      t0 = time.time()
      saved, temp = bench.step_memory(train.model_fns(model), opt,
                                      jax.ShapeDtypeStruct((b, 224, 224, 3), jnp.float32),
                                      jax.ShapeDtypeStruct((b,), jnp.int32))
      temps[b] = (saved, temp, time.time() - t0)
    rows.append(dict(model=model_name, technique=label, saved_bytes_b32=temps[32][0],
                     temp_bytes_b32=temps[32][1], temp_bytes_b16=temps[16][1],
                     temp_per_example=(temps[32][1] - temps[16][1]) / 16,
                     compile_s=temps[32][2]))
    print(f"{model_name:24s} {label:26s} saved {temps[32][0] / MIB:8.1f} MiB temp "
          f"{temps[32][1] / MIB:8.1f} MiB per-example {rows[-1]['temp_per_example'] / MIB:.1f} "
          f"MiB ({temps[32][2]:.0f} s)", flush=True)
  for r in rows:
    ex = next(e for e in rows if e["model"] == r["model"] and e["technique"] == "exact")
    r["saved_ratio"] = r["saved_bytes_b32"] / ex["saved_bytes_b32"]
    r["temp_ratio"] = r["temp_bytes_b32"] / ex["temp_bytes_b32"]
    r["max_batch_x"] = ex["temp_per_example"] / r["temp_per_example"]
  return rows


def _step_cost(model, x, y):
  """Temp bytes and FLOPs of the compiled train step (SGD) of a linen ``model``."""
  fns = train.model_fns(model)
  params, state = jax.eval_shape(lambda: fns.init(jax.random.key(0), x[:1]))
  loss = train.make_loss(fns)
  step = jax.jit(jax.grad(lambda p, s, x, y: loss(p, s, x, y, jax.random.key(3))[0]))
  compiled = step.lower(params, state, x, y).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return compiled.memory_analysis().temp_size_in_bytes, cost["flops"]


def _oracle_deviation(model, site, keep_ratio, x, y):
  """max |g_sbp - g_oracle| / max |g_oracle|: the oracle is plain autodiff with the dropped
  nodes' outputs and every BatchNorm's statistics under stop_gradient."""
  variables = model.init(jax.random.key(1), x)
  state = {k: v for k, v in variables.items() if k != "params"}
  key = jax.random.key(5)
  drawn = {}

  def oracle(next_fun, args, kwargs, context):
    mod = context.module
    if context.method_name == "__call__" and isinstance(mod, nn.BatchNorm):
      xx = args[0]
      axes = tuple(range(xx.ndim - 1))
      mean = jax.lax.stop_gradient(jnp.mean(xx, axes))
      var = jax.lax.stop_gradient(jnp.mean(jnp.square(xx - mean), axes))
      return ((xx - mean) * jax.lax.rsqrt(var + mod.epsilon) *
              mod.get_variable("params", "scale") + mod.get_variable("params", "bias"))
    if context.method_name == "__call__" and isinstance(mod, site):
      drawn.setdefault("key", mod.make_rng("sbp"))
      idx = sbp_lib.sample_indices(drawn["key"], args[0], keep_ratio=keep_ratio, axis=1)
      return sbp_lib.core._hold_dropped(next_fun(*args, **kwargs), idx, 1)  # pylint: disable=protected-access
    return next_fun(*args, **kwargs)

  def grads(m, intercept=None):
    def f(p):
      out, _ = m.apply({"params": p, **state}, x, mutable=list(state), rngs={"sbp": key})
      return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(out), y[:, None], 1))
    if intercept is None:
      return ravel_pytree(jax.grad(f)(variables["params"]))[0]
    with nn.intercept_methods(intercept):
      return ravel_pytree(jax.grad(f)(variables["params"]))[0]

  g = grads(jmem.convert(model, jmem.SBP(keep_ratio=keep_ratio, where=site)))
  g_ref = grads(model, oracle)
  return float(jnp.max(jnp.abs(g - g_ref)) / jnp.max(jnp.abs(g_ref)))


SBP_MODELS = [  # name, model, site
    ("StT: per-frame ResNet-8 (BatchNorm) + temporal transformer", tp.ThirdPartyStT,
     tp.ResNetFrameEncoder),
    ("ViT over the tokens of every frame (nn.MultiHeadDotProductAttention)",
     lambda: tp.FrameTokenViT(dim=64, depth=4, heads=4, num_classes=40), tp.ViTBlock),
]


def sbp_memory():
  rows = []
  x = jnp.zeros((32, 16, 24, 24, 1))
  y = jnp.zeros((32,), jnp.int32)
  small_x = jax.random.normal(jax.random.key(0), (2, 8, 24, 24, 1))
  small_y = jnp.array([1, 3])
  for name, make, site in SBP_MODELS:
    temp0, flops0 = _step_cost(make(), x, y)
    rows.append(dict(model=name, technique="exact", temp_bytes=temp0, flops=flops0,
                     temp_ratio=1.0, flops_ratio=1.0, oracle_dev=0.0))
    for r in (0.5, 0.25, 0.125):
      temp, flops = _step_cost(jmem.convert(make(), jmem.SBP(keep_ratio=r, where=site)), x, y)
      dev = _oracle_deviation(make(), site, r, small_x, small_y)
      rows.append(dict(model=name, technique=f"SBP({r})", where=site.__name__,
                       temp_bytes=temp, flops=flops, temp_ratio=temp / temp0,
                       flops_ratio=flops / flops0, oracle_dev=dev))
      print(f"{name[:40]:40s} SBP({r}) temp {temp / temp0:.3f} flops {flops / flops0:.3f} "
            f"oracle dev {dev:.1e}", flush=True)
  return rows


def sbp_accuracy(seeds, steps, train_clips=8192, learning_rate=2e-3, pretrain_steps=1000,
                 test_clips=256):
  clips = data.moving_digits(16, frame_size=24, digit_size=8, num_train=train_clips,
                             num_test=test_clips)
  frames = data.frames_of(clips)
  t0 = time.perf_counter()
  pre = train.train(tp.FramePretrainer(num_classes=frames.num_classes), frames,
                    train.TrainConfig(steps=pretrain_steps, batch_size=128, seed=0,
                                      progress=False))
  pretrain_s = time.perf_counter() - t0
  initial = {"frames": pre.state.params["frames"]}
  rows = []
  base = tp.ThirdPartyStT(num_classes=clips.num_classes)
  for label, model in (("exact", base), ("SBP(0.25) via jmem.convert", jmem.convert(
      base, jmem.SBP(keep_ratio=0.25, where=tp.ResNetFrameEncoder)))):
    accs, secs = [], []
    for seed in seeds:
      opt = video.spatial_lr_scale(train.default_optimizer(learning_rate, steps), 0.1,
                                   ("frames",))
      t0 = time.perf_counter()
      res = train.train(model, clips, train.TrainConfig(steps=steps, batch_size=32, seed=seed,
                                                        progress=False),
                        optimizer=opt, initial_params=initial)
      secs.append(time.perf_counter() - t0)
      accs.append(res.test_accuracy)
      print(f"third-party StT {label} seed {seed}: {100 * accs[-1]:.2f}% ({secs[-1]:.0f} s)",
            flush=True)
    rows.append(dict(technique=label, accuracy=sum(accs) / len(accs), accuracy_per_seed=accs,
                     train_seconds_per_seed=secs))
  rows[1]["accuracy_minus_exact"] = rows[1]["accuracy"] - rows[0]["accuracy"]
  meta = dict(seeds=list(seeds), steps=steps, batch_size=32, train_clips=train_clips,
              test_clips=test_clips, learning_rate=learning_rate, frames_lr_scale=0.1,
              pretrain=f"ResNetFrameEncoder + linear head on one frame per training clip "
                       f"(digit labels), {pretrain_steps} steps, batch 128, seed 0; "
                       f"{pretrain_s:.0f} s; frame test accuracy "
                       f"{100 * pre.test_accuracy:.2f}%")
  return dict(meta=meta, rows=rows)


def _merge_seeds(old, new):
  """Adds the seeds of an earlier sbp-accuracy run with the same settings to ``new``.

  The pretraining is seeded (seed 0) and deterministic, so seeds run apart share it; a seed
  run again replaces its earlier figure.
  """
  settings = ("steps", "batch_size", "train_clips", "test_clips", "learning_rate",
              "frames_lr_scale")
  if not old or any(old["meta"].get(k) != new["meta"].get(k) for k in settings):
    return new
  rows = []
  for o, n in zip(old["rows"], new["rows"]):
    per = dict(zip(old["meta"]["seeds"], zip(o["accuracy_per_seed"],
                                             o["train_seconds_per_seed"])))
    per.update(zip(new["meta"]["seeds"], zip(n["accuracy_per_seed"],
                                             n["train_seconds_per_seed"])))
    seeds = sorted(per)
    accs = [per[s][0] for s in seeds]
    rows.append(dict(technique=n["technique"], accuracy=sum(accs) / len(accs),
                     accuracy_per_seed=accs, train_seconds_per_seed=[per[s][1] for s in seeds]))
  rows[1]["accuracy_minus_exact"] = rows[1]["accuracy"] - rows[0]["accuracy"]
  return dict(meta=dict(new["meta"], seeds=seeds), rows=rows)


def _spatial_step(model, y, x, **kw):
  variables = jax.eval_shape(lambda x: model.init(jax.random.key(1), x), x)
  state = [k for k in variables if k != "params"]

  def loss(params, rest, x):
    out = model.apply({"params": params, **rest}, x, mutable=state, **kw)[0]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(out), y[:, None], 1))
  return jax.jit(jax.value_and_grad(loss)), variables


def spatial():
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  meshes = {s: jax.make_mesh(s, ("h", "w"), axis_types=(AxisType.Auto,) * 2,
                             devices=jax.devices()[:s[0] * s[1]]) for s in ((2, 2), (2, 4))}
  mesh = meshes[(2, 4)]
  put = lambda a: jax.device_put(a, NamedSharding(mesh, P(None, "h", "w", None)))
  rows = []
  convnext_kw = dict(train=True, rngs={"dropout": jax.random.key(2)})
  cases = [("ConvNeXt-T (jmem's)", lambda: models.convnext("convnext-t", 1000), 224,
            convnext_kw, (2, 2)),
           ("ConvNeXt-T (jmem's)", lambda: models.convnext("convnext-t", 1000), 224,
            convnext_kw, (2, 4)),
           ("third-party CNN (BatchNorm, functional activations, global mean)",
            tp.FunctionalCNN, 128, {}, (2, 4))]
  for name, make, size, kw, shape in cases:
    mesh = meshes[shape]
    x = jax.ShapeDtypeStruct((8, size, size, 3), jnp.float32,
                             sharding=NamedSharding(mesh, P(None, "h", "w", None)))
    y = jnp.zeros((8,), jnp.int32)
    for label, model in (("XLA partitioning (unconverted, input sharded)", make()),
                         ("jmem.Spatial", jmem.convert(make(), jmem.Spatial(mesh)))):
      step, variables = _spatial_step(model, y, x, **kw)
      rest = {k: v for k, v in variables.items() if k != "params"}
      t0 = time.time()
      compiled = step.lower(variables["params"], rest, x).compile()
      counts = jmem.collective_counts(compiled.as_text())
      rows.append(dict(model=name, technique=label, image=size, mesh=f"{shape[0]}x{shape[1]}",
                       collective_permutes=counts["collective-permute"],
                       all_reduces=counts["all-reduce"], all_gathers=counts["all-gather"],
                       temp_bytes=compiled.memory_analysis().temp_size_in_bytes,
                       compile_s=time.time() - t0))
      print(f"{name[:30]:30s} {label[:24]:24s} permutes {counts['collective-permute']} "
            f"all-reduce {counts['all-reduce']} temp {rows[-1]['temp_bytes'] / MIB:.1f} MiB",
            flush=True)
  # Exactness: ConvNeXt-T 64 x 64 run on one device and sharded (2 x 4: stages of 16, 8,
  # 4 and 2 wide, the last one uneven over 4 devices).
  mesh = meshes[(2, 4)]
  model = models.convnext("convnext-t", 10)
  x = jax.random.normal(jax.random.key(0), (2, 64, 64, 3))
  y = jnp.arange(2)
  kw = dict(train=True, rngs={"dropout": jax.random.key(2)})
  variables = model.init(jax.random.key(1), x)
  step0, _ = _spatial_step(model, y, x, **kw)
  step1, _ = _spatial_step(jmem.convert(model, jmem.Spatial(mesh)), y, x, **kw)
  loss0, g0 = step0(variables["params"], {}, x)
  loss1, g1 = step1(variables["params"], {}, put(x))
  a, b = ravel_pytree(g1)[0], ravel_pytree(g0)[0]
  exact = dict(model="ConvNeXt-T (jmem's), 64x64, batch 2", loss_rel_dev=float(
      abs(loss1 - loss0) / abs(loss0)), grad_max_rel_dev=float(
          jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))))
  print(exact, flush=True)
  return dict(rows=rows, exactness=exact)


def _markdown(small_rows, r50_rows, sbp_rows=(), sbp_acc=None, spatial_res=None):
  out = ["# jmem.convert on models jmem did not write", "",
         "Written by `benchmarks/any_model.py` (CPU, compile-only memory of the whole train "
         "step: SGD update included). Models: `tests/third_party_models.py`, plain Flax.", ""]
  if small_rows:
    out += ["## Every model x technique (small shapes)", "",
            "Gradient deviation: max |g - g_plain| / max |g_plain| over all parameters "
            "(exact techniques must be float32 rounding; ActNN L3 is one stochastic draw). "
            "Ratios are against the same model's exact step.", "",
            "| model | technique | where | grad max rel. dev. | saved ratio | temp ratio |",
            "|---|---|---|---:|---:|---:|"]
    for r in small_rows:
      out.append(f"| {r['model']} | {r['technique']} | {r.get('where') or 'default'} | "
                 f"{r['grad_max_rel_dev']:.1e} | {r['saved_ratio']:.3f} | "
                 f"{r['temp_ratio']:.3f} |")
    out.append("")
  if r50_rows:
    out += ["## ResNet-50, 224x224 (temp at batch 32; per example: slope 16 -> 32)", "",
            "| model | technique | saved (MiB) | saved ratio | temp (MiB) | temp ratio | "
            "temp / example (MiB) | max batch x |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in r50_rows:
      out.append(f"| {r['model']} | {r['technique']} | {r['saved_bytes_b32'] / MIB:.1f} | "
                 f"{r['saved_ratio']:.3f} | {r['temp_bytes_b32'] / MIB:.1f} | "
                 f"{r['temp_ratio']:.3f} | {r['temp_per_example'] / MIB:.1f} | "
                 f"{r['max_batch_x']:.2f} |")
    out.append("")
    third = {r["technique"]: r for r in r50_rows if r["model"] == "third-party ResNet-50"}
    own = [r for r in r50_rows if r["model"] == "jmem ResNet-50" and r["technique"] != "exact"]
    l3 = third.get("ActNN L3 (jmem.convert)")
    if l3 is not None and own:
      out += [f"ActNN L3 through `jmem.convert` on the third-party ResNet-50 keeps "
              f"{l3['temp_ratio']:.3f}x the exact step's temp memory; jmem's own ResNet-50 "
              f"at L3 (its block hooks, same bits, same run) keeps {own[0]['temp_ratio']:.3f}x. "
              "The converted model's saved bytes are higher (its inline stem - relu, max "
              "pool - is not inside a site and stays float32) but its peak is lower.", ""]
  if sbp_rows:
    out += ["## SBP (jmem.SBP), 16 frames of 24x24, batch 32", "",
            "Temp bytes and FLOPs of the whole compiled step (forward + backward) against the "
            "same model's exact step. Oracle deviation: max |g - g_oracle| / max |g_oracle| "
            "on small shapes, the oracle being plain autodiff with the dropped nodes' outputs "
            "and the BatchNorm statistics under stop_gradient.", "",
            "| model | technique | where | temp (MiB) | temp ratio | FLOPs ratio | "
            "oracle dev. |", "|---|---|---|---:|---:|---:|---:|"]
    for r in sbp_rows:
      out.append(f"| {r['model']} | {r['technique']} | {r.get('where') or '-'} | "
                 f"{r['temp_bytes'] / MIB:.1f} | {r['temp_ratio']:.3f} | "
                 f"{r['flops_ratio']:.3f} | {r['oracle_dev']:.1e} |")
    out.append("")
  if sbp_acc:
    meta, rows = sbp_acc["meta"], sbp_acc["rows"]
    with open(os.path.join(RESULTS, "sbp_stt_pretrained.json")) as f:
      own = {r["technique"]: r for r in json.load(f)["rows"]}
    exact, sbp = own["exact"]["accuracy"], own["sbp-0.25"]["accuracy"]
    out += ["## SBP accuracy: the third-party StT from a pretrained per-frame CNN", "",
            "The setting of `benchmarks/results/sbp_stt_pretrained.md` (jmem's own StT: exact "
            f"{100 * exact:.2f}%, SBP 0.25 {100 * sbp:.2f}%, {100 * (sbp - exact):+.2f} points "
            "over seeds 0, 1, 2) with "
            "`tests/third_party_models.ThirdPartyStT` (BatchNorm in its frame CNN) converted by "
            "`jmem.convert`.", ""]
    out += [f"- {k}: {v}" for k, v in meta.items()]
    out += ["", "| technique | test accuracy (mean) | per seed | train s / seed |",
            "|---|---:|---|---:|"]
    for r in rows:
      out.append(f"| {r['technique']} | {100 * r['accuracy']:.2f}% | "
                 f"{', '.join(f'{100 * a:.2f}' for a in r['accuracy_per_seed'])} | "
                 f"{sum(r['train_seconds_per_seed']) / len(r['train_seconds_per_seed']):.0f} |")
    out += ["", f"SBP minus exact: {100 * rows[1]['accuracy_minus_exact']:+.2f} points.", ""]
  if spatial_res:
    out += ["## Spatial (jmem.Spatial): H x W device meshes, whole step under jit", "",
            "The input is a global array sharded over H and W; XLA partitions the unconverted "
            "model by itself, `jmem.Spatial` replaces its convolutions by halo exchange in a "
            "nested shard_map (compile-only, simulated CPU devices, batch 8). ConvNeXt-T at "
            "224 on 2 x 4: in stages 3 and 4 (counted from 1; 14 and 7 wide) W does not split "
            "evenly over 4 devices, and jmem pads those blocks to XLA's own layout (4 and 2 "
            "per device).", "",
            "| model | image | mesh | partitioning | collective-permutes | all-reduces | "
            "all-gathers | temp (MiB) |", "|---|---:|---|---|---:|---:|---:|---:|"]
    for r in spatial_res["rows"]:
      out.append(f"| {r['model']} | {r['image']} | {r.get('mesh', '2x4')} | {r['technique']} | "
                 f"{r['collective_permutes']} | {r['all_reduces']} | {r['all_gathers']} | "
                 f"{r['temp_bytes'] / MIB:.1f} |")
    e = spatial_res["exactness"]
    out += ["", f"Against one device ({e['model']}): loss deviation {e['loss_rel_dev']:.1e}, "
            f"gradient max deviation {e['grad_max_rel_dev']:.1e} (relative to the largest "
            "entry).", ""]
  return "\n".join(out)


def main():
  p = parser(__doc__)
  p.set_defaults(seeds=(0,), steps=600)
  p.add_argument("--parts", default="small,resnet50,sbp,spatial")
  p.add_argument("--markdown-only", action="store_true",
                 help="rewrite any_model.md from any_model.json without measuring")
  args = p.parse_args()
  path = os.path.join(RESULTS, "any_model.json")

  def load():
    if not os.path.exists(path):
      return {}
    with open(path) as f:
      return json.load(f)
  saved = load()
  if not args.markdown_only:
    parts = args.parts.split(",")
    measured = {}
    for part, run in (("small", small), ("resnet50", resnet50), ("sbp", sbp_memory),
                      ("sbp-accuracy", lambda: sbp_accuracy(args.seeds, args.steps)),
                      ("spatial", spatial)):
      if part in parts:
        measured[part.replace("-", "_")] = run()
    saved = load()  # read again: another run may have written other parts meanwhile
    for key, res in measured.items():
      saved[key] = _merge_seeds(saved.get(key), res) if key == "sbp_accuracy" else res
    saved.update(jax=jax.__version__, backend=jax.default_backend())
    os.makedirs(RESULTS, exist_ok=True)
    with open(path, "w") as f:
      json.dump(saved, f, indent=1)
  md = _markdown(saved.get("small", []), saved.get("resnet50", []), saved.get("sbp", []),
                 saved.get("sbp_accuracy"), saved.get("spatial"))
  with open(os.path.join(RESULTS, "any_model.md"), "w") as f:
    f.write(md)
  print(md)


if __name__ == "__main__":
  main()
