"""The run folder (``--out``) and what it holds: ``config.yaml`` (the resolved recipe), ``checkpoint.pt`` (the latest
state, :mod:`obow.weights.checkpoint`'s format), ``checkpoint.prev.pt`` (the one before it, resumed from when the
latest cannot be read), ``checkpoints/epoch_NNNN.pt`` (permanent copies every ``train.keep_every`` epochs),
``log.jsonl``, ``tensorboard/``, ``images.tsv.gz`` (the training images' list, :mod:`obow.data.identity`, written
with the checkpoint that adopts them: :mod:`~obow.training.run.checkpoints`), ``previous_attempt/`` (the logs of an
attempt that died before its first checkpoint, :func:`set_aside_attempt`) and ``.obow.lock``
(:mod:`obow.training.run.lock`: one writer at a time).

:func:`open_run` opens it for a run: the checkpoint found, checked against the recipe
(:mod:`~obow.training.run.settings_check`) and the images (:mod:`~obow.training.run.data_check`), and what a killed
process left behind cleared; checked before anything is written: the folders the run reads
(:func:`check_inputs`) and the run folder outside the training images (:func:`check_out_outside_data`).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import yaml

from obow import distributed as D
from obow.config import Config, save_config
from obow.data.identity import LIST_NAME, DataIdentity, write_list
from obow.files import is_inside, make_folder, writing
from obow.training.run.data_check import NEXT_LIST, check_same_data
from obow.training.run.settings_check import check_same_run
from obow.training.run.state import RunError
from obow.weights.checkpoint import load_checkpoint, load_resumable, place_copy

log = logging.getLogger("obow")


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
    the list of the images: a new run's in place, other images' aside until the checkpoint that adopts them,
    :data:`~obow.training.run.data_check.NEXT_LIST`), and what a killed process left behind cleared: half-written
    checkpoint files, log records of iterations after the checkpoint (a resumed run computes them again), and the
    logs of an attempt that wrote no checkpoint (:func:`set_aside_attempt`)."""
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
        if ckpt is None:
            write_list(identity, out / LIST_NAME)
        if ckpt is not None and (ckpt.get("data") or {}).get("digest") != identity.digest:
            write_list(identity, out / NEXT_LIST)  # in place with the checkpoint that adopts them (save_run)
        else:
            (out / NEXT_LIST).unlink(missing_ok=True)  # left by a continuing run killed before its checkpoint
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
