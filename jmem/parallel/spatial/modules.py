"""Spatial sharding's Flax side: the halo-exchanging convolution module, the mesh helpers,
and the training-loop glue that runs a model with its activations sharded over H and W.

The execution model is per-device code: ``spatial_model_fns`` runs the model inside
``jax.shard_map`` over a ``(data, h, w)`` mesh, every window op exchanging halos itself
(`jmem.parallel.spatial.halo`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jmem import step as step_lib
from jmem.parallel.spatial.halo import halo_conv

__all__ = ["HaloConv", "spatial_mesh", "activation_spec", "replicated", "spatial_model_fns"]


class HaloConv(nn.Module):
  """`flax.linen.Conv`-like 2-D convolution over `halo_conv` (NHWC, HWIO kernel).

  With ``axis_names=(None, None)`` it is a plain convolution; with mesh axis names (inside
  ``shard_map``) its input is a block of the image and it exchanges halos with the
  neighbours. ``kernel_init`` defaults to ``flax.linen.Conv``'s. ``conv_general_dilated``
  (as ``flax.linen.Conv``'s): a replacement for ``lax.conv_general_dilated`` that computes
  the convolution instead (what `jmem.Spatial` sets).
  """

  features: int
  kernel_size: tuple[int, int]
  strides: int = 1
  padding: Any = "SAME"
  feature_group_count: int = 1
  use_bias: bool = True
  axis_names: tuple[str | None, str | None] = (None, None)
  dtype: Any = None
  kernel_init: Callable[..., Any] = nn.initializers.lecun_normal()
  conv_general_dilated: Callable[..., Any] | None = None

  @nn.compact
  def __call__(self, x):
    cin = x.shape[-1]
    kernel = self.param("kernel", self.kernel_init, tuple(self.kernel_size) +
                        (cin // self.feature_group_count, self.features))
    dtype = self.dtype or x.dtype
    if self.conv_general_dilated is not None:
      padding = self.padding
      if isinstance(padding, int):
        padding = ((padding, padding),) * 2
      y = self.conv_general_dilated(
          x.astype(dtype), kernel.astype(dtype), (self.strides,) * 2 if isinstance(
              self.strides, int) else tuple(self.strides), padding,
          dimension_numbers=("NHWC", "HWIO", "NHWC"),
          feature_group_count=self.feature_group_count)
    else:
      y = halo_conv(x.astype(dtype), kernel.astype(dtype), strides=self.strides,
                    padding=self.padding, feature_group_count=self.feature_group_count,
                    axis_names=self.axis_names)
    if self.use_bias:
      y = y + self.param("bias", nn.initializers.zeros, (self.features,)).astype(dtype)
    return y


def spatial_mesh(data: int = 1, height: int = 1, width: int | None = None, *,
                 devices=None, axis_names: tuple[str, str, str] = ("data", "h", "w")) -> Mesh:
  """A ``(data, h, w)`` mesh; ``width`` defaults to the remaining devices.

  Raises:
    ValueError: if the sizes do not multiply to the number of devices given.
  """
  devices = np.asarray(jax.devices() if devices is None else devices).reshape(-1)
  if width is None:
    if len(devices) % (data * height):
      raise ValueError(f"{len(devices)} devices do not split into data={data} x h={height}.")
    width = len(devices) // (data * height)
  if data * height * width != len(devices):
    raise ValueError(f"data={data} x h={height} x w={width} = {data * height * width} is not "
                     f"the number of devices ({len(devices)}).")
  return Mesh(devices.reshape(data, height, width), axis_names)


def activation_spec(mesh: Mesh, ndim: int = 4) -> P:
  """PartitionSpec of an ``[N, H, W, C]`` activation on a `spatial_mesh` (size-1 axes dropped)."""
  data, h, w = mesh.axis_names
  size = dict(zip(mesh.axis_names, mesh.devices.shape))
  pick = lambda a: a if size[a] > 1 else None
  if ndim == 4:
    return P(pick(data), pick(h), pick(w), None)
  if ndim == 3:
    return P(pick(data), pick(w), None)
  raise ValueError(f"activation_spec supports 3-D and 4-D activations, got ndim={ndim}.")


def replicated(mesh: Mesh) -> NamedSharding:
  """Sharding of parameters (replicated on every device of ``mesh``)."""
  return NamedSharding(mesh, P())


def spatial_model_fns(model, mesh: Mesh):
  """`jmem.step.ModelFns` of ``model`` run with its activations sharded on ``mesh``.

  ``model`` is a linen module with ``axis_names`` and ``data_axis`` fields (e.g.
  `jmem.models.ConvNeXt`); ``mesh`` a `spatial_mesh` ``(data, h, w)``. Parameters are
  initialised by the unsharded model (they are the same) and replicated; ``apply`` runs the
  sharded clone inside ``jax.shard_map``, so the training step of `jmem.step` is unchanged:
  autodiff of the shard_map all-reduces the replicated parameters' gradients. The training
  state is replicated over ``mesh`` (``sharding``), as the step returns it.
  """
  for field in ("axis_names", "data_axis"):
    if not hasattr(model, field):
      raise ValueError(f"Spatial sharding needs a model with an {field!r} field (such as "
                       f"jmem.models.ConvNeXt); {type(model).__name__} has none.")
  data, h, w = mesh.axis_names
  size = dict(zip(mesh.axis_names, mesh.devices.shape))
  sharded = model.clone(axis_names=(h if size[h] > 1 else None, w if size[w] > 1 else None),
                        data_axis=data if size[data] > 1 else None)
  base, local = step_lib.model_fns(model), step_lib.model_fns(sharded)
  x_spec = activation_spec(mesh)
  out_spec = P(data) if size[data] > 1 else P()

  def apply(params, model_state, x, *, train, rng=None, mask=None):
    for dim, axis in zip(x.shape, (data, h, w)):
      if dim % size[axis]:
        raise ValueError(
            f"Input of shape {x.shape} is not divisible by the mesh {size} along {axis!r} "
            f"({dim} % {size[axis]} != 0): resize or pad the images, or change the batch size, "
            f"so that N, H and W are multiples of the data, h and w mesh sizes.")

    def run(params, model_state, x, rng, *mask):
      kw = {"mask": mask[0]} if mask else {}
      return local.apply(params, model_state, x, train=train, rng=rng, **kw)
    masks = () if mask is None else (mask,)
    return jax.shard_map(run, mesh=mesh, in_specs=(P(), P(), x_spec, P()) + (out_spec,) * len(masks),
                         out_specs=(out_spec, P()))(params, model_state, x, rng, *masks)

  return step_lib.ModelFns(base.init, apply, sharded, sharding=replicated(mesh),
                            batch_sharding=NamedSharding(mesh, x_spec))
