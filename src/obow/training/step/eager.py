"""``train.compile: off`` and ``networks``: PyTorch's eager step (:class:`EagerStep`), the one every run can take:
fused SGD with a float learning rate, fp16's gradient scaler when asked, several processes
(DistributedDataParallel)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from obow.config import Config
from obow.methods.base import Method
from obow.training.run.precision import precision_context
from obow.training.step.shared import configure_optimizer, forward_backward

__all__ = ["EagerStep"]


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
