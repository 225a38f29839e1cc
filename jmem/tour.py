"""`jmem bench` with no options: one row per technique family, each on a model it fits,
all against exact in the same run (the README's first command).

* ActNN (L3), remat (the JAX-native peer), a per-site policy (``recompute-2bit``) and the
  planner's stack (``plan-50%``: `jmem.plan` at half of exact's device bytes) on ResNet-20
  (digits 16x16, batch 128), trained for a few steps;
* InPlace-ABN on preact20, SBP (r = 0.25) on the video ViT and spatial sharding over 8
  devices on a ConvNeXt, memory only, their accuracy quoted from a committed benchmark
  result (named in the row);
* SyncBN over 8 devices on a masked batch whose valid examples are unbalanced (two devices
  hold none): its error against plain BatchNorm on the valid examples alone, and the
  collectives of its compiled step.

Every row gives the collectives of its compiled step (none on one device).

``quick=True`` runs the same pipeline on tiny shapes (a check by hand: about 4 minutes on 2
cores, most of it compiling; tests/test_tour.py checks the parts).
"""

from __future__ import annotations

import os
import textwrap
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jmem import bench, measure
from jmem.parallel import sync_bn

__all__ = ["SECTIONS", "QUOTED", "run_tour", "sync_bn_check", "format_tour", "write_tour"]

# (section, BenchConfig fields); exact is each section's baseline.
SECTIONS = (
    ("ActNN, remat, policies, plan", dict(
        model="resnet20", techniques=("remat", "actnn-L3", "recompute-2bit", "plan-50%"),
        batch_size=128, image_size=16, steps=60, budgets_gib=(16.0,))),
    ("InPlace-ABN", dict(model="preact20", techniques=("inplace-abn",), batch_size=128,
                         image_size=16, memory_only=True, budgets_gib=(16.0,))),
    ("SBP (video)", dict(model="video-vit", techniques=("sbp-0.25",), batch_size=32,
                         image_size=24, num_frames=16, train_clips=64, memory_only=True,
                         budgets_gib=(16.0,))),
    ("Spatial (8 devices, per-device figures)", dict(
        model="convnext-digits", techniques=("spatial-8",), batch_size=16, image_size=32,
        memory_only=True, budgets_gib=())),
)
_QUICK = dict(batch_size=16, image_size=8, steps=2, budgets_gib=())
_QUICK_VIDEO = dict(batch_size=4, image_size=24, num_frames=8, train_clips=16)

# Accuracy of the memory-only rows, from committed results (tests/test_repo.py checks that
# each file says it): technique -> (what, file).
# Both were trained before the bench built every technique with jmem.convert (commit
# 4c60a24): InPlace-ABN then on every norm-act of preact20, the final one included (now its
# norm-act pairs); SBP by the video models' own keep_ratio field (now jmem.SBP on their
# sbp_sites: the same gradients, the dropped nodes' outputs held constant).
QUOTED = {
    "inplace-abn": ("98.79% (its BN + leaky_relu twin 98.51%; preact20, 3 seeds x 300 steps)",
                    "benchmarks/results/inplace_abn.md"),
    "sbp-0.25": ("93.36% (exact 94.21%; pretrained video ViT, 3 seeds x 1200 steps, before "
                 "jmem.convert built it)", "benchmarks/results/sbp_vit_pretrained_1200steps.md"),
    "spatial-8": ("exact's (gradients within 1.93e-05 relative of one device's, parameters "
                  "after a step within 1.79e-07)", "benchmarks/results/spatial.md"),
}


