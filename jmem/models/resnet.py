"""Reference (exact) ResNets in Flax linen: plain models, converted as any user's are.

Every model follows one calling convention, ``model.apply(variables, x, train=bool)`` with
channels-last input, which is what `jmem.train` expects. Techniques are applied with
``jmem.convert(model, ...)``: its default block sites are the stem and the residual blocks
(the top module's children but the head), and each "normalise then activate" is an
``nn.Sequential`` pair, where InPlace-ABN finds it when the activation is invertible.

References:
  He et al., Deep Residual Learning for Image Recognition, https://arxiv.org/abs/1512.03385
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

ModuleDef = Any

__all__ = ["BasicBlock", "Bottleneck", "PreActBlock", "ResNet", "RESNET_CONFIGS", "resnet"]


class _Block(nn.Module):
  """Fields shared by the residual blocks (the ResNet passes them all)."""

  filters: int
  norm: ModuleDef
  act: Callable[[Any], Any]
  strides: int = 1
  dtype: Any = jnp.float32

  def conv(self, features, kernel, strides=1, *, name):
    return nn.Conv(features, kernel, (strides, strides), use_bias=False, padding="SAME",
                   dtype=self.dtype, name=name)

  def norm_act(self, name):
    """Normalise then activate, as an ``nn.Sequential`` pair (the norm keeps its own
    name): `jmem.convert`'s InPlace-ABN finds BatchNorm + invertible activation pairs
    there."""
    return nn.Sequential([self.norm(name=name), self.act])


class BasicBlock(_Block):
  """Two 3x3 convolutions with an identity (or 1x1 projection) shortcut."""

  @nn.compact
  def __call__(self, x):
    residual = x
    y = self.conv(self.filters, (3, 3), self.strides, name="conv1")(x)
    y = self.norm_act("bn1")(y)
    y = self.conv(self.filters, (3, 3), name="conv2")(y)
    y = self.norm(name="bn2", scale_init=nn.initializers.zeros)(y)
    if residual.shape != y.shape:
      residual = self.conv(self.filters, (1, 1), self.strides, name="proj_conv")(residual)
      residual = self.norm(name="proj_bn")(residual)
    return self.act(residual + y)


class Bottleneck(_Block):
  """1x1 reduce, 3x3, 1x1 expand (x4), with an identity (or projection) shortcut."""

  @nn.compact
  def __call__(self, x):
    residual = x
    y = self.conv(self.filters, (1, 1), name="conv1")(x)
    y = self.norm_act("bn1")(y)
    y = self.conv(self.filters, (3, 3), self.strides, name="conv2")(y)
    y = self.norm_act("bn2")(y)
    y = self.conv(self.filters * 4, (1, 1), name="conv3")(y)
    y = self.norm(name="bn3", scale_init=nn.initializers.zeros)(y)
    if residual.shape != y.shape:
      residual = self.conv(self.filters * 4, (1, 1), self.strides, name="proj_conv")(residual)
      residual = self.norm(name="proj_bn")(residual)
    return self.act(residual + y)


class PreActBlock(_Block):
  """Pre-activation block: (norm-act, 3x3 conv) x2 plus shortcut (He et al. 2016, v2).

  Every convolution's input is the output of a norm-act pair, which is where InPlace-ABN
  removes a stored tensor.
  """

  @nn.compact
  def __call__(self, x):
    y = self.norm_act("bn1")(x)
    shortcut = x
    if x.shape[-1] != self.filters or self.strides != 1:
      shortcut = self.conv(self.filters, (1, 1), self.strides, name="proj_conv")(y)
    y = self.conv(self.filters, (3, 3), self.strides, name="conv1")(y)
    y = self.norm_act("bn2")(y)
    y = self.conv(self.filters, (3, 3), name="conv2")(y)
    return y + shortcut


class ResNet(nn.Module):
  """ResNet for ``float[N, H, W, C]`` images, returning ``float32[N, num_classes]`` logits.

  Attributes:
    stage_sizes: number of blocks per stage.
    block_cls: `BasicBlock` or `Bottleneck` (or any module with the same fields).
    num_classes: number of output classes.
    num_filters: width of the first stage; stage i has ``num_filters * 2**i``.
    stem: ``"imagenet"`` (7x7/2 conv + 3x3/2 max pool, for 224² inputs) or ``"cifar"``
      (one 3x3/1 conv, for small images).
    dtype: computation dtype (parameters stay float32).
    act: activation function.
    norm: normalisation layer class; called as ``norm(use_running_average=..., name=...)``.
    preactivation: pre-activation layout (use with `PreActBlock`): the stem is a bare conv
      and a final norm-act precedes the pooling.
    head_pool: ``"mean"`` (global average pooling) or ``"flatten"`` (the final feature map
      flattened into the head: position-aware, as a per-frame encoder of motion needs).
    scan_blocks: run the identical blocks of a stage (all but its first) under
      ``flax.linen.scan`` with stacked parameters. Same function, different parameter
      layout; compiles once per stage instead of once per block. (On XLA:CPU the weight
      gradient of a convolution inside a loop is slow, ~20x on ResNet-20.)
  """

  stage_sizes: Sequence[int]
  block_cls: ModuleDef
  num_classes: int
  num_filters: int = 64
  stem: str = "imagenet"
  dtype: Any = jnp.float32
  act: Callable[[Any], Any] = nn.relu
  norm: ModuleDef = nn.BatchNorm
  preactivation: bool = False
  scan_blocks: bool = False
  head_pool: str = "mean"

  @nn.compact
  def __call__(self, x, train: bool = True):
    if self.stem not in ("imagenet", "cifar"):
      raise ValueError(f"stem must be 'imagenet' or 'cifar', got {self.stem!r}.")
    norm = functools.partial(self.norm, use_running_average=not train, momentum=0.9,
                             epsilon=1e-5, dtype=self.dtype)
    kw = dict(norm=norm, act=self.act, dtype=self.dtype)
    x = x.astype(self.dtype)
    x = _Stem(self.num_filters, kind=self.stem, preactivation=self.preactivation, name="stem",
              **kw)(x)
    for i, size in enumerate(self.stage_sizes):
      filters = self.num_filters * 2**i
      x = self.block_cls(filters, strides=2 if i > 0 else 1, name=f"stage{i + 1}_block1",
                         **kw)(x)
      if self.scan_blocks and size > 1:
        body = nn.scan(_ScanBody, variable_axes={True: 0}, split_rngs={True: True},
                       length=size - 1)
        x, _ = body(self.block_cls, filters, kw, name=f"stage{i + 1}_blocks")(x, None)
      else:
        for j in range(1, size):
          x = self.block_cls(filters, name=f"stage{i + 1}_block{j + 1}", **kw)(x)
    if self.preactivation:
      x = self.act(norm(name="final_bn")(x))
    if self.head_pool == "mean":
      x = jnp.mean(x, axis=(1, 2))
    elif self.head_pool == "flatten":      # keeps where things are (e.g. for motion)
      x = x.reshape(x.shape[0], -1)
    else:
      raise ValueError(f"head_pool must be 'mean' or 'flatten', got {self.head_pool!r}.")
    return nn.Dense(self.num_classes, dtype=self.dtype, name="head")(x).astype(jnp.float32)


class _Stem(_Block):
  """The stem: 7x7/2 conv + max pool ('imagenet') or a 3x3 conv ('cifar')."""

  kind: str = "imagenet"
  preactivation: bool = False

  @nn.compact
  def __call__(self, x):
    if self.kind == "imagenet":
      x = self.conv(self.filters, (7, 7), 2, name="conv")(x)
      if not self.preactivation:
        x = self.norm_act("bn")(x)
      return nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
    x = self.conv(self.filters, (3, 3), name="conv")(x)
    return x if self.preactivation else self.norm_act("bn")(x)


class _ScanBody(nn.Module):
  """One block as a scan body: ``(x, None) -> (block(x), None)``."""

  block_cls: ModuleDef
  filters: int
  kw: dict[str, Any]

  @nn.compact
  def __call__(self, x, _):
    return self.block_cls(self.filters, name="block", **self.kw)(x), None


# name -> (stage_sizes, block, num_filters, stem)
RESNET_CONFIGS: dict[str, tuple[tuple[int, ...], ModuleDef, int, str]] = {
    "resnet8": ((1, 1, 1), BasicBlock, 16, "cifar"),
    "preact20": ((3, 3, 3), PreActBlock, 16, "cifar"),
    "resnet20": ((3, 3, 3), BasicBlock, 16, "cifar"),
    "resnet56": ((9, 9, 9), BasicBlock, 16, "cifar"),
    "resnet18": ((2, 2, 2, 2), BasicBlock, 64, "imagenet"),
    "resnet34": ((3, 4, 6, 3), BasicBlock, 64, "imagenet"),
    "resnet50": ((3, 4, 6, 3), Bottleneck, 64, "imagenet"),
    "resnet101": ((3, 4, 23, 3), Bottleneck, 64, "imagenet"),
}


# Fields of a named ResNet other than the defaults: preact20 is InPlace-ABN's model, whose
# norm-act pairs need an invertible activation (leaky_relu 0.01, as InPlace-ABN's paper).
RESNET_FIELDS: dict[str, dict[str, Any]] = {
    "preact20": dict(act=functools.partial(nn.leaky_relu, negative_slope=0.01)),
}


def resnet(name: str, num_classes: int, **overrides) -> ResNet:
  """Builds a named ResNet (see `RESNET_CONFIGS`, `RESNET_FIELDS`); ``overrides`` replace
  any field."""
  if name not in RESNET_CONFIGS:
    raise ValueError(f"Unknown ResNet {name!r}; valid names: {sorted(RESNET_CONFIGS)}.")
  stages, block, width, stem = RESNET_CONFIGS[name]
  kw = dict(stage_sizes=stages, block_cls=block, num_filters=width, stem=stem,
            preactivation=block is PreActBlock, **RESNET_FIELDS.get(name, {}))
  kw.update(overrides)
  return ResNet(num_classes=num_classes, **kw)
