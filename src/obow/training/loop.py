"""``obow pretrain``: the training loop, readable top to bottom.

:func:`pretrain` sets up the run (processes, device, data, method, optimiser), takes the run folder's lock
(:mod:`obow.training.run.lock`: one writer at a time), resumes from ``<out>/checkpoint.pt`` when there is one
(:mod:`obow.training.run.checkpoints`), then calls :func:`train_one_epoch` until the recipe's epochs are done. One step
(:func:`train_step`): the learning rate of the iteration, the method's forward pass (for OBoW: teacher EMA,
BoW targets, vocabulary update, student loss; see :mod:`obow.methods.base` for the contract every method
meets), backward, SGD step, run by the step ``train.compile`` chose (eager, compiled or graphed:
:mod:`obow.training.step`).

Checkpoints are written only between two steps (:class:`StepBoundary`), so that each one is a state an
uninterrupted run also passes through: at every epoch end, every ``train.checkpoint_every`` steps, every
``train.checkpoint_minutes`` of training (so that a hard kill loses at most that much), and after SIGINT,
SIGTERM or SIGHUP, which let the step under way finish, write the checkpoint and stop (:class:`Interrupted`,
:mod:`obow.training.run.signals`); a step
that compiles (``train.compile``) stops at once instead, keeping nothing (:mod:`obow.training.step.watch`).

A run is settled, built, then trained: its ``auto`` settings and threads resolved once
(:mod:`obow.training.run.settle`), then what it is built from (process, device, data, method, optimiser):
:mod:`obow.training.build`; its arithmetic: :mod:`obow.training.run.precision`. Files in ``<out>``:
:mod:`obow.training.run.folder`; logs: :mod:`obow.training.run.logger`. What it will cost is said (and a run that cannot
fit refused) before its first step: :mod:`obow.training.cost`; a diverging run stops before a checkpoint
keeps it, a collapse is warned about: :mod:`obow.training.run.guards`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch import nn

from obow import distributed as D
from obow.config import Config
from obow.data.cache import BuildStopped
from obow.data.folders import EpochSampler, ImageList, scan_images
from obow.data.identity import identify
from obow.methods.base import Method
from obow.notices import release_notices
from obow.schedules import learning_rate
from obow.training.build import (
    build_data,
    build_model,
    build_optimizer,
    prepare_step_model,
    setup_process,
)
from obow.training.cost import check_budget, check_view_sizes, out_of_memory
from obow.training.run.busy import BusyWatch
from obow.training.run.checkpoints import save_run, start_or_resume
from obow.training.run.folder import check_inputs, check_out_outside_data, open_run
from obow.training.run.guards import RunGuard, kept_checkpoint
from obow.training.run.lock import RunLock
from obow.training.run.logger import RunLogger, log_interval, log_main, logged_step, logged_steps
from obow.training.run.settle import SettledRun, settle_run
from obow.training.run.signals import Interrupted, SignalFlag, handle_signals, run_aborted, stopped_while_setting_up
from obow.training.run.state import RunError, RunState, summary
from obow.training.run.threads import chosen_threads
from obow.training.step import TrainingStep, build_step, check_step_mode
from obow.training.step.shared import to_device
from obow.training.step.watch import CompileWatch, checkpoint_iteration

__all__ = ["EPOCH_MEANS", "Interrupted", "RunError", "pretrain", "train_one_epoch", "train_step"]

log = logging.getLogger("obow")

#: Step metrics averaged over each epoch (the loss over every step, the diagnostics over the logged steps, where
#: they are computed: :func:`logged_step`), and their names in the epoch record.
EPOCH_MEANS = {
    "loss": "loss",
    "student/effective_rank": "effective_rank",
    "student/mean_cosine": "mean_cosine",
}


class Monitor(Protocol):
    """Measures the student between epochs (e.g. :class:`obow.evaluate.monitor.KNNMonitor`)."""

    def due(self, epoch: int) -> bool: ...

    def __call__(self, backbone: nn.Module) -> dict[str, float]: ...


#: Builds a run's monitor from its recipe, training images and device.
MonitorFactory = Callable[[Config, ImageList, torch.device], Monitor]


class Decision(NamedTuple):
    stop: bool  # a signal was received (by any process)
    save: bool  # train.checkpoint_minutes have passed since the last checkpoint


class StepBoundary:
    """What happens between two steps, decided alike on every process (one small all-reduce when distributed):
    stop after SIGINT / SIGTERM, received by any process; save when ``train.checkpoint_minutes`` have passed
    since the last checkpoint, by the main process's clock."""

    def __init__(self, signals: SignalFlag, minutes: float, device: torch.device) -> None:
        self.signals = signals
        self.seconds = minutes * 60
        self.device = device
        self.last_save = time.monotonic()

    def check(self) -> Decision:
        due = bool(self.seconds) and D.is_main_process() and time.monotonic() - self.last_save >= self.seconds
        stop, save = D.agree_any([self.signals.received is not None, due], self.device)
        return Decision(stop, save)

    def saved(self) -> None:
        self.last_save = time.monotonic()


