"""What a run keeps and how it comes back: the run folder, the checkpoint of a run in progress, resumption.

A run lives in one folder (``--out``): ``config.yaml`` (the resolved recipe), ``checkpoint.pt`` (the latest
state, :mod:`obow.weights.checkpoint`'s format), ``checkpoints/epoch_NNNN.pt`` (permanent copies every
``train.keep_every`` epochs), ``log.jsonl`` and ``tensorboard/``. A checkpoint holds everything needed to
continue exactly where the run stopped: the method's and the optimiser's state, the position in the epoch
(:class:`RunState`) and every process's random state. Resuming refuses a recipe whose run-defining settings
differ from the checkpoint's (:func:`check_same_run`); only :data:`RESUMABLE_CHANGES` may change.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from obow import distributed as D
from obow.config import Config, from_dict, save_config, to_dict
from obow.weights.checkpoint import build_checkpoint, load_checkpoint, save_atomic

log = logging.getLogger("obow")

#: Settings that may change between a run and its resumption (they do not change what is computed).
RESUMABLE_CHANGES = {
    "description",
    "data.num_workers",
    "data.pin_memory",
    "data.val_path",
    "train.device",
    "train.compile",
    "train.log_every",
    "train.checkpoint_every",
    "train.keep_every",
    "train.knn_every",
    "train.knn_k",
    "train.knn_temperature",
    "train.progress_bar",
    "train.tensorboard",
}


class RunError(RuntimeError):
    """A run cannot start or continue; the message says why and what to do."""


class Interrupted(Exception):
    """Raised in the training loop by SIGINT / SIGTERM, after which a checkpoint is written."""


@dataclass
class RunState:
    """Where a run stands: ``epoch`` epochs done, ``batch_in_epoch`` batches into the next one, ``iteration``
    optimiser steps in all; the per-epoch records and the unreadable images met so far."""

    epoch: int = 0
    batch_in_epoch: int = 0
    iteration: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    skipped: set[str] = field(default_factory=set)

    def end_epoch(self, record: dict[str, Any]) -> None:
        self.history.append(record)
        self.epoch += 1
        self.batch_in_epoch = 0


def open_run(cfg: Config, out: Path) -> dict[str, Any] | None:
    """The checkpoint of the run in ``out`` (``None`` for a new run), checked against ``cfg``; the folder is
    created, ``config.yaml`` written, and what a killed process left behind cleared: half-written checkpoint
    files, and log records of iterations after the checkpoint (a resumed run computes them again)."""
    path = out / "checkpoint.pt"
    ckpt = load_checkpoint(path) if path.exists() else None
    if ckpt is not None:
        check_same_run(cfg, ckpt["config"], path)
        if "optimizer" not in ckpt:
            raise RunError(
                f"{path} holds weights but no training state (written by obow import-official?): it can be "
                "evaluated and exported, not resumed; use another --out for a new run"
            )
    if D.is_main_process():
        out.mkdir(parents=True, exist_ok=True)
        save_config(cfg, out / "config.yaml")
        for stale in out.glob(".checkpoint.pt.*.tmp"):
            stale.unlink()
        if ckpt is not None:
            truncate_log(out / "log.jsonl", ckpt["iteration"])
    return ckpt


def restore(
    ckpt: dict[str, Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    iters_per_epoch: int,
) -> RunState:
    """Load ``ckpt`` into the model, optimiser, gradient scaler and this process's random generators."""
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    if "scaler" in ckpt:
        scaler.load_state_dict(ckpt["scaler"])
    states = ckpt["rng"]
    set_rng_state(states[D.rank()] if len(states) == D.world_size() else states[0])
    epoch, batch = ckpt["epoch"], ckpt["batch_in_epoch"]
    return RunState(
        epoch=epoch,
        batch_in_epoch=batch,
        iteration=epoch * iters_per_epoch + batch,
        history=ckpt.get("history", []),
        skipped=set(ckpt.get("skipped_images", [])),
    )


def save_run(
    out: Path,
    cfg: Config,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    state: RunState,
    every_process: bool = True,
) -> None:
    """Write ``out/checkpoint.pt`` (atomically), and a permanent copy at every ``train.keep_every``-th epoch end.

    Every process's random state is kept (they differ: queue sampling), when all of them are here to send it
    (``every_process``); an interruption saves the main process's only, so such a resume is exact on one
    process. Only the main process writes.
    """
    rng = gather_rng_states() if every_process else [get_rng_state()]
    if not D.is_main_process():
        return
    ckpt = build_checkpoint(
        to_dict(cfg),
        model.state_dict(),
        epoch=state.epoch,
        iteration=state.iteration,
        batch_in_epoch=state.batch_in_epoch,
        optimizer=optimizer.state_dict(),
        scaler=scaler.state_dict(),
        rng=rng,
        skipped_images=sorted(state.skipped),
        history=state.history,
    )
    save_atomic(ckpt, out / "checkpoint.pt")
    if state.batch_in_epoch == 0 and cfg.train.keep_every and state.epoch % cfg.train.keep_every == 0:
        save_atomic(ckpt, out / "checkpoints" / f"epoch_{state.epoch:04d}.pt")


def check_same_run(cfg: Config, saved: dict[str, Any], path: Path) -> None:
    """Refuse to resume a checkpoint whose run-defining settings differ from ``cfg``."""
    try:  # settings added after the checkpoint was written count as their defaults
        saved = to_dict(from_dict(Config, saved))
    except ValueError:
        pass
    now, before = flatten(to_dict(cfg)), flatten(saved)
    changed = sorted(
        k for k in now.keys() | before.keys() if now.get(k) != before.get(k) and k not in RESUMABLE_CHANGES
    )
    if changed:
        diffs = "; ".join(f"{k}: {before.get(k)!r} -> {now.get(k)!r}" for k in changed)
        raise RunError(
            f"{path} belongs to a run with other settings ({diffs}). Use another --out for a new run, "
            "or the same settings to resume this one"
        )


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def truncate_log(path: Path, iteration: int) -> None:
    """Drop the log records of iterations after ``iteration``: a resumed run computes them again."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a kill
            continue
        if record.get("iteration", 0) <= iteration:
            kept.append(line)
    path.write_text("".join(f"{line}\n" for line in kept))


def get_rng_state() -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def gather_rng_states() -> list[dict[str, Any]]:
    """The random states of every process, in rank order (on every process)."""
    state = get_rng_state()
    if not D.is_distributed():
        return [state]
    states: list[Any] = [None] * D.world_size()
    dist.all_gather_object(states, state)
    return states


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@contextlib.contextmanager
def handle_signals() -> Iterator[None]:
    """Turn SIGINT and SIGTERM into :class:`Interrupted` so the loop can write a checkpoint first."""

    def raise_interrupted(signum: int, frame: Any) -> None:
        raise Interrupted(signal.Signals(signum).name)

    try:
        previous = {s: signal.signal(s, raise_interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
