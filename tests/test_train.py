"""The training loop: linen and NNX, state threading, exact resume from orbax checkpoints."""

import collections
import contextlib
import dataclasses
import json
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import linear_fns
from jmem import bench, data, models, train
from jmem.models import SmallCNN, resnet


@pytest.fixture(scope="module")
def digits8():
  return data.digits(8)


def _same_tree(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      x, y = jax.random.key_data(x), jax.random.key_data(y)
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.runs
@pytest.mark.slow
def test_linen_resnet_learns_digits(digits8):
  cfg = train.TrainConfig(steps=120, batch_size=64, progress=False, eval_every=60)
  result = train.train(resnet("resnet8", 10), digits8, cfg)
  assert result.test_accuracy > 0.9
  assert [h["step"] for h in result.history] == [60, 120]
  # BatchNorm statistics were threaded through the steps.
  stats = result.state.model_state["batch_stats"]["stem"]["bn"]["mean"]
  assert float(jnp.abs(stats).sum()) > 0


@pytest.mark.slow
def test_nnx_model_learns_and_threads_state(digits8):
  model = SmallCNN(1, 10, rngs=nnx.Rngs(0))
  cfg = train.TrainConfig(steps=150, batch_size=64, progress=False)
  result = train.train(model, digits8, cfg)
  assert result.test_accuracy > 0.8
  bn_mean = result.state.model_state["bn1"]["mean"]
  assert float(jnp.abs(bn_mean[...]).sum()) > 0
  # The caller's model was not donated away: it still runs, with its initial statistics.
  model.eval()
  assert model(jnp.asarray(digits8.x_test[:2])).shape == (2, 10)
  assert float(jnp.abs(model.bn1.mean[...]).sum()) == 0


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_resume_is_bit_identical(kind, digits8, tmp_path):
  def make():
    return (resnet("resnet8", 10, num_filters=8) if kind == "linen"
            else SmallCNN(1, 10, width=8, rngs=nnx.Rngs(0)))

  cfg = dict(steps=7, batch_size=32, progress=False, checkpoint_every=3)
  full = train.train(make(), digits8, train.TrainConfig(**cfg))
  ckpt = str(tmp_path / "ckpt")
  killed = train.train(make(), digits8,
                       train.TrainConfig(**cfg, checkpoint_dir=ckpt), stop_after=5)
  assert int(killed.state.step) == 5          # last checkpoint was written at step 3
  resumed = train.train(make(), digits8,
                        train.TrainConfig(**cfg, checkpoint_dir=ckpt, resume=True))
  assert resumed.resumed_from == 3
  _same_tree(full.state, resumed.state)
  assert resumed.test_accuracy == full.test_accuracy
  # The other kind of model is refused: its state has other arrays.
  other = (SmallCNN(1, 10, width=8, rngs=nnx.Rngs(0)) if kind == "linen"
           else resnet("resnet8", 10, num_filters=8))
  with pytest.raises(ValueError, match="different run.*state: '[0-9]+ arrays"):
    train.train(other, digits8, train.TrainConfig(**cfg, checkpoint_dir=ckpt, resume=True))


def _flip_bytes(step_dir):
  """Inverts 8 bytes in the middle of the largest data file of a checkpoint step, as a bad
  disk or copy would. The file's chunks are zstd frames, so whether orbax still reads it
  depends on where the bytes land: into different values (which the checksums catch) or
  into a frame that no longer decodes."""
  files = [p for p in step_dir.rglob("*") if p.is_file() and p.parent.name == "d"]
  big = max(files, key=lambda p: p.stat().st_size)
  with open(big, "r+b") as f:
    f.seek(big.stat().st_size // 2)
    chunk = f.read(8)
    f.seek(big.stat().st_size // 2)
    f.write(bytes(b ^ 0xFF for b in chunk))


def _change_one_digest(step_dir, index=0):
  """Makes one array of a checkpoint step differ from its recorded SHA-256, readably: the
  record is edited instead of the array (which, zstd-compressed, a flip may make unreadable
  instead), so the checksum comparison itself is what must refuse it."""
  record = step_dir / "integrity" / "metadata"
  doc = json.loads(record.read_text())
  digest = doc["sha256"][index]
  doc["sha256"][index] = ("0" if digest[0] != "0" else "1") + digest[1:]
  record.write_text(json.dumps(doc))


@pytest.mark.slow
def test_resume_falls_back_past_a_corrupted_checkpoint(digits8, tmp_path):
  """Issue 50: a byte flip in the newest checkpoint resumed silently into NaN. Now it fails
  its checksums or its read, the run resumes from the step before (saying so, the bad step
  moved aside) and ends bit-identical to an uninterrupted run; with every step corrupted it
  refuses to resume."""
  def make():
    return resnet("resnet8", 10, num_filters=8)
  cfg = dict(steps=7, batch_size=32, progress=False, checkpoint_every=3)
  full = train.train(make(), digits8, train.TrainConfig(**cfg))
  ckpt = tmp_path / "ckpt"
  train.train(make(), digits8, train.TrainConfig(**cfg, checkpoint_dir=str(ckpt)), stop_after=7)
  assert sorted(p.name for p in ckpt.iterdir()) == ["6", "7"]
  both = tmp_path / "both"
  shutil.copytree(ckpt, both)
  _flip_bytes(ckpt / "7")
  with pytest.warns(train.CheckpointFallbackWarning,
                    match=r"from checkpoint step 6 .* not from the newer step 7 \((1 of 108 "
                          r"arrays differ from the checksums|unreadable, perhaps truncated or "
                          r"corrupted).*moved aside as 7.unverified"):
    resumed = train.train(make(), digits8,
                          train.TrainConfig(**cfg, checkpoint_dir=str(ckpt), resume=True))
  assert resumed.resumed_from == 6
  _same_tree(full.state, resumed.state)
  assert sorted(p.name for p in ckpt.iterdir()) == ["6", "7", "7.unverified"]
  # The checksums' own refusal, deterministically: array 5 of step 7 and 0 of step 6 differ.
  _change_one_digest(both / "7", 5)
  _change_one_digest(both / "6")
  with pytest.raises(ValueError, match=r"no checkpoint in it verifies \(step 7: 1 of 108 "
                                       r"arrays differ from the checksums written with them "
                                       r"\(array 5 first\).*; step 6: 1 of 108 arrays differ"):
    train.train(make(), digits8, train.TrainConfig(**cfg, checkpoint_dir=str(both), resume=True))


def test_resume_refuses_a_state_that_is_not_finite(digits8, tmp_path):
  """A run saved after it diverged (its checksums hold) is not resumed from."""
  def nan_fns():
    fns = _tiny_fns((2, 3))
    return fns._replace(init=lambda key, x: ({"w": jnp.full((2, 3), jnp.nan)}, {}))
  cfg = dict(steps=2, batch_size=8, progress=False, checkpoint_dir=str(tmp_path / "c"),
             checkpoint_every=1)
  train.train(nan_fns(), digits8, train.TrainConfig(**cfg))
  with pytest.raises(ValueError, match=r"no checkpoint in it verifies \(step 2: \d+ of 6 "
                                       r"arrays hold NaN or inf.*diverged"):
    train.train(nan_fns(), digits8, train.TrainConfig(**cfg, resume=True))


def _tiny_fns(shape):
  """A model whose only parameter has ``shape``: the logits are 0 plus sum(w) * 0."""
  def apply(params, model_state, x, *, train, rng=None):
    del train, rng
    return jnp.zeros((x.shape[0], 10)) + 0.0 * jnp.sum(params["w"]), model_state
  return train.ModelFns(lambda key, x: ({"w": jnp.ones(shape)}, {}), apply, None)


def test_resume_refuses_a_state_of_other_shapes(digits8, tmp_path):
  """Same number of arrays and parameters, but a transposed weight."""
  cfg = dict(steps=2, batch_size=8, progress=False, checkpoint_dir=str(tmp_path / "c"))
  train.train(_tiny_fns((2, 3)), digits8, train.TrainConfig(**cfg))
  with pytest.raises(ValueError, match=r"different run \(state: '6 arrays, 6 parameters, "
                     r"shapes and dtypes #\w+' there, '6 arrays, 6 parameters, shapes"):
    train.train(_tiny_fns((3, 2)), digits8, train.TrainConfig(**cfg, resume=True))


def test_train_config_errors(digits8):
  model = resnet("resnet8", 10)
  with pytest.raises(ValueError, match="batch_size"):
    train.train(model, digits8, train.TrainConfig(batch_size=10_000, progress=False))
  with pytest.raises(ValueError, match="steps"):
    train.train(model, digits8, train.TrainConfig(steps=-1, progress=False))
  with pytest.raises(ValueError, match="checkpoint_dir"):
    train.train(model, digits8, train.TrainConfig(resume=True, progress=False))
  with pytest.raises(TypeError, match="linen"):
    train.model_fns(object())


def test_unwritable_checkpoint_dir(digits8, tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("not a directory")
  with pytest.raises(ValueError, match="checkpoint directory"):
    train.train(resnet("resnet8", 10), digits8,
                train.TrainConfig(steps=1, checkpoint_dir=str(blocker / "sub"), progress=False))


class _Tiny(nn.Module):
  @nn.compact
  def __call__(self, x, train=False):
    return nn.Dense(3)(x)


def test_empty_batch_is_refused_before_any_update():
  """A mean over no example is NaN: the step used to return a NaN loss (and, with
  BatchNorm, NaN statistics and parameters); now it refuses the batch when traced."""
  fns = train.model_fns(_Tiny())
  opt = train.default_optimizer(1e-3, 10)
  state = train.init_state(fns, opt, jax.random.key(0), jnp.ones((1, 4)))
  step = train.make_train_step(fns, opt, donate=False)
  with pytest.raises(ValueError, match=r"Empty batch: x has shape \(0, 4\)"):
    step(state, jnp.ones((0, 4)), jnp.zeros((0,), jnp.int32))
  with pytest.raises(ValueError, match="Empty batch"):
    train.make_loss(fns)(state.params, state.model_state, jnp.ones((0, 4)),
                         jnp.zeros((0,), jnp.int32), None)
  new, metrics = step(state, jnp.ones((2, 4)), jnp.zeros((2,), jnp.int32))   # still works
  assert np.isfinite(float(metrics["loss"]))
  assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree.leaves(new.params))


@contextlib.contextmanager
def _compiles():
  """Counts XLA compilations, by function name, while the block runs."""
  counts = collections.Counter()

  def listener(event, duration, **kwargs):
    del duration
    if event == "/jax/core/compile/backend_compile_duration":
      counts[kwargs.get("fun_name")] += 1
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield counts
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


@pytest.mark.slow
@pytest.mark.parametrize("technique", ["exact", "spatial-8"])
def test_step_and_evaluate_compile_once(technique):
  """A train step called 3 times compiles once, and so does an evaluation called again and
  again, a partial last batch included.

  spatial-8 compiled its step twice (the initial state on one device, the step's output
  replicated on the mesh); evaluate re-jitted on every call, once more for a partial batch.
  Evaluate counts the correct predictions in its compiled call (``count``), on a mesh too.
  """
  evaluation = "jit(count)"
  ds = data.digits(16)
  ds = dataclasses.replace(ds, x_test=ds.x_test[:40], y_test=ds.y_test[:40])
  model = models.create_model("convnext-digits", 10, depths=(1,), dims=(8,))
  fns = train.model_fns(bench.build_model(technique, model, ds, 8))
  with _compiles() as counts:      # evaluates after steps 1, 2 and 3
    result = train.train(fns, ds, train.TrainConfig(steps=3, batch_size=8, eval_every=1,
                                                    progress=False))
  assert len(result.history) == 3
  assert counts["jit(step)"] == 1 and counts[evaluation] == 1, counts
  accuracies = []
  for i in range(3):               # batches of 16, 16 and 8 (padded)
    with _compiles() as counts:
      accuracies.append(train.evaluate(fns, result.state, ds.x_test, ds.y_test, batch_size=16))
    if i == 0:                     # a new batch size: one compile, the partial batch included
      assert counts[evaluation] == 1, counts
    else:                          # nothing at all is compiled again
      assert not counts, counts
  assert accuracies == [result.test_accuracy] * 3


@pytest.mark.slow
def test_evaluate_per_pixel_labels_is_pixel_accuracy():
  """Segmentation (one label per pixel): the accuracy is over the pixels, on one device,
  with the batch split over a data axis (padded) and with the images and labels split over
  data x H; trained so, the parameters are one device's (it was correct pixels per image,
  and on a mesh the row mask did not broadcast over the pixels)."""
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from jmem.parallel import data_parallel  # pylint: disable=g-import-not-at-top

  class PerPixel(nn.Module):
    @nn.compact
    def __call__(self, x, train=True):
      return nn.Conv(3, (3, 3))(x)

  rng = np.random.default_rng(0)
  x = rng.normal(size=(6, 6, 6, 1)).astype(np.float32)
  y = rng.integers(0, 3, (6, 6, 6)).astype(np.int32)
  plain = train.model_fns(PerPixel())
  state = train.init_state(plain, train.default_optimizer(1e-3, 10), jax.random.key(0),
                           jnp.asarray(x[:1]))
  logits = plain.apply(state.params, state.model_state, jnp.asarray(x), train=False)[0]
  want = float(np.mean(np.argmax(np.asarray(logits), -1) == y))
  assert 0 < want < 1
  assert train.evaluate(plain, state, x, y, batch_size=4) == pytest.approx(want)
  split = data_parallel(PerPixel(), jax.make_mesh((4,), ("data",), devices=jax.devices()[:4]))
  cube = jax.make_mesh((2, 2), ("data", "h"), devices=jax.devices()[:4])
  tiled = plain._replace(sharding=NamedSharding(cube, P()),
                         batch_sharding=NamedSharding(cube, P("data", "h", None, None)))
  _, labels, _ = train.global_batch(tiled, x, y, np.arange(6), 6)
  assert labels.sharding.spec == P("data", "h", None)         # split as the images are
  ds = data.Dataset("per-pixel labels", x, y, x, y, 3)
  config = train.TrainConfig(steps=3, batch_size=6, progress=False)
  one = train.train(PerPixel(), ds, config)
  for fns in (split, tiled):       # 6 rows on 4 devices: padded, masked; 2 x 2: not padded
    assert train.evaluate(fns, state, x, y, batch_size=4) == pytest.approx(want)
    other = train.train(fns, ds, config)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 one.state.params, jax.device_get(other.state.params))
    assert other.test_accuracy == pytest.approx(one.test_accuracy)
  assert 0 < one.test_accuracy < 1


@pytest.mark.slow
def test_evaluate_on_a_data_axis_any_test_set_size():
  """A mesh with a data axis of 2: a test set of 21 (smaller than the batch size, odd) is
  padded to a multiple of the mesh, and the accuracy equals the one-device model's (the
  final evaluation crashed: 21 is not divisible by the data axis)."""
  from jmem.parallel import spatial  # pylint: disable=g-import-not-at-top
  ds = data.digits(16)
  x, y = ds.x_test[:21], ds.y_test[:21]
  model = models.create_model("convnext-digits", 10, depths=(1,), dims=(8,))
  fns = spatial.spatial_model_fns(model, spatial.spatial_mesh(2, 1, 4))
  plain = train.model_fns(model)
  state = train.init_state(plain, train.default_optimizer(1e-3, 10), jax.random.key(0),
                           jnp.asarray(x[:1]))
  assert train.evaluate(fns, state, x, y) == train.evaluate(plain, state, x, y)


@pytest.mark.slow
def test_steps_wait_for_each_other_where_xla_cpu_collectives_need_it(digits8, monkeypatch):
  """Issue 50: XLA:CPU's collectives with many steps in flight aborted (exit 134) or hung a
  multi-device run; `train` waits for each step there (benchmarks/soak_multiprocess.py runs
  the two-process command of docs/devices.md), and keeps JAX's asynchronous queue elsewhere."""
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:8]), ("data",))
  on_mesh = jax.device_put(jnp.ones(8), jax.sharding.NamedSharding(mesh, jax.P()))
  assert train._collectives_need_waiting({"w": on_mesh})
  assert not train._collectives_need_waiting({"w": jnp.ones(8)})        # one device
  waited = []
  real = jax.block_until_ready
  monkeypatch.setattr(jax, "block_until_ready", lambda x: waited.append(1) or real(x))
  replicated = jax.sharding.NamedSharding(mesh, jax.P())
  fns = _tiny_fns((2, 3))._replace(sharding=replicated)
  cfg = dict(steps=3, batch_size=8, progress=False)
  train.train(fns, digits8, train.TrainConfig(**cfg))
  assert len(waited) == 3
  train.train(fns, digits8, train.TrainConfig(**cfg, wait_each_step=False))
  assert len(waited) == 3
  train.train(_tiny_fns((2, 3)), digits8, train.TrainConfig(**cfg))
  assert len(waited) == 3


