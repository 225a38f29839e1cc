"""Why undoing a bit reduction at a site whose residuals are not live at the peak can still
cost bytes: ResNet-20 on the digits at 32x32, batch 128, planned at 25% of exact's device
bytes with sensitivities (as in plan_sensitivity.py), then that plan with some sites put
back to 8 bits. Each step is compiled once with XLA's buffer-assignment dump
(`jmem.measure.peak_buffers`): its temp allocation, the bytes live at the peak (arguments
left out), what the heap's layout adds over them (`PeakReport.layout_bytes`), where the peak
is (the site whose backward holds the most bytes there) and which sites have residuals live
at it. Compile-only on CPU. Writes results/plan_undo_peak.{json,md}.

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


def site_of(scope, paths):
  """The site whose module path ``scope`` runs through (None: none)."""
  parts = scope.split("/")
  return next((p for p in parts if p in paths), None)


def account(model, choices, optimizer, x, y, paths):
  """What the compiled step of ``model`` converted by ``choices`` holds at its peak."""
  converted = jmem.convert(model, *planner._policies(choices))  # pylint: disable=protected-access
  fns = train.model_fns(converted)
  step = train.make_train_step(fns, optimizer, donate=True)
  report = measure.peak_buffers(step, train.abstract_state(fns, optimizer, x), x, y)
  backward, residual = {}, {}
  for b in report.buffers:
    site = site_of(b.scope, paths)
    if site and b.kind == "backward":
      backward[site] = backward.get(site, 0) + b.bytes
    elif site and b.kind == "forward":
      residual[site] = residual.get(site, 0) + b.bytes
  return dict(device_bytes=report.memory.total_bytes, temp_bytes=report.memory.temp_bytes,
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
  lowered = [c.path for c in plan.choices if c.kind == "compress" and c.bits < 8]
  stage = lambda *prefixes: [p for p in lowered if p.startswith(prefixes)]
  variants = [("the plan", [])]
  for label, sites in (("stage-3 sites at 8 bits", stage("stage3")),
                       ("stage-2 and stage-3 sites at 8 bits", stage("stage2", "stage3")),
                       ("stage2_block1 at 8 bits", stage("stage2_block1")),
                       ("stage1_block1 at 8 bits", stage("stage1_block1"))):
    if sites:
      variants.append((label, sites))
  rows = []
  for label, sites in variants:
    choices = tuple(dataclasses.replace(c, bits=8) if c.path in sites else c
                    for c in plan.choices)
    row = dict(variant=label, undone=sites, **account(model, choices, optimizer, x, y, paths))
    rows.append(row)
    print({k: v for k, v in row.items() if k != "bits"}, flush=True)
  base = rows[0]
  assert base["device_bytes"] == plan.device_bytes, (base["device_bytes"], plan.device_bytes)
  lines = [
      "# Undoing bit reductions the peak does not hold",
      "",
      f"Written by `benchmarks/plan_undo_peak.py` ({jax.default_backend()}, JAX "
      f"{jax.__version__}, compile-only). ResNet-20, digits 32x32, batch {BATCH}, the "
      f"planner's AdamW step. The plan: `jmem.plan` at {SHARE} of exact's device bytes "
      f"({plan.budget_bytes / MIB:.2f} MiB) with sensitivities measured on 16 training "
      f"examples, {plan.compiles} compiles: "
      + ", ".join(f"{c.path} {c.label}" for c in plan.choices) + ". Each row is that plan "
      "with the sites named put back to 8 bits, compiled once with XLA's buffer-assignment "
      "dump (`jmem.measure.peak_buffers`). Live at the peak: the bytes live at the peak of "
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
  write_report("plan_undo_peak", dict(
      batch=BATCH, budget=SHARE, budget_bytes=plan.budget_bytes, compiles=plan.compiles,
      plan={c.path: c.label for c in plan.choices}, rows=rows), lines)


if __name__ == "__main__":
  main()
