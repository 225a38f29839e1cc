"""ConvNeXt in Flax linen, trainable unsharded and on a spatial mesh with the same code.

Every window op goes through `jmem.parallel.spatial`: with ``axis_names=(None, None)`` they
are plain convolutions and means; with ``axis_names=("h", "w")`` (inside ``shard_map``) the
activations are blocks of the image sharded over H and W, convolutions exchange halos and
the head's global pooling is one psum. Layer norms and the MLPs are per pixel, so local.

References:
  Liu et al., A ConvNet for the 2020s, CVPR 2022, https://arxiv.org/abs/2201.03545
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax

from jmem.parallel import spatial
from jmem.parallel.spatial import HaloConv

__all__ = ["ConvNeXtBlock", "ConvNeXt", "CONVNEXT_CONFIGS", "convnext"]

_INIT = nn.initializers.truncated_normal(0.02)


class ConvNeXtBlock(nn.Module):
  """Depthwise 7x7 -> LayerNorm -> Dense 4d -> GELU -> Dense d -> layer scale -> DropPath."""

  dim: int
  drop_path: float = 0.0
  layer_scale_init: float = 1e-6
  axis_names: tuple[str | None, str | None] = (None, None)
  data_axis: str | None = None
  dtype: Any = None

  @nn.compact
  def __call__(self, x, train: bool = False):
    y = HaloConv(self.dim, (7, 7), feature_group_count=self.dim, axis_names=self.axis_names,
                 dtype=self.dtype, kernel_init=_INIT, name="dwconv")(x)
    y = nn.LayerNorm(epsilon=1e-6, dtype=self.dtype, name="norm")(y)
    y = nn.Dense(4 * self.dim, kernel_init=_INIT, dtype=self.dtype, name="pwconv1")(y)
    y = nn.gelu(y)
    y = nn.Dense(self.dim, kernel_init=_INIT, dtype=self.dtype, name="pwconv2")(y)
    if self.layer_scale_init > 0:
      y = y * self.param("layer_scale", nn.initializers.constant(self.layer_scale_init),
                         (self.dim,)).astype(y.dtype)
    use_drop = train and self.drop_path > 0
    y = spatial.drop_path(y, self.drop_path, self.make_rng("dropout") if use_drop else None,
                          deterministic=not use_drop, data_axis=self.data_axis)
    return x + y


def _check_image_size(x, stem_patch: int, stages: int, axis_names) -> None:
  """Raises a ValueError if the stem and downsamplings would leave no pixel of ``x``.

  The patchify stem and the ``stages - 1`` 2x2 downsamplings use VALID padding, so an image
  smaller than ``stem_patch * 2**(stages - 1)`` ends as an empty feature map whose mean is
  NaN. Under ``shard_map`` the global size (block size times the axis size) is checked.
  """
  need = stem_patch * 2 ** (stages - 1)
  try:
    sizes = [x.shape[1 + i] * (1 if a is None else jax.lax.axis_size(a))
             for i, a in enumerate(axis_names)]
  except NameError:   # an unbound axis name: the stem's halo_conv says how to fix it
    return
  if min(sizes) < need:
    raise ValueError(
        f"This ConvNeXt (stem patch {stem_patch}, {stages} stages, each after the first "
        f"halving the size) needs images of at least {need}x{need}, got {sizes[0]}x{sizes[1]} "
        f"(its feature map would be empty and the loss NaN): use larger images "
        f"(e.g. --image-size {need}).")


class ConvNeXt(nn.Module):
  """ConvNeXt classifier, ``apply(variables, x, train=bool)`` on ``[N, H, W, C]`` images.

  Attributes:
    depths: blocks per stage.
    dims: channels per stage.
    num_classes: classifier outputs.
    stem_patch: side (= stride) of the patchify stem (4 in the paper; 1 for tiny images).
    drop_path_rate: stochastic depth, linearly increasing over blocks up to this rate.
    layer_scale_init: initial layer scale (0 disables it).
    axis_names: mesh axes H and W are sharded over (inside ``shard_map``), or None.
    data_axis: mesh axis of the batch (so DropPath draws differ across data shards).
  """

  depths: Sequence[int]
  dims: Sequence[int]
  num_classes: int
  stem_patch: int = 4
  drop_path_rate: float = 0.0
  layer_scale_init: float = 1e-6
  axis_names: tuple[str | None, str | None] = (None, None)
  data_axis: str | None = None
  dtype: Any = None

  @nn.compact
  def __call__(self, x, train: bool = False):
    if len(self.depths) != len(self.dims):
      raise ValueError(f"depths {self.depths} and dims {self.dims} must have the same length.")
    _check_image_size(x, self.stem_patch, len(self.dims), self.axis_names)
    block_cls = ConvNeXtBlock
    total = sum(self.depths)
    rates = [self.drop_path_rate * i / max(total - 1, 1) for i in range(total)]
    k = 0
    for stage, (depth, dim) in enumerate(zip(self.depths, self.dims)):
      if stage == 0:
        x = HaloConv(dim, (self.stem_patch,) * 2, strides=self.stem_patch, padding="VALID",
                     axis_names=self.axis_names, dtype=self.dtype, kernel_init=_INIT,
                     name="stem")(x)
        x = nn.LayerNorm(epsilon=1e-6, dtype=self.dtype, name="stem_norm")(x)
      else:
        x = nn.LayerNorm(epsilon=1e-6, dtype=self.dtype, name=f"down{stage}_norm")(x)
        x = HaloConv(dim, (2, 2), strides=2, padding="VALID", axis_names=self.axis_names,
                     dtype=self.dtype, kernel_init=_INIT, name=f"down{stage}")(x)
      for i in range(depth):
        x = block_cls(dim, rates[k], self.layer_scale_init, self.axis_names, self.data_axis,
                      self.dtype, name=f"stage{stage}_block{i}")(x, train)
        k += 1
    x = spatial.global_avg_pool(x, axis_names=self.axis_names)
    x = nn.LayerNorm(epsilon=1e-6, dtype=self.dtype, name="head_norm")(x)
    return nn.Dense(self.num_classes, kernel_init=_INIT, dtype=self.dtype, name="head")(x)


# name -> (depths, dims, stem_patch)
CONVNEXT_CONFIGS: dict[str, tuple[tuple[int, ...], tuple[int, ...], int]] = {
    "convnext-digits": ((2, 2), (32, 64), 1),
    "convnext-t": ((3, 3, 9, 3), (96, 192, 384, 768), 4),
    "convnext-s": ((3, 3, 27, 3), (96, 192, 384, 768), 4),
    "convnext-b": ((3, 3, 27, 3), (128, 256, 512, 1024), 4),
    "convnext-l": ((3, 3, 27, 3), (192, 384, 768, 1536), 4),
    "convnext-xl": ((3, 3, 27, 3), (256, 512, 1024, 2048), 4),
}


def convnext(name: str, num_classes: int, **overrides) -> ConvNeXt:
  """Builds a named ConvNeXt (see `CONVNEXT_CONFIGS`); ``overrides`` replace any field."""
  if name not in CONVNEXT_CONFIGS:
    raise ValueError(f"Unknown ConvNeXt {name!r}; valid names: {sorted(CONVNEXT_CONFIGS)}.")
  depths, dims, patch = CONVNEXT_CONFIGS[name]
  kw = dict(depths=depths, dims=dims, stem_patch=patch)
  kw.update(overrides)
  return ConvNeXt(num_classes=num_classes, **kw)
