"""Video models with Stochastic Backpropagation switched on by one field, ``keep_ratio``.

* `StTVideo`: spatial-then-temporal. A per-frame 2-D CNN (the ResNet family, GroupNorm so
  that frames stay independent) runs under `jmem.ops.sbp.sbp` over the frame axis, then a
  small temporal transformer trained with full backprop classifies the clip.
* `VideoTransformer`: patch tokens of all frames through transformer blocks; the first
  ``depth - exact_last`` blocks use layer-level SBP (`sbp_rows`) with ONE set of kept
  tokens shared by all of them; the last ``exact_last`` blocks are exact.

``keep_ratio=1`` is exact backpropagation; the parameters do not depend on ``keep_ratio``,
so an SBP model and its exact twin start from the same weights for the same seed.

References:
  Cheng et al., Stochastic Backpropagation, CVPR 2022, https://arxiv.org/abs/2203.16755
"""

from __future__ import annotations

from collections.abc import Callable, Collection
import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from jmem import train as train_lib
from jmem.models.resnet import resnet as make_resnet
from jmem.ops import sbp as sbp_lib

__all__ = ["TokenBlock", "StTVideo", "VideoTransformer", "group_norm", "spatial_lr_scale",
           "VIDEO_CONFIGS", "video_model", "FrameClassifier", "pretrain_backbone"]


def group_norm(*, num_groups: int = 8, use_running_average=None, momentum=None,
               epsilon: float = 1e-5, dtype=None, name=None, scale_init=nn.initializers.ones):
  """GroupNorm with BatchNorm's call signature, for `jmem.models.ResNet`'s ``norm`` field.

  Per-sample normalisation keeps the frames of a clip independent, which SBP needs (batch
  statistics would couple kept and dropped frames).
  """
  del use_running_average, momentum
  return nn.GroupNorm(num_groups=num_groups, epsilon=epsilon, dtype=dtype, name=name,
                      scale_init=scale_init)


class TokenBlock(nn.Module):
  """Pre-norm transformer block; ``rows`` computes only those output tokens.

  With ``rows``, queries (and the MLP) are computed for the kept tokens only, against the
  keys and values of ALL tokens: what the SBP backward re-runs.
  """

  dim: int
  heads: int = 4
  mlp_ratio: int = 4
  dtype: Any = None      # computation dtype (None: the input's); parameters stay float32

  @nn.compact
  def __call__(self, x, rows: jax.Array | None = None):
    b, n, d = x.shape
    hd = d // self.heads
    dt = self.dtype
    h = nn.LayerNorm(dtype=dt, name="norm1")(x)
    kv = nn.DenseGeneral((2, self.heads, hd), dtype=dt, name="kv")(h)
    q_in, x_res = (h, x) if rows is None else (jnp.take(h, rows, 1), jnp.take(x, rows, 1))
    q = nn.DenseGeneral((self.heads, hd), dtype=dt, name="q")(q_in)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, kv[:, :, 0]) / jnp.sqrt(hd).astype(q.dtype)
    att = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), kv[:, :, 1])
    y = x_res + nn.DenseGeneral(d, axis=(-2, -1), dtype=dt, name="proj")(att)
    m = nn.Dense(self.mlp_ratio * d, dtype=dt, name="fc1")(nn.LayerNorm(dtype=dt,
                                                                        name="norm2")(y))
    return (y + nn.Dense(d, dtype=dt, name="fc2")(nn.gelu(m))).astype(x.dtype)


def _frame_cnn(backbone: str, feature_dim: int, **kw):
  # Flattened head: global pooling would discard where the digit is, hence the motion.
  return make_resnet(backbone, feature_dim, norm=group_norm, head_pool="flatten", **kw)


def _pure(module: nn.Module, call: Callable[..., Any]):
  """``(params, *args) -> call(module, *args)`` with ``module``'s ``params`` as an argument:
  what the SBP transforms (plain JAX) differentiate. The call runs on an unbound copy, so
  `jmem.convert`'s techniques do not reach it; the module itself stays a bound submodule
  (its parameters, and every call outside SBP, are the model's own)."""
  free = module.clone(parent=None)
  return lambda params, *args: free.apply({"params": params}, *args, method=call)


