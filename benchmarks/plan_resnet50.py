"""`jmem.plan` on ResNet-50 224x224 (float32, compile-only): budgets of 16 and 8 GiB at
several batch sizes, against the single uniform techniques that also fit (issue 17).

For each (budget, batch): the plan (its compiled device bytes, FLOPs against exact, the
compiles it made and its wall time on this machine) and each uniform technique (ActNN's
8, 4 or 2 bits everywhere, remat, recompute from a 2-bit input) compiled at the same batch: does
it fit, at what FLOPs. The plan must fit and need no more FLOPs than the cheapest uniform
technique that fits. The planner gets 16 digits (resized to 224x224, 3 channels) as its
calibration batch: plan time includes measuring the sites' gradient sensitivity. Writes
results/plan_resnet50.{json,md}. With ``--data N`` the batch is split over N (simulated)
devices, ``jmem.plan(..., mesh=, data_axis=)``, every figure per device: writes
results/plan_resnet50_data{N}.{json,md}.

  python benchmarks/plan_resnet50.py [--cases 16GiB:256,16GiB:512,8GiB:128,8GiB:256]
  python benchmarks/plan_resnet50.py --data 8 --cases 2GiB:256
"""

import argparse
import os
import re
import sys
import time

_DATA = re.search(r"--data[= ](\d+)", " ".join(sys.argv))
if _DATA and "host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +   # before jax starts
                             f" --xla_force_host_platform_device_count={_DATA.group(1)}")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jmem  # noqa: E402
from jmem import data, models, planner as plan_lib, train  # noqa: E402
from _common import write_report  # noqa: E402

GIB = 2**30
UNIFORM = {
    "ActNN 8-bit everywhere (Policy compress)": lambda m: jmem.convert(
        m, jmem.Policy("compress", bits=8)),
    "ActNN 4-bit everywhere (Policy compress)": lambda m: jmem.convert(
        m, jmem.Policy("compress", bits=4)),
    "ActNN 2-bit everywhere (Policy compress)": lambda m: jmem.convert(
        m, jmem.Policy("compress", bits=2)),
    "remat (Policy recompute)": lambda m: jmem.convert(m, jmem.Policy("recompute")),
    "recompute-2bit": lambda m: jmem.convert(m, jmem.Policy("recompute_compressed", bits=2)),
}


def main():
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--cases", default="16GiB:256,16GiB:512,8GiB:128,8GiB:256")
  p.add_argument("--image-size", type=int, default=224)
  p.add_argument("--data", type=int, default=1, help="devices the batch is split over")
  args = p.parse_args()
  mesh = None
  if args.data > 1:
    mesh = jax.make_mesh((args.data,), ("data",), axis_types=(AxisType.Auto,),
                         devices=jax.devices()[:args.data])
  devices = dict(mesh=mesh, data_axis="data", spatial_axes=None) if mesh else {}
  base = models.create_model("resnet50", 1000)
  optimizer = train.default_optimizer(1e-3, 100)
  # Real examples at the plan's shapes: the sites' gradient sensitivities order the bits.
  digits = data.digits(args.image_size)
  calibration = (np.repeat(digits.x_train[:16], 3, axis=-1), digits.y_train[:16])
  rows = []
  for case in args.cases.split(","):
    budget, batch = case.split(":")
    batch = int(batch)
    x = jax.ShapeDtypeStruct((batch, args.image_size, args.image_size, 3), jnp.float32)
    y = jax.ShapeDtypeStruct((batch,), jnp.int32)
    t0 = time.time()
    result = plan_lib.plan(base, (x, y), budget, optimizer=optimizer,
                           calibration_batch=calibration, **devices)
    seconds = time.time() - t0
    uniform = {}
    for name, make in UNIFORM.items():
      total, flops = plan_lib.step_cost(make(base), optimizer, x, y, mesh=mesh,
                                        specs=(P("data"), P("data")) if mesh else None)
      uniform[name] = dict(device_bytes=total, flops_ratio=flops / result.exact_flops,
                           fits=total <= result.budget_bytes)
    fitting = [u["flops_ratio"] for u in uniform.values() if u["fits"]]
    row = dict(budget=budget, batch=batch, plan=result.to_json(), seconds=seconds,
               flops_ratio=result.flops / result.exact_flops, uniform=uniform,
               cheapest_uniform_that_fits=min(fitting) if fitting else None)
    rows.append(row)
    print(budget, batch, f"plan fits={result.fits} {result.device_bytes / GIB:.2f} GiB "
          f"flops {row['flops_ratio']:.3f} compiles {result.compiles} {seconds:.0f}s; "
          f"uniform {[(k[:12], round(v['device_bytes'] / GIB, 2), round(v['flops_ratio'], 3)) for k, v in uniform.items()]}",
          flush=True)
  split = (f", the batch split over {args.data} simulated devices (`--data {args.data}`: "
           "`data_axis=`), figures per device" if mesh else "")
  md = ["# `jmem.plan` on ResNet-50 224x224 (float32, compile-only)", "",
        f"Written by `benchmarks/plan_resnet50.py` ({jax.default_backend()}, JAX "
        f"{jax.__version__}; 2 CPU cores{split}). Device bytes are the compiled train step's "
        "(parameters, AdamW state, batch, activations and temp); FLOPs from XLA's cost "
        "analysis, against exact at the same batch.", "",
        "| budget | batch | exact GiB | plan GiB | fits | plan FLOPs / exact | compiles | "
        "plan time (s) | cheapest uniform that fits (FLOPs / exact) | uniform: GiB, FLOPs |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---|"]
  for r in rows:
    pj = r["plan"]
    md.append(
        f"| {r['budget']} | {r['batch']} | {pj['exact_device_bytes'] / GIB:.2f} | "
        f"{pj['device_bytes'] / GIB:.2f} | {'yes' if pj['fits'] else 'NO'} | "
        f"{r['flops_ratio']:.3f} | {pj['compiles']} | {r['seconds']:.0f} | "
        f"{r['cheapest_uniform_that_fits'] if r['cheapest_uniform_that_fits'] is None else round(r['cheapest_uniform_that_fits'], 3)} | "
        + "; ".join(f"{k}: {v['device_bytes'] / GIB:.2f}, {v['flops_ratio']:.3f}"
                    for k, v in r["uniform"].items()) + " |")
  md += [""]
  for r in rows:
    md += [f"## {r['budget']} at batch {r['batch']}", "",
           "| site | policy |", "|---|---|"]
    md += [f"| {c['path']} | {c['policy']} |" for c in r["plan"]["choices"]]
    md += [""]
  stem = "plan_resnet50" + (f"_data{args.data}" if mesh else "")
  write_report(stem, rows, md)


if __name__ == "__main__":
  main()
