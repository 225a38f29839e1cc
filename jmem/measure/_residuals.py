"""What a train step keeps for its backward pass, traced only (`saved_residuals`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jex
import numpy as np

__all__ = ["Residual", "ResidualReport", "saved_residuals", "VIEW_PRIMITIVES", "module_path"]


def _nbytes(aval) -> int:
  shape = getattr(aval, "shape", ())
  dtype = getattr(aval, "dtype", None)
  if dtype is None:  # tokens and other non-array values take no activation memory
    return 0
  return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


@dataclasses.dataclass(frozen=True)
class Residual:
  """One value kept from the forward pass for the backward pass.

  Attributes:
    shape: array shape.
    dtype: array dtype.
    nbytes: bytes this value occupies.
    source: ``"activation"`` (computed in the forward pass), ``"argument"`` (one of the
      function's own inputs, or a copy or slice of one: resident anyway, and not what a
      technique saves; see `saved_residuals`), ``"constant"`` or ``"literal"``.
    description: where it came from (producing primitive, or argument index and the
      primitives that copied it).
    scope: the module path of the producing equation's name stack (Flax names each module
      call: ``"stage1_block0/conv1"``; ``""`` at the top or for arguments).
  """

  shape: tuple[int, ...]
  dtype: Any
  nbytes: int
  source: str
  description: str
  scope: str = ""


@dataclasses.dataclass(frozen=True)
class ResidualReport:
  """What `jax.vjp` keeps alive between the forward and the backward pass.

  Attributes:
    residuals: every residual, deduplicated (one buffer counted once).
    activation_bytes: bytes of the residuals computed in the forward pass: the memory a
      technique can save. Arguments (parameters, the input batch) and constants are
      excluded because they are resident whether or not a backward pass follows.
    argument_bytes: bytes of residuals that are the function's own arguments.
    constant_bytes: bytes of residuals that are closed-over constants or literals.
  """

  residuals: tuple[Residual, ...]
  activation_bytes: int
  argument_bytes: int
  constant_bytes: int

  def by_dtype(self) -> dict[str, int]:
    """Activation bytes per dtype (e.g. to see float32 vs packed uint8 residuals)."""
    out: dict[str, int] = {}
    for r in self.residuals:
      if r.source == "activation":
        key = str(np.dtype(r.dtype))
        out[key] = out.get(key, 0) + r.nbytes
    return out

  def largest(self, n: int = 10) -> list[Residual]:
    """The ``n`` largest activation residuals, for finding what still holds memory."""
    acts = [r for r in self.residuals if r.source == "activation"]
    return sorted(acts, key=lambda r: -r.nbytes)[:n]


def saved_residuals(f: Callable[..., Any], *args, argnums: int | Sequence[int] | None = None,
                    **kwargs) -> ResidualReport:
  """Traces ``jax.vjp(f, *args)`` and classifies every residual it keeps.

  Tracing only: ``args`` may be `jax.ShapeDtypeStruct`s, nothing is executed. The residuals
  are exactly the leaves of ``jax.vjp(f, *args)[1]``; a custom_vjp's residuals are counted as
  its ``fwd`` returns them (packed uint8 stays uint8), and ``jax.checkpoint`` policies are
  honoured.

  A residual that is an argument, or made from one only by copies, dtype casts and layout
  ops (`VIEW_PRIMITIVES`: ``pvary``, ``convert_element_type``, ``reshape``, ``transpose``,
  slicing, a ``broadcast_in_dim`` that adds unit dims only, ...), counts as
  ``"argument"``, also when the chain runs through the jaxpr of a ``shard_map``, ``jit``
  or ``checkpoint`` (whose inputs are the outer values). Under ``jax.shard_map`` every
  device keeps its copy of a replicated weight (a ``pvary``) for the backward: that is
  the weight's memory, not an activation, and is counted once per device, at the size the
  residual has. A broadcast to a larger shape, or anything computed from a weight, stays
  an activation.

  Args:
    f: the function to differentiate, e.g. ``loss(params, batch)``.
    *args: its positional arguments (arrays or ShapeDtypeStructs, any pytrees).
    argnums: which positional arguments to differentiate (default: all). The others are
      still inputs, so residuals that are them count as ``"argument"``.
    **kwargs: keyword arguments, passed through undifferentiated.

  Returns:
    A `ResidualReport`; ``activation_bytes`` is the figure to compare across techniques.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> x, w = jnp.ones((4, 8)), jnp.ones((8, 16))
    >>> saved_residuals(lambda x, w: jnp.tanh(x @ w).sum(), x, w).activation_bytes
    256
  """
  if argnums is None:
    argnums = tuple(range(len(args)))
  elif isinstance(argnums, int):
    argnums = (argnums,)
  for i in argnums:
    if not 0 <= i < len(args):
      raise ValueError(f"argnums {tuple(argnums)} out of range for {len(args)} arguments.")
  leaves, treedef = jax.tree.flatten((args, kwargs))

  def flat_vjp(*flat):
    a, k = jax.tree.unflatten(treedef, flat)

    def g(*diff):
      full = list(a)
      for i, d in zip(argnums, diff):
        full[i] = d
      return f(*full, **k)

    return jax.vjp(g, *[a[i] for i in argnums])

  closed, out_shape = jax.make_jaxpr(flat_vjp, return_shape=True)(*leaves)
  jaxpr = closed.jaxpr
  num_res = len(jax.tree.leaves(out_shape[1]))
  res_vars = jaxpr.outvars[len(jaxpr.outvars) - num_res:]

  invars = {v: i for i, v in enumerate(jaxpr.invars)}
  constvars = set(jaxpr.constvars)
  producers = _producers(jaxpr)
  origins = _Origins()

  seen: set[Any] = set()
  residuals: list[Residual] = []
  for v in res_vars:
    # A checkpoint_name (e.g. InPlace-ABN's exact output) is the value it names: one buffer.
    while (not isinstance(v, jex.Literal) and (eqn := producers.get(v)) is not None
           and eqn.primitive.name == "name"):
      v = eqn.invars[0]
    scope = ""
    if isinstance(v, jex.Literal):
      source, desc = "literal", "literal"
    else:
      if v in seen:
        continue
      seen.add(v)
      if v in invars:
        source, desc = "argument", f"argument at flattened index {invars[v]}"
      elif v in constvars:
        source, desc = "constant", "closed-over constant"
      else:
        eqn = producers.get(v)
        source = "activation"
        desc = f"output of {eqn.primitive.name}" if eqn is not None else "unknown"
        scope = module_path(eqn)
        found = origins.find(v, jaxpr)
        if found is not None:
          root, via = found
          if root in invars:
            source = "argument"
            desc = f"copy of argument at flattened index {invars[root]} (via {' > '.join(via)})"
          elif root in constvars:
            source, desc = "constant", f"copy of a closed-over constant (via {' > '.join(via)})"
    aval = v.aval
    residuals.append(Residual(tuple(getattr(aval, "shape", ())), getattr(aval, "dtype", None),
                              _nbytes(aval), source, desc, scope))

  def total(kind: Sequence[str]) -> int:
    return sum(r.nbytes for r in residuals if r.source in kind)

  return ResidualReport(tuple(residuals), total(("activation",)), total(("argument",)),
                        total(("constant", "literal")))


# Primitives whose output is a copy, a dtype cast, a relayout or a slice of their first
# operand (not a new value computed from it).
VIEW_PRIMITIVES = frozenset({
    "pvary", "pcast", "convert_element_type", "copy", "copy_p", "reduce_precision",
    "reshape", "squeeze", "expand_dims", "transpose", "slice", "dynamic_slice",
    "broadcast_in_dim", "sharding_constraint", "mesh_cast", "reshard",
})
# Several operands, output ``i`` a copy of operand ``i``.
_POSITIONAL_PRIMITIVES = frozenset({"device_put", "optimization_barrier"})
# Calls whose inner jaxpr's inputs and outputs are the equation's, in order.
_CALL_JAXPR_PARAMS = ("jaxpr", "call_jaxpr")
_CALL_PRIMITIVES = frozenset({"shard_map", "pjit", "jit", "closed_call", "core_call",
                              "checkpoint", "remat", "custom_jvp_call"})


def module_path(eqn) -> str:
  """The module path in ``eqn``'s name stack: its transform-wrapped top element
  (``jvp(ResNet)``) dropped, as are transform names (``checkpoint``, ``jvp(...)``); under
  a `jmem.convert` wrapper (``Converted._run/model/...``) the wrapped model's own path."""
  if eqn is None:
    return ""
  parts = str(eqn.source_info.name_stack).split("/")[1:]
  parts = [p for p in parts if p and "(" not in p and p != "checkpoint"]
  while True:                         # Converted/Converted._run/model/..., maybe nested
    if parts[:1] == ["Converted"]:
      parts = parts[1:]
    elif parts[:1] and parts[0].startswith("Converted.") and parts[1:2] == ["model"]:
      parts = parts[2:]
    else:
      return "/".join(parts)


