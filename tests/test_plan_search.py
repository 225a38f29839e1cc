"""The planner's search (`jmem.planner.Search`) with a stub cost model: no model, no compile.

Each test builds a few sites' estimates, the ladder `jmem.plan` uses, and a ``compile``
that says what a state's step "compiles" to, and checks where the walk goes."""

import pytest

from jmem import measure
from jmem import planner
from jmem.planner import _inputs, _search

LADDER = planner.site_ladder(None, True)     # save, 8, 4, 2, 1 bits, recompute from 2 bits
H100 = planner.Objective(measure.constants_for("h100"))


def _site(path, mib, flops=0.0, input_mib=None, arrays=4):
  """A site keeping ``mib`` MiB of float32 residuals per example."""
  values = mib * 2**20 / 4
  input_mib = mib / 4 if input_mib is None else input_mib
  return _inputs._Site(path, residual_bytes=mib * 2**20, input_bytes=input_mib * 2**20,  # pylint: disable=protected-access
                       input_values=input_mib * 2**20 / 4, forward_flops=flops,
                       values=values, residuals=arrays)


def _search_of(sites, budget, compile_, objective=planner.Objective(), max_compiles=8,
               batch=16, fixed=64 * 2**20, working=2**20):
  """A `Search` of ``sites`` whose cost model is ``compile_(state)``, and the list of what
  it compiles; two compiles of the bound go to the exact step, as in `jmem.plan`."""
  compiles = []

  def counted(state, what):
    compiles.append((state, what))
    return compile_(state)
  exact_bytes = fixed + batch * (working + sum(s.residual_bytes for s in sites))
  exact = planner.Measured(exact_bytes, 1e12, 0.05 if objective.time else None)
  search = _search.Search(
      sites, LADDER, batch=batch, budget=budget, fixed=fixed, working=working, exact=exact,
      objective=objective, compile=counted,
      compiles_left=lambda: max_compiles - 2 - len(compiles), max_compiles=max_compiles)
  return search, compiles


def _linear(search, keep=0.5):
  """A stub compile whose saving is ``keep`` of the estimate's, the cost the estimate's."""
  exact = search.predicted(search.walk[0])[0]

  def compile_(state):
    b, c = search.predicted(state)
    return planner.Measured(exact - keep * (exact - b), 1e12 + (c if not search.objective.time
                                                               else 0.0),
                            c if search.objective.time else None)
  return compile_


SITES = [_site("stem", 6.0, 1e8), _site("block1", 12.0, 4e8), _site("block2", 8.0, 6e8),
         _site("block3", 3.0, 9e8), _site("head", 0.5, 2e8)]


@pytest.mark.parametrize("objective", [planner.Objective(), H100], ids=["flops", "time"])
@pytest.mark.parametrize("share", [0.85, 0.65, 0.5])
def test_walk_finds_the_first_fitting_point_where_compiled_bytes_follow_a_line(objective,
                                                                               share):
  """Where compiled bytes are a line in the estimate's (here 70% of its saving), the walk's
  secant steps find the first point of the path that fits, within the compile bound."""
  search, compiles = _search_of(SITES, 0, lambda s: None, objective)
  stub = _linear(search, keep=0.7)
  exact = search.predicted(search.walk[0])[0]
  budget = exact * share
  search, compiles = _search_of(SITES, budget, lambda s: stub(s), objective)
  search.run()
  first = next(i for i, s in enumerate(search.walk) if stub(s).bytes <= budget)
  stop = next((i - 1 for i, s in enumerate(search.walk)
               if any(LADDER[r][0].startswith("recompute") for r in s)), None)
  if stop is None or first <= stop:
    assert search.index == first and search.at.bytes <= budget, (search.index, first)
    assert search.at == stub(search.walk[first])
  assert len(compiles) <= 6 and len(set(c[0] for c in compiles)) == len(compiles)


def test_a_step_time_objective_compresses_the_fewest_sites_at_two_bits():
  """Minimising an estimated step time, compression goes to 2 bits at once (8 and 4 bits keep
  more and cost more: larger codes), the sites that save the most bytes per second first;
  1 bit only past every point at 2 bits; a budget that needs one site compressed leaves the
  rest saved, in less time than 2 bits everywhere."""
  search, _ = _search_of(SITES, 0, lambda s: None, H100)
  walk, two, one = search.walk, LADDER.index(("compress", 2)), LADDER.index(("compress", 1))
  used = {r for s in walk for r in s}
  assert LADDER.index(("compress", 8)) not in used and LADDER.index(("compress", 4)) not in used
  first_one = next(i for i, s in enumerate(walk) if one in s)
  assert all(one not in s for s in walk[:first_one])
  assert all(r != 0 for r in walk[first_one - 1]), "every site compressed before 1 bit"
  # Bytes fall along the path, and to its last 2-bit point the cost only grows.
  predicted = [search.predicted(s) for s in walk]
  assert all(b1 < b0 for (b0, _), (b1, _) in zip(predicted, predicted[1:]))
  assert all(c1 >= c0 for (_, c0), (_, c1) in zip(predicted[:first_one], predicted[1:first_one]))
  assert len(set(walk)) == len(walk)
  # The first step is the largest site, the one with the most bytes per second added.
  assert walk[1] == tuple(two if s.path == "block1" else 0 for s in SITES)
  # A budget that one site at 2 bits meets: the plan compresses that site alone.
  stub = _linear(search, keep=1.0)
  budget = stub(walk[1]).bytes + 1.0
  search, _ = _search_of(SITES, budget, stub, H100)
  search.run()
  assert search.state == walk[1] and search.at.bytes <= budget
  everywhere = tuple(two for _ in SITES)
  assert search.at.seconds < stub(everywhere).seconds


