"""A run's logs, on the main process only: ``log.jsonl`` (one JSON object per step and per epoch),
TensorBoard scalars, the epoch line and a progress bar."""

from __future__ import annotations

import json
import logging
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from obow import distributed as D
from obow.checks import is_utf8
from obow.config import Config
from obow.files import writing
from obow.notices import ObowWarning

log = logging.getLogger("obow")


def log_main(message: str, *args: Any, level: int = logging.INFO) -> None:
    if D.is_main_process():
        log.log(level, message, *args)


class RunLogger:
    """JSON lines, TensorBoard scalars and a progress bar, on the main process only."""

    def __init__(self, out: Path, cfg: Config, enabled: bool) -> None:
        self.enabled = enabled
        self.cfg = cfg
        self.jsonl_path = out / "log.jsonl"
        self.jsonl = None
        if enabled:
            with writing(self.jsonl_path):
                self.jsonl = open(self.jsonl_path, "a")  # noqa: SIM115 - closed in close()
        self.tb = None
        if enabled and cfg.train.tensorboard and is_utf8(str(out)):
            from torch.utils.tensorboard import SummaryWriter

            with writing(out / "tensorboard"):
                self.tb = SummaryWriter(str(out / "tensorboard"))
        elif enabled and cfg.train.tensorboard:  # TensorBoard's writer encodes its path as UTF-8, and stops the run
            warnings.warn(
                f"no TensorBoard logs in {out}: the folder's name is not UTF-8 and TensorBoard cannot write there; "
                "log.jsonl holds every value (train.tensorboard=false leaves them out without this line)",
                ObowWarning,
                stacklevel=2,
            )
        self.last_time = time.time()
        self.last_iteration: int | None = None

    def write(self, record: dict[str, Any]) -> None:
        if self.jsonl is not None:
            with writing(self.jsonl_path):
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
        self.values = ""  # the last logged step's loss (and rank)
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=per_epoch, initial=start, desc=desc, dynamic_ncols=True, leave=True)

    def update(self, batch: int, metrics: dict[str, torch.Tensor], lr: float, logged: bool = True) -> None:
        """One step more. The step's loss and rank are read (on a GPU, a wait for the device) on ``logged`` steps
        only; the others show the last logged step's, so that the host can issue the next steps' work while the
        device runs this one."""
        self.steps += 1
        if self.bar is None:
            return
        per_step = (time.time() - self.started) / self.steps
        left = max(self.remaining - self.steps, 0) * per_step
        if logged or not self.values:
            rank = metrics.get("student/effective_rank")
            rank_text = f" rank {float(rank):.1f}" if rank is not None else ""
            self.values = f"step loss {float(metrics['loss']):.3f}{rank_text}"
        self.bar.set_postfix_str(
            f"{self.values} lr {lr:.3g} img/s {batch / per_step:.1f} left {format_seconds(left)}", refresh=False
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


#: A short run logs often enough to give ``obow show run`` this many points per curve.
MIN_LOGGED_STEPS = 100


def logged_step(iteration: int, interval: int, last_of_epoch: bool) -> bool:
    """Whether step ``iteration`` (counted from 1) is logged, and so computes its diagnostics: every
    ``interval``-th step and each epoch's last."""
    return iteration % interval == 0 or last_of_epoch


def logged_steps(first: int, steps: int, interval: int) -> int:
    """How many of the ``steps`` steps after iteration ``first`` (``first + 1 ... first + steps``, an epoch's
    steps so far, its last among them) are logged: every ``interval``-th, and the last if it is not one."""
    if steps <= 0:
        return 0
    end = first + steps
    return end // interval - first // interval + (end % interval != 0)


def log_interval(cfg: Config, total_iterations: int) -> int:
    """Steps between two step records: ``train.log_every``, or less for a short run, so that its log holds at
    least :data:`MIN_LOGGED_STEPS` points (a curve rather than a dot in ``obow show run``)."""
    return max(1, min(cfg.train.log_every, total_iterations // MIN_LOGGED_STEPS))
