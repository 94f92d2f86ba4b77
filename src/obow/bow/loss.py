"""The training loss of OBoW (paper eq. 3): the student's predicted BoW against the teacher's target."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from obow.bow.targets import at_least_float32, bow_perplexity, kl_to_mean_bow


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


@torch.no_grad()
def prediction_diagnostics(logits: Tensor) -> dict[str, Tensor]:
    """How image-specific the student's predicted BoWs are, from its ``[N, K]`` logits (one row a view).

    ``predicted_kl_to_mean``: ``mean_i KL(p_i || mean_j p_j)`` of the predictions ``p = softmax(logits)``, 0 for
    a student that predicts the same BoW for every view; the targets' ``kl_to_mean_bow`` is what predictions
    that matched their targets would reach. ``predicted_perplexity_image`` / ``_batch``: the perplexity of
    each prediction (mean over views) and of their mean, as the targets' ``perplexity_image`` / ``_batch``.
    """
    p = F.softmax(at_least_float32(logits.detach()), dim=-1)
    batch, image = bow_perplexity(p)
    return {
        "predicted_kl_to_mean": kl_to_mean_bow(p),
        "predicted_perplexity_image": image,
        "predicted_perplexity_batch": batch,
    }
