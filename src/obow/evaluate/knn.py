"""Weighted k-nearest-neighbour classification of frozen features.

Not one of the paper's protocols (section 4.1 uses a linear probe and few-shot episodes) but the cheap
monitor other libraries publish (peers notes: ``k=200, T=0.1`` in InstDisc / the MoCo Colab / lightly,
``k=20`` in solo-learn and DINO). Each of the ``k`` most similar memory features (cosine similarity of
L2-normalised vectors) votes for its class with weight ``exp(sim / T)``; the class with the largest summed
vote wins.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from obow.checks import check_positive

#: The two settings reported by default: InstDisc / MoCo-Colab / lightly, and solo-learn / DINO.
DEFAULT_KS = (200, 20)
DEFAULT_TEMPERATURE = 0.1


def knn_scores(
    train_features: Tensor,
    train_labels: Tensor,
    test_features: Tensor,
    *,
    k: int = 200,
    temperature: float = 0.1,
    num_classes: int | None = None,
    chunk_size: int = 1024,
) -> Tensor:
    """Summed ``exp(sim / T)`` votes of each query's ``k`` nearest memory features, ``[M, num_classes]``.

    ``k`` larger than the memory is clamped to its size (every memory feature then votes). Queries are
    processed ``chunk_size`` at a time, so memory stays ``O(chunk_size * N)`` whatever the number of queries.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    check_positive("temperature", temperature)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    if train_features.ndim != 2 or test_features.ndim != 2 or train_features.shape[1] != test_features.shape[1]:
        raise ValueError(
            f"features must be [N, c] and [M, c] with the same c, got {tuple(train_features.shape)} "
            f"and {tuple(test_features.shape)}"
        )
    if train_labels.shape != (train_features.shape[0],):
        raise ValueError(f"train_labels must be [{train_features.shape[0]}], got {tuple(train_labels.shape)}")
    if train_features.shape[0] == 0:
        raise ValueError("the kNN memory (train_features) is empty")
    train_labels = train_labels.long()
    if num_classes is None:
        num_classes = int(train_labels.max()) + 1
    memory = F.normalize(train_features.float(), dim=1)
    k = min(k, memory.shape[0])
    out = []
    for start in range(0, test_features.shape[0], chunk_size):
        queries = F.normalize(test_features[start : start + chunk_size].float(), dim=1)
        sims, idx = (queries @ memory.T).topk(k, dim=1)
        votes = torch.zeros(queries.shape[0], num_classes, dtype=memory.dtype, device=memory.device)
        # exp(sim / T) <= exp(1 / T): fine in float32 for T >= ~0.012; smaller T would need a max-shift.
        votes.scatter_add_(1, train_labels[idx], (sims / temperature).exp())
        out.append(votes)
    if not out:
        return torch.zeros(0, num_classes)
    return torch.cat(out)


def knn_predict(
    train_features: Tensor,
    train_labels: Tensor,
    test_features: Tensor,
    *,
    k: int = 200,
    temperature: float = 0.1,
    num_classes: int | None = None,
    chunk_size: int = 1024,
) -> Tensor:
    """Predicted class of each query, ``[M]`` (see :func:`knn_scores`); ties go to the lower class index."""
    scores = knn_scores(
        train_features,
        train_labels,
        test_features,
        k=k,
        temperature=temperature,
        num_classes=num_classes,
        chunk_size=chunk_size,
    )
    return scores.argmax(dim=1)


def knn_accuracy(
    train_features: Tensor,
    train_labels: Tensor,
    test_features: Tensor,
    test_labels: Tensor,
    *,
    k: int = 200,
    temperature: float = 0.1,
    num_classes: int | None = None,
    chunk_size: int = 1024,
    topk: int = 1,
) -> float:
    """Top-``topk`` accuracy (percent) of the weighted kNN classifier on ``test_labels``."""
    if num_classes is None:
        num_classes = int(max(train_labels.max(), test_labels.max())) + 1
    scores = knn_scores(
        train_features,
        train_labels,
        test_features,
        k=k,
        temperature=temperature,
        num_classes=num_classes,
        chunk_size=chunk_size,
    )
    return topk_accuracy(scores, test_labels, topk)


def top1_top5(scores: Tensor, labels: Tensor) -> dict[str, float]:
    """``{"top1": ..., "top5": ...}`` in percent; ``top5`` only when there are at least 5 classes."""
    result = {"top1": topk_accuracy(scores, labels, 1)}
    if scores.shape[1] >= 5:
        result["top5"] = topk_accuracy(scores, labels, 5)
    return result


def topk_accuracy(scores: Tensor, labels: Tensor, topk: int = 1) -> float:
    """Percentage of rows of ``scores`` whose ``topk`` highest entries include the row's label."""
    if scores.shape[0] != labels.shape[0]:
        raise ValueError(f"{scores.shape[0]} score rows for {labels.shape[0]} labels")
    if scores.shape[0] == 0:
        raise ValueError("no test samples to score")
    if not 1 <= topk <= scores.shape[1]:
        raise ValueError(f"topk must be between 1 and the number of classes ({scores.shape[1]}), got {topk}")
    top = scores.topk(topk, dim=1).indices
    hits = (top == labels.long().view(-1, 1).to(top.device)).any(dim=1)
    return 100.0 * hits.float().mean().item()
