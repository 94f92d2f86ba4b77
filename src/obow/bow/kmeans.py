"""Off-line k-means (Lloyd's algorithm) in plain torch: BoWNet's static vocabulary (Table 5)."""

from __future__ import annotations

import torch
from torch import Tensor

from obow.bow.targets import squared_distances

#: Entries of one block of the ``[rows, K]`` distance matrix in :func:`nearest_centroids` (256 MB in float32).
DISTANCE_BLOCK = 2**26


def kmeans_init(x: Tensor, k: int, generator: torch.Generator | None = None) -> Tensor:
    """``k`` distinct rows of ``x`` ``[N, C]``, chosen uniformly at random (the indices drawn on the CPU)."""
    if x.dim() != 2:
        raise ValueError(f"k-means takes points [N, C], got shape {tuple(x.shape)}")
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    if x.shape[0] < k:
        raise ValueError(f"k-means with k={k} needs at least {k} points, got {x.shape[0]}")
    index = torch.randperm(x.shape[0], generator=generator)[:k].to(x.device)
    return x[index].clone()


def nearest_centroids(x: Tensor, centroids: Tensor) -> tuple[Tensor, Tensor]:
    """Index ``[N]`` of the nearest of ``centroids`` ``[K, C]`` for every row of ``x`` ``[N, C]``, and the
    squared distance to it ``[N]``; computed in blocks of rows, so that ``[N, K]`` is never held whole."""
    rows = max(1, DISTANCE_BLOCK // centroids.shape[0])
    nearest, distance = [], []
    for part in x.split(rows):
        d, i = squared_distances(part.unsqueeze(0), centroids)[0].min(dim=1)
        nearest.append(i)
        distance.append(d)
    return torch.cat(nearest), torch.cat(distance)


def lloyd_step(x: Tensor, centroids: Tensor, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """One Lloyd iteration: assign every point to its nearest centroid, move each centroid to the mean of its
    points. A centroid that no point chose is re-seeded with a random point of ``x``. Returns the new
    centroids and the mean squared distance of the points to the old ones (the k-means objective)."""
    nearest, distance = nearest_centroids(x, centroids)
    k = centroids.shape[0]
    counts = torch.bincount(nearest, minlength=k)
    sums = torch.zeros_like(centroids).index_add_(0, nearest, x)
    new = sums / counts.clamp_min(1).unsqueeze(1).to(x.dtype)
    empty = torch.nonzero(counts == 0).flatten()
    if empty.numel():
        pick = torch.randint(x.shape[0], (empty.numel(),), generator=generator).to(x.device)
        new[empty] = x[pick]
    return new, distance.mean()


def kmeans(x: Tensor, k: int, iterations: int, generator: torch.Generator | None = None) -> Tensor:
    """``k`` centroids ``[k, C]`` of the points ``x`` ``[N, C]``: random distinct points as the start
    (:func:`kmeans_init`), then ``iterations`` Lloyd iterations (:func:`lloyd_step`).

    Plain torch rather than scikit-learn's ``KMeans``: it runs where ``x`` is, i.e. on the training GPU, on the
    teacher's features (ResNet-50: 160k points of 1024 or 2048 dimensions, K = 8192), without a copy to the
    host. The random draws come from ``generator`` (a CPU generator), else from torch's global one.
    """
    if not isinstance(iterations, int) or iterations < 0:
        raise ValueError(f"iterations must be an integer >= 0, got {iterations!r}")
    centroids = kmeans_init(x, k, generator)
    for _ in range(iterations):
        centroids, _ = lloyd_step(x, centroids, generator)
    return centroids
