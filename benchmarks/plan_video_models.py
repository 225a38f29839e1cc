"""`jmem.plan` on jmem's own video models (compile-only, float32, one device): ``video-vit``
(patch 8, width 64, 4 blocks) exact and with SBP on its first 3 blocks (keep ratio 0.25,
the planner then choosing policies for what SBP leaves: the exact last block), and
``stt-resnet8`` (a per-frame ResNet-8 under one submodule, which the planner splits into
its blocks), 16 frames of 112x112 at batch 8, each at half its exact step's device bytes
(the SBP ViT at the exact ViT's budget, and at 4 GiB), against the uniform policies on
the plan's sites at the same batch.
Writes results/plan_video_models.{json,md}.

  python benchmarks/plan_video_models.py
"""

import re
import time

import jax
import jax.numpy as jnp

import jmem
from jmem import models, planner, train
from _common import write_report

GIB = 2**30
UNIFORM = {"compress 8-bit": dict(kind="compress", bits=8),
           "compress 4-bit": dict(kind="compress", bits=4),
           "compress 2-bit": dict(kind="compress", bits=2), "recompute": dict(kind="recompute"),
           "recompute_compressed 2-bit": dict(kind="recompute_compressed", bits=2)}


def main():
  optimizer = train.default_optimizer(1e-3, 100)
  x = jax.ShapeDtypeStruct((8, 16, 112, 112, 1), jnp.float32)
  y = jax.ShapeDtypeStruct((8,), jnp.int32)
  exact_vit = None
  rows, md = [], ["# `jmem.plan` on jmem's own video models", "",
                  f"Written by `benchmarks/plan_video_models.py` ({jax.default_backend()}, JAX "
                  f"{jax.__version__}, compile-only, 2 CPU cores). 16 frames of 112x112, "
                  "batch 8. Device bytes: the compiled train step's (parameters, AdamW "
                  "state, batch, activations, temp); FLOPs from XLA's cost analysis against "
                  "the model's own step without policies (for the SBP ViT: with SBP).", ""]
  for name, overrides, budget in (("video-vit", {}, "50%"), ("video-vit", "sbp", None),
                                  ("video-vit", "sbp", "4GiB"), ("stt-resnet8", {}, "50%")):
    model = models.create_model(name, 10)
    if overrides:            # SBP on the ViT's own sites; the planner takes the other blocks
      model = jmem.convert(model, jmem.SBP(keep_ratio=0.25, where=model.sbp_sites,
                                           mode=model.sbp_mode))
    budget = budget or exact_vit.budget_bytes      # None: the exact ViT's budget
    t0 = time.time()
    result = planner.plan(model, (x, y), budget, optimizer=optimizer, max_batch=False)
    seconds = time.time() - t0
    if name == "video-vit" and not overrides:
      exact_vit = result
    uniform = {}
    sites = "|".join(re.escape(c.path) for c in result.choices)   # the plan's sites
    for label, kw in UNIFORM.items():
      total, flops = planner.step_cost(jmem.convert(model, jmem.Policy(**kw, where=sites)),
                                       optimizer, x, y)
      uniform[label] = dict(device_bytes=total, flops_ratio=flops / result.exact_flops,
                            fits=total <= result.budget_bytes)
    case = name + "".join(f", {k}={v}" for k, v in overrides.items())
    extra = {}
    if exact_vit is not None and result is not exact_vit and name == "video-vit":
      extra = dict(exact_vit_device_bytes=exact_vit.exact_device_bytes,
                   flops_vs_exact_vit=result.flops / exact_vit.exact_flops)
    rows.append(dict(case=case, plan=result.to_json(), seconds=seconds, uniform=uniform,
                     **extra))
    print(case, result.table(), uniform, f"{seconds:.0f}s", flush=True)
    md += [f"## {case}, budget {result.budget_bytes / GIB:.2f} GiB", "", result.table(), "",
           "Uniform policies on the plan's sites at the same batch: " + "; ".join(
               f"{k} {v['device_bytes'] / GIB:.2f} GiB ({'fits' if v['fits'] else 'over'}), "
               f"{v['flops_ratio']:.3f}x FLOPs" for k, v in uniform.items())]
    if extra:
      md += [f"Against the exact ViT's step ({exact_vit.exact_device_bytes / GIB:.2f} GiB): "
             "the SBP "
             f"model with this plan needs {result.device_bytes / GIB:.2f} GiB at "
             f"{extra['flops_vs_exact_vit']:.3f}x its FLOPs."]
    md += [f"Plan time {seconds:.0f} s on this machine.", ""]
  write_report("plan_video_models", rows, md)


if __name__ == "__main__":
  main()
