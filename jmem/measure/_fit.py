"""How a step's memory grows with its batch, the largest batch that fits (`fit_batch`), and
step times (`time_steps`)."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from jmem.measure._compiled import CompiledMemory, _memory_of, step_flops
from jmem.measure._heap import collective_counts
from jmem.measure.targets import Target, TargetError, target as get_target

__all__ = ["GIB", "BatchFit", "fit_batch", "fit_step", "time_steps"]


GIB = 2**30


@dataclasses.dataclass(frozen=True)
class BatchFit:
  """How a compiled step's device memory grows with its batch, and the largest batches
  that fit given budgets (`fit_batch`).

  Device bytes are what the step holds at once: arguments + outputs − donated + temp
  (`CompiledMemory.total_bytes`), so weights, optimiser state, gradients and the batch
  itself are all in. They are fitted as ``fixed_bytes + per_example_bytes * batch``
  through two batch sizes.

  Attributes:
    batch_sizes: the two batch sizes of the fit.
    device_bytes: the step's device bytes at each.
    temp_bytes: its temp bytes at each.
    per_example_bytes: device bytes one more example costs (the slope).
    per_example_temp_bytes: temp bytes one more example costs (activations, working set).
    fixed_bytes: the intercept: parameters, optimiser state, gradients and other buffers
      that do not grow with the batch.
    flops: `step_flops` of the step at ``batch_sizes[0]`` (XLA's cost analysis; off the CPU
      of the lowered step where ``compile_at`` gives it; 0.0 where the backend gives none).
    max_batch: budget in bytes -> the largest batch whose compiled step was seen to fit:
      the line's guess where it fits, else the best of a bracketed search (0: none fits;
      None: memory did not grow with the batch and nothing seen went over). A lower bound:
      the true largest batch lies in ``[max_batch, over_budget)``.
    over_budget: budget in bytes -> the smallest batch seen NOT to fit (None: no compiled
      batch went over the budget).
    compiles: compiles made (the fit's two included).
    collectives: op -> count of the collectives (`COLLECTIVE_OPS`) in the compiled step at
      ``batch_sizes[0]``, those it has only (empty on one device).
    memory: batch -> the `CompiledMemory` of every batch compiled (temp, argument, output
      and aliased bytes).
    target: the name of the `jmem.measure.Target` the figures are for (`fit_step`;
      ``"default"`` where ``compile_at`` compiled for the default backend).
  """

  batch_sizes: tuple[int, int]
  device_bytes: tuple[int, int]
  temp_bytes: tuple[int, int]
  per_example_bytes: float
  per_example_temp_bytes: float
  fixed_bytes: float
  flops: float
  max_batch: dict[int, int | None]
  over_budget: dict[int, int | None]
  compiles: int
  collectives: dict[str, int] = dataclasses.field(default_factory=dict)
  memory: dict[int, CompiledMemory] = dataclasses.field(default_factory=dict)
  target: str = "default"


def fit_batch(compile_at: Callable[[int], Any], batch_sizes: tuple[int, int],
              budgets: Sequence[int] = (16 * GIB, 80 * GIB), *,
              max_compiles: int = 3) -> BatchFit:
  """Device bytes of a step against its batch size, and the largest batch per budget.

  Args:
    compile_at: ``batch -> compiled step`` (a ``jax.stages.Compiled``: ``f.lower(...)
      .compile()`` for arguments of that batch size), or ``(compiled, lowered)`` with the
      ``jax.stages.Lowered`` it came from (its FLOPs count off the CPU: `step_flops`).
    batch_sizes: two different batch sizes to fit the line through.
    budgets: device memory budgets in bytes.
    max_compiles: compiles per budget to confirm its largest batch. The line's guess is
      compiled; where it does not fit (memory need not be linear in the batch) the search
      narrows the bracket [largest seen to fit, smallest seen over] along the line through
      its ends (halving it where the line leaves it), down to batch 1.

  Returns:
    A `BatchFit`.
  """
  b0, b1 = sorted(batch_sizes)
  if b0 < 1 or b0 == b1:
    raise ValueError(f"fit_batch needs two different positive batch sizes, got {batch_sizes}.")
  seen: dict[int, tuple[int, int]] = {}
  memories: dict[int, CompiledMemory] = {}
  flops, collectives = 0.0, {}

  def measure_at(b):
    nonlocal flops
    compiled = compile_at(b)
    compiled, lowered = compiled if isinstance(compiled, tuple) else (compiled, None)
    memory = _memory_of(compiled)
    memories[b] = memory
    seen[b] = (memory.total_bytes, memory.temp_bytes)
    if b == b0:
      flops = step_flops(compiled, lowered)
      collectives.update((op, n) for op, n in collective_counts(compiled.as_text()).items()
                         if n)
    return seen[b][0]

  measure_at(b0)
  measure_at(b1)
  slope = (seen[b1][0] - seen[b0][0]) / (b1 - b0)
  fixed = seen[b0][0] - slope * b0
  best: dict[int, int | None] = {}
  above: dict[int, int | None] = {}
  for budget in budgets:
    fits = [b for b, (t, _) in seen.items() if t <= budget]
    over = [b for b, (t, _) in seen.items() if t > budget]

    def between(lo, hi, budget=budget):
      """The line through the bracket's ends (a fitting batch, one over), else halfway."""
      if hi is None:
        return None
      if lo > 0:
        s = (seen[hi][0] - seen[lo][0]) / (hi - lo)
        g = lo + int((budget - seen[lo][0]) // s) if s > 0 else hi
        if lo < g < hi:
          return g
      return (lo + hi) // 2

    guess = int((budget - fixed) // slope) if slope > 0 else None
    for _ in range(max_compiles):
      lo, hi = max(fits, default=0), min(over, default=None)
      if hi is not None and hi - lo <= 1:
        break                                    # the largest batch is known exactly
      if guess is None or guess <= lo or (hi is not None and guess >= hi):
        guess = between(lo, hi)
        if guess is None or guess <= lo:
          break
      fitted = measure_at(guess) <= budget
      (fits if fitted else over).append(guess)
      if fitted and not over:
        break                                    # the line's guess fits, nothing seen above
      guess = between(max(fits, default=0), min(over, default=None))
    if slope <= 0 and not over:
      best[budget] = None                        # memory does not grow with the batch here
    else:
      best[budget] = max(fits, default=0)
    above[budget] = min(over, default=None)
  return BatchFit((b0, b1), (seen[b0][0], seen[b1][0]), (seen[b0][1], seen[b1][1]),
                  slope, (seen[b1][1] - seen[b0][1]) / (b1 - b0), fixed, flops, best,
                  above, len(seen), collectives, memories)


def fit_step(step: Callable[..., Any], args_at: Callable[[int], tuple], *,
             target: str | Target | None = None, batch_sizes: tuple[int, int] = (64, 128),
             memory_limit: int | None = None, max_compiles: int = 3) -> BatchFit:
  """A step's compiled memory on ``target`` against its batch, and its largest batch there.

  The step is compiled for ``target`` at both ``batch_sizes`` (their temp, argument and
  output bytes: `BatchFit.memory`; the slope between them: what one more example costs),
  then at the batch whose device bytes (arguments + outputs not aliased to a donated
  argument + temp) the line puts within ``memory_limit``, to confirm it fits
  (`fit_batch`'s search where it does not).

  Args:
    step: the train step, e.g. ``jax.jit(step, donate_argnums=0)`` or `jmem.measure.jit`'s
      (a plain function is jitted with `jmem.measure.jit`).
    args_at: ``batch -> (args...)``: the step's positional arguments at that batch size
      (arrays or `jax.ShapeDtypeStruct`s; placed on the target's device).
    target: a `jmem.measure.Target` or its name (`jmem.measure.target`; default: JAX's
      default backend).
    batch_sizes: the two batch sizes of the slope.
    memory_limit: the device bytes a step may hold (default: the target's; required where
      it has none, as on a CPU).
    max_compiles: compiles to confirm the largest batch (`fit_batch`).

  Returns:
    A `BatchFit` (``max_batch[memory_limit]``: the largest batch seen to fit) whose
    ``target`` names the target.
  """
  on = get_target(target)
  limit = on.memory_limit if memory_limit is None else memory_limit
  if limit is None:
    raise TargetError(f"The {on.name} target ({on.device_kind}) has no memory limit to fit "
                      "a batch into: give memory_limit= (bytes).")
  if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
    raise TargetError(f"memory_limit must be a positive number of bytes, got {limit!r}.")
  if not callable(args_at):
    raise TypeError("args_at must be a function of the batch size returning the step's "
                    f"positional arguments, got {type(args_at).__name__}.")

  def compile_at(b):
    args = args_at(b)
    if not isinstance(args, tuple):
      raise TypeError(f"args_at({b}) must return a tuple of the step's positional "
                      f"arguments, got {type(args).__name__}.")
    lowered = on.lower(step, *args)
    return on.compile_lowered(lowered), lowered

  fit = fit_batch(compile_at, batch_sizes, [limit], max_compiles=max_compiles)
  return dataclasses.replace(fit, target=on.name)


def time_steps(steps: Mapping[str, Callable[[], Any]], *, warmup: int = 2, repeats: int = 10,
               baseline: str | None = None) -> dict[str, dict[str, float]]:
  """Median wall time of several step functions, interleaved so drift hits all alike.

  Each callable runs one full step (already jitted, arguments bound) and returns something
  to block on. After ``warmup`` calls each, the functions are called round-robin
  ``repeats`` times.

  Args:
    steps: name -> zero-argument callable.
    warmup: untimed calls per function (compilation happens here).
    repeats: timed calls per function.
    baseline: name whose median is the denominator of ``ratio`` (default: the first).

  Returns:
    name -> ``{"median_s", "min_s", "ratio"}``.
  """
  if not steps:
    raise ValueError("time_steps needs at least one step function.")
  if repeats < 1 or warmup < 0:
    raise ValueError(f"Need repeats >= 1 and warmup >= 0, got {repeats=}, {warmup=}.")
  baseline = baseline if baseline is not None else next(iter(steps))
  if baseline not in steps:
    raise ValueError(f"baseline {baseline!r} is not one of {sorted(steps)}.")
  for fn in steps.values():
    for _ in range(warmup):
      jax.block_until_ready(fn())
  times: dict[str, list[float]] = {k: [] for k in steps}
  for _ in range(repeats):
    for name, fn in steps.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn())
      times[name].append(time.perf_counter() - t0)
  base = statistics.median(times[baseline])
  return {k: {"median_s": statistics.median(v), "min_s": min(v),
              "ratio": statistics.median(v) / base} for k, v in times.items()}
