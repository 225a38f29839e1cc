"""SyncBN as a technique: the `jmem.convert` object (`SyncBN`) and the ``jmem bench`` name
``sync-bn`` (on one device: jmem's exact BatchNorm statistics in place of Flax's, the cost
of the same computation that synchronises them across devices)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jmem._backends import check_implementation
from jmem._technique import BenchTechnique, Technique
from jmem.parallel.sync_bn import core

__all__ = ["SyncBN", "BENCH_TECHNIQUES"]


@dataclasses.dataclass(frozen=True)
class SyncBN(Technique):
  """Batch statistics over a named mesh axis (`jmem.parallel.sync_bn`), exact for masked,
  unbalanced batches.

  Default sites: every BatchNorm-like module (``flax.linen.BatchNorm`` / ``nnx.BatchNorm``
  and their subclasses that do not override ``__call__``; a subclass that does, or a
  look-alike with ``batch_stats`` ``mean``/``var``, must be named in ``where=``). The
  module's own fields and variables are used; ``axis_name`` (None: the module's own, and
  local statistics if it has none) needs ``shard_map``: under plain ``jit`` over sharded
  arrays XLA already computes global statistics. Masks from `jmem.surgery.batch_mask`.
  ``implementation`` picks the per-device statistics' backend (`jmem.parallel.sync_bn.
  sync_batch_norm`; None: the Pallas kernel on a GPU for unmasked batches, else XLA).
  """

  axis_name: Any = None
  axis_index_groups: Any = None
  unbiased_running_var: bool = False
  implementation: str | None = None

  def __post_init__(self):
    super().__post_init__()
    check_implementation(self.implementation, core.OPS, "SyncBN")


BENCH_TECHNIQUES = (
    BenchTechnique("sync-bn", lambda implementation: SyncBN(implementation=implementation),
                   "SyncBN's exact statistics core in place of Flax's BatchNorm (one device)",
                   has_kernels=True, kernel_ops=core.OPS),
)
