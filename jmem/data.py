"""Real data that ships inside a package: scikit-learn's 8x8 handwritten digits.

Nothing is downloaded. Bigger images are the digits resized; short videos are moving-digit
clips built from the same digits. Every function is deterministic given its arguments, and the
train and test clips are built from disjoint digit images.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import numpy as np

__all__ = ["Dataset", "digits", "digit_segmentation", "pixel_labels", "BACKGROUND",
           "moving_digits", "frames_of", "batch_indices", "DIRECTIONS"]


@dataclasses.dataclass(frozen=True)
class Dataset:
  """An in-memory classification data set (numpy arrays, channels last).

  Attributes:
    name: what it is, with its parameters.
    x_train: ``float32[N, H, W, C]`` images or ``float32[N, T, H, W, C]`` clips.
    y_train: ``int32[N]`` labels in ``[0, num_classes)`` (or ``int32[N, H, W]``, one per
      pixel, for segmentation).
    x_test: like ``x_train``.
    y_test: like ``y_train``.
    num_classes: number of classes.
  """

  name: str
  x_train: np.ndarray
  y_train: np.ndarray
  x_test: np.ndarray
  y_test: np.ndarray
  num_classes: int

  @property
  def example_shape(self) -> tuple[int, ...]:
    """Shape of one example (without the batch dimension)."""
    return tuple(self.x_train.shape[1:])


@functools.cache
def _raw_digits() -> tuple[np.ndarray, np.ndarray]:
  from jmem import _extras  # pylint: disable=g-import-not-at-top
  d = _extras.require("sklearn.datasets", "jmem.data's digits").load_digits()
  return d.images.astype(np.float32) / 16.0, d.target.astype(np.int32)


def _split(n: int, test_fraction: float, seed: int, labels: np.ndarray):
  """Deterministic stratified split: the same indices on every machine."""
  rng = np.random.default_rng(seed)
  train, test = [], []
  for c in np.unique(labels):
    idx = np.flatnonzero(labels == c)
    idx = idx[rng.permutation(len(idx))]
    k = int(round(len(idx) * test_fraction))
    test.append(idx[:k])
    train.append(idx[k:])
  return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def _resize(images: np.ndarray, size: int) -> np.ndarray:
  """Bilinear resize of ``[N, h, w]`` images to ``[N, size, size]``."""
  if images.shape[-1] == size:
    return images
  from jmem import _extras  # pylint: disable=g-import-not-at-top
  ndimage = _extras.require("scipy.ndimage", "Resizing the digits")
  zoom = (1.0, size / images.shape[1], size / images.shape[2])
  out = ndimage.zoom(images, zoom, order=1, mode="nearest", grid_mode=True)
  return np.clip(out, 0.0, 1.0).astype(np.float32)


def _check_positive(**kw):
  for k, v in kw.items():
    if not isinstance(v, (int, np.integer)) or v <= 0:
      raise ValueError(f"{k} must be a positive integer, got {v!r}.")


def _memory_bytes() -> int | None:
  """This machine's physical memory in bytes (None where it cannot be read)."""
  try:
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
  except (ValueError, OSError, AttributeError):
    return None


def check_fits_in_memory(what: str, values: int, *, flag: str = "--image-size") -> None:
  """Raises ValueError where ``values`` float32 values (a data set about to be made in
  host memory) would take more than half of this machine's memory: a clear message instead
  of an out-of-memory crash deep inside the resize."""
  total = _memory_bytes()
  need = 4 * int(values)
  if total is not None and need > total // 2:
    raise ValueError(f"{what} would take {need / 2**30:,.1f} GiB of host memory as float32, "
                     f"more than half of this machine's {total / 2**30:,.1f} GiB: lower "
                     f"{flag}.")


