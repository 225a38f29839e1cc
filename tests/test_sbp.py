"""Stochastic Backpropagation: exact at r=1, the stop_gradient oracle at r<1, memory ~ r."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util

import flax.linen
import jmem
from jmem import bench, data, measure, models, train
from jmem.models import video
from jmem.ops import sbp as S
from jmem.ops.sbp import core as sbp_core


def _mlp(p, x):
  return jnp.tanh(x @ p["w"]) * p["b"]


def _setup(seed=0, shape=(3, 16, 5)):
  k = jax.random.split(jax.random.key(seed), 3)
  p = {"w": jax.random.normal(k[0], (5, 4)), "b": jax.random.normal(k[1], (4,))}
  x = jax.random.normal(k[2], shape)
  ct = jax.random.normal(jax.random.key(seed + 1), shape[:-1] + (4,))
  return p, x, ct


@pytest.mark.slow
def test_keep_ratio_one_is_exact_bit_for_bit():
  p, x, ct = _setup()
  g = S.sbp(_mlp, keep_ratio=1.0, axis=1)
  got = jax.grad(lambda p, x: jnp.sum(g(p, x, jax.random.key(0)) * ct), argnums=(0, 1))(p, x)
  want = jax.grad(lambda p, x: jnp.sum(_mlp(p, x) * ct), argnums=(0, 1))(p, x)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert jnp.array_equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("sampler", list(S.SAMPLERS))
@pytest.mark.parametrize("keep_ratio", [0.5, 0.25, 0.3])
def test_gradients_equal_stop_gradient_oracle(sampler, keep_ratio):
  p, x, ct = _setup()
  key = jax.random.key(7)
  loss = lambda t: (lambda p, x: jnp.sum(t(_mlp, keep_ratio=keep_ratio, axis=1,
                                            sampler=sampler)(p, x, key) * ct))
  y = S.sbp(_mlp, keep_ratio=keep_ratio, axis=1, sampler=sampler)(p, x, key)
  np.testing.assert_array_equal(y, _mlp(p, x))                 # forward on every node
  got = jax.jit(jax.grad(loss(S.sbp), argnums=(0, 1)))(p, x)
  want = jax.grad(loss(S.sbp_reference), argnums=(0, 1))(p, x)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  kept = S.sample_indices(key, x, keep_ratio=keep_ratio, axis=1, sampler=sampler)
  dropped = np.setdiff1d(np.arange(16), np.asarray(kept))
  assert len(kept) == int(np.ceil(keep_ratio * 16)) and len(dropped) > 0
  assert np.all(np.asarray(got[1])[:, dropped] == 0)          # no gradient to dropped nodes


@pytest.mark.slow
def test_composes_with_vmap_and_scan_and_saves_only_the_kept_slice():
  p, x, ct = _setup(shape=(2, 3, 16, 5))
  g = S.sbp(_mlp, keep_ratio=0.25, axis=1)
  keys = jax.random.split(jax.random.key(1), 2)
  vm = lambda p, x: jnp.sum(jax.vmap(g, in_axes=(None, 0, 0))(p, x, keys) * ct)
  ref = lambda p, x: jnp.sum(jax.vmap(S.sbp_reference(_mlp, keep_ratio=0.25, axis=1),
                                      in_axes=(None, 0, 0))(p, x, keys) * ct)
  for a, b in zip(jax.tree.leaves(jax.grad(vm)(p, x)), jax.tree.leaves(jax.grad(ref)(p, x))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)

  def scanned(p, x):
    def body(c, xs):
      return c + jnp.sum(g(p, xs[0], xs[1])), None
    return jax.lax.scan(body, 0.0, (x, keys))[0]
  assert np.isfinite(np.asarray(jax.grad(scanned)(p, x)["w"])).all()
  # Saved for backward: the kept quarter of x (4 of 16 nodes), no tanh output.
  x1 = x[0]
  report = measure.saved_residuals(lambda p, x: jnp.sum(g(p, x, keys[0])), p, x1)
  assert report.activation_bytes <= x1.nbytes // 4 + 64, report.activation_bytes


@pytest.mark.slow
def test_samplers_are_deterministic_sorted_and_spread():
  x = jnp.zeros((1, 64, 3))
  key = jax.random.key(0)
  for name in S.SAMPLERS:
    a = S.sample_indices(key, x, keep_ratio=0.25, axis=1, sampler=name)
    b = S.sample_indices(key, x, keep_ratio=0.25, axis=1, sampler=name)
    assert jnp.array_equal(a, b) and a.shape == (16,) and a.dtype == jnp.int32
    assert np.all(np.diff(np.asarray(a)) > 0)
  chunk = np.asarray(S.sample_indices(key, x, keep_ratio=0.25, axis=1))
  assert np.array_equal(chunk // 4, np.arange(16))                  # one per chunk of 4
  strided = np.asarray(S.sample_indices(key, x, keep_ratio=0.25, axis=1, sampler="strided"))
  assert np.array_equal(strided, np.arange(16) * 4 + 2)             # chunk centres
  # Uniform within a chunk over many keys.
  picks = np.stack([S.sample_indices(jax.random.key(i), x, keep_ratio=0.25, axis=1)[0]
                    for i in range(400)])
  assert set(np.unique(picks)) == {0, 1, 2, 3}
  assert np.all(np.abs(np.bincount(picks, minlength=4) / 400 - 0.25) < 0.08)
  # Diverse feature: the order of magnitudes, one per chunk.
  xf = jnp.arange(64.0)[None, ::-1, None]
  div = np.asarray(S.sample_indices(key, xf, keep_ratio=0.25, axis=1, sampler="diverse_feature"))
  assert np.array_equal(np.sort(63 - div) // 4, np.arange(16))
  # Checkerboard: half of a (4, 4, 4) grid, no two kept neighbours along t, h or w.
  cb = S.sample_indices(key, x, keep_ratio=0.5, axis=1, sampler=S.checkerboard((4, 4, 4)))
  grid = np.zeros(64, bool)
  grid[np.asarray(cb)] = True
  grid = grid.reshape(4, 4, 4)
  assert grid.sum() == 32 and not np.any(grid[1:] & grid[:-1]) and not np.any(
      grid[:, :, 1:] & grid[:, :, :-1])


def test_bad_input_errors():
  p, x, _ = _setup()
  key = jax.random.key(0)
  for r in (0.0, -0.5, 1.5, float("nan"), float("inf"), True, "0.5"):
    with pytest.raises(ValueError, match=r"keep_ratio must be in \(0, 1\]"):
      S.sbp(_mlp, keep_ratio=r)
  S.sbp(_mlp, keep_ratio=np.float32(0.5))          # a NumPy scalar is a ratio
  with pytest.raises(ValueError, match="out of range"):
    S.sbp(_mlp, keep_ratio=0.5, axis=5)(p, x, key)
  with pytest.raises(ValueError, match="zero nodes"):
    S.sbp(_mlp, keep_ratio=0.5, axis=1)(p, jnp.zeros((3, 0, 5)), key)
  with pytest.raises(ValueError, match="Unknown sampler"):
    S.sbp(_mlp, keep_ratio=0.5, sampler="every-other")
  with pytest.raises(ValueError, match="grid"):
    S.sample_indices(key, x, keep_ratio=0.5, axis=1, sampler=S.checkerboard((2, 2, 2)))
  with pytest.raises(ValueError, match="1/m"):
    S.sample_indices(key, jnp.zeros((1, 27, 2)), keep_ratio=0.5, axis=1,
                     sampler=S.checkerboard((3, 3, 3)))


@functools.lru_cache(maxsize=None)
def _clips():
  rng = np.random.default_rng(0)
  return (jnp.asarray(rng.normal(size=(2, 8, 16, 16, 1)), jnp.float32),
          jnp.asarray([3, 17], jnp.int32))


def _sbp(model, keep_ratio, **kw):
  """``model`` with SBP on its own sites, as the bench's ``sbp-<r>`` builds it."""
  return jmem.convert(model, jmem.SBP(keep_ratio=keep_ratio, where=model.sbp_sites,
                                      mode=model.sbp_mode, **kw))


