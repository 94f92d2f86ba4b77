"""What a run keeps and how it comes back: the run folder, the checkpoint of a run in progress, resumption.

A run lives in one folder (``--out``): ``config.yaml`` (the resolved recipe), ``checkpoint.pt`` (the latest state,
:mod:`obow.weights.checkpoint`'s format), ``checkpoint.prev.pt`` (the one before it, resumed from when the latest
cannot be read), ``checkpoints/epoch_NNNN.pt`` (permanent copies every ``train.keep_every`` epochs), ``log.jsonl``,
``tensorboard/``, ``images.tsv.gz`` (the training images' list, :mod:`obow.data.identity`), ``previous_attempt/``
(the logs of an attempt that died before its first checkpoint, :func:`set_aside_attempt`) and ``.obow.lock``
(:mod:`obow.training.run.lock`: one writer at a time). A checkpoint holds everything needed to continue exactly where
the run stopped: the method's and the optimiser's state, the position in the epoch (:class:`RunState`), every
process's random state and running sums of the epoch under way. It is written at step boundaries only (epoch ends,
every ``train.checkpoint_every`` steps, every ``train.checkpoint_minutes``, and after SIGINT / SIGTERM / SIGHUP, which
:func:`handle_signals` turns into a request the loop honours when the step under way is done; a step that compiles
stops at once instead, keeping nothing: :mod:`obow.training.step.watch`). Resuming refuses a recipe whose
run-defining settings differ from the checkpoint's (:func:`check_same_run`); only :data:`RESUMABLE_CHANGES` may
change; and training images other than the checkpoint's, wherever they are (:func:`check_same_data`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
import torch.distributed as dist
import yaml
from torch import nn

from obow import distributed as D
from obow.config import Config, from_dict, save_config, to_dict
from obow.data.identity import LIST_NAME, DataIdentity, compare, read_list, write_list
from obow.files import is_inside, make_folder, writing
from obow.training.run.logger import log_main
from obow.weights.checkpoint import build_checkpoint, load_checkpoint, load_resumable, place_copy, save_atomic

if TYPE_CHECKING:
    from obow.data.folders import ImageList
    from obow.methods.base import Method

log = logging.getLogger("obow")

#: Settings that may change between a run and its resumption (they do not change what is computed).
RESUMABLE_CHANGES = {
    "description",
    "data.num_workers",
    "data.pin_memory",
    "data.cache_dir",
    "data.on_change",
    "data.val_path",
    "train.device",
    "train.compile",
    "train.log_every",
    "train.checkpoint_every",
    "train.checkpoint_minutes",
    "train.keep_every",
    "train.knn_every",
    "train.knn_k",
    "train.knn_temperature",
    "train.progress_bar",
    "train.tensorboard",
    "train.threads",
    "train.tf32",  # CUDA's rounding of float32 products, as train.device changes it
}


class RunError(RuntimeError):
    """A run cannot start or continue; the message says why and what to do."""


class Interrupted(Exception):
    """Raised by the training loop at the step boundary after SIGINT / SIGTERM / SIGHUP, once the checkpoint is
    written.

    ``signal`` names the signal (``None`` on a process that only learnt of it from another one)."""

    def __init__(self, signal_name: str | None) -> None:
        super().__init__(signal_name or "a signal received by another process")
        self.signal = signal_name

    @property
    def exit_code(self) -> int:
        """The shell's code for a run stopped by this signal: 128 + its number (130 for SIGINT, 143 for SIGTERM;
        SIGINT's when the signal is not known here)."""
        name = self.signal if self.signal is not None and self.signal in signal.Signals.__members__ else "SIGINT"
        return 128 + int(signal.Signals[name])


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


def check_inputs(cfg: Config) -> None:
    """A :class:`RunError` when a folder the run reads is missing (``data.path``, ``data.val_path``): checked
    before the run folder is created or locked, so that a mistyped ``--data`` or ``--val`` leaves nothing behind."""
    for key, option, path in (("data.path", "--data", cfg.data.path), ("data.val_path", "--val", cfg.data.val_path)):
        if path is not None and not Path(path).is_dir():
            what = "is not a folder" if Path(path).exists() else "does not exist"
            raise RunError(f"{option} {path} ({key}) {what}: nothing was written")


