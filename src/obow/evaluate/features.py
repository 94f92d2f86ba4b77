"""Frozen backbones' ``pool5`` features, the input of every evaluation protocol (paper section 4.1).

Backbones come from :mod:`obow.weights.load`; evaluation sets from :mod:`obow.data.eval_sets`.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from obow.data.folders import EpochSampler, ImageDataset, build_loader
from obow.notices import ObowWarning


@torch.no_grad()
def extract_features(
    backbone: torch.nn.Module,
    dataset: ImageDataset,
    *,
    batch_size: int = 256,
    device: str | torch.device = "cpu",
    num_workers: int = 0,
    flip: bool = False,
    skipped: list[str] | None = None,
) -> tuple[Tensor, Tensor]:
    """``pool5`` features ``[N, c]`` (float32, CPU) and labels ``[N]`` of every image of ``dataset``, in order.

    The backbone runs frozen in eval mode (BN running statistics, official notes 5.1); its training mode is
    restored afterwards. ``flip=True`` extracts the horizontally flipped images instead (the second view of
    the paper's linear protocol). Unreadable images are replaced by the next readable one (see
    :class:`~obow.data.folders.ImageDataset`), reported in a warning, and appended to ``skipped`` when given.
    """
    device = torch.device(device)
    was_training = backbone.training
    backbone.eval().to(device)
    sampler = EpochSampler(len(dataset), batch_size, shuffle=False, drop_last=False)
    loader = build_loader(dataset, sampler, batch_size, num_workers, pin_memory=device.type == "cuda")
    features, labels, missed = [], [], []
    try:
        for batch in loader:
            images = batch["image"].to(device, non_blocking=True)
            if flip:
                images = images.flip(-1)
            features.append(backbone(images).pool5.float().cpu())
            labels.append(batch["label"])
            missed.extend(batch["skipped"])
    finally:
        backbone.train(was_training)
    if missed:
        unique = sorted(set(missed))
        warnings.warn(
            f"{len(unique)} unreadable images under {dataset.images.root} were skipped (replaced by the next "
            f"readable image), e.g. {unique[0]}",
            ObowWarning,
            stacklevel=2,
        )
        if skipped is not None:
            skipped.extend(unique)
    return torch.cat(features), torch.cat(labels).long()
