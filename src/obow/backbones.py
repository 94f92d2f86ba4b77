"""ResNet trunks that expose the feature levels OBoW needs.

The teacher quantises intermediate feature maps (``conv4`` = ``layer3`` and ``conv5`` = ``layer4`` in
torchvision's naming, paper section 3.3) and the student predicts every BoW from its global-average-pooled
``pool5`` vector (paper section 3.3, official notes 2.6-2.7).

:class:`ResNetBackbone` registers torchvision's own modules under torchvision's own names (``conv1``,
``bn1``, ``layer1`` ... ``layer4``) and drops only ``avgpool`` and ``fc``, so its ``state_dict`` loads into
the matching ``torchvision.models.resnetXX()`` once an ``fc`` is supplied (see ``obow.export``).

Stems:

* ``"torchvision"``: 7x7 stride-2 convolution and a 3x3 stride-2 max-pool (output stride 32), as in the paper.
* ``"no_maxpool"``: the same convolution without the max-pool (output stride 16), for small views such as
  96 px, where stride 32 leaves a conv5 map too small for border removal and local averaging.
* ``"cifar"``: a 3x3 stride-1 convolution and no max-pool (output stride 8), for 32-64 px images. Its
  ``conv1.weight`` has shape ``[64, 3, 3, 3]``; a torchvision model needs the same ``conv1`` to load it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torchvision
from torch import Tensor, nn

from obow.validation import check_choice

ARCHITECTURES = (
    "resnet18",
    "resnet34",
    "resnet50",
    "resnet101",
    "resnet152",
    "resnext50_32x4d",
    "wide_resnet50_2",
)
STEMS = ("torchvision", "no_maxpool", "cifar")
#: Paper level names (ResNet convention conv2..conv5) and the torchvision stage that produces each.
LEVEL_TO_STAGE = {"conv2": "layer1", "conv3": "layer2", "conv4": "layer3", "conv5": "layer4"}


@dataclass
class BackboneOutput:
    """What one backbone pass returns: the pooled vector and the requested feature maps."""

    pool5: Tensor
    maps: dict[str, Tensor]


class ResNetBackbone(nn.Module):
    """A torchvision ResNet (random initialisation) that returns ``pool5`` and named feature maps.

    Args:
        arch: one of :data:`ARCHITECTURES`.
        stem: one of :data:`STEMS` (see the module docstring).
    """

    def __init__(self, arch: str = "resnet18", stem: str = "torchvision") -> None:
        super().__init__()
        check_choice("arch", arch, ARCHITECTURES)
        check_choice("stem", stem, STEMS)
        self.arch = arch
        self.stem = stem
        net = torchvision.models.get_model(arch, weights=None)
        if stem == "cifar":
            net.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
            nn.init.kaiming_normal_(net.conv1.weight, mode="fan_out", nonlinearity="relu")
        if stem in ("cifar", "no_maxpool"):
            net.maxpool = nn.Identity()
        self.conv1, self.bn1, self.relu, self.maxpool = net.conv1, net.bn1, net.relu, net.maxpool
        self.layer1, self.layer2, self.layer3, self.layer4 = net.layer1, net.layer2, net.layer3, net.layer4
        self.num_features: int = net.fc.in_features
        self.level_channels: dict[str, int] = {
            level: _stage_out_channels(getattr(self, stage)) for level, stage in LEVEL_TO_STAGE.items()
        }

    def forward(self, x: Tensor, levels: tuple[str, ...] = ()) -> BackboneOutput:
        """Run the trunk; ``levels`` names the maps to return (e.g. ``("conv4", "conv5")``)."""
        for level in levels:
            check_choice("level", level, tuple(LEVEL_TO_STAGE))
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        maps: dict[str, Tensor] = {}
        for level, stage in LEVEL_TO_STAGE.items():
            x = getattr(self, stage)(x)
            if level in levels:
                maps[level] = x
        return BackboneOutput(pool5=torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1), maps=maps)

    def feature_map_size(self, input_size: int, level: str) -> int:
        """Side of the ``level`` map for a square ``input_size`` input (see :func:`feature_map_size`)."""
        return feature_map_size(input_size, level, self.stem)


def _stage_out_channels(stage: nn.Module) -> int:
    return [m for m in stage.modules() if isinstance(m, nn.BatchNorm2d)][-1].num_features


def _halve(n: int) -> int:
    # Every stride-2 layer of a ResNet (7x7 pad 3, 3x3 pad 1, 3x3 max-pool pad 1) maps n to floor((n-1)/2)+1.
    return (n - 1) // 2 + 1


def feature_map_size(input_size: int, level: str, stem: str = "torchvision") -> int:
    """Spatial side of a ResNet feature map, computed from the strides (no forward pass).

    Used to reject recipes whose BoW levels would be too small after border removal.
    """
    check_choice("level", level, tuple(LEVEL_TO_STAGE))
    check_choice("stem", stem, STEMS)
    if input_size < 1:
        raise ValueError(f"input_size must be a positive number of pixels, got {input_size}")
    n = input_size
    if stem != "cifar":
        n = _halve(n)
    if stem == "torchvision":
        n = _halve(n)
    for _ in range(int(level[-1]) - 2):  # conv3, conv4 and conv5 each halve once more
        n = _halve(n)
    return n
