"""Semi-supervised fine-tuning on a labelled fraction of the data (paper section 4.3 and appendix).

The paper fine-tunes the whole pretrained ResNet-50 plus a linear head on 1% or 10% of the ImageNet labels
(appendix "Evaluation protocols in Section 4.3", official notes 5.4): SGD, batch 256, weight decay 0, two
learning rates, 0.5 for the head and 0.0002 for the trunk, both multiplied by 0.2 at two milestones
(1%: 40 epochs, milestones 24 and 32; 10%: 20 epochs, milestones 12 and 16). Training images are
RandomResizedCrop + horizontal flip at the teacher's size; test images the deterministic evaluation view.

The paper uses SimCLR's fixed ImageNet split files; for any other folder :func:`balanced_subset` draws a
class-balanced subset from a seed, and the CLI writes it next to the results so that it can be reused.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Subset
from torchvision.transforms import v2

from obow.checks import check_positive
from obow.data.folders import ImageDataset, collate
from obow.data.transforms import eval_transform
from obow.evaluate.knn import top1_top5
from obow.evaluate.linear import linear_head
from obow.notices import ObowWarning

if TYPE_CHECKING:
    from obow.backbones import Backbone


@dataclass(frozen=True)
class FinetunePreset:
    """The settings of one semi-supervised protocol of the paper."""

    fraction: float
    epochs: int
    milestones: tuple[int, ...]
    head_lr: float = 0.5
    trunk_lr: float = 0.0002
    gamma: float = 0.2
    weight_decay: float = 0.0
    momentum: float = 0.9
    batch_size: int = 256


FINETUNE_PRESETS: dict[str, FinetunePreset] = {
    "1%": FinetunePreset(fraction=0.01, epochs=40, milestones=(24, 32)),
    "10%": FinetunePreset(fraction=0.1, epochs=20, milestones=(12, 16)),
}


def preset_settings(name: str) -> dict[str, Any]:
    """A preset as a plain dictionary (``fraction`` included)."""
    if name not in FINETUNE_PRESETS:
        raise ValueError(f"unknown fine-tuning preset {name!r}; choose one of {', '.join(FINETUNE_PRESETS)}")
    return asdict(FINETUNE_PRESETS[name])


def balanced_subset(labels: Tensor | Sequence[int], fraction: float, seed: int = 0) -> list[int]:
    """Sorted indices of a class-balanced subset: ``max(1, round(fraction * n_c))`` images of each class ``c``
    (``n_c`` its size), drawn without replacement, reproducibly from ``seed``."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
    array = np.asarray(labels.tolist() if isinstance(labels, Tensor) else labels, dtype=np.int64)
    if array.size == 0:
        raise ValueError("no labels to draw a subset from")
    rng = np.random.default_rng(seed)
    chosen = []
    for c in np.unique(array):
        members = np.flatnonzero(array == c)
        take = max(1, round(fraction * len(members)))
        chosen.extend(rng.choice(members, size=take, replace=False).tolist())
    return sorted(chosen)


def finetune_transform(views: Any) -> v2.Compose:
    """Training view: RandomResizedCrop at the teacher's size, horizontal flip, the recipe's normalisation."""
    size = views.teacher_size
    # eval_transform's Resize and CenterCrop leave a size x size crop unchanged: it only adds the tensor
    # conversion and normalisation, so both views share them exactly
    return v2.Compose(
        [v2.RandomResizedCrop(size), v2.RandomHorizontalFlip(), eval_transform(size, size, views.mean, views.std)]
    )


def finetune_optimizer(
    trunk: nn.Module,
    head: nn.Module,
    *,
    head_lr: float,
    trunk_lr: float,
    momentum: float = 0.9,
    weight_decay: float = 0.0,
) -> torch.optim.SGD:
    """SGD with two parameter groups, ``"trunk"`` and ``"head"``, each with its own learning rate."""
    check_positive("head_lr", head_lr)
    check_positive("trunk_lr", trunk_lr, allow_zero=True)
    groups = [
        {"params": list(trunk.parameters()), "lr": trunk_lr, "name": "trunk"},
        {"params": list(head.parameters()), "lr": head_lr, "name": "head"},
    ]
    return torch.optim.SGD(groups, lr=head_lr, momentum=momentum, weight_decay=weight_decay)


