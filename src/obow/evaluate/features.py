"""Frozen backbones' ``pool5`` features, the input of every evaluation protocol (paper section 4.1).

Backbones come from :mod:`obow.weights.load`; evaluation sets from :mod:`obow.data.eval_sets`. A set measured
again and again (the kNN monitor of a pretraining run) can be decoded once (:func:`decode_set`) and its features
taken from the kept pixels (:func:`decoded_features`), equal to :func:`extract_features`' bit for bit.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.data import DataLoader

from obow.data.folders import EpochSampler, ImageDataset, build_loader, decoding_workers
from obow.data.transforms import normalize_pixels
from obow.notices import ObowWarning, counted


@contextlib.contextmanager
def frozen(backbone: torch.nn.Module, device: torch.device) -> Iterator[None]:
    """The backbone on ``device`` in eval mode (BN running statistics, official notes 5.1) for the block; its
    training mode restored afterwards."""
    was_training = backbone.training
    backbone.eval().to(device)
    try:
        yield
    finally:
        backbone.train(was_training)


def _loader(dataset: ImageDataset, batch_size: int, num_workers: int, pin_memory: bool) -> DataLoader:
    """Every image of ``dataset`` once, in order, by at least ``num_workers`` loader workers (one per core for a large
    set: :func:`~obow.data.folders.decoding_workers`)."""
    sampler = EpochSampler(len(dataset), batch_size, shuffle=False, drop_last=False)
    workers = decoding_workers(len(dataset), num_workers)
    return build_loader(dataset, sampler, batch_size, workers, pin_memory=pin_memory)


def readable(batch: dict, first: int) -> Tensor:
    """Which rows of ``batch`` (the images ``first``, ``first + 1``, ... of a set read in order) are the images asked
    for: a row whose image could not be read holds the next readable image instead
    (:class:`~obow.data.folders.ImageDataset`), which has a row of its own; an evaluation leaves such rows out, so
    that no image counts twice."""
    used = batch["index"]
    return used == torch.arange(first, first + len(used))


def _report_skipped(dataset: ImageDataset, missed: list[str], skipped: list[str] | None) -> None:
    """One warning for the unreadable images met (each left out)."""
    if not missed:
        return
    unique = sorted(set(missed))
    warnings.warn(
        f"{counted(len(unique), 'unreadable image')} under {dataset.images.root} left out, e.g. {unique[0]}",
        ObowWarning,
        stacklevel=3,
    )
    if skipped is not None:
        skipped.extend(unique)


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
    the paper's linear protocol). Unreadable images are left out (:func:`readable`: the rows that would repeat the
    next readable image), reported in a warning, and appended to ``skipped`` when given: ``N`` counts the readable
    images.
    """
    device = torch.device(device)
    features, labels, missed = [], [], []
    seen = 0
    with frozen(backbone, device):
        for batch in _loader(dataset, batch_size, num_workers, pin_memory=device.type == "cuda"):
            kept = readable(batch, seen)
            seen += len(kept)
            images = batch["image"][kept].to(device, non_blocking=True)
            if flip:
                images = images.flip(-1)
            features.append(backbone(images).pool5.float().cpu())
            labels.append(batch["label"][kept])
            missed.extend(batch["skipped"])
    _report_skipped(dataset, missed, skipped)
    return torch.cat(features), torch.cat(labels).long()


@dataclass(frozen=True)
class DecodedSet:
    """An evaluation set's deterministic views decoded once: ``pixels`` ``uint8`` ``[N, 3, T, T]`` (CPU; pinned
    when it feeds a GPU), ``labels`` ``[N]``, and the ``mean`` / ``std`` that normalise a batch of them."""

    pixels: Tensor
    labels: Tensor
    mean: tuple[float, ...]
    std: tuple[float, ...]

    @property
    def nbytes(self) -> int:
        return self.pixels.nelement() * self.pixels.element_size()


def decode_set(
    dataset: ImageDataset,
    mean: Sequence[float],
    std: Sequence[float],
    *,
    batch_size: int = 256,
    num_workers: int = 0,
    pin_memory: bool = False,
    skipped: list[str] | None = None,
) -> DecodedSet:
    """Every image of ``dataset`` (built with ``eval_dataset(..., pixels=True)``: ``uint8`` views) decoded once, in
    order, to be normalised by ``mean`` / ``std`` when used. Unreadable images as in :func:`extract_features`."""
    pixels, labels, missed = [], [], []
    seen = 0
    for batch in _loader(dataset, batch_size, num_workers, pin_memory=False):
        if batch["image"].dtype != torch.uint8:
            raise ValueError("decode_set needs uint8 views: build the dataset with eval_dataset(..., pixels=True)")
        kept = readable(batch, seen)
        seen += len(kept)
        pixels.append(batch["image"][kept])
        labels.append(batch["label"][kept])
        missed.extend(batch["skipped"])
    _report_skipped(dataset, missed, skipped)
    kept = torch.cat(pixels)
    return DecodedSet(
        kept.pin_memory() if pin_memory else kept,
        torch.cat(labels).long(),
        tuple(float(m) for m in mean),
        tuple(float(s) for s in std),
    )


@torch.no_grad()
def decoded_features(
    backbone: torch.nn.Module, decoded: DecodedSet, *, batch_size: int = 256, device: str | torch.device = "cpu"
) -> Tensor:
    """``pool5`` features ``[N, c]`` (float32, left on ``device``) of a :class:`DecodedSet`, in order: each batch
    copied to ``device``, normalised there and seen by the frozen backbone, as :func:`extract_features` does."""
    device = torch.device(device)
    features = []
    with frozen(backbone, device):
        for start in range(0, len(decoded.pixels), batch_size):
            images = decoded.pixels[start : start + batch_size].to(device, non_blocking=True)
            features.append(backbone(normalize_pixels(images, decoded.mean, decoded.std)).pool5.float())
    return torch.cat(features)