def test_bit_widths_without_two_take_the_ladders_own_rungs():
  """With ``bits=(8, 4)`` (no width of 2 or more below 4), the time walk compresses at 4 bits,
  the fewest allowed, and never at 8."""
  ladder = planner.site_ladder("compress", True, (8, 4))
  sites = SITES[:3]
  path = _search.time_path(sites, ladder, lambda i, r: H100.added(sites[i], ladder[r], 16))
  assert {r for s in path for r in s} == {0, ladder.index(("compress", 4))}


def test_every_site_on_the_top_rung_is_reached_where_compression_compiles_too_large():
  """Where every compression point compiles over the budget (they compile to more than
  estimated), the search still reaches every site on the top rung, which fits."""
  search, _ = _search_of(SITES, 0, lambda s: None)
  exact = search.predicted(search.walk[0])[0]
  top = len(LADDER) - 1

  def stub(state):
    b, c = search.predicted(state)
    if all(r == top for r in state):
      return planner.Measured(0.3 * exact, 1.3e12)
    return planner.Measured(max(b, 0.5 * exact), 1e12 + c)
  search, compiles = _search_of(SITES, 0.4 * exact, stub, max_compiles=12)
  search.run()
  assert search.state == tuple(top for _ in SITES) and search.at.bytes <= 0.4 * exact
  assert len(compiles) <= 10


def test_nothing_fitting_gives_the_smallest_step_compiled():
  """Where no step fits, the plan is the smallest compiled, not the walk's last."""
  search, _ = _search_of(SITES, 0, lambda s: None)
  exact = search.predicted(search.walk[0])[0]
  sizes = {}

  def stub(state):
    sizes[state] = 0.6 * exact + 0.01 * exact * sum(r == len(LADDER) - 1 for r in state)
    return planner.Measured(sizes[state], 1e12)
  search, _ = _search_of(SITES, 0.1 * exact, stub, max_compiles=6)
  search.run()
  assert search.at.bytes == min(sizes.values()) and search.at.bytes > 0.1 * exact
  assert "nothing fits" in (search.walk_note or "")


def test_a_fitting_plan_gets_back_the_bits_the_budget_does_not_need():
  """With sensitivities (FLOPs objective), once the walk's plan fits, `Search.undo` tries
  it with the bit reductions the budget does not need undone, the most sensitive site's
  first; a try is kept only where it fits, and each costs one compile of the bound."""
  sens = {"stem": 100.0, "block1": 1.0, "block2": 1.0, "block3": 1.0, "head": 1.0}
  search, _ = _search_of(SITES, 0, lambda s: None)
  stub = _linear(search, keep=0.5)
  exact = search.predicted(search.walk[0])[0]
  budget = 0.62 * exact                # some sites below 8 bits
  compiled = []
  search = _search.Search(SITES, LADDER, batch=16, budget=budget, fixed=64 * 2**20,
                          working=2**20, exact=planner.Measured(exact, 1e12),
                          objective=planner.Objective(), sensitivity=sens,
                          compile=lambda s, what: compiled.append((s, what)) or stub(s),
                          compiles_left=lambda: 8 - len(compiled))
  search.run()
  walk_compiles = len(compiled)
  walked = search.state
  assert search.at.bytes <= budget
  notes = search.undo()
  assert search.at.bytes <= budget and search.at == stub(search.state)
  variance = lambda st: sum(_inputs._variance(sens[site.path], LADDER[r])  # pylint: disable=protected-access
                            for site, r in zip(SITES, st))
  undone = [i for i, (a, b) in enumerate(zip(search.state, walked)) if a != b]
  assert notes and undone and all(search.state[i] == walked[i] - 1 for i in undone), notes
  assert variance(search.state) < variance(walked)
  tries = compiled[walk_compiles:]                  # one compile per try, none repeated
  assert tries and all(what == "bit reductions undone" for _, what in tries), tries
  assert len({s for s, _ in compiled}) == len(compiled) <= 8
  assert search.state in [s for s, _ in tries] and len(notes[-1].split("; then ")) == len(tries)
  with pytest.raises(RuntimeError, match="walks once"):
    search.run()


@pytest.mark.parametrize("policies, bits", [("recompute", None), ("recompute_compressed", None),
                                            ("compress", 1), (None, (8, 1))])
def test_the_time_path_takes_any_ladder(policies, bits):
  """The time path on ladders without a width of 2 or more, or without compression: bytes
  fall at every point, no state repeats, and every site ends on a rung that keeps less."""
  ladder = planner.site_ladder(policies, policies != "recompute", bits)
  path = _search.time_path(SITES, ladder, lambda i, r: H100.added(SITES[i], ladder[r], 16))
  kept = lambda st: sum(_inputs._kept(s, ladder[r])[0] for s, r in zip(SITES, st))  # pylint: disable=protected-access
  assert len(path) > 1 and len(set(path)) == len(path)
  assert all(kept(b) < kept(a) for a, b in zip(path, path[1:]))
  assert all(r > 0 for r in path[-1])
