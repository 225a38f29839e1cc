"""`jmem.plan`: the inputs checked and estimated, the device layout chosen, the search run
on the compiled steps (`_Steps`, its cost model), InPlace-ABN alone weighed against it, and
the `Plan` made (`jmem.planner`'s docstring says how)."""

from __future__ import annotations

import contextlib
import math
import numbers
import warnings
from collections.abc import Mapping, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jmem import _backends
from jmem import measure
from jmem import surgery
from jmem import step as step_lib
from jmem._technique import BenchTechnique
from jmem.planner._inputs import (Measured, _block_techniques, _converted, _default_sites,
                                  _estimate_sites, _inplace_abn, _kept, _measured_sensitivities,
                                  _offload_note, _reach, _rung_text, _split_dominant,
                                  _train_step, budget_share, objective_for, parse_bytes,
                                  site_ladder)
from jmem.planner._layouts import _hw, _lay_out, _layout, _per_device
from jmem.planner._report import (BudgetNotMetWarning, Plan, SiteChoice, _calibrated,
                                  _largest, _policies, _size)
from jmem.planner._search import Search, _heap_of
from jmem.techniques import register_technique

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
  objective = objective_for(device)
  if objective.time:
    notes.append(f"the walk steers by the step time estimated for the {device.name} target "
                 "from each compiled module (jmem.measure.estimate_step_time: bytes moved, "
                 "matrix FLOPs and kernels, fitted on an H100's measured steps; an estimate, "
                 "not a measured time), not by FLOPs: compression at 2 bits where it frees "
                 "the most bytes per second added, 1 bit and recomputation only where 2 bits "
                 "do not fit")
  steps = _Steps(model, optimizer, x, y, spec, abstract, loss_fn, device, objective, batch,
                 notes, read_heaps=sens is not None and not objective.time)

  # devices=: where H x W can be split several ways, the exact step compiled on each (the
  # halo sizes do not rank them: decisions.md); of those within 2% of the fewest device
  # bytes, the fewest collectives, then the fewest bytes.
  layout = layouts[0]
  if len(layouts) > 1:
    counts = []
    tried = [steps.compile((), batch, collectives=counts, on=on) for on in layouts]
    least = min(m.bytes for m in tried)
    pick = min((i for i, m in enumerate(tried) if m.bytes <= 1.02 * least),
               key=lambda i: (counts[i], tried[i].bytes))
    exact, layout = tried[pick], layouts[pick]
    notes.append("H x W split every way the devices and sides allow, the exact step compiled "
                 "on each (per device): " + ", ".join(
                     f"{_hw(lay)} {_size(m.bytes)} with {c} collectives"
                     for lay, m, c in zip(layouts, tried, counts)) +
                 f"; the plan takes {_hw(layout)}: of those within 2% of the fewest bytes, the "
                 f"fewest collectives ({len(tried) - 1} compiles more than the plan's own, not "
                 "counted against max_compiles)")
    steps.measured.append(("exact", int(exact.bytes), float(exact.flops)))
    steps.measured_seconds.append(exact.seconds)
  steps.layout = layout
  searched = len(layouts) - 1                 # compiles that do not count against the bound
  left = lambda: max_compiles - (steps.compiles - searched)   # compiles the bound allows
  notes += [layout.note] if layout.note else []
  base = layout.base

  # The exact step at two batch sizes: fixed bytes and the per-example working bytes.
  multiple = layout.multiple                  # batch sizes the data axis divides
  small = (batch // 2 // multiple) * multiple or 2 * batch
  exact_small = steps.compile((), small).bytes
  if len(layouts) == 1:
    exact = steps.compile((), batch, "exact")
  if fraction is not None:
    budget_bytes = int(fraction * exact.bytes)
  notes += _reach(share, outside, paths, exact.bytes > budget_bytes)
  slope = (exact.bytes - exact_small) / (batch - small)
  fixed = exact.bytes - slope * batch
  working = slope - sum(s.residual_bytes for s in sites)   # what no site holds
  abn = abn_cost = None
  if exact.bytes > budget_bytes:
    abn, note = _inplace_abn(model, xs, inplace_abn, max_compiles)
    notes += [note] if note else []
    if abn is not None:
      abn_cost = steps.compile((abn,), batch, "InPlace-ABN alone")   # one compile

  def choices_of(state, added=None):     # added: Search.added, for the step-time column
    out = []
    for i, (s, r) in enumerate(zip(sites, state)):
      b, f = _kept(s, ladder[r])
      out.append(SiteChoice(s.path, ladder[r][0], ladder[r][1], s.residual_bytes - b, f,
                            None if sens is None else sens[s.path],
                            None if added is None else added(i, r)))
    return tuple(out)

  search = Search(
      sites, ladder, batch=batch, budget=budget_bytes, fixed=fixed, working=working,
      exact=exact, objective=objective, sensitivity=sens if quantizes else None,
      compile=lambda state, what: steps.compile(_policies(choices_of(state)), batch, what,
                                                heap_of=state),
      compiles_left=left, max_compiles=max_compiles).run()
  notes += search.notes
  of = objective.of
  under = ()                                  # techniques under every site (and the base)
  if abn_cost is not None:
    under, note = _weigh_inplace_abn(search, abn, abn_cost)
    notes.append(note)
  walk, at = search.walk, search.at
  notes += [search.walk_note] if search.walk_note else []
  if sens is not None and quantizes and search.index > 0 and at.bytes <= budget_bytes:
    if objective.time:
      notes.append("bit reductions not undone: the walk steers by the estimated step time, "
                   "and more bits cost more (larger codes); its compressed sites are at the "
                   "fewest bits of 2 or more allowed, 1 bit only where nothing at 2 bits fit")
    else:
      # Once the walk's plan fits: tries with the bit reductions it does not need undone
      # (`_undo_tries`). The estimate taken as it is undid too few (ResNet-20 at 25%, where
      # a compile saved half of the estimate's bytes or less, kept the most sensitive site,
      # the stem, at 4 bits): it is scaled by the compiled slope from the walk's last miss.
      notes += search.undo(steps.heaps, [site.path for site in sites])
      at = search.at
  if search.no_top and at.bytes > budget_bytes:
    notes.append(search.no_top)
  if search.cut and at.bytes > budget_bytes:
    notes.append(f"the per-site walk stopped over the budget at max_compiles={max_compiles}"
                 f"{' (InPlace-ABN alone took one)' if abn_cost is not None else ''}: more "
                 "compiles may find a plan that fits")
  choices = choices_of(search.state, search.added if objective.time else None)
  fits = at.bytes <= budget_bytes
  best = exact_best = None
  if max_batch:
    exact_best = _largest(*sorted([(small, exact_small), (batch, exact.bytes)]), budget_bytes,
                          multiple)
    if not (under or search.index):
      best = exact_best                   # the exact step's
    else:
      other = 2 * batch if fits else small
      at_other = steps.compile(under + _policies(choices), other).bytes
      best = _largest(*sorted([(batch, at.bytes), (other, at_other)]), budget_bytes,
                      multiple)
  if not fits and fixed > budget_bytes:
    notes.append(f"the exact step's line through batch {small} and {batch} puts "
                 f"{_size(fixed)} at batch 0 (parameters, optimiser state and the rest of "
                 f"what does not grow with the batch), over the budget of "
                 f"{_size(budget_bytes)}: the sites' policies change what grows with the "
                 "batch, so no batch is likely to fit")
  on_top = search.on_top
  estimates = tuple(search.predicted(s_) for s_ in walk) + (
      (search.predicted(search.top),) if on_top else ())
  front = _calibrated(estimates[:len(walk)],
                      {i: (m.bytes, of(m)) for i, s_ in enumerate(walk)
                       if (m := search.costs.get(s_)) is not None} |
                      {0: (exact.bytes, of(exact))}, floor=max(fixed, 0.0))
  if on_top:                                  # the top rung was compiled
    top = search.costs[search.top]
    front += ((float(top.bytes), float(of(top))),)
  index = len(front) - 1 if on_top else search.index
  result = Plan(budget_bytes, batch, choices, int(at.bytes), int(exact.bytes), at.flops,
                exact.flops, fits, best, exact_best, steps.compiles, front, index, tuple(notes),
                base + under, tuple(steps.measured), layout.shards, layout.mesh,
                layout.specs(x, y), on_top, estimates, device.name, device.label,
                objective.name, at.seconds, exact.seconds, tuple(steps.measured_seconds))
  if not fits:
    warnings.warn(
        f"jmem.plan: nothing found fits the budget of {_size(budget_bytes)} at batch {batch}: "
        f"the returned plan (fits=False) is the smallest step compiled, "
        f"{_size(at.bytes)} ({_size(at.bytes - budget_bytes)} over). Raise the "
        "budget, plan a smaller batch_size, or allow more policies (plan.table() shows each "
        "site's).", BudgetNotMetWarning, stacklevel=2)
  return result


def _weigh_inplace_abn(search, abn, abn_cost) -> tuple[tuple, str]:
  """``((abn,) or (), note)``: InPlace-ABN alone (``abn``, compiled to ``abn_cost``) is the
  plan where it fits at less cost than the search's plan, or fits where that does not, or
  (nothing fits) comes closer; then the search's plan becomes every site saved under it."""
  of, exact, budget, at = search.objective.of, search.exact, search.budget, search.at
  ratio = lambda m: of(m) / max(of(exact), 1e-30)
  unit = search.objective.name
  walk_fits = at.bytes <= budget
  if abn_cost.bytes > budget:
    why = f"misses the budget by {_size(abn_cost.bytes - budget)}"
  elif walk_fits:
    fewer = ("" if of(abn_cost) < of(at) else "no ") + (
        "less" if search.objective.time else "fewer")
    why = (f"fits at {ratio(abn_cost):.3f}x exact's {unit}, {fewer} than the per-site walk's "
           f"{ratio(at):.3f}x")
  else:
    why = f"fits at {ratio(abn_cost):.3f}x exact's {unit}, where the per-site walk does not"
  if (abn_cost.bytes <= budget and (not walk_fits or of(abn_cost) < of(at))) or (
      not walk_fits and abn_cost.bytes < at.bytes):
    search.state, search.at, search.index = search.walk[0], abn_cost, 0
    search.walk_note, search.on_top = None, False
    return (abn,), (f"InPlace-ABN alone {why}" + (", less than the per-site walk" if
                                                   abn_cost.bytes > budget else "") +
                    f": the plan is InPlace-ABN on the BatchNorms {abn.where!r} (their "
                    "activation inverted from the output; exact, but the scale is "
                    "|gamma| + epsilon: map existing weights with "
                    "jmem.surgery.inplace_abn_params)")
  return (), (f"InPlace-ABN alone {why}: the plan is the walk's (InPlace-ABN with per-site "
              "policies is not searched)")


class _Steps:
  """The cost model `plan` gives its `Search`: ``model``'s train step compiled with
  techniques, for ``device`` (a `jmem.measure.Target`), at a batch, on a `_Layout`
  (``layout``, set once chosen): its `Measured`, with the estimated step time where the
  ``objective`` has a step-time model. Counts the compiles, keeps what was compiled at the plan's
  batch (``measured``) and, for the states asked, their heap layouts (``heaps``)."""

  def __init__(self, model, optimizer, x, y, spec, abstract, loss_fn, device, objective,
               batch, notes, read_heaps):
    self.model, self.optimizer, self.x, self.y, self.spec = model, optimizer, x, y, spec
    self.abstract, self.loss_fn, self.device, self.batch = abstract, loss_fn, device, batch
    self.notes, self.read_heaps = notes, read_heaps
    self.constants = objective.constants      # None: no step-time model, no estimate
    self.compiles, self.measured, self.measured_seconds, self.heaps = 0, [], [], {}
    self.layout = None

  def compile(self, techniques, b, what=None, collectives=None, on=None, heap_of=None
              ) -> Measured:
    """The step compiled on the `_Layout` ``on`` (default: ``layout``); ``collectives``: a
    list the compiled HLO's collective count is appended to; ``heap_of``: a state to keep
    the compile's heap layout for (in ``heaps``)."""
    self.compiles += 1
    on = on or self.layout
    techniques = on.base + tuple(techniques)
    m = _converted(self.model, techniques) if techniques else self.model
    device = self.device
    # Data parallel alone on a GPU: XLA, not a Pallas call, as data_parallel trains it.
    with (_backends.automatic_xla("jmem.plan compiles the step with its batch split over "
                                  "the data axis (XLA cannot split a Pallas call over it)")
          if on.xla else contextlib.nullcontext()):
      step, args = _train_step(m, self.optimizer, self.spec(self.x, b), self.spec(self.y, b),
                               abstract=self.abstract, mesh=on.mesh,
                               specs=on.specs(self.x, self.y), loss_fn=self.loss_fn)
      args = device.place(args) if device.deviceless else args
      with device.lowering():
        heap = (_heap_of(step, args, self.notes) if heap_of is not None and self.read_heaps
                else None)
        self.read_heaps = self.read_heaps and (heap_of is None or heap is not None)
        if heap is None:
          lowered = step.lower(*args)
          step = lowered.compile()
        else:
          lowered, step = heap.lowered, heap.compiled
    if heap is not None:
      self.heaps[heap_of] = heap
    total, flops = measure.device_bytes_and_flops(step, lowered)
    seconds = (measure.estimate_step_time(step, flops, constants=self.constants).seconds
               if self.constants is not None else None)
    if collectives is not None:
      collectives.append(sum(measure.collective_counts(step.as_text()).values()))
    if what is not None and b == self.batch:
      self.measured.append((what, int(total), float(flops)))
      self.measured_seconds.append(seconds)
    return Measured(total, flops, seconds)


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
