"""Why `jmem.plan` does not search InPlace-ABN under per-site policies: on the third-party
NNX CNN (tests/third_party_models.py ``NNXCNN``: conv + BatchNorm + leaky_relu in an
nnx.Sequential stem, then conv + BatchNorm + relu inline; 32x32x3, batch 64), the train
step compiled with per-site policies, with and without InPlace-ABN on the stem's
BatchNorm. Device bytes and FLOPs against exact (compile-only, float32). Writes
results/plan_inplace_abn_stack.{json,md}.

  python benchmarks/plan_inplace_abn_stack.py
"""

import os
import sys

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import jmem  # noqa: E402
import third_party_models as tp  # noqa: E402
from jmem import planner, train  # noqa: E402
from _common import write_report  # noqa: E402

# Per-site policies (site -> (kind, bits)): the planner's sites are bn, conv and stem.
POLICIES = {
    "none": {},
    "stem recompute": {"stem": ("recompute", None)},
    "bn recompute": {"bn": ("recompute", None)},
    "bn 8-bit": {"bn": ("compress", 8)},
    "stem 8-bit": {"stem": ("compress", 8)},
    "bn, stem 8-bit": {"bn": ("compress", 8), "stem": ("compress", 8)},
    "bn 8-bit, stem 4-bit": {"bn": ("compress", 8), "stem": ("compress", 4)},
    "all 8-bit": {s: ("compress", 8) for s in ("bn", "conv", "stem")},
    "all 4-bit": {s: ("compress", 4) for s in ("bn", "conv", "stem")},
}


def main():
  optimizer = train.default_optimizer(1e-3, 100)
  x = jax.ShapeDtypeStruct((64, 32, 32, 3), jnp.float32)
  y = jax.ShapeDtypeStruct((64,), jnp.int32)
  model = tp.NNXCNN(rngs=nnx.Rngs(0))
  abn = jmem.InPlaceABN(where=r"stem/layers/1")
  exact_bytes, exact_flops = planner.step_cost(model, optimizer, x, y)
  rows = []
  for name, sites in POLICIES.items():
    policies = tuple(jmem.Policy(kind, bits=bits, where=site)
                     for site, (kind, bits) in sites.items())
    row = dict(policies=name)
    for label, under in (("alone", ()), ("with InPlace-ABN", (abn,))):
      techniques = under + policies
      converted = jmem.convert(nnx.clone(model), *techniques) if techniques else model
      device_bytes, flops = planner.step_cost(converted, optimizer, x, y)
      row[label] = dict(bytes_ratio=device_bytes / exact_bytes, flops_ratio=flops / exact_flops,
                        device_bytes=device_bytes)
    rows.append(row)
  md = ["# InPlace-ABN under per-site policies (third-party NNX CNN, batch 64, 32x32)", "",
        f"Written by `benchmarks/plan_inplace_abn_stack.py` ({jax.default_backend()}, JAX "
        f"{jax.__version__}, compile-only). Device bytes and FLOPs of the train step against "
        f"exact ({exact_bytes / 2**20:.2f} MiB), with the policies alone and with "
        "InPlace-ABN on the stem's BatchNorm too.", "",
        "| policies | bytes, alone | FLOPs, alone | bytes, with InPlace-ABN | "
        "FLOPs, with InPlace-ABN |",
        "|---|---:|---:|---:|---:|"]
  for r in rows:
    a, b = r["alone"], r["with InPlace-ABN"]
    md.append(f"| {r['policies']} | {a['bytes_ratio']:.3f} | {a['flops_ratio']:.3f} | "
              f"{b['bytes_ratio']:.3f} | {b['flops_ratio']:.3f} |")
  write_report("plan_inplace_abn_stack", dict(exact_bytes=exact_bytes, exact_flops=exact_flops,
                                              rows=rows), md)


if __name__ == "__main__":
  main()