def _oracle_grads(model, sites, keep_ratio, params, x, y, key):
  """Plain autodiff of ``model`` with the outputs of the dropped nodes of every module
  whose path is in ``sites`` held constant (``stop_gradient``); one draw of kept nodes,
  made as jmem.convert makes it (the first site's ``make_rng("sbp")``), shared by all."""
  drawn = {}

  def hold(next_fun, args, kwargs, context):
    mod = context.module
    path = "/".join(mod.scope.path) if mod.scope is not None else ""
    if context.method_name != "__call__" or path not in sites or mod.is_initializing():
      return next_fun(*args, **kwargs)
    if "idx" not in drawn:
      drawn["idx"] = S.sample_indices(mod.make_rng("sbp"), args[0], keep_ratio=keep_ratio,
                                      axis=1)
    return sbp_core._hold_dropped(next_fun(*args, **kwargs), drawn["idx"], 1)  # pylint: disable=protected-access

  def loss(p):
    logits = model.apply({"params": p}, x, rngs={"sbp": key})
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))
  with flax.linen.intercept_methods(hold):      # traced (and held) inside: one compile
    return jax.jit(jax.grad(loss))(params)


def _grads(model, params, x, y, key):
  def loss(p):
    logits = model.apply({"params": p}, x, rngs={"sbp": key})
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))
  return jax.jit(jax.grad(loss))(params)


