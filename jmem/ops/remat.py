"""Rematerialisation (``jax.checkpoint``, JAX's own peer of jmem's techniques) as a
technique: the `jmem.convert` object (`Remat`) and the ``jmem bench`` name ``remat``."""

from __future__ import annotations

import dataclasses
from typing import Any

from jmem._technique import BenchTechnique, Technique

__all__ = ["Remat", "BENCH_TECHNIQUES"]


@dataclasses.dataclass(frozen=True)
class Remat(Technique):
  """Recompute each site's forward pass in the backward (``jax.checkpoint``), exactly.

  Default sites: the direct children of the top module (its blocks, stem layers), except
  its ``nn.Dense`` / ``nnx.Linear`` layers (a head, an embedding: one matmul, little to
  save; name them in ``where=`` to include them). ``policy``: a ``jax.checkpoint_policies`` entry
  (None: save nothing inside a site). Works under ``jit`` and under ``shard_map``.
  """

  policy: Any = None


BENCH_TECHNIQUES = (
    BenchTechnique("remat", lambda implementation: Remat(),
                   "jax.checkpoint on each default site: the top module's children but its "
                   "Dense layers (JAX-native peer)"),
)
