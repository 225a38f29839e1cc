"""Reference models: plain Flax models, converted with `jmem.convert` as any user's are."""

from jmem.models.convnext import CONVNEXT_CONFIGS as CONVNEXT_CONFIGS
from jmem.models.convnext import ConvNeXt as ConvNeXt
from jmem.models.convnext import convnext as convnext
from jmem.models.resnet import BasicBlock as BasicBlock
from jmem.models.resnet import Bottleneck as Bottleneck
from jmem.models.resnet import PreActBlock as PreActBlock
from jmem.models.resnet import RESNET_CONFIGS as RESNET_CONFIGS
from jmem.models.resnet import ResNet as ResNet
from jmem.models.resnet import resnet as resnet
from jmem.models.segmentation import UNet as UNet
from jmem.models.segmentation import pixel_cross_entropy as pixel_cross_entropy
from jmem.models.small import SmallCNN as SmallCNN
from jmem.models.video import VIDEO_CONFIGS as VIDEO_CONFIGS
from jmem.models.video import StTVideo as StTVideo
from jmem.models.video import VideoTransformer as VideoTransformer
from jmem.models.video import video_model as video_model

# name -> UNet fields (the U-Net of the peak-memory issue: 5 stages, 32 to 512 channels).
SEGMENTATION_CONFIGS = {"unet": {}}

MODEL_NAMES = (tuple(RESNET_CONFIGS) + tuple(CONVNEXT_CONFIGS) + tuple(VIDEO_CONFIGS)
               + tuple(SEGMENTATION_CONFIGS))


def model_task(name: str) -> str:
  """``"video"`` for models of ``[B, T, H, W, C]`` clips, ``"segmentation"`` for models of
  per-pixel labels, else ``"image"``."""
  if name in VIDEO_CONFIGS:
    return "video"
  return "segmentation" if name in SEGMENTATION_CONFIGS else "image"


def image_size_unit(name: str) -> int:
  """The image side unit of the registered model ``name``: the smallest side it takes, and
  the sides it sees whole are its multiples (its VALID-padded strides leave the remainder
  out): a ConvNeXt's stem patch times its ``stages - 1`` halvings (32 for convnext-t), the
  U-Net's ``2**poolings`` (its sides must divide by that), the video ViT's patch (8), else 1.
  (Moving-digit clips need room to move too: `jmem.bench.min_frame_size`.)"""
  if name in CONVNEXT_CONFIGS:
    depths, _, patch = CONVNEXT_CONFIGS[name]
    return patch * 2 ** (len(depths) - 1)
  if name in SEGMENTATION_CONFIGS:
    widths = {**{f.name: f.default for f in UNet.__dataclass_fields__.values()},
              **SEGMENTATION_CONFIGS[name]}["widths"]
    return 2 ** (len(widths) - 1)
  if name in VIDEO_CONFIGS:
    cls, fields = VIDEO_CONFIGS[name]
    if cls is VideoTransformer:
      return fields.get("patch", VideoTransformer.__dataclass_fields__["patch"].default)
  return 1


def create_model(name: str, num_classes: int, **overrides):
  """Builds a registered model by name (one of `MODEL_NAMES`)."""
  if name in RESNET_CONFIGS:
    return resnet(name, num_classes, **overrides)
  if name in CONVNEXT_CONFIGS:
    return convnext(name, num_classes, **overrides)
  if name in VIDEO_CONFIGS:
    return video_model(name, num_classes, **overrides)
  if name in SEGMENTATION_CONFIGS:
    return UNet(num_classes, **{**SEGMENTATION_CONFIGS[name], **overrides})
  raise ValueError(f"Unknown model {name!r}; valid models: {', '.join(MODEL_NAMES)}.")
