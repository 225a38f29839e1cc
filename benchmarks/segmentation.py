"""High-resolution segmentation (the Mapillary use case): a U-Net at 1024 x 2048, batch 1,
compile-only. Exact against jmem's techniques and stacks on one device, then with the image
sharded over H x W of 8 devices (`jmem.Spatial`) on top.

Writes benchmarks/results/segmentation.{json,md}:

  python benchmarks/segmentation.py [--height 1024] [--width 2048] [--batch-size 1]

Each row compiles the whole train step (forward, backward, SGD update with the parameters,
BatchNorm statistics and optimiser state donated) and reports, per device, the temp bytes
(`memory_analysis().temp_size_in_bytes`: what the step needs beyond its arguments), the
argument bytes, their sum (the step's device memory), XLA's FLOPs (per device under
sharding) and the collectives of the compiled HLO. Compile-only on XLA:CPU; a GPU's
figures would come from running this script there (benchmarks/gpu.py has no segmentation
case yet).
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

# pylint: disable=g-import-not-at-top,wrong-import-position   (after the flags above)
import argparse
import time

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from _common import write_report
import jmem
from jmem import models

MIB = 2**20
NUM_CLASSES = 19


def stacks(model):
  stage = models.segmentation.UNetStage
  return {
      "exact": (),
      "remat (stages)": (jmem.Remat(),),
      "ActNN L3 (stages)": (jmem.ActNN("L3"),),
      "Remat + ActNN L3 (recompute from 2-bit stage inputs)": (jmem.Remat(where=stage),
                                                               jmem.ActNN("L3")),
  }


def train_step(model, optimizer):
  def step(params, batch_stats, opt_state, x, y):
    def loss(p):
      logits, upd = model.apply({"params": p, "batch_stats": batch_stats}, x,
                                mutable=["batch_stats"], rngs={"actnn": jax.random.key(0)})
      return models.pixel_cross_entropy(logits, y), upd["batch_stats"]
    (value, new_stats), grads = jax.value_and_grad(loss, has_aux=True)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), new_stats, opt_state, value
  return jax.jit(step, donate_argnums=(0, 1, 2))


def measure(model, techniques, x, y, mesh=None):
  converted = jmem.convert(model, *techniques) if techniques else model
  variables = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros(x.shape, x.dtype)))
  optimizer = optax.sgd(0.1, momentum=0.9)
  opt_state = jax.eval_shape(optimizer.init, variables["params"])
  args = [variables["params"], variables["batch_stats"], opt_state, x, y]
  if mesh is not None:
    replicated = NamedSharding(mesh, P())
    image = NamedSharding(mesh, P(None, "h", "w", None))
    put = lambda tree, s: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                                      sharding=s), tree)
    args = [put(a, replicated) for a in args[:3]] + [put(x, image),
                                                     put(y, NamedSharding(mesh, P(None, "h",
                                                                                  "w")))]
  t0 = time.time()
  compiled = train_step(converted, optimizer).lower(*args).compile()
  mem = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return dict(temp_mib=mem.temp_size_in_bytes / MIB,
              argument_mib=mem.argument_size_in_bytes / MIB,
              device_mib=(mem.temp_size_in_bytes + mem.argument_size_in_bytes) / MIB,
              flops=float(cost.get("flops", 0.0)),
              collectives=jmem.collective_counts(compiled.as_text()),
              compile_s=time.time() - t0)


def main():
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--height", type=int, default=1024)
  p.add_argument("--width", type=int, default=2048)
  p.add_argument("--batch-size", type=int, default=1)
  p.add_argument("--only", default="", help="comma-separated row names (default: all)")
  args = p.parse_args()
  model = models.UNet(NUM_CLASSES)
  b, h, w = args.batch_size, args.height, args.width
  x = jax.ShapeDtypeStruct((b, h, w, 3), jnp.float32)
  y = jax.ShapeDtypeStruct((b, h, w), jnp.int32)
  mesh = jax.make_mesh((2, 4), ("h", "w"), axis_types=(AxisType.Auto,) * 2)
  rows = []
  for name, techniques in stacks(model).items():
    if args.only and name not in args.only.split(","):
      continue
    for sharded in (False, True):
      ts = techniques + ((jmem.Spatial(mesh, axes=("h", "w")),) if sharded else ())
      row = dict(name=name, devices=8 if sharded else 1,
                 **measure(model, ts, x, y, mesh if sharded else None))
      rows.append(row)
      print(f"{name} on {row['devices']} device(s): temp {row['temp_mib']:.0f} MiB, device "
            f"{row['device_mib']:.0f} MiB, FLOPs {row['flops']:.3g} "
            f"({row['compile_s']:.0f} s)", flush=True)
  base = {r["devices"]: r for r in rows if r["name"] == "exact"}
  for r in rows:
    ref = base.get(r["devices"])
    if ref:
      r["temp_vs_exact"] = r["temp_mib"] / ref["temp_mib"]
      r["flops_vs_exact"] = r["flops"] / ref["flops"] if ref["flops"] else None
  lines = [f"# U-Net segmentation at {h}x{w}, batch {b}: per-device bytes, compile-only", "",
           f"Written by `benchmarks/segmentation.py` ({jax.default_backend()}, JAX "
           f"{jax.__version__}): `jmem.models.UNet({NUM_CLASSES})` (widths 32-512, five "
           "stages, BatchNorm), the whole SGD-momentum train step compiled with its "
           "arguments donated. Temp is what the step needs beyond its arguments (parameters, "
           "BatchNorm statistics, optimiser state, the image and its labels); device = temp "
           "+ arguments, per device. 8 devices: the image sharded 2 x 4 over H x W "
           "(`jmem.Spatial`), FLOPs per device; the ratios compare rows on the same number "
           "of devices.", "",
           "| technique / stack | devices | temp MiB | device MiB | temp / exact | "
           "FLOPs / exact | collective-permute | all-reduce | all-gather |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    c = r["collectives"]
    lines.append(f"| {r['name']} | {r['devices']} | {r['temp_mib']:.0f} | "
                 f"{r['device_mib']:.0f} | {r.get('temp_vs_exact', 0):.3f} | "
                 f"{(r.get('flops_vs_exact') or 0):.3f} | {c['collective-permute']} | "
                 f"{c['all-reduce']} | {c['all-gather']} |")
  write_report("segmentation", dict(height=h, width=w, batch_size=b, rows=rows,
                                    jax=jax.__version__, backend=jax.default_backend()),
               lines)


if __name__ == "__main__":
  main()
