"""Reading XLA's buffer assignment of a compiled step: what is live at its peak
(`peak_buffers`), where each temp buffer sits and when (`heap_layout`), and its
collectives (`collective_counts`)."""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import re
import tempfile
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jmem.measure._compiled import (CompiledMemory, _compile, _memory_of, jit,
                                    platform_of_args, xla_compiler_options)

__all__ = ["PeakBuffer", "PeakReport", "peak_buffers", "HeapBuffer", "HeapLayout",
           "heap_layout", "DumpUnavailableError", "collective_counts", "COLLECTIVE_OPS"]


@dataclasses.dataclass(frozen=True)
class PeakBuffer:
  """One buffer live at the peak of a compiled function's heap.

  Attributes:
    name: the HLO value (instruction or parameter) that owns the buffer.
    bytes: its size.
    shape: its HLO shape.
    op_name: the JAX name stack of the instruction that defines it (``jit(step)/
      transpose(jvp(...))/model/Block_3/Conv_0/conv_general_dilated``); "" for parameters.
    kind: ``"argument"`` (a parameter of the function: weights, optimiser state, inputs),
      ``"backward"`` (defined by a transposed, i.e. backward, computation: gradients and the
      backward pass's working set), ``"forward"`` (defined in the forward pass and still
      live: what is saved for the backward, compressed or not), or ``"other"`` (the update,
      constants, layout copies XLA made without a name).
    scope: ``op_name`` without the transformation wrappers and the primitive: the module
      path of the layer that made it (``model/Block_3/Conv_0``); for a buffer XLA made
      without a name, ``"read by "`` and the path of the first instruction that reads it.
    op: the JAX primitive of ``op_name`` (or of that reader), e.g. ``conv_general_dilated``.
  """

  name: str
  bytes: int
  shape: str
  op_name: str
  kind: str
  scope: str
  op: str = ""


@dataclasses.dataclass(frozen=True)
class PeakReport:
  """The buffers live at the peak of XLA's heap simulation of a compiled function.

  ``total_bytes`` counts every live buffer (arguments included), so it exceeds
  ``memory_analysis().temp_size_in_bytes``; the sum over kinds other than ``"argument"``
  (``live_temp_bytes``) is the temp part at that moment. ``memory``: the same compile's
  `CompiledMemory` (None where the report was built without one).
  """

  position: int
  buffers: tuple[PeakBuffer, ...]
  memory: CompiledMemory | None = None

  @property
  def total_bytes(self) -> int:
    return sum(b.bytes for b in self.buffers)

  @property
  def live_temp_bytes(self) -> int:
    """Bytes live at the peak that are not arguments: what the temp allocation must hold
    at that moment."""
    return sum(b.bytes for b in self.buffers if b.kind != "argument")

  @property
  def layout_bytes(self) -> int | None:
    """The compiled temp allocation less `live_temp_bytes`: what XLA's placement of the
    buffers in one heap adds over what is live at the peak (buffers of different times
    that cannot share addresses). It changes where no live buffer at the peak does: on
    ResNet-20 at 25% (docs/decisions.md) storing stage-2 and stage-3
    residuals at 8 bits instead of 4 left the peak's live bytes unchanged and added 6.5 MiB
    here. It can be slightly negative: two live values sharing one buffer (an in-place
    update) are counted twice in the live bytes. None without ``memory``."""
    return None if self.memory is None else self.memory.temp_bytes - self.live_temp_bytes

  def by(self, key: str = "kind") -> dict[str, int]:
    """Bytes per value of a `PeakBuffer` field (``"kind"``, ``"scope"``, ``"shape"``),
    largest first."""
    out: dict[str, int] = {}
    for b in self.buffers:
      out[getattr(b, key)] = out.get(getattr(b, key), 0) + b.bytes
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))

  def table(self, top: int = 20) -> str:
    """A Markdown table of the ``top`` largest buffers live at the peak."""
    rows = ["| MiB | kind | shape | scope | op |", "|---:|---|---|---|---|"]
    for b in sorted(self.buffers, key=lambda b: -b.bytes)[:top]:
      rows.append(f"| {b.bytes / 2**20:.1f} | {b.kind} | `{b.shape.split('{')[0]}` | "
                  f"{b.scope or '(top level)'} | {b.op} |")
    return "\n".join(rows)


