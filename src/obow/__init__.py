"""obow: Online Bag-of-Visual-Words self-supervised pretraining (Gidaris et al., CVPR 2021) in PyTorch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from obow.version import __version__ as __version__

#: Public names and the module that defines each. They are imported on first use, so that ``import obow``
#: (and the ``obow`` command's parser, which ``obow --help`` builds) does not pay for PyTorch.
_EXPORTS = {
    "BoWExtractor": "obow.bow.targets",
    "BoWNet": "obow.methods.bownet",
    "DynamicBoWPredictor": "obow.bow.predictor",
    "FixedBoWPredictor": "obow.bow.predictor",
    "ImageFolder": "obow.data.image_folder",
    "KMeansVocabulary": "obow.bow.vocabulary",
    "MoCoV2": "obow.methods.mocov2",
    "ModelConfig": "obow.config",
    "OBoW": "obow.methods.obow",
    "OBoWViews": "obow.data.transforms",
    "QueueVocabulary": "obow.bow.vocabulary",
    "ResNetBackbone": "obow.backbones",
    "RotNet": "obow.methods.rotnet",
    "TimmBackbone": "obow.backbones",
    "TorchvisionBackbone": "obow.backbones",
    "build_backbone": "obow.backbones",
    "Vocabulary": "obow.bow.vocabulary",
    "ViewsConfig": "obow.config",
    "WeightGenerator": "obow.bow.predictor",
    "bow_loss": "obow.bow.loss",
    "feature_map_size": "obow.backbones",
    "load_backbone": "obow.weights.load",
    "load_config": "obow.config",
}
#: Public submodules, also imported on first use (``obow.cutmix.cutmix``, ``obow.cutmix.draw_box``, ...).
_SUBMODULES = {"cutmix": "obow.data.cutmix"}

__all__ = [
    "BoWExtractor",
    "BoWNet",
    "DynamicBoWPredictor",
    "FixedBoWPredictor",
    "ImageFolder",
    "KMeansVocabulary",
    "MoCoV2",
    "ModelConfig",
    "OBoW",
    "OBoWViews",
    "QueueVocabulary",
    "ResNetBackbone",
    "RotNet",
    "TimmBackbone",
    "TorchvisionBackbone",
    "ViewsConfig",
    "Vocabulary",
    "WeightGenerator",
    "bow_loss",
    "build_backbone",
    "cutmix",
    "feature_map_size",
    "load_backbone",
    "load_config",
]

if TYPE_CHECKING:
    from obow.backbones import ResNetBackbone, feature_map_size
    from obow.bow.loss import bow_loss
    from obow.bow.predictor import DynamicBoWPredictor, FixedBoWPredictor, WeightGenerator
    from obow.bow.targets import BoWExtractor
    from obow.bow.vocabulary import KMeansVocabulary, QueueVocabulary, Vocabulary
    from obow.config import ModelConfig, ViewsConfig, load_config
    from obow.data import cutmix
    from obow.data.transforms import OBoWViews
    from obow.methods.bownet import BoWNet
    from obow.methods.mocov2 import MoCoV2
    from obow.methods.obow import OBoW
    from obow.methods.rotnet import RotNet
    from obow.weights.load import load_backbone


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(_SUBMODULES[name])
    raise AttributeError(f"module 'obow' has no attribute {name!r}")