@dataclass
class Run:
    """The parts of a run in progress that every step uses."""

    cfg: Config
    out: Path
    device: torch.device
    model: Method
    step_model: nn.Module  # the model, wrapped for DistributedDataParallel when there are several processes
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    sampler: EpochSampler
    loader: Iterable[dict[str, Any]]  # a DataLoader, or a DeviceLoader (data.pipeline: device)
    iters_per_epoch: int
    logger: RunLogger
    boundary: StepBoundary
    step: TrainingStep  # eager, compiled or graphed (train.compile), chosen once by build_step
    watch: CompileWatch | None = None  # what a compiling step says, and a signal stopping it at once
    guard: RunGuard = field(default_factory=RunGuard)  # a non-finite loss stops the run, a collapse is warned of
    saved_at: int | None = None  # the iteration of the checkpoint on disk (None: none yet)
    busy: BusyWatch | None = None  # the threads adapted to the cores other processes leave (a CPU run's)

    def save(self, state: RunState) -> None:
        """The checkpoint of ``state``, unless a loss since the last one was not finite (:class:`RunError`); every
        process calls it at the same step boundary."""
        self.guard.check(self.out, self.saved_at, self.device, self.model)
        save_run(self.out, self.cfg, self.model, self.optimizer, self.scaler, state)
        self.saved_at = state.iteration
        self.boundary.saved()


def pretrain(cfg: Config, out_dir: str | Path, *, monitor: MonitorFactory | None = None) -> dict[str, Any]:
    """Pretrain (or resume pretraining) with ``cfg``, writing everything under ``out_dir``.

    ``monitor`` builds what measures the student between epochs on the main process (the ``obow`` command
    passes :class:`obow.evaluate.monitor.KNNMonitor`, which ``train.knn_every`` configures). Returns a
    summary: epochs done, iterations, the last epoch's mean loss, and where the checkpoint is. Raises
    :class:`Interrupted` after SIGINT / SIGTERM, once the checkpoint of the last finished step is written.
    """
    joined_here = not D.is_distributed()
    device = setup_process(cfg)
    joined_here = joined_here and D.is_distributed()
    stopped_together = False  # every process ended at the same step boundary (done, or a signal)
    try:
        result = run_pretraining(cfg, Path(out_dir), device, monitor)
        stopped_together = True
        return result
    except Interrupted:
        stopped_together = True
        raise
    finally:
        if joined_here and stopped_together:
            # Leave the process group while the interpreter is whole: gloo's worker threads torn down during
            # interpreter finalization abort the process ("terminate called without an active exception",
            # SIGABRT), which turns a finished run into a failed torchrun job now and then.
            dist.destroy_process_group()


def run_pretraining(cfg: Config, out: Path, device: torch.device, monitor: MonitorFactory | None) -> dict[str, Any]:
    """:func:`pretrain`'s work, once the process has joined its group and chosen its device."""
    if cfg.data.path is None:
        raise RunError("no training images: set data.path (obow pretrain --data DIR)")
    check_inputs(cfg)  # before the run folder is created
    if why := check_step_mode(cfg):
        raise RunError(why)
    check_out_outside_data(cfg, out)
    # and the images found before it too: an empty --data, or one with fewer images than a batch, leaves no folder
    # with a config.yaml and a lock behind
    images = scan_images(cfg.data.path, cfg.data.labels, cfg.data.images_per_class)
    if cfg.data.batch_size > len(images):  # a step takes a whole batch: not one would be made
        raise RunError(
            f"data.batch_size ({cfg.data.batch_size}) is larger than the number of images ({len(images)}) under "
            f"{cfg.data.path}: lower data.batch_size or add images"
        )
    release_notices()  # the lines `obow pretrain` held until the images were found
    with RunLock(out, device=device):  # one writer per run folder, from here to the end
        settled = settle_run(cfg, out, device)
        workers = settled.pipeline == "workers"
        with chosen_threads(settled.threads, settled.threads_why, workers, device) as busy:
            return train_in_lock(settled, out, device, monitor, images, busy)