def finetune(
    backbone: Backbone,
    train_dataset: ImageDataset,
    test_dataset: ImageDataset,
    subset_indices: Sequence[int],
    *,
    epochs: int,
    head_lr: float,
    trunk_lr: float,
    milestones: Sequence[int],
    gamma: float = 0.2,
    weight_decay: float = 0.0,
    momentum: float = 0.9,
    batch_size: int = 256,
    device: str | torch.device = "cpu",
    num_workers: int = 0,
    seed: int = 0,
    num_classes: int | None = None,
) -> dict[str, Any]:
    """Fine-tune ``backbone`` (in place) and a new linear head on ``train_dataset[subset_indices]``; report
    the top-1 (and top-5 with >= 5 classes) accuracy on ``test_dataset`` (paper section 4.3).

    ``train_dataset`` should carry :func:`finetune_transform` and ``test_dataset`` the evaluation view.
    The learning rates are multiplied by ``gamma`` at each milestone epoch. A last batch is dropped when
    the subset holds at least one full batch (a batch of one image would break batch norm on small maps).
    """
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"epochs must be a positive integer, got {epochs!r}")
    if not subset_indices:
        raise ValueError("subset_indices is empty: nothing to fine-tune on")
    device = torch.device(device)
    if num_classes is None:
        classes = train_dataset.images.classes
        num_classes = len(classes) if classes else max(cast(list[int], train_dataset.images.labels)) + 1

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = linear_head(backbone.num_features, num_classes)
        backbone.to(device)
        head.to(device)
        optimizer = finetune_optimizer(
            backbone, head, head_lr=head_lr, trunk_lr=trunk_lr, momentum=momentum, weight_decay=weight_decay
        )
        scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=list(milestones), gamma=gamma)
        n = len(subset_indices)
        loader = DataLoader(
            Subset(train_dataset, list(subset_indices)),
            batch_size=min(batch_size, n),
            shuffle=True,
            generator=torch.Generator().manual_seed(seed),
            num_workers=num_workers,
            collate_fn=collate,
            drop_last=n >= batch_size,
            pin_memory=device.type == "cuda",
        )
        history: dict[str, list[float]] = {"train_loss": [], "train_top1": [], "lr_head": [], "lr_trunk": []}
        skipped: set[str] = set()
        for _ in range(epochs):
            backbone.train()
            head.train()
            history["lr_trunk"].append(optimizer.param_groups[0]["lr"])
            history["lr_head"].append(optimizer.param_groups[1]["lr"])
            loss_sum, correct, seen = 0.0, 0, 0
            for batch in loader:
                images, labels = batch["image"].to(device), batch["label"].to(device)
                logits = head(backbone(images).pool5)
                loss = F.cross_entropy(logits, labels)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                loss_sum += loss.item() * labels.numel()
                correct += int((logits.argmax(1) == labels).sum())
                seen += labels.numel()
                skipped.update(batch["skipped"])
            scheduler.step()
            history["train_loss"].append(loss_sum / seen)
            history["train_top1"].append(100.0 * correct / seen)

        scores, labels = _predict(backbone, head, test_dataset, batch_size, device, num_workers, skipped)
    if skipped:
        warnings.warn(f"{len(skipped)} unreadable images were skipped during fine-tuning", ObowWarning, stacklevel=2)
    result: dict[str, Any] = top1_top5(scores, labels)
    result.update(
        epochs=epochs,
        head_lr=head_lr,
        trunk_lr=trunk_lr,
        milestones=list(milestones),
        gamma=gamma,
        weight_decay=weight_decay,
        momentum=momentum,
        batch_size=batch_size,
        seed=seed,
        num_train=n,
        num_test=len(test_dataset),
        num_classes=num_classes,
        skipped_images=sorted(skipped),
        **history,
    )
    return result


@torch.no_grad()
def _predict(
    backbone: nn.Module,
    head: nn.Module,
    dataset: ImageDataset,
    batch_size: int,
    device: torch.device,
    num_workers: int,
    skipped: set[str],
) -> tuple[Tensor, Tensor]:
    backbone.eval()
    head.eval()
    loader = DataLoader(dataset, batch_size=batch_size, num_workers=num_workers, collate_fn=collate)
    scores, labels = [], []
    for batch in loader:
        scores.append(head(backbone(batch["image"].to(device)).pool5).float().cpu())
        labels.append(batch["label"])
        skipped.update(batch["skipped"])
    return torch.cat(scores), torch.cat(labels)
