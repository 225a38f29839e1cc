"""`jmem.SBP` through `jmem.convert` on models jmem did not write (third_party_models.py).

The oracle is plain autodiff of the unconverted model with the dropped nodes' outputs under
``stop_gradient`` and, for BatchNorm in training mode inside a site, the batch statistics
under ``stop_gradient`` too: SBP's gradients must equal it to 1e-5, the dropped nodes must
get no input gradient, the forward and the BatchNorm running statistics must equal the
plain model's, and the variable tree must not change.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jmem
import third_party_models as tp
from helpers import assert_trees_close as assert_close
from jmem import _context
from jmem.ops import sbp as S
from jmem.ops.sbp import core as sbp_core

CLIPS = jax.random.normal(jax.random.key(0), (2, 8, 8, 8, 3))
Y = jnp.array([1, 3])
KEY = jax.random.key(5)


def xent(logits):
  return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), Y[:, None], 1))


def _stop_grad_bn(x, scale, bias, epsilon):
  axes = tuple(range(x.ndim - 1))
  mean = jax.lax.stop_gradient(jnp.mean(x, axes))
  var = jax.lax.stop_gradient(jnp.mean(jnp.square(x - mean), axes))
  return (x - mean) * jax.lax.rsqrt(var + epsilon) * scale + bias


def linen_grads(model, variables, x, reference=None):
  """``(loss, (d_params, d_x), new_batch_stats)``; ``reference`` (the site class and the
  keep ratio) gives the oracle on the unconverted ``model``."""
  state = {k: v for k, v in variables.items() if k != "params"}
  drawn = {}

  def oracle(next_fun, args, kwargs, context):
    mod = context.module
    if context.method_name != "__call__":
      return next_fun(*args, **kwargs)
    if isinstance(mod, nn.BatchNorm) and not mod.is_initializing():
      return _stop_grad_bn(args[0], mod.get_variable("params", "scale"),
                           mod.get_variable("params", "bias"), mod.epsilon)
    site, keep_ratio = reference
    if isinstance(mod, site):
      if "key" not in drawn:                 # one draw per step, shared by the sites
        drawn["key"] = mod.make_rng("sbp")
      idx = S.sample_indices(drawn["key"], args[0], keep_ratio=keep_ratio, axis=1)
      drawn.setdefault("idx", idx)
      return sbp_core._hold_dropped(next_fun(*args, **kwargs), idx, 1)  # pylint: disable=protected-access
    return next_fun(*args, **kwargs)

  def f(params, x):
    out, upd = model.apply({"params": params, **state}, x, mutable=list(state),
                           rngs={"sbp": KEY})
    return xent(out), upd

  if reference is not None:
    with nn.intercept_methods(oracle):
      (loss, upd), grads = jax.value_and_grad(f, (0, 1), has_aux=True)(variables["params"], x)
    return loss, grads, upd, drawn["idx"]
  (loss, upd), grads = jax.jit(jax.value_and_grad(f, (0, 1), has_aux=True))(
      variables["params"], x)
  return loss, grads, upd


@pytest.mark.slow
@pytest.mark.parametrize("model_cls,site,keep_ratio", [
    (tp.ClipClassifier, tp.FrameEncoder, 0.25),        # per-node: BatchNorm couples frames
    (tp.FrameTokenViT, tp.ViTBlock, 0.5),              # tokens mixed by attention: rows
])
def test_linen_sbp_matches_the_stop_gradient_oracle(model_cls, site, keep_ratio):
  model = model_cls()
  variables = model.init(jax.random.key(1), CLIPS)
  converted = jmem.convert(model, jmem.SBP(keep_ratio=keep_ratio, axis=1, where=site))
  loss, (dp, dx), upd = jax.jit(lambda v, x: linen_grads(converted, v, x))(variables, CLIPS)
  ref_loss, (rp, rx), ref_upd, idx = linen_grads(model, variables, CLIPS, (site, keep_ratio))
  plain_loss, _, plain_upd = linen_grads(model, variables, CLIPS)
  np.testing.assert_allclose(loss, plain_loss, rtol=1e-6)
  np.testing.assert_allclose(ref_loss, plain_loss, rtol=1e-6)
  assert_close(dp, rp)
  assert_close(dx, rx)
  assert_close(upd, plain_upd, tol=1e-6)            # running statistics from every node
  assert jax.tree.structure(converted.init(jax.random.key(1), CLIPS)) == \
      jax.tree.structure(variables)
  if site is tp.FrameEncoder:                        # dropped frames get no gradient
    per_frame = np.asarray(jnp.abs(dx).sum(axis=(0, 2, 3, 4)))
    assert set(np.flatnonzero(per_frame)) == set(np.asarray(idx).tolist())
    assert len(idx) == 2


@pytest.mark.slow
def test_linen_sbp_saves_memory_and_compute():
  """Compile-only, whole step: temp bytes and FLOPs fall with the keep ratio."""
  model = tp.ClipClassifier()
  clips = jnp.zeros((2, 16, 32, 32, 3))
  variables = model.init(jax.random.key(1), clips[:1])

  def compiled(m):
    c = jax.jit(lambda v, x: linen_grads(m, v, x)[1]).lower(variables, clips).compile()
    cost = c.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return c.memory_analysis().temp_size_in_bytes, cost["flops"]

  exact = compiled(model)
  quarter = compiled(jmem.convert(model, jmem.SBP(keep_ratio=0.25, where=tp.FrameEncoder)))
  # The backward of the frame CNN runs on a quarter of the frames: 1 + 3/4 of its 3 units.
  assert quarter[0] < 0.6 * exact[0], (quarter, exact)
  assert quarter[1] < 0.7 * exact[1], (quarter, exact)


def _nnx_oracle(model, site_cls, keep_ratio):
  """The unconverted NNX ``model`` turned into the oracle, in place (test code: classes of
  the test's own)."""
  with _context.rngs(sbp=KEY):
    key = _context.context_key("sbp", "")

  class HeldSite(site_cls):
    def __call__(self, x):
      idx = S.sample_indices(key, x, keep_ratio=keep_ratio, axis=1)
      return sbp_core._hold_dropped(site_cls.__call__(self, x), idx, 1)  # pylint: disable=protected-access

  class StopGradBN(nnx.BatchNorm):
    def __call__(self, x):
      return _stop_grad_bn(x, self.scale[...], self.bias[...], self.epsilon)

  for _, m in nnx.iter_graph(model):
    if isinstance(m, site_cls):
      m.__class__ = HeldSite
    elif type(m) is nnx.BatchNorm:
      m.__class__ = StopGradBN
  return model


@pytest.mark.slow
@pytest.mark.parametrize("make,site,keep_ratio", [
    (lambda: tp.NNXClipClassifier(frames=8, rngs=nnx.Rngs(0)), tp.NNXFrameEncoder, 0.25),
    (lambda: tp.NNXFrameTokenViT(rngs=nnx.Rngs(0)), tp.NNXViTBlock, 0.5),
])
def test_nnx_sbp_matches_the_stop_gradient_oracle(make, site, keep_ratio):
  def grads(model):
    def f(m, x):
      with jmem.surgery.rngs(sbp=KEY):
        return xent(m(x))
    return nnx.value_and_grad(f, argnums=(0, 1))(model, CLIPS)

  plain, converted = make(), make()
  before = nnx.state(converted)
  jmem.convert(converted, jmem.SBP(keep_ratio=keep_ratio, where=site))
  assert jax.tree.structure(nnx.state(converted)) == jax.tree.structure(before)
  loss, (dp, dx) = grads(converted)
  oracle = _nnx_oracle(make(), site, keep_ratio)
  ref_loss, (rp, rx) = grads(oracle)
  plain_loss, _ = grads(plain)
  np.testing.assert_allclose(loss, plain_loss, rtol=1e-6)
  np.testing.assert_allclose(ref_loss, plain_loss, rtol=1e-6)
  assert_close(nnx.state(dp, nnx.Param), nnx.state(rp, nnx.Param))
  assert_close(dx, rx)
  assert_close(nnx.state(converted, nnx.BatchStat), nnx.state(plain, nnx.BatchStat), tol=1e-6)


class _JointBlock(nn.Module):
  """A space-time block over ``[B, T, N, D]``: attention over the tokens of every frame at
  once (mixes the frames, the SBP nodes, in a layout jmem must not take for per-node)."""

  @nn.compact
  def __call__(self, x):
    b, t, n, d = x.shape
    h = nn.MultiHeadDotProductAttention(num_heads=2)(nn.LayerNorm()(x).reshape(b, t * n, d))
    return x + nn.Dense(d)(h.reshape(b, t, n, d))


class _JointModel(nn.Module):
  @nn.compact
  def __call__(self, clips, train=True):
    b, t = clips.shape[:2]
    x = nn.Dense(8)(clips.reshape(b, t, 4, -1))
    x = _JointBlock(name="joint")(x)
    return nn.Dense(10)(x.reshape(b, -1))


@pytest.mark.slow
def test_linen_sbp_joint_attention_is_rows():
  model = _JointModel()
  variables = model.init(jax.random.key(1), CLIPS)
  converted = jmem.convert(model, jmem.SBP(keep_ratio=0.25, axis=1, where=_JointBlock))
  _, (dp, dx), _ = linen_grads(converted, variables, CLIPS)
  _, (rp, rx), _, _ = linen_grads(model, variables, CLIPS, (_JointBlock, 0.25))
  assert_close(dp, rp)
  assert_close(dx, rx)


class _Pooling(nn.Module):
  @nn.compact
  def __call__(self, clips):
    return nn.Dense(4)(clips.reshape(clips.shape[:2] + (-1,))).mean(axis=1)


class _CustomBN(nn.BatchNorm):
  @nn.compact
  def __call__(self, x, use_running_average=None):
    return super().__call__(x, use_running_average)


class _EncoderWithCustomBN(nn.Module):
  @nn.compact
  def __call__(self, clips):
    x = nn.Conv(4, (3, 3))(clips.reshape((-1,) + clips.shape[2:]))
    x = _CustomBN(use_running_average=False)(x)
    return x.mean(axis=(1, 2)).reshape(clips.shape[:2] + (-1,))


class _EncoderWithDropout(nn.Module):
  @nn.compact
  def __call__(self, clips):
    x = nn.Dense(4)(clips.reshape(clips.shape[:2] + (-1,)))
    return nn.Dropout(0.5, deterministic=False)(x)


@pytest.mark.slow
def test_sbp_refuses_what_it_cannot_do_exactly():
  x = CLIPS
  with pytest.raises(ValueError, match="needs where="):
    jmem.convert(tp.ClipClassifier(), jmem.SBP(keep_ratio=0.5))
  with pytest.raises(ValueError, match="needs where="):
    jmem.convert(tp.ClipClassifier(), "sbp-0.25")
  assert jmem.technique("sbp-0.25", where=tp.FrameEncoder) == \
      jmem.SBP(keep_ratio=0.25, where=tp.FrameEncoder)
  with pytest.raises(ValueError, match="keep_ratio"):
    jmem.SBP(keep_ratio=1.5, where=tp.FrameEncoder)
  with pytest.raises(ValueError, match="mode"):
    jmem.SBP(mode="tokens", where=tp.FrameEncoder)

  def run(model, *techniques):
    converted = jmem.convert(model, *techniques)
    v = model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)
    f = lambda p: jnp.sum(converted.apply({**v, "params": p}, x, mutable=True, rngs={
        "sbp": KEY, "dropout": KEY})[0])
    return jax.grad(f)(v["params"])

  with pytest.raises(ValueError, match=r"frames.*SBP.*not implemented"):
    run(tp.ClipClassifier(), jmem.SBP(where=tp.FrameEncoder), jmem.Remat(where="frames"))
  with pytest.raises(ValueError, match=r"_CustomBN.*'_EncoderWithCustomBN_0/_CustomBN_0'"):
    run(_Wrap(_EncoderWithCustomBN), jmem.SBP(where=_EncoderWithCustomBN))
  with pytest.raises(ValueError, match=r"Dropout at '_EncoderWithDropout_0/Dropout_0'"):
    run(_Wrap(_EncoderWithDropout), jmem.SBP(where=_EncoderWithDropout))
  run(_Wrap(_EncoderWithDropout), jmem.SBP(where=_EncoderWithDropout, mode="rows"))
  for mode in (None, "rows"):
    with pytest.raises(ValueError, match=r"'_Pooling_0' returns an output of shape \(2, 4\)"):
      run(_Wrap(_Pooling), jmem.SBP(where=_Pooling, mode=mode))
  with pytest.raises(ValueError, match=r"mode='nodes'.*attention at 'block0/"):
    run(tp.FrameTokenViT(), jmem.SBP(where=tp.ViTBlock, mode="nodes"))
  with pytest.raises(ValueError, match=r"(?s)re-running the site '_FixedFrames_0' on its 4 kept "
                                       r"of 8 nodes.*mode='rows'"):
    run(_Wrap(_FixedFrames), jmem.SBP(where=_FixedFrames))
  run(_Wrap(_FixedFrames), jmem.SBP(where=_FixedFrames, mode="rows"))


