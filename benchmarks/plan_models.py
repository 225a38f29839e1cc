"""`jmem.plan` on the segmentation model and a video transformer (compile-only, float32):
the U-Net of issue 16 at 1024x2048 (batch 1; and batch 2 on 8 devices, its activations
sharded 2 x 4 over H x W by the plan's `jmem.Spatial`, ``mesh=``, the budget per device;
and on 8 devices laid out by the planner, ``devices=8``)
and a third-party video ViT (tests/third_party_models.py ``FrameTokenViT``: 16 frames of
112x112, 16x16 patches, width 384, 8 blocks, 6 heads; batch 8, and batch 32 split over 8
devices, ``data_axis=``), each at a budget below its exact step, against the uniform
policies at the same batch (on the same devices). Writes results/plan_models.{json,md}.

  python benchmarks/plan_models.py
"""

import json
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

import jmem  # noqa: E402
import third_party_models as tp  # noqa: E402
from jmem import planner, train  # noqa: E402
from jmem.models.segmentation import UNet  # noqa: E402
from _common import RESULTS  # noqa: E402

GIB = 2**30
UNIFORM = {"compress 8-bit": dict(kind="compress", bits=8),
           "compress 4-bit": dict(kind="compress", bits=4),
           "compress 2-bit": dict(kind="compress", bits=2), "recompute": dict(kind="recompute"),
           "recompute_compressed 2-bit": dict(kind="recompute_compressed", bits=2)}


def _cheapest(uniform) -> str:
  fit = {k: v["flops_ratio"] for k, v in uniform.items() if v["fits"]}
  return f"{min(fit, key=fit.get)} ({min(fit.values()):.3f}x FLOPs)" if fit else "none"


def main():
  optimizer = train.default_optimizer(1e-3, 100)
  mesh = jax.make_mesh((2, 4), ("h", "w"), axis_types=(AxisType.Auto,) * 2,
                       devices=jax.devices()[:8])
  data = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:8])
  spatial = dict(mesh=mesh)
  split = dict(mesh=data, data_axis="data", spatial_axes=None)
  vit = tp.FrameTokenViT(patch=16, dim=384, depth=8, heads=6)
  clips = lambda b: (jax.ShapeDtypeStruct((b, 16, 112, 112, 3), jnp.float32),
                     jax.ShapeDtypeStruct((b,), jnp.int32))
  cases = [
      ("U-Net 1024x2048, batch 1", UNet(19), jax.ShapeDtypeStruct((1, 1024, 2048, 3), jnp.float32),
       jax.ShapeDtypeStruct((1, 1024, 2048), jnp.int32), "6GiB", {}),
      ("U-Net 1024x2048, batch 2, 8 devices (2 x 4 over H x W), per device", UNet(19),
       jax.ShapeDtypeStruct((2, 1024, 2048, 3), jnp.float32),
       jax.ShapeDtypeStruct((2, 1024, 2048), jnp.int32), "2GiB", spatial),
      ("U-Net 1024x2048, batch 2, devices=8 (laid out by the planner), per device", UNet(19),
       jax.ShapeDtypeStruct((2, 1024, 2048, 3), jnp.float32),
       jax.ShapeDtypeStruct((2, 1024, 2048), jnp.int32), "2GiB", dict(devices=8)),
      ("video ViT 16x112x112, batch 8", vit, *clips(8), "2GiB", {}),
      ("video ViT 16x112x112, batch 32, 8 devices (data parallel), per device", vit,
       *clips(32), "1GiB", split),
  ]

  rows, md = [], ["# `jmem.plan` on the segmentation model and a video transformer", "",
                  f"Written by `benchmarks/plan_models.py` ({jax.default_backend()}, JAX "
                  f"{jax.__version__}, compile-only, 2 CPU cores). Device bytes: the "
                  "compiled train step's (parameters, AdamW state, batch, activations, "
                  "temp); FLOPs from XLA's cost analysis against exact.", ""]
  for name, model, x, y, budget, devices in cases:
    t0 = time.time()
    result = planner.plan(model, (x, y), budget, optimizer=optimizer, max_batch=False,
                          **devices)
    seconds = time.time() - t0
    uniform = {}
    under = [t for t in result.base if isinstance(t, jmem.Spatial)]   # with a spatial mesh
    for label, kw in UNIFORM.items():       # on the plan's mesh, with its batch shardings
      total, flops = planner.step_cost(jmem.convert(model, *under, jmem.Policy(**kw)),
                                       optimizer, x, y, mesh=result.mesh,
                                       specs=result.batch_specs)
      uniform[label] = dict(device_bytes=total, flops_ratio=flops / result.exact_flops,
                            fits=total <= result.budget_bytes)
    rows.append(dict(case=name, budget=budget, plan=result.to_json(), seconds=seconds,
                     uniform=uniform))
    print(name, result.table(), uniform, f"{seconds:.0f}s", flush=True)
    md += [f"## {name}, budget {budget}", "", result.table(), "",
           "Uniform policies at the same batch: " + "; ".join(
               f"{k} {v['device_bytes'] / GIB:.2f} GiB ({'fits' if v['fits'] else 'over'}), "
               f"{v['flops_ratio']:.3f}x FLOPs" for k, v in uniform.items()),
           f"Cheapest uniform policy that fits: {_cheapest(uniform)}.",
           f"Plan time {seconds:.0f} s on this machine.", ""]
  with open(os.path.join(RESULTS, "plan_models.json"), "w") as f:
    json.dump(rows, f, indent=1, default=str)
  with open(os.path.join(RESULTS, "plan_models.md"), "w") as f:
    f.write("\n".join(md) + "\n")


if __name__ == "__main__":
  main()
