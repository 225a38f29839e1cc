"""`jmem.step` and what it gives: `jmem.rngs`, the error for a converted site without a
key and its opt-in (`jmem.surgery.data_keys`), your own loss (`loss_fn=` of the step, the
loop and `jmem.plan`), and `jmem.train_step`."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jmem
import third_party_models as tp

pytestmark = pytest.mark.slow     # most tests compile a train step or plan

X = jax.random.normal(jax.random.key(0), (4, 8, 8, 3))
CLIPS = jax.random.normal(jax.random.key(1), (2, 4, 8, 8, 3))
KEY = jax.random.key(7)


def _same(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


class _DropoutCNN(nn.Module):
  """Two conv blocks (ActNN's default sites), dropout, a head."""

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.relu(nn.Conv(8, (3, 3), name="block1")(x))
    x = nn.relu(nn.Conv(8, (3, 3), name="block2")(x))
    x = nn.Dropout(0.5, deterministic=not train)(jnp.mean(x, axis=(1, 2)))
    return nn.Dense(10)(x)


def _linen_grads(model, variables, x, **apply_kw):
  loss = lambda p: jnp.sum(model.apply({**variables, "params": p}, x, mutable=True,
                                       **apply_kw)[0] ** 2)
  return jax.grad(loss)(variables["params"])


def test_rngs_in_linen_apply_is_the_explicit_streams():
  model = jmem.convert(_DropoutCNN(), jmem.ActNN("L3", bits=2))
  variables = model.init(jax.random.key(0), X, train=False)
  explicit = {"dropout": KEY, "actnn": jax.random.fold_in(KEY, 0x61),
              "sbp": jax.random.fold_in(KEY, 0x73)}
  rngs = jmem.rngs(KEY)
  assert isinstance(rngs, dict) and set(rngs) == {"dropout", "actnn", "sbp"}
  _same(_linen_grads(model, variables, X, rngs=rngs),
        _linen_grads(model, variables, X, rngs=explicit))
  # A pytree: it crosses jit as the keys it holds.
  jitted = jax.jit(lambda p, r: jax.grad(lambda q: jnp.sum(model.apply(
      {"params": q}, X, rngs=r) ** 2))(p))(variables["params"], rngs)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), jitted,
               _linen_grads(model, variables, X, rngs=explicit))


def test_rngs_as_a_context_for_nnx_is_the_explicit_keys():
  model = jmem.convert(tp.NNXCNN(rngs=nnx.Rngs(0)), jmem.ActNN("L3", bits=2))

  def grads(context):
    def loss(m):
      with context():
        return jnp.sum(m(X) ** 2)
    return nnx.grad(loss)(nnx.clone(model))

  new = grads(lambda: jmem.rngs(KEY))
  _same(new, grads(lambda: jmem.surgery.rngs(actnn=jax.random.fold_in(KEY, 0x61))))
  other = grads(lambda: jmem.rngs(jax.random.key(8)))
  assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(new),
                                                      jax.tree.leaves(other)))


def test_rngs_refuses_what_is_not_a_key():
  with pytest.raises(TypeError, match=r"must be a PRNG key, e\.g\. jax\.random\.key\(0\)"):
    jmem.rngs(0)
  with pytest.raises(TypeError, match="jmem.rngs's actnn must be a PRNG key"):
    jmem.rngs(actnn=jnp.ones(3))
  raw = jmem.rngs(jax.random.PRNGKey(0))           # raw uint32 keys are keys too
  assert set(raw) == {"dropout", "actnn", "sbp"}


def test_a_site_differentiated_without_a_key_names_the_streams():
  """ActNN and SBP sites without a key raise when differentiated, naming every stream the
  model needs and the call that gives them; a forward pass (inference) needs none."""
  model = jmem.convert(tp.ClipClassifier(), jmem.SBP(keep_ratio=0.5, axis=1, where="frames"),
                       jmem.ActNN("L3", bits=2, where="Dense_0"))
  variables = model.init(jax.random.key(0), CLIPS)
  model.apply(variables, CLIPS, mutable=True)                # forward: no key needed
  jax.eval_shape(lambda: model.apply(variables, CLIPS, train=False))
  with pytest.raises(ValueError, match=r"differentiated without a key.*needs the RNG streams "
                                       r"'actnn' and 'sbp'.*rngs=jmem\.rngs\(key\).*with "
                                       r"jmem\.rngs\(key\).*jmem\.surgery\.data_keys\(\)"):
    _linen_grads(model, variables, CLIPS)
  _linen_grads(model, variables, CLIPS, rngs=jmem.rngs(KEY))
  # NNX: the same error, and inference without a key.
  net = jmem.convert(tp.NNXCNN(rngs=nnx.Rngs(0)), jmem.ActNN("L3", bits=2))
  net.eval()
  assert net(X).shape == (4, 10)
  net.train()
  with pytest.raises(ValueError, match=r"the compressing site .* at 'stem' is differentiated "
                                       r"without a key: no 'actnn' RNG stream"):
    nnx.grad(lambda m: jnp.sum(m(X) ** 2))(net)


