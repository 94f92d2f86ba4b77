"""A run's settings made concrete, once, before anything is built: settle -> build -> train.

:func:`settle_run` takes the recipe as asked and the device the process computes on, reads the configuration
the run started with when it is being resumed (:func:`obow.training.run.folder.started_config`), and resolves what
the recipe leaves to the machine: ``train.precision: auto`` (:func:`settle_precision`), ``data.pipeline: auto``
(:func:`settle_pipeline`) and the threads of a training process (:func:`obow.training.run.threads.choose_threads`).
A resumed run keeps what it started with. The :class:`SettledRun` it returns is what
:mod:`obow.training.build` and the loop (:mod:`obow.training.loop`) are given; neither resolves a setting again.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from obow import distributed as D
from obow.config import Config
from obow.config.choices import PIPELINES, PRECISIONS
from obow.schedules import run_warmup
from obow.training.run import precision as prec
from obow.training.run.folder import started_config
from obow.training.run.logger import log_main
from obow.training.run.settings_check import as_it_ran
from obow.training.run.threads import choose_threads

__all__ = ["SettledRun", "resolve_pipeline", "settle_pipeline", "settle_precision", "settle_run", "started_precision"]


@dataclass(frozen=True)
class SettledRun:
    """A run's configuration with its ``auto`` settings resolved, and what the machine decides beside it."""

    #: The recipe with ``train.precision`` concrete and ``data.pipeline`` concrete (or the ``auto`` of a run
    #: started before the choice was recorded, which keeps it): what ``config.yaml`` and the checkpoint hold.
    cfg: Config
    #: Who makes the views on this device: ``workers`` or ``device``.
    pipeline: str
    #: Intra-op threads of this training process, and why (:func:`obow.training.run.threads.choose_threads`).
    threads: int
    threads_why: str


def settle_run(cfg: Config, out: Path, device: torch.device) -> SettledRun:
    """``cfg`` settled for the run in ``out`` on ``device`` (called with the run folder locked): the started
    configuration is read once, then precision, pipeline, MoCo's batch-norm splits and threads are resolved, each
    said in the log."""
    started_with = started_config(out)
    cfg = settle_pipeline(settle_precision(cfg, device, started_with), device, started_with)
    cfg = settle_bn_splits(cfg, started_with)
    note_short_warmup(cfg)
    threads, why = choose_threads(cfg)
    return SettledRun(cfg, resolve_pipeline(cfg.data.pipeline, device), threads, why)


def settle_precision(cfg: Config, device: torch.device, started_with: dict[str, Any] | None) -> Config:
    """``cfg`` with ``train.precision: auto`` made concrete for a run: a run being resumed keeps the precision it
    started with (``started_with``, the configuration :func:`obow.training.run.folder.started_config` reads; a resume
    on another machine computes as the run did, exactly), a new run (``None``) takes
    :func:`~obow.training.run.precision.resolve_precision`'s choice for ``device``. Every other ``cfg`` is returned as
    it is. ``config.yaml`` and the checkpoint then hold the concrete value."""
    if cfg.train.precision != "auto":
        return cfg
    started = started_precision(started_with)
    precision = started or prec.resolve_precision("auto", device)
    why = (
        "as the run started"
        if started
        else f"{'native' if precision == 'bf16' else 'no native'} bf16 on this {device.type}"
    )
    log_main("Precision: train.precision=auto -> %s (%s)", precision, why)
    if precision == "bf16" and device.type == "cpu" and not prec.native_bf16(device):
        log_main(
            "this run started in bf16 on a CPU with bf16 instructions; this one has none and emulates bfloat16, far "
            "slower than fp32: the run keeps bf16 to resume exactly (a new --out can start in fp32 here)",
            level=logging.WARNING,
        )
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision=precision))


def started_precision(started_with: dict[str, Any] | None) -> str | None:
    """The ``train.precision`` a run started with, from its configuration (``None``: a new run, or none
    recorded)."""
    precision = ((started_with or {}).get("train") or {}).get("precision")
    return precision if precision in PRECISIONS and precision != "auto" else None


