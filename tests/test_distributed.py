"""Data parallelism on a mesh and the settings of several processes, in this one process
(two real processes: tests/test_multiprocess.py)."""

import dataclasses
import re

import flax.linen as nn
import jax
import numpy as np
import pytest
from flax import nnx

import jmem
from jmem import cli, data, distributed, parallel, train


class _TinyBN(nn.Module):
  """A third-party model: inline conv stem, Flax's own BatchNorm (or ``norm``), a global
  mean."""

  norm: type = nn.BatchNorm

  @nn.compact
  def __call__(self, x, train: bool = False):
    # No bias before BatchNorm: its gradient is 0 up to rounding, which Adam's first steps
    # turn into +-learning rate (rounding differs between 1 and 8 devices).
    x = nn.Conv(8, (3, 3), use_bias=False, name="stem")(x)
    x = nn.relu(self.norm(use_running_average=not train, name="norm")(x))
    return nn.Dense(10, name="head")(x.mean(axis=(1, 2)))


def _digits():
  return data.digits(8)


def _max_diff(a, b):
  return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("how", ["convert", "SyncBatchNorm"])
def test_padded_data_parallel_batches_equal_one_device(how):
  """20 examples over 8 devices: padded to 24, the 4 padding rows (one device has none
  real) masked out of the loss and of SyncBN's statistics (a converted model's sites, or
  jmem's own SyncBatchNorm): the same training as 20 examples on one device."""
  ds = _digits()
  config = train.TrainConfig(steps=2, batch_size=20, progress=False)
  model = (jmem.convert(_TinyBN(), jmem.SyncBN()) if how == "convert" else
           _TinyBN(norm=parallel.SyncBatchNorm))
  fns = parallel.data_parallel(model)
  assert train.padded_size(fns, 20) == 24
  one = train.train(model, ds, config)
  eight = train.train(fns, ds, config)
  assert _max_diff(one.state.params, eight.state.params) < 1e-5
  assert _max_diff(one.state.model_state, eight.state.model_state) < 1e-5
  assert eight.test_accuracy == one.test_accuracy


@pytest.mark.slow
def test_padded_batches_on_a_data_and_spatial_mesh_equal_one_device():
  """A data x H x W = 2 x 2 x 2 mesh (both at once): 7 examples padded to 8, each device
  given its rows and its H/W block, the padding masked out of the loss (through the
  shard_map): the same training as 7 examples on one device."""
  from jmem import models  # pylint: disable=g-import-not-at-top
  from jmem.parallel import spatial  # pylint: disable=g-import-not-at-top
  ds = data.digits(8)
  ds = dataclasses.replace(ds, x_test=ds.x_test[:21], y_test=ds.y_test[:21])   # padded too
  config = train.TrainConfig(steps=2, batch_size=7, progress=False)
  model = models.create_model("convnext-digits", 10, depths=(1,), dims=(8,))
  fns = spatial.spatial_model_fns(model, spatial.spatial_mesh(2, 2, 2))
  assert train.padded_size(fns, 7) == 8
  one = train.train(model, ds, config)
  mesh = train.train(fns, ds, config)
  assert _max_diff(one.state.params, mesh.state.params) < 1e-5
  assert mesh.test_accuracy == one.test_accuracy


def test_global_batch_rows_and_mask():
  ds = _digits()
  fns = parallel.data_parallel(_TinyBN())
  idx = np.array([5, 3, 9, 1, 7])
  x, y, mask = train.global_batch(fns, ds.x_train, ds.y_train, idx, 8)
  np.testing.assert_array_equal(np.asarray(x)[:5], ds.x_train[idx])
  np.testing.assert_array_equal(np.asarray(x)[5:], 0)
  np.testing.assert_array_equal(np.asarray(y)[:5], ds.y_train[idx])
  np.testing.assert_array_equal(np.asarray(mask), [True] * 5 + [False] * 3)
  assert x.sharding == fns.batch_sharding
  assert train.global_batch(fns, ds.x_train, ds.y_train, np.arange(8), 8)[2] is None