class _FixedFrames(nn.Module):
  """Hard-codes the clip length (8 frames): it cannot run on the kept frames alone."""

  @nn.compact
  def __call__(self, clips):
    return nn.Dense(4)(clips.reshape(clips.shape[0], 8, -1))   # Dense: 192 inputs


@pytest.mark.slow
def test_sbp_under_shard_map_over_the_batch():
  """A converted model inside ``jax.shard_map`` with the batch split over 2 devices: the
  gradients summed over the devices equal the unsharded SBP step's (the key is replicated, so every device
  keeps the same frames)."""
  mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:2])
  model = jmem.convert(tp.FrameTokenViT(), jmem.SBP(keep_ratio=0.5, where=tp.ViTBlock))
  variables = jax.jit(model.init)(jax.random.key(1), CLIPS)

  def loss(params, x, y):
    out = model.apply({"params": params}, x, rngs={"sbp": KEY})
    return -jnp.sum(jnp.take_along_axis(jax.nn.log_softmax(out), y[:, None], 1))

  # Under check_vma the gradient of the replicated parameters is summed over "data" by
  # autodiff itself.
  P = jax.sharding.PartitionSpec
  sharded = jax.jit(jax.shard_map(jax.grad(loss), mesh=mesh,
                                  in_specs=(P(), P("data"), P("data")),
                                  out_specs=P()))(variables["params"], CLIPS, Y)
  assert_close(sharded, jax.jit(jax.grad(loss))(variables["params"], CLIPS, Y))


class _Wrap(nn.Module):
  inner: type

  @nn.compact
  def __call__(self, clips):
    return nn.Dense(2)(self.inner()(clips).reshape(clips.shape[0], -1))
