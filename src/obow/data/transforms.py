"""The teacher's view and the student's crops and patches (paper appendix "PyTorch code of Image augmentations",
official notes 2.11).

The teacher sees one unperturbed centre crop (only a horizontal flip), from which the BoW target is built; the
student sees independently sampled, strongly augmented random-resized crops and a grid of small patches, and
must predict the teacher's BoW from each of them (paper section 3). Every size and probability comes from a
:class:`~obow.config.ViewsConfig`.

All randomness is drawn from torch's global generator, so seeding it before a call (as
:class:`obow.data.folders.ImageDataset` does per sample) makes the views exactly reproducible.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from PIL import Image, ImageFilter
from torchvision.transforms import v2

from obow.config import ViewsConfig

#: The patches come from a GRID_SIDE x GRID_SIDE grid over the patch view (official notes 2.11).
GRID_SIDE = 3


class GaussianBlur:
    """PIL Gaussian blur whose radius (the Gaussian's standard deviation, in pixels) is uniform in ``sigma``.

    This is the official blur (paper appendix, official notes 2.11) rather than torchvision's, which needs a
    kernel size and would give slightly different images. The radius is drawn from torch's generator, not
    Python's, so that per-sample torch seeding covers it.
    """

    def __init__(self, sigma: Sequence[float] = (0.1, 2.0)) -> None:
        low, high = sigma
        if not 0 < low <= high:
            raise ValueError(f"GaussianBlur sigma must be (low, high) with 0 < low <= high, got {tuple(sigma)}")
        self.sigma = (float(low), float(high))

    def __call__(self, img: Image.Image) -> Image.Image:
        radius = torch.empty(()).uniform_(*self.sigma).item()
        return img.filter(ImageFilter.GaussianBlur(radius=radius))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(sigma={self.sigma})"


class PatchGrid:
    """Cut ``num_patches`` of a 3x3 grid of jittered ``patch_size`` patches from a ``[3, H, W]`` tensor.

    On each axis the grid step is ``(side - patch_size - jitter) // 2``; the patch of cell (i, j) starts at
    ``(i * step_y + ry, j * step_x + rx)`` with ``ry, rx`` uniform integers in ``[0, jitter]`` drawn per patch,
    and a random subset of the 9 cells (``torch.randperm``) is kept (paper appendix, official notes 2.11).
    With the paper's sizes (256 px view, 96 px patches, jitter 24) the step is 68 px, so neighbouring patches
    overlap. Returns ``[num_patches, 3, patch_size, patch_size]``.
    """

    def __init__(self, patch_size: int, jitter: int, num_patches: int) -> None:
        if patch_size < 1 or jitter < 0:
            raise ValueError(f"PatchGrid needs patch_size >= 1 and jitter >= 0, got {patch_size} and {jitter}")
        if not 1 <= num_patches <= GRID_SIDE * GRID_SIDE:
            raise ValueError(f"PatchGrid num_patches must be in [1, {GRID_SIDE * GRID_SIDE}], got {num_patches}")
        self.patch_size = patch_size
        self.jitter = jitter
        self.num_patches = num_patches

    def step(self, side: int) -> int:
        """Distance between the un-jittered starts of neighbouring grid cells along an axis of ``side`` pixels."""
        if side < self.patch_size + self.jitter:
            raise ValueError(
                f"PatchGrid needs an image side of at least patch_size + jitter "
                f"({self.patch_size} + {self.jitter}), got {side}"
            )
        return (side - self.patch_size - self.jitter) // (GRID_SIDE - 1)

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        _, height, width = image.shape
        step_y, step_x = self.step(height), self.step(width)
        cells = GRID_SIDE * GRID_SIDE
        offsets = torch.randint(0, self.jitter + 1, (cells, 2)).tolist()
        keep = torch.randperm(cells)[: self.num_patches].tolist()
        size = self.patch_size
        patches = []
        for cell in keep:
            i, j = divmod(cell, GRID_SIDE)
            top = i * step_y + offsets[cell][0]
            left = j * step_x + offsets[cell][1]
            patches.append(image[:, top : top + size, left : left + size])
        return torch.stack(patches)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(patch_size={self.patch_size}, jitter={self.jitter}, num_patches={self.num_patches})"
        )


def _to_normalized_tensor(mean: Sequence[float], std: Sequence[float]) -> list[Callable]:
    """PIL image -> float tensor in [0, 1] -> per-channel normalisation -> a plain ``torch.Tensor``."""
    return [
        v2.ToImage(),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(mean=list(mean), std=list(std)),
        # a plain tensor, so that stacking, slicing and collation never see torchvision's tensor subclass
        v2.ToPureTensor(),
    ]


def _photometric(cfg: ViewsConfig) -> list[Callable]:
    """The student's colour augmentations: colour jitter with probability, then random grayscale."""
    return [
        v2.RandomApply([v2.ColorJitter(*cfg.color_jitter)], p=cfg.color_jitter_prob),
        v2.RandomGrayscale(p=cfg.grayscale_prob),
    ]


def teacher_transform(cfg: ViewsConfig) -> v2.Compose:
    """The teacher's view: Resize -> CenterCrop -> horizontal flip -> normalise (official notes 2.11).

    No colour, blur or random crop: the BoW target is computed from the (nearly) unperturbed image.
    """
    return v2.Compose(
        [
            v2.Resize(cfg.teacher_resize),
            v2.CenterCrop(cfg.teacher_size),
            v2.RandomHorizontalFlip(),
            *_to_normalized_tensor(cfg.mean, cfg.std),
        ]
    )


def crop_transform(cfg: ViewsConfig) -> v2.Compose:
    """One student crop: RandomResizedCrop -> colour jitter -> grayscale -> PIL blur -> flip -> normalise.

    The crop scale's upper bound is 0.6 in the paper, not 1.0 (official notes 2.11), so a crop never shows
    most of the image and the student has to infer the rest of the teacher's BoW.
    """
    return v2.Compose(
        [
            v2.RandomResizedCrop(cfg.crop_size, scale=tuple(cfg.crop_scale)),
            *_photometric(cfg),
            v2.RandomApply([GaussianBlur(cfg.blur_sigma)], p=cfg.blur_prob),
            v2.RandomHorizontalFlip(),
            *_to_normalized_tensor(cfg.mean, cfg.std),
        ]
    )


def patch_transform(cfg: ViewsConfig) -> v2.Compose:
    """The student's patches: RandomResizedCrop -> colour jitter -> grayscale -> flip -> normalise -> grid.

    The whole patch view is augmented once and the patches are then cut from it, so all patches of an image
    share one colour jitter and flip. There is no blur, as in the official code (official notes 2.11).
    Returns ``[num_patches, 3, p, p]``.
    """
    return v2.Compose(
        [
            v2.RandomResizedCrop(cfg.patch_grid_size, scale=tuple(cfg.patch_scale)),
            *_photometric(cfg),
            v2.RandomHorizontalFlip(),
            *_to_normalized_tensor(cfg.mean, cfg.std),
            PatchGrid(cfg.patch_size, cfg.patch_jitter, cfg.num_patches),
        ]
    )


class OBoWViews:
    """All the views of one image for a training step (paper section 3, official notes 4).

    Called on a PIL RGB image, returns ``{"teacher": [3, T, T]}`` plus ``"crops": [num_crops, 3, c, c]`` when
    ``num_crops > 0`` and ``"patches": [num_patches, 3, p, p]`` when ``num_patches > 0``. The views are drawn
    independently; nothing forces a student view to overlap the teacher's centre crop (official notes 2.11).
    """

    def __init__(self, cfg: ViewsConfig) -> None:
        if not isinstance(cfg, ViewsConfig):
            views = " (a recipe's: its .views)" if hasattr(cfg, "views") else ""
            raise TypeError(f"OBoWViews takes the views' settings, a ViewsConfig{views}, got {type(cfg).__name__}")
        self.num_crops = cfg.num_crops
        self.teacher = teacher_transform(cfg)
        self.crop = crop_transform(cfg) if cfg.num_crops > 0 else None
        self.patches = patch_transform(cfg) if cfg.num_patches > 0 else None

    def __call__(self, img: Image.Image) -> dict[str, torch.Tensor]:
        if isinstance(img, np.ndarray):  # torchvision's transforms take no arrays ("No image ... was found")
            raise TypeError(
                f"OBoWViews takes a PIL image (or a [3, H, W] tensor), got a NumPy array of shape {img.shape}: "
                "PIL.Image.fromarray(array) makes one"
            )
        views = {"teacher": self.teacher(img)}
        if self.crop is not None:
            views["crops"] = torch.stack([self.crop(img) for _ in range(self.num_crops)])
        if self.patches is not None:
            views["patches"] = self.patches(img)
        return views


def eval_transform(resize: int, size: int, mean: Sequence[float], std: Sequence[float]) -> v2.Compose:
    """Deterministic view for feature extraction during evaluation: Resize -> CenterCrop -> normalise."""
    return v2.Compose([v2.Resize(resize), v2.CenterCrop(size), *_to_normalized_tensor(mean, std)])


def eval_pixels_transform(resize: int, size: int) -> v2.Compose:
    """:func:`eval_transform` before its normalisation: the view as a ``uint8`` tensor ``[3, size, size]``, to be
    kept decoded and normalised later, a batch at a time, by :func:`normalize_pixels`."""
    return v2.Compose([v2.Resize(resize), v2.CenterCrop(size), v2.ToImage(), v2.ToPureTensor()])


def normalize_pixels(pixels: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """``uint8`` images ``[..., 3, H, W]`` as :func:`eval_transform` ends them: float in [0, 1], then the recipe's
    mean and std (the same torchvision functions, so the result equals :func:`eval_transform`'s bit for bit)."""
    scaled = v2.functional.to_dtype(pixels, torch.float32, scale=True)
    return v2.functional.normalize(scaled, mean=list(mean), std=list(std))


class MoCoV2Views:
    """MoCo v2's two views of one image (Chen et al. 2020): independent draws of the same augmentation.

    Each view: RandomResizedCrop(``views.teacher_size``, scale ``crop_scale``) -> colour jitter (with
    ``views.color_jitter_prob``) -> grayscale (``views.grayscale_prob``) -> PIL Gaussian blur
    (``views.blur_sigma``, with ``views.blur_prob``) -> horizontal flip -> normalise (``views.mean`` /
    ``views.std``). Returns ``{"teacher": [3, T, T], "crops": [1, 3, T, T]}``: the key view and the query view,
    in the batch structure of :class:`OBoWViews` (one student group of one view).
    """

    def __init__(self, cfg: ViewsConfig, crop_scale: Sequence[float] = (0.2, 1.0)) -> None:
        low, high = crop_scale
        if not 0 < low <= high <= 1:
            raise ValueError(
                f"MoCoV2Views crop_scale must be (low, high) with 0 < low <= high <= 1, got {tuple(crop_scale)}"
            )
        self.view = v2.Compose(
            [
                v2.RandomResizedCrop(cfg.teacher_size, scale=(float(low), float(high))),
                *_photometric(cfg),
                v2.RandomApply([GaussianBlur(cfg.blur_sigma)], p=cfg.blur_prob),
                v2.RandomHorizontalFlip(),
                *_to_normalized_tensor(cfg.mean, cfg.std),
            ]
        )

    def __call__(self, img: Image.Image) -> dict[str, torch.Tensor]:
        key = self.view(img)
        query = self.view(img)
        return {"teacher": key, "crops": query.unsqueeze(0)}