class StTVideo(nn.Module):
  """Per-frame CNN under SBP, then a temporal transformer: ``[B, T, H, W, C] -> [B, K]``.

  Attributes:
    num_classes: outputs.
    keep_ratio: fraction of frames that get a backward pass through the CNN, in (0, 1]
      (1 = exact); anything else (NaN included) raises ValueError at construction.
    sampler: SBP sampler name or callable.
    backbone: ResNet config name for the per-frame CNN (GroupNorm replaces BatchNorm).
    feature_dim: per-frame feature size (the CNN's head width).
    temporal_depth: transformer blocks over the frame features (exact backprop).
    heads: attention heads.
    reference: use `jmem.ops.sbp.sbp_reference` (plain autodiff with the dropped frames'
      features under stop_gradient: the oracle in tests) instead of `sbp`.
    dtype: computation dtype (e.g. ``jnp.bfloat16``: mixed precision; parameters stay
      float32, the logits are float32).
  """

  num_classes: int
  keep_ratio: float = 1.0
  sampler: Any = "uniform_chunk"
  backbone: str = "resnet8"
  feature_dim: int = 64
  temporal_depth: int = 2
  heads: int = 4
  reference: bool = False
  dtype: Any = jnp.float32

  def __post_init__(self):
    # At construction: a ratio > 1 or NaN would otherwise silently train exact.
    sbp_lib.check_keep_ratio(self.keep_ratio)
    super().__post_init__()

  @nn.compact
  def __call__(self, video, train: bool = False):
    if video.ndim != 5:
      raise ValueError(f"StTVideo expects [B, T, H, W, C] clips, got shape {video.shape}.")
    b, t = video.shape[:2]
    # A bound submodule (`resnet`'s first argument is the config name, so it is named by a
    # clone): jmem.convert and jmem.plan reach its blocks on the exact path.
    cnn = _frame_cnn(self.backbone, self.feature_dim, dtype=self.dtype,
                     parent=None).clone(parent=self, name="spatial")

    def per_frame(m, clips):
      frames = clips.reshape((-1,) + clips.shape[2:])
      feats = m(frames, train=True)
      return feats.reshape(clips.shape[:2] + feats.shape[1:])

    if train and self.keep_ratio < 1.0 and not self.is_initializing():
      transform = sbp_lib.sbp_reference if self.reference else sbp_lib.sbp
      run = transform(_pure(cnn, per_frame), keep_ratio=self.keep_ratio, axis=1,
                      sampler=self.sampler)
      feats = run(cnn.variables["params"], video, self.make_rng("dropout"))
    else:                         # exact backprop (keep_ratio 1, eval, or init)
      feats = per_frame(cnn, video)
    time_embed = self.param("time_embed", nn.initializers.normal(0.02), (t, self.feature_dim))
    x = feats.astype(self.dtype) + time_embed.astype(self.dtype)
    for i in range(self.temporal_depth):
      x = TokenBlock(self.feature_dim, self.heads, dtype=self.dtype, name=f"temporal{i}")(x)
    # Read out every time step (not their mean): the order of the frames is the motion.
    x = nn.LayerNorm(dtype=self.dtype, name="norm")(x.reshape(b, t * self.feature_dim))
    return nn.Dense(self.num_classes, dtype=self.dtype, name="head")(x).astype(jnp.float32)