_WRAPPER = re.compile(r"^(jit|jvp|transpose|remat|checkpoint|vmap|pjit|custom_jvp_call|"
                      r"custom_vjp_call|shard_map|cond|while|body|branch_\d+_fun)\b")


def _scope(op_name: str) -> str:
  """``op_name`` without transformation wrappers (``jvp(...)``, a transformed module's
  ``Block.fn``, jmem's ``Converted`` wrapper) and the final primitive; a path that the name
  stack repeats (a module inside a transform) is given once, as is a name repeated next to
  itself."""
  parts = [p for p in op_name.split("/")[:-1]
           if p and not _WRAPPER.match(p) and p not in ("Converted", "rematted_computation")
           and not p.endswith((".fn", "._run"))]
  if parts:
    parts = parts[max(i for i, p in enumerate(parts) if p == parts[0]):]
  return "/".join(p for i, p in enumerate(parts) if i == 0 or p != parts[i - 1])


def _hlo_definitions(hlo: str):
  """``({name: (shape, opcode, op_name)}, {name: op_name of its first named reader})`` of
  the instructions of an HLO module's text. An instruction without an ``op_name`` of its own
  (a fusion or wrapped op) takes its called computation's first one."""
  inst = re.compile(r"\s*(?:ROOT )?%?([\w.\-]+) = (\S+(?: \S+)*?) ([\w\-]+)\((.*)$")
  computations: dict[str, str] = {}
  raw, current = [], None
  for line in hlo.splitlines():
    head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
    if head and not line.startswith(" "):
      current = head.group(1)
      continue
    d = inst.match(line)
    if not d:
      continue
    op = re.search(r'op_name="((?:[^"\\]|\\.)*)"', line)
    op_name = op.group(1).replace("\\'", "'").replace('\\"', '"') if op else ""
    if current is not None and op_name and current not in computations:
      computations[current] = op_name
    called = re.search(r"(?:calls|to_apply)=%?([\w.\-]+)", line)
    raw.append((d.group(1), d.group(2), d.group(3), op_name, called and called.group(1),
                d.group(4)))
  defs, users = {}, {}
  for name, shape, opcode, op_name, called, rest in raw:
    op_name = op_name or computations.get(called, "")
    defs[name] = (shape, opcode, op_name)
    if op_name:
      for operand in re.findall(r"%([\w.\-]+)", rest.split("), ")[0]):
        users.setdefault(operand, op_name)
  return defs, users


@contextlib.contextmanager
def _no_persistent_cache():
  """JAX's persistent compilation cache off for one compile: a compile it answers runs no
  XLA pass and writes no dump (its key leaves the dump options out), so a step compiled
  before, in this process or in an earlier one sharing the cache directory, would have
  none. JAX decides once per process whether the cache is used; turning it off and on
  again takes its (private) `reset_cache`, without which the cache stays as it is."""
  from jax._src import compilation_cache  # pylint: disable=g-import-not-at-top
  reset = getattr(compilation_cache, "reset_cache", None)
  if reset is None or not jax.config.jax_enable_compilation_cache:
    yield
    return
  jax.config.update("jax_enable_compilation_cache", False)
  reset()
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", True)
    reset()


class DumpUnavailableError(RuntimeError):
  """The backend wrote no buffer-assignment dump (or not the part needed) for a compile:
  `peak_buffers` and `heap_layout` cannot read it. The compile itself succeeded."""