@pytest.mark.slow
def test_stt_sbp_through_convert_equals_the_stop_gradient_oracle():
  """The StT model's SBP (its per-frame CNN as the site, nodes mode): gradients equal
  plain autodiff with the dropped frames' features held constant, and differ from exact."""
  x, y = _clips()
  model = video.StTVideo(num_classes=40, feature_dim=32, temporal_depth=1)
  params = jax.jit(model.init)(jax.random.key(0), x)["params"]
  key = jax.random.key(5)
  got = _grads(_sbp(model, 0.25), params, x, y, key)
  want = _oracle_grads(model, {"spatial"}, 0.25, params, x, y, key)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  exact = _grads(model, params, x, y, key)
  spatial_diff = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), got["spatial"],
                              exact["spatial"])
  assert max(jax.tree.leaves(spatial_diff)) > 1e-4          # r < 1 really drops frames


@pytest.mark.slow
def test_stt_spatial_memory_falls_with_keep_ratio():
  """The per-frame CNN under SBP: saved bytes <= (r + 0.03) of exact; temp falls with r.

  Temp keeps a floor: the forward still runs every frame, so the largest layer output of
  ALL frames is live once (here ~0.1 of exact's temp) whatever r is.
  """
  x = jnp.zeros((4, 16, 24, 24, 1))
  cnn = models.resnet("resnet8", 32, norm=video.group_norm)
  params = cnn.init(jax.random.key(0), x[:1, 0])["params"]

  def per_frame(p, clips):
    feats = cnn.apply({"params": p}, clips.reshape((-1,) + clips.shape[2:]))
    return feats.reshape(clips.shape[:2] + feats.shape[1:])

  def measure_both(f):
    loss = lambda p, x: jnp.sum(f(p, x) ** 2)
    temp = measure.compiled_memory(measure.jit(jax.grad(loss)), params, x).temp_bytes
    return measure.saved_residuals(loss, params, x).activation_bytes, temp
  saved_exact, temp_exact = measure_both(per_frame)
  last = 1.0
  for r in (0.5, 0.25, 0.125):
    g = S.sbp(per_frame, keep_ratio=r, axis=1)
    saved, temp = measure_both(lambda p, x: g(p, x, jax.random.key(0)))
    assert saved / saved_exact <= r + 0.03, (r, saved / saved_exact)
    assert temp / temp_exact <= r + 0.11 and temp / temp_exact < last, (r, temp / temp_exact)
    last = temp / temp_exact


@pytest.mark.slow
def test_video_transformer_sbp_blocks():
  """The ViT's SBP (its blocks but the last, rows mode, one draw shared): the forward is
  the exact forward, the gradients equal the oracle with the dropped tokens' block outputs
  held constant."""
  x, y = _clips()
  key = jax.random.key(1)
  for readout in ("mean", "frames"):
    model = video.VideoTransformer(num_classes=40, patch=4, dim=32, depth=3, heads=2,
                                   exact_last=1, readout=readout)
    assert model.sbp_sites == ("block0", "block1")
    params = model.init(jax.random.key(0), x)["params"]
    converted = _sbp(model, 0.5)
    np.testing.assert_allclose(converted.apply({"params": params}, x, rngs={"sbp": key}),
                               model.apply({"params": params}, x), rtol=1e-6, atol=1e-6)
    got = _grads(converted, params, x, y, key)
    want = _oracle_grads(model, set(model.sbp_sites), 0.5, params, x, y, key)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)
  with pytest.raises(ValueError, match="readout must be"):
    model.clone(readout="cls").init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="exact_last must be"):
    model.clone(exact_last=4).init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="exact_last must be"):
    model.clone(exact_last=4).sbp_sites  # pylint: disable=expression-not-assigned
  with pytest.raises(ValueError, match=r"\[B, T, H, W, C\]"):
    model.init(jax.random.key(0), x[:, 0])


