"""The kNN monitor of a pretraining run: how good the student's features are, measured every few epochs.

:func:`obow.training.loop.pretrain` takes it as ``monitor=KNNMonitor`` (the ``obow`` command, the demo and
the tables pass it): the training package sits below evaluation and does not import it.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from obow.config import Config
from obow.data.eval_sets import align_classes, eval_dataset, scan_labelled
from obow.data.folders import ImageList
from obow.diagnostics import feature_diagnostics
from obow.evaluate.features import extract_features
from obow.evaluate.knn import knn_accuracy

log = logging.getLogger("obow")


class KNNMonitor:
    """Weighted kNN accuracy of the student's ``pool5`` features during pretraining (on the main process).

    Memory: the labelled training images; queries: ``data.val_path``; both through the teacher's deterministic
    view. On when ``train.knn_every`` > 0, the training folder has class folders and a validation folder is
    given; otherwise :attr:`enabled` is false (and :attr:`reason` says why, when it was asked for).
    """

    def __init__(self, cfg: Config, images: ImageList, device: torch.device) -> None:
        self.cfg, self.device = cfg, device
        self.enabled, self.reason = False, ""
        if not cfg.train.knn_every:
            return
        if cfg.data.val_path is None:
            self.reason = "no validation folder (data.val_path / --val)"
        elif not images.labelled:
            self.reason = f"the training images under {images.root} have no class folders"
        if self.reason:
            log.info("kNN monitor off: %s", self.reason)
            return
        val = align_classes(images, scan_labelled(cfg.data.val_path))
        self.train_set, self.val_set = eval_dataset(images, cfg.views), eval_dataset(val, cfg.views)
        self.enabled = True
        if cfg.train.knn_every > cfg.optim.epochs:
            log.warning(
                "kNN monitor: train.knn_every=%d is larger than optim.epochs=%d, so it will never run; "
                "set train.knn_every to at most %d",
                cfg.train.knn_every,
                cfg.optim.epochs,
                cfg.optim.epochs,
            )
        if cfg.train.knn_k > len(images):
            log.warning(
                "kNN monitor: train.knn_k=%d is more than the %d training images; it uses k=%d",
                cfg.train.knn_k,
                len(images),
                len(images),
            )

    def due(self, epoch: int) -> bool:
        return self.enabled and epoch % self.cfg.train.knn_every == 0

    def __call__(self, backbone: nn.Module) -> dict[str, float]:
        """``knn_top1`` and the collapse diagnostics of the validation features (``knn_effective_rank``,
        ``knn_mean_cosine``)."""
        kwargs = {"batch_size": 256, "device": self.device, "num_workers": self.cfg.data.num_workers}
        train_x, train_y = extract_features(backbone, self.train_set, **kwargs)
        val_x, val_y = extract_features(backbone, self.val_set, **kwargs)
        k = min(self.cfg.train.knn_k, len(train_y))
        top1 = knn_accuracy(train_x, train_y, val_x, val_y, k=k, temperature=self.cfg.train.knn_temperature)
        diagnostics = feature_diagnostics(val_x) if len(val_x) > 1 else {}
        return {"knn_top1": top1, **{f"knn_{key}": float(v) for key, v in diagnostics.items()}}
