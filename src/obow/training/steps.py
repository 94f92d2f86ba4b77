"""One training step, three ways: the run's build chooses one (:func:`build_step`), the loop calls it.

Every step has the same call, ``metrics = step(teacher_images, student_views, lr)``: one optimiser step at learning
rate ``lr`` on a batch already on the device, returning the step's detached metrics (device tensors, ``"loss"``
among them). The loop sets the model's ``diagnose`` (a logged step computes the collapse diagnostics) and
``host_iteration`` before each call and does not know which step it calls:

* :class:`EagerStep` (``train.compile: off`` and ``networks``): PyTorch's eager execution, fused SGD with a float
  learning rate, fp16's gradient scaler when asked, several processes (DistributedDataParallel);
* :class:`~obow.training.compiled.CompiledStep` (``step``): the forward and backward pass and the optimiser step
  as two ``torch.compile`` graphs;
* :class:`~obow.training.graphed.GraphedStep` (``graph``): the eager step captured once as a CUDA graph and
  replayed, no compiler.

What a method must offer for the last two is part of the method contract (:mod:`obow.methods.base`):
``step`` and ``graph`` in its :attr:`~obow.methods.base.Method.step_modes`, its teacher momentum on the host
(:meth:`~obow.methods.base.Method.current_momentum`) and its host-drawn random numbers
(:meth:`~obow.methods.base.Method.draw_host_inputs`). :func:`check_step_mode` refuses, in one line, a mode a
run cannot use, before its folder is made.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from obow import distributed as D
from obow.config import Config
from obow.methods import method_class
from obow.methods.base import Method
from obow.training.precision import precision_context

__all__ = [
    "EagerStep",
    "TrainingStep",
    "build_step",
    "check_step_mode",
    "forward_backward",
    "step_forward_backward",
    "to_device",
    "write_host_inputs",
]

log = logging.getLogger("obow")


class TrainingStep(Protocol):
    """What the loop calls once a batch: one optimiser step at ``lr``; returns the step's detached metrics."""

    #: the ``train.compile`` mode the step runs as (``off``, ``networks``, ``step`` or ``graph``)
    mode: str

    def __call__(self, teacher_images: Tensor, student_views: list[Tensor], lr: float) -> dict[str, Tensor]: ...


def check_step_mode(cfg: Config) -> str | None:
    """Why ``cfg`` cannot train with its ``train.compile`` mode (one line), or ``None`` when it can."""
    mode, method = cfg.train.compile, cfg.model.method
    if mode not in ("step", "graph"):
        return None
    if mode not in method_class(method).step_modes:
        return (
            f"train.compile={mode} does not support model.method={method}: its step reads host values each step "
            "(not yet made tensors); use train.compile=networks or off"
        )
    if cfg.train.precision == "fp16":
        return (
            f"train.compile={mode} does not support train.precision=fp16 (its gradient scaler reads the device); "
            "use bf16"
        )
    if D.is_distributed():
        return f"train.compile={mode} does not support several processes yet; use train.compile=networks or off"
    if mode == "step" and not hasattr(torch._dynamo.config, "trace_autograd_ops"):
        return (
            f"train.compile=step needs a torch that traces Tensor.backward (torch._dynamo.config.trace_autograd_ops); "
            f"this is torch {torch.__version__}"
        )
    return None


def build_step(
    cfg: Config,
    model: Method,
    step_model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    device: torch.device,
) -> TrainingStep:
    """The run's step for ``train.compile`` (checked by :func:`check_step_mode` before), with the optimiser as that
    step wants it, whatever run wrote the state it resumed (:func:`~obow.training.compiled.configure_optimizer`).
    ``graph`` where CUDA graphs cannot run (a CPU) says so in one line and runs the eager step."""
    from obow.training import compiled, graphed

    mode = cfg.train.compile
    if mode == "step":
        return compiled.CompiledStep(
            model,
            optimizer,
            step_forward_backward(cfg, model),
            backend=compiled.BACKEND,
            options=compiled.OPTIONS,
        )
    if mode == "graph":
        factory = graphed.graph_factory(device)
        if factory is not None:
            return graphed.GraphedStep(model, optimizer, step_forward_backward(cfg, model, graphed=True), graph=factory)
        log.warning(
            "train.compile=graph: CUDA graphs need a CUDA device, and this run is on the %s: it runs the eager step "
            "(the same numbers, without the replay)",
            device.type,
        )
    return EagerStep(cfg, model, step_model, optimizer, scaler, device)


class EagerStep:
    """PyTorch's eager step: the learning rate written into the optimiser as a float, gradients set to ``None``,
    the forward and backward pass of the (possibly DDP-wrapped) ``step_model``, the gradient scaler's step and
    update (fp16; otherwise a plain ``optimizer.step()``)."""

    def __init__(
        self,
        cfg: Config,
        model: Method,
        step_model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler,
        device: torch.device,
    ) -> None:
        from obow.training.compiled import configure_optimizer

        self.mode = cfg.train.compile if cfg.train.compile in ("off", "networks") else "off"
        self.step_model = step_model
        self.optimizer = optimizer
        self.scaler = scaler
        self.autocast = precision_context(cfg.train.precision, device)
        self.per_group = cfg.train.backward_per_group and model.supports_groups
        configure_optimizer(optimizer, step=False)

    def __call__(self, teacher_images: Tensor, student_views: list[Tensor], lr: float) -> dict[str, Tensor]:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        metrics = forward_backward(
            self.step_model, teacher_images, student_views, self.scaler, self.autocast, self.per_group
        )
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return metrics


def step_forward_backward(
    cfg: Config, model: Method, *, graphed: bool = False
) -> Callable[[Tensor, list[Tensor]], dict[str, Tensor]]:
    """:func:`forward_backward` of ``model`` as a compiled or graphed step calls it (no gradient scaler: fp32 or
    bf16). ``graphed``: autocast without its cache of cast weights, which must not outlive a CUDA graph's capture."""
    from obow.training.compiled import step_per_group

    device = next(model.parameters()).device
    autocast = precision_context(cfg.train.precision, device, cache=not graphed)
    requested = cfg.train.backward_per_group and model.supports_groups
    per_group = requested if graphed else step_per_group(requested)
    return lambda teacher_images, student_views: forward_backward(
        model, teacher_images, student_views, None, autocast, per_group
    )


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
        no_sync = step_model.no_sync() if D.is_distributed() and not last else contextlib.nullcontext()
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


def write_host_inputs(model: Method, student_views: Sequence[Tensor], device: torch.device) -> None:
    """The host-drawn random numbers of the step about to run (:meth:`~obow.methods.base.Method.draw_host_inputs`:
    the same generator and order as the eager step), written into the tensors a compiled or graphed step reads
    (``model.host_inputs``, in place once they exist: a graph keeps reading the same memory)."""
    draws = model.draw_host_inputs(student_views)
    if draws is None:
        return
    held = model.host_inputs
    if held is None or tensor_shapes(held) != tensor_shapes(draws):
        model.host_inputs = draws.to(device)
    else:
        held.copy_(draws, non_blocking=True)


def tensor_shapes(record: Any) -> list[torch.Size]:
    """The shapes of a dataclass of tensors (a method's host inputs)."""
    return [getattr(record, f.name).shape for f in dataclasses.fields(record)]