@pytest.mark.slow
def test_sbp_rows_backward_equals_the_oracle():
  """`sbp_rows` on an attention block: the kept-rows backward equals the oracle (dropped
  rows held constant), the forward is exact, and only the block input is kept."""
  def f_full(p, v):
    return f_rows(p, v, None)

  def f_rows(p, v, rows):
    q_in = v if rows is None else jnp.take(v, rows, 1)
    att = jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", q_in @ p["q"], v @ p["k"]) / 4.0, -1)
    return q_in + jnp.tanh(jnp.einsum("bqk,bkd->bqd", att, v @ p["v"]))

  k = jax.random.split(jax.random.key(3), 3)
  bp = {n: 0.3 * jax.random.normal(kk, (16, 16)) for n, kk in zip("qkv", k)}
  tokens = jax.random.normal(jax.random.key(2), (2, 64, 16))
  idx = S.sample_indices(jax.random.key(4), tokens, keep_ratio=0.25, axis=1)
  ct = jax.random.normal(jax.random.key(5), tokens.shape)
  got = jax.jit(jax.grad(lambda p, v: jnp.sum(S.sbp_rows(f_full, f_rows, p, v, idx) * ct),
                         argnums=(0, 1)))(bp, tokens)
  want = jax.jit(jax.grad(lambda p, v: jnp.sum(S.sbp_rows_reference(f_full, p, v, idx) * ct),
                          argnums=(0, 1)))(bp, tokens)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(S.sbp_rows(f_full, f_rows, bp, tokens, idx),
                                f_full(bp, tokens))
  saved = measure.saved_residuals(
      lambda p, v: jnp.sum(S.sbp_rows(f_full, f_rows, p, v, idx)), bp, tokens)
  assert saved.activation_bytes == 0          # only the block input (an argument) is kept


@pytest.mark.slow
@pytest.mark.parametrize("name", ["video-vit", "stt-resnet8"])
def test_video_models_in_bfloat16(name):
  """Mixed precision: float32 parameters and logits, bfloat16 activations (SBP's saved
  block inputs included); the logits within bfloat16's precision of float32's, finite
  gradients under SBP."""
  x, y = _clips()
  plain = video.video_model(name, 40, **(
      dict(patch=4, dim=32, depth=2, heads=2) if name == "video-vit" else {}))
  model, half = _sbp(plain, 0.25), _sbp(plain.clone(dtype=jnp.bfloat16), 0.25)
  fns, half_fns = train.model_fns(model), train.model_fns(half)
  params, state = fns.init(jax.random.key(0), x)
  assert all(v.dtype == jnp.float32 for v in jax.tree.leaves(params))
  logits = lambda f: train.make_loss(f)(params, state, x, y, jax.random.key(1))[1][0]
  want, got = logits(fns), logits(half_fns)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, want, atol=0.1 * float(jnp.max(jnp.abs(want))) + 0.05)
  loss = lambda p: train.make_loss(half_fns)(p, state, x, y, jax.random.key(1))[0]
  grads = jax.jit(jax.grad(loss))(params)
  assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
  saved = measure.saved_residuals(loss, params)
  assert saved.by_dtype().get("bfloat16", 0) > saved.by_dtype().get("float32", 0)


@pytest.mark.slow
def test_video_transformer_sbp_recomputes_in_the_backward():
  """Each SBP block's kept-rows re-run waits for its cotangent. Scheduled early (as XLA
  did before the re-run was tied to the cotangent) every block's re-run attention is live
  at once: temp 0.60x exact here, against 0.36x."""
  def temp(model):
    fns = train.model_fns(model)
    x = jax.ShapeDtypeStruct((4, 8, 16, 16, 1), jnp.float32)
    y = jax.ShapeDtypeStruct((4,), jnp.int32)
    params, state = jax.eval_shape(lambda x: fns.init(jax.random.key(0), x), x)
    loss = train.make_loss(fns)
    step = jax.grad(lambda p, s, x, y: loss(p, s, x, y, jax.random.key(3))[0])
    return measure.compiled_memory(measure.jit(step), params, state, x, y).temp_bytes
  model = video.VideoTransformer(num_classes=10, patch=4, dim=32, depth=3, heads=2,
                                 exact_last=0)
  ratio = temp(_sbp(model, 0.25)) / temp(model)
  assert ratio < 0.45, ratio


