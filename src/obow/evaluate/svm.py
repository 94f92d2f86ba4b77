"""VOC07 classification with linear SVMs on frozen features (the paper's Table 6; Goyal et al., ICCV 2019).

The protocol of the benchmark the paper used (fair_self_supervision_benchmark; official notes 5.3):

* ``pool5`` features of every image of ``trainval`` and ``test``, each L2-normalised (:func:`l2_normalize`);
* per class, a linear SVM (squared hinge loss, L2 penalty, positives weighted 2, scikit-learn's
  ``LinearSVC``) for every cost of :data:`DEFAULT_COSTS` (the costs the authors ran), the cost chosen by the
  mean average precision of a 3-fold cross-validation on ``trainval`` (scikit-learn's ``average_precision``),
  then refit on all of ``trainval``. In training, a class's *difficult* images count as negatives, as in the
  benchmark;
* on ``test``, the average precision of each class with its difficult images left out
  (:func:`voc_average_precision`), and their mean: mAP.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from obow.data.voc import DIFFICULT, PRESENT

#: The SVM costs of the authors' VOC07 runs (official notes 5.3).
DEFAULT_COSTS = (0.05, 0.1, 0.3, 0.5, 1.0, 3.0, 5.0)
#: Weight of the positive class in the SVM loss (the benchmark's ``class_weight={1: 2, -1: 1}``).
POSITIVE_WEIGHT = 2.0
FOLDS = 3


def l2_normalize(features: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    """Each row divided by its L2 norm (plus ``eps``, so that a zero row stays zero)."""
    features = np.asarray(features, dtype=np.float64)
    return features / (np.linalg.norm(features, axis=1, keepdims=True) + eps)


def voc_average_precision(scores: np.ndarray, targets: np.ndarray) -> float:
    """Average precision of ``scores`` ``[N]`` for ``targets`` ``[N]`` (1 present, -1 absent, 0 difficult), in
    percent: the difficult images are left out, and precision is interpolated (at each recall, the best
    precision at that recall or beyond) and integrated over recall, as VOC's devkit does since 2010.
    ``nan`` when no image is positive."""
    scores, targets = np.asarray(scores, dtype=np.float64), np.asarray(targets)
    keep = targets != DIFFICULT
    scores, positive = scores[keep], targets[keep] == PRESENT
    if not positive.any():
        return float("nan")
    order = np.argsort(-scores, kind="stable")
    hits = positive[order]
    true_pos = np.cumsum(hits)
    precision = true_pos / np.arange(1, len(hits) + 1)
    recall = true_pos / hits.sum()
    envelope = np.maximum.accumulate(precision[::-1])[::-1]
    recall_steps = np.diff(np.concatenate([[0.0], recall]))
    return float(100 * np.sum(recall_steps * envelope))


def train_class_svm(features: np.ndarray, positive: np.ndarray, costs: Sequence[float]) -> tuple[Any, float, dict]:
    """The SVM of one class (``positive``: a boolean per training image), the chosen cost, and the mean
    cross-validated average precision (percent) of every cost."""
    from sklearn.model_selection import cross_val_score
    from sklearn.svm import LinearSVC

    labels = np.where(positive, 1, -1)
    counts = (int(positive.sum()), int((~positive).sum()))
    if min(counts) < FOLDS:
        raise ValueError(
            f"an SVM's {FOLDS}-fold cross-validation needs at least {FOLDS} positive and {FOLDS} negative training "
            f"images; this class has {counts[0]} and {counts[1]}"
        )

    def svm(cost: float) -> LinearSVC:
        return LinearSVC(
            C=cost, class_weight={1: POSITIVE_WEIGHT, -1: 1.0}, penalty="l2", loss="squared_hinge", max_iter=2000
        )

    cv_ap = {}
    for cost in costs:
        scores = cross_val_score(svm(cost), features, labels, cv=FOLDS, scoring="average_precision")
        cv_ap[float(cost)] = float(100 * scores.mean())
    best = max(cv_ap, key=lambda c: (cv_ap[c], -c))  # ties: the smaller cost (the stronger regulariser)
    return svm(best).fit(features, labels), best, cv_ap


def svm_classification(
    train_features: np.ndarray,
    train_targets: np.ndarray,
    test_features: np.ndarray,
    test_targets: np.ndarray,
    classes: Sequence[str],
    costs: Sequence[float] = DEFAULT_COSTS,
) -> dict[str, Any]:
    """The whole protocol (module docstring): ``{"mAP", "per_class": {name: {"ap", "cost", "cv_ap"}}}``."""
    import warnings

    from sklearn.exceptions import ConvergenceWarning

    if not costs or any(c <= 0 for c in costs):
        raise ValueError(f"SVM costs must be positive numbers, got {list(costs)}")
    train_x, test_x = l2_normalize(train_features), l2_normalize(test_features)
    per_class: dict[str, dict[str, Any]] = {}
    for index, name in enumerate(classes):
        positive = train_targets[:, index] == PRESENT
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ConvergenceWarning)  # max_iter=2000 as the benchmark
                clf, cost, cv_ap = train_class_svm(train_x, positive, costs)
        except ValueError as err:
            raise ValueError(f"class {name!r}: {err}") from None
        ap = voc_average_precision(clf.decision_function(test_x), test_targets[:, index])
        per_class[name] = {"ap": ap, "cost": cost, "cv_ap": cv_ap}
    aps = [v["ap"] for v in per_class.values() if not np.isnan(v["ap"])]
    return {"mAP": float(np.mean(aps)) if aps else float("nan"), "per_class": per_class}
