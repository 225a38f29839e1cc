"""Models written as a Flax user would write them: plain flax only, none of jmem's hooks.

They are what `jmem.convert` is tested on (tests/test_convert.py) and was measured on
(docs/decisions.md): their own BatchNorm subclass, stems built inline, functional
activations, global means, ``nn.Sequential`` pairs, attention from Flax.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import flax.linen as nn
import jax.numpy as jnp
from flax import nnx


class MyBatchNorm(nn.BatchNorm):
  """A user's BatchNorm subclass (different defaults, same __call__)."""

  momentum: float = 0.9
  epsilon: float = 1e-5


class BottleneckBlock(nn.Module):
  filters: int
  strides: int = 1
  train: bool = True

  @nn.compact
  def __call__(self, x):
    norm = functools.partial(MyBatchNorm, use_running_average=not self.train)
    residual = x
    y = nn.Conv(self.filters, (1, 1), use_bias=False)(x)
    y = nn.relu(norm()(y))
    y = nn.Conv(self.filters, (3, 3), (self.strides, self.strides), use_bias=False)(y)
    y = nn.relu(norm()(y))
    y = nn.Conv(self.filters * 4, (1, 1), use_bias=False)(y)
    y = norm(scale_init=nn.initializers.zeros_init())(y)
    if residual.shape != y.shape:
      residual = nn.Conv(self.filters * 4, (1, 1), (self.strides, self.strides),
                         use_bias=False, name="conv_proj")(residual)
      residual = norm(name="norm_proj")(residual)
    return nn.relu(residual + y)


class ThirdPartyResNet(nn.Module):
  """A linen ResNet as in Flax's examples: inline stem, functional relu, global mean."""

  stage_sizes: Sequence[int] = (1, 1)
  num_filters: int = 8
  num_classes: int = 10

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Conv(self.num_filters, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], use_bias=False,
                name="conv_init")(x)
    x = MyBatchNorm(use_running_average=not train, name="bn_init")(x)
    x = nn.relu(x)
    x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
    for i, n in enumerate(self.stage_sizes):
      for j in range(n):
        x = BottleneckBlock(self.num_filters * 2**i, strides=2 if i > 0 and j == 0 else 1,
                            train=train)(x)
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.num_classes)(x)


def resnet50(num_classes: int = 1000) -> ThirdPartyResNet:
  return ThirdPartyResNet(stage_sizes=(3, 4, 6, 3), num_filters=64, num_classes=num_classes)


class FunctionalCNN(nn.Module):
  """Plain BatchNorm, functional activations in the body, a global mean."""

  num_classes: int = 10

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Conv(8, (3, 3))(x)
    x = nn.BatchNorm(use_running_average=not train)(x)
    x = nn.gelu(x)
    x = nn.Conv(16, (3, 3), strides=(2, 2))(x)
    x = nn.BatchNorm(use_running_average=not train)(x)
    x = jnp.tanh(x) * 2.0
    return nn.Dense(self.num_classes)(jnp.mean(x, axis=(1, 2)))


class DetachedConvCNN(nn.Module):
  """A convolution, then a 3x3 + 5x5 convolution pair applied detached
  (``Block(parent=None).apply``, its parameters held by the caller), a global mean."""

  @nn.compact
  def __call__(self, x, train: bool = True):
    del train
    x = nn.relu(nn.Conv(8, (3, 3))(x))
    pair = nn.Sequential([nn.Conv(8, (3, 3)), nn.relu, nn.Conv(8, (5, 5), strides=(2, 2))],
                         parent=None)
    x = pair.apply(self.param("pair", lambda rng: pair.init(rng, x)), x)
    return nn.Dense(10)(jnp.mean(x, axis=(1, 2)))


class SequentialABNCNN(nn.Module):
  """BatchNorms followed by leaky_relu / elu in nn.Sequential (InPlace-ABN's pattern)."""

  num_classes: int = 10

  @nn.compact
  def __call__(self, x, train: bool = True):
    ra = not train
    x = nn.Sequential([
        nn.Conv(8, (3, 3)), nn.BatchNorm(use_running_average=ra),
        functools.partial(nn.leaky_relu, negative_slope=0.1),
        nn.Conv(8, (3, 3)), nn.BatchNorm(use_running_average=ra), nn.elu,
    ], name="features")(x)
    return nn.Dense(self.num_classes)(jnp.mean(x, axis=(1, 2)))


class ViTBlock(nn.Module):
  dim: int
  heads: int

  @nn.compact
  def __call__(self, x):
    y = nn.LayerNorm()(x)
    x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(y, y)
    y = nn.LayerNorm()(x)
    y = nn.Dense(2 * self.dim)(y)
    return x + nn.Dense(self.dim)(nn.gelu(y))