def _dumped_compile(f, args, kwargs, who: str):
  """``(compiled, live-range text, buffer-assignment text, lowered)``: ``f`` compiled (as
  `compiled_memory` does) with XLA's buffer-assignment dump into a temporary directory, and
  the ``jax.stages.Lowered`` it was compiled from."""
  if not hasattr(f, "lower"):
    f = jit(f)
  with tempfile.TemporaryDirectory() as d, _no_persistent_cache():
    platform = platform_of_args(args, kwargs) or jax.default_backend()
    options = {**xla_compiler_options(platform), "xla_dump_to": d,
               "xla_dump_hlo_as_text": True}
    lowered = f.lower(*args, **kwargs)
    compiled = lowered.compile(compiler_options=options)
    ranges = sorted(glob.glob(os.path.join(d, "*after_optimizations-live-range.txt")))
    if not ranges:
      raise DumpUnavailableError(
          f"XLA on {jax.default_backend()!r} wrote no live-range dump; {who} needs "
          "the buffer-assignment dump of --xla_dump_to (a compile answered from JAX's "
          "persistent compilation cache writes none)")
    # The largest module is the step (small helper modules are dumped too).
    path = max(ranges, key=os.path.getsize)
    with open(path) as fh:
      live = fh.read()
    assignment = path.replace("-live-range.txt", "-buffer-assignment.txt")
    placed = ""
    if os.path.exists(assignment):
      with open(assignment) as fh:
        placed = fh.read()
  return compiled, live, placed, lowered


def peak_buffers(f: Callable[..., Any], *args, **kwargs) -> PeakReport:
  """What is live at the peak of ``f``'s compiled heap, buffer by buffer, with the layer and
  the pass (forward residual, backward working set, argument) that each comes from.

  Compiles ``f`` (as `compiled_memory` does) with XLA's buffer-assignment dump into a
  temporary directory and reads its live ranges at the peak. The way to see why a
  technique's saving at the peak is smaller than its saving in residuals. The report's
  ``memory`` is that compile's `CompiledMemory`, so its ``layout_bytes`` (the temp
  allocation over the bytes live at the peak) comes from one compile.

  Raises:
    DumpUnavailableError: (a RuntimeError) if the backend wrote no live-range dump.
  """
  compiled, text, _, _ = _dumped_compile(f, args, kwargs, "peak_buffers")
  m = re.search(r"Live ranges at (\d+) \(peak\):\n((?:    .*\n)*)", text)
  if m is None:
    raise DumpUnavailableError(f"No peak found in XLA's live-range dump on "
                               f"{jax.default_backend()!r}.")
  defs, users = _hlo_definitions(compiled.as_text())
  buffers = []
  for line in m.group(2).splitlines():
    b = re.match(r"\s+([\w.\-]+)\{[^}]*\}: (\d+) bytes", line)
    if not b:
      continue
    name, size = b.group(1), int(b.group(2))
    shape, opcode, op_name = defs.get(name, ("?", "?", ""))
    if opcode == "parameter":
      kind = "argument"
    elif "transpose(" in op_name:
      kind = "backward"
    elif op_name:
      kind = "forward"
    else:
      kind = "other"
    scope, op = _scope(op_name), op_name.rsplit("/", 1)[-1]
    if kind == "argument":
      scope, op = op_name or name, "parameter"
    elif not op_name and name in users:        # named by the layer that reads it
      scope, op = ("read by " + (_scope(users[name]) or "(top level)"),
                   users[name].rsplit("/", 1)[-1])
    buffers.append(PeakBuffer(name, size, shape, op_name, kind, scope, op))
  return PeakReport(int(m.group(1)), tuple(buffers), _memory_of(compiled))


@dataclasses.dataclass(frozen=True)
class HeapBuffer:
  """One buffer of a compiled function's temp allocation (values XLA keeps in one buffer,
  an in-place update's input and output, are one).

  Attributes:
    name: the HLO value that defines it (the first, where values share it).
    bytes: its size.
    offset: where XLA placed it in the temp allocation.
    start: the first position of the schedule it is live at.
    end: the last (inclusive): where its last reader runs.
    shape: its HLO shape.
    op_name: the JAX name stack of the instruction that defines it ("" if none).
    end_op_name: that of the instruction at ``end`` (its last reader).
  """

  name: str
  bytes: int
  offset: int
  start: int
  end: int
  shape: str
  op_name: str
  end_op_name: str


