"""Spatial sharding as a technique: the `jmem.convert` object (`Spatial`) and the
``jmem bench`` name ``spatial-8`` (``jmem.Spatial`` over H x W = 2 x 4 devices: activations
sharded, every convolution exchanging halos)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from jmem._technique import BenchTechnique, Technique
from jmem.parallel.spatial import modules, sharded

__all__ = ["Spatial", "BENCH_TECHNIQUES"]


@dataclasses.dataclass(frozen=True)
class Spatial(Technique):
  """Activations sharded over H and W of ``mesh``; convolutions exchange halos.

  The converted model runs under plain ``jax.jit`` with its input a global array sharded
  ``P(data_axis, axes[0], axes[1], None)`` (`jmem.parallel.spatial.sharded`): every
  convolution the ``where=`` selects runs `halo_conv` on the device blocks in a nested
  ``shard_map``; every other layer (BatchNorm, pooling, a global mean, attention) is
  partitioned by XLA. Uneven blocks (a side the mesh does not divide, an odd width after a
  stride) are padded with zeros and the extra outputs cut, exactly; a convolution
  `halo_conv` does not cover runs on the gathered image, with a `SpatialFallbackWarning`.

  Default sites: every 2-D convolution module (``nn.Conv``, ``nnx.Conv``,
  `jmem.parallel.spatial.HaloConv`).

  Attributes:
    mesh: the device mesh (``AxisType.Auto`` axes: Flax's layers take no ``out_sharding``).
    axes: the mesh axes of H and W (None: not sharded).
    data_axis: the mesh axis of the batch, if any.
  """

  mesh: Any = None
  axes: tuple = ("h", "w")
  data_axis: str | None = None

  def __post_init__(self):
    super().__post_init__()
    sharded.check_mesh(self.mesh, self.axes, self.data_axis)


def _convert(devices: int, height: int):
  def convert(implementation):
    del implementation
    if jax.device_count() < devices:
      raise ValueError(
          f"Technique 'spatial-{devices}' needs {devices} devices, found {jax.device_count()}; "
          f"on CPU set XLA_FLAGS=--xla_force_host_platform_device_count={devices} before "
          "jax is imported (the jmem CLI does this itself).")
    mesh = modules.spatial_mesh(1, height, devices // height, devices=jax.devices()[:devices])
    return Spatial(mesh=mesh, axes=("h", "w"))
  return convert


BENCH_TECHNIQUES = (
    BenchTechnique("spatial-8", _convert(8, 2),
                   "activations sharded over H x W = 2 x 4 devices, halo exchange "
                   "(per-device figures)"),
)
