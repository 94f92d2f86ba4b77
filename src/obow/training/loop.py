"""``obow pretrain``: the OBoW training loop, readable top to bottom.

:func:`pretrain` sets up the run (processes, device, data, model, optimiser), resumes from
``<out>/checkpoint.pt`` when one is there, then loops over epochs and batches: learning rate from the
iteration, one step of the method (:class:`~obow.methods.obow.OBoW`: teacher EMA, targets, vocabulary update,
student loss; or a baseline of :mod:`obow.methods`), backward, SGD step, logs. A checkpoint is written
atomically at every epoch end (and every ``train.checkpoint_every`` iterations), and on Ctrl-C or
SIGTERM, holding everything needed to continue exactly where the run stopped.

Files in ``<out>``: ``config.yaml`` (the resolved recipe), ``checkpoint.pt`` (latest), ``checkpoints/``
(permanent copies every ``train.keep_every`` epochs), ``log.jsonl`` (one JSON object per line),
``tensorboard/``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from obow import distributed as D
from obow.config import Config, from_dict, save_config, to_dict
from obow.data.eval_sets import align_classes, eval_dataset, scan_labelled
from obow.data.folders import EpochSampler, ImageDataset, ImageList, build_loader, scan_images
from obow.diagnostics import feature_diagnostics
from obow.evaluate.features import extract_features
from obow.evaluate.knn import knn_accuracy
from obow.methods import build_method, build_views
from obow.schedules import learning_rate
from obow.weights.checkpoint import FORMAT, VERSION, load_checkpoint, save_atomic

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


#: Step metrics averaged over each epoch, and their names in the epoch record.
EPOCH_MEANS = {
    "loss": "loss",
    "student/effective_rank": "effective_rank",
    "student/mean_cosine": "mean_cosine",
}


class RunError(RuntimeError):
    """A run cannot start or continue; the message says why and what to do."""


class Interrupted(Exception):
    """Raised in the training loop by SIGINT / SIGTERM, after which a checkpoint is written."""


def pretrain(cfg: Config, out_dir: str | Path) -> dict[str, Any]:
    """Pretrain (or resume pretraining) with ``cfg``, writing everything under ``out_dir``.

    Returns a summary: epochs done, iterations, the last epoch's mean loss, and where the checkpoint is.
    """
    out = Path(out_dir)
    device = setup_process(cfg)
    is_main = D.is_main_process()
    if cfg.data.path is None:
        raise RunError("no training images: set data.path (obow pretrain --data DIR)")

    # Resume, or start a new run in an empty (or new) folder.
    ckpt_path = out / "checkpoint.pt"
    ckpt = load_checkpoint(ckpt_path) if ckpt_path.exists() else None
    if ckpt is not None:
        check_same_run(cfg, ckpt["config"], ckpt_path)
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
        save_config(cfg, out / "config.yaml")
        for stale in out.glob(".checkpoint.pt.*.tmp"):  # left by a process killed while writing
            stale.unlink()
        if ckpt is not None:
            truncate_log(out / "log.jsonl", ckpt["iteration"])

    # Data: every process sees its share of each global batch, augmentations seeded per image.
    world = D.world_size()
    if cfg.data.batch_size % world != 0:
        raise RunError(f"data.batch_size ({cfg.data.batch_size}) must be divisible by the {world} processes")
    images = scan_images(cfg.data.path, cfg.data.labels, cfg.data.images_per_class)
    local_batch = cfg.data.batch_size // world
    sampler = EpochSampler(len(images), local_batch, seed=cfg.train.seed, rank=D.rank(), world_size=world)
    loader = build_loader(
        ImageDataset(images, build_views(cfg)),
        sampler,
        local_batch,
        num_workers=cfg.data.num_workers,
        pin_memory=cfg.data.pin_memory and device.type == "cuda",
    )
    iters_per_epoch = len(images) // cfg.data.batch_size
    total_iters = iters_per_epoch * cfg.optim.epochs

    # Model and optimiser. The same seed on every process gives the same initial weights and vocabulary.
    torch.manual_seed(cfg.train.seed)
    model = build_method(cfg, total_iters)
    if D.is_distributed() and device.type == "cuda" and cfg.train.sync_batchnorm:
        model.student = nn.SyncBatchNorm.convert_sync_batchnorm(model.student)
        if isinstance(getattr(model, "teacher", None), nn.Module):
            model.teacher = nn.SyncBatchNorm.convert_sync_batchnorm(model.teacher)
    model.to(device)
    if cfg.train.channels_last:
        model.to(memory_format=torch.channels_last)
    optimizer = build_optimizer(model, cfg)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.train.precision == "fp16")

    start_epoch, start_batch, history, skipped = 0, 0, [], set()
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        if "scaler" in ckpt:
            scaler.load_state_dict(ckpt["scaler"])
        start_epoch, start_batch = ckpt["epoch"], ckpt["batch_in_epoch"]
        history, skipped = ckpt.get("history", []), set(ckpt.get("skipped_images", []))
        states = ckpt["rng"]
        set_rng_state(states[D.rank()] if len(states) == world else states[0])
        if is_main:
            log.info(
                "Resuming %s from epoch %d, batch %d (iteration %d of %d)",
                ckpt_path,
                start_epoch + 1,
                start_batch,
                ckpt["iteration"],
                total_iters,
            )
    else:
        if hasattr(model, "prepare"):  # e.g. BoWNet's offline k-means, once, before the first step
            model.prepare(images, cfg, device)
        torch.manual_seed(cfg.train.seed + D.rank())  # runtime randomness (queue sampling) differs per process
        if is_main:
            log.info("New run in %s: %d images, %d iterations per epoch", out, len(images), iters_per_epoch)
    if start_epoch >= cfg.optim.epochs:
        if is_main:
            log.info("The run in %s is already complete (%d epochs); nothing to do", out, start_epoch)
        return summary(out, history, start_epoch, total_iters)

    step_model: nn.Module = model
    if D.is_distributed():
        step_model = D.ddp_without_buffer_sync(model, [device.index] if device.type == "cuda" else None)
    if cfg.train.compile:
        model.student.compile()
        if isinstance(getattr(model, "teacher", None), nn.Module):  # RotNet has none
            model.teacher.compile()

    logger = RunLogger(out, cfg, enabled=is_main)
    monitor = KNNMonitor(cfg, images, device) if is_main else None
    if monitor is not None and monitor.reason:
        log.info("kNN monitor off: %s", monitor.reason)
    autocast = precision_context(cfg.train.precision, device)

    def save(epoch: int, batch_in_epoch: int, iteration: int, every_process: bool = True) -> None:
        # Every process's random state is kept (they differ: queue sampling), when all of them are here to
        # send it; an interruption saves the main process's only, so such a resume is exact on one process.
        rng = gather_rng_states() if every_process else [get_rng_state()]
        if not is_main:
            return
        state = {
            "format": FORMAT,
            "version": VERSION,
            "config": to_dict(cfg),
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict(),
            "epoch": epoch,
            "batch_in_epoch": batch_in_epoch,
            "iteration": iteration,
            "rng": rng,
            "skipped_images": sorted(skipped),
            "history": history,
        }
        save_atomic(state, ckpt_path)
        if batch_in_epoch == 0 and cfg.train.keep_every and epoch % cfg.train.keep_every == 0:
            save_atomic(state, out / "checkpoints" / f"epoch_{epoch:04d}.pt")

    iteration = start_epoch * iters_per_epoch + start_batch
    epoch = start_epoch
    model.train()
    with handle_signals():
        try:
            for epoch in range(start_epoch, cfg.optim.epochs):
                sampler.set_epoch(epoch, start_batch)
                epoch_start, steps = time.time(), 0
                sums = {key: torch.zeros((), device=device) for key in EPOCH_MEANS}
                progress = logger.progress(epoch, start_batch, iters_per_epoch, total_iters, iteration)
                for batch_index, batch in enumerate(loader, start=start_batch):
                    lr = learning_rate(
                        iteration,
                        iters_per_epoch,
                        base_lr=cfg.optim.lr,
                        epochs=cfg.optim.epochs,
                        warmup_epochs=cfg.optim.warmup_epochs,
                        end_lr=cfg.optim.end_lr,
                        cosine_per_epoch=cfg.optim.cosine_per_epoch,
                    )
                    for group in optimizer.param_groups:
                        group["lr"] = lr
                    teacher_images, student_views = to_device(batch["image"], device, cfg.train.channels_last)

                    optimizer.zero_grad(set_to_none=True)
                    metrics_t = forward_backward(
                        step_model,
                        teacher_images,
                        student_views,
                        scaler,
                        autocast,
                        cfg.train.backward_per_group and getattr(model, "supports_groups", True),
                    )
                    scaler.step(optimizer)
                    scaler.update()
                    iteration += 1
                    steps += 1
                    for key, total in sums.items():
                        total += metrics_t.get(key, 0.0)

                    new_skipped = set(batch["skipped"]) - skipped
                    for path in sorted(new_skipped):
                        log.warning("skipped unreadable image %s", path)
                    skipped |= new_skipped
                    if iteration % cfg.train.log_every == 0 or batch_index + 1 == iters_per_epoch:
                        metrics = {k: float(v) for k, v in metrics_t.items()}
                        if not math.isfinite(metrics["loss"]):
                            raise RunError(
                                f"the loss became {metrics['loss']} at iteration {iteration}; the last good "
                                f"checkpoint is {ckpt_path} (lower optim.lr or use train.precision=fp32)"
                            )
                        logger.step(epoch, iteration, lr, metrics, len(skipped), cfg.data.batch_size)
                    progress.update(cfg.data.batch_size, metrics_t, lr)
                    if cfg.train.checkpoint_every and iteration % cfg.train.checkpoint_every == 0:
                        save(epoch, batch_index + 1, iteration)
                progress.close()

                means = {key: float(D.all_reduce_mean(total / max(steps, 1))) for key, total in sums.items()}
                record = {
                    "epoch": epoch + 1,
                    "iteration": iteration,
                    **{name: means[key] for key, name in EPOCH_MEANS.items()},
                    "epoch_time_s": time.time() - epoch_start,
                    "skipped_images": len(skipped),
                }
                if monitor is not None and monitor.due(epoch + 1):
                    record.update(monitor(model.student))
                if D.is_distributed():
                    dist.barrier()  # the other processes wait for the main one's monitor
                history.append(record)
                logger.epoch(record)
                start_batch = 0
                save(epoch + 1, 0, iteration)
        except Interrupted:
            batch_done = iteration - epoch * iters_per_epoch
            save(epoch, batch_done, iteration, every_process=False)
            if is_main:
                log.info("Interrupted: checkpoint written at iteration %d; run the same command to resume", iteration)
            raise
        finally:
            logger.close()
    return summary(out, history, cfg.optim.epochs, iteration)


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
            return
        if not images.labelled:
            self.reason = f"the training images under {images.root} have no class folders"
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


def summary(out: Path, history: list[dict[str, Any]], epochs: int, iteration: int) -> dict[str, Any]:
    return {
        "out": str(out),
        "epochs": epochs,
        "iteration": iteration,
        "loss": history[-1]["loss"] if history else None,
        "checkpoint": str(out / "checkpoint.pt"),
    }


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
    return device


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
    """Autocast for bf16 / fp16 (the BoW distances and codes stay in float32 inside the extractor)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device.type, dtype=dtype)


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
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


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


