"""Linear classification on frozen, precomputed features (paper section 4.1 and appendix).

The paper's analysis protocol (appendix "Evaluation protocols in Section 4.1", official notes 5.1) trains the
classifier on *pre-cached* ``pool5`` features of the 224 px centre crop and of its horizontal flip: every
epoch, each image contributes one of its two views, drawn at random. Test images use the unflipped centre
crop. The head is ``nn.Linear`` initialised ``N(0, 0.01)`` with bias 0 (official ``classification.py``),
optionally preceded by a non-affine batch norm (``batch_norm=True``, the official ``--batch-norm`` of its
Places205 protocol), which makes the probe indifferent to the scale and offset of the features: useful for
features whose magnitude is far from what the preset's learning rate of 10 expects (a random network's).

Presets (:data:`LINEAR_PRESETS`):

* ``"resnet18"``: the section 4.1 numbers, SGD for 50 epochs, lr 10 divided by 10 every 15 epochs,
  batch 256, weight decay 2e-6 (momentum 0.9 as in the official script);
* ``"resnet50"``: the section 4.3 numbers, 100 epochs, lr 10, cosine, batch 1024, weight decay 0,
  momentum 0.9. The paper trains that one on augmented crops; here it runs on the same pre-cached centre
  and flip features, which is what makes it take seconds instead of GPU-days.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from obow.checks import check_choice, check_positive
from obow.evaluate.knn import top1_top5
from obow.notices import ObowWarning

SCHEDULES = ("step", "cosine")


@dataclass(frozen=True)
class LinearPreset:
    """Optimisation settings of one linear-probe protocol."""

    epochs: int
    lr: float
    batch_size: int
    weight_decay: float
    momentum: float = 0.9
    schedule: str = "step"
    milestones: tuple[int, ...] = ()
    gamma: float = 0.1


LINEAR_PRESETS: dict[str, LinearPreset] = {
    "resnet18": LinearPreset(
        epochs=50, lr=10.0, batch_size=256, weight_decay=2e-6, schedule="step", milestones=(15, 30, 45), gamma=0.1
    ),
    "resnet50": LinearPreset(epochs=100, lr=10.0, batch_size=1024, weight_decay=0.0, schedule="cosine"),
}


def preset_for_arch(arch: str) -> str:
    """The preset matching a backbone: ``"resnet18"`` for the BasicBlock ResNets (ResNet-10 to 34, torchvision,
    timm or their variants such as ``timm:resnet18d``), ``"resnet50"`` otherwise."""
    name = arch.rpartition(":")[2]
    return "resnet18" if re.match(r"resnet(10|14|18|34)(?!\d)", name) else "resnet50"


def lr_at_epoch(
    epoch: int,
    *,
    base_lr: float,
    epochs: int,
    schedule: str = "step",
    milestones: Sequence[int] = (),
    gamma: float = 0.1,
) -> float:
    """Learning rate used during ``epoch`` (0-based), constant within an epoch.

    ``step``: ``base_lr * gamma ** (number of milestones <= epoch)`` (official ``MultiStepLR``);
    ``cosine``: ``base_lr * (1 + cos(pi * epoch / epochs)) / 2`` (per epoch, no warm-up, as MoCo's
    ``main_lincls.py`` and the official linear script).
    """
    check_choice("schedule", schedule, SCHEDULES)
    if schedule == "step":
        return base_lr * gamma ** sum(1 for m in milestones if epoch >= m)
    return base_lr * 0.5 * (1.0 + math.cos(math.pi * epoch / epochs))


def linear_head(in_features: int, num_classes: int) -> nn.Linear:
    """``nn.Linear`` with weights ``N(0, 0.01)`` and zero bias (official ``classification.py``)."""
    head = nn.Linear(in_features, num_classes)
    nn.init.normal_(head.weight, mean=0.0, std=0.01)
    nn.init.zeros_(head.bias)
    return head


def probe_head(in_features: int, num_classes: int, batch_norm: bool = False) -> nn.Module:
    """The probe: :func:`linear_head`, after ``BatchNorm1d(affine=False)`` when ``batch_norm``.

    The batch norm's running statistics are cumulative averages over all training batches
    (``momentum=None``), not the default 0.1-momentum EMA: a probe sees only tens of batches, and an EMA
    started from a variance of 1 would still carry 1.5% of that start after 40 of them, which swamps features
    whose variance is small (such a probe scored 77% on its own training set, against 100% with the average).
    """
    head = linear_head(in_features, num_classes)
    if not batch_norm:
        return head
    return nn.Sequential(nn.BatchNorm1d(in_features, affine=False, momentum=None), head)


def train_linear_probe(
    train_views: Sequence[Tensor],
    train_labels: Tensor,
    test_features: Tensor,
    test_labels: Tensor,
    *,
    epochs: int,
    lr: float,
    batch_size: int,
    weight_decay: float,
    momentum: float = 0.9,
    schedule: str = "step",
    milestones: Sequence[int] = (15, 30, 45),
    gamma: float = 0.1,
    seed: int = 0,
    device: str | torch.device = "cpu",
    num_classes: int | None = None,
    batch_norm: bool = False,
) -> dict:
    """Train a linear classifier on precomputed features and report test accuracy (paper section 4.1).

    Args:
        train_views: one or two ``[N, c]`` tensors (e.g. centre crop and its flip); each epoch every image
            contributes the features of one view drawn uniformly at random.
        train_labels: ``[N]`` class indices.
        test_features, test_labels: ``[M, c]`` and ``[M]``.
        epochs, lr, batch_size, weight_decay, momentum: SGD settings.
        schedule, milestones, gamma: learning rate per epoch (see :func:`lr_at_epoch`).
        seed: seeds the head's initialisation, the shuffling and the view draws.
        batch_norm: put a non-affine batch norm before the linear layer (batch statistics while training,
            running statistics on the test features).

    Returns:
        ``top1`` (and ``top5`` with at least 5 classes) in percent, ``train_loss`` and ``lr`` per epoch,
        every setting used, and ``diverged``: why the probe diverged (:func:`divergence`), else ``None``.
    """
    views = _check_views(train_views, train_labels)
    check_choice("schedule", schedule, SCHEDULES)
    for name, value in (("epochs", epochs), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    check_positive("lr", lr)
    check_positive("weight_decay", weight_decay, allow_zero=True)
    if test_features.ndim != 2 or test_features.shape[1] != views.shape[2]:
        raise ValueError(f"test_features must be [M, {views.shape[2]}], got {tuple(test_features.shape)}")
    if num_classes is None:
        num_classes = int(max(train_labels.max(), test_labels.max())) + 1

    device = torch.device(device)
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = probe_head(views.shape[2], num_classes, batch_norm).to(device)
    optimizer = torch.optim.SGD(head.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    views, labels = views.to(device), train_labels.long().to(device)
    num_views, n = views.shape[:2]

    losses, lrs = [], []
    for epoch in range(epochs):
        epoch_lr = lr_at_epoch(epoch, base_lr=lr, epochs=epochs, schedule=schedule, milestones=milestones, gamma=gamma)
        for group in optimizer.param_groups:
            group["lr"] = epoch_lr
        order = torch.randperm(n, generator=generator).to(device)
        chosen = torch.randint(num_views, (n,), generator=generator).to(device)
        total = 0.0
        for start in range(0, n, batch_size):
            idx = order[start : start + batch_size]
            loss = F.cross_entropy(head(views[chosen[idx], idx]), labels[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += loss.item() * idx.numel()
        losses.append(total / n)
        lrs.append(epoch_lr)

    diverged = divergence(losses, num_classes)
    if diverged:
        warnings.warn(f"the linear probe diverged at lr {lr}: {diverged}", ObowWarning, stacklevel=2)
    head.eval()
    with torch.no_grad():
        scores = torch.cat([head(chunk.to(device)).cpu() for chunk in test_features.float().split(4096)])
    result: dict = top1_top5(scores, test_labels)
    result.update(
        epochs=epochs,
        lr=lr,
        batch_size=batch_size,
        weight_decay=weight_decay,
        momentum=momentum,
        schedule=schedule,
        milestones=list(milestones) if schedule == "step" else [],
        gamma=gamma if schedule == "step" else None,
        batch_norm=batch_norm,
        seed=seed,
        num_views=num_views,
        num_train=n,
        num_test=int(test_features.shape[0]),
        num_classes=num_classes,
        train_loss=losses,
        lr_per_epoch=lrs,
        diverged=diverged,
    )
    return result


#: A trained probe whose last epoch's mean training loss is above this many times ``ln(C)`` (the loss of the
#: uniform prediction its near-zero initial head makes) has diverged: it ends worse than it started.
DIVERGED_ABOVE = 1.5


def divergence(losses: Sequence[float], num_classes: int) -> str | None:
    """Why a probe trained with these mean training losses per epoch diverged, in a few words; ``None`` when it did
    not: a loss that became non-finite, or a last epoch's loss above :data:`DIVERGED_ABOVE` times ``ln(C)``, the
    loss of the uniform prediction a near-zero head starts from (a linear head's optimum is never above it)."""
    if not losses:
        return None
    shown = ", ".join(f"{loss:.4g}" for loss in losses[:2]) + (f", ..., {losses[-1]:.4g}" if len(losses) > 2 else "")
    if not all(math.isfinite(loss) for loss in losses):
        return f"its training loss became non-finite (per epoch: {shown})"
    chance = math.log(max(num_classes, 2))
    if losses[-1] > DIVERGED_ABOVE * chance:
        return (
            f"its training loss rose far above the {chance:.2f} of an untrained head (ln {max(num_classes, 2)}) and "
            f"stayed there (per epoch: {shown})"
        )
    return None


def stable_lr(features: Tensor, num_classes: int, momentum: float = 0.9, batch_norm: bool = False) -> float:
    """Half the largest learning rate at which SGD with ``momentum`` on a linear head's cross-entropy is stable at
    its start: ``(1 + momentum) C / lambda_max``. At the near-zero initial head the predictions are uniform and the
    loss's Hessian is ``(I/C - 11^T/C^2) (x) E[x x^T]`` (``x`` with a 1 for the bias), whose largest eigenvalue is
    ``lambda_max(E[x x^T]) / C``; heavy-ball momentum diverges along it from the first steps when
    ``lr lambda > 2 (1 + momentum)``. Half that leaves room for the Hessian's growth as the predictions sharpen.
    ``features`` ``[N, c]`` are standardised first with ``batch_norm`` (what that head sees); at most
    :data:`STABLE_LR_ROWS` of them are used."""
    x = features.double()
    if len(x) > STABLE_LR_ROWS:  # E[x x^T] of a fixed sample: an expectation, well estimated from 16k rows
        x = x[torch.randperm(len(x), generator=torch.Generator().manual_seed(0))[:STABLE_LR_ROWS]]
    if batch_norm:
        x = (x - x.mean(0)) / (x.var(0, unbiased=False) + 1e-5).sqrt()  # BatchNorm1d's eps
    x = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1)
    # power iteration, from the mean (the dominant direction of unnormalised features) plus a random direction (an
    # eigenvector alone would be a fixed point: the bias's, for standardised features)
    v = x.mean(0) + torch.randn(x.shape[1], generator=torch.Generator().manual_seed(0), dtype=x.dtype)
    lam = 0.0
    for _ in range(POWER_STEPS):
        w = x.T @ (x @ v) / len(x)
        lam, v = float(w.norm()), w / w.norm().clamp_min(1e-300)
    return (1.0 + momentum) * num_classes / max(lam, 1e-12)


