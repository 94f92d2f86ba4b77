"""obow: Online Bag-of-Visual-Words self-supervised pretraining (Gidaris et al., CVPR 2021) in PyTorch."""

from obow.backbones import ResNetBackbone, feature_map_size
from obow.bow import BoWExtractor
from obow.config import ModelConfig
from obow.method import OBoW, bow_loss
from obow.predictor import DynamicBoWPredictor, FixedBoWPredictor, WeightGenerator
from obow.vocabulary import KMeansVocabulary, QueueVocabulary, Vocabulary

__version__ = "0.1.0"

__all__ = [
    "BoWExtractor",
    "DynamicBoWPredictor",
    "FixedBoWPredictor",
    "KMeansVocabulary",
    "ModelConfig",
    "OBoW",
    "QueueVocabulary",
    "ResNetBackbone",
    "Vocabulary",
    "WeightGenerator",
    "bow_loss",
    "feature_map_size",
]
