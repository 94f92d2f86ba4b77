"""``obow pretrain``: the training loop, readable top to bottom.

:func:`pretrain` sets up the run (processes, device, data, method, optimiser), takes the run folder's lock
(:mod:`obow.training.lock`: one writer at a time), resumes from ``<out>/checkpoint.pt`` when there is one
(:mod:`obow.training.state`), then calls :func:`train_one_epoch` until the recipe's epochs are done. One step
(:func:`train_step`): the learning rate of the iteration, the method's forward pass (for OBoW: teacher EMA,
BoW targets, vocabulary update, student loss; see :mod:`obow.methods.base` for the contract every method
meets), backward, SGD step.

Checkpoints are written only between two steps (:class:`StepBoundary`), so that each one is a state an
uninterrupted run also passes through: at every epoch end, every ``train.checkpoint_every`` steps, every
``train.checkpoint_minutes`` of training (so that a hard kill loses at most that much), and after SIGINT or
SIGTERM, which let the step under way finish, write the checkpoint and stop (:class:`Interrupted`).

Files in ``<out>``: see :mod:`obow.training.state`; logs: :mod:`obow.training.logger`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist
import yaml
from torch import nn

from obow import distributed as D
from obow.config import Config
from obow.data.cache import build_cache
from obow.data.device_loader import DeviceLoader
from obow.data.folders import EpochSampler, ImageDataset, ImageList, build_loader, scan_images
from obow.methods import build_batched_views, build_method, build_views, views_side
from obow.methods.base import Method
from obow.schedules import learning_rate
from obow.training import PRECISIONS
from obow.training.lock import RunLock
from obow.training.logger import RunLogger
from obow.training.state import (
    Interrupted,
    RunError,
    RunState,
    SignalFlag,
    check_inputs,
    handle_signals,
    open_run,
    restore,
    save_run,
    seed_run,
)

__all__ = ["EPOCH_MEANS", "Interrupted", "RunError", "pretrain", "train_one_epoch", "train_step"]

log = logging.getLogger("obow")

#: Step metrics averaged over each epoch, and their names in the epoch record.
EPOCH_MEANS = {
    "loss": "loss",
    "student/effective_rank": "effective_rank",
    "student/mean_cosine": "mean_cosine",
}


#: A short run logs often enough to give ``obow show run`` this many points per curve.
MIN_LOGGED_STEPS = 100


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

    def save(self, state: RunState) -> None:
        """The checkpoint of ``state``; every process calls it at the same step boundary."""
        save_run(self.out, self.cfg, self.model, self.optimizer, self.scaler, state)
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
    with RunLock(out, device=device), chosen_threads(cfg):  # one writer per run folder, from here to the end
        cfg = settle_precision(cfg, out, device)
        ckpt = open_run(cfg, out)
        images, sampler, loader = build_data(cfg, device)
        iters_per_epoch = len(images) // cfg.data.batch_size
        total_iters = iters_per_epoch * cfg.optim.epochs
        model = build_model(cfg, total_iters, device, resuming=ckpt is not None)
        optimizer = build_optimizer(model, cfg)
        scaler = torch.amp.GradScaler(device.type, enabled=cfg.train.precision == "fp16")
        state = start_or_resume(ckpt, model, optimizer, scaler, images, cfg, device, out)
        if state.epoch >= cfg.optim.epochs:
            log_main("The run in %s is already complete (%d epochs); nothing to do", out, state.epoch)
            return summary(out, state)

        step_model = prepare_step_model(model, cfg, device)
        logger = RunLogger(out, cfg, enabled=D.is_main_process())
        epoch_monitor = make_monitor(monitor, cfg, images, device)
        model.train()
        with handle_signals(announce=D.is_main_process()) as signals:
            boundary = StepBoundary(signals, cfg.train.checkpoint_minutes, device)
            parts = (model, step_model, optimizer, scaler, sampler, loader, iters_per_epoch, logger, boundary)
            run = Run(cfg, out, device, *parts)
            try:
                train_epochs(run, state, epoch_monitor)
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
            finally:
                logger.close()
    return summary(out, state)


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
    log_main(
        "New run in %s (no checkpoint there): %d images, %d iterations per epoch", out, len(images), iters_per_epoch
    )
    return RunState()


def train_epochs(run: Run, state: RunState, epoch_monitor: Monitor | None) -> None:
    """The remaining epochs, each ended by its record (plus the monitor's numbers when due) and a checkpoint;
    :class:`Interrupted` at the first step boundary after a signal."""
    while state.epoch < run.cfg.optim.epochs:
        record = train_one_epoch(run, state)
        if epoch_monitor is not None and epoch_monitor.due(state.epoch + 1):
            with run.boundary.signals.finishing("the end-of-epoch monitor under way (the epoch's steps are done)"):
                record.update(epoch_monitor(run.model.student))
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
        metrics = train_step(run, batch["image"], lr)
        state.iteration += 1
        state.batch_in_epoch += 1
        state.epoch_steps += 1
        for key, total in state.epoch_sums.items():
            total += metrics.get(key, 0.0)
        note_skipped(state, batch["skipped"])
        if state.iteration % log_interval(cfg, total_iters) == 0 or state.batch_in_epoch == run.iters_per_epoch:
            values = {k: float(v) for k, v in metrics.items()}
            if not math.isfinite(values["loss"]):
                raise RunError(
                    f"the loss became {values['loss']} at iteration {state.iteration}; the last good checkpoint "
                    f"is {run.out / 'checkpoint.pt'} (lower optim.lr or use train.precision=fp32)"
                )
            run.logger.step(epoch, state.iteration, lr, values, len(state.skipped), cfg.data.batch_size)
        progress.update(cfg.data.batch_size, metrics, lr)
        if state.batch_in_epoch < run.iters_per_epoch:  # the epoch's end has its own checkpoint and check
            step_boundary(run, state)
    progress.close()
    steps = max(state.epoch_steps, 1)
    means = {key: float(D.all_reduce_mean(total / steps)) for key, total in state.epoch_sums.items()}
    return {
        "epoch": epoch + 1,
        "iteration": state.iteration,
        **{name: means[key] for key, name in EPOCH_MEANS.items()},
        "epoch_time_s": state.epoch_time(),
        "skipped_images": len(state.skipped),
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
    """One optimiser step at learning rate ``lr`` on a batch of views; returns the step's detached metrics."""
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    teacher_images, student_views = to_device(views, run.device, run.cfg.train.channels_last)
    run.optimizer.zero_grad(set_to_none=True)
    metrics = forward_backward(
        run.step_model,
        teacher_images,
        student_views,
        run.scaler,
        precision_context(run.cfg.train.precision, run.device),
        run.cfg.train.backward_per_group and run.model.supports_groups,
    )
    run.scaler.step(run.optimizer)
    run.scaler.update()
    return metrics


def note_skipped(state: RunState, skipped: list[str]) -> None:
    """Count the unreadable images of a batch (each reported once)."""
    new = set(skipped) - state.skipped
    for path in sorted(new):
        log.warning("skipped unreadable image %s", path)
    state.skipped |= new


def log_interval(cfg: Config, total_iterations: int) -> int:
    """Steps between two step records: ``train.log_every``, or less for a short run, so that its log holds at
    least :data:`MIN_LOGGED_STEPS` points (a curve rather than a dot in ``obow show run``)."""
    return max(1, min(cfg.train.log_every, total_iterations // MIN_LOGGED_STEPS))


def build_data(
    cfg: Config, device: torch.device, images: ImageList | None = None
) -> tuple[ImageList, EpochSampler, Iterable[dict[str, Any]]]:
    """The training images (``images``, else those of ``data.path``) and their loader: every process sees its
    share of each global batch, augmentations seeded per image (workers) or per global batch (device pipeline),
    so a resumed epoch sees the same views."""
    world = D.world_size()
    if cfg.data.batch_size % world != 0:
        raise RunError(f"data.batch_size ({cfg.data.batch_size}) must be divisible by the {world} processes")
    if images is None:
        images = scan_images(cfg.data.path, cfg.data.labels, cfg.data.images_per_class)
    local_batch = cfg.data.batch_size // world
    pipeline = data_pipeline(cfg, device)
    if pipeline == "device":
        cache = build_cache(images, views_side(cfg.views), cfg.data.cache_size, cfg.data.cache_dir)
        images = cache.images
    sampler = EpochSampler(len(images), local_batch, seed=cfg.train.seed, rank=D.rank(), world_size=world)
    if pipeline == "device":
        loader = DeviceLoader(cache, sampler, build_batched_views(cfg, cache.side), device, cfg.train.seed)
        held = "; held on the GPU" if loader.where == "on the GPU" else ""
        log_main("Data: views made on the %s from %s%s", device.type, cache.describe(), held)
        return images, sampler, loader
    loader = build_loader(
        ImageDataset(images, build_views(cfg)),
        sampler,
        local_batch,
        num_workers=cfg.data.num_workers,
        pin_memory=cfg.data.pin_memory and device.type == "cuda",
    )
    log_main("Data: views made by %d loader worker(s)", cfg.data.num_workers)
    return images, sampler, loader


def data_pipeline(cfg: Config, device: torch.device) -> str:
    """``data.pipeline`` for ``device``: ``auto`` makes the views on a GPU and in loader workers on a CPU."""
    if cfg.data.pipeline != "auto":
        return cfg.data.pipeline
    return "device" if device.type == "cuda" else "workers"


def build_model(cfg: Config, total_iterations: int, device: torch.device, resuming: bool = False) -> Method:
    """The method of ``cfg`` on ``device``. The same seed on every process gives the same initial weights and
    vocabulary; batch norm is synchronised across GPUs when asked (``train.sync_batchnorm``). ``resuming``: the
    weights come from a checkpoint next (so BoWNet does not read its teacher file)."""
    torch.manual_seed(cfg.train.seed)
    model = build_method(cfg, total_iterations, resuming=resuming)
    if D.is_distributed() and device.type == "cuda" and cfg.train.sync_batchnorm:
        model.student = nn.SyncBatchNorm.convert_sync_batchnorm(model.student)
        if model.teacher is not None:
            model.teacher = nn.SyncBatchNorm.convert_sync_batchnorm(model.teacher)
    model.to(device)
    if cfg.train.channels_last:
        model.to(memory_format=torch.channels_last)
    return model


def prepare_step_model(model: Method, cfg: Config, device: torch.device) -> nn.Module:
    """What each step calls: the model, wrapped for DDP when distributed; its networks compiled when asked."""
    step_model: nn.Module = model
    if D.is_distributed():
        step_model = D.ddp_without_buffer_sync(model, [device.index] if device.type == "cuda" else None)
    if cfg.train.compile:
        model.student.compile()
        if model.teacher is not None:
            model.teacher.compile()
    return step_model


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


def log_main(message: str, *args: Any, level: int = logging.INFO) -> None:
    if D.is_main_process():
        log.log(level, message, *args)


def summary(out: Path, state: RunState) -> dict[str, Any]:
    return {
        "out": str(out),
        "epochs": state.epoch,
        "iteration": state.iteration,
        "loss": state.history[-1]["loss"] if state.history else None,
        "checkpoint": str(out / "checkpoint.pt"),
    }


def forward_backward(
    step_model: nn.Module,
    teacher_images: torch.Tensor,
    student_views: list[torch.Tensor],
    scaler: torch.amp.GradScaler,
    autocast: contextlib.AbstractContextManager,
    per_group: bool,
) -> dict[str, torch.Tensor]:
    """Forward and backward of one step; returns the step's detached metrics (``"loss"``: the whole loss).

    With ``per_group`` each student view group is back-propagated before the next is built (the loss is a
    sum over groups), so only one group's activations are held at a time; under DDP the gradients are
    synchronised once, in the last group's backward pass.
    """
    if not per_group or len(student_views) == 1:
        with autocast:
            output = step_model(teacher_images, student_views)
        scaler.scale(output.loss).backward()
        return output.metrics
    metrics: dict[str, torch.Tensor] = {}
    total = torch.zeros((), device=teacher_images.device)
    grad_scale = scaler.get_scale() if scaler.is_enabled() else 1.0
    for g in range(len(student_views)):
        last = g == len(student_views) - 1
        no_sync = step_model.no_sync() if D.is_distributed() and not last else contextlib.nullcontext()
        with no_sync:
            with autocast:
                output = step_model(teacher_images, student_views, group=g, grad_scale=grad_scale)
            scaler.scale(output.loss).backward()
        metrics.update(output.metrics)
        total += output.metrics["loss"]
    metrics["loss"] = total
    return metrics


def setup_process(cfg: Config) -> torch.device:
    """Join the process group when launched by ``torchrun``; choose the device; set determinism."""
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1 and not D.is_distributed():
        use_cuda = cfg.train.device != "cpu" and torch.cuda.is_available()
        dist.init_process_group("nccl" if use_cuda else "gloo")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        raise RunError("train.device=cuda but no CUDA device is visible; use train.device=cpu or auto")
    if cfg.train.device != "cpu" and torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = not cfg.train.deterministic
    else:
        device = torch.device("cpu")
    if cfg.train.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    if cfg.train.precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise RunError("train.precision=bf16 needs a GPU with bfloat16 support; use fp16 or fp32")
    if cfg.train.precision == "bf16" and device.type == "cpu" and cpu_supports_bf16() is False:
        log_main(
            "train.precision=bf16 on a CPU without AVX-512: PyTorch emulates bfloat16 there, and a step is far "
            "slower than in fp32 (20 to 35 times for the cifar10_fast and demo recipes on a 2-core AVX2 EPYC; "
            "benchmarks/step_time.py measures it); train.precision=fp32 is the faster choice on this machine",
            level=logging.WARNING,
        )
    return device


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes bfloat16 in hardware, where bf16 autocast is the faster choice: a CUDA GPU
    with bfloat16 arithmetic (compute capability 8.0 and above), or an x86 CPU with AVX-512 BF16 or AMX
    instructions. Measured on 2-core AMD EPYCs (docs/results/step_time_cpu.md): with AVX-512 BF16 a
    ``cifar10_fast`` step is 2.1x faster in bf16 than in fp32 (2.5x with channels_last), on an AVX2-only one
    20x slower (PyTorch emulates bfloat16 there). Other CPUs (Arm's bf16 extension among them) answer ``False``:
    not measured."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type != "cpu":
        return False
    checks = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(bool(check()) for check in checks if check is not None)


def resolve_precision(precision: str, device: torch.device) -> str:
    """``train.precision`` as a run computes it: ``auto`` is bf16 where :func:`native_bf16`, else fp32; the
    other values are themselves."""
    if precision != "auto":
        return precision
    return "bf16" if native_bf16(device) else "fp32"


def settle_precision(cfg: Config, out: Path, device: torch.device) -> Config:
    """``cfg`` with ``train.precision: auto`` made concrete for the run in ``out``: a run being resumed keeps the
    precision it started with (its ``config.yaml`` holds it; a resume on another machine computes as the run
    did, exactly), a new run takes :func:`resolve_precision`'s choice for ``device``. Every other ``cfg`` is
    returned as it is. ``config.yaml`` and the checkpoint then hold the concrete value."""
    if cfg.train.precision != "auto":
        return cfg
    started = started_precision(out)
    precision = started or resolve_precision("auto", device)
    why = (
        "as the run started"
        if started
        else f"{'native' if precision == 'bf16' else 'no native'} bf16 on this {device.type}"
    )
    log_main("Precision: train.precision=auto -> %s (%s)", precision, why)
    if precision == "bf16" and device.type == "cpu" and not native_bf16(device):
        log_main(
            "this run started in bf16 on a CPU with bf16 instructions; this one has none and emulates bfloat16, far "
            "slower than fp32: the run keeps bf16 to resume exactly (a new --out can start in fp32 here)",
            level=logging.WARNING,
        )
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision=precision))


def started_precision(out: Path) -> str | None:
    """The ``train.precision`` of the run in ``out`` that a checkpoint can resume, from its ``config.yaml``
    (``None``: no such run, or none recorded)."""
    saved = out / "config.yaml"
    if not (out / "checkpoint.pt").is_file() or not saved.is_file():
        return None
    precision = (yaml.safe_load(saved.read_text()) or {}).get("train", {}).get("precision")
    return precision if precision in PRECISIONS and precision != "auto" else None


def cpu_supports_bf16() -> bool | None:
    """Whether PyTorch's oneDNN has fast bfloat16 kernels for this CPU (they need AVX-512 or Arm's bf16
    extension); ``None`` when this PyTorch cannot say."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check()) if check is not None else None


@contextlib.contextmanager
def chosen_threads(cfg: Config) -> Iterator[None]:
    """Run with :func:`choose_threads`'s choice (said in the run's header), then restore the caller's."""
    threads, why = choose_threads(cfg)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    log_main("Threads: %d per training process (%s); 1 per data-loading worker", threads, why)
    ignored = ignored_omp_threads()
    if ignored:
        log_main("Threads: %s", ignored, level=logging.WARNING)
    hint = busy_machine_hint(threads, why)
    if hint:
        log_main("Threads: %s", hint, level=logging.WARNING)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def choose_threads(cfg: Config, environ: dict[str, str] | None = None, cores: int | None = None) -> tuple[int, str]:
    """Intra-op threads for each training process, and why: ``train.threads`` when set; else the user's
    ``OMP_NUM_THREADS``; else the cores this process may use, shared by the training processes of this machine
    (``LOCAL_WORLD_SIZE``). Data-loading workers are not subtracted: on a quiet 2-core machine they need little
    of a core for small images, and one training thread beside one worker gave 0.58x the images/s of two
    threads (``cifar10_fast``) and 0.68x (``demo``) (``benchmarks/threads.py``). On a machine that other jobs
    keep busy the opposite holds (one thread was 3.3x faster there): :func:`busy_machine_hint` says so."""
    environ = os.environ if environ is None else environ
    if cfg.train.threads:
        return cfg.train.threads, "train.threads"
    if environ.get("OMP_NUM_THREADS", "").isdigit() and int(environ["OMP_NUM_THREADS"]) > 0:
        return int(environ["OMP_NUM_THREADS"]), "OMP_NUM_THREADS"
    if cores is None:
        cores = available_cores()
    processes = max(1, int(environ.get("LOCAL_WORLD_SIZE", "1")))
    threads = max(1, cores // processes)
    return threads, f"{cores} cores, {processes} training process(es) here"


def ignored_omp_threads(environ: dict[str, str] | None = None) -> str | None:
    """A one-line warning when ``OMP_NUM_THREADS`` is set to something :func:`choose_threads` cannot use (not a
    whole number above 0, e.g. ``zz``), which it then ignores; ``None`` when it is unset, empty or usable."""
    value = (os.environ if environ is None else environ).get("OMP_NUM_THREADS", "")
    if not value or (value.isdigit() and int(value) > 0):
        return None
    return (
        f"OMP_NUM_THREADS={value!r} is not a whole number of threads above 0, so it is ignored; set it to one "
        "(e.g. OMP_NUM_THREADS=2) or use train.threads"
    )


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def busy_machine_hint(threads: int, why: str, load: float | None = None, cores: int | None = None) -> str | None:
    """A hint when the machine was busy before the run started (the 1-minute load average at least its cores)
    and the threads were chosen, not set: oversubscribed cores make each step wait for its slowest thread (a
    tiny run took 43.5 s an epoch with 2 threads beside a neighbour's job, 2.0 s with one)."""
    if why in ("train.threads", "OMP_NUM_THREADS"):
        return None
    cores = available_cores() if cores is None else cores
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:
            return None
    if load < cores or threads == 1:
        return None
    return (
        f"this machine is busy (load {load:.1f} on {cores} cores): if other jobs keep running, one thread per "
        "process (OMP_NUM_THREADS=1 or train.threads=1) can be several times faster"
    )


def build_optimizer(model: nn.Module, cfg: Config) -> torch.optim.Optimizer:
    """SGD over the student and the head. The official code decays every parameter (BN and biases too);
    ``optim.decay_norm_and_bias: false`` exempts one-dimensional parameters instead."""
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.optim.decay_norm_and_bias:
        groups = [{"params": params, "weight_decay": cfg.optim.weight_decay}]
    else:
        groups = [
            {"params": [p for p in params if p.ndim > 1], "weight_decay": cfg.optim.weight_decay},
            {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0},
        ]
    return torch.optim.SGD(groups, lr=cfg.optim.lr, momentum=cfg.optim.momentum, nesterov=cfg.optim.nesterov)


def to_device(views: dict[str, torch.Tensor], device: torch.device, channels_last: bool):
    """The teacher batch and the student's view groups (crops, then patches) on ``device``."""
    fmt = torch.channels_last if channels_last else torch.contiguous_format

    def move(x: torch.Tensor) -> torch.Tensor:
        return x.to(device, non_blocking=True, memory_format=fmt) if x.dim() == 4 else x.to(device, non_blocking=True)

    return move(views["teacher"]), [move(views[k]) for k in ("crops", "patches") if k in views]


def precision_context(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast for bf16 / fp16 (the BoW distances and codes stay in float32 inside the extractor); ``auto`` as
    :func:`resolve_precision` makes it."""
    precision = resolve_precision(precision, device)
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device.type, dtype=dtype)