class VideoTransformer(nn.Module):
  """Patch tokens of every frame through transformer blocks with layer-level SBP.

  Tokens are ordered (t, h, w); the position embedding is a spatial one shared by the
  frames plus a per-frame one.

  Attributes:
    num_classes: outputs.
    keep_ratio: fraction of tokens kept for the backward of the SBP blocks, in (0, 1]
      (1 = exact); anything else (NaN included) raises ValueError at construction.
    sampler: SBP sampler over the ``T * (H/p) * (W/p)`` tokens (e.g.
      ``jmem.ops.sbp.checkerboard((T, H/p, W/p))``).
    patch: spatial patch side.
    dim, depth, heads: transformer width, blocks, heads.
    exact_last: the last blocks that use exact backprop.
    readout: ``"mean"`` pools all tokens; ``"frames"`` pools each frame's tokens and
      concatenates the frames in time order (the order of the frames is the motion, as in
      `StTVideo`'s readout).
    dtype: computation dtype (e.g. ``jnp.bfloat16``: mixed precision; parameters stay
      float32, the logits are float32).
  """

  num_classes: int
  keep_ratio: float = 1.0
  sampler: Any = "uniform_chunk"
  patch: int = 4
  dim: int = 64
  depth: int = 4
  heads: int = 4
  exact_last: int = 1
  readout: str = "mean"
  dtype: Any = jnp.float32

  def __post_init__(self):
    # At construction: a ratio > 1 or NaN would otherwise silently train exact.
    sbp_lib.check_keep_ratio(self.keep_ratio)
    super().__post_init__()

  @nn.compact
  def __call__(self, video, train: bool = False):
    if video.ndim != 5:
      raise ValueError(f"VideoTransformer expects [B, T, H, W, C] clips, got {video.shape}.")
    if self.readout not in ("mean", "frames"):
      raise ValueError(f"readout must be 'mean' or 'frames', got {self.readout!r}.")
    if not 0 <= self.exact_last <= self.depth:
      raise ValueError(f"exact_last must be in [0, depth={self.depth}], got {self.exact_last}.")
    b, t, h, w, c = video.shape
    p = self.patch
    if min(h, w) < p:     # no patch token: a mean over nothing, a NaN loss
      raise ValueError(f"This VideoTransformer (patch {p}) needs frames of at least {p}x{p}, "
                       f"got {h}x{w}: use larger frames (--image-size {p} or more).")
    x = nn.Conv(self.dim, (p, p), strides=(p, p), padding="VALID", dtype=self.dtype,
                name="patch_embed")(video.reshape((b * t, h, w, c)))
    x = x.reshape(b, t, -1, self.dim)
    # Factorised: a spatial embedding shared by all frames plus one per time step, so
    # that the spatial part can be pretrained on single frames (see `pretrain_backbone`).
    pos = self.param("pos_embed", nn.initializers.normal(0.02), x.shape[2:])
    time = self.param("time_embed", nn.initializers.normal(0.02), (t, 1, self.dim))
    x = x + pos.astype(x.dtype) + time.astype(x.dtype)
    x = x.reshape(b, -1, self.dim)                       # tokens in (t, h, w) order
    idx = None
    if (train and self.keep_ratio < 1.0 and self.exact_last < self.depth
        and not self.is_initializing()):
      idx = sbp_lib.sample_indices(self.make_rng("dropout"), x, keep_ratio=self.keep_ratio,
                                   axis=1, sampler=self.sampler)
    for i in range(self.depth):
      # Bound submodules: jmem.convert and jmem.plan reach the blocks on the exact path.
      block = TokenBlock(self.dim, self.heads, dtype=self.dtype, name=f"block{i}")
      if idx is not None and i < self.depth - self.exact_last:
        x = sbp_lib.sbp_rows(_pure(block, lambda m, v: m(v)),
                             _pure(block, lambda m, v, rows: m(v, rows)),
                             block.variables["params"], x, idx, axis=1)
      else:
        x = block(x)
    x = x.reshape(b, t, -1, self.dim)
    x = jnp.mean(x, axis=(1, 2)) if self.readout == "mean" else jnp.mean(x, axis=2)
    x = nn.LayerNorm(dtype=self.dtype, name="norm")(x).reshape(b, -1)
    return nn.Dense(self.num_classes, dtype=self.dtype, name="head")(x).astype(jnp.float32)


class FrameClassifier(nn.Module):
  """`StTVideo`'s per-frame CNN (under ``cnn``) with a linear classifier on its features:
  what `pretrain_backbone` trains on single frames."""

  num_classes: int
  backbone: str = "resnet8"
  feature_dim: int = 64

  @nn.compact
  def __call__(self, x, train: bool = False):
    # `resnet`'s first argument is called ``name``, so the module is named by a clone.
    cnn = _frame_cnn(self.backbone, self.feature_dim, parent=None).clone(parent=self, name="cnn")
    feats = cnn(x, train=train)
    return nn.Dense(self.num_classes, name="classifier")(nn.relu(feats))


