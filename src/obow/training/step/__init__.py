"""One training step, three ways: the run's build chooses one (:func:`build_step`), the loop calls it.

Every step has the same call, ``metrics = step(teacher_images, student_views, lr)``: one optimiser step at learning
rate ``lr`` on a batch already on the device, returning the step's detached metrics (device tensors, ``"loss"``
among them). Before each call the loop tells the model what the step needs from it (``model.begin_step(logged,
iteration)``: a logged step computes the collapse diagnostics) and does not know which step it calls:

* :class:`EagerStep` (``train.compile: off`` and ``networks``, :mod:`~obow.training.step.eager`): PyTorch's eager
  execution, fused SGD with a float learning rate, fp16's gradient scaler when asked, several processes
  (DistributedDataParallel);
* :class:`~obow.training.step.compiled.CompiledStep` (``step``): the forward and backward pass and the optimiser step
  as two ``torch.compile`` graphs;
* :class:`~obow.training.step.graphed.GraphedStep` (``graph``): the eager step captured once as a CUDA graph and
  replayed, no compiler.

What a method must offer for the last two is part of the method contract (:mod:`obow.methods.base`):
``step`` and ``graph`` in its :attr:`~obow.methods.base.Method.step_modes`, its teacher momentum on the host
(:meth:`~obow.methods.base.Method.current_momentum`) and its host-drawn random numbers
(:meth:`~obow.methods.base.Method.draw_host_inputs`, written where the step reads them by
:meth:`~obow.methods.base.Method.write_host_inputs`). :func:`check_step_mode` refuses, in one line, a mode a
run cannot use, before its folder is made.

The package, read top to bottom: this module (the step's call, the check, :func:`build_step`); a module per mode
(:mod:`~obow.training.step.eager`, :mod:`~obow.training.step.compiled`, :mod:`~obow.training.step.graphed`);
beneath them what they share (:mod:`~obow.training.step.shared`: the forward and backward pass, the batch on
the device, the optimiser as a step wants it), which imports no mode; and beside them the watch over a step that
compiles (:mod:`~obow.training.step.watch`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor, nn

from obow import distributed as D
from obow.config import Config
from obow.methods import method_class
from obow.methods.base import Method
from obow.training.run.precision import precision_context
from obow.training.step import compiled, graphed
from obow.training.step.eager import EagerStep
from obow.training.step.shared import forward_backward

__all__ = [
    "EagerStep",
    "TrainingStep",
    "build_step",
    "check_step_mode",
    "step_forward_backward",
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
    step wants it, whatever run wrote the state it resumed (:func:`~obow.training.step.shared.configure_optimizer`).
    ``graph`` where CUDA graphs cannot run (a CPU) says so in one line and runs the eager step."""
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


def step_forward_backward(
    cfg: Config, model: Method, *, graphed: bool = False
) -> Callable[[Tensor, list[Tensor]], dict[str, Tensor]]:
    """:func:`forward_backward` of ``model`` as a compiled or graphed step calls it (no gradient scaler: fp32 or
    bf16). ``graphed``: autocast without its cache of cast weights, which must not outlive a CUDA graph's capture."""
    device = next(model.parameters()).device
    autocast = precision_context(cfg.train.precision, device, cache=not graphed)
    requested = cfg.train.backward_per_group and model.supports_groups
    per_group = requested if graphed else compiled.step_per_group(requested)
    return lambda teacher_images, student_views: forward_backward(
        model, teacher_images, student_views, None, autocast, per_group
    )
