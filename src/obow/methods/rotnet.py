"""RotNet (Gidaris et al., ICLR 2018): predict which of four rotations was applied; BoWNet's first teacher.

``model.method=rotnet`` (paper Table 5: 40 epochs of RotNet pretrain BoWNet's first teacher). Each image of
the student's first view group (the crops; the teacher's images when there is no group) is fed in all four
rotations, 0, 90, 180 and 270 degrees counter-clockwise, in one batch, and a linear layer on ``pool5``
classifies the rotation with a cross-entropy loss. The rotated copies are stacked rotation-major: rows
``r * N : (r + 1) * N`` hold rotation ``r`` of the ``N`` images, label ``r``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from obow.backbones import Backbone, build_backbone
from obow.bow.targets import at_least_float32
from obow.config import Config
from obow.diagnostics import feature_diagnostics
from obow.methods.base import Method, StepOutput, whole_recipe

NUM_ROTATIONS = 4


def rotate_batch(images: Tensor) -> tuple[Tensor, Tensor]:
    """Every image of ``[N, C, s, s]`` rotated by 0, 90, 180 and 270 degrees (counter-clockwise, as
    ``torch.rot90``): ``[4N, C, s, s]``, rotation-major, and the labels ``[4N]`` (0..3)."""
    if images.dim() != 4 or images.shape[-1] != images.shape[-2]:
        raise ValueError(
            f"rotation prediction needs square images [N, C, s, s] (a rotated batch must keep its shape), "
            f"got {tuple(images.shape)}: use square crops (views.crop_size) and views.teacher_size"
        )
    rotated = torch.cat([torch.rot90(images, r, dims=(-2, -1)) for r in range(NUM_ROTATIONS)])
    labels = torch.arange(NUM_ROTATIONS, device=images.device).repeat_interleave(images.shape[0])
    return rotated, labels


class RotNet(Method):
    """The student backbone and a linear rotation classifier on its ``pool5`` vector.

    Buffers: ``iteration`` (steps taken). The student is called once per step on all groups' images, so the
    training loop calls it with ``group=None`` (:attr:`supports_groups` is false).
    """

    iteration: Tensor

    supports_groups = False

    def __init__(self, student: Backbone, *, total_iterations: int) -> None:
        super().__init__()
        self.student = student
        self.teacher = None  # RotNet learns from the rotation labels alone
        self.classifier = nn.Linear(student.num_features, NUM_ROTATIONS)
        self.total_iterations = total_iterations
        self.register_buffer("iteration", torch.zeros((), dtype=torch.long))

    @classmethod
    def from_config(cls, cfg: Config, total_iterations: int) -> RotNet:
        cfg = whole_recipe(cfg, "RotNet")
        m = cfg.model
        return cls(build_backbone(m.arch, m.stem, m.arch_options), total_iterations=total_iterations)

    def realign_iteration(self, iteration: int) -> None:
        """The ``iteration`` buffer (the steps done) set to ``iteration`` (:meth:`Method.realign_iteration
        <obow.methods.base.Method.realign_iteration>`)."""
        self.iteration.fill_(iteration)

    def forward(
        self,
        teacher_images: Tensor,
        student_views: Sequence[Tensor],
        group: int | None = None,
        grad_scale: float = 1.0,
    ) -> StepOutput:
        """The rotation loss of the first view group's images (``[B, n, 3, s, s]`` or ``[B, 3, s, s]``)."""
        if group not in (None, 0):
            raise ValueError("RotNet computes its loss in one pass: call it with group=None")
        images = student_views[0] if len(student_views) else teacher_images
        if images.dim() == 5:
            images = images.flatten(0, 1)
        rotated, labels = rotate_batch(images)
        features = self.student(rotated).pool5
        logits = at_least_float32(self.classifier(features))
        loss = F.cross_entropy(logits, labels)
        if self.training:
            self.iteration += 1
        metrics = {
            "loss": loss.detach(),
            "rotnet/accuracy": (logits.detach().argmax(dim=1) == labels).float().mean(),
        }
        upright = features[: images.shape[0]]  # diagnostics on the images as they are (rotation 0)
        if self.diagnose and upright.shape[0] > 1:
            metrics.update({f"student/{k}": v for k, v in feature_diagnostics(upright).items()})
        return StepOutput(loss=loss, metrics=metrics, targets={})
