"""obow: Online Bag-of-Visual-Words self-supervised pretraining (Gidaris et al., CVPR 2021) in PyTorch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: Public names and the module that defines each. They are imported on first use, so that ``import obow``
#: (and the ``obow`` command's parser, which ``obow --help`` builds) does not pay for PyTorch.
_EXPORTS = {
    "BoWExtractor": "obow.bow",
    "BoWNet": "obow.bownet",
    "DynamicBoWPredictor": "obow.predictor",
    "FixedBoWPredictor": "obow.predictor",
    "KMeansVocabulary": "obow.vocabulary",
    "MoCoV2": "obow.mocov2",
    "ModelConfig": "obow.config",
    "OBoW": "obow.method",
    "QueueVocabulary": "obow.vocabulary",
    "ResNetBackbone": "obow.backbones",
    "RotNet": "obow.rotnet",
    "TimmBackbone": "obow.backbones",
    "TorchvisionBackbone": "obow.backbones",
    "build_backbone": "obow.backbones",
    "Vocabulary": "obow.vocabulary",
    "WeightGenerator": "obow.predictor",
    "bow_loss": "obow.method",
    "feature_map_size": "obow.backbones",
}
#: Public submodules, also imported on first use (``obow.cutmix.cutmix``, ``obow.cutmix.draw_box``, ...).
_SUBMODULES = ("cutmix",)

__all__ = [
    "BoWExtractor",
    "BoWNet",
    "DynamicBoWPredictor",
    "FixedBoWPredictor",
    "KMeansVocabulary",
    "MoCoV2",
    "ModelConfig",
    "OBoW",
    "QueueVocabulary",
    "ResNetBackbone",
    "RotNet",
    "TimmBackbone",
    "TorchvisionBackbone",
    "Vocabulary",
    "WeightGenerator",
    "bow_loss",
    "build_backbone",
    "cutmix",
    "feature_map_size",
]

if TYPE_CHECKING:
    from obow import cutmix
    from obow.backbones import ResNetBackbone, feature_map_size
    from obow.bow import BoWExtractor
    from obow.bownet import BoWNet
    from obow.config import ModelConfig
    from obow.method import OBoW, bow_loss
    from obow.mocov2 import MoCoV2
    from obow.predictor import DynamicBoWPredictor, FixedBoWPredictor, WeightGenerator
    from obow.rotnet import RotNet
    from obow.vocabulary import KMeansVocabulary, QueueVocabulary, Vocabulary


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"obow.{name}")
    raise AttributeError(f"module 'obow' has no attribute {name!r}")
