"""`jmem.plan` (`jmem.planner.plan`): per-site memory policies that fit a model's train
step into a budget at the least extra compute.

::

  plan = jmem.plan(model, (x, y), budget="16GiB")     # x, y: arrays or ShapeDtypeStructs
  print(plan)                                          # per-site table, peak, FLOPs, batch
  model = jmem.convert(model, *plan.techniques)
  # Your own loss (a regression head, float targets): one loss per example, as optax's.
  plan = jmem.plan(regressor, (x, t), "60%", loss_fn=lambda out, t: optax.l2_loss(out, t).sum(-1))

The model is a linen or an NNX module, as `jmem.convert` takes (an NNX model is planned on
``nnx.clone`` copies: yours is converted only when you call `jmem.convert` with the plan).
The sites are `jmem.convert`'s default block sites (the direct children of the top module
but its ``Dense`` / ``nnx.Linear`` layers, as `jmem.Remat`'s); a site that holds over half
of the saved activations (a per-frame CNN called as one submodule) is replaced by the
module calls directly inside it where they hold at least 90% of its bytes, down to three
levels (one site leaves the walk compressing all of it or recomputing all of it, and
recomputing the largest block keeps its whole forward live in its backward: no smaller
peak). Each site gets a `jmem.Policy`. How:

1. **Estimates, traced only.** The exact step's residuals are attributed to the sites by
   the module path of the equation that made them (`jmem.measure.Residual.scope`; NNX,
   which names no scopes, is traced through a copy whose sites run in a
   ``jax.named_scope`` of their path); each
   site's input size and forward FLOPs (convolutions and matmuls) come from the same
   trace. Per site and policy: the bytes it would keep per example (save: its residuals;
   compress at ``b`` bits: ``b`` of each value's bits plus group metadata; recompute: its
   input; recompute from a ``b``-bit input: that input at ``b`` bits plus 1-bit masks) and
   the FLOPs it adds (a recomputation: the site's forward; a quantizer: a few per value).
2. **A path of upgrades.** From "save everywhere", one site moves one rung up its ladder
   at a time (save -> compress at 8, 4, 2, 1 bits -> recompute from a 2-bit input; exact
   only: save -> recompute; ``policies=`` and ``bits=`` choose the rungs): every site
   climbs a rung before any climbs the next (all at 8 bits before one goes to 4: fewer
   bits only where the budget needs them), the site with the most bytes saved per FLOP
   added first (a rung that keeps no less is skipped), until the predicted step fits. Down the
   compression rungs (8 -> 4 -> 2 -> 1 bits, which add no FLOPs) the order is GACT's
   instead when the gradient sensitivities are known (``calibration_batch=``: measured
   at 2 bits on a few real examples at the initial weights, `jmem.surgery.sensitivities`;
   or your own ``sensitivities=``): most bytes saved per gradient variance added, the
   variance a site adds at ``b`` bits being about ``C / (2^b - 1)^2``, so the sites whose
   gradients tolerate it get fewer bits first. The prediction is
   ``fixed + batch * (working + sum of the sites' bytes)``, with ``fixed`` and
   ``working`` (what no site holds: the head, inline code, the backward's working set)
   from the compiled exact step at two batch sizes. A tighter budget walks further along
   the same path, so a plan that fits should need no fewer FLOPs (with InPlace-ABN, item
   4, the cheaper of the walk's plan and a fixed-cost alternative keeps that). Not a
   proof, and it has failed: the compiled steps that steer the walk and the undo step
   depend on the budget, and compiled FLOPs need not grow along the path as estimated
   (the 2 x 4-device CNN of the plan_ladder_sweep study of docs/decisions.md with the walk of
   commit 08fb59f, before the cheaper-top try of item 3: 1.125x exact's FLOPs at 92%,
   1.084x at 90%, where a site at 1 bit compiled to more FLOPs than recomputed from 2
   bits).
3. **Confirmed by compiling.** The chosen plan's step is compiled at the batch: the
   reported peak is XLA's. Where it does not fit, the walk goes on to the first point that
   the line through the last two compiled misses (compiled against predicted bytes, its
   slope clamped to [0.1, 1]) puts within the budget (none: the walk's end); once a point
   fits, to the first between the last miss and it that the line through those two puts
   within (regula falsi; none: the point halfway), so a plan found past a short estimate
   comes back towards the fewest bit reductions and FLOPs, keeping a compile for the tries
   below where one of them will run; at most ``max_compiles`` compiles. A step from
   compression into recomputation first compiles the last point before it (the
   recomputation's estimate is the least sure). Where the walk's end misses and a compile
   is left, one more tries every site that saves anything on the top rung (a site the
   estimate keeps at 1 bit may compile smaller recomputed from 2 bits); so does one where
   the walk's plan fits but the estimate puts the top rung at fewer FLOPs (a small CNN,
   whose quantizer outweighs its convolutions), taken if it fits at fewer compiled FLOPs.
   If nothing fits, the plan is the smallest step compiled. With sensitivities, once a plan
   fits, the compiles left try it with the bit reductions the prediction (the estimate
   through the plan's compiled bytes, at the compiled slope from the last miss, at least
   0.1 and not capped at 1) says the budget does not need undone (the one adding the most
   variance first): the walk lowers many small tolerant sites before a large sensitive one,
   and may not have needed all of them. A try is kept only if it fits; the next is scaled
   by the slope between the plan and the step compiled before it (`_undo_tries`). Where
   the plan's compiled step names each site's packed codes (linen models), its heap layout
   (`jmem.measure.heap_layout`, read from the same compile) predicts the tries instead: the
   codes resized by the bits and the buffers placed again, which sees what the estimate
   cannot (codes dead at the peak may cost nothing, or grow the heap's layout; a
   prediction adds the placement's own error on the plan's step); such a try leaves
   reductions of under 1% of the plan's added variance and tries them alone once nothing
   else is predicted to fit, and where nothing is or a try it predicted misses, the
   estimate's line takes over. A step compiled before is judged by its compiled bytes.
   The largest batch at the budget is predicted by the line through the plan compiled at
   two batch sizes (one compile more).

4. **InPlace-ABN alone.** Where the exact step does not fit and the model has BatchNorms
   InPlace-ABN can take (followed by leaky_relu or elu in a Sequential,
   `jmem.surgery.inplace_abn_sites`), InPlace-ABN on all of them (exact: it keeps each
   BatchNorm's output only) is compiled once, and it is the plan where it fits at fewer
   compiled FLOPs than the walk's plan, or fits where that does not (or, nothing fitting,
   comes closer to the budget). The comparison is on
   compiled FLOPs: the estimates count only convolutions and matmuls, so they cannot rank
   InPlace-ABN's elementwise work against a recomputation's. InPlace-ABN under per-site
   policies is not searched: a walk from it, tried first, took compiles the plain walk
   needed, and never gave the plan in a sweep of the third-party NNX CNN, where no policy
   stacked on InPlace-ABN compiles more than 0.1% below InPlace-ABN alone's bytes (inside
   a compressed site its output stays full precision:
   the plan_inplace_abn_stack study of docs/decisions.md).

5. **Devices.** With ``mesh=``, every step (the exact one too) is compiled with the batch
   split over ``data_axis`` (data parallelism) and/or its H and W over ``spatial_axes``
   (then stacked on ``jmem.Spatial(mesh)``), the train state replicated; the budget and
   the figures are per device, and the sites' estimates are the one-device trace's
   divided by the devices of those axes. With the data axis alone, on a GPU these
   compiles use XLA for the quantizer, as `jmem.parallel.data_parallel` trains (XLA
   cannot split a Pallas call over the batch). With ``devices=N`` instead of a mesh, the
   planner lays the devices out: the batch over the most of them that divide it and N
   (per device, splitting the batch or the image keeps the same share of the
   activations, and the batch needs no halo exchange: in the plan_layouts study of
   docs/decisions.md, at batch 8 the 8-way batch split has both the fewest bytes and the
   fewest collectives; at batch 2 the fewest bytes are with the batch split 2 ways, 702
   MiB, and no layout leaving it unsplit needs under 735 MiB), the image's H x W over
   the rest, split every way the sides allow (at most 4), the exact step compiled on each:
   of the splits within 2% of the fewest device bytes, the one with the fewest collectives
   (the halo sizes did not rank them).

Not searched: ``offload``. On CPU, one memory for host and device, it saves nothing, so
only a GPU compile could measure it; on a GPU the walk's cost, FLOPs, counts none of its
host transfers, and where it was measured it lost on both figures: on an H100, ResNet-50
224² at batch 64 (benchmarks/results/gpu/gpu_nvidia_h100_80gb_hbm3_run4.md), full-precision
``Policy("offload")`` at every site compiled to 0.97x exact's temp bytes and stepped in
11.5x exact's time (310.6 against 27.1 ms), where ``recompute-2bit`` compiled to 0.29x at
1.21x; in an earlier run (gpu_h100_first_figures.md, run 3: unmasked kernels, a non-finite
loss) ActNN L4's offload of the 2-bit codes had compiled larger than L3, which keeps them
(3.51 against 2.28 GiB), and stepped 1.76x as long. The plan's notes say which applies.
Why offload left the H100's peak where it was is not yet known: `benchmarks/gpu_offload.py`,
for the next GPU, reads the figures that could show it from the compiled schedule's host
copies.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import numbers
import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jmem import _backends
from jmem import measure
from jmem import surgery
from jmem import step as step_lib
from jmem._technique import BenchTechnique
from jmem.ops.actnn import quantize as actnn_quantize
from jmem.ops.actnn import technique as actnn_technique
from jmem.ops.policy import Policy
from jmem.parallel.data_parallel import data_parallel
from jmem.techniques import register_technique

__all__ = ["plan", "Plan", "SiteChoice", "parse_bytes", "budget_share", "step_cost",
           "compile_step", "POLICY_KINDS", "site_ladder", "BudgetNotMetWarning"]

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
# A site's ladder (`site_ladder`) has rungs (policy kind, bits); approximate policies first
# climb these bit widths (`plan(bits=...)` allows some of them).
_COMPRESS_BITS = (8, 4, 2, 1)
# The site policies `plan(policies=...)` may allow (``save`` is always allowed).
POLICY_KINDS = ("compress", "recompute", "recompute_compressed")
# `Plan.measured`'s name for the one compile off the walk: every site on its top rung.
_TOP_RUNG = "every site on the top rung"
# XLA FLOPs per quantized value, compress and decompress (a measured order of magnitude:
# ActNN L3 on ResNet-50 costs 1.03x exact's FLOPs); the plan's reported FLOPs are XLA's.
_QUANTIZE_FLOPS = 12.0
# Input values of the sensitivity batch, at most (16 examples of 128x128x1; 2 of 224x224x3).
_CALIBRATION_VALUES = 2**18


def budget_share(budget) -> float | None:
  """``"50%"`` -> 0.5 (a share of the exact step's device bytes); None for anything that
  is not a percentage. Raises ValueError for a share outside (0%, 100%]."""
  if isinstance(budget, str) and budget.strip().endswith("%"):
    try:
      value = float(budget.strip()[:-1])
    except ValueError:
      value = float("nan")
    if not 0 < value <= 100:
      raise ValueError(f"budget {budget!r}: a share of the exact step's bytes must be in "
                       "(0%, 100%].")
    return value / 100
  return None


def parse_bytes(budget: int | str) -> int:
  """A device memory size in bytes (int), one meaning everywhere:

  * an int: bytes (``16 * 2**30``), at least 1 KiB (``16`` is refused: 16 GiB is
    ``"16GiB"``);
  * a string with a unit: ``"16GiB"``, ``"12.5 GB"``, ``"800MiB"``, ``"1000B"``;
  * a string of a bare number: GiB (``"1.5"``), as ``jmem plan --budget 1.5`` and ``jmem
    bench --budgets 16,80`` take it.

  A float is refused (bytes or GiB? say which), as is a size of zero or less.
  """
  if isinstance(budget, (bool, np.bool_)):
    raise ValueError(f"budget must be a size, got {budget!r}.")
  if isinstance(budget, numbers.Integral):
    if budget < 1:
      raise ValueError(f"budget must be more than 0 bytes, got {budget!r}.")
    if budget < 1024:      # no train step fits: a number of GiB meant as one, surely
      raise ValueError(f"budget {budget!r} is {budget} bytes (an int is bytes), which no train "
                       f"step fits in: for {budget} GiB give '{budget}GiB' or "
                       f"{budget} * 2**30.")
    return int(budget)
  if isinstance(budget, numbers.Real):
    raise ValueError(f"budget {budget!r}: a bare float is ambiguous (bytes or GiB?): give "
                     "bytes as an int (e.g. 16 * 2**30) or a string with a unit ('1.5GiB').")
  if isinstance(budget, str):
    m = re.fullmatch(r"\s*([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", budget)
    if m and (not m.group(2) or m.group(2).lower() in _UNITS):
      unit = _UNITS[m.group(2).lower()] if m.group(2) else 2**30    # bare: GiB
      value = float(m.group(1)) * unit
      if not value >= 1:
        raise ValueError(f"budget {budget!r} must be more than 0 bytes (at least 1 byte).")
      return int(value)
  raise ValueError(f"budget {budget!r} is not a size: give bytes (an int) or a string such as "
                   "'16GiB', '800MiB', '12GB' or '1.5' (GiB).")


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
  """

  path: str
  kind: str
  bits: int | None
  saved_bytes: float
  added_flops: float
  sensitivity: float | None = None

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
    front: the (device bytes, FLOPs) of each point of the upgrade path as the walk's
      compiles predict them (`_calibrated`: the compiled figures where a point was
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
    share = "" if self.devices == 1 else f", per device of {self.devices}"
    lines = [f"| site | policy | saved MiB / example{share}, estimated | added MFLOPs / "
             f"example{share}, estimated |" + (" gradient sensitivity C |" if sens else ""),
             "|---|---|---:|---:|" + ("---:|" if sens else "")]
    for c in self.choices:
      lines.append(f"| {c.path} | {c.label} | {c.saved_bytes / 2**20:.2f} | "
                   f"{c.added_flops / 1e6:.1f} |" + (f" {c.sensitivity:.3g} |" if sens else ""))
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


def compile_step(model, optimizer, x, y, *, abstract=None, mesh=None, specs=None,
                 loss_fn=None):
  """``model``'s donating train step (`jmem.step`'s, with ``optimizer`` and ``loss_fn``,
  default: cross-entropy with integer labels) compiled for the batch ``x``, ``y`` (arrays
  or ShapeDtypeStructs); ``abstract``: the train state's shapes, if already known. With
  ``mesh`` (a `jax.sharding.Mesh`), the batch is sharded over it by ``specs`` (x's and
  y's `PartitionSpec`) and the train state replicated, as `jmem.plan(mesh=...)` compiles
  it: its figures are then per device."""
  return _lowered_step(model, optimizer, x, y, abstract=abstract, mesh=mesh,
                       specs=specs, loss_fn=loss_fn).compile()


def _lowered_step(model, optimizer, x, y, **kwargs):
  """`compile_step`'s step lowered (the ``jax.stages.Lowered`` it compiles)."""
  step, args = _train_step(model, optimizer, x, y, **kwargs)
  return step.lower(*args)


def _train_step(model, optimizer, x, y, *, abstract=None, mesh=None, specs=None,
                loss_fn=None):
  """``(step, args)``: `compile_step`'s jitted step and the abstract arguments it is
  compiled for (the same arguments)."""
  fns = step_lib.model_fns(model)
  if abstract is None:
    abstract = step_lib.abstract_state(fns, optimizer, x)
  if (mesh is None) != (specs is None) or specs is not None and (
      isinstance(specs, P) or len(specs) != 2 or not all(isinstance(s, P) for s in specs)):
    raise ValueError(f"compile_step takes mesh= and specs=(x's PartitionSpec, y's) together "
                     f"(or neither: one device), got mesh={mesh!r}, specs={specs!r}.")
  if mesh is not None:
    on = lambda a, spec: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                              sharding=NamedSharding(mesh, spec))
    x, y = on(x, specs[0]), on(y, specs[1])
    abstract = jax.tree.map(lambda a: on(a, P()), abstract)
  return step_lib.make_train_step(fns, optimizer, donate=True, loss_fn=loss_fn), (abstract, x, y)


def step_cost(model, optimizer, x, y, *, abstract=None, mesh=None,
              specs=None, loss_fn=None) -> tuple[int, float]:
  """``(device bytes, FLOPs)`` of `compile_step` (the same arguments): per device with
  ``mesh``; FLOPs by `jmem.measure.step_flops` (off the CPU, the lowered module's)."""
  lowered = _lowered_step(model, optimizer, x, y, abstract=abstract, mesh=mesh, specs=specs,
                          loss_fn=loss_fn)
  return measure.device_bytes_and_flops(lowered.compile(), lowered)


def _size(n: float) -> str:
  if abs(n) >= 2**30:
    return f"{n / 2**30:.2f} GiB"
  if abs(n) < 2**20 / 100:
    return f"{n / 2**10:.1f} KiB"
  return f"{n / 2**20:.{1 if abs(n) >= 10 * 2**20 else 2}f} MiB"


# ------------------------------------------------------------------ per-site estimates

@dataclasses.dataclass
class _Site:
  path: str
  residual_bytes: float = 0.0       # per example, exact
  input_bytes: float = 0.0          # per example
  input_values: float = 0.0         # per example (in whatever dtype the site takes)
  forward_flops: float = 0.0        # per example
  values: float = 0.0               # residual values per example (quantizer work)


def _flops_of(eqn) -> float:
  name = eqn.primitive.name
  if name == "dot_general":
    (lc, _), _ = eqn.params["dimension_numbers"]
    k = math.prod(eqn.invars[0].aval.shape[i] for i in lc)
    return 2.0 * math.prod(eqn.outvars[0].aval.shape) * k
  if name == "conv_general_dilated":
    rhs = eqn.invars[1].aval.shape
    dn = eqn.params["dimension_numbers"]
    spatial = math.prod(rhs[i] for i in dn.rhs_spec[2:])
    in_features = rhs[dn.rhs_spec[1]]
    return 2.0 * math.prod(eqn.outvars[0].aval.shape) * spatial * in_features
  return 0.0


def _walk(jaxpr, visit):
  for eqn in jaxpr.eqns:
    visit(eqn)
    for v in eqn.params.values():
      inner = getattr(v, "jaxpr", v)
      if hasattr(inner, "eqns"):
        _walk(inner, visit)


def _owner(scope: str, paths: Sequence[str]) -> str | None:
  for p in paths:
    if scope == p or scope.startswith(p + "/"):
      return p
  return None


def _nnx_probe(model, paths, record):
  """A copy of the NNX ``model`` whose calls of the sites ``paths`` give their arguments to
  ``record(path, args)`` and run in a ``jax.named_scope`` of their path (under one of the top
  module's class name, as linen's name stack is), so `jmem.measure.module_path` finds them."""
  probe = nnx.clone(model)

  def scoped(base, name, path):
    def __call__(self, *args, **kwargs):  # pylint: disable=invalid-name
      if path is not None:
        record(path, args)
      with jax.named_scope(name):
        return base.__call__(self, *args, **kwargs)
    return type(base.__name__, (base,), {"__call__": __call__, "__module__": base.__module__,
                                         "__qualname__": base.__qualname__})

  for p, m in list(nnx.iter_graph(probe)):
    path = "/".join(str(k) for k in p)
    if path in paths:
      m.__class__ = scoped(type(m), path, path)
  probe.__class__ = scoped(type(probe), type(probe).__name__, None)
  return probe


def _estimate_sites(model, optimizer, x, y, paths, loss_fn=None) -> tuple[list[_Site], float]:
  """Per-example residual bytes, input bytes and forward FLOPs of each site, and the
  residual bytes no site holds; traced at the example batch."""
  batch = x.shape[0]
  sites = {p: _Site(p) for p in paths}

  def record(path, args):
    if path in sites and not sites[path].input_bytes:
      arrays = [a for a in jax.tree.leaves(args) if hasattr(a, "dtype")]
      sites[path].input_bytes = float(sum(a.size * a.dtype.itemsize for a in arrays))
      sites[path].input_values = float(sum(a.size for a in arrays))

  if isinstance(model, nnx.Module):
    fns = step_lib.model_fns(_nnx_probe(model, set(paths), record))
    calls = contextlib.nullcontext
  else:
    fns = step_lib.model_fns(model)

    def intercept(next_fun, args, kwargs, context):    # linen: method interception
      if context.method_name == "__call__" and context.module.scope:
        record("/".join(context.module.scope.path), args)
      return next_fun(*args, **kwargs)
    calls = lambda: nn.intercept_methods(intercept)
  abstract = step_lib.abstract_state(fns, optimizer, x)
  loss = step_lib.make_loss(fns, loss_fn)
  rng = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
  report = measure.saved_residuals(lambda *a: loss(*a)[0], abstract.params,
                                   abstract.model_state, x, y, rng, argnums=0)
  outside = 0.0
  for r in report.residuals:
    if r.source != "activation":
      continue
    owner = _owner(r.scope, paths)
    if owner is None:
      outside += r.nbytes
    else:
      sites[owner].residual_bytes += r.nbytes
      sites[owner].values += math.prod(r.shape)

  def forward(params, model_state, xb):
    with calls():
      return fns.apply(params, model_state, xb, train=True, rng=jax.random.key(0))
  closed = jax.make_jaxpr(forward)(abstract.params, abstract.model_state, x)

  def visit(eqn):
    owner = _owner(measure.module_path(eqn), paths)
    if owner is not None:
      sites[owner].forward_flops += _flops_of(eqn)
  _walk(closed.jaxpr, visit)
  out = list(sites.values())
  for s in out:
    for f in ("residual_bytes", "input_bytes", "input_values", "forward_flops", "values"):
      setattr(s, f, getattr(s, f) / batch)
  return out, outside / batch


def _kept(site: _Site, rung) -> tuple[float, float]:
  """(bytes per example the site keeps, FLOPs per example it adds) on ``rung``."""
  kind, bits = rung
  if kind == "save":
    return site.residual_bytes, 0.0
  meta = 8.0 / 256                        # a scale and a zero per 256-value group
  if kind == "compress":
    return site.values * (bits / 8 + meta), _QUANTIZE_FLOPS * site.values
  if kind == "recompute":
    return site.input_bytes, site.forward_flops
  if kind == "recompute_compressed":
    inputs = site.input_values
    masks = site.values / 8 / 4           # some of the values are masks, at 1 bit
    return inputs * (bits / 8 + meta) + masks, site.forward_flops + _QUANTIZE_FLOPS * inputs
  raise ValueError(kind)


def site_ladder(policies: Sequence[str] | str | None = None, approximate: bool = True,
                bits: Sequence[int] | int | None = None) -> tuple:
  """The rungs ``(policy kind, bits)`` of every site's ladder for `plan`'s ``policies``,
  ``approximate`` and ``bits``, from ``("save", None)`` up; raises ValueError for a
  combination `plan` refuses."""
  if policies is None:
    kinds = ("compress", "recompute_compressed") if approximate else ("recompute",)
  else:
    kinds = (policies,) if isinstance(policies, str) else tuple(policies)
  bad = [k for k in kinds if k not in POLICY_KINDS]
  if "offload" in bad:
    raise ValueError(
        "policies= (--policies): the planner does not search 'offload' (the module docstring "
        "says why: on CPU it saves nothing, and on an H100 full-precision offload at every "
        "site of ResNet-50 kept 0.96x exact's peak at 11.5x the step time). Plan without it; "
        "to offload sites yourself, add jmem.Policy('offload', where=...) to the plan's "
        f"techniques. Searchable: {list(POLICY_KINDS)}.")
  if not kinds or bad:
    raise ValueError(f"policies= (--policies) takes site policies of {list(POLICY_KINDS)} "
                     f"(save is always allowed), at least one; got {list(kinds)!r}.")
  quantized = [k for k in kinds if k != "recompute"]
  if not approximate and quantized:
    raise ValueError(f"approximate=False keeps the gradients exact, but policies allows "
                     f"{quantized}, which quantize: allow only 'recompute', or drop "
                     "approximate=False (--exact-only).")
  widths = _COMPRESS_BITS if bits is None else _bit_widths(bits)
  if bits is not None and not quantized:
    raise ValueError(
        "bits= (--bits) sets the widths of quantized values, but "
        + ("approximate=False (--exact-only) quantizes nothing: drop bits or approximate=False."
           if not approximate else
           f"the policies allowed ({', '.join(kinds)}) quantize nothing: allow compress or "
           "recompute_compressed, or drop bits."))
  ladder = [("save", None)]
  if "compress" in kinds:
    ladder += [("compress", b) for b in widths]
  if "recompute_compressed" in kinds:   # from a 2-bit input, or the fewest bits above 1
    ladder.append(("recompute_compressed", min([b for b in widths if b > 1] or [1])))
  elif "recompute" in kinds:
    ladder.append(("recompute", None))
  return tuple(ladder)


def _bit_widths(bits) -> tuple[int, ...]:
  """``bits`` (an int or ints, of `_COMPRESS_BITS`, each once) as Python ints, most first."""
  scalar = isinstance(bits, (numbers.Number, str, bytes, np.ndarray)) and np.ndim(bits) == 0
  try:
    items = [bits] if scalar else list(bits)
  except TypeError:
    items = []
  integral = all(isinstance(b, numbers.Integral) and not isinstance(b, (bool, np.bool_))
                 for b in items)
  widths = [int(b) for b in items] if integral else []
  if not widths or any(b not in _COMPRESS_BITS for b in widths) or \
      len(set(widths)) != len(widths):
    raise ValueError(f"bits= (--bits) takes the bit widths a quantized value may have, some "
                     f"of {list(_COMPRESS_BITS)} (integers), each once; got {bits!r}.")
  return tuple(sorted(widths, reverse=True))


def _rung_text(rung) -> str:
  kind, bits = rung
  return {"save": "save", "compress": f"compressed at {bits} bit{'s' * (bits != 1)}",
          "recompute": "recomputed",
          "recompute_compressed": f"recomputed from a {bits}-bit input"}[kind]


def _variance(sensitivity: float, rung) -> float:
  """The gradient variance a site of GACT sensitivity ``sensitivity`` adds on ``rung``."""
  kind, bits = rung
  return sensitivity / float(2**bits - 1) ** 2 if kind == "compress" else 0.0


def _upgrade_path(sites, ladder, sensitivity=None):
  """The sequence of (rungs per site) from all-save, one rung at a time: the lowest rung
  any site has not passed first (so every site is at 8 bits before one goes to 4), and
  among the sites that can take it, the most bytes saved per FLOP added (per byte where
  it adds none); from one compression rung to the next (fewer bits, no more FLOPs), with
  ``sensitivity`` (path -> GACT ``C``), the most bytes saved per gradient variance added."""
  state = [0] * len(sites)
  path = [tuple(state)]
  while True:
    best, best_key = None, None
    for i, site in enumerate(sites):
      if state[i] + 1 >= len(ladder):
        continue
      b0, f0 = _kept(site, ladder[state[i]])
      b1, f1 = _kept(site, ladder[state[i] + 1])
      saved, added = b0 - b1, max(f1 - f0, 0.0)
      if saved <= 0:
        continue                          # a rung that keeps no less is never worth it
      if sensitivity is not None and ladder[state[i]][0] == ladder[state[i] + 1][0] == "compress":
        c = sensitivity[site.path]
        added = _variance(c, ladder[state[i] + 1]) - _variance(c, ladder[state[i]])
        key = (-state[i], saved / added if added > 0 else math.inf, saved)
      else:
        key = (-state[i], saved / max(added, 1.0), saved)
      if best_key is None or key > best_key:
        best, best_key = i, key
    if best is None:
      return path
    state[best] += 1
    path.append(tuple(state))


# ------------------------------------------------------------------ the plan

def _converted(model, techniques):
  """``jmem.convert(model, *techniques)``; of a copy for an NNX model (convert changes an
  NNX model in place, and the planner converts it many times)."""
  if isinstance(model, nnx.Module):
    model = nnx.clone(model)
  return surgery.convert(model, *techniques)


def _default_sites(model, x, where: str | None = None) -> list[str]:
  """`jmem.convert`'s block sites of ``model`` (``where``: those its regex matches)."""
  probe = Policy("save", where=where)
  if isinstance(model, nnx.Module):
    return list(surgery.sites(_converted(model, [probe])).get("save", []))
  kw = step_lib.mode_kwargs(model, True)
  return list(surgery.sites(surgery.convert(model, probe), x, **kw).get(repr(probe), []))


# A site holding more than this share of the saved activations is planned per module inside
# it, where its children hold at least _COVERED of its bytes (and there are two or more).
_DOMINANT, _COVERED, _MAX_DEPTH = 0.5, 0.9, 3


def _split_dominant(model, optimizer, xs, ys, paths, sites, outside, loss_fn=None):
  """``(paths, sites, outside, notes)`` with a site that holds most of the saved activations
  (a per-frame CNN applied as one submodule, an encoder) replaced by the module calls
  directly inside it (inside the one module it wraps, where it wraps one), repeatedly: one
  site would leave the walk one choice (compress it all, or recompute it all, which keeps
  its whole forward live in the backward: no smaller peak)."""
  notes = []
  x0 = jnp.zeros(xs.shape, xs.dtype)
  for _ in range(_MAX_DEPTH):
    total = sum(s.residual_bytes for s in sites) + outside
    big = max(sites, key=lambda s: s.residual_bytes)
    if big.residual_bytes <= _DOMINANT * total:
      break
    try:
      inner = _default_sites(model, x0, where=re.escape(big.path) + "/[^/]+")
      while len(inner) == 1:                # a wrapper around one module: look inside that
        inner = _default_sites(model, x0, where=re.escape(inner[0]) + "/[^/]+")
    except surgery.NothingMatched:          # no module call inside: a leaf site
      break
    if len(inner) < 2:
      break
    at = paths.index(big.path)
    new_paths = paths[:at] + inner + paths[at + 1:]
    new_sites, new_outside = _estimate_sites(model, optimizer, xs, ys, new_paths, loss_fn)
    covered = sum(s.residual_bytes for s in new_sites if s.path in inner)
    if covered < _COVERED * big.residual_bytes:
      notes.append(f"the site {big.path!r} holds {big.residual_bytes / total:.0%} of the saved "
                   f"activations, but the modules inside it only {covered / total:.0%} (the "
                   "rest is inline code): planned as one site")
      break
    notes.append(f"the site {big.path!r} held {big.residual_bytes / total:.0%} of the saved "
                 f"activations: planned per module inside it ({len(inner)} sites)")
    paths, sites, outside = new_paths, new_sites, new_outside
  return paths, sites, outside, notes


def _block_techniques(model) -> list:
  """The block techniques (`Remat`, `ActNN`, `Policy`, `SBP`) the linen ``model`` was
  converted with."""
  return [t for t in getattr(model, "techniques", ())
          if not isinstance(t, (surgery.SyncBN, surgery.InPlaceABN, surgery.Spatial))]


def plan(model, example_batch, budget, *, batch_size: int | None = None,
         approximate: bool = True, optimizer=None, max_compiles: int = 8,
         max_batch: bool = True, calibration_batch=None,
         sensitivities: Mapping[str, float] | None = None, inplace_abn: bool = True,
         mesh=None, spatial_axes: tuple | None = ("h", "w"),
         data_axis: str | None = None, devices=None,
         policies: Sequence[str] | None = None,
         bits: Sequence[int] | int | None = None, target=None, where=None,
         loss_fn=None) -> Plan:
  """Per-site policies that fit ``model``'s train step into ``budget`` (module docstring).

  Args:
    model: an unbound linen module (``apply(variables, x, train=...)``) or an NNX module
      (``model(x)``, ``model.train()``; left unchanged: planned on copies): a classifier
      with integer labels (one per example or per pixel), or any model with ``loss_fn``.
    example_batch: ``(x, y)`` arrays or `jax.ShapeDtypeStruct`s (shapes are enough): the
      inputs and their labels (with ``loss_fn``, its targets, e.g. float regression
      targets).
    budget: device bytes (int), a size string (``"16GiB"``), or a share of the exact
      step's device bytes at the batch (``"50%"``).
    batch_size: the batch to plan for (default: ``x``'s).
    approximate: allow compression (ActNN's quantizer); False keeps the gradients exact
      (save or recompute only).
    optimizer: the optimiser whose state counts against the budget (default: jmem's AdamW).
    max_compiles: the most steps compiled before the largest batch's (at least 3).
    max_batch: also compile the plan at a second batch size for its largest batch.
    calibration_batch: ``(x, y)`` arrays, at least 2 real examples shaped like the example
      batch's: the sites' gradient sensitivities, measured on them at 2 bits at the
      model's initial weights (linen: seed 0; NNX: the model's own; the first 16
      examples at most, and no more than
      2**18 input values: 2 examples of 224x224x3), order the bit reductions (the module
      docstring). It costs one gradient compile and 2 x sites + 1 gradients (in the
      plan's notes). Without it (or ``sensitivities``) they go by bytes saved.
    sensitivities: the sites' ``C`` (path -> finite float >= 0, as
      `jmem.surgery.sensitivities` gives), measured by you, e.g. on trained weights;
      instead of ``calibration_batch``.
    inplace_abn: where the exact step does not fit, also compile InPlace-ABN alone on every
      BatchNorm it can take (`jmem.surgery.inplace_abn_sites`; exact, one compile more)
      and make it the plan if it fits at fewer compiled FLOPs than the walk's plan (or
      fits where that does not, or comes closer where nothing fits). Its scale is
      ``|gamma| + epsilon``: existing weights map with `jmem.surgery.inplace_abn_params`.
    mesh: devices to shard the activations over (a `jax.sharding.Mesh`, ``AxisType.Auto``,
      of the axes ``spatial_axes`` and ``data_axis``): each step, the exact one too, is
      compiled with the batch sharded over them and the parameters and optimiser state
      replicated, and the budget and every figure are per device. With spatial axes every
      plan stacks on ``jmem.Spatial(mesh, axes=spatial_axes, data_axis=data_axis)`` (NHWC
      images sharded over H and W; per-pixel labels likewise); with ``data_axis`` the
      batch is split over it (data parallelism: BatchNorm statistics over the whole batch,
      as `jmem.parallel.data_parallel` trains it), and the batch sizes are multiples of
      its size.
    spatial_axes: the mesh axes of H and W (None for a side: not sharded; None: no
      jmem.Spatial, for data parallelism alone).
    data_axis: the mesh axis the batch is split over (None: not split).
    devices: instead of ``mesh``, ``data_axis`` and ``spatial_axes``: a number of devices
      (the first of `jax.devices()`) or a sequence of them, which the planner lays out: the
      batch over as many as divide it (data parallelism: no halo exchange), the image's H
      and W over the rest (``jmem.Spatial``; split every way the sides allow, at most 4
      (`_lay_out`), each exact step compiled: of those within 2% of the fewest device bytes, the one
      with the fewest collectives; those compiles are in ``Plan.compiles`` and not counted
      against ``max_compiles``). ``Plan.mesh`` is the mesh it made.
    policies: the site policies the walk may use besides ``save``, of `POLICY_KINDS`:
      ``"compress"`` (at 8, 4, 2 and 1 bits; ``bits=`` narrows them), ``"recompute"``,
      ``"recompute_compressed"`` (from a 2-bit input; see ``bits``); one kind may be given
      as a string. Default: compress and recompute_compressed (with
      ``approximate=False``: recompute). Plain recompute goes on the ladder only where
      recompute_compressed is not allowed (recomputing from a 2-bit input keeps less for
      the same recomputation); above the compression rungs a site climbs to it only where
      the estimate keeps less recomputed than where the site is.
      InPlace-ABN is allowed by ``inplace_abn``, jmem.Spatial by ``mesh``/``devices``.
    bits: the bit widths a quantized value may have, some of 8, 4, 2, 1 (one may be given
      as an int; default: all): ``bits=(8, 4)`` keeps at least 4 bits everywhere. The
      compress rungs are these widths; recompute_compressed recomputes from an input at
      2 bits, or where 2 is not allowed the fewest allowed above 1 (1 bit where only 1
      is). An error where the policies allowed quantize nothing.
    target: the device the budget and every compiled figure are for: a
      `jmem.measure.Target` or its name (``"h100"``: compiled for an H100 from this
      machine, XLA:GPU's buffer assignment, the kernels chosen as there; default: JAX's
      default backend). A GPU target is one device: ``mesh=`` and ``devices=`` are refused
      with it. Gradient sensitivities (``calibration_batch=``) are measured on this machine.
    where: the block sites to plan, as ``jmem.convert``'s ``where=`` takes them (a module
      class, or a regular expression over module paths such as ``"layer1/.*"``);
      default: jmem.convert's default block sites (the direct children of the top module
      but its Dense layers).
    loss_fn: the training loss, ``loss_fn(outputs, targets) -> losses`` one per example
      (or per pixel) as optax's losses are, e.g. ``lambda out, y: optax.l2_loss(out,
      y).sum(-1)`` for a regression head; every step planned and compiled minimises their
      mean (`jmem.step.make_loss`), and the sensitivities of ``calibration_batch`` are
      measured on it. Default: softmax cross-entropy with integer labels.

  Returns:
    A `Plan`; ``jmem.convert(model, *plan.techniques)`` is the planned model. If nothing
    fits, the plan whose compiled step is the smallest (exact's included), with ``fits``
    False and its excess in `Plan.table`.
  """
  fraction = budget_share(budget)
  budget_bytes = parse_bytes(budget) if fraction is None else None
  device = measure.target(target)
  if device.deviceless and (mesh is not None or devices not in (None, 1)
                            or data_axis is not None):
    raise ValueError(f"jmem.plan(target={device.name!r}) compiles for one "
                     f"{device.device_kind} from this machine; multi-device layouts (mesh=, devices=, data_axis=) are "
                     "planned on the devices themselves: drop target= or the layout.")
  if max_compiles < 3:
    raise ValueError(f"max_compiles must be at least 3 (exact at two batch sizes, the plan), "
                     f"got {max_compiles}.")
  ladder = site_ladder(policies, approximate, bits)
  if not isinstance(model, (nn.Module, nnx.Module)):
    raise TypeError(f"jmem.plan takes a flax.linen or flax.nnx Module, got "
                    f"{type(model).__name__}.")
  if isinstance(model, nnx.Module) and surgery.sites(model):
    raise ValueError(
        f"jmem.plan takes the unconverted NNX model; this one has jmem.convert sites "
        f"{surgery.sites(model)}. jmem.convert changes an NNX model in place and converts it "
        "once, so the planner, which converts copies, cannot add to it: plan the model as it "
        "was and convert it once with your techniques and the plan's, e.g. "
        "jmem.convert(model, jmem.SyncBN(...), *plan.techniques).")
  taken = _block_techniques(model)
  if taken:
    raise ValueError(f"jmem.plan chooses each block site's policy itself, but the model already "
                     f"has {taken}: plan the model before converting it with block techniques "
                     "(Remat, ActNN, Policy, SBP); BatchNorm techniques may come first, and "
                     "jmem.Spatial comes with mesh= or devices=.")
  if not (isinstance(example_batch, (tuple, list)) and len(example_batch) == 2):
    raise ValueError(
        "example_batch must be (x, y), the inputs and their labels or targets (arrays or "
        f"jax.ShapeDtypeStructs), got {type(example_batch).__name__}"
        f"{' ' + str(example_batch.shape) if hasattr(example_batch, 'shape') else ''}: e.g. "
        "jmem.plan(model, (x, jax.ShapeDtypeStruct((x.shape[0],), jnp.int32)), budget).")
  x, y = example_batch
  if loss_fn is None and hasattr(y, "dtype") and not jnp.issubdtype(y.dtype, jnp.integer):
    raise ValueError(
        f"jmem.plan's default loss is softmax cross-entropy with integer class labels, but "
        f"the labels y have dtype {y.dtype}: give class indices (e.g. y.astype(jnp.int32), or "
        "a jax.ShapeDtypeStruct of int32), or plan with your loss, e.g. for regression "
        "loss_fn=lambda out, y: optax.l2_loss(out, y).sum(-1) (one loss per example).")
  if loss_fn is not None and not callable(loss_fn):
    raise TypeError(f"loss_fn must be a function (outputs, targets) -> per-example losses, "
                    f"got {type(loss_fn).__name__}.")
  if not (np.ndim(x) and np.ndim(y)) or x.shape[0] != y.shape[0]:
    raise ValueError(f"example_batch must be (x, y) with one label (or label map) per example; "
                     f"got x of shape {np.shape(x)} and y of shape {np.shape(y)}.")
  if batch_size is not None and (isinstance(batch_size, bool) or
                                 not isinstance(batch_size, numbers.Integral) or batch_size < 1):
    raise ValueError(f"batch_size must be a positive integer (or None: x's batch, "
                     f"{x.shape[0]}), got {batch_size!r}.")
  batch = int(x.shape[0] if batch_size is None else batch_size)
  if batch < 1:
    raise ValueError(f"batch_size must be positive, got {batch}.")
  spec = lambda a, b: jax.ShapeDtypeStruct((b,) + tuple(a.shape[1:]), a.dtype)
  optimizer = optimizer or step_lib.default_optimizer(1e-3, 100)
  notes = []
  candidates = [(mesh, data_axis, spatial_axes)]
  if devices is not None:
    if mesh is not None or data_axis is not None or tuple(spatial_axes or ()) != ("h", "w"):
      raise ValueError("give jmem.plan devices= (it lays them out) or mesh= with data_axis= "
                       "and spatial_axes=, not both.")
    candidates, why = _lay_out(devices, batch, x)
    notes += [why] if why else []
  layouts = [_layout(model, m, axes, d, x, batch) for m, d, axes in candidates]
  layout = layouts[0]           # the same devices, the same batch split: only H x W differs
  fns = step_lib.model_fns(model)
  trace_batch = max(2, min(int(x.shape[0]), 8))
  xs, ys = spec(x, trace_batch), spec(y, trace_batch)
  abstract = step_lib.abstract_state(fns, optimizer, x)
  try:
    paths = _default_sites(model, jnp.zeros(xs.shape, xs.dtype), where=where)
  except surgery.NothingMatched as e:
    if where is None:
      raise
    raise surgery.NothingMatched(f"jmem.plan(where={where!r}) matched no module call of the "
                                 f"model: {e}") from e
  if not paths:
    raise ValueError("jmem.plan found no block site in the model (jmem.convert's default "
                     "sites: the direct children of the top module but its Dense layers); "
                     "name them with where= (a module class or a regular expression over "
                     "module paths).")
  sites, outside = _estimate_sites(model, optimizer, xs, ys, paths, loss_fn)
  paths, sites, outside, split = _split_dominant(model, optimizer, xs, ys, paths, sites,
                                                 outside, loss_fn)
  notes += split
  held = sum(s.residual_bytes for s in sites)
  share = held / max(held + outside, 1e-30)
  sites = _per_device(sites, layout.shards)
  if policies is not None or bits is not None:
    notes.append("site policies searched: " + ", ".join(_rung_text(r) for r in ladder))
  quantizes = any(kind == "compress" for kind, _ in ladder)   # sensitivities order these
  notes.append(_offload_note(layout.mesh, device))
  sens = None
  if sensitivities is not None and calibration_batch is not None:
    raise ValueError("give sensitivities or a calibration_batch to measure them on, not both.")
  if not quantizes and (sensitivities is not None or calibration_batch is not None):
    notes.append("sensitivities unused: " + (
        "an exact plan (approximate=False) quantizes nothing" if not approximate else
        "they order bit reductions, and the policies allowed compress nothing"))
  elif sensitivities is not None:
    missing = sorted(set(paths) - set(sensitivities))
    if missing:
      raise ValueError(f"sensitivities has no value for the sites {missing}; the plan's sites "
                       f"are {paths} (jmem.surgery.sensitivities with ActNN(where=...) on "
                       "them measures all).")
    sens = {p: float(sensitivities[p]) for p in paths}
    bad = {p: c for p, c in sens.items() if not (math.isfinite(c) and c >= 0)}
    if bad:
      raise ValueError(f"sensitivities must be finite and >= 0, got {bad}.")
  elif calibration_batch is not None:
    sens, measured_on = _measured_sensitivities(model, paths, calibration_batch, x, y,
                                                loss_fn)
    weights = "the model's weights" if isinstance(model, nnx.Module) else "the initial weights"
    notes.append(f"gradient sensitivities measured at 2 bits on {measured_on} examples at "
                 f"{weights}: one gradient compile and {2 * len(paths) + 1} gradients, "
                 "not counted in the steps compiled")
    unseen = [p for p in paths if p not in sens]
    if unseen:
      notes.append(f"sites {unseen} quantize nothing the probe saw: their sensitivity is "
                   "taken as the largest measured")
      sens.update({p: max(sens.values(), default=1.0) for p in unseen})
  elif quantizes:
    notes.append("bit reductions ordered by bytes saved, not by gradient sensitivity: pass "
                 "calibration_batch=(x, y) (a few real examples) to order them by it")
  compiles, measured = 0, []                  # measured: the steps compiled at the batch
  heaps = {}          # state -> its compiled step's heap layout (with sensitivities: undoing)
  read_heaps = sens is not None               # (until a backend writes no dump)

  def compiled(techniques, b, what=None, collectives=None, on=None, heap_of=None):
    """``(device bytes, FLOPs)`` of the step compiled on the `_Layout` ``on`` (default:
    ``layout``); ``collectives``: a list the compiled HLO's collective count is appended
    to; ``heap_of``: a state to keep the compile's heap layout for (in ``heaps``)."""
    nonlocal compiles, read_heaps
    compiles += 1
    on = on or layout
    techniques = on.base + tuple(techniques)
    m = _converted(model, techniques) if techniques else model
    # Data parallel alone on a GPU: XLA, not a Pallas call, as data_parallel trains it.
    with (_backends.automatic_xla("jmem.plan compiles the step with its batch split over "
                                  "the data axis (XLA cannot split a Pallas call over it)")
          if on.xla else contextlib.nullcontext()):
      step, args = _train_step(m, optimizer, spec(x, b), spec(y, b), abstract=abstract,
                               mesh=on.mesh, specs=on.specs(x, y), loss_fn=loss_fn)
      args = device.place(args) if device.deviceless else args
      with device.lowering():
        heap = _heap_of(step, args, notes) if heap_of is not None and read_heaps else None
        read_heaps = read_heaps and (heap_of is None or heap is not None)
        if heap is None:
          lowered = step.lower(*args)
          step = lowered.compile()
        else:
          lowered, step = heap.lowered, heap.compiled
    if heap is not None:
      heaps[heap_of] = heap
    out = measure.device_bytes_and_flops(step, lowered)
    if collectives is not None:
      collectives.append(sum(measure.collective_counts(step.as_text()).values()))
    if what is not None and b == batch:
      measured.append((what, int(out[0]), float(out[1])))
    return out

  # devices=: where H x W can be split several ways, the exact step compiled on each (the
  # halo sizes do not rank them: decisions.md); of those within 2% of the fewest device
  # bytes, the fewest collectives, then the fewest bytes.
  if len(layouts) > 1:
    counts = []
    tried = [compiled((), batch, collectives=counts, on=on) for on in layouts]
    least = min(b for b, _ in tried)
    pick = min((i for i, (b, _) in enumerate(tried) if b <= 1.02 * least),
               key=lambda i: (counts[i], tried[i][0]))
    (exact_bytes, exact_flops), layout = tried[pick], layouts[pick]
    notes.append("H x W split every way the devices and sides allow, the exact step compiled "
                 "on each (per device): " + ", ".join(
                     f"{_hw(lay)} {_size(b)} with {c} collectives"
                     for lay, (b, _), c in zip(layouts, tried, counts)) +
                 f"; the plan takes {_hw(layout)}: of those within 2% of the fewest bytes, the "
                 f"fewest collectives ({len(tried) - 1} compiles more than the plan's own, not "
                 "counted against max_compiles)")
    measured.append(("exact", int(exact_bytes), float(exact_flops)))
  searched = len(layouts) - 1                 # compiles that do not count against the bound
  left = lambda: max_compiles - (compiles - searched)    # compiles the bound still allows
  notes += [layout.note] if layout.note else []
  base = layout.base

  # The exact step at two batch sizes: fixed bytes and the per-example working bytes.
  multiple = layout.multiple                  # batch sizes the data axis divides
  small = (batch // 2 // multiple) * multiple or 2 * batch
  exact_small, _ = compiled((), small)
  if len(layouts) == 1:
    exact_bytes, exact_flops = compiled((), batch, "exact")
  if fraction is not None:
    budget_bytes = int(fraction * exact_bytes)
  notes += _reach(share, outside, paths, exact_bytes > budget_bytes)
  slope = (exact_bytes - exact_small) / (batch - small)
  fixed = exact_bytes - slope * batch
  working = slope - sum(s.residual_bytes for s in sites)   # what no site holds
  walk = _upgrade_path(sites, ladder, sens if quantizes else None)
  abn = abn_cost = None
  if exact_bytes > budget_bytes:
    abn, note = _inplace_abn(model, xs, inplace_abn, max_compiles)
    notes += [note] if note else []
    if abn is not None:
      abn_cost = compiled((abn,), batch, "InPlace-ABN alone")   # one compile

  def predicted(state):
    kept, flops = np.sum([_kept(s, ladder[r]) for s, r in zip(sites, state)], axis=0)
    return fixed + batch * (working + kept), exact_flops + batch * flops

  def choose(after: int) -> int:
    for i in range(after, len(walk)):
      if predicted(walk[i])[0] <= budget_bytes:
        return i
    return len(walk) - 1

  def choices_of(state):
    out = []
    for s, r in zip(sites, state):
      b, f = _kept(s, ladder[r])
      out.append(SiteChoice(s.path, ladder[r][0], ladder[r][1], s.residual_bytes - b, f,
                            None if sens is None else sens[s.path]))
    return tuple(out)

  costs = {}                                  # walk point -> compiled (bytes, FLOPs)

  def cost(state, what="bit reductions undone"):
    if state not in costs:
      costs[state] = compiled(_policies(choices_of(state)), batch,
                              f"walk point {walk.index(state)}" if state in walk else what,
                              heap_of=state)
    return costs[state]

  # The walk, searched by compiling: ``misses`` are the walk points compiled over the budget
  # (exact first), ``hi`` the first known to fit. Compiled bytes are taken as linear in the
  # predicted ones through the last two misses (the compiled saving has been a fifth of
  # the estimate: ResNet-20 at 22%), and between the last miss and ``hi`` once one fits, so
  # a plan found past a short estimate is brought back towards the fewest bit reductions
  # and FLOPs that fit.
  # A step from compression into recomputation stops at the last point before it: the
  # recomputation's estimate is the least sure (it leaves out its own working set, and on
  # ResNet-20 it compiles larger than 2 bits: a line through compression points sent the
  # 22% walk past every point that fits, to recomputation everywhere at 1.33x FLOPs).
  first_recompute = next((i for i, s_ in enumerate(walk)
                          if any(ladder[r][0].startswith("recompute") for r in s_)), None)
  stop = first_recompute - 1 if first_recompute is not None and first_recompute > 1 else None
  index = choose(0) if exact_bytes > budget_bytes else 0
  index = min(index, stop) if stop is not None else index

  def cheaper_top(state):                     # the estimate puts the top at fewer FLOPs
    top = _top_of(sites, ladder, state)
    return top != state and predicted(top)[1] < predicted(state)[1]

  misses, hi = [0], None
  while index > 0:
    if cost(walk[index])[0] <= budget_bytes:
      hi = index
    else:
      misses.append(index)
    index = _next_point(walk, misses, hi, lambda i: predicted(walk[i])[0],
                        lambda i: costs[walk[i]][0] if i else exact_bytes, budget_bytes,
                        stop)
    # Once a point fits, bringing it back keeps a compile for the tries after the walk.
    keep = hi is not None and (sens is not None or cheaper_top(walk[hi]))
    if index is None or left() <= keep:
      break
  index = misses[-1] if hi is None else hi
  state = walk[index]
  device_bytes, flops = costs[state] if index else (exact_bytes, exact_flops)
  cut = index > 0 and device_bytes > budget_bytes and index < len(walk) - 1
  top = _top_of(sites, ladder, state,
                smaller=index == len(walk) - 1 and device_bytes > budget_bytes)
  walk_note = None                            # what the walk's plan is; dropped for InPlace-ABN
  no_top = None                               # said only if the plan misses
  on_top = False                              # the plan is every site on the top rung
  end_bytes = device_bytes
  if index == len(walk) - 1 > 0 and device_bytes > budget_bytes and top != state:
    # The walk's end misses: the estimates of the last rungs are the least sure (a 1-bit
    # site's packing; a recomputation's own working set), and a site the estimate kept at
    # 1 bit may compile smaller recomputed from 2 bits. One compile tries every site that
    # saves anything on the top rung.
    if left() <= 0:
      no_top = (f"no compile left (max_compiles={max_compiles}) to try every site that saves "
                "anything on the top rung after the walk's end missed: more compiles may find "
                "a plan that fits")
    else:
      top_bytes, top_flops = cost(top, _TOP_RUNG)
      if top_bytes <= budget_bytes:
        walk_note = (f"the walk's end missed the budget by {_size(end_bytes - budget_bytes)}; "
                     "every site that saves anything on the top rung "
                     f"({_rung_text(ladder[-1])}) fitted: that is the walk's plan")
        state, device_bytes, flops, on_top = top, top_bytes, top_flops, True
      else:
        notes.append(f"every site that saves anything on the top rung missed the budget by "
                     f"{_size(top_bytes - budget_bytes)} too (the walk's end by "
                     f"{_size(end_bytes - budget_bytes)})")
  elif (index > 0 and device_bytes <= budget_bytes and cheaper_top(state) and
        left() > 0):
    # The walk's plan fits, but the estimate says the top rung everywhere costs fewer
    # FLOPs: where a model's convolutions are small the quantizer's elementwise work
    # outweighs a recomputation (the 2 x 4-device CNN in decisions.md: 1.208x
    # exact's FLOPs at 1 and 2 bits, 1.084x recomputed from 2 bits). One compile tries it.
    top_bytes, top_flops = cost(top, _TOP_RUNG)
    ratio = lambda f: f"{f / max(exact_flops, 1):.3f}x"
    what = (f"every site that saves anything on the top rung ({_rung_text(ladder[-1])}), "
            f"which the estimate put at fewer FLOPs than the walk's plan ({ratio(flops)}),")
    if top_bytes <= budget_bytes and top_flops < flops:
      walk_note = f"{what} fitted at {ratio(top_flops)}: that is the plan"
      state, device_bytes, flops = top, top_bytes, top_flops
      on_top = top not in walk
      index = index if on_top else walk.index(top)
    else:
      notes.append(f"{what} compiled to {_size(top_bytes)} at {ratio(top_flops)}: the plan "
                   "is the walk's")
  if device_bytes > budget_bytes and costs:
    # Nothing fits: the smallest step compiled, which need not be the last (past a point
    # the largest block's backward sets the peak, and recomputing adds its own working
    # set: on ResNet-20 and ResNet-50 recomputing from 2-bit inputs compiles larger than
    # compressing at 2 bits, the plan_one_bit study of docs/decisions.md).
    tried = {walk[0]: (exact_bytes, exact_flops), **costs}
    smallest = min((s_ for s_ in tried if s_ in walk or s_ == top), key=lambda s_: tried[s_])
    name = lambda s_: ("exact" if s_ == walk[0] else f"walk point {walk.index(s_)}"
                       if s_ in walk else _TOP_RUNG)
    if smallest != state:
      walk_note = (f"nothing fits: the plan is the smallest of the steps compiled for the walk "
                   f"({name(smallest)}, {_size(tried[smallest][0])}); the walk ended at "
                   + ("its last point, every site on the highest rung that keeps less than "
                      "the one below (a site none does stays saved), " if state == walk[-1]
                      else "") + f"{name(state)} ({_size(end_bytes)})")
      state, device_bytes, flops = smallest, *tried[smallest]
      on_top = smallest not in walk               # else a walk point (index: the walk's end)
      index = index if on_top else walk.index(smallest)
  # InPlace-ABN alone is the plan where it fits at fewer compiled FLOPs than the walk's
  # plan, or fits where that does not, or (nothing fits) comes closer.
  under = ()                                  # techniques under every site (and the base)
  if abn_cost is not None:
    (abn_bytes, abn_flops), ratio = abn_cost, lambda f: f / max(exact_flops, 1)
    walk_fits = device_bytes <= budget_bytes
    if abn_bytes > budget_bytes:
      why = f"misses the budget by {_size(abn_bytes - budget_bytes)}"
    elif walk_fits:
      why = (f"fits at {ratio(abn_flops):.3f}x exact's FLOPs, "
             f"{'fewer' if abn_flops < flops else 'no fewer'} than the per-site walk's "
             f"{ratio(flops):.3f}x")
    else:
      why = f"fits at {ratio(abn_flops):.3f}x exact's FLOPs, where the per-site walk does not"
    if (abn_bytes <= budget_bytes and (not walk_fits or abn_flops < flops)) or (
        not walk_fits and abn_bytes < device_bytes):
      notes.append(f"InPlace-ABN alone {why}" + (", less than the per-site walk" if
                                                 abn_bytes > budget_bytes else "") +
                   f": the plan is InPlace-ABN on the BatchNorms {abn.where!r} (their "
                   "activation inverted from the output; exact, but the scale is "
                   "|gamma| + epsilon: map existing weights with "
                   "jmem.surgery.inplace_abn_params)")
      under, index, state, device_bytes, flops = (abn,), 0, walk[0], abn_bytes, abn_flops
      walk_note, on_top = None, False
    else:
      notes.append(f"InPlace-ABN alone {why}: the plan is the walk's (InPlace-ABN with "
                   "per-site policies is not searched)")
  notes += [walk_note] if walk_note else []
  if sens is not None and index > 0 and device_bytes <= budget_bytes:
    # Once the walk's plan fits: tries with the bit reductions it does not need undone
    # (`_undo_tries`). The estimate taken as it is undid too few (ResNet-20 at 25%, where a
    # compile saved half of the estimate's bytes or less, kept the most sensitive site, the
    # stem, at 4 bits): it is scaled by the compiled slope from the walk's last miss.
    lo = misses[-1]
    names = [site.path for site in sites]
    layouts = {}                              # state -> its `_heap_prediction`, made once

    def layout_of(s_):
      if s_ not in layouts:
        layouts[s_] = (_heap_prediction(heaps[s_], s_, costs[s_][0], names, ladder)
                       if s_ in heaps else None)
      return layouts[s_]
    if (any(_undoable(ladder, r) for r in state) and state in heaps and
        layout_of(state) is None):
      notes.append("no site's packed codes are named in the compiled step's heap layout (its "
                   "names do not carry the sites' module paths, as with NNX modules): "
                   "undoing bit reductions uses the per-site estimate alone")
    state, (device_bytes, flops), outcomes = _undo_tries(
        state, (device_bytes, flops), (predicted(walk[lo])[0], costs[walk[lo]][0] if lo
                                      else exact_bytes),
        lambda s_: predicted(s_)[0],
        lambda s_, fits, least=0.0: _relax(s_, sites, ladder, sens, fits, least),
        cost, lambda s_: s_ in costs or left() > 0, budget_bytes, layout_of,
        lambda s_: costs[s_][0] if s_ in costs else None)
    notes += ["; then ".join(outcomes)] if outcomes else []
  if no_top and device_bytes > budget_bytes:
    notes.append(no_top)
  if cut and device_bytes > budget_bytes:
    notes.append(f"the per-site walk stopped over the budget at max_compiles={max_compiles}"
                 f"{' (InPlace-ABN alone took one)' if abn_cost is not None else ''}: more "
                 "compiles may find a plan that fits")
  choices = choices_of(state)
  fits = device_bytes <= budget_bytes
  best = exact_best = None
  if max_batch:
    exact_best = _largest(*sorted([(small, exact_small), (batch, exact_bytes)]), budget_bytes,
                          multiple)
    if not (under or index):
      best = exact_best                   # the exact step's
    else:
      other = 2 * batch if fits else small
      at_other, _ = compiled(under + _policies(choices), other)
      best = _largest(*sorted([(batch, device_bytes), (other, at_other)]), budget_bytes,
                      multiple)
  if not fits and fixed > budget_bytes:
    notes.append(f"the exact step's line through batch {small} and {batch} puts "
                 f"{_size(fixed)} at batch 0 (parameters, optimiser state and the rest of "
                 f"what does not grow with the batch), over the budget of "
                 f"{_size(budget_bytes)}: the sites' policies change what grows with the "
                 "batch, so no batch is likely to fit")
  estimates = tuple(predicted(s_) for s_ in walk) + ((predicted(top),) if on_top else ())
  front = _calibrated(estimates[:len(walk)],
                      {i: costs[s_] for i, s_ in enumerate(walk) if s_ in costs} |
                      {0: (exact_bytes, exact_flops)}, floor=max(fixed, 0.0))
  if on_top:
    front += (tuple(map(float, costs[top])),)      # on_top: the top rung was compiled
  index = len(front) - 1 if on_top else index
  result = Plan(budget_bytes, batch, choices, int(device_bytes), int(exact_bytes), flops,
                exact_flops, fits, best, exact_best, compiles, front, index, tuple(notes),
                base + under, tuple(measured), layout.shards, layout.mesh,
                layout.specs(x, y), on_top, estimates, device.name, device.label)
  if not fits:
    warnings.warn(
        f"jmem.plan: nothing found fits the budget of {_size(budget_bytes)} at batch {batch}: "
        f"the returned plan (fits=False) is the smallest step compiled, "
        f"{_size(device_bytes)} ({_size(device_bytes - budget_bytes)} over). Raise the "
        "budget, plan a smaller batch_size, or allow more policies (plan.table() shows each "
        "site's).", BudgetNotMetWarning, stacklevel=2)
  return result


class BudgetNotMetWarning(UserWarning):
  """`jmem.plan` returned a plan that does not fit its budget (``Plan.fits`` is False)."""


@dataclasses.dataclass(frozen=True)
class _Layout:
  """How each step is compiled on the devices of ``mesh=`` (the defaults: one device).

  Attributes:
    base: the techniques under every plan (``jmem.Spatial``, or none).
    shards: the devices one step's activations are split over (data x H x W).
    multiple: the data axis's size: the batch sizes compiled are multiples of it.
    mesh: the mesh (None: one device).
    specs: ``(x, y) -> (x's PartitionSpec, y's)`` for a batch (the train state is
      replicated; None on one device).
    note: what the figures are, for the plan's notes (None: one device).
    xla: data parallelism alone: on a GPU the kernels' automatic choice is XLA, as
      `jmem.parallel.data_parallel` trains it.
  """

  base: tuple = ()
  shards: int = 1
  multiple: int = 1
  mesh: Any = None
  specs: Any = lambda x, y: None
  note: str | None = None
  xla: bool = False


def _layout(model, mesh, axes, data_axis, x, batch: int) -> _Layout:
  """The `_Layout` of ``mesh`` (None: one device), its H and W ``axes`` (None: no
  jmem.Spatial) and its ``data_axis`` (None: the batch not split)."""
  if _has_spatial(model):
    raise ValueError("this model was converted with jmem.Spatial: give jmem.plan the "
                     "unconverted model and the mesh (mesh=) or the number of devices "
                     "(devices=), so that it compiles every step with the batch sharded over "
                     "H and W and Spatial comes with the plan.")
  if mesh is None:
    if data_axis is not None:
      raise ValueError(f"data_axis={data_axis!r} names an axis of the mesh: pass mesh= too.")
    return _Layout()
  if not isinstance(mesh, Mesh):
    raise TypeError(f"jmem.plan(mesh=...) takes a jax.sharding.Mesh, got {type(mesh).__name__}.")
  axes = (None, None) if axes is None else tuple(axes)
  spatial = any(a is not None for a in axes)
  named = [a for a in (*axes, data_axis) if a is not None]
  missing = [a for a in named if a not in mesh.axis_names]
  if not named:
    raise ValueError(f"jmem.plan(mesh=...) was given no mesh axis to use: name the batch's "
                     f"axis with data_axis= and/or H and W's with spatial_axes= (the mesh has "
                     f"{dict(mesh.shape)}).")
  if missing:
    hint = (" For data parallelism alone pass spatial_axes=None (jmem plan --mesh D)."
            if data_axis is not None and data_axis in mesh.axis_names else
            " Name the batch's axis with data_axis= and H and W's with spatial_axes=.")
    raise ValueError(f"jmem.plan(mesh=...): {', '.join(map(repr, missing))} "
                     f"{'is not an axis' if len(missing) == 1 else 'are not axes'} of the mesh "
                     f"{dict(mesh.shape)} (spatial_axes={axes}, data_axis={data_axis!r}).{hint}")
  others = {a: n for a, n in mesh.shape.items() if a not in named and n > 1}
  if others:
    raise ValueError(f"jmem.plan(mesh=...) splits the batch over data_axis={data_axis!r} and "
                     f"the image's H and W over spatial_axes={axes}; the mesh's other axes "
                     f"{others} would hold copies of the same work. Name them (data_axis=, "
                     "spatial_axes=) or give a mesh without them.")
  multiple = mesh.shape[data_axis] if data_axis is not None else 1
  if batch % multiple:
    raise ValueError(f"jmem.plan(mesh=...) splits the batch over the data axis {data_axis!r} "
                     f"of {multiple} devices: batch_size {batch} must be a multiple of "
                     f"{multiple} (a padded batch would plan for masked rows).")
  base = ()
  if spatial:
    base = (surgery.Spatial(mesh, axes=axes, data_axis=data_axis),)   # checks the axes
    if len(x.shape) != 4:
      raise ValueError(f"jmem.plan(mesh=...) shards NHWC images over H and W; got x of "
                       f"shape {tuple(x.shape)} (spatial_axes=None plans data parallelism "
                       "alone: jmem plan --mesh D).")
    sides = [(x.shape[1 + i], mesh.shape[a]) for i, a in enumerate(axes) if a is not None]
    if any(n % k for n, k in sides):
      raise ValueError(f"jmem.plan(mesh=...) shards the image's H and W over the mesh axes "
                       f"{axes}: the sides {[n for n, _ in sides]} must be multiples of the "
                       f"axes' sizes {[k for _, k in sides]}.")

  def spec(a):      # images and per-pixel labels over (data, H, W), other labels over data
    return (P(data_axis, *axes, *[None] * (len(a.shape) - 3)) if spatial and len(a.shape) >= 3
            else P(data_axis))
  specs = lambda x, y: (spec(x), spec(y))
  shards = math.prod(mesh.shape[a] for a in named)
  split = ([f"the batch over {data_axis!r}"] if data_axis is not None else []) + (
      [f"H and W over {axes} (jmem.Spatial)"] if spatial else [])
  xla = data_axis is not None and not spatial
  note = (f"figures per device ({shards} device{'s' * (shards > 1)}): every step, the "
          f"exact one too, is compiled with {' and '.join(split)}, parameters and optimiser "
          "state replicated" +
          ("; BatchNorm statistics are over the whole batch (XLA all-reduces them, as "
           "SyncBN does) and on a GPU the kernels' automatic choice is XLA (XLA cannot split "
           "a Pallas call over the batch): train it so, jmem.parallel.data_parallel(model, "
           f"mesh, axis={data_axis!r})" if xla else ""))
  return _Layout(base, shards, multiple, mesh, specs, note, xla)


def _lay_out(devices, batch: int, x) -> tuple[list, str | None]:
  """``([(mesh, data_axis, spatial_axes), ...], note)`` for ``jmem.plan(devices=...)``: the
  batch over the most devices that divide it and the device count (per device, splitting
  the batch or the image keeps the same share of the activations, and halo exchanges add
  collectives: decisions.md), the image's H x W over the rest, every way ``h x w`` the
  sides allow, for `plan` to compile (the halo sizes do not rank them), at most 4: where
  the devices left for H x W split more ways (12 or more of them), the 4 with the fewest
  halo values per device and convolution, ``(h > 1) * W / w + (w > 1) * H / h`` (a
  heuristic)."""
  what = ("jmem.plan(devices=...) takes a number of devices or a non-empty sequence of "
          "distinct jax.Device (a mesh goes to mesh=, with data_axis= and spatial_axes=)")
  if isinstance(devices, numbers.Integral) and not isinstance(devices, bool):
    if not 1 <= devices <= jax.device_count():
      raise ValueError(f"jmem.plan(devices={devices}) takes a number from 1 to "
                       f"{jax.device_count()} (the devices there are), or a sequence of "
                       "devices.")
    devices = jax.devices()[:devices]
  if isinstance(devices, (bool, str, Mesh)) or not isinstance(devices, Sequence):
    raise TypeError(f"{what}; got {devices!r}.")
  devices = list(devices)
  n = len(devices)
  if not n or not all(isinstance(d, jax.Device) for d in devices) or len(set(devices)) < n:
    raise TypeError(f"{what}; got {devices!r}.")
  if n == 1:
    return [(None, None, None)], None
  data = math.gcd(n, batch)
  rest = n // data
  fewer = max(k for k in range(1, n + 1) if batch % k == 0)     # devices the batch splits over
  axis_types = (jax.sharding.AxisType.Auto,) * 3
  if rest == 1:
    mesh = jax.make_mesh((n,), ("data",), axis_types=axis_types[:1], devices=devices)
    return [(mesh, "data", None)], (f"devices={n}: the batch of {batch} is split over all "
                                    f"{n} (data parallelism)")
  took = (f"devices={n}: the batch of {batch} is split over {data} of them (the most that "
          f"divide it and {n})" if data > 1 else
          f"devices={n}: the batch of {batch} splits over none of them evenly")
  if len(x.shape) != 4:
    raise ValueError(f"{took}; the other {rest} would split the image's H and W "
                     f"(jmem.Spatial), which takes NHWC images, not x of shape "
                     f"{tuple(x.shape)}. Give a batch that is a multiple of {n}, or fewer "
                     f"devices (devices={fewer}).")
  height, width = x.shape[1:3]
  splits = [(h, rest // h) for h in range(1, rest + 1)
            if rest % h == 0 and height % h == 0 and width % (rest // h) == 0]
  if not splits:
    raise ValueError(f"{took}; the other {rest} would split the image's H x W = {height} x "
                     f"{width}, and no h x w = {rest} divides it. Give a batch that is a "
                     f"multiple of {n}, an image size that {rest} divides, or fewer devices "
                     f"(devices={fewer}).")
  splits = sorted(splits, key=lambda s: ((s[0] > 1) * width / s[1] + (s[1] > 1) * height / s[0],
                                         (s[0] > 1) + (s[1] > 1), -s[1]))[:4]
  out = [(jax.make_mesh((data, h, w), ("data", "h", "w"), axis_types=axis_types,
                        devices=devices),
          "data" if data > 1 else None, ("h" if h > 1 else None, "w" if w > 1 else None))
         for h, w in splits]
  return out, f"{took}; H x W over the other {rest} (jmem.Spatial)"


def _hw(layout) -> str:
  """``h x w`` of a `_Layout` with jmem.Spatial."""
  shape = layout.mesh.shape
  return "x".join(str(shape[a]) if a is not None else "1" for a in layout.base[0].axes)


def _has_spatial(model) -> bool:
  if isinstance(model, nnx.Module):
    return any(isinstance(m, nnx.Conv) and m.conv_general_dilated is not lax.conv_general_dilated
               for _, m in nnx.iter_graph(model))
  return any(isinstance(t, surgery.Spatial) for t in getattr(model, "techniques", ()))


def _per_device(sites, shards: int):
  """``sites`` with their bytes and FLOPs shared by ``shards`` devices."""
  if shards == 1:
    return sites
  return [dataclasses.replace(s, **{f: getattr(s, f) / shards for f in (
      "residual_bytes", "input_bytes", "input_values", "forward_flops", "values")})
          for s in sites]


def _reach(share: float, outside: float, paths, needed: bool) -> list[str]:
  """Where the exact step does not fit (``needed``), raises if the sites hold under 10% of
  its saved activations (``share``: the policies could change next to nothing); a note if
  they hold under half. Checked after the exact compiles: a refusal costs those two."""
  where = (f"the rest, {outside / 2**20:.2f} MiB per example on one device, is made outside "
           "them: by code inline in the top module, or by modules applied detached (e.g. "
           "Module(parent=None).apply inside __call__), which jmem.convert's policies do not "
           "reach")
  if share < 0.1 and needed:
    raise ValueError(
        f"jmem.plan: the block sites {paths} hold {share:.1%} of the train step's saved "
        f"activations; {where}. Make the blocks submodules of the model (self.block = "
        "Block(...) in setup, or Block(name=...)(x)), or use the model's own memory "
        "technique.")
  if share < 0.5:
    return [f"the block sites hold {share:.0%} of the saved activations; {where}"]
  return []


def _inplace_abn(model, x, allowed: bool, max_compiles: int):
  """``(InPlaceABN over every BatchNorm it can take, or None, a note or None)``."""
  if not allowed:
    return None, None
  if max_compiles < 4:
    return None, (f"InPlace-ABN not tried: max_compiles={max_compiles} (it needs 4: the exact "
                  "step twice, InPlace-ABN's, the walk's)")
  if any(isinstance(t, (surgery.SyncBN, surgery.InPlaceABN))
         for t in getattr(model, "techniques", ())):
    return None, ("InPlace-ABN not tried: the model's BatchNorms were converted already "
                  "(SyncBN or InPlaceABN)")
  kw = step_lib.mode_kwargs(model, True) if isinstance(model, nn.Module) else {}
  paths = surgery.inplace_abn_sites(model, jnp.zeros(x.shape, x.dtype), **kw)
  if not paths:
    return None, ("InPlace-ABN not applicable: no BatchNorm followed by leaky_relu or elu in "
                  "a Sequential (what jmem.InPlaceABN converts)")
  return surgery.InPlaceABN(where="|".join(re.escape(p) for p in paths)), None


def _top_of(sites, ladder, state, smaller: bool = False) -> tuple:
  """``state`` (a rung per site) with every site that saves anything on the top rung moved
  there. ``smaller`` (the try after the walk's end missed, which must keep less): only
  where the estimate keeps less there than where the site is (a recomputed input can keep
  more than a block at 1 bit), unless the top recomputes from a 2-bit input, which may
  compile smaller than the estimate says (the default ladder's top)."""
  def up(site, r):
    top = _kept(site, ladder[-1])[0]
    return top < site.residual_bytes and (
        not smaller or ladder[-1] == ("recompute_compressed", 2) or
        top < _kept(site, ladder[r])[0])
  return tuple(len(ladder) - 1 if up(s, r) else r for s, r in zip(sites, state))


def _next_point(walk, misses, hi, estimate, compiled, budget, stop=None) -> int | None:
  """The walk point to compile next, or None. ``misses``: the walk points compiled over the
  budget (0, exact, first); ``hi``: the first compiled within it (None: none yet);
  ``estimate(i)``: point i's predicted bytes; ``compiled(i)``: its compiled bytes;
  ``stop``: a point a step from before it goes no further than (None: the walk's end).

  Compiled bytes are taken as linear in the estimate: between the last miss and ``hi``
  (regula falsi; where the line puts no point between them within the budget, the point
  halfway: the line is a guess, and a compile the bound leaves is better spent on a point
  that may fit with fewer reductions than left unused; None where they are adjacent), else
  through the last two misses, the slope clamped to [0.1, 1] (1: the estimate's savings
  taken as they are; under 0.1 a miss could send the walk to its end), going to ``stop``
  or the walk's end where the line puts no point before it within the budget."""
  assert hi is not None or len(misses) > 1, "a step needs two misses (exact, one point)"
  lo = misses[-1]
  end = hi if hi is not None else stop if stop is not None and lo < stop else len(walk) - 1
  if end - lo <= 1:
    return None if hi is not None or lo == end else end
  a, b = (lo, hi) if hi is not None else (misses[-2], lo)
  k = _compiled_slope((estimate(a), compiled(a)), (estimate(b), compiled(b)),
                      *((-math.inf, math.inf) if hi is not None else (0.1, 1.0)))
  for i in range(lo + 1, end):
    if compiled(lo) - k * (estimate(lo) - estimate(i)) <= budget:
      return i
  return (lo + hi) // 2 if hi is not None else end


def _compiled_slope(a, b, low: float = 0.1, high: float = math.inf) -> float:
  """Compiled bytes per estimated byte from ``(estimate, compiled)`` point ``a`` to ``b`` (a
  miss and a fit, two misses, or two fitting plans of the undo tries), held within [``low``,
  ``high``]: by default at least 0.1 (a point saved nothing compiled); 1 where the estimate
  does not fall from ``a`` to ``b``. Above 1 the compile saved more than the estimate, and
  undoing a reduction costs more than estimated too."""
  drop = a[0] - b[0]
  return min(max((a[1] - b[1]) / drop, low), high) if drop > 0 else 1.0


def _undoable(ladder, r) -> bool:
  """Whether rung ``r`` is a bit reduction `_relax` can undo: compressed, one rung below
  another compression."""
  return r > 0 and ladder[r][0] == ladder[r - 1][0] == "compress"


def _relax(state, sites, ladder, sensitivity, fits, least: float = 0.0):
  """``state`` with the bit reductions it does not need undone (one rung each), the one
  adding the most gradient variance first, while ``fits(state)`` holds. Only reductions
  between compression rungs are undone: the estimated FLOPs do not change. One whose
  undoing takes off less than ``least`` of the variance ``state`` adds is left: in a try
  that is compiled, it would risk the try's missing for next to nothing."""
  state = list(state)
  added = lambda i: (_variance(sensitivity[sites[i].path], ladder[state[i]]) -
                     _variance(sensitivity[sites[i].path], ladder[state[i] - 1]))
  total = sum(_variance(sensitivity[st.path], ladder[r]) for st, r in zip(sites, state))
  lowered = [i for i, r in enumerate(state) if _undoable(ladder, r) and
             added(i) >= least * total]
  for i in sorted(lowered, key=added, reverse=True):
    state[i] -= 1
    if not fits(state):
      state[i] += 1
  return tuple(state)


# The least share of a plan's added gradient variance a try guided by the heap layout
# undoes a reduction for (`_relax`'s ``least``): on ResNet-20 at 25% the layout predicts
# seven of nine blocks put back alone within 0.014 MiB, but stage2_block2 (0.6% of the
# variance) 0.45 MiB short (the plan_undo_peak study of docs/decisions.md), and a try holding such
# an undo risks its compile for next to nothing. They get a try of their own where the
# layout predicts no other undo to fit (ResNet-50 224², 8 GiB, batch 256: four such
# reductions, and nothing else predicted to fit).
_LEAST_UNDONE = 0.01


def _heap_of(step, args, notes):
  """``step``'s heap layout compiled for ``args`` (`measure.heap_layout`, one compile that
  also gives the step), or None with a note where the backend writes no buffer-assignment
  dump (the undo tries then use the per-site estimate alone; the caller compiles the step
  without the dump and asks no more)."""
  try:
    return measure.heap_layout(step, *args)
  except measure.DumpUnavailableError as e:
    notes.append(f"the compiled steps' heap layouts could not be read ({e}): undoing bit "
                 "reductions uses the per-site estimate alone")
    return None


def _site_of_codes(buffer, paths) -> int | None:
  """The index in ``paths`` of the site whose packed ActNN codes ``buffer`` (a
  `measure.HeapBuffer`) holds: uint8, made by the quantizer (its name scope) in the forward
  pass, inside the site's module path (a converted model runs it under ``model/``); None
  for any other buffer."""
  if (not buffer.shape.startswith("u8[") or "transpose(" in buffer.op_name or
      not re.search(rf"\b{actnn_quantize.CODES_SCOPE}\b", buffer.op_name)):
    return None
  site = _site_of_scope(measure._heap._scope(buffer.op_name), paths)  # pylint: disable=protected-access
  return None if site is None else list(paths).index(site)


def _site_of_scope(scope: str, paths: Sequence[str]) -> str | None:
  """The site of ``paths`` a compiled instruction's module ``scope`` lies in: the first
  path that a tail of the scope starts with (a converted model runs under ``model/``)."""
  parts = scope.split("/")
  for k in range(len(parts)):
    site = _owner("/".join(parts[k:]), paths)
    if site is not None:
      return site
  return None


def _heap_prediction(heap, at, at_bytes, paths, ladder):
  """``predict(state)``: the device bytes of ``state``'s step predicted from the heap layout
  (`measure.HeapLayout`) of the compiled step of the state ``at`` (``at_bytes``): every
  site's packed codes resized by its bits in ``state`` over those in ``at`` and the buffers
  placed again (`HeapLayout.simulate`), the difference to the simulated ``at`` added to
  ``at_bytes``. Unlike the per-site estimate it sees when the codes are live and where they
  lie in the heap: codes dead at the peak can cost nothing, or grow the heap's layout
  (the plan_undo_peak study of docs/decisions.md). A changed state's prediction adds how far the
  simulation of ``at``'s own heap is from XLA's temp allocation: XLA's placement is not
  one best fit, and the two part more on a larger heap (ResNet-20 32² at batch 128: 0.01
  MiB of 70; ResNet-50 224² at batch 512: 171 MiB of 15464, where undoing stage2_block2
  compiled 689 MiB larger and was predicted 300). ``predict`` gives None where a site
  changes other than between two compression rungs, or has no codes in the layout;
  `_heap_prediction` gives None (no prediction at all) where no site has."""
  owner = {b: _site_of_codes(b, paths) for b in heap.buffers}
  covered = set(owner.values()) - {None}
  if not covered:
    return None
  base = heap.simulate()
  slack = abs(base - heap.memory.temp_bytes)     # the simulation's error on ``at`` itself

  def predict(state):
    changed = [i for i, (r, r0) in enumerate(zip(state, at)) if r != r0]
    if any(i not in covered or ladder[state[i]][0] != "compress" or
           ladder[at[i]][0] != "compress" for i in changed):
      return None
    if not changed:
      return at_bytes
    scale = {i: ladder[state[i]][1] / ladder[at[i]][1] for i in changed}
    return at_bytes + heap.simulate(
        lambda b: round(b.bytes * scale.get(owner[b], 1.0))) - base + slack
  return predict


def _offload_note(mesh, target=None) -> str:
  """Why the plan has no ``offload`` site, for the platform it compiles for (``target``: a
  `jmem.measure.Target`, whose platform it is where it is compiled for without a device)."""
  platform = (mesh.devices.flat[0].platform if mesh is not None else
              target.platform if target is not None and target.deviceless else
              jax.default_backend())
  if platform == "cpu":
    return ("offload not searched (on CPU, where host and device memory are one, it saves "
            "nothing: only a GPU compile could measure it)")
  return (f"offload not searched ({platform}): the walk ranks by FLOPs, which count none of "
          "offload's host transfers, and where offload was measured (an H100, ResNet-50 224² "
          "at batch 64) it lost on both figures: full precision at every site compiled to "
          "0.97x exact's temp bytes and stepped 11.5x as long, where recompute-2bit compiled "
          "to 0.29x at 1.21x)")


def _undo_tries(state, at, anchor, estimate, relax, cost, affordable, budget,
                predict=None, known=lambda s: None):
  """``(state, (bytes, FLOPs), notes)``: the fitting plan ``state`` (compiled at ``at``)
  with the bit reductions it does not need undone, tried by compiling while compiles are
  left. ``anchor``: ``(estimated, compiled)`` bytes of a step compiled before the plan (the
  walk's last miss); ``estimate(s)``: predicted bytes; ``relax(s, fits, least=0.0)``:
  `_relax`; ``cost(s)``: compiled ``(bytes, FLOPs)``; ``affordable(s)``: whether
  ``cost(s)`` is known or a compile is left; ``predict(s)``: None, or for a compiled state
  ``s`` a function that predicts a state's compiled bytes from ``s``'s heap layout
  (`_heap_prediction`; None where it cannot); ``known(s)``: ``s``'s compiled bytes where a
  compile gave them (a walk point, the top rung, an earlier try), else None: neither the
  layout nor the line overrides them.

  Each try is `_relax` with the estimate anchored at the plan and scaled by the compiled
  slope between the plan and the last step compiled before it (`_compiled_slope`; at
  least 0.1): the walk's last miss, then the try that missed, or the plan before the try
  that fitted (a secant along the undoing: where undoing cost less than estimated, the
  next try undoes more). Where the plan's heap layout predicts a state, that prediction
  is taken instead, until a try it predicted misses: it sees what the estimate cannot,
  which codes are live when, and how the heap is laid out (ResNet-20 at 25%: undoing the
  stage-3 reductions compiled 0.04 MiB larger, predicted 0.04, estimated 7.8). Such a
  try leaves the reductions of under `_LEAST_UNDONE` of the variance, and tries them on
  their own once no other is predicted to fit; where none is, the line takes over (each
  try is one compile the bound allows, and a try that misses changes no plan). A state
  compiled before (``known``) is judged by its compiled bytes. A try that fits is the
  plan. Stops where a try repeats one, undoes nothing, or no compile is left."""
  device_bytes, flops = at
  seen, notes, by_layout = set(), [], predict is not None
  while True:
    here = (estimate(state), device_bytes)
    slope = _compiled_slope(*sorted([anchor, here], reverse=True))
    layout = predict(state) if by_layout else None

    def guess(s, k=slope, here=here, layout=layout):
      g = known(tuple(s))
      g = layout(s) if g is None and layout is not None else g
      return here[1] + k * (estimate(s) - here[0]) if g is None else g
    fits = lambda s, guess=guess: guess(s) <= budget
    loose = relax(state, fits, _LEAST_UNDONE) if layout is not None else relax(state, fits)
    small = layout is not None and loose == state
    if small:
      # The reductions of under 1% of the variance go in a try of their own, once no other
      # is predicted to fit.
      loose = relax(state, fits)
      if loose == state:
        # The layout, with its slack, has no undo fit: the line is asked instead. Its tries
        # spend compiles the bound would leave unused.
        by_layout = False
        notes.append("the plan's heap layout predicted no undo to fit: the estimate's "
                     "line was asked instead")
        continue
    if loose == state or loose in seen:
      break
    seen.add(loose)
    if known(loose) is not None:
      guided, what = False, "compiled before within the budget"
    else:
      guided = layout is not None and layout(loose) is not None  # the layout predicted it
      what = ("the plan's heap layout predicted to fit" if guided else
              "the estimate did not need")
    what += (f" (each under {_LEAST_UNDONE:.0%} of the gradient variance the plan adds)"
             if small else "")
    if not affordable(loose):
      notes.append(f"no compile left to try undoing the bit reductions {what}")
      break
    loose_bytes, loose_flops = cost(loose)
    undone = sum(a != b for a, b in zip(loose, state))
    if loose_bytes <= budget:
      anchor, state, device_bytes, flops = here, loose, loose_bytes, loose_flops
      notes.append(f"undoing {undone} bit reductions {what} fitted: the plan has them undone")
    else:
      anchor = (estimate(loose), loose_bytes)
      by_layout = by_layout and not guided    # a try the layout predicted missed: no more
      notes.append(f"undoing {undone} bit reductions {what} missed the budget by "
                   f"{_size(loose_bytes - budget)}: the plan keeps them")
  return state, (device_bytes, flops), notes


def _measured_sensitivities(model, paths, batch, x, y, loss_fn=None
                            ) -> tuple[dict[str, float], int]:
  """``C`` of each site the probe sees, measured at 2 bits on the examples ``batch`` at
  the model's initial weights (of ``loss_fn``, default cross-entropy), and the number of
  examples used."""
  ok = isinstance(batch, (tuple, list)) and len(batch) == 2
  cx, cy = batch if ok else (None, None)
  if not ok or (tuple(np.shape(cx)[1:]), tuple(np.shape(cy)[1:])) != (
      tuple(x.shape[1:]), tuple(y.shape[1:])) or len(cx) != len(cy) or len(cx) < 2:
    got = (f"x {np.shape(cx)} and y {np.shape(cy)}" if ok else
           f"a {type(batch).__name__}")
    raise ValueError(f"calibration_batch must be (x, y) arrays of at least 2 examples shaped "
                     f"like the example batch's, x (n, {', '.join(map(str, x.shape[1:]))}) and "
                     f"y (n{''.join(f', {d}' for d in y.shape[1:])}); got {got}.")
  for name, a in (("x", cx), ("y", cy)):
    a = np.asarray(a)
    if np.issubdtype(a.dtype, np.inexact) and not np.all(np.isfinite(a)):
      bad = int(np.sum(~np.isfinite(a)))
      raise ValueError(f"calibration_batch's {name} holds {bad} non-finite values (NaN or "
                       "inf): every site's gradient sensitivity would be NaN. Pass real, "
                       "finite examples (or sensitivities=).")
  params, probe_loss, data = actnn_technique.calibration_problem_on(
      model, cx, cy, max_values=_CALIBRATION_VALUES, loss_fn=loss_fn)
  where = "|".join(re.escape(p) for p in paths)
  c, _ = surgery.sensitivities(model, probe_loss, params, data,
                               surgery.ActNN("L3", where=where), bits=2)
  bad = {p: v for p, v in c.items() if p in paths and not math.isfinite(v)}
  if bad:
    raise ValueError(f"The gradient sensitivities measured on calibration_batch are not finite "
                     f"at the sites {sorted(bad)} (the model's loss or gradients on those "
                     "examples overflow): pass other examples, or sensitivities=.")
  return {p: float(v) for p, v in c.items() if p in paths}, int(data[0].shape[0])


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
  mem = np.array([p[0] for p in plan_.front]) / scale
  fl = np.array([p[1] for p in plan_.front]) / max(plan_.exact_flops, 1)
  fig, ax = plt.subplots(figsize=(6, 4))
  walk = slice(0, len(fl) - 1 if plan_.off_walk else len(fl))   # the top-rung try is apart
  ax.plot(fl[walk], mem[walk], ".-", color="0.6",
          label="upgrade path (predicted from the compiled points)")
  steps = [(f / max(plan_.exact_flops, 1), b / scale) for what, b, f in plan_.measured
           if what != "exact" and (b, f) != (plan_.device_bytes, plan_.flops)]
  if steps:
    ax.plot(*zip(*steps), "x", color="C2", label="other steps compiled")
  front = _pareto([(f / max(plan_.exact_flops, 1), b / scale) for _, b, f in plan_.measured])
  if len(front) > 1:
    ax.step(*zip(*front), where="post", color="C2", lw=1, alpha=0.7,
            label="compiled front (fewest bytes at each FLOPs)")
  ax.plot(plan_.flops / max(plan_.exact_flops, 1), plan_.device_bytes / scale, "*", ms=12,
          color="C1", label="chosen (compiled)")
  ax.plot(1.0, plan_.exact_device_bytes / scale, "s", color="k", label="exact (compiled)")
  ax.axhline(plan_.budget_bytes / scale, color="C3", ls="--", label="budget")
  ax.set_ylim(bottom=0)              # the budget line and exact's bytes set the top
  ax.set_xlabel("step FLOPs / exact")
  ax.set_ylabel(f"device {unit} at batch {plan_.batch_size}")
  ax.legend(fontsize=8)
  fig.tight_layout()
  png = os.path.join(output_dir, f"{stem}_front.png")
  fig.savefig(png, dpi=120)
  plt.close(fig)
  return paths + [png]


# ------------------------------------------------------------------ the bench's name

def _plan_technique(share: str):
  def prepare(model, dataset, batch_size, techniques, *, target=None):
    x = jax.ShapeDtypeStruct((batch_size,) + tuple(dataset.example_shape), jnp.float32)
    y = jax.ShapeDtypeStruct((batch_size,) + tuple(np.shape(dataset.y_train)[1:]), jnp.int32)
    calibration = (dataset.x_train[:16], dataset.y_train[:16])
    return tuple(techniques) + plan(model, (x, y), share, max_batch=False,
                                    calibration_batch=calibration, target=target).techniques

  return BenchTechnique(f"plan-{share}", None, f"jmem.plan's policies at {share} of exact's "
                        "device bytes, bits by gradient sensitivity", prepare=prepare)


register_technique(_plan_technique("50%"))
