"""Video models for Stochastic Backpropagation: plain Flax models whose ``sbp_sites`` name
where SBP goes, applied as on any model with ``jmem.convert(model, jmem.SBP(...))``
(``jmem.technique("sbp-0.25")`` in the bench, which reads ``sbp_sites``).

* `StTVideo`: spatial-then-temporal. A per-frame 2-D CNN (`FrameEncoder`: the ResNet family,
  GroupNorm so that frames stay independent) is the SBP site over the frame axis; a small
  temporal transformer trained with full backprop classifies the clip.
* `VideoTransformer`: patch tokens of all frames through transformer blocks; the first
  ``depth - exact_last`` blocks are the SBP sites (rows mode: their attention computes the
  kept queries against every key and value in the backward), with ONE set of kept tokens
  shared by all of them; the last ``exact_last`` blocks stay exact.

A converted model has the same parameters as the plain one, so an SBP model and its exact
twin start from the same weights for the same seed.

References:
  Cheng et al., Stochastic Backpropagation, CVPR 2022, https://arxiv.org/abs/2203.16755
"""

from __future__ import annotations

from collections.abc import Callable, Collection
import dataclasses
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from jmem.models.resnet import resnet as make_resnet

__all__ = ["TokenBlock", "FrameEncoder", "StTVideo", "VideoTransformer", "group_norm",
           "spatial_lr_scale", "VIDEO_CONFIGS", "video_model", "FrameClassifier",
           "pretrain_backbone"]


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
  """Pre-norm transformer block over ``[B, N, D]`` tokens (Flax's multi-head attention, which
  `jmem.SBP` in rows mode restricts to the kept queries in the backward)."""

  dim: int
  heads: int = 4
  mlp_ratio: int = 4
  dtype: Any = None      # computation dtype (None: the input's); parameters stay float32

  @nn.compact
  def __call__(self, x):
    dt = self.dtype
    h = nn.LayerNorm(dtype=dt, name="norm1")(x)
    y = x + nn.MultiHeadDotProductAttention(num_heads=self.heads, qkv_features=self.dim,
                                            out_features=self.dim, dtype=dt,
                                            name="attn")(h, h)
    m = nn.Dense(self.mlp_ratio * self.dim, dtype=dt, name="fc1")(
        nn.LayerNorm(dtype=dt, name="norm2")(y))
    return (y + nn.Dense(self.dim, dtype=dt, name="fc2")(nn.gelu(m))).astype(x.dtype)


def _frame_cnn(backbone: str, feature_dim: int, **kw):
  # Flattened head: global pooling would discard where the digit is, hence the motion.
  return make_resnet(backbone, feature_dim, norm=group_norm, head_pool="flatten", **kw)


class FrameEncoder(nn.Module):
  """A per-frame CNN (``cnn``: a ResNet config with GroupNorm) on every frame of
  ``[B, T, H, W, C]`` clips: ``[B, T, feature_dim]``. The frames are independent, so it is
  an SBP site of ``"nodes"`` mode over axis 1."""

  backbone: str = "resnet8"
  feature_dim: int = 64
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, clips):
    # `resnet`'s first argument is called ``name``, so the module is named by a clone.
    cnn = _frame_cnn(self.backbone, self.feature_dim, dtype=self.dtype,
                     parent=None).clone(parent=self, name="cnn")
    feats = cnn(clips.reshape((-1,) + clips.shape[2:]), train=True)
    return feats.reshape(clips.shape[:2] + feats.shape[1:])