# What `pretrain_backbone` does NOT transfer to a `VideoTransformer`: the parameters that
# depend on the number of frames or of classes.
_VIT_FRESH = ("time_embed", "head")


def pretrain_backbone(model: StTVideo | VideoTransformer, frames, config) -> tuple[Any, float]:
  """Trains ``model``'s spatial part on single labelled frames.

  The SBP paper fine-tuned ImageNet-pretrained backbones (per-frame ResNets, Video Swin);
  this gives a video model the same start::

    pre, acc = pretrain_backbone(model, frames, config)
    jmem.train.train(model, clips, ..., initial_params=pre)

  * `StTVideo`: its per-frame CNN with a linear head (`FrameClassifier`).
  * `VideoTransformer`: the same transformer on one-frame clips (with a head for the frame
    labels); the patch embedding, spatial position embedding, blocks and final norm carry
    over, the time embedding and the head start fresh.

  Args:
    model: the video model whose fields the pretrained network takes.
    frames: a `jmem.data.Dataset` of single frames ``[N, H, W, C]`` with their labels.
    config: a `jmem.train.TrainConfig`.

  Returns:
    ``(initial_params, frame_test_accuracy)``; ``initial_params`` is the sub-tree of
    ``model``'s parameters to start from.
  """
  if len(frames.example_shape) != 3:
    raise ValueError(f"pretrain_backbone needs single frames [N, H, W, C], got examples of "
                     f"shape {frames.example_shape}.")
  if isinstance(model, StTVideo):
    clf = FrameClassifier(frames.num_classes, model.backbone, model.feature_dim)
    result = train_lib.train(clf, frames, config)
    return {"spatial": result.state.params["cnn"]}, result.test_accuracy
  if isinstance(model, VideoTransformer):
    one_frame = lambda x: x[:, None]
    clips = dataclasses.replace(frames, x_train=one_frame(frames.x_train),
                                x_test=one_frame(frames.x_test))
    clf = model.clone(num_classes=frames.num_classes, keep_ratio=1.0, parent=None)
    result = train_lib.train(clf, clips, config)
    params = {k: v for k, v in result.state.params.items() if k not in _VIT_FRESH}
    return params, result.test_accuracy
  raise TypeError(f"pretrain_backbone supports StTVideo and VideoTransformer, got "
                  f"{type(model).__name__}.")


def spatial_lr_scale(optimizer: optax.GradientTransformation, scale: float = 0.1,
                     spatial_key: str | Collection[str] = "spatial"
                     ) -> optax.GradientTransformation:
  """Scales the updates of the top-level parameters named ``spatial_key`` (one name or
  several) by ``scale`` (the paper used 0.1x for the pretrained spatial model)."""
  keys = {spatial_key} if isinstance(spatial_key, str) else set(spatial_key)
  def labels(params):
    missing = keys - set(params)
    if missing:
      raise ValueError(f"spatial_lr_scale: no top-level parameters named {sorted(missing)}; "
                       f"the model has {sorted(params)}.")
    return {k: jax.tree.map(lambda _: "spatial" if k in keys else "rest", v)
            for k, v in params.items()}
  return optax.multi_transform(
      {"spatial": optax.chain(optimizer, optax.scale(scale)), "rest": optimizer}, labels)


# name -> (class, fields)
VIDEO_CONFIGS: dict[str, tuple[Callable[..., nn.Module], dict[str, Any]]] = {
    "stt-resnet8": (StTVideo, dict(backbone="resnet8", feature_dim=64, temporal_depth=2)),
    "video-vit": (VideoTransformer, dict(patch=8, dim=64, depth=4, heads=4, exact_last=1,
                                        readout="frames")),
}


def video_model(name: str, num_classes: int, **overrides) -> nn.Module:
  """Builds a named video model (see `VIDEO_CONFIGS`)."""
  if name not in VIDEO_CONFIGS:
    raise ValueError(f"Unknown video model {name!r}; valid names: {sorted(VIDEO_CONFIGS)}.")
  cls, fields = VIDEO_CONFIGS[name]
  return cls(num_classes=num_classes, **{**fields, **overrides})

