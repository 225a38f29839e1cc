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
  aval = jax.typeof(x)
  mat = getattr(aval, "manual_axis_type", None)
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", ()))
