"""What a compiled module's kernels move: bytes and launches, read from its HLO text.

A GPU runs an optimised module as one kernel (or library call) per instruction of its
entry computation that does work: a fusion, a cuDNN or cuBLAS custom call, a copy. Each
reads its operands from device memory and writes its result there, so the bytes a step
moves are, to a first approximation, the sum over those instructions of operand and result
sizes. `traffic` counts them from ``compiled.as_text()``; it needs nothing but the text
(no jax import), so a benchmark can read modules compiled at another commit with it.

Over-counts: a fusion that slices or gathers from a large operand is charged the whole
operand, and one that updates a buffer in place the whole buffer (reading the fused
computations to charge only what they touch changed ResNet-50's bytes by 0.1% and a small
ViT's with SBP by 0.8%, so it is not done); under-counts: nothing inside a ``while`` body
runs more than once here (a step with loops is flagged, ``loops > 0``).
"""

from __future__ import annotations

import dataclasses
import math
import re

# Instructions that move no data on a GPU: views, bookkeeping, scheduling barriers.
_FREE = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
    "opt-barrier", "partition-id", "replica-id", "add-dependency", "domain", "iota",
})
# Bytes per element (sub-byte types packed).
_DTYPE_BYTES = {
    "pred": 1, "s2": 0.25, "u2": 0.25, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1,
    "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8,
    "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1,
    "f8e4m3b11fnuz": 1, "f8e3m4": 1, "f8e8m0fnu": 1, "f4e2m1fn": 0.5, "token": 0,
}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[((?:<=)?[0-9]*(?:,(?:<=)?[0-9]+)*)\]")
_NAME = re.compile(r"%[\w.\-]+")
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_HEAD = re.compile(r"^\s*(?:ROOT\s+)?(%[\w.\-]+)\s*=\s*")


@dataclasses.dataclass(frozen=True)
class Traffic:
  """Bytes and kernels of an optimised module's entry computation.

  Attributes:
    bytes: operand + result bytes summed over the instructions that do work.
    kernels: how many such instructions (kernel launches or library calls).
    library_calls: of those, custom calls (cuDNN convolutions, cuBLAS matrix products).
    loops: instructions with bodies of their own (``while``, ``conditional``, ``call``,
      ``async-start``), counted as one kernel each: the bytes and launches inside them are
      not read (0 for the steps jmem builds; a step with loops is underestimated).
    by_opcode: bytes per opcode (``"fusion"``, ``"custom-call"``, ``"copy"``, ...).
    library_dtype: the element type of most of the cuDNN and cuBLAS calls' result bytes
      (the precision the convolutions and matrix products run at; other custom calls, such
      as Pallas kernels, do not count); None where there are none.
  """

  bytes: int
  kernels: int
  library_calls: int
  loops: int
  by_opcode: dict
  library_dtype: str | None = None


def shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape string (an array or a tuple of them; layouts ignored)."""
  total = 0.0
  for dtype, dims in _ARRAY.findall(shape):
    if dtype not in _DTYPE_BYTES:
      raise ValueError(f"Unknown HLO element type {dtype!r} in {shape!r}: add its size to "
                       "jmem.measure._hlo_traffic._DTYPE_BYTES.")
    # A dynamic dimension (``<=4``) at its bound: what its buffer is sized for.
    total += _DTYPE_BYTES[dtype] * math.prod(int(d.lstrip("<=")) for d in dims.split(",")
                                             if d)
  return int(math.ceil(total))


def _balanced(text: str, start: int) -> int:
  """The index just past the bracket group opening at ``text[start]``."""
  depth = 0
  for i in range(start, len(text)):
    c = text[i]
    if c in "([{":
      depth += 1
    elif c in ")]}":
      depth -= 1
      if depth == 0:
        return i + 1
  raise ValueError(f"unbalanced brackets in HLO line: {text[:200]!r}")


def _instruction(line: str):
  """``(name, shape, opcode, operand names)`` of one HLO instruction line, or None."""
  head = _HEAD.match(line)
  if head is None:
    return None
  i = head.end()
  if line[i] == "(":                      # a tuple shape
    end = _balanced(line, i)
  else:
    end = line.index(" ", i)
  shape = line[i:end]
  rest = line[end:].lstrip()
  paren = rest.find("(")
  if paren <= 0:
    return None
  opcode = rest[:paren].strip()
  close = _balanced(rest, paren)
  operands = _NAME.findall(rest[paren:close])
  return head.group(1), shape, opcode, operands


def entry_lines(hlo_text: str) -> list[str] | None:
  """The instruction lines of a module text's entry computation, in order (None: the text
  has no ``ENTRY`` computation)."""
  lines, inside = [], False
  for line in hlo_text.splitlines():
    if line.startswith("ENTRY "):
      inside = True
      continue
    if inside:
      if line.startswith("}"):
        break
      lines.append(line)
  return lines if inside else None


def traffic(hlo_text: str) -> Traffic:
  """`Traffic` of the entry computation of an optimised HLO module's text."""
  shapes: dict[str, int] = {}
  total = kernels = library = loops = 0
  by_opcode: dict[str, int] = {}
  library_bytes: dict[str, int] = {}
  entry = entry_lines(hlo_text)
  if entry is None:
    raise ValueError("The HLO text has no ENTRY computation (pass compiled.as_text()).")
  for line in entry:
    parsed = _instruction(line)
    if parsed is None:
      continue
    name, shape, opcode, operands = parsed
    out = shape_bytes(shape)
    shapes[name] = out
    if opcode in _FREE or opcode.endswith("-done"):
      continue
    if opcode in ("while", "conditional", "call", "async-start"):
      loops += 1
    moved = out + sum(shapes.get(o, 0) for o in operands)
    total += moved
    kernels += 1
    if opcode == "custom-call":
      library += 1
      first = _ARRAY.search(shape)
      target = _TARGET.search(line)
      if first is not None and target and target.group(1).startswith(("__cudnn", "__cublas")):
        library_bytes[first.group(1)] = library_bytes.get(first.group(1), 0) + out
    by_opcode[opcode] = by_opcode.get(opcode, 0) + moved
  return Traffic(bytes=total, kernels=kernels, library_calls=library, loops=loops,
                 by_opcode=by_opcode,
                 library_dtype=max(library_bytes, key=library_bytes.get, default=None))
