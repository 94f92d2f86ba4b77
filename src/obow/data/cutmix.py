"""CutMix for the student's views (Yun et al., ICCV 2019; BoWNet's augmentation, Table 4's "1 x 224 + cutmix").

One box per view group: every view of image ``i`` gets, inside the box, the pixels of the same view of image
``perm[i]``, and its BoW target becomes ``w * y_i + (1 - w) * y_perm[i]`` with ``w`` the share of the view
that still shows image ``i`` (1 - box area / view area).

The box (as CutMix draws it): ``lam ~ Beta(1, 1)`` (uniform on [0, 1]), sides ``int(H * sqrt(1 - lam))`` by
``int(W * sqrt(1 - lam))``, centre uniform over the pixels, then clipped to the view; the mixing weight is
recomputed from the clipped area, so it is exact whatever the clipping did.

The random numbers come from the ``generator`` given (on the CPU), else from torch's global CPU generator,
whose state every checkpoint holds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Box:
    """Rows ``top:bottom`` and columns ``left:right`` (end excluded) of an ``height x width`` view."""

    top: int
    bottom: int
    left: int
    right: int
    height: int
    width: int

    @property
    def area(self) -> int:
        return (self.bottom - self.top) * (self.right - self.left)

    @property
    def weight(self) -> float:
        """The share of the view left to its own image: ``1 - area / (height * width)``."""
        return 1.0 - self.area / (self.height * self.width)


def clip_box(center_y: int, center_x: int, cut_h: int, cut_w: int, height: int, width: int) -> Box:
    """The ``cut_h x cut_w`` box centred on ``(center_y, center_x)`` (top-left at centre - side // 2),
    clipped to the ``height x width`` view."""
    top, left = center_y - cut_h // 2, center_x - cut_w // 2
    return Box(
        top=min(max(top, 0), height),
        bottom=min(max(top + cut_h, 0), height),
        left=min(max(left, 0), width),
        right=min(max(left + cut_w, 0), width),
        height=height,
        width=width,
    )


def draw_box(height: int, width: int, generator: torch.Generator | None = None) -> Box:
    """A CutMix box for an ``height x width`` view: ``lam ~ Beta(1, 1)``, side ratio ``sqrt(1 - lam)``,
    uniform centre, clipped (see the module's docstring)."""
    if height < 1 or width < 1:
        raise ValueError(f"cutmix needs a view of at least 1x1 pixels, got {height}x{width}")
    lam = float(torch.rand((), generator=generator))  # Beta(1, 1) is the uniform distribution
    ratio = math.sqrt(1.0 - lam)
    center_y = int(torch.randint(height, (), generator=generator))
    center_x = int(torch.randint(width, (), generator=generator))
    return clip_box(center_y, center_x, int(height * ratio), int(width * ratio), height, width)


def draw_permutation(batch: int, generator: torch.Generator | None = None) -> Tensor:
    """Which image each image takes its box from (a random permutation of ``batch`` indices, on the CPU)."""
    return torch.randperm(batch, generator=generator)


def cutmix(images: Tensor, box: Box, perm: Tensor) -> tuple[Tensor, Tensor]:
    """Paste ``box`` of ``images[perm[i]]`` into ``images[i]``; nothing outside the box changes.

    ``images`` is ``[N, ..., h, w]`` (e.g. ``[N, 3, h, w]`` or a view group ``[B, n, 3, h, w]``: ``perm``
    indexes the first dimension, so all views of image ``i`` take their box from image ``perm[i]``). Returns
    the mixed copy and the mixing weights ``1 - area / (h * w)``, one per image of the leading dimensions
    (all but the last three), in the images' dtype.
    """
    h, w = images.shape[-2:]
    if (box.height, box.width) != (h, w):
        raise ValueError(f"the box was drawn for {box.height}x{box.width} views, the images are {h}x{w}")
    if perm.shape != (images.shape[0],):
        raise ValueError(f"perm must hold one index per image ({images.shape[0]}), got shape {tuple(perm.shape)}")
    mixed = images.clone()
    perm = perm.to(images.device)
    rows, cols = slice(box.top, box.bottom), slice(box.left, box.right)
    mixed[..., rows, cols] = images[perm][..., rows, cols]
    weights = torch.full(images.shape[:-3], box.weight, dtype=images.dtype, device=images.device)
    return mixed, weights


def draw_cutmix(shapes: Sequence[tuple[int, int, int]], generator: torch.Generator | None = None) -> CutmixDraws:
    """The draws of one step's view groups, ``shapes[g] = (batch, height, width)``: for each group in order a
    :func:`draw_box` then a :func:`draw_permutation` (the numbers one group after another drew), as tensors on
    the CPU: :class:`CutmixDraws`. Every group must have the same batch."""
    boxes, weights, perms = [], [], []
    for batch, height, width in shapes:
        box = draw_box(height, width, generator)
        boxes.append([box.top, box.bottom, box.left, box.right])
        weights.append(box.weight)
        perms.append(draw_permutation(batch, generator))
    return CutmixDraws(
        torch.tensor(boxes, dtype=torch.long), torch.tensor(weights, dtype=torch.float64), torch.stack(perms)
    )


@dataclass(frozen=True)
class CutmixDraws:
    """One step's boxes and permutations as tensors (:func:`draw_cutmix`; a compiled step's input, written in
    place each step): ``boxes`` ``[G, 4]`` (top, bottom, left, right; end excluded), ``weights`` ``[G]``
    (float64: ``1 - area / (h * w)`` as the host computes it), ``perms`` ``[G, B]``."""

    boxes: Tensor
    weights: Tensor
    perms: Tensor

    def to(self, device: torch.device, non_blocking: bool = False) -> CutmixDraws:
        return CutmixDraws(*(t.to(device, non_blocking=non_blocking) for t in (self.boxes, self.weights, self.perms)))

    def copy_(self, other: CutmixDraws, non_blocking: bool = False) -> None:
        mine, theirs = (self.boxes, self.weights, self.perms), (other.boxes, other.weights, other.perms)
        for a, b in zip(mine, theirs, strict=True):
            a.copy_(b, non_blocking=non_blocking)


def cutmix_masked(images: Tensor, box: Tensor, weight: Tensor, perm: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`cutmix` with the box as a tensor ``[4]`` (top, bottom, left, right) and its weight a 0-d tensor: the
    same pixels, pasted through a mask rather than a slice, so that neither the box nor the batch's content is a
    Python value (one graph for every box, ``train.compile: step``). ``perm`` is on the images' device."""
    h, w = images.shape[-2:]
    rows = torch.arange(h, device=images.device)
    cols = torch.arange(w, device=images.device)
    inside = ((rows >= box[0]) & (rows < box[1]))[:, None] & ((cols >= box[2]) & (cols < box[3]))[None, :]
    mixed = torch.where(inside, images[perm], images)
    weights = weight.to(images.dtype).expand(images.shape[:-3]).clone()
    return mixed, weights


def mix_targets(targets: Tensor, perm: Tensor, weights: Tensor) -> Tensor:
    """``w * y_i + (1 - w) * y_perm[i]``: BoW targets ``[B, K]`` mixed as their images were.

    ``weights`` is ``[B]`` or ``[B, n]`` (one per view); the result is ``[B, K]`` or ``[B, n, K]``.
    """
    perm = perm.to(targets.device)
    own, other = targets, targets[perm]
    if weights.dim() == 2:
        own, other = own.unsqueeze(1), other.unsqueeze(1)
    w = weights.to(targets.dtype).unsqueeze(-1)
    return w * own + (1.0 - w) * other