def test_an_iterable_of_batches_trains_as_the_dataset_it_came_from(digits8, tmp_path):
  """`train` takes any iterable of (x, y) batches: fed the batches a Dataset run draws, it
  ends bit-identical to that run, resumes exactly (skipping the batches its checkpoint took),
  and stops with a warning where the batches end."""
  cfg = dict(steps=6, batch_size=16, progress=False)

  def batches(limit=None):
    for step in range(cfg["steps"] if limit is None else limit):
      idx = data.batch_indices(len(digits8.x_train), 16, step, seed=0)
      yield digits8.x_train[idx], digits8.y_train[idx]
  test = (digits8.x_test, digits8.y_test)
  ref = train.train(linear_fns(), digits8, train.TrainConfig(**cfg))
  got = train.train(linear_fns(), batches(), train.TrainConfig(**cfg), eval_data=test)
  _same_tree(got.state, ref.state)
  assert got.test_accuracy == ref.test_accuracy and got.history == ref.history
  # No test set: the training figures only.
  alone = train.train(linear_fns(), batches(), train.TrainConfig(**cfg))
  assert alone.test_accuracy is None and set(alone.history[-1]) == {"step", "loss",
                                                                   "train_accuracy"}
  # Stopped after step 4 (as if killed), resumed with the iterable started again.
  ckpt = dict(checkpoint_dir=str(tmp_path / "c"), checkpoint_every=2)
  train.train(linear_fns(), batches(), train.TrainConfig(**cfg, **ckpt), stop_after=4)
  resumed = train.train(linear_fns(), batches(), train.TrainConfig(**cfg, **ckpt, resume=True))
  assert resumed.resumed_from == 4
  _same_tree(resumed.state, ref.state)
  with pytest.raises(ValueError, match=r"Cannot resume at step 6: the iterable of batches "
                                       r"ended after 3 batches"):
    train.train(linear_fns(), batches(3), train.TrainConfig(**cfg, **ckpt, resume=True))
  # Batches that end early: a warning, and the run stops there.
  with pytest.warns(UserWarning, match="The batches ended after 3 steps, before steps=6"):
    short = train.train(linear_fns(), batches(3), train.TrainConfig(**cfg))
  assert short.history[-1]["step"] == 3 and int(short.state.step) == 3