class RunLogger:
    """JSON lines, TensorBoard scalars and a progress bar, on the main process only."""

    def __init__(self, out: Path, cfg: Config, enabled: bool) -> None:
        self.enabled = enabled
        self.cfg = cfg
        self.jsonl = open(out / "log.jsonl", "a") if enabled else None  # noqa: SIM115 - closed in close()
        self.tb = None
        if enabled and cfg.train.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(out / "tensorboard"))
        self.last_time = time.time()
        self.last_iteration: int | None = None

    def write(self, record: dict[str, Any]) -> None:
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()

    def step(self, epoch: int, iteration: int, lr: float, metrics: dict[str, float], skipped: int, batch: int) -> None:
        if not self.enabled:
            return
        now = time.time()
        rate = None
        if self.last_iteration is not None and iteration > self.last_iteration:
            rate = (iteration - self.last_iteration) * batch / (now - self.last_time)
        self.last_time, self.last_iteration = now, iteration
        record = {"epoch": epoch + 1, "iteration": iteration, "lr": lr, **metrics, "skipped_images": skipped}
        if rate is not None:
            record["images_per_s"] = rate
        self.write(record)
        if self.tb is not None:
            for key, value in record.items():
                if key not in ("epoch", "iteration"):
                    self.tb.add_scalar(f"train/{key}", value, iteration)

    def epoch(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.write({"type": "epoch", **record})
        if self.tb is not None:
            for key, value in record.items():
                if key not in ("epoch", "iteration"):
                    self.tb.add_scalar(f"epoch/{key}", value, record["epoch"])
        shown = {("mean step loss" if k == "loss" else k): v for k, v in record.items() if k != "epoch"}
        log.info("epoch %d: %s", record["epoch"], ", ".join(f"{k} {v:.4g}" for k, v in shown.items()))

    def progress(self, epoch: int, start: int, per_epoch: int, total: int, iteration: int) -> Progress:
        return Progress(
            enabled=self.enabled and self.cfg.train.progress_bar,
            desc=f"epoch {epoch + 1}/{self.cfg.optim.epochs}",
            start=start,
            per_epoch=per_epoch,
            remaining_total=total - iteration,
        )

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
            self.jsonl = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None


class Progress:
    """A tqdm bar over an epoch's batches: the step's loss (summed over view groups, as optimised), the
    effective rank of the student's features (collapse shows as a falling rank), learning rate, images/s and
    time left for the whole run. The epoch line printed after it gives the epoch's mean step loss."""

    def __init__(self, *, enabled: bool, desc: str, start: int, per_epoch: int, remaining_total: int) -> None:
        self.bar = None
        self.remaining = remaining_total
        self.started = time.time()
        self.steps = 0
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=per_epoch, initial=start, desc=desc, dynamic_ncols=True, leave=True)

    def update(self, batch: int, metrics: dict[str, torch.Tensor], lr: float) -> None:
        self.steps += 1
        if self.bar is None:
            return
        per_step = (time.time() - self.started) / self.steps
        left = max(self.remaining - self.steps, 0) * per_step
        rank = metrics.get("student/effective_rank")
        rank_text = f" rank {float(rank):.1f}" if rank is not None else ""
        self.bar.set_postfix_str(
            f"step loss {float(metrics['loss']):.3f}{rank_text} lr {lr:.3g} img/s {batch / per_step:.1f} "
            f"left {format_seconds(left)}",
            refresh=False,
        )
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def format_seconds(seconds: float) -> str:
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"
