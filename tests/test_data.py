"""Real data, built deterministically from scikit-learn's digits."""

import numpy as np
import pytest

from jmem import data


def test_digits_split_is_deterministic_disjoint_and_stratified():
  a, b = data.digits(), data.digits()
  np.testing.assert_array_equal(a.x_train, b.x_train)
  assert a.x_train.shape[1:] == (8, 8, 1) and a.x_train.dtype == np.float32
  assert len(a.x_train) + len(a.x_test) == 1797
  counts = np.bincount(a.y_test, minlength=10)
  assert counts.min() >= 34 and counts.max() <= 38          # ~20% of each class
  # No test image appears in the training set.
  train_rows = {r.tobytes() for r in a.x_train.reshape(len(a.x_train), -1)}
  dup = sum(r.tobytes() in train_rows for r in a.x_test.reshape(len(a.x_test), -1))
  assert dup <= 2   # the raw data set itself holds a couple of identical images
  assert abs(a.x_train.mean()) < 1e-4 and abs(a.x_train.std() - 1) < 1e-3


def test_digits_resize():
  d = data.digits(32)
  assert d.x_train.shape[1:] == (32, 32, 1)
  assert d.example_shape == (32, 32, 1)
  with pytest.raises(ValueError, match="image_size"):
    data.digits(0)


def test_moving_digits_motion_matches_label():
  d = data.moving_digits(8, frame_size=24, digit_size=8, num_train=40, num_test=8)
  assert d.x_train.shape == (40, 8, 24, 24, 1) and d.num_classes == 40
  assert d.y_train.min() >= 0 and d.y_train.max() < 40
  raw = d.x_train[..., 0] - d.x_train.min()
  ys, xs = np.mgrid[:24, :24]
  for clip, label in zip(raw, d.y_train):
    mass = clip.sum(axis=(1, 2))
    cy = (clip * ys).sum(axis=(1, 2)) / mass
    cx = (clip * xs).sum(axis=(1, 2)) / mass
    dy, dx = data.DIRECTIONS[label % 4]
    np.testing.assert_allclose(np.diff(cy), dy, atol=1e-3)
    np.testing.assert_allclose(np.diff(cx), dx, atol=1e-3)


def test_moving_digits_deterministic_and_validated():
  a = data.moving_digits(4, frame_size=16, digit_size=8, num_train=8, num_test=4)
  b = data.moving_digits(4, frame_size=16, digit_size=8, num_train=8, num_test=4)
  np.testing.assert_array_equal(a.x_test, b.x_test)
  with pytest.raises(ValueError, match="travels"):
    data.moving_digits(32, frame_size=16, digit_size=12)
  with pytest.raises(ValueError, match="num_directions"):
    data.moving_digits(4, num_directions=9)


def test_frames_of_picks_one_frame_per_clip_with_its_digit():
  for directions in (4, 2):
    d = data.moving_digits(4, frame_size=16, digit_size=8, num_directions=directions,
                           num_train=8, num_test=4)
    f = data.frames_of(d)
    assert f.x_train.shape == (8, 16, 16, 1) and f.num_classes == 10
    np.testing.assert_array_equal(f.x_train[5], d.x_train[5, 5 % 4])
    np.testing.assert_array_equal(f.y_test, d.y_test // directions)
  with pytest.raises(ValueError, match="frames_of needs moving_digits clips"):
    data.frames_of(data.digits())


def test_batch_indices_pure_and_epoch_permutation():
  per_epoch = [data.batch_indices(100, 10, s, seed=3) for s in range(10)]
  np.testing.assert_array_equal(np.sort(np.concatenate(per_epoch)), np.arange(100))
  np.testing.assert_array_equal(data.batch_indices(100, 10, 7, seed=3), per_epoch[7])
  assert not np.array_equal(data.batch_indices(100, 10, 10, seed=3), per_epoch[0])
  with pytest.raises(ValueError, match="batch_size"):
    data.batch_indices(100, 101, 0, seed=0)
