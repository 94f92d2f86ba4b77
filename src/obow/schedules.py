"""Schedules as pure functions of the training iteration (so that resuming needs nothing but the counter)."""

from __future__ import annotations

import math


def cosine_anneal(iteration: float, total: float, start: float, end: float) -> float:
    """``end + (start - end) * (1 + cos(pi * iteration / total)) / 2``, clamped to the end after ``total``."""
    if total <= 0:
        return end
    progress = min(max(iteration / total, 0.0), 1.0)
    return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * progress))


def teacher_momentum(iteration: int, total_iterations: int, base: float = 0.99, schedule: str = "cosine") -> float:
    """Momentum ``alpha`` of the teacher EMA at ``iteration`` (paper eq. 2, official notes 2.10).

    ``"cosine"``: from ``base`` at iteration 0 to 1 at ``total_iterations``, per iteration.
    ``"constant"``: ``base`` throughout (the fixed-alpha rows of the paper's Table 2).
    """
    if schedule == "constant":
        return base
    return cosine_anneal(iteration, total_iterations, base, 1.0)


def run_warmup(warmup_epochs: float, epochs: int) -> float:
    """The warm-up a run of ``epochs`` epochs takes when ``optim.warmup_epochs`` asks for ``warmup_epochs``: as
    asked, or half the run when that is not shorter than the run (a 1-epoch run of a recipe with a 1-epoch
    warm-up keeps half its length for the cosine part rather than being refused). The recipe keeps what was
    asked, so that the same run extended (a larger ``optim.epochs``) warms up as asked once it is long enough."""
    return epochs / 2 if warmup_epochs >= epochs else warmup_epochs


def learning_rate(
    iteration: int,
    iterations_per_epoch: int,
    *,
    base_lr: float,
    epochs: int,
    warmup_epochs: float = 0.0,
    end_lr: float = 0.0,
    cosine_per_epoch: bool = True,
) -> float:
    """Linear warm-up from 0 over ``warmup_epochs`` (per iteration; :func:`run_warmup`: half the run when it is
    not shorter than the run), then cosine from ``base_lr`` to ``end_lr``.

    With ``cosine_per_epoch`` (the official code, notes 2.12) the cosine steps once per epoch, evaluated at the
    epoch's start; otherwise it is smooth per iteration.
    """
    warmup_epochs = run_warmup(warmup_epochs, epochs)
    warmup_iterations = warmup_epochs * iterations_per_epoch
    if iteration < warmup_iterations:
        return base_lr * iteration / warmup_iterations
    if cosine_per_epoch:
        epoch = iteration // iterations_per_epoch
        return cosine_anneal(epoch - warmup_epochs, epochs - warmup_epochs, base_lr, end_lr)
    total = epochs * iterations_per_epoch
    return cosine_anneal(iteration - warmup_iterations, total - warmup_iterations, base_lr, end_lr)
