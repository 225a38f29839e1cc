"""Why undoing a bit reduction at a site whose residuals are not live at the peak can still
cost bytes, and how well the compiled step's heap layout predicts it: ResNet-20 on the
digits at 32x32, batch 128. The reference step: every block compressed at 4 bits and the
stem at 8 (the plan `jmem.plan` made at 25% of exact's device bytes with sensitivities,
as in plan_sensitivity.py, before its undo tries were predicted from the heap layout);
then that step with some sites put back to 8 bits, and the plan `jmem.plan` makes now.
Each step is compiled with XLA's buffer-assignment dump (`jmem.measure.peak_buffers`,
`jmem.measure.heap_layout`): its temp allocation, the bytes live at the peak (arguments
left out), what the heap's layout adds over them (`PeakReport.layout_bytes`), where the peak
is (the site whose backward holds the most bytes there), which sites have residuals live
at it, the temp `HeapLayout.simulate` gives from the step's own dump and from the
reference's (its codes resized), and the planner's per-site estimate. Compile-only on CPU.
Writes results/plan_undo_peak.{json,md}.

  python benchmarks/plan_undo_peak.py
"""

import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jmem  # noqa: E402
from jmem import data, measure, models, planner, train  # noqa: E402
from _common import write_report  # noqa: E402

BATCH, SHARE, MIB = 128, "25%", 2**20


def account(model, choices, optimizer, x, y, paths):
  """What the compiled step of ``model`` converted by ``choices`` holds at its peak, and
  its temp allocation laid out (`measure.heap_layout`)."""
  # pylint: disable=protected-access
  step, args = planner._train_step(jmem.convert(model, *planner._policies(choices)),
                                   optimizer, x, y)
  report = measure.peak_buffers(step, *args)
  heap = measure.heap_layout(step, *args)
  assert heap.memory == report.memory and heap.extent == heap.memory.temp_bytes
  backward, residual = {}, {}
  for b in report.buffers:
    site = planner._site_of_scope(b.scope, paths)
    if site and b.kind == "backward":
      backward[site] = backward.get(site, 0) + b.bytes
    elif site and b.kind == "forward":
      residual[site] = residual.get(site, 0) + b.bytes
  # pylint: enable=protected-access
  return heap, dict(
      device_bytes=report.memory.total_bytes, temp_bytes=report.memory.temp_bytes,
      simulated_temp_bytes=heap.simulate(),
      live_temp_bytes=report.live_temp_bytes, layout_bytes=report.layout_bytes,
      peak_in=max(backward, key=backward.get) if backward else None,
      residual_bytes_at_peak={p: residual.get(p, 0) for p in paths},
      bits={c.path: c.label for c in choices})


