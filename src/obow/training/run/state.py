"""Where a run stands (:class:`RunState`), what a run says when it cannot go on (:class:`RunError`), and the summary
:func:`obow.training.loop.pretrain` returns.

The rest of the run is a module a concern, read in the order a run meets them: its folder
(:mod:`~obow.training.run.folder`: ``config.yaml``, the checkpoint found, what a killed process left), the checks
of a resumed run against its checkpoint (:mod:`~obow.training.run.settings_check`, the settings;
:mod:`~obow.training.run.data_check`, the training images), saving and restoring
(:mod:`~obow.training.run.checkpoints`), every process's random states (:mod:`~obow.training.run.random_states`)
and the signals that stop it at a step boundary (:mod:`~obow.training.run.signals`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("obow")


class RunError(RuntimeError):
    """A run cannot start or continue; the message says why and what to do."""


@dataclass
class RunState:
    """Where a run stands: ``epoch`` epochs done, ``batch_in_epoch`` batches into the next one, ``iteration``
    optimiser steps in all; the per-epoch records, the unreadable and the tiny images met so far; and this process's
    share of the epoch under way: the running ``epoch_sums`` of the step metrics averaged in its record (over
    ``epoch_steps`` steps) and the ``epoch_seconds`` spent in it before :attr:`segment_start`."""

    epoch: int = 0
    batch_in_epoch: int = 0
    iteration: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    skipped: set[str] = field(default_factory=set)
    tiny: set[str] = field(default_factory=set)
    epoch_sums: dict[str, Any] = field(default_factory=dict)
    epoch_steps: int = 0
    epoch_seconds: float = 0.0
    segment_start: float = field(default_factory=time.time)
    #: The training images' identity (:attr:`obow.data.identity.DataIdentity.record`), kept in each checkpoint.
    data: dict[str, Any] | None = None

    def epoch_time(self) -> float:
        """Seconds spent in the epoch under way, across resumptions (the time between them not counted)."""
        return self.epoch_seconds + time.time() - self.segment_start

    def end_epoch(self, record: dict[str, Any]) -> None:
        self.history.append(record)
        self.epoch += 1
        self.batch_in_epoch = 0
        self.epoch_sums, self.epoch_steps, self.epoch_seconds = {}, 0, 0.0
        self.segment_start = time.time()

    def note_skipped(
        self, skipped: list[str], tiny: Iterable[tuple[str, int]] = (), reasons: dict[str, str] | None = None
    ) -> None:
        """Count the unreadable images of a batch, each reported once with why (``reasons``, from the pipeline), and
        the tiny ones it used (each reported once)."""
        from obow.data.folders import TINY_UPSCALE

        new = set(skipped) - self.skipped
        for path in sorted(new):
            log.warning("skipped image %s: %s", path, (reasons or {}).get(path, "unreadable"))
        self.skipped |= new
        for path, side in sorted({(path, side) for path, side in tiny if path not in self.tiny}):
            log.warning(
                "tiny image %s (shorter side %d px): upscaled more than %dx into the views, used all the same",
                path,
                side,
                TINY_UPSCALE,
            )
            self.tiny.add(path)


def summary(out: Path, state: RunState) -> dict[str, Any]:
    return {
        "out": str(out),
        "epochs": state.epoch,
        "iteration": state.iteration,
        "loss": state.history[-1]["loss"] if state.history else None,
        "checkpoint": str(out / "checkpoint.pt"),
    }
