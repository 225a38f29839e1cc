"""A U-Net for dense prediction at high resolution: the seed's Mapillary use case (street
scenes at 1024 x 2048), where a batch of one image does not fit.

``UNet`` is a plain linen model: an encoder of stages (two 3x3 conv + BatchNorm + ReLU per
stage, a 2x2 max pool between stages), a decoder that upsamples by 2 (nearest), concatenates
the encoder's skip connection and runs a stage, and a 1x1 convolution to per-pixel logits
``[B, H, W, num_classes]``. Its stages are direct children named ``enc{i}`` / ``dec{i}``, so
`jmem.convert`'s default sites (``Remat``, ``ActNN`` L3, ``Policy``) are whole stages, and
``jmem.Spatial`` shards every convolution over H and W (pooling, upsampling and
concatenation are XLA's to partition).

Reference:
  Ronneberger et al., U-Net: Convolutional Networks for Biomedical Image Segmentation, MICCAI
  2015, https://arxiv.org/abs/1505.04597
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

__all__ = ["UNet", "UNetStage", "pixel_cross_entropy"]


class UNetStage(nn.Module):
  """Two 3x3 convolutions, each followed by BatchNorm and ReLU."""

  features: int
  train: bool = True
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    norm = functools.partial(nn.BatchNorm, use_running_average=not self.train, momentum=0.9,
                             dtype=self.dtype)
    for i in range(2):
      x = nn.Conv(self.features, (3, 3), use_bias=False, dtype=self.dtype,
                  name=f"conv{i}")(x)
      x = nn.relu(norm(name=f"bn{i}")(x))
    return x


class UNet(nn.Module):
  """U-Net: ``widths`` channels per encoder stage (the last is the bottleneck); the image
  sides must be divisible by ``2 ** (len(widths) - 1)``."""

  num_classes: int
  widths: tuple[int, ...] = (32, 64, 128, 256, 512)
  train: bool = True
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    factor = 2 ** (len(self.widths) - 1)
    if x.ndim != 4:
      raise ValueError(f"UNet takes [B, H, W, C] images; got shape {x.shape}.")
    if x.shape[1] % factor or x.shape[2] % factor:
      raise ValueError(f"UNet takes images with H and W divisible by {factor} "
                       f"({len(self.widths) - 1} poolings); got H x W {x.shape[1]} x "
                       f"{x.shape[2]}.")
    stage = functools.partial(UNetStage, train=self.train, dtype=self.dtype)
    skips = []
    for i, w in enumerate(self.widths):
      if i:
        x = nn.max_pool(x, (2, 2), strides=(2, 2))
      x = stage(w, name=f"enc{i}")(x)
      skips.append(x)
    for i, w in reversed(list(enumerate(self.widths[:-1]))):
      b, h, wd, c = x.shape
      x = jax.image.resize(x, (b, 2 * h, 2 * wd, c), "nearest")
      x = stage(w, name=f"dec{i}")(jnp.concatenate([x, skips[i]], axis=-1))
    return nn.Conv(self.num_classes, (1, 1), dtype=self.dtype, name="head")(x).astype(
        jnp.float32)


def pixel_cross_entropy(logits: jax.Array, labels: jax.Array,
                        ignore_index: int | None = None) -> jax.Array:
  """Mean cross-entropy over the pixels: ``logits [B, H, W, K]``, ``labels [B, H, W]``.
  ``ignore_index`` (e.g. 255, the "void" label of Cityscapes-style data) leaves those pixels
  out of the mean; an image with none left gives 0, not NaN."""
  log_p = jax.nn.log_softmax(logits)
  if ignore_index is None:
    return -jnp.mean(jnp.take_along_axis(log_p, labels[..., None], -1))
  valid = labels != ignore_index
  safe = jnp.where(valid, labels, 0)
  nll = -jnp.take_along_axis(log_p, safe[..., None], -1)[..., 0]
  return jnp.sum(jnp.where(valid, nll, 0.0)) / jnp.maximum(jnp.sum(valid), 1)
