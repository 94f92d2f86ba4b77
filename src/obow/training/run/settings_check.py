"""The settings check of a resumed run: a recipe whose run-defining settings differ from its checkpoint's is refused
(:func:`check_same_run`); only :data:`RESUMABLE_CHANGES` may change, and ``optim.epochs`` may grow (extending the
run). Settings added to obow since a checkpoint was written count as what that run did (:func:`as_it_ran`,
:func:`as_asked`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from obow.config import Config, from_dict, to_dict
from obow.training.run.state import RunError

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


class SettingsChanged(RunError):
    """A checkpoint's run-defining settings differ from the ones asked for now; :attr:`diffs` names them
    (``key: before -> now``, separated by ``; ``) for a caller that says it in its own words (the demo)."""

    diffs: str = ""


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
        err = SettingsChanged(
            f"{path} belongs to a run with other settings ({diffs}). Use another --out for a new run, "
            "or the same settings to resume this one (optim.epochs may grow, to extend the run)"
        )
        err.diffs = diffs
        raise err
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