def sync_bn_check(counts=(5, 0, 3, 8, 1, 0, 2, 7), mean: float = 3.0, std: float = 2.0,
                  module=None) -> dict[str, Any]:
  """A BatchNorm over 8 devices on a masked batch, ``counts`` valid rows per device (of 8):
  its largest error on the valid rows against BatchNorm of the valid rows alone (float64),
  NaN outputs, the running mean's error, and the collectives of the compiled forward and
  forward + backward. ``module``: the BatchNorm class (default jmem's SyncBatchNorm)."""
  module = module or sync_bn.SyncBatchNorm
  devices = jax.devices() if jax.device_count() >= 8 else jax.devices("cpu")
  if len(devices) < 8:
    raise ValueError(f"sync_bn_check needs 8 devices, found {len(devices)}: on CPU set "
                     "XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax is "
                     "imported (the jmem CLI does this itself).")
  cap, c = 8, 4
  rng = np.random.default_rng(0)
  x = (rng.normal(size=(8 * cap, c)) * std + mean).astype(np.float32)
  mask = np.zeros((8 * cap, 1), bool)
  for d, n in enumerate(counts):
    mask[d * cap:d * cap + n] = True
  valid = mask[:, 0]
  xv = x[valid].astype(np.float64)
  want = (xv - xv.mean(0)) / np.sqrt(xv.var(0) + 1e-5)
  mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,),
                       devices=devices[:8])
  xs = jax.device_put(x, NamedSharding(mesh, P("d")))
  ms = jax.device_put(mask, NamedSharding(mesh, P("d")))
  m = module(use_running_average=False, axis_name="d", momentum=0.0)
  v = jax.tree.map(jnp.asarray, m.init(jax.random.key(0), x[:cap], mask=mask[:cap]))

  def fwd(x, mk):
    y, upd = m.apply(v, x, mask=mk, mutable=["batch_stats"])
    return y, upd["batch_stats"]["mean"]

  f = jax.jit(jax.shard_map(fwd, mesh=mesh, in_specs=(P("d"), P("d")),
                            out_specs=(P("d"), P())))
  y, running_mean = f(xs, ms)
  y = np.asarray(y)
  g = jax.jit(jax.shard_map(
      lambda x, mk: jax.grad(lambda x: jnp.sum(jnp.where(mk, fwd(x, mk)[0], 0.0) ** 2))(x),
      mesh=mesh, in_specs=(P("d"), P("d")), out_specs=P("d")))
  nonzero = lambda counts: {op: n for op, n in counts.items() if n}
  return dict(counts=list(counts), data_mean=mean, data_std=std,
              max_abs_error_valid=float(np.nanmax(np.abs(y[valid] - want))),
              nan_outputs=int(np.isnan(y).sum()),
              running_mean_error=float(np.nanmax(np.abs(np.asarray(running_mean) - xv.mean(0)))),
              collectives_forward=nonzero(measure.collective_counts(f, xs, ms)),
              collectives_forward_backward=nonzero(measure.collective_counts(g, xs, ms)))


def run_tour(*, quick: bool = False, quiet: bool = False, progress: bool = True,
             target=None) -> list[dict[str, Any]]:
  """Every section's rows (`jmem.bench.run_bench`'s, with ``section`` and, for memory-only
  rows, ``quoted_accuracy`` and its ``source``), then the SyncBN row.

  ``target``: the device the memory figures are for (`jmem.measure.target`; a GPU target
  is one device, so the 8-device spatial row is not run; the largest batches are then for
  its memory limit). Training, timing and the SyncBN check run on this machine."""
  on = measure.target(target)
  rows = []
  for section, fields in SECTIONS:
    fields = dict(fields)
    if on.deviceless:
      fields.update(target=on.name)
      if fields.get("budgets_gib"):
        fields["budgets_gib"] = None        # the target's memory limit
    if "spatial-8" in fields["techniques"] and on.deviceless:
      rows.append(dict(section=section, technique="spatial-8", model=fields["model"],
                       skipped=f"needs 8 devices; the {on.short} is one"))
      continue
    if "spatial-8" in fields["techniques"] and jax.device_count() < 8:
      rows.append(dict(section=section, technique="spatial-8", model=fields["model"],
                       skipped=f"needs 8 devices of one kind; this machine's default "
                       f"backend has {jax.device_count()}"))
      continue
    if quick:
      fields.update(_QUICK)
      if fields["model"] == "video-vit":
        fields.update(_QUICK_VIDEO)
      if fields["model"] == "convnext-digits":
        fields.update(image_size=16)
    config = bench.BenchConfig(**fields)
    for row in bench.run_bench(config, quiet=quiet, progress=progress):
      row["section"] = section
      if row["technique"] == "spatial-8":
        _saved_per_device(row, 8)
      if config.memory_only and row["technique"] in QUOTED:
        row["quoted_accuracy"], row["source"] = QUOTED[row["technique"]]
      rows.append(row)
  rows.append(dict(section="SyncBN (8 devices, unbalanced)", technique="sync-bn",
                   model="BatchNorm layer", sync_bn=sync_bn_check()))
  return rows


def _saved_per_device(row, devices: int) -> None:
  """A spatial row's saved bytes per device, like its other figures: they are traced, and
  the trace holds every device's blocks (what all of them save together is kept as
  ``saved_bytes_all_devices``)."""
  row["saved_bytes_all_devices"] = row["saved_bytes"]
  row["saved_bytes"] = row["saved_bytes"] / devices
  if row.get("saved_ratio") is not None:
    row["saved_ratio"] = row["saved_ratio"] / devices


def _cell(v, fmt):
  return "-" if v is None else format(v, fmt)


def _collectives(counts) -> str:
  """``{op: n}`` as "8 collective-permute, 2 all-reduce" (most first); "-" for none."""
  counts = {op: n for op, n in (counts or {}).items() if n}
  return ", ".join(f"{n} {op}" for op, n in sorted(counts.items(), key=lambda kv: -kv[1])) \
      or "-"


