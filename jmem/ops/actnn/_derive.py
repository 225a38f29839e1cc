"""Residuals that are linear functions of others: stored once, rebuilt in the backward pass.

A network's VJP saves values that carry the same information: Flax's BatchNorm saves
``x - mean`` and ``2 x`` (the derivative of its mean of squares), its ReLU the mask
``y > 0`` and, for the next convolution, ``max(y, 0)``, where ``y`` is an affine function of
``x`` per channel. `compress` quantized each of them: three 2-bit copies of one tensor per
convolution, BatchNorm and ReLU (and in bfloat16 the bf16 copies of the weights, which are
no activations at all). `derivations` finds, in the forward jaxpr of ``jax.vjp(f, ...)``, the residuals
that are *linear* in a few full-size values (their sources) given exact small ones
(per-channel statistics, scale, literals) and exact boolean masks: built from them by
``add``, ``sub``, ``mul`` or ``div`` by a small value, ``neg``, conversions, reshapes,
broadcasts, ``select_n`` on an exact mask, and ReLU (``max(y, 0)`` is ``select_n(y > 0, 0,
y)`` where the VJP keeps the mask ``y > 0``). `compress` then stores each source once and
rebuilds the residuals from its dequantized copy in the backward pass (`replay`).

Rebuilding is linear in the dequantized source with every other operand exact, so the
rebuilt residual is as unbiased as a quantized one (``E[L(x̂)] = L(x)``; a conversion to a
narrower float rounds, as the forward pass's own conversion did); it differs from
quantizing each residual on its own in that the residuals of one source share its
rounding noise (`_shared_noise` keeps apart those that the backward multiplies together).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np

__all__ = ["Recipe", "derivations", "replay"]

# Single-operand primitives linear in their operand.
_UNARY = frozenset({"neg", "convert_element_type", "reshape", "squeeze", "expand_dims",
                    "broadcast_in_dim", "transpose", "copy", "copy_p"})
# Primitives whose operand a small value may be broadcast from (rebuilt where it is read).
_BROADCASTS = frozenset({"broadcast_in_dim", "reshape", "convert_element_type", "squeeze",
                         "expand_dims"})


@dataclasses.dataclass(frozen=True)
class Recipe:
  """How to rebuild the residual ``target``: ``eqns`` (forward equations, in order) on
  ``inputs`` (the full-size sources, small values and masks to store); ``relus`` maps a
  ReLU call among ``eqns`` to the mask variable that replaces it."""

  target: Any
  eqns: tuple[Any, ...]
  inputs: tuple[Any, ...]
  relus: tuple[tuple[Any, Any], ...] = ()


def _literal(v) -> bool:
  return isinstance(v, jax.extend.core.Literal)


def _floating(v) -> bool:
  return jnp.issubdtype(v.aval.dtype, jnp.inexact)


def _relu_input(eqn):
  """The operand of ``eqn`` if it is a ReLU (a ``custom_jvp_call`` whose function is
  ``max(x, 0)``, through ``jit`` wrappers: ``jax.nn.relu``, ``flax.linen.relu``), else None."""
  if eqn.primitive.name != "custom_jvp_call" or len(eqn.invars) != 1:
    return None
  inner = eqn.params.get("call_jaxpr")
  while inner is not None:
    jaxpr = getattr(inner, "jaxpr", inner)
    if len(jaxpr.eqns) != 1:
      return None
    (e,) = jaxpr.eqns
    if e.primitive.name in ("pjit", "jit"):
      inner = e.params.get("jaxpr")
      continue
    if (e.primitive.name == "max" and len(e.invars) == 2 and _literal(e.invars[1])
        and np.all(np.asarray(e.invars[1].val) == 0) and e.invars[0] is jaxpr.invars[0]):
      return eqn.invars[0]
    return None
  return None


class _Analysis:
  """Per variable of a forward jaxpr, in one pass in program order: ``("cheap", eqns,
  inputs)`` (a small value, or one broadcast from small values: stored small, rebuilt where
  read), ``("lin", sources, eqns, inputs, relus)`` (linear in the full-size ``sources``), or
  ``("opaque",)``."""

  def __init__(self, jaxpr, min_size: int):
    self.min_size = min_size
    self.order = {id(e): k for k, e in enumerate(jaxpr.eqns)}
    # ReLU masks the VJP itself computes: ``gt(y, 0)`` for a ReLU of ``y``.
    masks = {}
    for e in jaxpr.eqns:
      if (e.primitive.name == "gt" and len(e.invars) == 2 and _literal(e.invars[1])
          and np.all(np.asarray(e.invars[1].val) == 0) and not _literal(e.invars[0])):
        masks.setdefault(e.invars[0], e.outvars[0])
    self.infos: dict[Any, tuple] = {}
    for v in (*jaxpr.constvars, *jaxpr.invars):
      self.infos[v] = self._leaf(v)
    for e in jaxpr.eqns:
      outs = e.outvars
      info = self._eqn(e, masks) if len(outs) == 1 else None
      for v in outs:
        self.infos[v] = info if info is not None else self._leaf(v)

  def info(self, v) -> tuple:
    return ("cheap", (), ()) if _literal(v) else self.infos[v]

  def _leaf(self, v) -> tuple:
    if v.aval.size < self.min_size:
      return ("cheap", (), (v,))
    if not _floating(v):
      return ("opaque",)
    return ("lin", frozenset({v}), (), (v,), ())

  def _eqn(self, e, masks) -> tuple | None:
    """The info of ``e``'s one output, or None where it is a leaf (a source or opaque)."""
    v = e.outvars[0]
    if v.aval.size < self.min_size:
      return None
    name, ins = e.primitive.name, [self.info(u) for u in e.invars]
    if name in _BROADCASTS and len(ins) == 1 and ins[0][0] == "cheap":
      return ("cheap", ins[0][1] + (e,), ins[0][2])
    if not _floating(v):
      return None
    lin = [i for i in ins if i[0] == "lin"]
    cheap = [i for i in ins if i[0] == "cheap"]
    if name in _UNARY and len(ins) == 1 and lin:
      return self._combine(e, ins)
    if name in ("add", "sub", "add_any") and len(lin) + len(cheap) == len(ins) and lin:
      return self._combine(e, ins)
    if name == "mul" and len(ins) == 2 and len(lin) == 1 and len(cheap) == 1:
      return self._combine(e, ins)
    if name == "div" and len(ins) == 2 and ins[0][0] == "lin" and ins[1][0] == "cheap":
      return self._combine(e, ins)
    if (name == "select_n" and len(ins) >= 2 and all(i[0] != "opaque" for i in ins[1:])
        and any(i[0] == "lin" for i in ins[1:])):
      if not (_literal(e.invars[0]) or ins[0][0] == "cheap"):
        ins = [("cheap", (), (e.invars[0],))] + ins[1:]      # an exact mask, stored
      return self._combine(e, ins)
    x = _relu_input(e)
    if x is not None and x in masks and self.info(x)[0] == "lin":
      src, mask = self.info(x), masks[x]
      return ("lin", src[1], self._merge(src[2], (e,)), tuple(dict.fromkeys(src[3] + (mask,))),
              src[4] + ((e, mask),))
    return None

  def _merge(self, *eqn_lists):
    seen = {}
    for eqns in eqn_lists:
      for e in eqns:
        seen[id(e)] = e
    return tuple(sorted(seen.values(), key=lambda e: self.order[id(e)]))

  def _combine(self, e, ins) -> tuple:
    sources = frozenset().union(*(i[1] for i in ins if i[0] == "lin"))
    eqns = self._merge(*(i[2] if i[0] == "lin" else i[1] for i in ins), (e,))
    inputs = tuple(dict.fromkeys(u for i in ins
                                 for u in (i[3] if i[0] == "lin" else i[2])))
    relus = tuple(r for i in ins if i[0] == "lin" for r in i[4])
    return ("lin", sources, eqns, inputs, relus)


