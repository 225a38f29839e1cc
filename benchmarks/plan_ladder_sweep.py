"""Does the 1-bit rung cost plans that fitted without it? `jmem.plan` at the default
``max_compiles=8`` over budgets from loose to past what 2 bits everywhere reaches, with the
planner's ladder (save -> compress 8, 4, 2, 1 bits -> recompute from a 2-bit input) and
with the ladder it had before the 1-bit rung (``bits=(8, 4, 2)``: no 1-bit rung; the
walk's-end try and the smallest-step fallback are the same code in both), on ResNet-20 at
32x32 (the digits' model, batch 128) and the tests' functional CNN split over 2 x 4
simulated devices. Bytes order (no sensitivities). Per row: fits, the compiled device
bytes, FLOPs against exact, the steps compiled, and the rungs the plan uses. Writes
results/plan_ladder_sweep.{json,md}.

  python benchmarks/plan_ladder_sweep.py            # about 10 minutes on 2 CPU cores
"""

import collections
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

from jmem import models, planner, train  # noqa: E402
from _common import write_report  # noqa: E402
import third_party_models as tp  # noqa: E402

# The planner's default bit widths, and without 1 bit (`jmem.plan(bits=...)`).
LADDERS = (("with 1-bit", None), ("without 1-bit", (8, 4, 2)))


def problems():
  """(name, model, (x, y), mesh, budget shares)."""
  mesh = jax.make_mesh((2, 4), ("h", "w"), axis_types=(AxisType.Auto,) * 2)
  return (
      ("resnet20 32², batch 128", models.create_model("resnet20", 10),
       (jax.ShapeDtypeStruct((128, 32, 32, 1), jnp.float32),
        jax.ShapeDtypeStruct((128,), jnp.int32)), None,
       ("30%", "22%", "21%", "20.5%", "20%", "19%")),
      ("functional CNN 32², batch 16, 2 x 4 devices", tp.FunctionalCNN(),
       (jax.ShapeDtypeStruct((16, 32, 32, 3), jnp.float32),
        jax.ShapeDtypeStruct((16,), jnp.int32)), mesh,
       ("95%", "92%", "90%", "88%", "86%", "84%")),
  )


def rungs(plan):
  counts = collections.Counter(c.label for c in plan.choices)
  return ", ".join(f"{n} {label}" for label, n in sorted(counts.items()))


def main():
  t0 = time.time()
  optimizer = train.default_optimizer(1e-3, 100)
  rows = []
  for name, model, batch, mesh, shares in problems():
    for share in shares:
      for label, bits in LADDERS:
        t = time.time()
        p = planner.plan(model, batch, share, optimizer=optimizer, max_batch=False,
                         mesh=mesh, bits=bits)
        seconds = time.time() - t
        rows.append(dict(problem=name, budget=share, ladder=label, fits=p.fits,
                         budget_bytes=p.budget_bytes, device_bytes=p.device_bytes,
                         flops_ratio=p.flops / p.exact_flops, compiles=p.compiles,
                         rungs=rungs(p), seconds=seconds,
                         top_rung_tried=any(w == "every site on the top rung"
                                            for w, _, _ in p.measured),
                         notes=list(p.notes)))
        print({k: v for k, v in rows[-1].items() if k != "notes"}, flush=True)

  md = ["# The planner with and without the 1-bit rung, at the default max_compiles=8", "",
        f"Written by `benchmarks/plan_ladder_sweep.py` ({jax.default_backend()}, JAX "
        f"{jax.__version__}, 2 CPU cores, {time.time() - t0:.0f} s). Device bytes: the "
        "compiled AdamW train step's, per device where there is a mesh; FLOPs: XLA's cost "
        "analysis against exact's. Bit reductions in bytes order (no sensitivities). "
        "\"top\": every site that saves anything was tried on the top rung (recompute from "
        "a 2-bit input), off the walk, because the walk's end missed or the estimate put it "
        "at fewer FLOPs than the walk's plan (where that point is on the walk, as without "
        "the 1-bit rung on the CNN, it is a walk point).", ""]
  for name, *_ in problems():
    md += [f"## {name}", "",
           "| budget | ladder | fits | device MiB (budget) | FLOPs / exact | compiles | top "
           "| rungs |", "|---|---|---|---:|---:|---:|---|---|"]
    for r in rows:
      if r["problem"] == name:
        md.append(f"| {r['budget']} | {r['ladder']} | {'yes' if r['fits'] else 'NO'} | "
                  f"{r['device_bytes'] / 2**20:.2f} ({r['budget_bytes'] / 2**20:.2f}) | "
                  f"{r['flops_ratio']:.3f} | {r['compiles']} | "
                  f"{'yes' if r['top_rung_tried'] else ''} | {r['rungs']} |")
    md.append("")
  write_report("plan_ladder_sweep", dict(rows=rows), md)


if __name__ == "__main__":
  main()
