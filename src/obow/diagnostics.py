"""Collapse diagnostics of the student's pooled features (not in the paper; used to watch short runs).

A self-distillation run that collapses shows it first in its features: their spread over dimensions shrinks
(dimensional collapse) and every image ends up pointing the same way. Two numbers measure it on a batch of
``pool5`` vectors ``[N, D]``:

* :func:`effective_rank`: ``exp`` of the entropy of the singular values normalised to sum to one (RankMe,
  Garrido et al., ICML 2023; the features are not centred, as there). Between 1 (all features on one line)
  and ``min(N, D)`` (a flat spectrum);
* :func:`mean_pairwise_cosine`: the mean cosine similarity over all pairs of distinct features; near 1 when
  every feature points the same way. Non-negative ``pool5`` features (after a ReLU) start well above 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


@torch.no_grad()
def effective_rank(features: Tensor, eps: float = 1e-12) -> Tensor:
    """``exp(H(p))`` with ``p = s / sum(s)``, ``s`` the singular values of ``features`` ``[N, D]``; ``nan`` when a
    feature is not finite (a diverged run, which the loop then stops: the SVD would fail on it), decided on the
    device without reading it."""
    if features.dim() != 2 or min(features.shape) < 1:
        raise ValueError(f"features must be [N, D] with N, D >= 1, got {tuple(features.shape)}")
    x = features.double()
    finite = torch.isfinite(x).all()
    s = torch.linalg.svdvals(torch.where(finite, x, 0.0))
    p = s / s.sum().clamp_min(eps)
    rank = torch.exp(-torch.special.xlogy(p, p).sum())
    return torch.where(finite, rank, torch.nan).float()


@torch.no_grad()
def mean_pairwise_cosine(features: Tensor) -> Tensor:
    """Mean of ``cos(f_i, f_j)`` over the ``N (N - 1)`` ordered pairs ``i != j`` of ``features`` ``[N, D]``."""
    n = features.shape[0]
    if features.dim() != 2 or n < 2:
        raise ValueError(f"features must be [N, D] with N >= 2, got {tuple(features.shape)}")
    unit = F.normalize(features.double(), dim=1)
    total = unit.sum(dim=0)
    # sum over all pairs of <u_i, u_j> = ||sum u||^2; remove the N diagonal terms ||u_i||^2 (1, or 0 for a zero row)
    off_diagonal = total.dot(total) - (unit * unit).sum()
    return (off_diagonal / (n * (n - 1))).float()


def feature_diagnostics(features: Tensor) -> dict[str, Tensor]:
    """Both diagnostics of a ``[N, D]`` batch, under the names the logs use."""
    features = features.detach()
    return {"effective_rank": effective_rank(features), "mean_cosine": mean_pairwise_cosine(features)}
