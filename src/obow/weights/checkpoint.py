"""Checkpoint files: written atomically, read back with a clear error when they are not ours.

A pretraining checkpoint is a ``torch.save`` dictionary:

=================  ==========================================================================================
``format``         ``"obow-checkpoint"``
``version``        1
``config``         the resolved recipe (:func:`obow.config.to_dict`), so the run can be rebuilt
``model``          the method's ``state_dict``; for :class:`~obow.methods.obow.OBoW`: ``student.*`` and
                   ``teacher.*`` (torchvision ResNet names), ``extractors.<level>.*`` (vocabulary and
                   statistics), ``predictor.*``, ``iteration``
``optimizer``      the optimiser's ``state_dict``
``epoch``          completed epochs; ``batch_in_epoch``: batches done in the epoch under way (0 at epoch ends)
``iteration``      optimiser steps done
``rng``            random states (Python, NumPy, torch CPU and CUDA), one per process in rank order
``skipped_images`` unreadable files met so far
``history``        per-epoch summaries
``scaler``         the fp16 gradient scaler's state
``imported_from``  the authors' file, for a checkpoint written by ``obow import-official``
=================  ==========================================================================================

Only ``format``, ``version``, ``config`` and ``model`` are needed to evaluate or export; the rest to resume.
:func:`build_checkpoint` is the one place the dictionary is put together.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

FORMAT = "obow-checkpoint"
VERSION = 1


def save_atomic(obj: Any, path: str | Path) -> None:
    """``torch.save`` to a temporary file in the same folder, then rename it over ``path``.

    A crash or a kill during the write leaves the previous file intact.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a pretraining checkpoint written by ``obow pretrain``; raise ``ValueError`` for anything else."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"checkpoint {str(path)!r} does not exist")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=False)
    except Exception as err:  # noqa: BLE001 - any unreadable file gets the same clear message
        raise ValueError(f"cannot read checkpoint {str(path)!r}: {err}") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise ValueError(f"{str(path)!r} is not an obow pretraining checkpoint (no format={FORMAT!r} entry)")
    if ckpt.get("version", 0) > VERSION:
        raise ValueError(f"{str(path)!r} has checkpoint version {ckpt['version']}; this obow reads up to {VERSION}")
    return ckpt


def build_checkpoint(
    config: dict[str, Any],
    model: dict[str, Any],
    *,
    epoch: int,
    iteration: int,
    batch_in_epoch: int = 0,
    optimizer: dict[str, Any] | None = None,
    scaler: dict[str, Any] | None = None,
    rng: list[dict[str, Any]] | None = None,
    skipped_images: list[str] | None = None,
    history: list[dict[str, Any]] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """The checkpoint dictionary (see the module docstring): ``config`` is the plain recipe
    (:func:`obow.config.to_dict`), ``model`` the method's ``state_dict``. The training state (``optimizer``,
    ``scaler``, ``rng``, ...) is left out when not given: such a checkpoint evaluates and exports but does not
    resume. ``extra`` entries (e.g. ``imported_from``) are kept as they are."""
    ckpt: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "config": config,
        "model": model,
        "epoch": epoch,
        "iteration": iteration,
    }
    if optimizer is not None:
        ckpt.update(
            optimizer=optimizer,
            batch_in_epoch=batch_in_epoch,
            rng=rng if rng is not None else [],
            skipped_images=list(skipped_images or []),
            history=list(history or []),
        )
    if scaler is not None:
        ckpt["scaler"] = scaler
    ckpt.update(extra)
    return ckpt