@pytest.mark.slow
def test_padding_refused_by_a_batchnorm_that_ignores_masks():
  """Flax's own BatchNorm would count the padding: linen and NNX raise, naming it."""
  ds = _digits()
  config = train.TrainConfig(steps=1, batch_size=20, progress=False)
  with pytest.raises(ValueError, match=r"padded rows.*'norm'.*jmem.SyncBN"):
    train.train(parallel.data_parallel(_TinyBN()), ds, config)

  class NNXTiny(nnx.Module):
    def __init__(self, rngs):
      self.conv = nnx.Conv(1, 4, (3, 3), rngs=rngs)
      self.bn = nnx.BatchNorm(4, rngs=rngs)
      self.head = nnx.Linear(4, 10, rngs=rngs)

    def __call__(self, x):
      return self.head(nnx.relu(self.bn(self.conv(x))).mean(axis=(1, 2)))

  with pytest.raises(ValueError, match=r"padded rows.*BatchNorm at 'bn'"):
    train.train(parallel.data_parallel(NNXTiny(nnx.Rngs(0))), ds, config)
  # A batch size the data axis divides pads nothing: Flax's BatchNorm is then exact.
  train.train(parallel.data_parallel(_TinyBN()), ds,
              train.TrainConfig(steps=1, batch_size=16, progress=False))


def test_data_parallel_makes_the_kernels_automatic_choice_xla():
  """Under data_parallel's sharded batch the kernels' automatic choice is XLA (XLA's
  partitioner cannot split a Pallas call); on one device nothing changes."""
  from jmem import _backends  # pylint: disable=g-import-not-at-top
  seen = []

  def apply(params, model_state, x, *, train, rng=None, mask=None):
    seen.append(_backends._AUTOMATIC_XLA.get())
    return x, model_state

  fns = train.ModelFns(lambda k, x: ({}, {}), apply, None)
  parallel.data_parallel(fns).apply({}, {}, 0, train=True)
  one = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("data",))
  parallel.data_parallel(fns, one).apply({}, {}, 0, train=True)
  assert "sharded over 8 devices" in seen[0] and seen[1] is None


def test_data_parallel_bad_axis():
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("batch",))
  with pytest.raises(ValueError, match="axis 'data' is not an axis of the mesh"):
    parallel.data_parallel(_TinyBN(), mesh)


def test_distributed_settings(monkeypatch):
  for k in distributed.ENV:
    monkeypatch.delenv(k, raising=False)
  assert distributed.initialize() is False          # nothing given: one process
  with pytest.raises(ValueError, match="num_processes, process_id missing"):
    distributed.initialize("127.0.0.1:1234")
  with pytest.raises(ValueError, match="HOST:PORT"):
    distributed.initialize("localhost", 2, 0)
  with pytest.raises(ValueError, match=r"process_id must be in \[0, num_processes\)"):
    distributed.initialize("127.0.0.1:1234", 2, 2)
  monkeypatch.setenv("JMEM_COORDINATOR", "10.0.0.1:99")
  monkeypatch.setenv("JMEM_NUM_PROCESSES", "4")
  monkeypatch.setenv("JMEM_PROCESS_ID", "3")
  assert distributed.settings_from_env() == ("10.0.0.1:99", 4, 3)
  assert distributed.settings_from_env(process_id=1) == ("10.0.0.1:99", 4, 1)
  monkeypatch.setenv("JMEM_NUM_PROCESSES", "two")
  with pytest.raises(ValueError, match="JMEM_NUM_PROCESSES must be an integer"):
    distributed.settings_from_env()


@pytest.mark.parametrize("argv, message", [
    (["--mesh", "2x2"], "expected D .* or DxHxW"),
    (["--mesh", "0"], "positive sizes"),
])
def test_cli_mesh_parse_errors(argv, message, capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(["train"] + argv)
  assert e.value.code == 2
  assert re.search(message, capsys.readouterr().err)


@pytest.mark.parametrize("argv, message", [
    (["--model", "resnet8", "--mesh", "1x2x4"], "shards the image, which needs a model with "
                                                "halo convolutions"),
    (["--model", "resnet8", "--mesh", "16"], "needs 16 devices; there are 8"),
    (["--model", "convnext-digits", "--technique", "spatial-8", "--mesh", "8"],
     "runs on a mesh of its own"),
])
def test_cli_mesh_errors(argv, message, capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(["train", "--steps", "0", "--image-size", "8", "--no-progress"] + argv)
  assert e.value.code == 2
  assert message in capsys.readouterr().err
