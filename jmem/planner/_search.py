"""The planner's search: the upgrade path through the sites' ladders, and the walk along it
that compiles points until one fits the budget at the least cost, then tries the top rung
and the bit reductions the plan does not need. Everything it knows is in one `Search`
object; what a step costs comes from the cost model it is given (`CostModel`), so the walk
runs without a compiler in tests."""

from __future__ import annotations

import heapq
import math
import re
from collections.abc import Sequence

from jmem import measure
from jmem.ops.actnn import quantize as actnn_quantize
from jmem.planner._inputs import (Measured, _compiled_slope, _kept, _owner, _rung_text,
                                  _variance)
from jmem.planner._report import _size

# `Plan.measured`'s name for the one compile off the walk: every site on the top rung.
TOP_RUNG = "every site on the top rung"


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


def _undo_tries(state, at, anchor, estimate, relax, cost, affordable, budget,
                predict=None, known=lambda s: None):
  """``(state, its Measured, notes)``: the fitting plan ``state`` (compiled at ``at``, a
  `Measured`)
  with the bit reductions it does not need undone, tried by compiling while compiles are
  left. ``anchor``: ``(estimated, compiled)`` bytes of a step compiled before the plan (the
  walk's last miss); ``estimate(s)``: predicted bytes; ``relax(s, fits, least=0.0)``:
  `_relax`; ``cost(s)``: its compiled `Measured`; ``affordable(s)``: whether
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
  device_bytes = at.bytes
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
    got = cost(loose)
    loose_bytes = got.bytes
    undone = sum(a != b for a, b in zip(loose, state))
    if loose_bytes <= budget:
      anchor, state, at, device_bytes = here, loose, got, loose_bytes
      notes.append(f"undoing {undone} bit reductions {what} fitted: the plan has them undone")
    else:
      anchor = (estimate(loose), loose_bytes)
      by_layout = by_layout and not guided    # a try the layout predicted missed: no more
      notes.append(f"undoing {undone} bit reductions {what} missed the budget by "
                   f"{_size(loose_bytes - budget)}: the plan keeps them")
  return state, at, notes


def _cheapest_path(sites, ladder, added, sensitivity=None, start=None, allowed=None):
  """The sequence of (rungs per site) from ``start`` (default: all-save) that an objective
  other than FLOPs takes (`Objective.time`): each site's rungs reduced to its lower convex
  hull of (bytes kept, ``added(i, r)`` cost), the hull's steps of all sites taken in order of
  bytes saved per cost added (a step that saves bytes at no added cost first: the most
  bytes saved, or with ``sensitivity`` the most per gradient variance added), so that each
  point of the path is the cheapest of its bytes the sites' estimates know. ``allowed(r)``:
  the rungs this pass may use (default: all)."""
  state = list(start if start is not None else [0] * len(sites))
  runs = []                                   # per site: its hull's steps, (key, rung)
  for i, site in enumerate(sites):
    here, steps = state[i], []
    options = [r for r in range(len(ladder)) if allowed is None or allowed(r)]
    while True:
      b0, c0 = _kept(site, ladder[here])[0], added(i, here)
      best, best_key = None, None
      for r in options:
        b1, c1 = _kept(site, ladder[r])[0], added(i, r)
        saved = b0 - b1
        if saved <= 0:
          continue
        if c1 - c0 <= 0:                      # saves at no added cost
          if sensitivity is not None and ladder[r][0] == ladder[here][0] == "compress":
            c = sensitivity[site.path]
            var = _variance(c, ladder[r]) - _variance(c, ladder[here])
            key = (1, saved / var if var > 0 else math.inf, saved)
          else:
            key = (1, saved, 0.0)
        else:
          key = (0, saved / (c1 - c0), saved)
        if best_key is None or key > best_key:
          best, best_key = r, key
      if best is None:
        break
      steps.append((best_key, i, len(steps), best))
      here = best
    runs.append(steps)
  # Each site's steps keep their order; across sites, the steepest first (heapq.merge
  # keeps each run's order: where a site's keys do not fall along its run, e.g. a free step
  # after a costed one, that site's later step waits for its earlier one).
  path = [tuple(state)]
  for _, i, _, rung in heapq.merge(*runs, key=lambda t: t[0], reverse=True):
    state[i] = rung
    path.append(tuple(state))
  return path


def time_path(sites, ladder, added, sensitivity=None):
  """The upgrade path when the walk steers by an estimated step time (`_cheapest_path`):
  first compression alone, at the fewest bits of 2 or more the ladder allows (ActNN L3's 2,
  whose accuracy the digits runs check; more bits keep more and cost more, their codes
  being larger), on the sites where it removes the most bytes per second added first; then,
  past every such point, the rungs left the same way: fewer bits (1: less kept at no added
  time, so before any recomputation) and recomputation (which adds its forward's time).
  Where the ladder compresses at no width of 2 or more, all its rungs from the start.
  ``added(i, r)``: site ``i``'s added cost on rung ``r``."""
  widths = [bits for kind, bits in ladder if kind == "compress"]
  floor = min([b for b in widths if b >= 2], default=None)
  path = [tuple([0] * len(sites))]
  if floor is not None:
    path = _cheapest_path(sites, ladder, added, sensitivity,
                          allowed=lambda r: ladder[r] in (("save", None), ("compress", floor)))
  return path + _cheapest_path(sites, ladder, added, sensitivity, start=path[-1])[1:]


class Search:
  """The state of one plan's search: the upgrade path (``walk``), what each compiled point
  cost (``costs``), the points compiled over the budget (``misses``), the first known to fit
  (``hi``), and what the walk ends on (``state``, ``at``, ``index``, ``on_top``), with the
  notes it leaves.

  Args:
    sites: the sites' estimates (`jmem.planner._inputs._Site`), per example.
    ladder: every site's rungs (`site_ladder`).
    batch: the batch planned.
    budget: device bytes.
    fixed, working: the exact step's line: ``fixed + batch * (working + the sites' bytes
      kept)`` predicts a point's bytes.
    exact: the exact step's `Measured` at the batch.
    objective: the cost the walk steers by (`Objective`).
    compile: the cost model: ``compile(state, what)`` -> `Measured` of the step with the
      sites on the rungs ``state`` at the batch (what: the name it is compiled under).
    compiles_left: ``() -> int``: compiles the bound still allows.
    sensitivity: path -> GACT ``C`` (None: unknown), ordering bit reductions.
    max_compiles: the bound, for the notes.
  """

  def __init__(self, sites, ladder, *, batch, budget, fixed, working, exact, objective,
               compile, compiles_left, sensitivity=None, max_compiles=8):  # pylint: disable=redefined-builtin
    self.sites, self.ladder, self.batch, self.budget = list(sites), tuple(ladder), batch, budget
    self.fixed, self.working, self.exact, self.objective = fixed, working, exact, objective
    self.compile, self.compiles_left, self.sensitivity = compile, compiles_left, sensitivity
    self.max_compiles = max_compiles
    self._added = {}
    if objective.time:
      self.walk = time_path(self.sites, self.ladder, self.added, sensitivity)
    else:
      self.walk = _upgrade_path(self.sites, self.ladder, sensitivity)
    self.costs = {}                           # state -> its compiled `Measured`
    self.notes = []
    self.misses, self.hi = [0], None
    self.state, self.at, self.index = self.walk[0], exact, 0
    self.on_top, self.walk_note, self.no_top, self.cut = False, None, None, False
    self.top, self.end_bytes = self.walk[0], exact.bytes
    self._ran = False

  # ---------------------------------------------------------------- estimates

  def added(self, i: int, r: int) -> float:
    """Site ``i``'s added cost on rung ``r`` for a step at the batch (the objective's unit)."""
    if (i, r) not in self._added:
      self._added[i, r] = self.objective.added(self.sites[i], self.ladder[r], self.batch)
    return self._added[i, r]

  def predicted(self, state) -> tuple[float, float]:
    """``(bytes, cost)`` the estimate gives the step of ``state``."""
    kept = sum(_kept(s, self.ladder[r])[0] for s, r in zip(self.sites, state))
    cost = sum(self.added(i, r) for i, r in enumerate(state))
    return (self.fixed + self.batch * (self.working + kept),
            self.objective.of(self.exact) + cost)

  def choose(self, after: int) -> int:
    for i in range(after, len(self.walk)):
      if self.predicted(self.walk[i])[0] <= self.budget:
        return i
    return len(self.walk) - 1

  def cost(self, state, what="bit reductions undone") -> Measured:
    """``state``'s compiled `Measured` (compiled once)."""
    state = tuple(state)
    if state not in self.costs:
      name = f"walk point {self.walk.index(state)}" if state in self.walk else what
      self.costs[state] = self.compile(state, name)
    return self.costs[state]

  def top_of(self, state, smaller: bool = False) -> tuple:
    """``state`` with every site that saves anything on the top rung moved there (`_top_of`;
    ``smaller``: only where that keeps less, the try after the walk's end missed)."""
    return _top_of(self.sites, self.ladder, state, smaller)

  def relax(self, state, fits, least: float = 0.0) -> tuple:
    """``state`` with the bit reductions ``fits`` says it does not need undone, the most
    variance first (`_relax`; ``least``: a reduction adding under that share of the
    state's variance is left)."""
    return _relax(state, self.sites, self.ladder, self.sensitivity, fits, least)

  def cheaper_top(self, state) -> bool:
    """Whether the estimate puts every site on the top rung at less cost than ``state``."""
    top = self.top_of(state)
    return top != state and self.predicted(top)[1] < self.predicted(state)[1]

  def bytes_of(self, i: int) -> float:
    """Walk point ``i``'s compiled bytes (exact's for point 0)."""
    return self.costs[self.walk[i]].bytes if i else self.exact.bytes

  # ---------------------------------------------------------------- the search

  def run(self, first: int | None = None) -> "Search":
    """The walk to the first point that fits (module docstring, item 3), then the top-rung
    try, then, where nothing fits, the smallest step compiled. ``first``: the point to
    compile first (default: the first the estimate puts within the budget). Once per
    `Search`: its state is the walk's."""
    if self._ran:
      raise RuntimeError("Search.run walks once; make a new Search to walk again.")
    self._ran = True
    self._walk(first)
    self._try_top()
    self._smallest()
    return self

  def _walk(self, first):
    walk, budget = self.walk, self.budget
    # A step from compression into recomputation stops at the last point before it: the
    # recomputation's estimate is the least sure (it leaves out its own working set, and
    # on ResNet-20 it compiles larger than 2 bits: a line through compression points sent
    # the 22% walk past every point that fits, to recomputation everywhere at 1.33x FLOPs).
    first_recompute = next((i for i, s_ in enumerate(walk) if any(
        self.ladder[r][0].startswith("recompute") for r in s_)), None)
    stop = first_recompute - 1 if first_recompute is not None and first_recompute > 1 else None
    if first is None:
      first = self.choose(0) if self.exact.bytes > budget else 0
    index = min(first, stop) if stop is not None else first
    misses, hi = self.misses, None
    while index > 0:
      if self.cost(walk[index]).bytes <= budget:
        hi = index
      else:
        misses.append(index)
      index = _next_point(walk, misses, hi, lambda i: self.predicted(walk[i])[0],
                          self.bytes_of, budget, stop)
      # Once a point fits, bringing it back keeps a compile for the tries after the walk.
      keep = hi is not None and (self.sensitivity is not None and not self.objective.time
                                 or self.cheaper_top(walk[hi]))
      if index is None or self.compiles_left() <= keep:
        break
    self.hi = hi
    self.index = misses[-1] if hi is None else hi
    self.state = walk[self.index]
    self.at = self.costs[self.state] if self.index else self.exact
    self.cut = (self.index > 0 and self.at.bytes > budget and self.index < len(walk) - 1)

  def _try_top(self):
    walk, budget, of = self.walk, self.budget, self.objective.of
    state, index = self.state, self.index
    self.top = top = self.top_of(state, smaller=index == len(walk) - 1 and
                                 self.at.bytes > budget)
    self.end_bytes = end_bytes = self.at.bytes
    if index == len(walk) - 1 > 0 and self.at.bytes > budget and top != state:
      # The walk's end misses: the estimates of the last rungs are the least sure (a 1-bit
      # site's packing; a recomputation's own working set), and a site the estimate kept
      # at 1 bit may compile smaller recomputed from 2 bits. One compile tries every site
      # that saves anything on the top rung.
      if self.compiles_left() <= 0:
        self.no_top = (f"no compile left (max_compiles={self.max_compiles}) to try every site "
                       "that saves anything on the top rung after the walk's end missed: more "
                       "compiles may find a plan that fits")
        return
      got = self.cost(top, TOP_RUNG)
      if got.bytes <= budget:
        self.walk_note = (f"the walk's end missed the budget by {_size(end_bytes - budget)}; "
                          "every site that saves anything on the top rung "
                          f"({_rung_text(self.ladder[-1])}) fitted: that is the walk's plan")
        self.state, self.at, self.on_top = top, got, True
      else:
        self.notes.append(f"every site that saves anything on the top rung missed the budget "
                          f"by {_size(got.bytes - budget)} too (the walk's end by "
                          f"{_size(end_bytes - budget)})")
    elif index > 0 and self.at.bytes <= budget and self.cheaper_top(state) and \
        self.compiles_left() > 0:
      # The walk's plan fits, but the estimate says the top rung everywhere costs less:
      # where a model's convolutions are small the quantizer's elementwise work outweighs a
      # recomputation (the 2 x 4-device CNN in decisions.md: 1.208x exact's FLOPs at 1 and
      # 2 bits, 1.084x recomputed from 2 bits). One compile tries it.
      got = self.cost(top, TOP_RUNG)
      ratio = lambda v: f"{v / max(of(self.exact), 1e-30):.3f}x"
      what = (f"every site that saves anything on the top rung ({_rung_text(self.ladder[-1])}),"
              f" which the estimate put at {self.objective.fewer} than the walk's plan "
              f"({ratio(of(self.at))}),")
      if got.bytes <= budget and of(got) < of(self.at):
        self.walk_note = f"{what} fitted at {ratio(of(got))}: that is the plan"
        self.state, self.at = top, got
        self.on_top = top not in walk
        self.index = index if self.on_top else walk.index(top)
      else:
        self.notes.append(f"{what} compiled to {_size(got.bytes)} at {ratio(of(got))}: the "
                          "plan is the walk's")

  def _smallest(self):
    walk, budget = self.walk, self.budget
    if self.at.bytes <= budget or not self.costs:
      return
    # Nothing fits: the smallest step compiled, which need not be the last (past a point
    # the largest block's backward sets the peak, and recomputing adds its own working
    # set: on ResNet-20 and ResNet-50 recomputing from 2-bit inputs compiles larger than
    # compressing at 2 bits, the plan_one_bit study of docs/decisions.md).
    tried = {walk[0]: self.exact, **self.costs}
    smallest = min((s_ for s_ in tried if s_ in walk or s_ == self.top),
                   key=lambda s_: (tried[s_].bytes, tried[s_].flops))
    name = lambda s_: ("exact" if s_ == walk[0] else f"walk point {walk.index(s_)}"
                       if s_ in walk else TOP_RUNG)
    if smallest != self.state:
      self.walk_note = (
          f"nothing fits: the plan is the smallest of the steps compiled for the walk "
          f"({name(smallest)}, {_size(tried[smallest].bytes)}); the walk ended at "
          + ("its last point, every site on the highest rung that keeps less than "
             "the one below (a site none does stays saved), " if self.state == walk[-1]
             else "") + f"{name(self.state)} ({_size(self.end_bytes)})")
      self.state, self.at = smallest, tried[smallest]
      self.on_top = smallest not in walk          # else a walk point (index: the walk's end)
      self.index = self.index if self.on_top else walk.index(smallest)

  def undo(self, heaps=None, names=None) -> list[str]:
    """Where the plan fits and its sites' bit reductions were ordered by sensitivity: tries
    with the reductions it does not need undone (`_undo_tries`), the plan's heap layout
    predicting them where ``heaps`` (state -> `jmem.measure.HeapLayout`) has it. Returns
    the outcomes' notes; the search's plan is the last try that fitted."""
    heaps = heaps or {}
    lo = self.misses[-1]
    layouts = {}

    def layout_of(s_):
      if s_ not in layouts:
        layouts[s_] = (_heap_prediction(heaps[s_], s_, self.costs[s_].bytes, names,
                                        self.ladder) if s_ in heaps else None)
      return layouts[s_]
    notes = []
    if (any(_undoable(self.ladder, r) for r in self.state) and self.state in heaps and
        layout_of(self.state) is None):
      notes.append("no site's packed codes are named in the compiled step's heap layout (its "
                   "names do not carry the sites' module paths, as with NNX modules): "
                   "undoing bit reductions uses the per-site estimate alone")
    self.state, self.at, outcomes = _undo_tries(
        self.state, self.at, (self.predicted(self.walk[lo])[0], self.bytes_of(lo)),
        lambda s_: self.predicted(s_)[0],
        self.relax,
        self.cost, lambda s_: s_ in self.costs or self.compiles_left() > 0, self.budget,
        layout_of, lambda s_: self.costs[s_].bytes if s_ in self.costs else None)
    return notes + (["; then ".join(outcomes)] if outcomes else [])
