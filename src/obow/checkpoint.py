"""Checkpoint files: written atomically, read back with a clear error when they are not ours.

A pretraining checkpoint is a ``torch.save`` dictionary:

=================  ==========================================================================================
``format``         ``"obow-checkpoint"``
``version``        1
``config``         the resolved recipe (:func:`obow.config.to_dict`), so the run can be rebuilt
``model``          the :class:`~obow.method.OBoW` ``state_dict``: ``student.*`` and ``teacher.*`` (torchvision
                   ResNet names), ``extractors.<level>.*`` (vocabulary and statistics), ``predictor.*``,
                   ``iteration``
``optimizer``      the optimiser's ``state_dict``
``epoch``          completed epochs; ``batch_in_epoch``: batches done in the epoch under way (0 at epoch ends)
``iteration``      optimiser steps done
``rng``            random states (Python, NumPy, torch CPU and CUDA), one per process in rank order
``skipped_images`` unreadable files met so far
``history``        per-epoch summaries
=================  ==========================================================================================
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
