"""Saving and restoring a run: the checkpoint of a run in progress, written at step boundaries only (epoch ends, every
``train.checkpoint_every`` steps, every ``train.checkpoint_minutes``, and after a signal,
:mod:`~obow.training.run.signals`), holds everything needed to continue exactly where the run stopped: the method's
and the optimiser's state, the position in the epoch (:class:`~obow.training.run.state.RunState`), every process's
random state (:mod:`~obow.training.run.random_states`) and running sums of the epoch under way
(:func:`save_run`); :func:`start_or_resume` loads it back, or prepares a new run."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from obow import distributed as D
from obow.config import Config, to_dict
from obow.notices import counted
from obow.training.run.data_check import adopt_image_list
from obow.training.run.logger import log_main
from obow.training.run.random_states import get_rng_state, seed_run, set_rng_state
from obow.training.run.state import RunState
from obow.weights.checkpoint import build_checkpoint, save_atomic

if TYPE_CHECKING:
    from obow.data.folders import ImageList
    from obow.methods.base import Method


def save_run(
    out: Path,
    cfg: Config,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    state: RunState,
) -> None:
    """Write ``out/checkpoint.pt`` (atomically; the list of its images in place before it,
    :func:`~obow.training.run.data_check.adopt_image_list`), and a permanent copy at every ``train.keep_every``-th
    epoch end.

    Every process calls it at the same step boundary: the processes' random states and epoch sums differ
    (queue sampling, their share of the batch) and are all kept. Only the main process writes.
    """
    mine = {"rng": get_rng_state(), "sums": {key: float(value) for key, value in state.epoch_sums.items()}}
    everyone = gather(mine)
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
        rng=[p["rng"] for p in everyone],
        epoch_progress={
            "steps": state.epoch_steps,
            "seconds": state.epoch_time(),
            "sums": [p["sums"] for p in everyone],
        },
        skipped_images=sorted(state.skipped),
        tiny_images=sorted(state.tiny),
        history=state.history,
        **({"data": state.data} if state.data is not None else {}),
    )
    adopt_image_list(out)  # the list of the images this checkpoint was trained on, in place before it
    save_atomic(ckpt, out / "checkpoint.pt", keep_previous=True)
    if state.batch_in_epoch == 0 and cfg.train.keep_every and state.epoch % cfg.train.keep_every == 0:
        save_atomic(ckpt, out / "checkpoints" / f"epoch_{state.epoch:04d}.pt")


def gather(obj: Any) -> list[Any]:
    """``obj`` of every process, in rank order (on every process)."""
    if not D.is_distributed():
        return [obj]
    everyone: list[Any] = [None] * D.world_size()
    dist.all_gather_object(everyone, obj)
    return everyone


def restore(
    ckpt: dict[str, Any],
    model: Method,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    iters_per_epoch: int,
) -> RunState:
    """Load ``ckpt`` into the model, optimiser, gradient scaler and this process's random generators; return
    where the run stands, with this process's sums of the epoch under way."""
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    if "scaler" in ckpt:
        scaler.load_state_dict(ckpt["scaler"])
    set_rng_state(this_process(ckpt["rng"]))
    progress = ckpt.get("epoch_progress") or {}  # absent from version-1 checkpoints, which had none
    epoch, batch = ckpt["epoch"], min(ckpt["batch_in_epoch"], iters_per_epoch)
    if epoch * iters_per_epoch + batch != ckpt["iteration"]:
        model.realign_iteration(epoch * iters_per_epoch + batch)
    return RunState(
        epoch=epoch,
        batch_in_epoch=batch,
        iteration=epoch * iters_per_epoch + batch,
        history=ckpt.get("history", []),
        skipped=set(ckpt.get("skipped_images", [])),
        tiny=set(ckpt.get("tiny_images", [])),
        epoch_sums=this_process_sums(progress.get("sums", [])),
        epoch_steps=progress.get("steps", 0),
        epoch_seconds=progress.get("seconds", 0.0),
    )


def this_process(per_process: list[Any]) -> Any:
    """This process's entry of a per-process list (the first one when the number of processes changed)."""
    return per_process[D.rank()] if len(per_process) == D.world_size() else per_process[0]


def this_process_sums(per_process: list[dict[str, float]]) -> dict[str, float]:
    """This process's running sums; with another number of processes than when saved, the mean over the saved
    ones (the epoch's mean, a mean over processes of sum / steps, is then unchanged up to rounding)."""
    if not per_process:
        return {}
    if len(per_process) == D.world_size():
        return dict(per_process[D.rank()])
    return {key: sum(p[key] for p in per_process) / len(per_process) for key in per_process[0]}


def start_or_resume(
    ckpt: dict[str, Any] | None,
    model: Method,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    images: ImageList,
    cfg: Config,
    device: torch.device,
    out: Path,
) -> RunState:
    """Where the run starts: the checkpoint's state loaded into the model, optimiser, scaler and random
    generators; or, for a new run, the method's one-off preparation (e.g. BoWNet's off-line k-means) and
    per-process seeds. Says which in the log."""
    iters_per_epoch = len(images) // cfg.data.batch_size
    if ckpt is not None:
        state = restore(ckpt, model, optimizer, scaler, iters_per_epoch)
        if state.epoch >= cfg.optim.epochs:  # finished: the loop says so, there is nothing to resume
            return state
        log_main(
            "Resuming %s from iteration %d of %d (epoch %d, batch %d of %d)",
            out,
            state.iteration,
            iters_per_epoch * cfg.optim.epochs,
            state.epoch + 1,
            state.batch_in_epoch,
            iters_per_epoch,
        )
        return state
    model.prepare(images, cfg, device)
    seed_run(cfg.train.seed + D.rank())  # runtime randomness (queue sampling) differs per process
    per_epoch = counted(iters_per_epoch, "iteration")
    log_main("New run in %s (no checkpoint there): %d images, %s per epoch", out, len(images), per_epoch)
    return RunState()
