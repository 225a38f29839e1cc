"""Stochastic Backpropagation on moving-digit clips (16 frames of 24x24, 40 classes).

Writes benchmarks/results/sbp_memory.*, sbp_stt.* and sbp_vit.*:

  python benchmarks/sbp.py [--seeds 0,1,2] [--steps 300]

(1) compile-only memory of the StT model (per-frame ResNet-8 + temporal transformer) at
keep ratios 0.5, 0.25, 0.125 against exact, with the paper's whole-step memory model
(r Ms + Mc) / (Ms + Mc) computed from the measured exact figures; (2) accuracy and step time
of exact vs SBP r = 0.25 for the StT model and for the video transformer (first 3 of 4
blocks SBP, last exact), same seeds and steps.
"""

import json
import os

import jax
import jax.numpy as jnp

from _common import RESULTS, seeds_and_steps
from jmem import bench, measure, models
from jmem.models import video


def spatial_share(batch=32, frames=16, size=24):
  """Ms / (Ms + Mc): the per-frame CNN's share of the exact step's saved bytes."""
  model = models.create_model("stt-resnet8", 40)
  x = jnp.zeros((batch, frames, size, size, 1))
  cnn = models.resnet("resnet8", model.feature_dim, norm=video.group_norm)
  params = cnn.init(jax.random.key(0), x[:1, 0])["params"]
  loss = lambda p, v: jnp.sum(cnn.apply({"params": p}, v.reshape((-1, size, size, 1))) ** 2)
  return measure.saved_residuals(loss, params, x).activation_bytes


def main():
  seeds, steps = seeds_and_steps(__doc__)
  common = dict(batch_size=32, image_size=24, num_frames=16, seeds=seeds, steps=steps)
  mem = bench.run_bench(bench.BenchConfig(
      model="stt-resnet8", techniques=("sbp-0.5", "sbp-0.25", "sbp-0.125"), memory_only=True,
      **common), progress=False)
  ms = spatial_share()
  total = mem[0]["saved_bytes"]
  for r in mem:
    keep = 1.0 if r["technique"] == "exact" else float(r["technique"].split("-")[1])
    r["paper_model_ratio"] = (keep * ms + (total - ms)) / total
    r["spatial_saved_share_of_exact"] = ms / total
  bench.write_results(mem, RESULTS, stem="sbp_memory", meta=dict(
      note="compile-only; paper_model_ratio = (r Ms + Mc)/(Ms + Mc) with Ms the per-frame "
           "CNN's saved bytes in exact training"))
  for name, stem in (("stt-resnet8", "sbp_stt"), ("video-vit", "sbp_vit")):
    rows = bench.run_bench(bench.BenchConfig(model=name, techniques=("sbp-0.25",), **common),
                           progress=False)
    rows[1]["accuracy_minus_exact"] = rows[1]["accuracy"] - rows[0]["accuracy"]
    bench.write_results(rows, RESULTS, stem=stem, meta=dict(seeds=list(seeds), steps=steps))
    print(bench.format_table(rows))
  print(json.dumps([{k: r[k] for k in ("technique", "saved_ratio", "temp_ratio",
                                       "paper_model_ratio")} for r in mem], indent=1))


if __name__ == "__main__":
  os.makedirs(RESULTS, exist_ok=True)
  main()
