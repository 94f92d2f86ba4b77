"""A run folder given where a checkpoint file is expected (``obow eval``, ``export`` and ``show --checkpoint
runs/mine``): its newest checkpoint that reads."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

from obow.notices import ObowWarning
from obow.weights.checkpoint import load_checkpoint, previous_path

log = logging.getLogger("obow")


def run_checkpoints(folder: Path) -> list[Path]:
    """The checkpoint files of the run folder ``folder``, newest first: ``checkpoint.pt``, ``checkpoint.prev.pt``,
    then the permanent copies ``checkpoints/epoch_NNNN.pt`` from the last epoch down (those that exist)."""
    latest = folder / "checkpoint.pt"
    kept = sorted((folder / "checkpoints").glob("epoch_*.pt"), reverse=True)
    return [path for path in (latest, previous_path(latest), *kept) if path.is_file()]


def checkpoint_path(given: str | Path) -> str:
    """``given`` as it is when it is not a folder; for a run folder, its newest checkpoint that reads
    (:func:`run_checkpoints`' order), said in one log line, with a warning naming each newer one that does not
    read. A one-line ``ValueError`` when the folder holds no checkpoint, or none that reads."""
    folder = Path(given)
    if not folder.is_dir():
        return str(given)
    found = run_checkpoints(folder)
    if not found:
        raise ValueError(
            f"--checkpoint {given} is a folder without a checkpoint (looked for checkpoint.pt, checkpoint.prev.pt "
            "and checkpoints/epoch_NNNN.pt in it): give a run folder of obow pretrain, or a checkpoint file"
        )
    unreadable = []
    for path in found:
        try:
            ckpt = load_checkpoint(path)
        except ValueError as err:
            unreadable.append(f"{path.name}: {getattr(err, 'why', err)}")
            continue
        if unreadable:
            warnings.warn(
                f"{'; '.join(unreadable)}: using {path} (iteration {ckpt.get('iteration')}), the newest checkpoint "
                f"of {given} that reads",
                ObowWarning,
                stacklevel=2,
            )
        else:
            log.info("--checkpoint %s: its newest checkpoint, %s (iteration %s)", given, path, ckpt.get("iteration"))
        return str(path)
    raise ValueError(f"no checkpoint of {given} can be read ({'; '.join(unreadable)})")