def digits(image_size: int = 8, *, test_fraction: float = 0.2, seed: int = 0) -> Dataset:
  """The 1797 scikit-learn digits, optionally resized, as a train/test `Dataset`.

  Args:
    image_size: side of the returned square images (8 = original; e.g. 32 for deeper nets).
    test_fraction: fraction of each class held out for testing.
    seed: seed of the stratified split.

  Returns:
    A `Dataset` of ``float32[N, image_size, image_size, 1]`` images, standardised with the
    training set's mean and standard deviation, and 10 classes.
  """
  _check_positive(image_size=image_size)
  if not 0.0 < test_fraction < 1.0:
    raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}.")
  images, labels = _raw_digits()
  check_fits_in_memory(f"The digits at {image_size}x{image_size}",
                       2 * len(labels) * image_size**2)      # the resize and the standardised
  tr, te = _split(len(labels), test_fraction, seed, labels)
  images = _resize(images, image_size)
  mean, std = images[tr].mean(), images[tr].std()
  x = ((images - mean) / std)[..., None].astype(np.float32)
  return Dataset(f"digits{image_size}", x[tr], labels[tr], x[te], labels[te], 10)


def digits_sample(num: int, image_size: int) -> tuple[np.ndarray, np.ndarray]:
  """The first ``num`` training digits of `digits` resized to ``image_size`` (without
  resizing all 1797), standardised by their own mean and standard deviation, and their
  labels: a few real examples, e.g. `jmem plan`'s calibration batch."""
  _check_positive(num=num, image_size=image_size)
  images, labels = _raw_digits()
  tr, _ = _split(len(labels), 0.2, 0, labels)
  if num > len(tr):
    raise ValueError(f"num must be at most {len(tr)} (the training digits), got {num}.")
  check_fits_in_memory(f"{num} digits at {image_size}x{image_size}", 2 * num * image_size**2)
  x = _resize(images[tr[:num]], image_size)
  x = (x - x.mean()) / max(float(x.std()), 1e-6)
  return x[..., None].astype(np.float32), labels[tr[:num]]


BACKGROUND = 10      # the segmentation label of a pixel that is no digit's ink


def pixel_labels(x: np.ndarray, y: np.ndarray) -> np.ndarray:
  """``int32[N, H, W]``: each pixel of the standardised digits ``x [N, H, W, 1]`` labelled
  with its digit ``y`` where it is ink (over one standard deviation above the mean
  intensity), else `BACKGROUND`."""
  return np.where(x[..., 0] > 1.0, np.asarray(y)[:, None, None], BACKGROUND).astype(np.int32)


def digit_segmentation(image_size: int = 32) -> Dataset:
  """`digits` at ``image_size`` with one label per pixel (`pixel_labels`): 11 classes, the
  ten digits and the background. The data of the registered segmentation model."""
  ds = digits(image_size)
  return Dataset(f"digit segmentation {image_size}", ds.x_train,
                 pixel_labels(ds.x_train, ds.y_train), ds.x_test,
                 pixel_labels(ds.x_test, ds.y_test), BACKGROUND + 1)


# Unit velocity per direction, as (dy, dx): right, down, left, up, then the diagonals.
DIRECTIONS = ((0, 1), (1, 0), (0, -1), (-1, 0), (1, 1), (1, -1), (-1, -1), (-1, 1))


def _render_clips(images, labels, num_clips, num_frames, frame_size, digit_size,
                  num_directions, speed, rng):
  n_src = len(images)
  travel = speed * (num_frames - 1)
  room = frame_size - digit_size
  if travel > room:
    raise ValueError(
        f"A digit of size {digit_size} moving {speed} px/frame for {num_frames} frames "
        f"travels {travel} px but the frame leaves only {room} px: use a larger "
        "frame_size, a smaller digit_size, fewer frames or a lower speed.")
  clips = np.zeros((num_clips, num_frames, frame_size, frame_size), np.float32)
  ys = np.zeros((num_clips,), np.int32)
  src = rng.integers(0, n_src, num_clips)
  dirs = rng.integers(0, num_directions, num_clips)
  for i in range(num_clips):
    dy, dx = DIRECTIONS[dirs[i]]
    # Start anywhere the whole trajectory stays inside the frame.
    lo_y, hi_y = max(0, -dy * travel), room - max(0, dy * travel)
    lo_x, hi_x = max(0, -dx * travel), room - max(0, dx * travel)
    y0, x0 = rng.integers(lo_y, hi_y + 1), rng.integers(lo_x, hi_x + 1)
    for t in range(num_frames):
      y, x = y0 + dy * speed * t, x0 + dx * speed * t
      clips[i, t, y:y + digit_size, x:x + digit_size] = images[src[i]]
    ys[i] = labels[src[i]] * num_directions + dirs[i]
  return clips, ys


