"""What the step's modes share, beneath them (it imports none): the forward and backward pass of one step
(:func:`forward_backward`), the batch on the device (:func:`to_device`), and the optimiser as each mode wants it
(:func:`configure_optimizer`, :func:`start_momentum_buffers`)."""

from __future__ import annotations

import contextlib
import logging
from typing import cast

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel as DDP

from obow import distributed as D

__all__ = [
    "configure_optimizer",
    "forward_backward",
    "start_momentum_buffers",
    "to_device",
]

log = logging.getLogger("obow")


def forward_backward(
    step_model: nn.Module,
    teacher_images: Tensor,
    student_views: list[Tensor],
    scaler: torch.amp.GradScaler | None,
    autocast: contextlib.AbstractContextManager,
    per_group: bool,
) -> dict[str, Tensor]:
    """Forward and backward of one step; returns the step's detached metrics (``"loss"``: the whole loss).
    ``scaler``: fp16's gradient scaler, or ``None`` (a compiled or graphed step).

    With ``per_group`` each student view group is back-propagated before the next is built (the loss is a
    sum over groups), so only one group's activations are held at a time; under DDP the gradients are
    synchronised once, in the last group's backward pass.
    """
    if not per_group or len(student_views) == 1:
        with autocast:
            output = step_model(teacher_images, student_views)
        scaled(scaler, output.loss).backward()
        return output.metrics
    metrics: dict[str, Tensor] = {}
    total = torch.zeros((), device=teacher_images.device)
    grad_scale = scaler.get_scale() if scaler is not None and scaler.is_enabled() else 1.0
    for g in range(len(student_views)):
        last = g == len(student_views) - 1
        distributed = D.is_distributed() and not last  # DistributedDataParallel: synchronised by the last group
        no_sync = cast(DDP, step_model).no_sync() if distributed else contextlib.nullcontext()
        with no_sync:
            with autocast:
                output = step_model(teacher_images, student_views, group=g, grad_scale=grad_scale)
            scaled(scaler, output.loss).backward()
        metrics.update(output.metrics)
        total += output.metrics["loss"]
    metrics["loss"] = total
    return metrics


def scaled(scaler: torch.amp.GradScaler | None, loss: Tensor) -> Tensor:
    return loss if scaler is None else scaler.scale(loss)


def to_device(views: dict[str, Tensor], device: torch.device, channels_last: bool) -> tuple[Tensor, list[Tensor]]:
    """The teacher batch and the student's view groups (crops, then patches) on ``device``."""
    fmt = torch.channels_last if channels_last else torch.contiguous_format

    def move(x: Tensor) -> Tensor:
        return x.to(device, non_blocking=True, memory_format=fmt) if x.dim() == 4 else x.to(device, non_blocking=True)

    return move(views["teacher"]), [move(views[k]) for k in ("crops", "patches") if k in views]


def configure_optimizer(optimizer: torch.optim.Optimizer, step: bool, graph: bool = False) -> Tensor | None:
    """The optimiser as a compiled step (``step``), a graphed one (``step`` and ``graph``) or the eager one needs
    it, whatever run wrote its state: ``foreach`` with a 0-d tensor learning rate (compiled: Dynamo does not trace
    the fused kernel), ``fused`` with a 0-d tensor one (graphed: the fused kernel reads it on the device, the same
    numbers as a float), the tensor returned and written in place by the step; or ``fused`` with a float one (the
    loop sets it each step)."""
    lr = None
    if step:
        device = optimizer.param_groups[0]["params"][0].device
        lr = torch.zeros((), device=device)
    fused = not step or graph
    for group in optimizer.param_groups:
        group.update(fused=fused, foreach=None if fused else True, lr=lr if step else float(group["lr"]))
    return lr


def start_momentum_buffers(optimizer: torch.optim.Optimizer) -> None:
    """SGD's momentum buffers as zeros where the optimiser has none yet (a new run), so that the first step is the
    graph of every later one. The same values: SGD's first step sets a buffer to the gradient, which
    ``momentum * 0 + gradient`` is."""
    for group in optimizer.param_groups:
        if group.get("momentum", 0.0) == 0.0:
            continue
        for p in group["params"]:
            state = optimizer.state[p]
            if state.get("momentum_buffer") is None:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
