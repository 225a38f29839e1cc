"""The memory/compute Pareto table of ResNet-50 224x224 (compile-only): single techniques
and stacks, per-example bytes and FLOPs against exact.

Writes benchmarks/results/stacks_resnet50.{json,md}:

  python benchmarks/stacks_resnet50.py [--batch-size 16] [--image-size 224] [--only a,b]

For jmem's ResNet-50 the donating train step (as `jmem train` runs it) is compiled at the
batch size and twice it (`jmem.bench.batch_fit`); the slope of the temp bytes is what one
more example costs, and exact's slope over a stack's is its max-batch multiplier. FLOPs
are XLA's cost analysis of the step at the smaller batch. Rows:

* exact; InPlace-ABN's twin (BN + leaky ReLU 0.01, exact) and InPlace-ABN itself;
* remat (``jax.checkpoint`` per block);
* remat from 2-bit block inputs as `jmem.convert` builds it (``Remat(where=<block class>)`` with
  ``ActNN("L3")``: the blocks recomputed from 2-bit inputs with their ReLU masks and
  BatchNorm statistics kept exact, the stem compressed);
* ``Policy("offload")``: every site's residuals in pinned host memory at full precision
  (XLA:CPU keeps host buffers in the same memory: on CPU, exact's figure);
* ActNN L3 (every residual of every block and of the stem at 2 bits, uniform here; the
  bench's ``actnn-L3`` calibrates per-layer bits at the same average) and L4 (L3 offloaded
  to pinned host memory: XLA:CPU keeps host buffers in the same memory, so on CPU its
  figure is L3's; a GPU's comes from benchmarks/gpu.py);
* InPlace-ABN + ActNN L3 (InPlace-ABN's saved output stays exact inside the compressed
  blocks: its backward inverts it).

(The committed table's "remat + 2-bit block inputs" row, ActNN L3 around ``nn.remat``
blocks, was measured before that composition was refused: it recomputed the masks and
statistics from quantized values, 6.4x ActNN's gradient error at 8 bits.)

The largest batch under 16 and 80 GiB here is the line's prediction (fixed bytes + slope);
`benchmarks/max_batch.py` confirms it by compiling, for the registered techniques.
"""

import argparse
import time

import flax.linen as nn
import jax
import jax.numpy as jnp

from _common import write_report
import jmem
from jmem import bench, measure, models, train

MIB = 2**20


def _twin(model):
  """InPlace-ABN's exact twin: the same leaky ReLU 0.01, plain BatchNorm."""
  return model.clone(act=lambda x: nn.leaky_relu(x, 0.01))


def variants(base):
  twin = _twin(base)
  pairs = jmem.surgery.inplace_abn_sites(twin, jnp.zeros((2, 32, 32, 3)))
  iabn = jmem.InPlaceABN(where=tuple(pairs))           # every BN + leaky_relu pair
  return {
      "exact": base,
      "bn+leaky (InPlace-ABN's twin)": twin,
      "InPlace-ABN": jmem.convert(twin, iabn),
      "remat": jmem.convert(base, jmem.Remat()),
      "Remat (blocks) + ActNN L3, jmem.convert": jmem.convert(
          base, jmem.Remat(where=base.block_cls), jmem.ActNN("L3")),
      "Policy offload (full precision; CPU: same memory)": jmem.convert(
          base, jmem.Policy("offload")),
      "ActNN L3": jmem.convert(base, jmem.ActNN("L3")),
      "ActNN L4 (offload; CPU: same memory)": jmem.convert(base, jmem.ActNN("L4")),
      "InPlace-ABN + ActNN L3": jmem.convert(twin, iabn, jmem.ActNN("L3")),
  }


def main():
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--batch-size", type=int, default=16)
  p.add_argument("--image-size", type=int, default=224)
  p.add_argument("--only", default="", help="comma-separated row names (default: all)")
  args = p.parse_args()
  base = models.create_model("resnet50", 1000)
  cases = variants(base)
  if args.only:
    cases = {k: v for k, v in cases.items() if k in args.only.split(",") or k == "exact"}
  optimizer = train.default_optimizer(0.1, 100)
  b, size = args.batch_size, args.image_size
  x = jax.ShapeDtypeStruct((b, size, size, 3), jnp.float32)
  y = jax.ShapeDtypeStruct((b,), jnp.int32)
  rows = []
  for name, model in cases.items():
    t0 = time.time()
    fit = bench.batch_fit(train.model_fns(model), optimizer, x, y, budgets_gib=())
    row = dict(name=name, per_example_temp_mib=fit.per_example_temp_bytes / MIB,
               per_example_mib=fit.per_example_bytes / MIB, fixed_mib=fit.fixed_bytes / MIB,
               temp_mib=fit.temp_bytes[0] / MIB, flops=fit.flops,
               max_batch_16gib=int((16 * measure.GIB - fit.fixed_bytes) //
                                   fit.per_example_bytes),
               max_batch_80gib=int((80 * measure.GIB - fit.fixed_bytes) //
                                   fit.per_example_bytes),
               compile_s=time.time() - t0)
    rows.append(row)
    print(f"{name}: {row['per_example_temp_mib']:.2f} MiB/example, "
          f"FLOPs {row['flops']:.4g} ({row['compile_s']:.0f} s)", flush=True)
  exact = rows[0]
  for row in rows:
    row["max_batch_ratio"] = exact["per_example_temp_mib"] / row["per_example_temp_mib"]
    row["flops_ratio"] = row["flops"] / exact["flops"]
  # Offload rows are left off the front: XLA:CPU keeps host buffers in device memory, so
  # their CPU figure is not what they save on a GPU.
  front = [r["name"] for r in rows if "CPU: same memory" not in r["name"] and
           not any(o["max_batch_ratio"] >= r["max_batch_ratio"] and o["flops_ratio"] <=
                      r["flops_ratio"] and (o["max_batch_ratio"], o["flops_ratio"]) !=
                      (r["max_batch_ratio"], r["flops_ratio"]) for o in rows
                      if "CPU: same memory" not in o["name"])]
  lines = [f"# ResNet-50 {size}x{size}: techniques and stacks, compile-only", "",
           f"Written by `benchmarks/stacks_resnet50.py` ({jax.default_backend()}, JAX "
           f"{jax.__version__}): jmem's ResNet-50, the donating train step compiled at batch "
           f"{b} and {2 * b}. MiB / example is the slope of the temp bytes; max-batch x is "
           "exact's slope over the row's; FLOPs from XLA's cost analysis; the largest "
           "batch is the line's prediction (device bytes: fixed + slope x batch). "
           "On the Pareto front (no other row has a larger batch at no more FLOPs; offload "
           "rows, whose CPU figure is not a GPU's, left out): "
           + ", ".join(front) + ".", "",
           "| technique / stack | MiB / example | max-batch x | FLOPs / exact | fixed MiB | "
           "max batch 16 GiB | max batch 80 GiB | on the front |",
           "|---|---:|---:|---:|---:|---:|---:|---|"]
  for r in rows:
    lines.append(f"| {r['name']} | {r['per_example_temp_mib']:.1f} | "
                 f"{r['max_batch_ratio']:.2f}x | {r['flops_ratio']:.3f} | {r['fixed_mib']:.0f} | "
                 f"{r['max_batch_16gib']} | {r['max_batch_80gib']} | "
                 f"{'yes' if r['name'] in front else ''} |")
  write_report("stacks_resnet50", dict(batch_size=b, image_size=size, rows=rows, front=front,
                                       jax=jax.__version__, backend=jax.default_backend()),
               lines)


if __name__ == "__main__":
  main()
