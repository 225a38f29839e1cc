"""Spatial sharding as a ``jmem bench`` technique: ``spatial-8`` (activations of jmem's
ConvNeXt sharded over H x W = 2 x 4 devices)."""

from __future__ import annotations

import jax

from jmem._technique import BenchTechnique
from jmem.parallel.spatial import modules

__all__ = ["BENCH_TECHNIQUES"]


def _apply(devices: int, height: int):
  def apply(model):
    if jax.device_count() < devices:
      raise ValueError(
          f"Technique 'spatial-{devices}' needs {devices} devices, found {jax.device_count()}; "
          f"on CPU set XLA_FLAGS=--xla_force_host_platform_device_count={devices} before "
          "jax is imported (the jmem CLI does this itself).")
    mesh = modules.spatial_mesh(1, height, devices // height, devices=jax.devices()[:devices])
    return modules.spatial_model_fns(model, mesh)
  return apply


BENCH_TECHNIQUES = (
    BenchTechnique("spatial-8", _apply(8, 2),
                   "activations sharded over H x W = 2 x 4 devices, halo exchange "
                   "(per-device figures; ConvNeXt models)"),
)
