"""Data parallelism over a mesh axis, the JAX way: parameters replicated, the batch sharded,
one ``jax.jit`` (XLA inserts the all-reduces of gradients and of batch statistics)."""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jmem import _backends
from jmem import step as step_lib

__all__ = ["data_parallel"]


def data_parallel(model, mesh: Mesh | None = None, *, axis: str = "data") -> step_lib.ModelFns:
  """`jmem.step.ModelFns` of ``model`` trained data-parallel over ``mesh``'s ``axis``.

  The training state is replicated on ``mesh`` and every batch is sharded along ``axis``
  (``P(axis)``), so `jmem.train.train` runs one ``jax.jit`` over global arrays: XLA's SPMD
  partitioner adds the all-reduce of the gradients, and a BatchNorm computes its statistics
  over the global batch, as a synchronised BatchNorm does. ``mesh`` may span several
  processes (`jmem.distributed`); each then loads only its own rows of each batch.

  On a GPU the kernels' automatic choice (``implementation=None`` of InPlace-ABN and SyncBN;
  ActNN's is XLA everywhere) is XLA here, with a warning: XLA cannot split a Pallas call
  over the sharded batch.

  A batch size that ``axis`` does not divide is padded with masked rows: the loss skips them
  and so must the model's BatchNorms, which a `jmem.convert(model, jmem.SyncBN())` model
  (or jmem's own `SyncBatchNorm` / `InPlaceABN`) does; a BatchNorm that would count them
  raises a ValueError naming it.

  Args:
    model: a linen module, an NNX module or `jmem.step.ModelFns` (its ``apply`` runs as is).
    mesh: the device mesh (None: all devices, one axis named ``axis``).
    axis: the mesh axis (or tuple of axes) the batch is split over.

  Raises:
    ValueError: ``axis`` is not an axis of ``mesh``.
  """
  if mesh is None:
    if not isinstance(axis, str):
      raise ValueError(f"data_parallel: axis {axis!r} names several mesh axes; pass the "
                       "mesh that has them (mesh=None makes one axis of all devices).")
    mesh = Mesh(np.asarray(jax.devices()), (axis,))
  names = (axis,) if isinstance(axis, str) else tuple(axis)
  missing = [a for a in names if a not in mesh.axis_names]
  if missing:
    raise ValueError(f"data_parallel: axis {missing[0]!r} is not an axis of the mesh "
                     f"{dict(mesh.shape)}; pass axis= one of {mesh.axis_names}.")
  fns = step_lib.model_fns(model)
  shards = math.prod(mesh.shape[a] for a in names)
  reason = (f"the batch is sharded over {shards} devices by jax.jit (data_parallel), and "
            "XLA cannot split a Pallas kernel over it (it would gather the operands onto "
            "every device)")

  def apply(*args, **kwargs):   # traced inside the step: the kernels' automatic choice
    with _backends.automatic_xla(reason):
      return fns.apply(*args, **kwargs)
  return fns._replace(apply=apply if shards > 1 else fns.apply,
                      sharding=NamedSharding(mesh, P()),
                      batch_sharding=NamedSharding(mesh, P(axis)))