def format_tour(rows) -> str:
  short, on = bench.caption([r for r in rows if "per_example_temp_bytes" in r])
  short = f" ({short})" if short else ""
  on = f" ({on})" if on else ""
  lines = [f"| section | technique | model | max-batch x{short} | MiB / example{short} | "
           f"FLOPs / exact | temp / exact | saved / exact | step time / exact{on} | "
           f"collectives | accuracy{on} |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
  for r in rows:
    if "skipped" in r:
      lines.append(f"| {r['section']} | {r['technique']} | {r['model']} | - | - | - | - | - | "
                   f"- | - | not run: {r['skipped']} |")
      continue
    if "sync_bn" in r:
      s = r["sync_bn"]
      lines.append(
          f"| {r['section']} | sync-bn | {r['model']} | - | - | - | - | - | - | "
          f"{_collectives(s['collectives_forward_backward'])} (forward + backward) | exact: "
          f"max error {s['max_abs_error_valid']:.2g} on valid rows {s['counts']}, "
          f"{s['nan_outputs']} NaN |")
      continue
    if r.get("accuracy") is not None:
      acc = f"{100 * r['accuracy']:.2f}% ({r['steps']} steps)"
    elif r.get("quoted_accuracy"):
      acc = f"{r['quoted_accuracy']}, from {r['source']}"
    else:
      acc = "-"
    technique = r["technique"] + (" (calibrated)" if r.get("calibrated") else "")
    lines.append(
        f"| {r['section']} | {technique} | {r['model']} | "
        f"{_cell(r.get('max_batch_ratio'), '.2f')}x | "
        f"{_cell(r['per_example_temp_bytes'] / 2**20, '.3g')} | "
        f"{_cell(r.get('flops_ratio'), '.3f')} | "
        f"{_cell(r.get('temp_ratio'), '.3f')} | {_cell(r.get('saved_ratio'), '.3f')} | "
        f"{_cell(r.get('step_time_ratio'), '.2f')} | {_collectives(r.get('collectives'))} | "
        f"{acc} |")
  return "\n".join(lines)


def _models_note(rows) -> str:
  """What the tour's points compare: each technique with exact on its own model."""
  models = list(dict.fromkeys(r["model"] for r in rows if r.get("model")))
  per_device = any("per-device" in r.get("section", "") for r in rows)
  return (f"Each point compares a technique with exact on the same model; the points span "
          f"{len(models)} model{'s' if len(models) != 1 else ''} ({', '.join(models)}), so "
          "compare a technique with exact, not with a technique on another model."
          + (" Points marked per device are one device's bytes of a step sharded over "
             "several." if per_device else ""))


def write_tour(rows, output_dir: str, meta: dict | None = None) -> dict[str, str]:
  """``tour.json``, ``tour.md`` and ``tour.png`` (max-batch multiplier against FLOPs,
  one point per technique) in ``output_dir``."""
  import json  # pylint: disable=g-import-not-at-top
  os.makedirs(output_dir, exist_ok=True)
  paths = {ext: os.path.join(output_dir, f"tour.{ext}") for ext in ("json", "md", "png")}
  with open(paths["json"], "w") as f:
    json.dump({"meta": meta or {}, "rows": rows}, f, indent=1, default=str)
  with open(paths["md"], "w") as f:
    label = next((r["target_label"] for r in rows if r.get("target_label")), "")
    f.write("# jmem bench: the tour\n\n" + (f"Memory figures for: {label}.\n\n" if label else "")
            + _models_note(rows) + "\n\n"
            + "".join(f"- {k}: {v}\n" for k, v in (meta or {}).items()) + "\n"
            + format_tour(rows) + "\n")
  from jmem import _extras  # pylint: disable=g-import-not-at-top
  matplotlib = _extras.require("matplotlib", "The bench's figures")
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(6.5, 4.5))
  ax.plot(1.0, 1.0, "ks")
  ax.annotate("exact", (1.0, 1.0), textcoords="offset points", xytext=(5, -10), fontsize=8)
  shown = [r for r in rows
           if r.get("technique") != "exact" and r.get("max_batch_ratio") is not None]
  for i, r in enumerate(sorted(shown, key=lambda r: r["max_batch_ratio"])):
    where = " per device" if "per-device" in r.get("section", "") else ""
    ax.plot(r["flops_ratio"], r["max_batch_ratio"], "o")
    ax.annotate(f"{r['technique']} ({r['model']}{where})",
                (r["flops_ratio"], r["max_batch_ratio"]), textcoords="offset points",
                xytext=(5, 3 if i % 2 else -10), fontsize=8)
  ax.set_xlabel("step FLOPs / exact (XLA cost analysis)")
  ax.set_ylabel("max-batch multiplier vs exact")
  ax.set_title("What each technique buys, and what it costs", fontsize=10)
  label = next((r["target_label"] for r in rows if r.get("target_label")), "XLA:CPU")
  fig.text(0.01, 0.01, "\n".join(textwrap.wrap(
      f"{_models_note(rows)} Memory: {label}.", 110)), fontsize=6, va="bottom")
  ax.grid(alpha=0.3)
  fig.tight_layout(rect=(0, 0.1, 1, 1))
  fig.savefig(paths["png"], dpi=110)
  plt.close(fig)
  return paths