def test_an_iterable_of_batches_that_cannot_be_trained_on_is_refused(digits8):
  x, y = digits8.x_train[:32], digits8.y_train[:32]
  cfg = train.TrainConfig(steps=2, batch_size=16, progress=False)
  with pytest.raises(TypeError, match=r"got one \(x, y\) pair of arrays.*Pass \[\(x, y\)\]"):
    train.train(linear_fns(), (x, y), cfg)
  with pytest.raises(TypeError, match="iterable of .x, y. batches, got int"):
    train.train(linear_fns(), 3, cfg)
  with pytest.raises(ValueError, match="yielded none"):
    train.train(linear_fns(), iter([]), cfg)
  with pytest.raises(ValueError, match=r"the first batch has 32 examples, TrainConfig.batch_size "
                                       r"is 16. Set TrainConfig\(batch_size=32\)"):
    train.train(linear_fns(), [(x, y)], cfg)
  with pytest.raises(ValueError, match="batch 0 is a ndarray; each batch of the iterable must "
                                       "be an .x, y. pair"):
    train.train(linear_fns(), [x[:16]], cfg)
  with pytest.raises(ValueError, match=r"batch 1 has x of shape \(8, 8, 8, 1\); every batch "
                                       r"must have 16 examples.*only on a mesh"):
    train.train(linear_fns(), [(x[:16], y[:16]), (x[:8], y[:8])], cfg)
  with pytest.raises(ValueError, match="eval_data must be an .x, y. pair"):
    train.train(linear_fns(), [(x[:16], y[:16])], cfg, eval_data=x)


