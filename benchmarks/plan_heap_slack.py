"""How well a compiled step's heap layout predicts undoing one bit reduction on ResNet-50
224x224 (compile-only), next to what the step compiles to: the figures behind the slack
`jmem.plan`'s undo tries add to a heap-layout prediction (the simulation's own error on the
step it is read from).

Each case: a plan's step (the sites named at 4 bits, every other block at 8), compiled
with XLA's buffer-assignment dump (`jmem.measure.heap_layout`): its temp allocation
(XLA's), `HeapLayout.simulate` of its own buffers, and the packed ActNN codes of the site
undone (found as the planner finds them); then the same step with that site at 8 bits,
compiled: what it costs, what the layout predicted (the planner's `_heap_prediction`, with
and without the slack), and the per-site estimate. The defaults are the walk points the
ResNet-50 plans of plan_resnet50.md stop at (16 GiB at batch 512, 8 GiB at 256) and an
undo the plans tried there. Writes results/plan_heap_slack.{json,md}.

  python benchmarks/plan_heap_slack.py [--cases BATCH:SITE,SITE:SITE_UNDONE;...]

e.g. --cases 512:stage1_block2,stage2_block2,stage2_block4:stage2_block2
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jmem import measure, models, planner, train  # noqa: E402
from _common import write_report  # noqa: E402

MIB = 2**20
CASES = ("512:stage1_block2,stage2_block2,stage2_block4:stage2_block2;"
         "256:stage1_block2,stage1_block3,stage2_block2,stage2_block4:stage2_block4")


def main():
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--cases", default=CASES, help="batch:sites at 4 bits:site undone;...")
  args = p.parse_args()
  # pylint: disable=protected-access
  model = models.create_model("resnet50", 1000)
  optimizer = train.default_optimizer(1e-3, 100)
  paths = planner._default_sites(model, jnp.zeros((1, 224, 224, 3), jnp.float32))
  ladder = planner.site_ladder(None, True)
  rung = {b: ladder.index(("compress", b)) for b in (8, 4)}
  estimated = {s.path: s for s in planner._estimate_sites(
      model, optimizer, jax.ShapeDtypeStruct((8, 224, 224, 3), jnp.float32),
      jax.ShapeDtypeStruct((8,), jnp.int32), paths)[0]}
  rows = []
  for case in args.cases.split(";"):
    batch, four, undone = case.split(":")
    batch, four = int(batch), set(four.split(","))
    x = jax.ShapeDtypeStruct((batch, 224, 224, 3), jnp.float32)
    y = jax.ShapeDtypeStruct((batch,), jnp.int32)

    def bits_of(state):
      return [planner.SiteChoice(p_, "compress", ladder[r][1], 0, 0, None)
              for p_, r in zip(paths, state)]
    at = tuple(rung[4] if p_ in four else rung[8] for p_ in paths)
    to = tuple(rung[8] if p_ == undone else r for p_, r in zip(paths, at))
    step, step_args = planner._train_step(
        planner._converted(model, planner._policies(bits_of(at))), optimizer, x, y)
    heap = measure.heap_layout(step, *step_args)
    at_bytes = heap.memory.total_bytes
    predict = planner._heap_prediction(heap, at, at_bytes, paths, ladder)
    simulated = heap.simulate()
    slack = abs(simulated - heap.memory.temp_bytes)
    site = paths.index(undone)
    codes = sum(b.bytes for b in heap.buffers if planner._site_of_codes(b, paths) == site)
    compiled = measure.device_bytes_and_flops(planner.compile_step(
        planner._converted(model, planner._policies(bits_of(to))), optimizer, x, y))[0]
    estimate = batch * (planner._kept(estimated[undone], ("compress", 8))[0] -
                        planner._kept(estimated[undone], ("compress", 4))[0])
    row = dict(batch=batch, sites_at_4_bits=sorted(four), undone=undone,
               at_device_bytes=at_bytes, temp_bytes=heap.memory.temp_bytes,
               simulated_temp_bytes=simulated, slack_bytes=slack, codes_bytes=codes,
               predicted_bytes=predict(to), compiled_bytes=compiled,
               estimated_growth_bytes=estimate)
    rows.append(row)
    print(row, flush=True)
  # pylint: enable=protected-access
  lines = [
      "# Predicting an undo from the heap layout on ResNet-50 224²", "",
      f"Written by `benchmarks/plan_heap_slack.py` ({jax.default_backend()}, JAX "
      f"{jax.__version__}, compile-only). The planner's AdamW step; the sites named at 4 "
      "bits, every other block at 8 (ActNN compress). XLA temp: the step's temp allocation; "
      "simulated: `HeapLayout.simulate` of the same buffers (best fit, the largest first); "
      "slack: the two apart, what `jmem.plan` adds to a prediction from this step. The undo: "
      "the site named put back to 8 bits; its codes: the site's packed codes in this step "
      "(they double). Predicted: the step's device bytes plus the simulated growth with the "
      "codes resized, with and without the slack. Estimate: the per-site estimate's growth.",
      "",
      "| batch | sites at 4 bits | undone | device MiB | XLA temp MiB | simulated MiB | slack "
      "MiB | codes MiB | +compiled | +predicted | +predicted, no slack | +estimate |",
      "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    grow = lambda v, r=r: f"{(v - r['at_device_bytes']) / MIB:+.1f}"
    lines.append(
        f"| {r['batch']} | {', '.join(r['sites_at_4_bits'])} | {r['undone']} | "
        f"{r['at_device_bytes'] / MIB:.1f} | {r['temp_bytes'] / MIB:.1f} | "
        f"{r['simulated_temp_bytes'] / MIB:.1f} | {r['slack_bytes'] / MIB:.1f} | "
        f"{r['codes_bytes'] / MIB:.1f} | {grow(r['compiled_bytes'])} | "
        f"{grow(r['predicted_bytes'])} | "
        f"{grow(r['predicted_bytes'] - r['slack_bytes'])} | "
        f"{r['estimated_growth_bytes'] / MIB:+.1f} |")
  write_report("plan_heap_slack", dict(rows=rows), lines)


if __name__ == "__main__":
  main()
