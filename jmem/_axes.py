"""Mesh-axis names: checks shared by every technique that runs collectives (SyncBN,
InPlace-ABN, the spatial halo ops). Private and low."""

from __future__ import annotations

import jax
from jax import lax

AxisName = str | tuple[str, ...] | None


def axes_tuple(axis_name: AxisName) -> tuple[str, ...]:
  if axis_name is None:
    return ()
  return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def check_axis_name(axis_name: AxisName) -> None:
  """Raises a clear error when ``axis_name`` is not bound by an enclosing transform."""
  for name in axes_tuple(axis_name):
    try:
      lax.axis_size(name)
    except (NameError, ValueError, KeyError) as e:
      raise NameError(
          f"axis_name {name!r} is not bound: call this inside jax.shard_map, jax.pmap or "
          f"jax.vmap with axis_name={name!r} (or pass axis_name=None for local batch norm)."
      ) from e


def varying_axes(x) -> frozenset:
  """The manual (shard_map) axes over which ``x`` varies; empty outside shard_map."""
  return aval_varying_axes(jax.typeof(x))


def aval_varying_axes(aval) -> frozenset:
  """The manual axes over which values of type ``aval`` vary."""
  mat = getattr(aval, "manual_axis_type", None)
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", ()))


def barrier(tree):
  """``lax.optimization_barrier(tree)`` without widening types under shard_map.

  The barrier's output varies over the union of its operands' mesh axes, so an invariant
  operand (a replicated statistic) would come out varying. Only the leaves that already vary
  over that union go through it (the activations and codes whose order matters); the others
  pass unchanged.
  """
  leaves, treedef = jax.tree.flatten(tree)
  kinds = [varying_axes(v) if hasattr(v, "dtype") else None for v in leaves]
  widest = frozenset().union(*(k for k in kinds if k is not None))
  pick = [i for i, k in enumerate(kinds) if k == widest]
  held = lax.optimization_barrier([leaves[i] for i in pick])
  for i, v in zip(pick, held):
    leaves[i] = v
  return jax.tree.unflatten(treedef, leaves)