@pytest.mark.slow
def test_an_iterables_short_last_batch_is_padded_and_masked_on_a_mesh(digits8):
  """On a data axis of 8, batches of 16 and a last one of 10: the short batch is padded to
  16 and masked (its padding rows out of the loss and the BatchNorm statistics), so the run
  ends where a Dataset run would not and the parameters stay finite."""
  import jmem  # pylint: disable=g-import-not-at-top
  from jmem import parallel  # pylint: disable=g-import-not-at-top
  x, y = digits8.x_train, digits8.y_train
  batches = [(x[:16], y[:16]), (x[16:32], y[16:32]), (x[32:42], y[32:42])]
  cfg = train.TrainConfig(steps=3, batch_size=16, progress=False)
  # Flax's BatchNorm would take the padding into its statistics: refused, saying what to do.
  with pytest.raises(ValueError, match=r"BatchNorm at 'stem/bn' keeps BatchNorm statistics "
                                       r"and ignores masks.*jmem.SyncBN"):
    train.train(parallel.data_parallel(resnet("resnet8", 10)), batches, cfg)
  fns = parallel.data_parallel(jmem.convert(resnet("resnet8", 10), jmem.SyncBN()))
  result = train.train(fns, batches, cfg, eval_data=(digits8.x_test[:64], digits8.y_test[:64]))
  assert int(result.state.step) == 3 and 0.0 <= result.test_accuracy <= 1.0
  assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree.leaves(result.state.params))
