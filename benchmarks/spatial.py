"""Spatially sharded ConvNeXt (halo exchange) against XLA's automatic partitioning.

Writes benchmarks/results/spatial.{json,md}. Runs on 8 simulated CPU devices:

  python benchmarks/spatial.py [--skip-xl]

Sections: (1) one k7 depthwise conv, forward + backward, W-sharded and HxW-sharded;
(2) a ConvNeXt-T stage-1 train step (3 blocks, dim 96); (3) weak scaling over 1, 2, 4, 8
devices; (4) compile-only per-device memory of ConvNeXt-XL on the seed's (7, 3, 512, 1024)
input. "auto" is the same unsharded step jit-compiled with the input sharded on W (XLA's
GSPMD/Shardy partitioner inserts the halos itself); "halo" is jmem's shard_map version.
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from _common import write_report  # noqa: E402
from jmem import measure, models, train  # noqa: E402
from jmem.parallel import spatial  # noqa: E402

MIB = 2**20


def _auto_mesh(shape):
  n = shape[0] * shape[1]
  return jax.make_mesh(shape, ("h", "w"), devices=jax.devices()[:n],
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _describe(f, *args):
  counts = measure.collective_counts(f, *args)
  return dict(collective_permute=counts["collective-permute"], all_reduce=counts["all-reduce"],
              all_gather=counts["all-gather"],
              temp_mib=measure.compiled_memory(f, *args).temp_bytes / MIB)


def conv_rows():
  rows = []
  x0 = jnp.asarray(jax.random.normal(jax.random.key(0), (8, 64, 256, 64)))
  w0 = jnp.full((7, 7, 1, 64), 0.02)
  loss = lambda x, w: jnp.sum(spatial.halo_conv_reference(x, w, feature_group_count=64) ** 2)
  single = measure.jit(jax.grad(loss, argnums=(0, 1)))
  single_temp = measure.compiled_memory(single, x0, w0).temp_bytes / MIB
  for shape in ((1, 8), (2, 4)):
    mesh = _auto_mesh(shape)
    spec = P(None, "h" if shape[0] > 1 else None, "w", None)
    x = jax.device_put(x0, NamedSharding(mesh, spec))
    w = jax.device_put(w0, NamedSharding(mesh, P()))
    auto = measure.jit(jax.grad(loss, argnums=(0, 1)))
    names = ("h" if shape[0] > 1 else None, "w")
    axes = tuple(a for a in names if a)

    def local(x, w):
      y = spatial.halo_conv(x, w, feature_group_count=64, axis_names=names)
      return jax.lax.psum(jnp.sum(y ** 2), axes)
    halo = measure.jit(jax.grad(jax.shard_map(local, mesh=mesh, in_specs=(spec, P()),
                                              out_specs=P()), argnums=(0, 1)))
    times = measure.time_steps({"auto": lambda: auto(x, w), "halo": lambda: halo(x, w)},
                               repeats=10, baseline="auto")
    err = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
              for a, b in zip(halo(x, w), single(x0, w0)))
    for name, f in (("auto", auto), ("halo", halo)):
      rows.append(dict(section="k7 depthwise conv fwd+bwd", mesh=f"{shape[0]}x{shape[1]}",
                       method=name, input=list(x0.shape), single_device_temp_mib=single_temp,
                       time_ratio_to_auto=times[name]["ratio"],
                       step_time_s=times[name]["median_s"],
                       max_rel_grad_error_vs_single=err if name == "halo" else None,
                       **_describe(f, x, w)))
  return rows


def _step_and_state(x_shape, fns, opt):
  state = train.init_state(fns, opt, jax.random.key(0),
                           jnp.zeros((1,) + x_shape[1:], jnp.float32))
  return train.make_train_step(fns, opt, donate=False), state


def stage_rows():
  """ConvNeXt-T stage 1 (3 blocks, dim 96) at 224/4 = 56 -> use 64x256 to split on 8."""
  model = models.ConvNeXt(depths=(3,), dims=(96,), num_classes=10, stem_patch=1)
  opt = optax.sgd(0.01)
  x0 = jax.random.normal(jax.random.key(1), (8, 64, 256, 3))
  y = jnp.arange(8) % 10
  fns = train.model_fns(model)
  step, state = _step_and_state(x0.shape, fns, opt)
  rows = []
  single_temp = measure.compiled_memory(step, state, x0, y).temp_bytes / MIB
  ref_state, _ = step(state, x0, y)
  for shape in ((1, 8), (2, 4)):
    mesh = _auto_mesh(shape)
    spec = P(None, "h" if shape[0] > 1 else None, "w", None)
    x = jax.device_put(x0, NamedSharding(mesh, spec))
    halo_step = train.make_train_step(
        spatial.spatial_model_fns(model, spatial.spatial_mesh(1, *shape,
                                                              devices=jax.devices()[:8])), opt,
        donate=False)
    got, _ = halo_step(state, x, y)
    err = max(float(jnp.max(jnp.abs(a - b))) for a, b in
              zip(jax.tree.leaves(got.params), jax.tree.leaves(ref_state.params)))
    times = measure.time_steps({"auto": lambda: step(state, x, y),
                                "halo": lambda: halo_step(state, x, y)},
                               repeats=5, baseline="auto")
    for name, f in (("auto", step), ("halo", halo_step)):
      rows.append(dict(section="ConvNeXt stage train step (3 blocks, dim 96)",
                       mesh=f"{shape[0]}x{shape[1]}", method=name, input=list(x0.shape),
                       single_device_temp_mib=single_temp,
                       time_ratio_to_auto=times[name]["ratio"],
                       step_time_s=times[name]["median_s"],
                       max_abs_param_error_vs_single=err if name == "halo" else None,
                       **_describe(f, state, x, y)))
  return rows


def weak_scaling_rows():
  model = models.ConvNeXt(depths=(3,), dims=(96,), num_classes=10, stem_patch=1)
  opt = optax.sgd(0.01)
  rows = []
  for n in (1, 2, 4, 8):
    x = jax.random.normal(jax.random.key(2), (4, 64, 64 * n, 3))
    y = jnp.arange(4) % 10
    mesh = spatial.spatial_mesh(1, 1, n, devices=jax.devices()[:n])
    fns = spatial.spatial_model_fns(model, mesh) if n > 1 else train.model_fns(model)
    step, state = _step_and_state(x.shape, fns, opt)
    t = measure.time_steps({"step": lambda: step(state, x, y)}, repeats=5, baseline="step")
    rows.append(dict(section="weak scaling (W = 64 per device)", devices=n,
                     input=list(x.shape), step_time_s=t["step"]["median_s"],
                     **_describe(step, state, x, y)))
  return rows


def xl_rows():
  """ConvNeXt-XL on (7, 3, 512, 1024): compile-only, per device, 1 vs 8 devices (1x8, 2x4)."""
  model = models.create_model("convnext-xl", 1000)
  opt = optax.sgd(0.01)
  x = jax.ShapeDtypeStruct((7, 512, 1024, 3), jnp.float32)
  y = jax.ShapeDtypeStruct((7,), jnp.int32)
  rows = []
  for label, fns in (("1 device", train.model_fns(model)),
                     ("8 devices, 1x8", spatial.spatial_model_fns(
                         model, spatial.spatial_mesh(1, 1, 8))),
                     ("8 devices, 2x4", spatial.spatial_model_fns(
                         model, spatial.spatial_mesh(1, 2, 4)))):
    abstract = jax.eval_shape(lambda k: train.init_state(fns, opt, k, jnp.zeros(
        (1, 32, 32, 3))), jax.random.key(0))
    step = train.make_train_step(fns, opt, donate=False)
    start = time.perf_counter()
    mem = measure.compiled_memory(step, abstract, x, y)
    rows.append(dict(section="ConvNeXt-XL (7,3,512,1024) compile-only", mesh=label,
                     temp_gib=mem.temp_bytes / 2**30,
                     argument_gib=mem.argument_bytes / 2**30,
                     compile_s=time.perf_counter() - start))
  return rows


def _table(rows):
  keys = [k for k in rows[0] if k != "section"]
  lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
  for r in rows:
    cells = []
    for k in keys:
      v = r.get(k)
      cells.append(f"{v:.3g}" if isinstance(v, float) else str(v))
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main():
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--skip-xl", action="store_true")
  args = p.parse_args()
  sections = [conv_rows(), stage_rows(), weak_scaling_rows()]
  if not args.skip_xl:
    sections.append(xl_rows())
  meta = dict(devices=jax.device_count(),
              note="8 simulated CPU devices on a 2-core machine: times are relative only")
  lines = ["# Spatially sharded ConvNeXt vs XLA automatic partitioning", ""]
  lines += [f"- {k}: {v}" for k, v in meta.items()]
  for rows in sections:
    lines += ["", f"## {rows[0]['section']}", "", _table(rows)]
  write_report("spatial", dict(meta=meta, sections=sections), lines)

if __name__ == "__main__":
  main()
