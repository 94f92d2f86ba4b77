"""The training loss of OBoW (paper eq. 3): the student's predicted BoW against the teacher's target."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from obow.bow.targets import at_least_float32


def bow_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """``KL(y_T || softmax(logits))`` averaged over all ``B * n`` predictions (official notes 2.8).

    ``logits`` is ``[B, n, K]`` (``n`` views of each image, image-major), ``targets`` is ``[B, K]`` (one per
    image, shared by its views) or ``[B, n, K]`` (one per view, e.g. cut-mixed views). Its gradient is that
    of the paper's cross-entropy (eq. 3); its value is that minus the targets' entropy, so a perfect
    prediction scores 0. Zero target entries contribute exactly 0 (``0 log 0 = 0``).
    """
    if targets.dim() == logits.dim() - 1:
        targets = targets.unsqueeze(1)
    if (
        targets.dim() != logits.dim()
        or targets.shape[::2] != logits.shape[::2]
        or targets.shape[1] not in (1, logits.shape[1])
    ):
        raise ValueError(
            f"targets must be [B, K] or [B, n, K] for logits {tuple(logits.shape)}, got {tuple(targets.shape)}"
        )
    log_probs = F.log_softmax(at_least_float32(logits), dim=-1)
    cross_entropy = -(targets * log_probs).sum(dim=-1)
    neg_entropy = torch.special.xlogy(targets, targets).sum(dim=-1)
    return (cross_entropy + neg_entropy).mean()