class StTVideo(nn.Module):
  """Per-frame CNN, then a temporal transformer: ``[B, T, H, W, C] -> [B, K]``.

  Its SBP site (``sbp_sites``) is the per-frame CNN ``spatial`` (a `FrameEncoder`), the
  paper's StT layout: ``jmem.convert(model, jmem.SBP(keep_ratio=0.25, where="spatial"))``
  runs it on every frame and backpropagates through the kept ones.

  Attributes:
    num_classes: outputs.
    backbone: ResNet config name for the per-frame CNN (GroupNorm replaces BatchNorm).
    feature_dim: per-frame feature size (the CNN's head width).
    temporal_depth: transformer blocks over the frame features (exact backprop).
    heads: attention heads.
    dtype: computation dtype (e.g. ``jnp.bfloat16``: mixed precision; parameters stay
      float32, the logits are float32).
  """

  num_classes: int
  backbone: str = "resnet8"
  feature_dim: int = 64
  temporal_depth: int = 2
  heads: int = 4
  dtype: Any = jnp.float32

  # Where `jmem.SBP` goes (the bench's sbp-* techniques read it): the per-frame CNN.
  sbp_sites: ClassVar[str] = "spatial"
  sbp_mode: ClassVar[str] = "nodes"

  @nn.compact
  def __call__(self, video, train: bool = False):
    del train     # no layer of this model changes with it (GroupNorm, no dropout)
    if video.ndim != 5:
      raise ValueError(f"StTVideo expects [B, T, H, W, C] clips, got shape {video.shape}.")
    b, t = video.shape[:2]
    feats = FrameEncoder(self.backbone, self.feature_dim, self.dtype, name="spatial")(video)
    time_embed = self.param("time_embed", nn.initializers.normal(0.02), (t, self.feature_dim))
    x = feats.astype(self.dtype) + time_embed.astype(self.dtype)
    for i in range(self.temporal_depth):
      x = TokenBlock(self.feature_dim, self.heads, dtype=self.dtype, name=f"temporal{i}")(x)
    # Read out every time step (not their mean): the order of the frames is the motion.
    x = nn.LayerNorm(dtype=self.dtype, name="norm")(x.reshape(b, t * self.feature_dim))
    return nn.Dense(self.num_classes, dtype=self.dtype, name="head")(x).astype(jnp.float32)


class VideoTransformer(nn.Module):
  """Patch tokens of every frame through transformer blocks.

  Tokens are ordered (t, h, w); the position embedding is a spatial one shared by the
  frames plus a per-frame one. Its SBP sites (`sbp_sites`) are the blocks but the last
  ``exact_last``, in rows mode: ``jmem.convert(model, jmem.SBP(keep_ratio=0.25,
  where=model.sbp_sites, mode="rows"))`` (one set of kept tokens shared by the blocks; for
  another sampler, e.g. ``jmem.ops.sbp.checkerboard((T, H/p, W/p))``, pass ``sampler=``).

  Attributes:
    num_classes: outputs.
    patch: spatial patch side.
    dim, depth, heads: transformer width, blocks, heads.
    exact_last: the last blocks `sbp_sites` leaves out (exact backprop, as the SBP papers'
      last stage).
    readout: ``"mean"`` pools all tokens; ``"frames"`` pools each frame's tokens and
      concatenates the frames in time order (the order of the frames is the motion, as in
      `StTVideo`'s readout).
    dtype: computation dtype (e.g. ``jnp.bfloat16``: mixed precision; parameters stay
      float32, the logits are float32).
  """

  num_classes: int
  patch: int = 4
  dim: int = 64
  depth: int = 4
  heads: int = 4
  exact_last: int = 1
  readout: str = "mean"
  dtype: Any = jnp.float32

  sbp_mode: ClassVar[str] = "rows"

  @property
  def sbp_sites(self) -> tuple[str, ...]:
    """The blocks SBP goes on: all but the last ``exact_last``."""
    if not 0 <= self.exact_last <= self.depth:
      raise ValueError(f"exact_last must be in [0, depth={self.depth}], got {self.exact_last}.")
    return tuple(f"block{i}" for i in range(self.depth - self.exact_last))

  @nn.compact
  def __call__(self, video, train: bool = False):
    del train     # no layer of this model changes with it (LayerNorm, no dropout)
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
    for i in range(self.depth):
      x = TokenBlock(self.dim, self.heads, dtype=self.dtype, name=f"block{i}")(x)
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
  # The loop sits above the models: imported here, where it trains.
  from jmem import train as train_lib  # pylint: disable=g-import-not-at-top
  if len(frames.example_shape) != 3:
    raise ValueError(f"pretrain_backbone needs single frames [N, H, W, C], got examples of "
                     f"shape {frames.example_shape}.")
  if isinstance(model, StTVideo):
    clf = FrameClassifier(frames.num_classes, model.backbone, model.feature_dim)
    result = train_lib.train(clf, frames, config)
    return {"spatial": {"cnn": result.state.params["cnn"]}}, result.test_accuracy
  if isinstance(model, VideoTransformer):
    one_frame = lambda x: x[:, None]
    clips = dataclasses.replace(frames, x_train=one_frame(frames.x_train),
                                x_test=one_frame(frames.x_test))
    clf = model.clone(num_classes=frames.num_classes, parent=None)
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

