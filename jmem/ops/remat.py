"""Rematerialisation (``jax.checkpoint``, JAX's own peer of jmem's techniques) as a
technique: the `jmem.convert` object (`Remat`) and the ``jmem bench`` name ``remat``."""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn

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


def _apply(model):
  """jmem's own models: ``nn.remat`` on their ``block_transform``."""
  if not hasattr(model, "block_transform"):
    raise ValueError(f"Technique 'remat' needs a model with a block_transform field (jmem's "
                     f"own models; any other model: jmem.convert(model, jmem.Remat())); "
                     f"{type(model).__name__} has none.")
  return model.clone(block_transform=nn.remat)


BENCH_TECHNIQUES = (
    BenchTechnique("remat", _apply, "jax.checkpoint per residual block (JAX-native peer)",
                   convert=lambda implementation: Remat()),
)