def moving_digits(num_frames: int = 16, *, frame_size: int = 32, digit_size: int = 12,
                  num_directions: int = 4, speed: int = 1, num_train: int = 1024,
                  num_test: int = 256, seed: int = 0) -> Dataset:
  """Short clips of one real digit translating across an empty frame.

  Appearance and motion both matter: the label is ``digit * num_directions + direction``,
  so a model must recognise the digit and tell which way it moves. Train clips use only
  the training digits of the `digits` split, test clips only the held-out ones.

  Args:
    num_frames: frames per clip (T).
    frame_size: side of each square frame.
    digit_size: side the 8x8 digit is resized to.
    num_directions: 1 to 8 directions of motion (see `DIRECTIONS`).
    speed: pixels per frame.
    num_train: number of training clips.
    num_test: number of test clips.
    seed: seed of the split, the digit draws, directions and start positions.

  Returns:
    A `Dataset` of ``float32[N, T, frame_size, frame_size, 1]`` clips and
    ``10 * num_directions`` classes.
  """
  _check_positive(num_frames=num_frames, frame_size=frame_size, digit_size=digit_size,
                  speed=speed, num_train=num_train, num_test=num_test)
  if not 1 <= num_directions <= len(DIRECTIONS):
    raise ValueError(f"num_directions must be in [1, {len(DIRECTIONS)}], got {num_directions}.")
  check_fits_in_memory(f"{num_train + num_test} clips of {num_frames} frames of "
                       f"{frame_size}x{frame_size}",
                       (num_train + num_test) * num_frames * frame_size**2)
  images, labels = _raw_digits()
  tr, te = _split(len(labels), 0.2, seed, labels)
  images = _resize(images, digit_size)
  rng = np.random.default_rng([seed, num_frames, frame_size])
  args = (num_frames, frame_size, digit_size, num_directions, speed)
  x_tr, y_tr = _render_clips(images[tr], labels[tr], num_train, *args, rng)
  x_te, y_te = _render_clips(images[te], labels[te], num_test, *args, rng)
  mean, std = x_tr.mean(), x_tr.std()
  norm = lambda v: ((v - mean) / std)[..., None].astype(np.float32)
  return Dataset(f"moving_digits{num_frames}x{frame_size}", norm(x_tr), y_tr, norm(x_te), y_te,
                 10 * num_directions)


def frames_of(clips: Dataset) -> Dataset:
  """Single labelled frames from `moving_digits` clips, e.g. to pretrain a video model's
  spatial part (`jmem.models.video.pretrain_backbone`): frame ``i % T`` of clip i, labelled
  with its digit (the label without the direction)."""
  if clips.x_train.ndim != 5 or clips.num_classes % 10:
    raise ValueError(f"frames_of needs moving_digits clips [N, T, H, W, C] with 10 x "
                     f"directions classes, got {clips.name!r} with examples of shape "
                     f"{clips.example_shape} and {clips.num_classes} classes.")
  directions = clips.num_classes // 10
  pick = lambda x: x[np.arange(len(x)), np.arange(len(x)) % x.shape[1]]
  return Dataset(f"frames_of_{clips.name}", pick(clips.x_train), clips.y_train // directions,
                 pick(clips.x_test), clips.y_test // directions, 10)


def batch_indices(num_examples: int, batch_size: int, step: int, *, seed: int) -> np.ndarray:
  """Indices of the training batch for ``step``: a pure function of (seed, step).

  Each epoch is a fresh permutation seeded by ``(seed, epoch)``; the last partial batch of
  an epoch is dropped. Because nothing is carried between steps, a resumed run draws the
  same batches as an uninterrupted one.
  """
  if not 0 < batch_size <= num_examples:
    raise ValueError(
        f"batch_size must be in [1, {num_examples}] (the number of training examples), "
        f"got {batch_size}.")
  per_epoch = num_examples // batch_size
  epoch, k = divmod(step, per_epoch)
  perm = np.random.default_rng([seed, epoch]).permutation(num_examples)
  return perm[k * batch_size:(k + 1) * batch_size]