def test_data_keys_is_the_opt_in_to_keys_from_the_data():
  model = jmem.convert(_DropoutCNN(), jmem.ActNN("L3", bits=2))
  variables = model.init(jax.random.key(0), X, train=False)
  with jmem.surgery.data_keys():
    got = _linen_grads(model, variables, X, train=False)
    again = _linen_grads(model, variables, X, train=False)
    shifted = _linen_grads(model, variables, X + 1.0, train=False)
  _same(got, again)                              # the key is a function of the data
  assert all(np.all(np.isfinite(a)) for a in jax.tree.leaves(got))
  assert jax.tree.structure(shifted) == jax.tree.structure(got)
  with pytest.raises(ValueError, match="without a key"):   # the context is left: it raises
    _linen_grads(model, variables, X, train=False)


# ------------------------------------------------------------------ your own loss

def _l2(out, y):
  return optax.l2_loss(out, y).sum(-1)


class _Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.relu(nn.Conv(16, (3, 3))(x))


class _Regressor(nn.Module):
  """A small CNN with a regression head: three conv blocks, a 2-value output."""

  @nn.compact
  def __call__(self, x, train: bool = True):
    del train
    for i in range(3):
      x = _Block(name=f"block{i}")(x)
    return nn.Dense(2)(jnp.mean(x, axis=(1, 2)))


def _regression_data(n, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, 8, 8, 3)).astype(np.float32)
  y = np.stack([x.mean((1, 2, 3)), x[..., 0].std((1, 2))], -1).astype(np.float32)
  return x, y


def test_plan_with_a_regression_loss_fits_the_budget():
  """A regression head trained on the mean squared error: the plan's compiled step fits a
  budget the exact step does not, and the float targets are taken."""
  x = jax.ShapeDtypeStruct((16, 16, 16, 3), jnp.float32)
  y = jax.ShapeDtypeStruct((16, 2), jnp.float32)
  opt = optax.adam(1e-3)
  plan = jmem.plan(_Regressor(), (x, y), "65%", loss_fn=_l2, optimizer=opt, max_compiles=4,
                   max_batch=False, inplace_abn=False)
  assert plan.fits and plan.device_bytes <= plan.budget_bytes < plan.exact_device_bytes
  assert plan.techniques
  converted = jmem.convert(_Regressor(), *plan.techniques)
  compiled, _ = jmem.planner.step_cost(converted, opt, x, y, loss_fn=_l2)
  assert compiled == plan.device_bytes
  # The default loss still refuses float labels, naming the way out.
  with pytest.raises(ValueError, match=r"integer class labels.*float32.*loss_fn="):
    jmem.plan(_Regressor(), (x, y), "65%")


def test_the_loop_trains_a_regression_with_a_loss_fn():
  x, y = _regression_data(96)
  dataset = jmem.data.Dataset("regression", x[:64], y[:64], x[64:], y[64:], num_classes=0)
  model = jmem.convert(_Regressor(), jmem.ActNN("L3", bits=4))
  cfg = jmem.train.TrainConfig(steps=40, batch_size=32, learning_rate=1e-2, progress=False,
                               eval_every=20)
  first = jmem.train.train(model, dataset, jmem.train.TrainConfig(steps=1, batch_size=32,
                                                                  progress=False), loss_fn=_l2)
  result = jmem.train.train(model, dataset, cfg, loss_fn=_l2)
  assert result.test_accuracy is None and result.test_loss < first.test_loss
  assert [set(h) for h in result.history] == [{"step", "loss", "test_loss"}] * 2
  assert result.history[-1]["loss"] < first.history[-1]["loss"]
  assert result.history[-1]["test_loss"] == result.test_loss