@pytest.mark.slow
def test_bench_sbp_techniques_on_video():
  rows = bench.run_bench(bench.BenchConfig(model="stt-resnet8", techniques=("sbp-0.25",),
                                           batch_size=4, image_size=24, num_frames=16,
                                           memory_only=True, budgets_gib=()), quiet=True)
  assert [r["technique"] for r in rows] == ["exact", "sbp-0.25"]
  assert rows[1]["temp_ratio"] < 0.5, rows[1]
  with pytest.raises(ValueError, match="'sbp-0.5' needs the model's SBP sites"):
    bench.build_model("sbp-0.5", models.create_model("resnet8", 10), data.digits(8), 4)


def test_spatial_lr_scale():
  params = {"spatial": {"w": jnp.ones(2)}, "head": {"w": jnp.ones(2)}}
  opt = video.spatial_lr_scale(optax.sgd(1.0), 0.1)
  upd, _ = opt.update(jax.tree.map(jnp.ones_like, params), opt.init(params), params)
  np.testing.assert_allclose(upd["spatial"]["w"], -0.1)
  np.testing.assert_allclose(upd["head"]["w"], -1.0)
  params["embed"] = {"w": jnp.ones(2)}
  opt = video.spatial_lr_scale(optax.sgd(1.0), 0.1, ("spatial", "embed"))
  upd, _ = opt.update(jax.tree.map(jnp.ones_like, params), opt.init(params), params)
  np.testing.assert_allclose(upd["embed"]["w"], -0.1)
  np.testing.assert_allclose(upd["head"]["w"], -1.0)
  with pytest.raises(ValueError, match="no top-level parameters named"):
    video.spatial_lr_scale(optax.sgd(1.0), 0.1, "spatail").init(params)


@pytest.mark.slow
def test_pretrained_backbone_starts_the_video_model():
  clips = data.moving_digits(8, frame_size=16, digit_size=5, num_train=32, num_test=16)
  frames = data.Dataset("f", clips.x_train[:, 0], clips.y_train // 4, clips.x_test[:, 0],
                        clips.y_test // 4, 10)
  cfg = train.TrainConfig(steps=2, batch_size=16, progress=False)
  # The initial state only: stop before the first step (no step or evaluation compiled).
  start = train.TrainConfig(steps=1, batch_size=16, progress=False)
  for name, transferred in (("stt-resnet8", {"spatial"}),
                            ("video-vit", {"patch_embed", "pos_embed", "block0", "block1",
                                           "block2", "block3", "norm"})):
    model = video.video_model(name, clips.num_classes)
    pre, acc = video.pretrain_backbone(model, frames, cfg)
    assert set(pre) == transferred, (name, set(pre))
    assert 0.0 <= acc <= 1.0
    fresh = train.train(model, clips, start, stop_after=0).state.params
    result = train.train(model, clips, start, initial_params=pre, stop_after=0)
    flat_pre = traverse_util.flatten_dict(pre)
    flat_got = traverse_util.flatten_dict(result.state.params)
    flat_fresh = traverse_util.flatten_dict(fresh)
    for path, value in flat_got.items():   # pretrained where given, fresh elsewhere
      np.testing.assert_array_equal(value, flat_pre.get(path, flat_fresh[path]))
  with pytest.raises(ValueError, match="which the model's parameters do not"):
    train.train(model, clips, cfg, initial_params={"spatail": pre["norm"]})
  with pytest.raises(ValueError, match="has shape"):
    train.train(model, clips, cfg, initial_params={"head": {"kernel": jnp.zeros((3, 3))}})
  with pytest.raises(ValueError, match="single frames"):
    video.pretrain_backbone(model, clips, cfg)
  with pytest.raises(TypeError, match="supports StTVideo and VideoTransformer"):
    video.pretrain_backbone(models.create_model("resnet8", 10), frames, cfg)


def test_sbp_refuses_a_bad_keep_ratio_at_construction():
  """Each of these used to train exact (1.5, NaN) or fail later inside SBP (0)."""
  for r in (1.5, float("nan"), 0.0, -0.25, True):
    with pytest.raises(ValueError, match=r"keep_ratio must be in \(0, 1\]"):
      jmem.SBP(keep_ratio=r, where="spatial")
    with pytest.raises(ValueError, match=r"keep_ratio must be in \(0, 1\]"):
      jmem.technique("sbp-0.5", keep_ratio=r)
