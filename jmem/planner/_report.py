"""What `jmem.plan` returns and writes: `Plan`, its `SiteChoice` per site, its table,
JSON and Pareto figure."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jmem import surgery
from jmem import step as step_lib
from jmem.ops.policy import Policy
from jmem.parallel.data_parallel import data_parallel
from jmem.planner._inputs import _compiled_slope

@dataclasses.dataclass(frozen=True)
class SiteChoice:
  """One site of a plan.

  Attributes:
    path: the module path (`jmem.convert`'s ``where=`` matches it exactly).
    kind: the policy kind (`jmem.ops.policy.POLICY_KINDS`).
    bits: its bits (None: full precision).
    saved_bytes: estimated bytes per example it keeps less than ``save``.
    added_flops: estimated FLOPs per example it adds.
    sensitivity: its GACT gradient sensitivity ``C`` (None: not measured).
    added_seconds: where the plan steered by an estimated step time, the seconds per step
      at the plan's batch the site's estimate adds (`Objective.added`: what ranks the
      sites, not a prediction); else None.
  """

  path: str
  kind: str
  bits: int | None
  saved_bytes: float
  added_flops: float
  sensitivity: float | None = None
  added_seconds: float | None = None

  @property
  def label(self) -> str:
    return self.kind if self.bits is None else f"{self.kind} {self.bits}-bit"

  def technique(self) -> Policy | None:
    if self.kind == "save":
      return None
    return Policy(self.kind, bits=self.bits, where=re.escape(self.path))


# What every compiled figure of a plan is for: train your converted model the same way.
ASSUMES = ("Each figure is the whole train step (forward, backward and the optimiser's "
           "update), compiled with jmem.jit, its parameters, optimiser state and batch "
           "statistics donated (jmem.train_step builds that step); compiled otherwise it can "
           "need more: on XLA:CPU plain jax.jit kept much of what the techniques remove, and "
           "without donation the old and the new state are both held.")


@dataclasses.dataclass(frozen=True)
class Plan:
  """What `plan` chose and what the compiler says about it.

  Attributes:
    budget_bytes, batch_size: the request.
    choices: one `SiteChoice` per site, sorted by path.
    device_bytes: the planned step's compiled device bytes at ``batch_size`` (arguments,
      outputs and temp: parameters, optimiser state, the batch, activations).
    exact_device_bytes: the same for the unconverted model.
    flops, exact_flops: XLA's cost analysis of both steps (`jmem.measure.step_flops`: off
      the CPU, of the lowered steps, whose count has the convolutions).
    fits: ``device_bytes <= budget_bytes``.
    max_batch: the largest batch of the planned step within the budget, predicted by the
      line through it compiled at two batch sizes (one more compile; None if not asked);
      with a data axis, the global batch, a multiple of the axis's size.
    exact_max_batch: the same for the exact step (from its two compiles).
    compiles: the steps compiled.
    front: the (device bytes, cost: ``objective``'s) of each point of the upgrade path as
      the walk's compiles predict them (`_calibrated`: the compiled figures where a point was
      compiled, between compiled points the estimate mapped through them, past the last
      the walk's line, no lower than the exact step's bytes at batch 0; where exact
      alone was compiled, the estimate itself so floored), then, where the plan is every
      site on the top rung (``off_walk``), that point's compiled figures,
      for the Pareto plot; ``chosen``: the index in it of the point the plan is (or, where
      undoing unneeded bit reductions fitted, the plan started from: same FLOPs; 0 for
      InPlace-ABN alone).
    notes: what was left out of the search and why.
    base: the techniques besides the sites' policies: ``jmem.Spatial(mesh)`` with a
      mesh of spatial axes, then ``InPlaceABN(where=...)`` where InPlace-ABN alone on the
      BatchNorms it can take is the plan (module docstring, item 4; every site then
      saves); else empty.
    measured: ``(what, device bytes, FLOPs)`` of every step compiled at ``batch_size``:
      "exact", "InPlace-ABN alone", "walk point i" (``front[i]`` compiled), "every site
      on the top rung" (the walk's end missed, or the estimate put it at fewer FLOPs than
      the walk's plan; "walk point i" where that point is on the walk), "bit reductions
      undone".
    devices: the devices each step's activations are split over (``mesh=`` or
      ``devices=``; 1: one device): the sites' bytes and FLOPs per example are then their
      share on one device.
    mesh: the `jax.sharding.Mesh` the steps were compiled on (``mesh=``, or the one
      ``devices=`` made: train on it; None: one device).
    batch_specs: the `PartitionSpec` of a batch's x and y on ``mesh``, as compiled (None:
      one device). `Plan.model_fns` trains the planned model so.
    off_walk: the plan is no point of the walk: every site that saves anything on the top
      rung, tried after the walk's end missed or where the estimate put it at fewer FLOPs
      than the walk's plan (``front``'s last point, after the walk's; ``chosen`` is it).
    estimates: the trace's estimate at each point of ``front`` (what the walk ranks by,
      before any compile corrects it: far off at times, even below zero bytes).
    target: the `jmem.measure.Target` every step was compiled for (``target=``), by name;
      ``target_label``: what its figures are (e.g. an H100's buffer assignment, compiled
      without one).
    objective: the cost the walk steered by and the plans were compared on: ``"FLOPs"``, or
      ``"estimated step time"`` for a target with a fitted step-time model (the H100:
      `jmem.measure.estimate_step_time`); ``front`` and ``estimates`` are (bytes, that).
    seconds, exact_seconds: the planned and the exact step's estimated step times (None:
      the target has no step-time model). Estimates, not measured times.
    measured_seconds: the estimated step time of each step of ``measured`` (None each
      where the target has no step-time model).
  """

  budget_bytes: int
  batch_size: int
  choices: tuple[SiteChoice, ...]
  device_bytes: int
  exact_device_bytes: int
  flops: float
  exact_flops: float
  fits: bool
  max_batch: int | None
  exact_max_batch: int | None
  compiles: int
  front: tuple[tuple[float, float], ...]
  chosen: int
  notes: tuple[str, ...] = ()
  base: tuple = ()
  measured: tuple[tuple[str, int, float], ...] = ()
  devices: int = 1
  mesh: Any = None
  batch_specs: tuple | None = None
  off_walk: bool = False
  estimates: tuple[tuple[float, float], ...] = ()
  target: str = "default"
  target_label: str = ""
  objective: str = "FLOPs"
  seconds: float | None = None
  exact_seconds: float | None = None
  measured_seconds: tuple[float | None, ...] = ()

  @property
  def techniques(self) -> tuple:
    """What to pass to `jmem.convert` (empty: the exact model fits)."""
    return tuple(self.base) + _policies(self.choices)

  def model_fns(self, model) -> step_lib.ModelFns:
    """The planned model as `jmem.step.ModelFns`, for `jmem.train.train` or
    `jmem.train_step`: ``model`` (the
    one planned; an NNX model is converted in place, as by `jmem.convert`) converted with
    `techniques` and, on ``mesh``, its train state replicated and each batch sharded by
    ``batch_specs`` (`jmem.train` splits per-pixel labels over H and W as the images). With the
    batch split over a data axis alone, it is `jmem.parallel.data_parallel`'s (on a GPU,
    XLA for the kernels, as the plan compiled it)."""
    converted = surgery.convert(model, *self.techniques) if self.techniques else model
    if self.mesh is None:
      return step_lib.model_fns(converted)
    x_spec = self.batch_specs[0]
    if not any(isinstance(t, surgery.Spatial) for t in self.base):
      return data_parallel(converted, self.mesh, axis=x_spec[0])
    return step_lib.model_fns(converted)._replace(
        sharding=NamedSharding(self.mesh, P()), batch_sharding=NamedSharding(self.mesh, x_spec))

  @property
  def approximate(self) -> bool:
    return any(c.bits is not None for c in self.choices)

  def table(self) -> str:
    sens = any(c.sensitivity is not None for c in self.choices)
    timed = any(c.added_seconds is not None for c in self.choices)
    share = "" if self.devices == 1 else f", per device of {self.devices}"
    lines = [f"| site | policy | saved MiB / example{share}, estimated | added MFLOPs / "
             f"example{share}, estimated |" +
             (f" added ms per step of {self.batch_size}, estimated |" if timed else "") +
             (" gradient sensitivity C |" if sens else ""),
             "|---|---|---:|---:|" + ("---:|" if timed else "") + ("---:|" if sens else "")]
    for c in self.choices:
      lines.append(f"| {c.path} | {c.label} | {c.saved_bytes / 2**20:.2f} | "
                   f"{c.added_flops / 1e6:.1f} |" +
                   (f" {1e3 * (c.added_seconds or 0.0):.3f} |" if timed else "") +
                   (f" {c.sensitivity:.3g} |" if sens else ""))
    if self.base:
      lines += ["", "Under every site: " + ", ".join(_short(t) for t in self.base) + "."]
    lines += ["", "Per site: the trace's estimates (what the walk ranks by). The step's "
              "figures below are compiled."]
    verdict = ("fits" if self.fits else
               f"does NOT fit: {_size(self.device_bytes - self.budget_bytes)} over; this is "
               "the smallest step compiled on its layout")
    if self.target_label:
      lines += ["", f"Compiled for {self.target_label}."]
    lines += ["", f"Budget {_size(self.budget_bytes)} at batch {self.batch_size}: the planned "
              f"step needs {_size(self.device_bytes)} ({verdict}); exact needs "
              f"{_size(self.exact_device_bytes)}. FLOPs "
              f"{self.flops / max(self.exact_flops, 1):.3f}x exact's (XLA cost analysis)."]
    if self.seconds is not None and self.exact_seconds:
      ratio = self.seconds / self.exact_seconds
      lines.append(f"Estimated step time {self.seconds * 1e3:.1f} ms, {ratio:.3f}x exact's "
                   f"{self.exact_seconds * 1e3:.1f} ms (jmem.measure.estimate_step_time: an "
                   "estimate from the compiled module, not a measured time); the walk steered "
                   "by it.")
    if self.max_batch is not None:
      lines.append(f"Largest batch within the budget, predicted from two compiled batch "
                   f"sizes: {self.max_batch} (exact: {self.exact_max_batch}).")
    lines.append(f"{self.compiles} steps compiled.")
    lines.append(ASSUMES)
    lines += [f"Note: {n}" for n in self.notes]
    return "\n".join(lines)

  def __str__(self) -> str:
    return self.table()

  def to_json(self) -> dict[str, Any]:
    out = dataclasses.asdict(dataclasses.replace(self, mesh=None, base=(), batch_specs=None))
    out["mesh"] = None if self.mesh is None else dict(self.mesh.shape)
    out["base"] = [_short(t) for t in self.base]            # Spatial holds a Mesh
    out["batch_specs"] = None if self.batch_specs is None else [
        [a if a is None or isinstance(a, str) else list(a) for a in s] for s in self.batch_specs]
    out["choices"] = [dict(dataclasses.asdict(c), policy=c.label) for c in self.choices]
    out["techniques"] = [repr(t) for t in self.techniques]
    return out


def _short(technique) -> str:
  if isinstance(technique, surgery.Spatial):
    data = "" if technique.data_axis is None else f", the batch over {technique.data_axis!r}"
    return (f"jmem.Spatial over the mesh axes {technique.axes}{data} "
            f"({dict(technique.mesh.shape)})")
  return f"jmem.InPlaceABN(where={technique.where!r})"


def _policies(choices) -> tuple[Policy, ...]:
  return tuple(t for t in (c.technique() for c in choices) if t is not None)


def _size(n: float) -> str:
  if abs(n) >= 2**30:
    return f"{n / 2**30:.2f} GiB"
  if abs(n) < 2**20 / 100:
    return f"{n / 2**10:.1f} KiB"
  return f"{n / 2**20:.{1 if abs(n) >= 10 * 2**20 else 2}f} MiB"


class BudgetNotMetWarning(UserWarning):
  """`jmem.plan` returned a plan that does not fit its budget (``Plan.fits`` is False)."""


def _largest(lo, hi, budget, multiple: int = 1) -> int:
  """The largest batch, a multiple of ``multiple``, on the line through two compiled
  ``(batch, bytes)`` points within ``budget`` (a prediction; 0 if none fits)."""
  (b_lo, bytes_lo), (b_hi, bytes_hi) = lo, hi
  slope = (bytes_hi - bytes_lo) / (b_hi - b_lo)
  if slope <= 0:
    return b_hi if bytes_hi <= budget else 0
  return max(0, int((budget - (bytes_lo - slope * b_lo)) // slope)) // multiple * multiple


def _calibrated(estimated, compiled, floor: float = 0.0) -> tuple[tuple[float, float], ...]:
  """The upgrade path's ``estimated`` (bytes, FLOPs) as its compiled points predict them.
  ``compiled``: walk index -> compiled (bytes, FLOPs), index 0 (exact) among them. Bytes:
  a compiled point's own; between two compiled points, linear in the estimate through
  them; past the last, the line through the last two (the walk's line: its slope clamped
  to [0.1, 1]; exact alone: slope 1, the estimate itself), and no lower than ``floor``
  (what does not grow with the batch: a step needs at least that). FLOPs: the estimate
  plus the compiled-less-estimated FLOPs of the compiled points, interpolated along the
  path (past the last, the last's)."""
  known = sorted(compiled)
  out = []
  for i, (e, f) in enumerate(estimated):
    if i in compiled:
      out.append(tuple(map(float, compiled[i])))
      continue
    lo = max(k for k in known if k < i)
    hi = min((k for k in known if k > i), default=None)
    (e0, f0), (c0, g0) = estimated[lo], compiled[lo]
    if hi is not None:
      (e1, f1), (c1, g1) = estimated[hi], compiled[hi]
      t = (e - e0) / (e1 - e0) if e1 != e0 else (i - lo) / (hi - lo)
      u = (i - lo) / (hi - lo)
      out.append((c0 + t * (c1 - c0), f + (g0 - f0) + u * ((g1 - f1) - (g0 - f0))))
      continue
    prev = [k for k in known if k < lo]
    slope = 1.0
    if prev:
      (ep, _), (cp, _) = estimated[prev[-1]], compiled[prev[-1]]
      slope = _compiled_slope((ep, cp), (e0, c0), 0.1, 1.0)   # the walk's clamp
    out.append((max(c0 + slope * (e - e0), floor), f + (g0 - f0)))
  return tuple(out)


def _pareto(points):
  """The ``(FLOPs, bytes)`` points that no point of fewer or equal FLOPs matches in bytes
  (the fewest bytes at each FLOPs), by FLOPs."""
  front = []
  for f, b in sorted(set(points)):
    if not front or b < front[-1][1]:
      front.append((f, b))
  return front


def write(plan_: Plan, output_dir: str, *, stem: str = "plan") -> list[str]:
  """``<stem>.json``, ``<stem>.md`` and ``<stem>_front.png`` (memory against FLOPs along
  the upgrade path as its compiles predict it, every step compiled at the batch, the plan
  marked, and the front of the compiled ones)."""
  import os  # pylint: disable=g-import-not-at-top
  os.makedirs(output_dir, exist_ok=True)
  paths = [os.path.join(output_dir, f"{stem}.{ext}") for ext in ("json", "md")]
  with open(paths[0], "w") as f:
    json.dump(plan_.to_json(), f, indent=1)
  with open(paths[1], "w") as f:
    f.write("# jmem plan\n\n" + plan_.table() + "\n")
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  except ImportError:
    return paths
  unit, scale = ("GiB", 2**30) if plan_.exact_device_bytes >= 2**30 else ("MiB", 2**20)
  timed = plan_.objective != "FLOPs" and bool(plan_.exact_seconds)
  unit_cost = plan_.exact_seconds if timed else max(plan_.exact_flops, 1)
  mem = np.array([p[0] for p in plan_.front]) / scale
  fl = np.array([p[1] for p in plan_.front]) / unit_cost
  fig, ax = plt.subplots(figsize=(6, 4))
  walk = slice(0, len(fl) - 1 if plan_.off_walk else len(fl))   # the top-rung try is apart
  ax.plot(fl[walk], mem[walk], ".-", color="0.6",
          label="upgrade path (predicted from the compiled points)")
  cost_of = (lambda i, f: plan_.measured_seconds[i] / unit_cost) if timed else (
      lambda i, f: f / unit_cost)
  here = plan_.seconds / unit_cost if timed else plan_.flops / unit_cost
  steps = [(cost_of(i, f), b / scale) for i, (what, b, f) in enumerate(plan_.measured)
           if what != "exact" and (b, f) != (plan_.device_bytes, plan_.flops)]
  if steps:
    ax.plot(*zip(*steps), "x", color="C2", label="other steps compiled")
  front = _pareto([(cost_of(i, f), b / scale) for i, (_, b, f) in enumerate(plan_.measured)])
  if len(front) > 1:
    ax.step(*zip(*front), where="post", color="C2", lw=1, alpha=0.7,
            label=f"compiled front (fewest bytes at each {'time' if timed else 'FLOPs'})")
  ax.plot(here, plan_.device_bytes / scale, "*", ms=12,
          color="C1", label="chosen (compiled)")
  ax.plot(1.0, plan_.exact_device_bytes / scale, "s", color="k", label="exact (compiled)")
  ax.axhline(plan_.budget_bytes / scale, color="C3", ls="--", label="budget")
  ax.set_ylim(bottom=0)              # the budget line and exact's bytes set the top
  ax.set_xlabel("estimated step time / exact" if timed else "step FLOPs / exact")
  ax.set_ylabel(f"device {unit} at batch {plan_.batch_size}")
  ax.legend(fontsize=8)
  fig.tight_layout()
  png = os.path.join(output_dir, f"{stem}_front.png")
  fig.savefig(png, dpi=120)
  plt.close(fig)
  return paths + [png]