class LinenViT(nn.Module):
  patch: int = 4
  dim: int = 16
  depth: int = 2
  heads: int = 2
  num_classes: int = 10

  @nn.compact
  def __call__(self, x, train: bool = True):
    del train
    x = nn.Conv(self.dim, (self.patch, self.patch), strides=(self.patch, self.patch),
                name="patchify")(x)
    x = x.reshape(x.shape[0], -1, self.dim)
    x = x + self.param("pos", nn.initializers.normal(0.02), (1, x.shape[1], self.dim))
    for i in range(self.depth):
      x = ViTBlock(self.dim, self.heads, name=f"block{i}")(x)
    return nn.Dense(self.num_classes)(nn.LayerNorm()(x).mean(axis=1))


class DetachedBlocksViT(nn.Module):
  """A small ViT whose `ViTBlock`s are applied detached (``Block(parent=None).apply``), their
  parameters held by the top module: jmem.convert cannot reach them."""

  dim: int = 16
  depth: int = 4

  @nn.compact
  def __call__(self, x, train: bool = True):
    del train
    x = nn.Conv(self.dim, (4, 4), strides=(4, 4), name="patchify")(x)
    x = x.reshape(x.shape[0], -1, self.dim)
    block = ViTBlock(self.dim, 2, parent=None)
    for i in range(self.depth):
      params = self.param(f"block{i}", lambda rng, v=x: block.init(rng, v)["params"])
      x = block.apply({"params": params}, x)
    return nn.Dense(10)(x.mean(axis=1))


class NNXCNN(nnx.Module):
  """An NNX CNN: conv + BatchNorm + leaky_relu in nnx.Sequential, another BN used inline."""

  def __init__(self, in_channels: int = 3, num_classes: int = 10, *, rngs: nnx.Rngs):
    self.stem = nnx.Sequential(
        nnx.Conv(in_channels, 8, (3, 3), rngs=rngs), nnx.BatchNorm(8, rngs=rngs),
        functools.partial(nnx.leaky_relu, negative_slope=0.05))
    self.conv = nnx.Conv(8, 16, (3, 3), strides=(2, 2), rngs=rngs)
    self.bn = nnx.BatchNorm(16, rngs=rngs)
    self.head = nnx.Linear(16, num_classes, rngs=rngs)

  def __call__(self, x):
    x = self.stem(x)
    x = nnx.relu(self.bn(self.conv(x)))
    return self.head(x.mean(axis=(1, 2)))


class NNXViTBlock(nnx.Module):
  def __init__(self, dim: int, heads: int, *, rngs: nnx.Rngs):
    self.ln1 = nnx.LayerNorm(dim, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=dim, decode=False,
                                       rngs=rngs)
    self.ln2 = nnx.LayerNorm(dim, rngs=rngs)
    self.fc1 = nnx.Linear(dim, 2 * dim, rngs=rngs)
    self.fc2 = nnx.Linear(2 * dim, dim, rngs=rngs)

  def __call__(self, x):
    y = self.ln1(x)
    x = x + self.attn(y, y)
    return x + self.fc2(nnx.gelu(self.fc1(self.ln2(x))))


class NNXViT(nnx.Module):
  def __init__(self, in_channels: int = 3, patch: int = 4, dim: int = 16, depth: int = 2,
               heads: int = 2, num_classes: int = 10, *, rngs: nnx.Rngs):
    self.patchify = nnx.Conv(in_channels, dim, (patch, patch), strides=(patch, patch),
                             rngs=rngs)
    self.blocks = nnx.List([NNXViTBlock(dim, heads, rngs=rngs) for _ in range(depth)])
    self.norm = nnx.LayerNorm(dim, rngs=rngs)
    self.head = nnx.Linear(dim, num_classes, rngs=rngs)

  def __call__(self, x):
    x = self.patchify(x)
    x = x.reshape(x.shape[0], -1, x.shape[-1])
    for block in self.blocks:
      x = block(x)
    return self.head(self.norm(x).mean(axis=1))


# ------------------------------------------------------------------ video (SBP sites)

class FrameEncoder(nn.Module):
  """A per-frame CNN over clips ``[B, T, H, W, C] -> [B, T, F]``: frames folded into the
  batch inline, BatchNorm in training mode (it couples the frames), a global mean."""

  features: int = 8

  @nn.compact
  def __call__(self, clips, train: bool = True):
    b, t = clips.shape[:2]
    x = clips.reshape((b * t,) + clips.shape[2:])
    x = nn.Conv(self.features, (3, 3))(x)
    x = nn.relu(nn.BatchNorm(use_running_average=not train)(x))
    x = nn.Conv(self.features, (3, 3), strides=(2, 2))(x)
    return jnp.mean(x, axis=(1, 2)).reshape(b, t, -1)


class TemporalConv(nn.Module):
  """A residual block of two 1-D convolutions over the frames of ``[B, T, F]`` features."""

  width: int = 32

  @nn.compact
  def __call__(self, f):
    h = nn.gelu(nn.Conv(self.width, (3,), padding="SAME")(f))
    return f + nn.Conv(f.shape[-1], (3,), padding="SAME")(h)


class ClipClassifier(nn.Module):
  """Per-frame CNN, then a small temporal model over the frame features."""

  num_classes: int = 10

  @nn.compact
  def __call__(self, clips, train: bool = True):
    f = FrameEncoder(name="frames")(clips, train)
    f = nn.gelu(nn.Dense(16)(f))
    return nn.Dense(self.num_classes)(f.reshape(f.shape[0], -1))


