"""The training loop: linen and NNX, state threading, exact resume from orbax checkpoints."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jmem import data, train
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


def test_linen_resnet_learns_digits(digits8):
  cfg = train.TrainConfig(steps=120, batch_size=64, progress=False, eval_every=60)
  result = train.train(resnet("resnet8", 10), digits8, cfg)
  assert result.test_accuracy > 0.9
  assert [h["step"] for h in result.history] == [60, 120]
  # BatchNorm statistics were threaded through the steps.
  stats = result.state.model_state["batch_stats"]["stem"]["bn"]["mean"]
  assert float(jnp.abs(stats).sum()) > 0


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