def started_config(out: Path) -> dict[str, Any] | None:
    """The configuration the run in ``out`` started with, when a checkpoint can resume it: its ``config.yaml``, or
    the checkpoint's own copy where there is none (a checkpoint copied into a new folder); ``None``: a new run.
    What ``auto`` settings resolved to is read from it (``train.precision``, ``data.pipeline``)."""
    checkpoint, saved = out / "checkpoint.pt", out / "config.yaml"
    if not checkpoint.is_file():
        return None
    if saved.is_file():
        return yaml.safe_load(saved.read_text()) or {}
    return load_checkpoint(checkpoint).get("config") or {}


def open_run(cfg: Config, out: Path, identity: DataIdentity) -> dict[str, Any] | None:
    """The checkpoint of the run in ``out`` (``None`` for a new run), checked against ``cfg`` and against the
    training images' ``identity`` (:func:`check_same_data`); the folder is created, ``config.yaml`` written (and
    the list of the images, :data:`~obow.data.identity.LIST_NAME`, when it is new), and what a killed process
    left behind cleared: half-written checkpoint files, log records of iterations after the checkpoint (a
    resumed run computes them again), and the logs of an attempt that wrote no checkpoint
    (:func:`set_aside_attempt`)."""
    path = out / "checkpoint.pt"
    found = load_resumable(path)
    ckpt, source = found if found is not None else (None, None)
    extended_from = None
    if ckpt is not None:
        # a checkpoint with its images' record keeps the warm-up asked (both came in with issue 60)
        extended_from = check_same_run(cfg, ckpt["config"], path, warmup_as_asked="data" in ckpt)
        if "optimizer" not in ckpt:
            raise RunError(
                f"{path} holds weights but no training state (written by obow import-official?): it can be "
                "evaluated and exported, not resumed; use another --out for a new run"
            )
        check_same_data(cfg, ckpt, out, identity)
    if D.is_main_process():
        if ckpt is None:
            set_aside_attempt(out)
        make_folder(out)
        save_config(cfg, out / "config.yaml")
        if ckpt is None or (ckpt.get("data") or {}).get("digest") != identity.digest:
            write_list(identity, out / LIST_NAME)
        for stale in [*out.glob(".checkpoint*.pt.*.tmp"), *out.glob("checkpoints/.epoch_*.pt.*.tmp")]:
            stale.unlink()
        if source is not None and source != path:  # the damaged file goes: the next write must not keep it
            place_copy(source, path)
        if ckpt is not None:
            truncate_log(out / "log.jsonl", ckpt["iteration"])
        if extended_from is not None:
            assert ckpt is not None  # a run is extended from its checkpoint
            note_plan_change(out / "log.jsonl", ckpt["iteration"], extended_from, cfg.optim.epochs)
    return ckpt


def check_out_outside_data(cfg: Config, out: Path) -> None:
    """A :class:`RunError` when the run folder ``out`` is ``data.path`` or inside it: the run's own files (the
    pictures of ``obow show``, exports) would be read as training images. Checked before anything is written."""
    if cfg.data.path is None:
        return
    if is_inside(out, cfg.data.path):
        raise RunError(
            f"--out {out} is inside --data {cfg.data.path} (data.path): the run's own files (pictures, exports) "
            "would become training images; give an --out outside the data folder: nothing was written"
        )


def set_aside_attempt(out: Path) -> None:
    """Start a new run's logs afresh in ``out``, where an earlier attempt left logs but no checkpoint (killed
    before its first one): its ``log.jsonl``, ``tensorboard/`` and ``config.yaml`` move to
    ``previous_attempt/`` (replacing what an older attempt left there), so that the new run's curves do not
    continue the dead one's."""
    left = [out / name for name in ("log.jsonl", "tensorboard") if (out / name).exists()]
    if not left:
        return
    aside = out / "previous_attempt"
    with writing(aside):
        if aside.exists():
            shutil.rmtree(aside)
        aside.mkdir()
        if (out / "config.yaml").is_file():
            left.append(out / "config.yaml")
        for item in left:
            item.rename(aside / item.name)
    log.warning(
        "%s holds the logs of an earlier attempt that wrote no checkpoint: moved to %s; this run starts its logs "
        "afresh",
        out,
        aside,
    )


