"""Reference models. Techniques are switched on by cloning a model with other fields."""

from jmem.models.convnext import CONVNEXT_CONFIGS as CONVNEXT_CONFIGS
from jmem.models.convnext import ConvNeXt as ConvNeXt
from jmem.models.convnext import convnext as convnext
from jmem.models.resnet import BasicBlock as BasicBlock
from jmem.models.resnet import Bottleneck as Bottleneck
from jmem.models.resnet import PreActBlock as PreActBlock
from jmem.models.resnet import RESNET_CONFIGS as RESNET_CONFIGS
from jmem.models.resnet import ResNet as ResNet
from jmem.models.resnet import resnet as resnet
from jmem.models.small import SmallCNN as SmallCNN

MODEL_NAMES = tuple(RESNET_CONFIGS) + tuple(CONVNEXT_CONFIGS)


def create_model(name: str, num_classes: int, **overrides):
  """Builds a registered model by name (one of `MODEL_NAMES`)."""
  if name in RESNET_CONFIGS:
    return resnet(name, num_classes, **overrides)
  if name in CONVNEXT_CONFIGS:
    return convnext(name, num_classes, **overrides)
  raise ValueError(f"Unknown model {name!r}; valid models: {', '.join(MODEL_NAMES)}.")
