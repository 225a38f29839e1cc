"""SyncBN as a technique: the `jmem.convert` object (`SyncBN`). The bench has no SyncBN
row: on one device it is BatchNorm."""

from __future__ import annotations

import dataclasses
from typing import Any

from jmem._technique import Technique

__all__ = ["SyncBN"]


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
  """

  axis_name: Any = None
  axis_index_groups: Any = None
  unbiased_running_var: bool = False