def check_same_data(cfg: Config, ckpt: dict[str, Any], out: Path, identity: DataIdentity) -> None:
    """Check that the training images (``identity``, of ``data.path``) are those the checkpoint ``ckpt`` of the
    run in ``out`` was trained on, by their names and sizes (:mod:`obow.data.identity`), not by their folder:

    - the same images under another ``data.path`` (a moved or remounted folder): the run resumes, and one line
      says so;
    - other images (added, removed, changed in size): a :class:`RunError` naming what changed, how to start over
      (another ``--out``) and how to go on (``data.on_change=continue``); with ``data.on_change: continue``, one
      warning line says what changed and the run continues on the images now there;
    - a checkpoint written before obow recorded its images: resumed on its own ``data.path`` only."""
    before = ((ckpt.get("config") or {}).get("data") or {}).get("path")
    now = cfg.data.path
    moved = before is not None and now is not None and os.path.realpath(before) != os.path.realpath(now)
    record = ckpt.get("data")
    if record is None:
        if moved:
            raise RunError(
                f"{out / 'checkpoint.pt'} was trained on data.path {before}, not {now}, and written before obow "
                f"recorded which images a run trains on, so the two cannot be compared: resume with --data {before}, "
                "or use another --out for a new run"
            )
        return
    where = f"{now} (data.path{f'; it was {before}' if moved else ''})"
    if record["digest"] == identity.digest:
        if moved:
            log_main(
                "data.path is now %s, was %s: the same %d images (names and sizes), resuming",
                now,
                before,
                len(identity.files),
            )
        return
    known = read_list(out / LIST_NAME, record["digest"])
    if known is not None:
        what = compare(known, identity.files).describe()
    else:
        what = (
            f"{len(identity.files)} images now, {record['images']} then (the list that would say which, "
            f"{out / LIST_NAME}, is missing or lists other images)"
        )
    said = f"the training images in {where} are not those the run in {out} was trained on: {what}"
    if cfg.data.on_change != "continue":
        raise RunError(
            f"{said}. Start a new run with another --out, or continue this one on the images now there with "
            "data.on_change=continue"
        )
    batch = cfg.data.batch_size
    steps = (record["images"] // batch, len(identity.files) // batch)
    per_epoch = f"; steps per epoch {steps[0]} -> {steps[1]}: the schedules follow the new count" * (
        steps[0] != steps[1]
    )
    log_main(
        "%s; continuing on the images now there (data.on_change=continue)%s", said, per_epoch, level=logging.WARNING
    )


def note_plan_change(log_path: Path, iteration: int, before: int, after: int) -> None:
    """Mark in the log where a run's plan grew from ``before`` to ``after`` epochs.

    From ``iteration`` on, the learning rate and the teacher's momentum follow the schedules of the longer
    run at the same iteration (a warm restart for a finished run, whose learning rate had reached its end);
    the steps before followed the shorter plan, so the result is not the run that the longer plan would have
    given from the start."""
    record = {"type": "plan", "iteration": iteration, "epochs": after, "previous_epochs": before}
    with writing(log_path) as target, open(target, "a") as f:
        f.write(json.dumps(record) + "\n")
    log.info(
        "Extending the run from %d to %d epochs at iteration %d: the learning rate and teacher momentum now "
        "follow the %d-epoch schedules (marked in log.jsonl)",
        before,
        after,
        iteration,
        after,
    )


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


def save_run(
    out: Path,
    cfg: Config,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    state: RunState,
) -> None:
    """Write ``out/checkpoint.pt`` (atomically), and a permanent copy at every ``train.keep_every``-th epoch end.

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
    save_atomic(ckpt, out / "checkpoint.pt", keep_previous=True)
    if state.batch_in_epoch == 0 and cfg.train.keep_every and state.epoch % cfg.train.keep_every == 0:
        save_atomic(ckpt, out / "checkpoints" / f"epoch_{state.epoch:04d}.pt")


def check_same_run(cfg: Config, saved: dict[str, Any], path: Path, *, warmup_as_asked: bool = False) -> int | None:
    """Refuse to resume a checkpoint whose run-defining settings differ from ``cfg``; one change is allowed,
    a larger ``optim.epochs`` (extending the run: the checkpoint's planned epochs are returned, else ``None``).
    ``data.path`` is left to :func:`check_same_data`. Unless ``warmup_as_asked`` (the checkpoint's configuration
    holds the warm-up asked for), ``optim.warmup_epochs`` is read as :func:`as_asked` says."""
    try:  # settings added after the checkpoint was written count as their defaults, or as what the run did
        saved = to_dict(from_dict(Config, as_it_ran(saved)))
    except ValueError:
        pass
    now, before = flatten(to_dict(cfg)), flatten(saved if warmup_as_asked else as_asked(saved, cfg))
    changed = sorted(
        k
        for k in now.keys() | before.keys()
        if now.get(k) != before.get(k) and k not in RESUMABLE_CHANGES and k != "data.path"  # check_same_data's
    )
    extended_from = None
    if "optim.epochs" in changed and now["optim.epochs"] > before["optim.epochs"]:
        changed.remove("optim.epochs")
        extended_from = before["optim.epochs"]
    if changed:
        diffs = "; ".join(f"{k}: {before.get(k)!r} -> {now.get(k)!r}" for k in changed)
        raise RunError(
            f"{path} belongs to a run with other settings ({diffs}). Use another --out for a new run, "
            "or the same settings to resume this one (optim.epochs may grow, to extend the run)"
        )
    return extended_from


def as_it_ran(saved: dict[str, Any]) -> dict[str, Any]:
    """A run's saved configuration with the settings added since, whose default is not what the run did, set to
    what it did: a MoCo v2 run without ``moco.bn_splits`` normalised with plain batch norm (``1``)."""
    model, moco = saved.get("model") or {}, saved.get("moco") or {}
    if model.get("method") == "mocov2" and "bn_splits" not in moco:
        return {**saved, "moco": {**moco, "bn_splits": 1}}
    return saved


def as_asked(saved: dict[str, Any], cfg: Config) -> dict[str, Any]:
    """A run's saved configuration with ``optim.warmup_epochs`` as its user asked for it: obow once saved the
    warm-up it shortened for a run not longer than it (half the run, now :func:`obow.schedules.run_warmup` at
    each step, the recipe keeping what was asked), so that such a checkpoint holds half its ``optim.epochs``. Met
    with a warm-up asked now that this rule shortens to the same value over the saved run, it is that value."""
    optim = saved.get("optim") or {}
    epochs, warmup, asked = optim.get("epochs"), optim.get("warmup_epochs"), cfg.optim.warmup_epochs
    if isinstance(epochs, int) and warmup == epochs / 2 and asked >= epochs:
        return {**saved, "optim": {**optim, "warmup_epochs": asked}}
    return saved


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
    with writing(path.with_name(f".{path.name}.tmp")) as tmp:  # a kill while rewriting keeps the old log
        tmp.write_text("".join(f"{line}\n" for line in kept))
        tmp.replace(path)


def seed_run(seed: int) -> None:
    """Seed every generator a run may draw from (Python's, NumPy's global one, torch's): the checkpoint keeps
    all of them, so that a resumed run continues the streams an uninterrupted one would have."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def get_rng_state() -> dict[str, Any]:
    """This process's random states as tensors and plain values (a weights-only load reads them back)."""
    legacy = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())  # legacy=True: the tuple
    name, key, pos, has_gauss, cached_gaussian = legacy
    return {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": name,
            "key": torch.from_numpy(key.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def gather(obj: Any) -> list[Any]:
    """``obj`` of every process, in rank order (on every process)."""
    if not D.is_distributed():
        return [obj]
    everyone: list[Any] = [None] * D.world_size()
    dist.all_gather_object(everyone, obj)
    return everyone


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore :func:`get_rng_state`'s states (or a version-1 checkpoint's, whose NumPy state is a tuple)."""
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    if isinstance(numpy_state, dict):
        numpy_state = (
            numpy_state["bit_generator"],
            numpy_state["key"].numpy().astype(np.uint32),
            numpy_state["pos"],
            numpy_state["has_gauss"],
            numpy_state["cached_gaussian"],
        )
    np.random.set_state(numpy_state)
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


#: The signals that stop a run at a step boundary: Ctrl-C, a scheduler's or ``kill``'s SIGTERM, and SIGHUP (the
#: terminal closed, the ssh connection dropped), which would otherwise end the process at once without a checkpoint.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

#: In a process whose parent passes signals on (a ``torchrun`` worker, an ``obow tables run --jobs`` process), a
#: repeat this close after the first counts as the same request: a terminal's Ctrl-C reaches the parent and its
#: workers, and the parent passes it on to them, so each worker receives it twice at once. Elsewhere a second
#: signal aborts at once, however soon it comes.
SAME_REQUEST_SECONDS = 1.0


def nohup(signum: int) -> bool:
    """Whether ``signum`` is a SIGHUP the process was started ignoring (``nohup``), which obow leaves ignored."""
    return signum == signal.SIGHUP and signal.getsignal(signum) is signal.SIG_IGN


def signals_passed_on() -> bool:
    """Whether this process's parent passes its signals on to it: a ``torchrun`` worker (``TORCHELASTIC_RUN_ID``),
    or a process started by ``multiprocessing`` (``obow tables run --jobs``)."""
    import multiprocessing

    return "TORCHELASTIC_RUN_ID" in os.environ or multiprocessing.parent_process() is not None


class SignalFlag:
    """The first SIGINT / SIGTERM / SIGHUP received by this process (:attr:`received`: its name, or ``None``) and when
    (:attr:`at`, ``time.monotonic()``); :attr:`doing` names what the loop finishes before its checkpoint (the
    step under way, or the end-of-epoch monitor, which can take minutes on a CPU), for the message a signal
    prints. While :attr:`abort` is set (a step compiling, :mod:`obow.training.step.watch`), the first signal
    raises ``abort(name)`` instead: the step is not finished."""

    STEP = "the step under way"

    def __init__(self) -> None:
        self.received: str | None = None
        self.at = 0.0
        self.doing = self.STEP
        self.abort: Callable[[str], BaseException] | None = None

    @contextlib.contextmanager
    def finishing(self, what: str) -> Iterator[None]:
        """While the block runs, a signal's message says it finishes ``what`` first."""
        self.doing = what
        try:
            yield
        finally:
            self.doing = self.STEP


@contextlib.contextmanager
def handle_signals(announce: bool = True, repeat_window: float | None = None) -> Iterator[SignalFlag]:
    """Note the first SIGINT, SIGTERM or SIGHUP (:data:`STOP_SIGNALS`) in the flag this yields, so that the loop
    finishes the step under way, writes a checkpoint at the step boundary and stops (:class:`Interrupted`). A
    second signal aborts at once with ``KeyboardInterrupt``: a checkpoint being written is then dropped and the
    previous one stays whole. Only a repeat within ``repeat_window`` seconds of the first counts as the same
    request (default: :data:`SAME_REQUEST_SECONDS` where :func:`signals_passed_on`, else none). SIGHUP stays
    ignored where it is (under ``nohup``: the run goes on). ``announce`` logs what the first signal does (the main
    process)."""
    flag = SignalFlag()
    window = repeat_window if repeat_window is not None else SAME_REQUEST_SECONDS if signals_passed_on() else 0.0

    def note(signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if flag.received is None:
            flag.received, flag.at = name, time.monotonic()
            if flag.abort is not None:
                raise flag.abort(name)
            if announce:
                log.warning("%s: finishing %s, then writing a checkpoint (again to abort)", name, flag.doing)
        elif time.monotonic() - flag.at >= window:
            raise KeyboardInterrupt(name)

    try:
        previous = {s: signal.signal(s, note) for s in STOP_SIGNALS if not nohup(s)}
    except ValueError:  # not the main thread: leave signals alone
        yield flag
        return
    try:
        yield flag
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


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
    log_main(
        "New run in %s (no checkpoint there): %d images, %d iterations per epoch", out, len(images), iters_per_epoch
    )
    return RunState()


def summary(out: Path, state: RunState) -> dict[str, Any]:
    return {
        "out": str(out),
        "epochs": state.epoch,
        "iteration": state.iteration,
        "loss": state.history[-1]["loss"] if state.history else None,
        "checkpoint": str(out / "checkpoint.pt"),
    }