def test_a_loss_fn_must_give_one_loss_per_example():
  fns = jmem.step.model_fns(_Regressor())
  x, y = (jnp.asarray(a) for a in _regression_data(4))
  params, state = fns.init(jax.random.key(0), x)
  loss = lambda f: jmem.step.make_loss(fns, f)(params, state, x, y, KEY)[0]
  np.testing.assert_allclose(loss(_l2), jnp.mean(_l2(fns.apply(params, state, x,
                                                               train=True)[0], y)), rtol=1e-6)
  # The loss the planner's sensitivities are measured on (calibration_batch=) is it too.
  from jmem.ops.actnn import technique  # pylint: disable=g-import-not-at-top
  _, probe_loss, batch = technique.calibration_problem_on(_Regressor(), x, y, loss_fn=_l2)
  np.testing.assert_allclose(probe_loss(_Regressor(), params, batch), loss(_l2), rtol=1e-6)
  with pytest.raises(ValueError, match=r"returned a scalar; it must return one loss per "
                                       r"example \(shape \(4,\)"):
    loss(lambda o, t: optax.l2_loss(o, t).mean())
  with pytest.raises(ValueError, match=r"losses of shape \(2,\), whose leading axis is not the "
                                       r"batch's \(4 examples\)"):
    loss(lambda o, t: optax.l2_loss(o, t).sum(0))
  with pytest.raises(TypeError, match="loss_fn must be a function"):
    jmem.train_step(_Regressor(), optax.sgd(0.1), loss_fn="mse")
  with pytest.raises(ValueError, match=r"integer class labels, but the labels y have dtype "
                                       r"float32.*loss_fn="):
    loss(None)


# ------------------------------------------------------------------ jmem.train_step

def test_train_step_on_a_converted_model_is_the_hand_written_step():
  """`jmem.train_step`: one step of a converted model (ActNN draws keys, dropout too) equals
  a hand-written step with the same keys, compiled with jmem.jit, state donated."""
  model = jmem.convert(_DropoutCNN(), jmem.ActNN("L3", bits=2))
  opt = optax.sgd(0.1)
  y = jnp.arange(4) % 10
  init, step = jmem.train_step(model, opt)
  state = init(jax.random.key(0), X)
  assert state.key is not None and int(state.step) == 0
  params = jax.tree.map(jnp.copy, state.params)
  k_params, k_steps = jax.random.split(jax.random.key(0))
  want_params = model.init(dict(zip(("params", "dropout"), jax.random.split(k_params))),
                           X[:1], train=False)["params"]
  _same(params, want_params)

  def hand(p, x, y, key):
    def loss(p):
      logits = model.apply({"params": p}, x, train=True, rngs=jmem.rngs(key))
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    value, grads = jax.value_and_grad(loss)(p)
    updates, _ = opt.update(grads, opt.init(p), p)
    return optax.apply_updates(p, updates), value

  want, want_loss = jmem.jit(hand)(params, X, y, jax.random.fold_in(k_steps, 0))
  new, metrics = step(state, X, y)
  assert set(metrics) == {"loss", "accuracy"} and int(new.step) == 1
  np.testing.assert_allclose(metrics["loss"], want_loss, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               new.params, want)
  assert all(a.is_deleted() for a in jax.tree.leaves(state.params))     # donated
  # The next step draws other keys: fold_in(key, 1).
  _, again = step(new, X, y)
  assert float(again["loss"]) != float(metrics["loss"])


def test_train_step_with_a_loss_fn_reports_no_accuracy_and_keeps_an_nnx_model():
  model = jmem.convert(tp.NNXCNN(num_classes=2, rngs=nnx.Rngs(0)), jmem.ActNN("L3", bits=4),
                       jmem.SyncBN(axis_name=None))       # its BatchNorms take the mask
  x, y = (jnp.asarray(a) for a in _regression_data(8))
  init, step = jmem.train_step(model, optax.adam(1e-2), loss_fn=_l2)
  state = init(jax.random.key(1), jax.ShapeDtypeStruct(x.shape, x.dtype))
  losses = []
  for _ in range(5):
    state, metrics = step(state, x, y)
    losses.append(float(metrics["loss"]))
  assert set(metrics) == {"loss"} and losses[-1] < losses[0]
  model.eval()                     # the model's own arrays were not donated
  assert model(x).shape == (8, 2)
  _, masked = step(state, x, y, mask=jnp.arange(8) < 6)   # padded rows stay out
  assert np.isfinite(float(masked["loss"]))