class FrameTokenViT(nn.Module):
  """A plain ViT over the patch tokens of every frame, ``(t, h, w)`` order."""

  patch: int = 4
  dim: int = 16
  depth: int = 2
  heads: int = 2
  num_classes: int = 10

  @nn.compact
  def __call__(self, clips, train: bool = True):
    del train
    b, t, h, w, c = clips.shape
    x = nn.Conv(self.dim, (self.patch, self.patch), strides=(self.patch, self.patch),
                name="patchify")(clips.reshape(b * t, h, w, c))
    x = x.reshape(b, -1, self.dim)
    x = x + self.param("pos", nn.initializers.normal(0.02), (1, x.shape[1], self.dim))
    for i in range(self.depth):
      x = ViTBlock(self.dim, self.heads, name=f"block{i}")(x)
    return nn.Dense(self.num_classes)(nn.LayerNorm()(x).mean(axis=1))


class NNXFrameEncoder(nnx.Module):
  def __init__(self, in_channels: int = 3, features: int = 8, *, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(in_channels, features, (3, 3), rngs=rngs)
    self.bn = nnx.BatchNorm(features, rngs=rngs)
    self.conv2 = nnx.Conv(features, features, (3, 3), strides=(2, 2), rngs=rngs)

  def __call__(self, clips):
    b, t = clips.shape[:2]
    x = clips.reshape((b * t,) + clips.shape[2:])
    x = nnx.relu(self.bn(self.conv1(x)))
    return jnp.mean(self.conv2(x), axis=(1, 2)).reshape(b, t, -1)


class NNXClipClassifier(nnx.Module):
  def __init__(self, frames: int = 4, num_classes: int = 10, *, rngs: nnx.Rngs):
    self.frames = NNXFrameEncoder(rngs=rngs)
    self.temporal = nnx.Linear(8, 16, rngs=rngs)
    self.head = nnx.Linear(16 * frames, num_classes, rngs=rngs)

  def __call__(self, clips):
    f = nnx.gelu(self.temporal(self.frames(clips)))
    return self.head(f.reshape(f.shape[0], -1))


class NNXFrameTokenViT(NNXViT):
  """`NNXViT` over the patch tokens of every frame."""

  def __call__(self, clips):
    b, t, h, w, c = clips.shape
    x = self.patchify(clips.reshape(b * t, h, w, c))
    x = x.reshape(b, -1, x.shape[-1])
    for block in self.blocks:
      x = block(x)
    return self.head(self.norm(x).mean(axis=1))


class ResNetFrameEncoder(nn.Module):
  """A per-frame ResNet-8 as a user would write it: BatchNorm in training mode, frames folded
  into the batch inline, a flattened last map (where the digit is matters for motion)."""

  features: int = 64
  widths: Sequence[int] = (16, 32, 64)

  @nn.compact
  def __call__(self, clips, train: bool = True):
    b, t = clips.shape[:2]
    x = clips.reshape((b * t,) + clips.shape[2:])
    norm = functools.partial(nn.BatchNorm, use_running_average=not train)
    x = nn.relu(norm()(nn.Conv(self.widths[0], (3, 3), use_bias=False)(x)))
    for i, w in enumerate(self.widths):
      s = 1 if i == 0 else 2
      y = nn.relu(norm()(nn.Conv(w, (3, 3), strides=(s, s), use_bias=False)(x)))
      y = norm()(nn.Conv(w, (3, 3), use_bias=False)(y))
      if s != 1 or x.shape[-1] != w:
        x = norm()(nn.Conv(w, (1, 1), strides=(s, s), use_bias=False)(x))
      x = nn.relu(x + y)
    return nn.Dense(self.features)(x.reshape(b * t, -1)).reshape(b, t, -1)


class ThirdPartyStT(nn.Module):
  """Spatial-then-temporal video model: `ResNetFrameEncoder` on every frame, then a small
  transformer over the frame features (time embedding, `ViTBlock`s), read out per frame."""

  num_classes: int = 40
  features: int = 64
  depth: int = 2
  heads: int = 4

  @nn.compact
  def __call__(self, clips, train: bool = True):
    f = ResNetFrameEncoder(self.features, name="frames")(clips, train)
    f = f + self.param("time_embed", nn.initializers.normal(0.02), f.shape[1:])
    for i in range(self.depth):
      f = ViTBlock(self.features, self.heads, name=f"temporal{i}")(f)
    f = nn.LayerNorm()(f.reshape(f.shape[0], -1))
    return nn.Dense(self.num_classes)(f)


class FramePretrainer(nn.Module):
  """`ResNetFrameEncoder` (same name, ``frames``) with a linear head on single frames: the
  per-frame pretraining of `ThirdPartyStT`."""

  num_classes: int = 10
  features: int = 64

  @nn.compact
  def __call__(self, frames, train: bool = True):
    f = ResNetFrameEncoder(self.features, name="frames")(frames[:, None], train)
    return nn.Dense(self.num_classes)(nn.relu(f[:, 0]))