@dataclasses.dataclass(frozen=True)
class HeapLayout:
  """The temp allocation of a compiled function, buffer by buffer, with each buffer's live
  range over the schedule, read from XLA's buffer-assignment dump; ``memory``: the same
  compile's `CompiledMemory`; ``compiled``: that compiled function (its cost analysis,
  say), so one compile gives both; ``lowered``: the ``jax.stages.Lowered`` it came from
  (`step_flops` counts it off the CPU).

  `simulate` places the buffers again, resized, to predict what the temp allocation of a
  step whose buffers change size (a residual stored at 8 bits instead of 4) would be,
  without compiling it. What live bytes alone cannot say: a larger buffer that is dead at
  the peak can still grow the allocation (docs/decisions.md, "Planner": the plan_undo_peak study).
  """

  buffers: tuple[HeapBuffer, ...]
  memory: CompiledMemory
  compiled: Any = dataclasses.field(default=None, repr=False, compare=False)
  lowered: Any = dataclasses.field(default=None, repr=False, compare=False)

  @property
  def extent(self) -> int:
    """The end of the highest buffer XLA placed: the temp allocation's size."""
    return max((b.offset + b.bytes for b in self.buffers), default=0)

  def simulate(self, resize: Callable[[HeapBuffer], int] | None = None,
               alignment: int = 64) -> int:
    """The size of a best-fit placement of the buffers, each ``resize(buffer)`` bytes
    (default: its own), the largest first: each goes into the smallest gap left between
    the buffers already placed that are live at the same time, or above them.

    XLA's placement is of this kind, but it tries more than one order and keeps the best
    and breaks ties its own way, so the simulated size is not XLA's to the byte: on
    ResNet-20's planned steps it came within 0.03 MiB of 70-76 MiB four times of five, and
    2.2 MiB over once (docs/decisions.md). Differences between two calls (the same
    buffers, resized or not) are the prediction to use.
    """
    n = len(self.buffers)
    if not n:
      return 0
    size = np.array([resize(b) if resize else b.bytes for b in self.buffers], np.int64)
    if (size < 0).any():
      raise ValueError("resize must give every buffer a size of 0 bytes or more.")
    size = -(-size // alignment) * alignment
    start = np.array([b.start for b in self.buffers], np.int64)
    end = np.array([b.end for b in self.buffers], np.int64)
    return int((_best_fit(size, start, end) + size).max())


def _best_fit(size, start, end):
  """Offsets of buffers of ``size`` bytes live from ``start`` to ``end`` (inclusive) placed
  the largest first (then the longest lived, then the earliest), each into the smallest gap
  between the buffers already placed that are live at the same time, or above them."""
  n = len(size)
  order = np.lexsort((start, -(end - start), -size))     # the last key sorts first
  off, placed = np.zeros(n, np.int64), np.zeros(n, bool)
  for i in order:
    live = placed & (start <= end[i]) & (end >= start[i])
    if live.any():
      by = np.argsort(off[live], kind="stable")
      lo = off[live][by]
      reach = np.maximum.accumulate((off[live] + size[live])[by])
      below = np.concatenate(([0], reach[:-1]))     # the highest end below each buffer
      gap = lo - below
      fits = gap >= size[i]
      off[i] = (below[np.argmin(np.where(fits, gap, np.iinfo(np.int64).max))]
                if fits.any() else reach[-1])
    placed[i] = True
  return off


def heap_layout(f: Callable[..., Any], *args, **kwargs) -> HeapLayout:
  """``f``'s compiled temp allocation, buffer by buffer (see `HeapLayout`).

  Compiles ``f`` (as `compiled_memory` does) with XLA's buffer-assignment dump into a
  temporary directory and reads where each buffer of the temp allocation was placed and
  when it is live.

  Only the temp allocation is read: a buffer XLA gives an allocation of its own (an output
  that may live out of the function, a parameter) is not in it.

  Raises:
    DumpUnavailableError: (a RuntimeError) if the backend wrote no live-range or
      buffer-assignment dump, or the latter has no temp allocation.
  """
  compiled, live, placed, lowered = _dumped_compile(f, args, kwargs, "heap_layout")
  temp = re.search(r"^allocation \d+: size \d+, preallocated-temp:\n((?: .*\n)*)", placed,
                   re.M)
  if temp is None:
    raise DumpUnavailableError(
        f"XLA on {jax.default_backend()!r} wrote no buffer assignment with a preallocated "
        "temp allocation; heap_layout needs one.")
  sequence = re.search(r"InstructionSequence:\n((?:    .*\n)*)", live)
  ranges = live.split("BufferLiveRange:", 1)[-1].split("Live ranges at", 1)[0]
  if sequence is None or not ranges.strip():
    raise DumpUnavailableError("XLA's live-range dump has no schedule or no live ranges.")
  schedule = [line.split(":", 1)[1] for line in sequence.group(1).split()]
  span = {m.group(1): (int(m.group(2)), int(m.group(3))) for m in
          re.finditer(r"([\w.\-]+\{[\d,]*\}):(\d+)-(\d+)", ranges)}
  defs, _ = _hlo_definitions(compiled.as_text())
  groups: dict[tuple[int, int], list] = {}
  for m in re.finditer(r"value: <\d+ ([\w.\-]+)(\{[\d,]*\})? @\d+> "
                       r"\(size=(\d+),offset=(\d+)\)", temp.group(1)):
    name = m.group(1) + (m.group(2) or "{}")
    if name in span:
      groups.setdefault((int(m.group(4)), int(m.group(3))), []).append((*span[name], name))
  buffers = []
  for (offset, size), values in groups.items():
    merged = []                     # values at one address whose live ranges meet: one buffer
    for a, b, name in sorted(values):
      if merged and a <= merged[-1][1]:
        merged[-1][1] = max(merged[-1][1], b)
      else:
        merged.append([a, b, name])
    for a, b, name in merged:
      shape, _, op_name = defs.get(name.split("{")[0], ("", "", ""))
      reader = defs.get(schedule[min(b, len(schedule) - 1)], ("", "", ""))[2]
      buffers.append(HeapBuffer(name, size, offset, a, b, shape, op_name, reader))
  return HeapLayout(tuple(sorted(buffers, key=lambda b: (b.start, b.offset))),
                    _memory_of(compiled), compiled, lowered)


COLLECTIVE_OPS = ("all-reduce", "all-gather", "collective-permute", "all-to-all",
                  "reduce-scatter")

# An HLO instruction's opcode is followed by "(" and is not part of a %name; async
# collectives are counted once, by their "-start" half.
_COLLECTIVE_RE = re.compile(
    r"(?<![%\w.\-])(" + "|".join(COLLECTIVE_OPS) + r")(-start)?\(")


def collective_counts(f_or_text: Callable[..., Any] | str, *args, **kwargs) -> dict[str, int]:
  """Counts collective operations in the compiled (optimised) HLO of ``f``.

  Args:
    f_or_text: a function (compiled for ``args``) or compiled HLO text.
    *args: arguments (arrays or ShapeDtypeStructs with shardings) to compile for.

  Returns:
    ``{op: count}`` for every op in `COLLECTIVE_OPS` (zeros included).
  """
  text = f_or_text if isinstance(f_or_text, str) else _compile(f_or_text, args, kwargs).as_text()
  counts = {op: 0 for op in COLLECTIVE_OPS}
  for m in _COLLECTIVE_RE.finditer(text):
    counts[m.group(1)] += 1
  return counts

