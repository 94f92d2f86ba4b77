"""The kNN monitor of a pretraining run: how good the student's features are, measured every few epochs.

The evaluation images are decoded once, on the first pass, and kept (``uint8``, the teacher's deterministic
view) when they take at most :data:`KEEP_FRACTION` of the memory available: each later pass is then the
backbone's forward and the kNN alone, both on the run's device (the kept images pinned for a GPU, up to
:data:`PIN_LIMIT`). Otherwise every pass reads the images again.

:func:`obow.training.loop.pretrain` takes it as ``monitor=KNNMonitor`` (the ``obow`` command, the demo and
the tables pass it): the training package sits below evaluation and does not import it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from obow.config import Config
from obow.data.cache import available_memory
from obow.data.eval_sets import align_classes, eval_dataset, scan_labelled
from obow.data.folders import ImageList
from obow.diagnostics import feature_diagnostics
from obow.evaluate.features import DecodedSet, decode_set, decoded_features, extract_features
from obow.evaluate.knn import knn_accuracy

log = logging.getLogger("obow")

#: The most of the memory available (at the monitor's set-up) that its decoded evaluation images may take.
KEEP_FRACTION = 0.25
#: Images per forward of the monitor.
BATCH_SIZE = 256
#: Kept images of at most this many bytes are pinned for a CUDA device (faster copies); larger ones are not (pinning
#: gigabytes takes long and may exceed the pinned-memory limit).
PIN_LIMIT = 4 * 2**30


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
        assert cfg.data.val_path is not None  # checked above
        val = align_classes(images, scan_labelled(cfg.data.val_path))
        size = cfg.views.teacher_size
        self.needed = needed = (len(images) + len(val)) * 3 * size * size  # bytes, decoded
        #: Whether the evaluation images are decoded once and kept (see the module's docstring).
        self.keeps_pixels = needed <= KEEP_FRACTION * available_memory()
        self.train_set = eval_dataset(images, cfg.views, pixels=self.keeps_pixels)
        self.val_set = eval_dataset(val, cfg.views, pixels=self.keeps_pixels)
        self.decoded: tuple[DecodedSet, DecodedSet] | None = None
        if not self.keeps_pixels:
            log.info(
                "kNN monitor: its %d images would take %.0f MiB decoded, more than %d%% of the memory available: "
                "each pass reads them again",
                len(images) + len(val),
                needed / 2**20,
                round(100 * KEEP_FRACTION),
            )
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
        if self.keeps_pixels:
            train, val = self.decoded or self._decode()
            train_x = decoded_features(backbone, train, batch_size=BATCH_SIZE, device=self.device)
            val_x = decoded_features(backbone, val, batch_size=BATCH_SIZE, device=self.device)
            train_y, val_y = train.labels.to(self.device), val.labels.to(self.device)
        else:
            kwargs: dict[str, Any] = {
                "batch_size": BATCH_SIZE,
                "device": self.device,
                "num_workers": self.cfg.data.num_workers,
            }
            train_x, train_y = extract_features(backbone, self.train_set, **kwargs)
            val_x, val_y = extract_features(backbone, self.val_set, **kwargs)
        k = min(self.cfg.train.knn_k, len(train_y))
        top1 = knn_accuracy(train_x, train_y, val_x, val_y, k=k, temperature=self.cfg.train.knn_temperature)
        diagnostics = feature_diagnostics(val_x.cpu()) if len(val_x) > 1 else {}
        return {"knn_top1": top1, **{f"knn_{key}": float(v) for key, v in diagnostics.items()}}

    def _decode(self) -> tuple[DecodedSet, DecodedSet]:
        """The training and validation images decoded (the first pass), kept for every later pass."""
        views, workers = self.cfg.views, self.cfg.data.num_workers
        pin = self.device.type == "cuda" and self.needed <= PIN_LIMIT
        train, val = (
            decode_set(dataset, views.mean, views.std, batch_size=BATCH_SIZE, num_workers=workers, pin_memory=pin)
            for dataset in (self.train_set, self.val_set)
        )
        self.decoded = train, val
        log.info(
            "kNN monitor: %d images decoded once and kept (%.0f MiB)",
            len(train.labels) + len(val.labels),
            (train.nbytes + val.nbytes) / 2**20,
        )
        return self.decoded
