"""The method contract: what the training loop needs from every pretraining method, written once.

A method is an ``nn.Module`` (a subclass of :class:`Method`) with

* ``student``: the backbone being trained (what ``obow eval`` and ``obow export`` read, as the ``student.*``
  entries of the checkpoint);
* ``teacher``: the network that makes the targets (OBoW's EMA teacher, MoCo v2's key encoder, BoWNet's static
  teacher), or ``None`` (RotNet); it never gets gradients;
* :attr:`~Method.supports_groups`: whether :meth:`~Method.forward` may be called one view group at a time
  (``group=0, 1, ...``), so that the loop back-propagates each group before building the next;
* :meth:`~Method.prepare`: work done once before the first step of a new run (not on resumption: what it
  computes must live in the ``state_dict``), e.g. BoWNet's off-line k-means; nothing by default;
* :meth:`~Method.forward` ``(teacher_images, student_views, group=None, grad_scale=1.0)`` returning a
  :class:`StepOutput`: the teacher's images ``[B, 3, T, T]`` and the student's view groups
  ``[B, n, 3, h, w]``, as :func:`obow.methods.build_views` and the loop's ``to_device`` give them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from torch import Tensor, nn

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

    from obow.config import Config
    from obow.data.folders import ImageList


@dataclass
class StepOutput:
    """One training step of a method: the loss to back-propagate and detached diagnostics (``metrics``, with
    ``"loss"`` among them), computed without extra passes; ``targets`` are what the student was asked to
    predict (OBoW: the BoW of every level; MoCo v2: the keys), for tests and inspection."""

    loss: Tensor
    metrics: dict[str, Tensor]
    targets: dict[str, Tensor] = field(default_factory=dict)


class Method(nn.Module):
    """Base class of the pretraining methods (see the module docstring for the contract)."""

    #: The training loop may call :meth:`forward` group by group (``group=0, 1, ...``).
    supports_groups: ClassVar[bool] = True

    student: nn.Module
    teacher: nn.Module | None

    def prepare(self, images: ImageList, cfg: Config, device: torch.device) -> Any:
        """Once, before the first step of a new run; nothing by default."""
        return None

    def forward(
        self,
        teacher_images: Tensor,
        student_views: Sequence[Tensor],
        group: int | None = None,
        grad_scale: float = 1.0,
    ) -> StepOutput:
        raise NotImplementedError
