"""The data check of a resumed run: the training images are compared with those its checkpoint was trained on, by
their names and sizes (:mod:`obow.data.identity`), not by their folder (:func:`check_same_data`), and the lists of
images in the run folder that say what changed.

The list of the images a checkpoint was trained on (:data:`~obow.data.identity.LIST_NAME`) changes with the
checkpoint that adopts new ones, never before it: a run continuing on other images (``data.on_change: continue``)
writes their list aside when it starts (:data:`NEXT_LIST`), and :func:`adopt_image_list` puts it in place just
before that run's first checkpoint is written, keeping the one it replaces (:data:`PREVIOUS_LIST`, the list of
``checkpoint.prev.pt``). A run killed before that checkpoint leaves the list of the checkpoint it resumes from in
place, so that the refusal of the next plain command still names what changed."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from obow.config import Config
from obow.data.identity import LIST_NAME, DataIdentity, compare, read_list
from obow.files import writing
from obow.training.run.logger import log_main
from obow.training.run.state import RunError

#: The list of the images a run continuing on other images moves to, until its first checkpoint adopts them.
NEXT_LIST = "images.next.tsv.gz"
#: The list the adopted one replaced: the images of the checkpoint before (``checkpoint.prev.pt``).
PREVIOUS_LIST = "images.prev.tsv.gz"


def adopt_image_list(out: Path) -> None:
    """Put the list of a run's new images (:data:`NEXT_LIST`, when there is one) in place of
    :data:`~obow.data.identity.LIST_NAME`, the replaced one kept as :data:`PREVIOUS_LIST`: called just before the
    checkpoint that adopts those images is written. Two renames; whatever kill falls between them and the
    checkpoint, the list of the checkpoint on disk is one of the two lists :func:`check_same_data` reads."""
    staged = out / NEXT_LIST
    if not staged.is_file():
        return
    current = out / LIST_NAME
    with writing(current):
        if current.is_file():
            current.replace(out / PREVIOUS_LIST)
        staged.replace(current)


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
    known = read_list(out / LIST_NAME, record["digest"]) or read_list(out / PREVIOUS_LIST, record["digest"])
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
