"""Evaluation protocols for frozen or fine-tuned OBoW backbones (paper sections 4.1 and 4.3).

- :mod:`~obow.evaluate.features`: load a backbone (checkpoint, exported file or random init) and extract
  ``pool5`` features of a folder of images as the teacher saw them;
- :mod:`~obow.evaluate.knn`: weighted kNN (``k=200, T=0.1`` and ``k=20``), the cheap monitor;
- :mod:`~obow.evaluate.linear`: linear probe on pre-cached centre-crop and flip features (section 4.1);
- :mod:`~obow.evaluate.fewshot`: 50-way 1/5-shot episodes with cosine prototypes (section 4.1);
- :mod:`~obow.evaluate.finetune`: 1% / 10% semi-supervised fine-tuning (section 4.3).
"""

from obow.data.eval_sets import eval_dataset
from obow.evaluate.features import extract_features
from obow.evaluate.fewshot import Episode, default_ways, prototype_accuracy, sample_episodes
from obow.evaluate.finetune import FINETUNE_PRESETS, balanced_subset, finetune
from obow.evaluate.knn import knn_accuracy, knn_predict
from obow.evaluate.linear import LINEAR_PRESETS, lr_at_epoch, train_linear_probe
from obow.weights.load import load_backbone

__all__ = [
    "FINETUNE_PRESETS",
    "LINEAR_PRESETS",
    "Episode",
    "balanced_subset",
    "default_ways",
    "eval_dataset",
    "extract_features",
    "finetune",
    "knn_accuracy",
    "knn_predict",
    "load_backbone",
    "lr_at_epoch",
    "prototype_accuracy",
    "sample_episodes",
    "train_linear_probe",
]