def train_in_lock(
    settled: SettledRun,
    out: Path,
    device: torch.device,
    monitor: MonitorFactory | None,
    images: ImageList,
    busy: BusyWatch | None = None,
) -> dict[str, Any]:
    """:func:`run_pretraining`'s work once the run folder is locked and the run settled, on the training ``images``
    it found: build, then train (its threads adapted to the machine's other work by ``busy``, when given)."""
    cfg = settled.cfg
    main = D.is_main_process()
    with handle_signals(announce=main) as signals:
        with stopped_while_setting_up(signals, lambda: setup_keeps(out), announce=main):  # a signal: at once
            check_view_sizes(cfg, images.paths)
            check_budget(cfg, device, len(images) // cfg.data.batch_size)  # a run that cannot fit is refused here
            identity = identify(images)
            ckpt = open_run(cfg, out, identity)
            data_record = identity.record
            del identity  # its list of every image is not held through the run
            images, sampler, loader = build_data(cfg, device, images, pipeline=settled.pipeline)
            iters_per_epoch = len(images) // cfg.data.batch_size
            total_iters = iters_per_epoch * cfg.optim.epochs
            model = build_model(cfg, total_iters, device, resuming=ckpt is not None)
            optimizer = build_optimizer(model, cfg)
            scaler = torch.amp.GradScaler(device.type, enabled=cfg.train.precision == "fp16")
            state = start_or_resume(ckpt, model, optimizer, scaler, images, cfg, device, out)
            state.data = data_record
            if state.epoch >= cfg.optim.epochs:
                log_main("%s is finished (%d of %d iterations); raise optim.epochs to extend it", out,
                         state.iteration, total_iters)  # fmt: skip
                return {**summary(out, state), "already_finished": True}

            step_model = prepare_step_model(model, cfg, device)
            epoch_monitor = make_monitor(monitor, cfg, images, device)
            model.train()
        logger = RunLogger(out, cfg, enabled=main)
        with CompileWatch(cfg, device, out, signals, logger) as watch:
            boundary = StepBoundary(signals, cfg.train.checkpoint_minutes, device)
            step = build_step(cfg, model, step_model, optimizer, scaler, device)
            parts = (model, step_model, optimizer, scaler, sampler, loader, iters_per_epoch, logger, boundary, step)
            saved_at = state.iteration if ckpt is not None else None
            run = Run(cfg, out, device, *parts, watch=watch, saved_at=saved_at, busy=busy)
            try:
                train_epochs(run, state, epoch_monitor)
            except KeyboardInterrupt as abort:  # a second signal (handle_signals), or a cache rebuild stopped
                if isinstance(abort, BuildStopped) and not D.is_distributed():  # by the first, between two steps
                    run.save(state)  # the checkpoint the signal asked for
                raise run_aborted(abort, kept_checkpoint(out, run.saved_at), announce=main) from None
            except Interrupted:
                if state.epoch >= cfg.optim.epochs:
                    log_main(
                        "Interrupted as the run ended: it is complete (checkpoint written at iteration %d); the "
                        "command stops here, and the same command goes on with what follows the training",
                        state.iteration,
                    )
                else:
                    log_main(
                        "Interrupted: checkpoint written at iteration %d (epoch %d, batch %d); run the same command "
                        "to resume",
                        state.iteration,
                        state.epoch + 1,
                        state.batch_in_epoch,
                    )
                raise
            except RuntimeError as err:
                if (oom := out_of_memory(err, cfg)) is not None:
                    raise oom from None
                raise
            finally:
                logger.close()
    return summary(out, state)


def setup_keeps(out: Path) -> str:
    """What a run stopped while it was set up keeps, and how to go on (:func:`stopped_while_setting_up`)."""
    iteration = checkpoint_iteration(out / "checkpoint.pt")
    again = "resume" if iteration is not None else "start it again"
    return f"{kept_checkpoint(out, iteration)}; run the same command to {again}"


def train_epochs(run: Run, state: RunState, epoch_monitor: Monitor | None) -> None:
    """The remaining epochs, each ended by its record (plus the monitor's numbers when due) and a checkpoint;
    :class:`Interrupted` at the first step boundary after a signal."""
    while state.epoch < run.cfg.optim.epochs:
        record = train_one_epoch(run, state)
        if epoch_monitor is not None and epoch_monitor.due(state.epoch + 1):
            with run.boundary.signals.finishing("the end-of-epoch monitor under way (the epoch's steps are done)"):
                start = time.perf_counter()
                record.update(epoch_monitor(run.model.student))
                record["monitor_time_s"] = round(time.perf_counter() - start, 3)
        if D.is_distributed():
            dist.barrier()  # the other processes wait for the main one's monitor
        state.end_epoch(record)
        run.logger.epoch(record)
        run.save(state)
        if run.boundary.check().stop:  # a signal during the epoch's end; after the last one, the run is complete
            raise Interrupted(run.boundary.signals.received)  # and the command stops before what follows it


def train_one_epoch(run: Run, state: RunState) -> dict[str, Any]:
    """The rest of epoch ``state.epoch`` (from batch ``state.batch_in_epoch``); returns its record: mean loss
    and diagnostics over all its steps, those before a resumption included (averaged across processes), time,
    skipped images. Between two steps, :func:`step_boundary`."""
    cfg, epoch = run.cfg, state.epoch
    run.sampler.set_epoch(epoch, state.batch_in_epoch)
    state.segment_start = time.time()
    # running sums on the device (no synchronisation per step), carried over from the checkpoint when resuming
    state.epoch_sums = {key: torch.tensor(state.epoch_sums.get(key, 0.0), device=run.device) for key in EPOCH_MEANS}
    total_iters = run.iters_per_epoch * cfg.optim.epochs
    progress = run.logger.progress(epoch, state.batch_in_epoch, run.iters_per_epoch, total_iters, state.iteration)
    interval = log_interval(cfg, total_iters)
    for batch in run.loader:
        lr = learning_rate(
            state.iteration,
            run.iters_per_epoch,
            base_lr=cfg.optim.lr,
            epochs=cfg.optim.epochs,
            warmup_epochs=cfg.optim.warmup_epochs,
            end_lr=cfg.optim.end_lr,
            cosine_per_epoch=cfg.optim.cosine_per_epoch,
        )
        logged = logged_step(state.iteration + 1, interval, state.batch_in_epoch + 1 == run.iters_per_epoch)
        run.model.begin_step(logged, state.iteration)  # the model's iteration, counted here: no read of the device's
        assert run.watch is not None  # pretrain sets it
        with run.watch.step(state.iteration + 1):
            metrics = train_step(run, batch["image"], lr)
        run.guard.note(metrics["loss"], state.iteration + 1, lr)
        state.iteration += 1
        state.batch_in_epoch += 1
        state.epoch_steps += 1
        for key, total in state.epoch_sums.items():
            total += metrics.get(key, 0.0)
        state.note_skipped(batch["skipped"], batch.get("tiny", ()), dict(batch.get("reasons", ())))
        if run.busy is not None:
            run.busy.check()
        if logged:
            values = {k: float(v) for k, v in metrics.items()}
            run.guard.check(run.out, run.saved_at, run.device)
            run.guard.logged(values, state.iteration)
            run.logger.step(epoch, state.iteration, lr, values, len(state.skipped), cfg.data.batch_size)
        progress.update(cfg.data.batch_size, metrics, lr, logged)
        if state.batch_in_epoch < run.iters_per_epoch:  # the epoch's end has its own checkpoint and check
            step_boundary(run, state)
    progress.close()
    steps = max(state.epoch_steps, 1)
    diagnosed = max(logged_steps(state.iteration - state.epoch_steps, state.epoch_steps, interval), 1)
    means = {
        key: float(D.all_reduce_mean(total / (steps if key == "loss" else diagnosed)))
        for key, total in state.epoch_sums.items()
    }
    return {
        "epoch": epoch + 1,
        "iteration": state.iteration,
        **{name: means[key] for key, name in EPOCH_MEANS.items()},
        "epoch_time_s": state.epoch_time(),
        "skipped_images": len(state.skipped),
        "tiny_images": len(state.tiny),
    }


def step_boundary(run: Run, state: RunState) -> None:
    """Between two steps of an epoch: write a checkpoint when one is due (``train.checkpoint_every`` steps,
    ``train.checkpoint_minutes``, or a signal), then stop after a signal."""
    decision = run.boundary.check()
    every = run.cfg.train.checkpoint_every and state.iteration % run.cfg.train.checkpoint_every == 0
    if decision.stop or decision.save or every:
        run.save(state)
    if decision.stop:
        raise Interrupted(run.boundary.signals.received)


def train_step(run: Run, views: dict[str, torch.Tensor], lr: float) -> dict[str, torch.Tensor]:
    """One optimiser step at learning rate ``lr`` on a batch of views (the run's step: eager, compiled or graphed,
    :mod:`obow.training.step`); returns the step's detached metrics."""
    teacher_images, student_views = to_device(views, run.device, run.cfg.train.channels_last)
    return run.step(teacher_images, student_views, lr)


def make_monitor(
    factory: MonitorFactory | None, cfg: Config, images: ImageList, device: torch.device
) -> Monitor | None:
    """The run's monitor, on the main process only."""
    if not D.is_main_process():
        return None
    if factory is None:
        if cfg.train.knn_every:
            log.info("kNN monitor off: pretrain was given no monitor (obow pretrain passes KNNMonitor)")
        return None
    return factory(cfg, images, device)
