"""Stochastic Backpropagation: exact at r=1, the stop_gradient oracle at r<1, memory ~ r."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util

from jmem import bench, data, measure, models, train
from jmem.models import video
from jmem.ops import sbp as S


def _mlp(p, x):
  return jnp.tanh(x @ p["w"]) * p["b"]


def _setup(seed=0, shape=(3, 16, 5)):
  k = jax.random.split(jax.random.key(seed), 3)
  p = {"w": jax.random.normal(k[0], (5, 4)), "b": jax.random.normal(k[1], (4,))}
  x = jax.random.normal(k[2], shape)
  ct = jax.random.normal(jax.random.key(seed + 1), shape[:-1] + (4,))
  return p, x, ct


def test_keep_ratio_one_is_exact_bit_for_bit():
  p, x, ct = _setup()
  g = S.sbp(_mlp, keep_ratio=1.0, axis=1)
  got = jax.grad(lambda p, x: jnp.sum(g(p, x, jax.random.key(0)) * ct), argnums=(0, 1))(p, x)
  want = jax.grad(lambda p, x: jnp.sum(_mlp(p, x) * ct), argnums=(0, 1))(p, x)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert jnp.array_equal(a, b)


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


def test_stt_gradients_equal_exact_with_dropped_frames_held_constant():
  x, y = _clips()
  model = video.StTVideo(num_classes=40, keep_ratio=0.25, sampler="uniform_chunk",
                         feature_dim=32, temporal_depth=1)
  fns, ref = train.model_fns(model), train.model_fns(model.clone(reference=True))
  params, state = fns.init(jax.random.key(0), x)
  rng = jax.random.key(5)
  grad = lambda f: jax.jit(jax.grad(lambda p: train.make_loss(f)(p, state, x, y, rng)[0]))(
      params)
  got, want = grad(fns), grad(ref)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  exact = grad(train.model_fns(model.clone(keep_ratio=1.0)))
  spatial_diff = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), got["spatial"],
                              exact["spatial"])
  assert max(jax.tree.leaves(spatial_diff)) > 1e-4          # r < 1 really drops frames


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


def test_video_transformer_sbp_blocks():
  x, y = _clips()
  for readout in ("mean", "frames"):
    model = video.VideoTransformer(num_classes=40, keep_ratio=0.5, patch=4, dim=32, depth=3,
                                   heads=2, exact_last=1, readout=readout)
    fns = train.model_fns(model)
    params, state = fns.init(jax.random.key(0), x)
    loss = lambda p, m=model: train.make_loss(train.model_fns(m))(
        p, state, x, y, jax.random.key(1))
    (_, (logits, _)), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    assert all(np.isfinite(np.asarray(v)).all() for v in jax.tree.leaves(g))
    # The SBP forward is the exact forward: same logits as the keep_ratio=1 twin.
    _, (exact_logits, _) = jax.jit(loss, static_argnums=1)(params, model.clone(keep_ratio=1.0))
    np.testing.assert_allclose(logits, exact_logits, rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match="readout must be"):
    model.clone(readout="cls").init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="exact_last must be"):
    model.clone(exact_last=4).init(jax.random.key(0), x)
  with pytest.raises(ValueError, match=r"\[B, T, H, W, C\]"):
    model.init(jax.random.key(0), x[:, 0])
  # One block: the kept-rows backward equals the oracle (dropped rows held constant).
  block = video.TokenBlock(32, 2)
  tokens = jax.random.normal(jax.random.key(2), (2, 64, 32))
  bp = block.init(jax.random.key(3), tokens)["params"]
  f_full = lambda p, v: block.apply({"params": p}, v)
  f_rows = lambda p, v, rows: block.apply({"params": p}, v, rows)
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


@pytest.mark.parametrize("name", ["video-vit", "stt-resnet8"])
def test_video_models_in_bfloat16(name):
  """Mixed precision: float32 parameters and logits, bfloat16 activations (SBP's saved
  block inputs included); the logits within bfloat16's precision of float32's, finite
  gradients under SBP."""
  x, y = _clips()
  model = video.video_model(name, 40, keep_ratio=0.25, **(
      dict(patch=4, dim=32, depth=2, heads=2) if name == "video-vit" else {}))
  half = model.clone(dtype=jnp.bfloat16)
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
  model = video.VideoTransformer(num_classes=10, keep_ratio=0.25, patch=4, dim=32, depth=3,
                                 heads=2, exact_last=0)
  ratio = temp(model) / temp(model.clone(keep_ratio=1.0))
  assert ratio < 0.45, ratio


def test_bench_sbp_techniques_on_video():
  rows = bench.run_bench(bench.BenchConfig(model="stt-resnet8", techniques=("sbp-0.25",),
                                           batch_size=4, image_size=24, num_frames=16,
                                           memory_only=True, budgets_gib=()), quiet=True)
  assert [r["technique"] for r in rows] == ["exact", "sbp-0.25"]
  assert rows[1]["temp_ratio"] < 0.5, rows[1]
  with pytest.raises(ValueError, match="keep_ratio field"):
    bench.get_technique("sbp-0.5").apply(models.create_model("resnet8", 10))


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
    model = video.video_model(name, clips.num_classes, keep_ratio=0.25)
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


@pytest.mark.parametrize("name", ["stt-resnet8", "video-vit"])
def test_video_models_refuse_bad_keep_ratio_at_construction(name):
  """Each of these used to train exact (1.5, NaN) or fail later inside SBP (0)."""
  for r in (1.5, float("nan"), 0.0, -0.25, True):
    with pytest.raises(ValueError, match=r"keep_ratio must be in \(0, 1\]"):
      models.create_model(name, 10, keep_ratio=r)
  model = models.create_model(name, 10, keep_ratio=0.5)
  with pytest.raises(ValueError, match=r"keep_ratio must be in \(0, 1\]"):
    model.clone(keep_ratio=2.0)
