"""SBP as a technique: the `jmem.convert` object (`SBP`) and the ``jmem bench`` names
``sbp-<keep ratio>``: ``jmem.SBP(keep_ratio=r)`` on the sites the model names in its
``sbp_sites`` (jmem's video models do: their per-frame CNN, their transformer blocks but the
last); through `jmem.technique` with your own ``where=``."""

from __future__ import annotations

import dataclasses
from typing import Any

from jmem._technique import BenchTechnique, Technique
from jmem.ops.sbp import core

__all__ = ["SBP", "model_sites", "BENCH_TECHNIQUES"]


@dataclasses.dataclass(frozen=True)
class SBP(Technique):
  """Stochastic Backpropagation on the calls of the modules ``where=`` names.

  Each such call gets a node axis ``axis`` in its first array argument (frames of a clip
  for a per-frame CNN, tokens for a transformer block) and returns the nodes along the same
  axis; the forward runs on every node, the backward on ``ceil(keep_ratio * n)`` sampled
  ones (`jmem.ops.sbp.sites`). ``where=`` is required: SBP has no sensible default site.

  ``mode``: ``"nodes"`` for a per-node module (the backward re-runs the kept nodes only),
  ``"rows"`` for a block that mixes nodes (the backward re-runs the block with the kept
  queries of each recognised attention layer, ``nn.MultiHeadDotProductAttention`` /
  ``nnx.MultiHeadAttention``), None (default) to pick ``"rows"`` where such an attention
  layer attends over the node axis and ``"nodes"`` elsewhere. Node mixing that jmem cannot
  see (attention written inline with ``jnp``, a mean over the node axis) needs
  ``mode="rows"``, or the gradient is that of a per-node model.

  BatchNorm layers in training mode inside a site are computed by jmem: their all-node
  statistics are used in the forward (and for the running averages) and held constant in
  the backward. The keep key comes from the RNG stream ``"sbp"``: linen
  ``apply(..., rngs=jmem.rngs(key))``, either API ``with jmem.rngs(key):``. Differentiated
  without it, a site raises ValueError (inference needs no key); inside
  ``jmem.surgery.data_keys()`` it draws one from the data.
  """

  keep_ratio: float = 0.5
  axis: int = 1
  sampler: Any = "uniform_chunk"
  mode: str | None = None

  def __post_init__(self):
    super().__post_init__()
    core.check_keep_ratio(self.keep_ratio)
    if isinstance(self.axis, bool) or not isinstance(self.axis, int):
      raise TypeError(f"SBP(axis=...) must be an int (the node axis), got {self.axis!r}.")
    core.get_sampler(self.sampler)
    if self.mode not in (None, "nodes", "rows"):
      raise ValueError(f"SBP(mode=...) must be 'nodes', 'rows' or None (automatic), got "
                       f"{self.mode!r}.")


def model_sites(model, techniques, name: str) -> tuple:
  """``techniques`` with each `SBP` without ``where=`` given the sites ``model`` names in
  its ``sbp_sites`` (module classes and/or path expressions, and ``sbp_mode``), as
  jmem's video models do; a model that names none is refused, saying what to pass."""
  out = []
  for t in techniques:
    if isinstance(t, SBP) and t.where is None:
      where = getattr(model, "sbp_sites", None)
      if where is None:
        raise ValueError(
            f"Technique {name!r} needs the model's SBP sites: {type(model).__name__} names "
            "none (jmem's video models do, in sbp_sites). For your own model: "
            f"jmem.convert(model, jmem.technique({name!r}, where=<per-frame module or "
            "blocks>)).")
      t = dataclasses.replace(t, where=where, mode=t.mode or getattr(model, "sbp_mode", None))
    out.append(t)
  return tuple(out)


BENCH_TECHNIQUES = tuple(
    BenchTechnique(f"sbp-{r}", lambda implementation, r=r: SBP(keep_ratio=r),
                   f"stochastic backpropagation, keep ratio {r} (the model's sbp_sites)",
                   prepare=lambda model, dataset, batch_size, techniques, *, target=None,
                   r=r: model_sites(model, techniques, f"sbp-{r}"))
    for r in (0.5, 0.25, 0.125))