# Primitives whose outputs sum over their operands' elements: rounding noise shared by two
# operands averages out over the sum, as it does for one operand used twice.
_REDUCTIONS = frozenset({"reduce_sum", "dot_general", "conv_general_dilated", "cumsum",
                         "psum", "psum_invariant"})


def _shared_noise(backward, n: int, noise: dict[int, frozenset]) -> set[Any]:
  """The sources (``noise``: residual position -> the sources whose rounding it carries) of
  which two different residuals meet in one elementwise product in the ``backward`` jaxpr
  (the residuals are its first ``n`` arguments, the cotangents the rest): rebuilt from one
  rounding of their source, they would make that product biased (``E[(1 - k̂)(1 + k̂)] !=
  1 - k²``: the derivative of ``tanh``, which JAX saves as ``k`` and ``1 - k``). Sums
  (reductions, contractions) end a product: shared noise averages out over them, as it
  does for one residual used twice."""
  jaxpr = backward.jaxpr
  tags: dict[Any, frozenset] = {}
  for i, v in enumerate(jaxpr.invars[:n]):
    if i in noise:
      tags[v] = frozenset((s, i) for s in noise[i])
  bad = set()
  for e in jaxpr.eqns:
    if e.primitive.name in _REDUCTIONS:
      continue
    t = frozenset().union(*(tags.get(u, frozenset()) for u in e.invars if not _literal(u)))
    if not t:
      continue
    seen = {}
    for src, i in t:
      if seen.setdefault(src, i) != i:
        bad.add(src)
    for v in e.outvars:
      tags[v] = t
  return bad