def _producers(jaxpr) -> dict[Any, Any]:
  return {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}


def _inner_jaxpr(eqn):
  """The jaxpr of a call-like equation whose invars/outvars match the equation's, or None."""
  if eqn.primitive.name not in _CALL_PRIMITIVES:
    return None
  for key in _CALL_JAXPR_PARAMS:
    inner = eqn.params.get(key)
    inner = getattr(inner, "jaxpr", inner)          # ClosedJaxpr -> Jaxpr
    if (inner is not None and hasattr(inner, "eqns")
        and len(inner.invars) == len(eqn.invars) and len(inner.outvars) == len(eqn.outvars)):
      return inner
  return None


class _Origins:
  """Follows a value back through `VIEW_PRIMITIVES` (and into call jaxprs) to its root."""

  def __init__(self):
    self._producers: dict[int, dict[Any, Any]] = {}

  def _of(self, jaxpr):
    if id(jaxpr) not in self._producers:
      self._producers[id(jaxpr)] = _producers(jaxpr)
    return self._producers[id(jaxpr)]

  def find(self, v, jaxpr) -> tuple[Any, list[str]] | None:
    """``(root, primitives on the way)`` if ``v`` is a view of an input or constant of
    ``jaxpr`` (the root is that input or constvar), else None."""
    inputs = set(jaxpr.invars) | set(jaxpr.constvars)
    producers = self._of(jaxpr)
    via: list[str] = []
    while True:
      if isinstance(v, jex.Literal):
        return None
      if v in inputs:
        return (v, via) if via else None
      eqn = producers.get(v)
      if eqn is None:
        return None
      name = eqn.primitive.name
      i = eqn.outvars.index(v)
      if name in VIEW_PRIMITIVES:
        if name == "broadcast_in_dim" and _size(eqn.outvars[0]) != _size(eqn.invars[0]):
          return None                                   # a new, larger buffer
        v = eqn.invars[0]
      elif name in _POSITIONAL_PRIMITIVES and i < len(eqn.invars):
        v = eqn.invars[i]
      elif (inner := _inner_jaxpr(eqn)) is not None:
        found = self.find(inner.outvars[i], inner)
        if found is None or found[0] not in inner.invars:
          if inner.outvars[i] in inner.invars:         # forwarded unchanged
            found = (inner.outvars[i], [])
          else:
            return None
        root, inner_via = found
        v = eqn.invars[inner.invars.index(root)]
        via.extend([name] + inner_via)
        continue
      else:
        return None
      via.append(name)


def _size(v) -> int:
  return int(np.prod(getattr(v.aval, "shape", ()), dtype=np.int64))

