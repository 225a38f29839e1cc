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

  def __post_init__(self):
    super().__post_init__()
    if self.policy is not None and not callable(self.policy):
      import jax  # pylint: disable=g-import-not-at-top
      named = (f" (did you mean jax.checkpoint_policies.{self.policy}?)"
               if isinstance(self.policy, str) and callable(getattr(jax.checkpoint_policies,
                                                                    self.policy, None))
               else "")
      raise TypeError(f"Remat(policy=...) takes a jax.checkpoint_policies function (e.g. "
                      f"jax.checkpoint_policies.dots_saveable) or None (save nothing inside "
                      f"a site), got {self.policy!r}{named}.")


BENCH_TECHNIQUES = (
    BenchTechnique("remat", lambda implementation: Remat(),
                   "jax.checkpoint on each default site: the top module's children but its "
                   "Dense layers (JAX-native peer)"),
)