def resolve_pipeline(pipeline: str, device: torch.device) -> str:
    """``data.pipeline`` as a run on ``device`` makes its views: ``auto`` is ``device`` on a GPU and ``workers`` on a
    CPU (for a new run, and for one started before the choice was recorded, whose ``auto`` keeps this rule); the
    other values are themselves."""
    if pipeline != "auto":
        return pipeline
    return "device" if device.type == "cuda" else "workers"


def settle_pipeline(cfg: Config, device: torch.device, started_with: dict[str, Any] | None) -> Config:
    """``cfg`` with ``data.pipeline: auto`` made concrete for a run, as ``train.precision: auto`` is: a run being
    resumed keeps the pipeline it started with (``started_with``; a run started on a GPU and resumed on a CPU
    makes the same views, and a change of the default cannot switch a run half-way), a new run (``None``) takes
    :func:`resolve_pipeline`'s choice. ``config.yaml`` and the checkpoint then hold it. A run whose configuration
    says ``auto`` or nothing (started before the choice was recorded, or before the setting existed, whose
    default ``auto`` it then had) keeps ``auto``, and its rule; asked for the pipeline that rule gives on
    ``device`` (as a table pins its pipeline), it resumes as the same run."""
    started = ((started_with or {}).get("data") or {}).get("pipeline")
    unrecorded = started_with is not None and started not in ("workers", "device")
    if cfg.data.pipeline != "auto":
        if unrecorded and cfg.data.pipeline == resolve_pipeline("auto", device):
            return _with_pipeline(cfg, "auto")  # what the run's recorded auto makes here: the same run (e.g. a table's)
        return cfg
    if started in PIPELINES:
        pipeline, why = started, "as the run started"
    elif unrecorded:  # started before the choice was recorded (or data.pipeline existed)
        pipeline, why = "auto", ""
    else:
        pipeline = resolve_pipeline("auto", device)
        why = f"{'a GPU' if device.type == 'cuda' else 'a CPU'} run's default"
    if pipeline != "auto":
        log_main("Data: data.pipeline=auto -> %s (%s)", pipeline, why)
    return _with_pipeline(cfg, pipeline)


def settle_bn_splits(cfg: Config, started_with: dict[str, Any] | None) -> Config:
    """``cfg`` with a MoCo v2 run's ``moco.bn_splits: null`` made concrete: a run being resumed keeps what it started
    with (``started_with``, :func:`obow.training.run.folder.started_config`'s; a run started before the setting existed
    trained with plain batch norm and keeps ``1``: changing it half-way would change the method), a new run takes
    :func:`~obow.methods.mocov2.auto_bn_splits` of its per-process batch. ``config.yaml`` and the checkpoint then
    hold it. Other methods, and a value given, are left as they are."""
    if cfg.model.method != "mocov2" or cfg.moco.bn_splits is not None:
        return cfg
    from obow.methods.mocov2 import auto_bn_splits

    processes = D.world_size()
    local_batch = cfg.data.batch_size // processes
    started = (as_it_ran(started_with or {}).get("moco") or {}).get("bn_splits")
    if started_with is not None and started is not None:
        unrecorded = "bn_splits" not in (started_with.get("moco") or {})
        splits, why = started, "as the run started" + (", before the setting existed" if unrecorded else "")
    else:
        splits = auto_bn_splits(local_batch, processes)
        why = f"sub-batches of {local_batch // splits} of the {local_batch} images per process"
    log_main("MoCo: moco.bn_splits=null -> %d (%s)", splits, why)
    return dataclasses.replace(cfg, moco=dataclasses.replace(cfg.moco, bn_splits=splits))


def note_short_warmup(cfg: Config) -> None:
    """Say when the run is not longer than its ``optim.warmup_epochs``: it warms up over half its length
    (:func:`obow.schedules.run_warmup`), while its recipe keeps what was asked, for an extension to warm up as
    asked."""
    optim = cfg.optim
    if optim.warmup_epochs >= optim.epochs:
        log_main(
            "optim.warmup_epochs (%g) is not shorter than optim.epochs (%d): the warm-up is shortened to %g epochs "
            "for this run (config.yaml keeps %g: extended to more epochs, the run warms up as asked)",
            optim.warmup_epochs,
            optim.epochs,
            run_warmup(optim.warmup_epochs, optim.epochs),
            optim.warmup_epochs,
            level=logging.WARNING,
        )


def _with_pipeline(cfg: Config, pipeline: str) -> Config:
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, pipeline=pipeline))