def main():
  dataset = data.digits(32)
  model = models.create_model("resnet20", 10)
  x = jax.ShapeDtypeStruct((BATCH,) + dataset.example_shape, jnp.float32)
  y = jax.ShapeDtypeStruct((BATCH,), jnp.int32)
  plan = planner.plan(model, (x, y), SHARE, max_batch=False,
                      calibration_batch=(dataset.x_train[:16], dataset.y_train[:16]))
  paths = [c.path for c in plan.choices]
  optimizer = train.default_optimizer(1e-3, 100)     # the planner's default
  reference = tuple(dataclasses.replace(c, kind="compress", bits=8 if c.path == "stem" else 4)
                    for c in plan.choices)
  blocks = lambda *prefixes: [p for p in paths if p.startswith(prefixes)]
  variants = [("reference: blocks at 4 bits, the stem at 8", reference)]
  for label, sites in (("stage-3 sites at 8 bits", blocks("stage3")),
                       ("stage-2 and stage-3 sites at 8 bits", blocks("stage2", "stage3")),
                       *((f"{p} at 8 bits", [p]) for p in blocks("stage"))):
    variants.append((label, tuple(dataclasses.replace(c, bits=8) if c.path in sites else c
                                  for c in reference)))
  variants.append((f"jmem.plan's plan now ({plan.compiles} compiles)", plan.choices))
  # The planner's per-site estimate of an undo: the residual bytes kept more, wherever live.
  # pylint: disable=protected-access
  small = lambda a: jax.ShapeDtypeStruct((8,) + a.shape[1:], a.dtype)
  estimated = {st.path: st for st in planner._estimate_sites(
      model, optimizer, small(x), small(y), paths)[0]}
  growth = lambda path, bits: BATCH * (planner._kept(estimated[path], ("compress", 8))[0] -
                                       planner._kept(estimated[path], ("compress", bits))[0])
  # pylint: enable=protected-access
  # What the planner's undo tries predict a state by: `_heap_prediction` on the reference's
  # heap layout, states as rungs of the default ladder.
  ladder = planner.site_ladder(None, True)
  rung = lambda choices: tuple(ladder.index(("compress", c.bits)) for c in choices)
  predict = None                                     # made from the reference's layout
  # The gradient variance a site adds at b bits (the planner's model, C / (2^b - 1)^2), and
  # the reference's: what share of it an undo takes off.
  sensitivity = {c.path: c.sensitivity for c in plan.choices}
  variance = lambda path, b: planner._variance(  # pylint: disable=protected-access
      sensitivity[path], ("compress", b))
  reference_variance = sum(variance(c.path, c.bits) for c in reference)
  rows = []
  bits_of = lambda choices: {c.path: c.bits if c.kind == "compress" else None for c in choices}
  for label, choices in variants:
    heap, row = account(model, choices, optimizer, x, y, paths)
    if predict is None:                               # the first row is the reference
      predict = planner._heap_prediction(  # pylint: disable=protected-access
          heap, rung(reference), heap.memory.temp_bytes, paths, ladder)
    bits = bits_of(choices)
    undone = [c.path for c in reference if bits[c.path] != c.bits]
    row = dict(variant=label, undone=undone, **row, variance_share=sum(
                   variance(p, 4) - variance(p, 8) for p in undone) / reference_variance,
               estimated_growth_bytes=sum(growth(c.path, c.bits) for c in reference
                                          if c.path in undone and bits[c.path] == 8),
               predicted_temp_bytes=predict(rung(choices)))
    rows.append(row)
    print({k: v for k, v in row.items() if k != "bits"}, flush=True)
  base = rows[0]
  assert rows[-1]["device_bytes"] == plan.device_bytes, (rows[-1], plan.device_bytes)
  lines = [
      "# Undoing bit reductions the peak does not hold",
      "",
      f"Written by `benchmarks/plan_undo_peak.py` ({jax.default_backend()}, JAX "
      f"{jax.__version__}, compile-only). ResNet-20, digits 32x32, batch {BATCH}, the "
      f"planner's AdamW step. The plan: `jmem.plan` at {SHARE} of exact's device bytes "
      f"({plan.budget_bytes / MIB:.2f} MiB) with sensitivities measured on 16 training "
      f"examples, {plan.compiles} compiles: "
      + ", ".join(f"{c.path} {c.label}" for c in plan.choices) + " (the last row). The "
      "reference: every block at 4 bits and the stem at 8, the plan before the undo tries "
      "were predicted from the heap layout; the rows between, the reference with the sites "
      "named put back to 8 bits. Each step compiled with XLA's buffer-assignment dump "
      "(`jmem.measure.peak_buffers`). Live at the peak: the bytes live at the peak of "
      "the schedule, arguments left out. Layout: the temp allocation less those "
      "(`PeakReport.layout_bytes`), what placing every buffer of the step in one heap adds. "
      "Peak in: the site whose backward holds the most bytes at the peak. Residuals: "
      "forward buffers live at the peak, by the site that made them (sites holding under "
      "0.01 MiB there left out).",
      "",
      "| variant | device MiB | fits | temp MiB | +temp | live at the peak MiB | +live | "
      "layout MiB | peak in | residual MiB live at the peak, by site (0.01 MiB or more) |",
      "|---|---:|---|---:|---:|---:|---:|---:|---|---|",
  ]
  for r in rows:
    held = ", ".join(f"{p} {v / MIB:.2f}" for p, v in r["residual_bytes_at_peak"].items()
                     if v >= 0.01 * MIB)
    lines.append(
        f"| {r['variant']} | {r['device_bytes'] / MIB:.2f} | "
        f"{'yes' if r['device_bytes'] <= plan.budget_bytes else 'no'} | "
        f"{r['temp_bytes'] / MIB:.2f} | {(r['temp_bytes'] - base['temp_bytes']) / MIB:+.2f} | "
        f"{r['live_temp_bytes'] / MIB:.2f} | "
        f"{(r['live_temp_bytes'] - base['live_temp_bytes']) / MIB:+.2f} | "
        f"{r['layout_bytes'] / MIB:+.2f} | {r['peak_in']} | "
        f"{held or '-'} |")
  lines += [
      "",
      "The temp allocation placed again (`jmem.measure.heap_layout`, `HeapLayout.simulate`: "
      "best fit, the largest buffer first): from each step's own dump (how close the "
      "simulation comes to XLA's placement), and predicted from the reference's dump alone, "
      "the packed codes of the sites named resized to 8 bits (the reference's temp plus the "
      "simulated difference, plus, for a changed state, how far the simulation of the "
      "reference's own dump is from XLA's: "
      f"{abs(base['simulated_temp_bytes'] - base['temp_bytes']) / MIB:.2f} MiB): what "
      "`jmem.plan` now predicts an undo try by before compiling it. The per-site estimate: "
      "the residual bytes the sites keep more at 8 bits (what "
      "the planner scaled by a compiled slope before), wherever they are live. Variance taken "
      "off: the share of the reference's added gradient variance (sum of C / (2^bits - 1)^2, "
      "C measured at 2 bits) the undo takes off; a try the layout guides leaves an undo under "
      "1% to a try of its own, made where no other undo is predicted to fit.",
      "",
      "| variant | temp MiB (XLA) | simulated from its own dump | predicted from the reference's "
      "| +temp (XLA) | +predicted | +per-site estimate (the planner's) | variance taken off |",
      "|---|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for r in rows:
    lines.append(
        f"| {r['variant']} | {r['temp_bytes'] / MIB:.2f} | "
        f"{r['simulated_temp_bytes'] / MIB:.2f} | {r['predicted_temp_bytes'] / MIB:.2f} | "
        f"{(r['temp_bytes'] - base['temp_bytes']) / MIB:+.2f} | "
        f"{(r['predicted_temp_bytes'] - base['temp_bytes']) / MIB:+.2f} | "
        f"{r['estimated_growth_bytes'] / MIB:+.2f} | {100 * r['variance_share']:.1f}% |")
  write_report("plan_undo_peak", dict(
      batch=BATCH, budget=SHARE, budget_bytes=plan.budget_bytes, compiles=plan.compiles,
      plan={c.path: c.label for c in plan.choices}, rows=rows), lines)


if __name__ == "__main__":
  main()