def test_the_step_module_does_not_import_the_loop():
  import os  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  code = ("import sys\nimport jmem, jmem.step, jmem.planner, jmem.bench, jmem.parallel, "
          "jmem.models, jmem.measure, jmem.surgery\n"
          "assert callable(jmem.train_step) and callable(jmem.rngs)\n"
          "loaded = [m for m in sys.modules if m == 'jmem.train' or m.startswith('orbax')]\n"
          "assert not loaded, loaded\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=120)
  assert out.returncode == 0, out.stderr


class _DeterministicNet(nn.Module):
  """A model whose mode keyword is Flax's ``deterministic`` (dropout's), not ``train``."""

  @nn.compact
  def __call__(self, x, deterministic: bool):
    x = nn.relu(nn.Conv(8, (3, 3))(x))
    x = nn.Dropout(0.5, deterministic=deterministic)(x)
    return nn.Dense(10)(jnp.mean(x, axis=(1, 2)))


def test_a_model_with_deterministic_is_trained_and_evaluated_in_its_mode():
  """Issue 48, defect 4: ``__call__(x, deterministic)`` models were refused (``Parameter
  "deterministic" must be passed``); they get ``deterministic=not train``."""
  from jmem import step as step_lib  # pylint: disable=g-import-not-at-top
  model = _DeterministicNet()
  assert step_lib.mode_kwargs(model, True) == {"deterministic": False}
  assert step_lib.mode_kwargs(jmem.convert(model, jmem.Remat()), False) == {
      "deterministic": True}
  x, y = jnp.ones((4, 8, 8, 3)), jnp.arange(4) % 10
  init, step = jmem.train_step(jmem.convert(model, jmem.Remat()), optax.sgd(0.1))
  state = init(jax.random.key(0), x)
  fns = step_lib.model_fns(model)
  # Evaluation is deterministic (dropout off): the same output twice, without a key.
  out = [fns.apply(state.params, state.model_state, x, train=False)[0] for _ in range(2)]
  np.testing.assert_array_equal(out[0], out[1])
  state, metrics = step(state, x, y)
  assert bool(jnp.isfinite(metrics["loss"]))


def test_a_loss_fn_on_class_labels_reports_accuracy():
  """Accuracy where it means something: a ``loss_fn`` on integer labels with logits (a
  smoothed cross-entropy, say) reports it in the step's metrics and the loop's results;
  the regression above (float targets) reports none."""
  smoothed = lambda out, y: optax.softmax_cross_entropy(
      out, optax.smooth_labels(jax.nn.one_hot(y, out.shape[-1]), 0.1))
  digits = jmem.data.digits(8)
  init, step = jmem.train_step(tp.FunctionalCNN(), optax.adam(1e-2), loss_fn=smoothed)
  x, y = jnp.asarray(digits.x_train[:16]), jnp.asarray(digits.y_train[:16])
  state = init(jax.random.key(0), x)
  _, metrics = step(state, x, y)
  assert set(metrics) == {"loss", "accuracy"}
  result = jmem.train.train(tp.FunctionalCNN(), digits,
                            jmem.train.TrainConfig(steps=2, batch_size=16, progress=False),
                            loss_fn=smoothed)
  assert set(result.history[-1]) == {"step", "loss", "train_accuracy", "test_loss",
                                     "test_accuracy"}
  assert 0.0 <= result.test_accuracy <= 1.0 and result.test_loss > 0
  assert not jmem.step.class_labels(jnp.zeros((4, 2)), jnp.zeros((4, 2)))    # regression
  assert not jmem.step.class_labels(jnp.zeros((4, 10)), jnp.zeros((4,), jnp.float32))


def test_train_step_keeps_the_saving_that_plain_jax_jit_loses_on_xla_cpu():
  """Issue 48's defect 1: the step `jmem.train_step` compiles (jmem.jit, state donated)
  keeps Remat's saving; the same step function under plain ``jax.jit`` on XLA:CPU gives
  it back (its cse_barrier_expander drops the barriers remat relies on)."""
  x = jax.ShapeDtypeStruct((32, 16, 16, 1), jnp.float32)
  y = jax.ShapeDtypeStruct((32,), jnp.int32)
  opt = optax.sgd(0.1)

  def temps(model):
    _, step = jmem.train_step(model, opt)
    state = jmem.step.abstract_state(jmem.step.model_fns(model), opt, x)
    plain = jax.jit(step.__wrapped__, donate_argnums=0)
    return [f.lower(state, x, y).compile().memory_analysis().temp_size_in_bytes
            for f in (step, plain)]
  exact, _ = temps(jmem.models.create_model("resnet8", 10))
  remat, remat_plain = temps(jmem.convert(jmem.models.create_model("resnet8", 10),
                                          jmem.Remat()))
  assert remat < 0.7 * exact, (remat, exact)
  assert remat_plain > 1.3 * remat, (remat_plain, remat)
