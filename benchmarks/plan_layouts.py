"""How `jmem.plan(devices=N)` lays N devices out, against every other layout: the exact train
step of the U-Net of issue 16 (at 512x1024, float32, to keep the 10 layouts' compiles
short) compiled on 8 devices as data x H x W, for a batch of 8 (every layout possible)
and a batch of 2 (data takes at most 2). Per device: device bytes, FLOPs and the
collectives in the compiled HLO; Spatial (`jmem.Spatial`) under the layouts that split H
or W, the batch split over the data axis with the train state replicated, as the planner
compiles them. Compile-only. Writes results/plan_layouts.{json,md}.

  python benchmarks/plan_layouts.py
"""

import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jmem  # noqa: E402
from jmem import measure, planner, train  # noqa: E402
from jmem.models.segmentation import UNet  # noqa: E402
from _common import write_report  # noqa: E402

LAYOUTS = tuple((d, h, 8 // d // h) for d in (8, 4, 2, 1) for h in (1, 2, 4, 8)
                if (8 // d) % h == 0)        # every data x H x W of 8 devices
SIDES = (512, 1024)


def _layout_cost(model, optimizer, x, y, shape):
  d, h, w = shape
  mesh = jax.make_mesh(shape, ("data", "h", "w"), axis_types=(AxisType.Auto,) * 3,
                       devices=jax.devices()[:8])
  axes = ("h" if h > 1 else None, "w" if w > 1 else None)
  data = "data" if d > 1 else None
  m = jmem.convert(model, jmem.Spatial(mesh, axes=axes, data_axis=data)) if h * w > 1 else model
  t0 = time.time()
  compiled = planner.compile_step(m, optimizer, x, y, mesh=mesh,
                                  specs=(P(data, *axes, None), P(data, *axes)))
  seconds = time.time() - t0
  device_bytes, flops = measure.device_bytes_and_flops(compiled)
  counts = measure.collective_counts(compiled.as_text())
  return dict(layout="x".join(map(str, shape)), device_bytes=device_bytes, flops=flops,
              collectives={k: v for k, v in counts.items() if v}, compile_seconds=seconds)


def main():
  optimizer = train.default_optimizer(1e-3, 100)
  model = UNet(19)
  data, md = {}, ["# How `jmem.plan(devices=8)` lays out 8 devices", "",
                  f"Written by `benchmarks/plan_layouts.py` ({jax.default_backend()}, JAX "
                  f"{jax.__version__}, compile-only, 2 CPU cores, 8 simulated devices). The "
                  f"exact train step of the U-Net (19 classes) at {SIDES[0]}x{SIDES[1]}, "
                  "float32, compiled as data x H x W (jmem.Spatial where H or W is split; "
                  "the batch over data; the train state replicated). Per device: device "
                  "bytes (arguments + outputs + temp), FLOPs (XLA's cost analysis), the "
                  "collectives in the compiled HLO.", ""]
  for batch in (8, 2):
    x = jax.ShapeDtypeStruct((batch, *SIDES, 3), jnp.float32)
    y = jax.ShapeDtypeStruct((batch, *SIDES), jnp.int32)
    rows = [_layout_cost(model, optimizer, x, y, s) for s in LAYOUTS if batch % s[0] == 0]
    # What the planner takes (a budget the exact step fits: the layout alone is chosen).
    t0 = time.time()
    result = planner.plan(model, (x, y), "100GiB", devices=8, optimizer=optimizer,
                          max_batch=False)
    seconds = time.time() - t0
    chosen = "x".join(str(result.mesh.shape.get(a, 1)) for a in ("data", "h", "w"))
    data[f"batch {batch}"] = dict(rows=rows, plan_devices_8=chosen, plan_seconds=seconds,
                                  plan_compiles=result.compiles, plan_notes=result.notes)
    md += [f"## Batch {batch}", "",
           "| data x H x W | MiB per device | GFLOPs per device | collectives | compile s |",
           "|---|---:|---:|---|---:|"]
    for r in rows:
      mark = " (jmem.plan(devices=8))" if r["layout"] == chosen else ""
      coll = ", ".join(f"{k} {v}" for k, v in sorted(r["collectives"].items())) or "none"
      md.append(f"| {r['layout']}{mark} | {r['device_bytes'] / 2**20:.0f} | "
                f"{r['flops'] / 1e9:.1f} | {coll} | {r['compile_seconds']:.0f} |")
    md += ["", f"`jmem.plan(devices=8)` takes {chosen}: {result.compiles} steps compiled, "
           f"{seconds:.0f} s.", ""]
  write_report("plan_layouts", data, md)


if __name__ == "__main__":
  main()
