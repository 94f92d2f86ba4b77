"""One frozen-feature protocol for comparing pretrained networks: kNN, linear probe, few-shot, diagnostics.

Used by ``obow tables`` and ``benchmarks/quality.py`` so that every row of a comparison (and its random-init
reference) is measured the same way, from one extraction of the ``pool5`` features of the evaluation view:

* weighted kNN (default k=200, T=0.1: the InstDisc / MoCo / lightly protocol), memory = the training
  images, queries = the test images;
* a linear probe on the frozen features (non-affine batch norm + linear layer, the ``resnet18`` preset's SGD
  settings at its rate or, where lower, half the largest stable rate of these features,
  :func:`~obow.evaluate.linear.stable_lr`, as ``obow eval linear`` takes it), trained on the training images'
  centre view, scored on the test images; a probe that still diverges gives no score, and a note says so;
* few-shot episodes (paper section 4.1: cosine prototypical classifier, 200 episodes of ``min(50, classes)``
  ways, 1 and 5 shots, 1 query per class, drawn once from seed 0) on the test images;
* the collapse diagnostics of the test features (effective rank, mean pairwise cosine).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from obow.diagnostics import feature_diagnostics
from obow.evaluate.features import extract_features
from obow.evaluate.fewshot import default_ways, prototype_accuracy, sample_episodes
from obow.evaluate.knn import knn_accuracy
from obow.evaluate.linear import capped_lr, preset_settings, train_linear_probe


def evaluate_features(
    train_x: Tensor,
    train_y: Tensor,
    test_x: Tensor,
    test_y: Tensor,
    *,
    k: int = 200,
    temperature: float = 0.1,
    shots: Sequence[int] = (1, 5),
    episodes: int = 200,
    linear: bool = True,
) -> dict[str, Any]:
    """The protocol's scores (percent) for features already extracted: ``knn``, ``linear``, ``fewshot_<n>``
    (with ``fewshot_<n>_ci``, the 95% half-width), ``effective_rank``, ``mean_cosine``; ``knn_k`` is the k
    used (at most the number of training images), ``linear_lr`` the probe's learning rate. Shots that the test
    set cannot fill, and a linear probe that diverged, are left out, and ``notes`` says why."""
    k = min(k, len(train_y))
    scores: dict[str, Any] = {
        "knn": knn_accuracy(train_x, train_y, test_x, test_y, k=k, temperature=temperature),
        "knn_k": k,
    }
    if linear:
        settings = preset_settings("resnet18")
        classes_seen = int(train_y.max()) + 1
        # the preset's rate (ImageNet's) diverges at once on small sets' batch-normed features (lr 10 against a
        # stable 0.24 on CIFAR-10 features of cifar10_fast at random init): capped as `obow eval linear` caps it
        lr = capped_lr(settings["lr"], train_x, classes_seen, settings["momentum"], batch_norm=True)
        probe = train_linear_probe(
            [train_x],
            train_y,
            test_x,
            test_y,
            epochs=settings["epochs"],
            lr=lr,
            batch_size=settings["batch_size"],
            weight_decay=settings["weight_decay"],
            momentum=settings["momentum"],
            schedule=settings["schedule"],
            milestones=settings["milestones"],
            gamma=settings["gamma"],
            batch_norm=True,
            num_classes=classes_seen,
        )
        scores["linear_lr"] = lr
        if probe["diverged"]:  # its accuracy would be that of a head that blew up, not the features'
            scores.setdefault("notes", []).append(f"linear not measured: the probe diverged at lr {lr:.3g}")
        else:
            scores["linear"] = probe["top1"]
    classes, counts = torch.unique(test_y, return_counts=True)
    for n_shot in shots:
        if len(classes) < 2 or int(counts.min()) < n_shot + 1:
            scores.setdefault("notes", []).append(
                f"{n_shot}-shot not measured: episodes need {n_shot} support and 1 query image per class; "
                + (f"the smallest test class has {int(counts.min())}" if len(classes) >= 2 else "one test class")
            )
            continue
        tasks = sample_episodes(test_y, n_way=default_ways(len(classes)), n_shot=n_shot, n_episodes=episodes, seed=0)
        scores[f"fewshot_{n_shot}"], scores[f"fewshot_{n_shot}_ci"] = prototype_accuracy(test_x, test_y, tasks)
    if len(test_x) > 1:
        scores.update({key: float(v) for key, v in feature_diagnostics(test_x).items()})
    return scores


def evaluate_backbone(
    backbone: torch.nn.Module,
    train_set: Any,
    test_set: Any,
    *,
    device: torch.device | str = "cpu",
    num_workers: int = 0,
    **protocol: Any,
) -> dict[str, Any]:
    """Extract ``pool5`` features of ``train_set`` and ``test_set`` (labelled evaluation datasets, see
    :func:`~obow.data.eval_sets.eval_dataset`) and score them with :func:`evaluate_features`."""
    kwargs: dict[str, Any] = {"batch_size": 256, "device": torch.device(device), "num_workers": num_workers}
    train_x, train_y = extract_features(backbone, train_set, **kwargs)
    test_x, test_y = extract_features(backbone, test_set, **kwargs)
    return evaluate_features(train_x, train_y, test_x, test_y, **protocol)
