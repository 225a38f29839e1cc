"""SBP as a ``jmem bench`` technique: ``sbp-<keep ratio>`` on jmem's video models (their
``keep_ratio`` field)."""

from __future__ import annotations

from jmem._technique import BenchTechnique
from jmem.ops.sbp import core

__all__ = ["BENCH_TECHNIQUES"]


def _apply(keep_ratio: float):
  def apply(model):
    if not hasattr(model, "keep_ratio"):
      raise ValueError(f"Technique 'sbp-{keep_ratio}' needs a video model (stt-resnet8, "
                       f"video-vit) with a keep_ratio field; {type(model).__name__} has none.")
    core.check_keep_ratio(keep_ratio)
    return model.clone(keep_ratio=keep_ratio)
  return apply


BENCH_TECHNIQUES = tuple(
    BenchTechnique(f"sbp-{r}", _apply(r),
                   f"stochastic backpropagation, keep ratio {r} (video models)")
    for r in (0.5, 0.25, 0.125))