def capped_lr(lr: float, features: Tensor, num_classes: int, momentum: float = 0.9, batch_norm: bool = False) -> float:
    """``lr`` (a preset's, set for ImageNet's classes and features), or :func:`stable_lr` of these features where
    that is lower: the rate every probe of obow takes unless the user gives one (``obow eval linear``, the tables'
    protocol)."""
    return min(lr, stable_lr(features, num_classes, momentum, batch_norm))


#: Rows of the features :func:`stable_lr` estimates ``E[x x^T]`` from, and its power-iteration steps.
STABLE_LR_ROWS = 16384
POWER_STEPS = 100


def preset_settings(name: str) -> dict:
    """The keyword arguments of :func:`train_linear_probe` for a named preset."""
    check_choice("preset", name, tuple(LINEAR_PRESETS))
    settings = asdict(LINEAR_PRESETS[name])
    settings["milestones"] = tuple(settings["milestones"])
    return settings


def _check_views(train_views: Sequence[Tensor], train_labels: Tensor) -> Tensor:
    if isinstance(train_views, Tensor):
        raise ValueError("train_views must be a list of [N, c] tensors (one per view), not a single tensor")
    if not 1 <= len(train_views) <= 2:
        raise ValueError(f"train_views must hold 1 or 2 views (centre crop, flip), got {len(train_views)}")
    shapes = {tuple(v.shape) for v in train_views}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise ValueError(f"every view must be the same [N, c] tensor shape, got {sorted(shapes)}")
    if train_labels.shape != (train_views[0].shape[0],):
        raise ValueError(f"train_labels must be [{train_views[0].shape[0]}], got {tuple(train_labels.shape)}")
    return torch.stack([v.float() for v in train_views])
