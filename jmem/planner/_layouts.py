"""Device layouts the planner compiles on: a mesh's data and H x W axes (``mesh=``), or
the layouts it makes of a number of devices (``devices=``), and each site's estimate
shared over them."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jmem import surgery

@dataclasses.dataclass(frozen=True)
class _Layout:
  """How each step is compiled on the devices of ``mesh=`` (the defaults: one device).

  Attributes:
    base: the techniques under every plan (``jmem.Spatial``, or none).
    shards: the devices one step's activations are split over (data x H x W).
    multiple: the data axis's size: the batch sizes compiled are multiples of it.
    mesh: the mesh (None: one device).
    specs: ``(x, y) -> (x's PartitionSpec, y's)`` for a batch (the train state is
      replicated; None on one device).
    note: what the figures are, for the plan's notes (None: one device).
    xla: data parallelism alone: on a GPU the kernels' automatic choice is XLA, as
      `jmem.parallel.data_parallel` trains it.
  """

  base: tuple = ()
  shards: int = 1
  multiple: int = 1
  mesh: Any = None
  specs: Any = lambda x, y: None
  note: str | None = None
  xla: bool = False


def _layout(model, mesh, axes, data_axis, x, batch: int) -> _Layout:
  """The `_Layout` of ``mesh`` (None: one device), its H and W ``axes`` (None: no
  jmem.Spatial) and its ``data_axis`` (None: the batch not split)."""
  if _has_spatial(model):
    raise ValueError("this model was converted with jmem.Spatial: give jmem.plan the "
                     "unconverted model and the mesh (mesh=) or the number of devices "
                     "(devices=), so that it compiles every step with the batch sharded over "
                     "H and W and Spatial comes with the plan.")
  if mesh is None:
    if data_axis is not None:
      raise ValueError(f"data_axis={data_axis!r} names an axis of the mesh: pass mesh= too.")
    return _Layout()
  if not isinstance(mesh, Mesh):
    raise TypeError(f"jmem.plan(mesh=...) takes a jax.sharding.Mesh, got {type(mesh).__name__}.")
  axes = (None, None) if axes is None else tuple(axes)
  spatial = any(a is not None for a in axes)
  named = [a for a in (*axes, data_axis) if a is not None]
  missing = [a for a in named if a not in mesh.axis_names]
  if not named:
    raise ValueError(f"jmem.plan(mesh=...) was given no mesh axis to use: name the batch's "
                     f"axis with data_axis= and/or H and W's with spatial_axes= (the mesh has "
                     f"{dict(mesh.shape)}).")
  if missing:
    hint = (" For data parallelism alone pass spatial_axes=None (jmem plan --mesh D)."
            if data_axis is not None and data_axis in mesh.axis_names else
            " Name the batch's axis with data_axis= and H and W's with spatial_axes=.")
    raise ValueError(f"jmem.plan(mesh=...): {', '.join(map(repr, missing))} "
                     f"{'is not an axis' if len(missing) == 1 else 'are not axes'} of the mesh "
                     f"{dict(mesh.shape)} (spatial_axes={axes}, data_axis={data_axis!r}).{hint}")
  others = {a: n for a, n in mesh.shape.items() if a not in named and n > 1}
  if others:
    raise ValueError(f"jmem.plan(mesh=...) splits the batch over data_axis={data_axis!r} and "
                     f"the image's H and W over spatial_axes={axes}; the mesh's other axes "
                     f"{others} would hold copies of the same work. Name them (data_axis=, "
                     "spatial_axes=) or give a mesh without them.")
  multiple = mesh.shape[data_axis] if data_axis is not None else 1
  if batch % multiple:
    raise ValueError(f"jmem.plan(mesh=...) splits the batch over the data axis {data_axis!r} "
                     f"of {multiple} devices: batch_size {batch} must be a multiple of "
                     f"{multiple} (a padded batch would plan for masked rows).")
  base = ()
  if spatial:
    base = (surgery.Spatial(mesh, axes=axes, data_axis=data_axis),)   # checks the axes
    if len(x.shape) != 4:
      raise ValueError(f"jmem.plan(mesh=...) shards NHWC images over H and W; got x of "
                       f"shape {tuple(x.shape)} (spatial_axes=None plans data parallelism "
                       "alone: jmem plan --mesh D).")
    sides = [(x.shape[1 + i], mesh.shape[a]) for i, a in enumerate(axes) if a is not None]
    if any(n % k for n, k in sides):
      raise ValueError(f"jmem.plan(mesh=...) shards the image's H and W over the mesh axes "
                       f"{axes}: the sides {[n for n, _ in sides]} must be multiples of the "
                       f"axes' sizes {[k for _, k in sides]}.")

  def spec(a):      # images and per-pixel labels over (data, H, W), other labels over data
    return (P(data_axis, *axes, *[None] * (len(a.shape) - 3)) if spatial and len(a.shape) >= 3
            else P(data_axis))
  specs = lambda x, y: (spec(x), spec(y))
  shards = math.prod(mesh.shape[a] for a in named)
  split = ([f"the batch over {data_axis!r}"] if data_axis is not None else []) + (
      [f"H and W over {axes} (jmem.Spatial)"] if spatial else [])
  xla = data_axis is not None and not spatial
  note = (f"figures per device ({shards} device{'s' * (shards > 1)}): every step, the "
          f"exact one too, is compiled with {' and '.join(split)}, parameters and optimiser "
          "state replicated" +
          ("; BatchNorm statistics are over the whole batch (XLA all-reduces them, as "
           "SyncBN does) and on a GPU the kernels' automatic choice is XLA (XLA cannot split "
           "a Pallas call over the batch): train it so, jmem.parallel.data_parallel(model, "
           f"mesh, axis={data_axis!r})" if xla else ""))
  return _Layout(base, shards, multiple, mesh, specs, note, xla)


def _lay_out(devices, batch: int, x) -> tuple[list, str | None]:
  """``([(mesh, data_axis, spatial_axes), ...], note)`` for ``jmem.plan(devices=...)``: the
  batch over the most devices that divide it and the device count (per device, splitting
  the batch or the image keeps the same share of the activations, and halo exchanges add
  collectives: decisions.md), the image's H x W over the rest, every way ``h x w`` the
  sides allow, for `plan` to compile (the halo sizes do not rank them), at most 4: where
  the devices left for H x W split more ways (12 or more of them), the 4 with the fewest
  halo values per device and convolution, ``(h > 1) * W / w + (w > 1) * H / h`` (a
  heuristic)."""
  what = ("jmem.plan(devices=...) takes a number of devices or a non-empty sequence of "
          "distinct jax.Device (a mesh goes to mesh=, with data_axis= and spatial_axes=)")
  if isinstance(devices, numbers.Integral) and not isinstance(devices, bool):
    if not 1 <= devices <= jax.device_count():
      raise ValueError(f"jmem.plan(devices={devices}) takes a number from 1 to "
                       f"{jax.device_count()} (the devices there are), or a sequence of "
                       "devices.")
    devices = jax.devices()[:devices]
  if isinstance(devices, (bool, str, Mesh)) or not isinstance(devices, Sequence):
    raise TypeError(f"{what}; got {devices!r}.")
  devices = list(devices)
  n = len(devices)
  if not n or not all(isinstance(d, jax.Device) for d in devices) or len(set(devices)) < n:
    raise TypeError(f"{what}; got {devices!r}.")
  if n == 1:
    return [(None, None, None)], None
  data = math.gcd(n, batch)
  rest = n // data
  fewer = max(k for k in range(1, n + 1) if batch % k == 0)     # devices the batch splits over
  axis_types = (jax.sharding.AxisType.Auto,) * 3
  if rest == 1:
    mesh = jax.make_mesh((n,), ("data",), axis_types=axis_types[:1], devices=devices)
    return [(mesh, "data", None)], (f"devices={n}: the batch of {batch} is split over all "
                                    f"{n} (data parallelism)")
  took = (f"devices={n}: the batch of {batch} is split over {data} of them (the most that "
          f"divide it and {n})" if data > 1 else
          f"devices={n}: the batch of {batch} splits over none of them evenly")
  if len(x.shape) != 4:
    raise ValueError(f"{took}; the other {rest} would split the image's H and W "
                     f"(jmem.Spatial), which takes NHWC images, not x of shape "
                     f"{tuple(x.shape)}. Give a batch that is a multiple of {n}, or fewer "
                     f"devices (devices={fewer}).")
  height, width = x.shape[1:3]
  splits = [(h, rest // h) for h in range(1, rest + 1)
            if rest % h == 0 and height % h == 0 and width % (rest // h) == 0]
  if not splits:
    raise ValueError(f"{took}; the other {rest} would split the image's H x W = {height} x "
                     f"{width}, and no h x w = {rest} divides it. Give a batch that is a "
                     f"multiple of {n}, an image size that {rest} divides, or fewer devices "
                     f"(devices={fewer}).")
  splits = sorted(splits, key=lambda s: ((s[0] > 1) * width / s[1] + (s[1] > 1) * height / s[0],
                                         (s[0] > 1) + (s[1] > 1), -s[1]))[:4]
  out = [(jax.make_mesh((data, h, w), ("data", "h", "w"), axis_types=axis_types,
                        devices=devices),
          "data" if data > 1 else None, ("h" if h > 1 else None, "w" if w > 1 else None))
         for h, w in splits]
  return out, f"{took}; H x W over the other {rest} (jmem.Spatial)"


def _hw(layout) -> str:
  """``h x w`` of a `_Layout` with jmem.Spatial."""
  shape = layout.mesh.shape
  return "x".join(str(shape[a]) if a is not None else "1" for a in layout.base[0].axes)


def _has_spatial(model) -> bool:
  if isinstance(model, nnx.Module):
    return any(isinstance(m, nnx.Conv) and m.conv_general_dilated is not lax.conv_general_dilated
               for _, m in nnx.iter_graph(model))
  return any(isinstance(t, surgery.Spatial) for t in getattr(model, "techniques", ()))


def _per_device(sites, shards: int):
  """``sites`` with their bytes and FLOPs shared by ``shards`` devices."""
  if shards == 1:
    return sites
  return [dataclasses.replace(s, **{f: getattr(s, f) / shards for f in (
      "residual_bytes", "input_bytes", "input_values", "forward_flops", "values")})
          for s in sites]
