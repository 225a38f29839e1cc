"""A small Flax NNX CNN: the NNX counterpart used to exercise `jmem.train` on both APIs."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

__all__ = ["SmallCNN"]


class SmallCNN(nnx.Module):
  """conv-BN-relu x2, global average pool, dropout, dense; ``float[N, H, W, C]`` input.

  Holds every kind of state the training loop must thread: parameters, BatchNorm
  statistics and a dropout RNG stream.
  """

  def __init__(self, in_channels: int, num_classes: int, *, width: int = 16,
               dropout: float = 0.1, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(in_channels, width, (3, 3), use_bias=False, rngs=rngs)
    self.bn1 = nnx.BatchNorm(width, momentum=0.9, rngs=rngs)
    self.conv2 = nnx.Conv(width, 2 * width, (3, 3), strides=(2, 2), use_bias=False, rngs=rngs)
    self.bn2 = nnx.BatchNorm(2 * width, momentum=0.9, rngs=rngs)
    self.dropout = nnx.Dropout(dropout, rngs=rngs)
    self.head = nnx.Linear(2 * width, num_classes, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.bn1(self.conv1(x)))
    x = nnx.relu(self.bn2(self.conv2(x)))
    x = self.dropout(jnp.mean(x, axis=(1, 2)))
    return self.head(x)