def derivations(jaxpr, residuals, *, min_size: int, backward=None, free=frozenset()
                ) -> tuple[dict[int, Recipe], list[Any]]:
  """``({residual index: Recipe}, extra variables to store)`` for the residuals of the
  forward ``jaxpr`` (its output variables ``residuals``, the VJP function's leaves) that
  are linear in sources worth storing once: residuals themselves (stored anyway), or
  values two or more residuals are rebuilt from. The extras are the recipes' inputs that
  are no residual: sources, small values, masks. ``free``: variables that cost nothing to
  keep (the parameters: alive anyway), so a residual made from them alone (a bfloat16
  copy of a float32 weight) is always rebuilt. A residual whose only source is itself is
  not rebuilt, nor are residuals of one source that the ``backward`` jaxpr (the VJP's,
  arguments: the residuals then the cotangents) multiplies together (`_shared_noise`);
  without ``backward`` nothing is rebuilt."""
  if backward is None:
    return {}, []
  analysis = _Analysis(jaxpr, min_size)
  infos = {}
  for i, v in enumerate(residuals):
    if _literal(v) or not _floating(v) or v.aval.size < min_size:
      continue
    info = analysis.info(v)
    if info[0] == "lin" and info[1] != frozenset({v}) and info[2]:
      infos[i] = info
  plain = {v for i, v in enumerate(residuals) if not _literal(v) and i not in infos}
  demand: dict[Any, int] = {}
  for info in infos.values():
    for s in info[1]:
      demand[s] = demand.get(s, 0) + 1
  stored = lambda s: s in plain or s in free or demand.get(s, 0) >= 2
  chosen = {i: info for i, info in infos.items() if all(stored(s) for s in info[1])}
  # A residual that is itself a chosen source shares its rounding with what is rebuilt.
  noise = {i: info[1] for i, info in chosen.items()}
  sources = frozenset().union(*noise.values()) if noise else frozenset()
  noise.update((i, frozenset({v})) for i, v in enumerate(residuals)
               if not _literal(v) and i not in noise and v in sources)
  bad = _shared_noise(backward, len(residuals), noise)
  recipes = {i: Recipe(residuals[i], info[2], info[3], info[4])
             for i, info in chosen.items() if not info[1] & bad}
  kept = {v for i, v in enumerate(residuals) if not _literal(v) and i not in recipes}
  extras = list(dict.fromkeys(u for r in recipes.values() for u in r.inputs
                              if u not in kept))
  return recipes, extras


def replay(recipe: Recipe, values: dict[Any, Any], bind) -> Any:
  """The residual ``recipe`` rebuilds, from ``values`` (its inputs: variable -> value;
  extended with what it computes, so that recipes sharing equations compute them once)
  and ``bind(eqn, operands) -> outputs``."""
  relus = dict((id(e), m) for e, m in recipe.relus)
  read = lambda v: v.val if _literal(v) else values[v]
  for e in recipe.eqns:
    if e.outvars[0] in values:
      continue
    if id(e) in relus:
      x = read(e.invars[0])
      outs = [jax.lax.select(read(relus[id(e)]), x, jnp.zeros_like(x))]
    else:
      outs = bind(e, [read(u) for u in e.invars])
    values.update(zip(e.outvars, outs))
  return read(recipe.target)
