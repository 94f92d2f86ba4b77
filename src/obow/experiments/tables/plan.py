"""A table's plan (``<table>/plan.json``): every row's epochs, warm-up and timed step, made once and kept, and
the ways a folder takes its plan or results from another (``--timing-from``, ``--results-from``,
``--shared-from``, ``--time-against``)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from obow.experiments.tables.catalog import TABLES, Row, Table, fill_placeholders, placeholders
from obow.experiments.tables.records import write_json

log = logging.getLogger("obow")


def budget_text(budget: dict[str, Any] | None) -> str:
    """A plan's ``budget`` as words: ``{"minutes": 25}`` is "25 minutes", ``{"epochs": 1}`` "1 epoch"."""
    if not budget:
        return "no budget"
    ((unit, value),) = budget.items()
    return f"{value:g} {unit if value != 1 else unit[:-1]}"


@dataclass(frozen=True)
class Against:
    """The table folder a lever is timed against (``--time-against``): its ``plan.json`` path, the seconds a step
    it timed for each stage, the changes that table was run with (``changes``, from its ``table.json``), this
    call's common items with those changes instead of this call's (``common``) and their placeholders."""

    plan: str
    seconds: dict[str, float]
    changes: tuple[str, ...]
    common: list[str]
    values: dict[str, Any]


def read_time_against(
    source: Path, recipe: str, with_changes: Callable[[list[str]], list[str]], train_images: int, minutes: float | None
) -> Against:
    """Read the folder named by ``--time-against``: a table folder planned for the same ``minutes`` (any steps
    an epoch: a lever may change the batch); its ``table.json``, when there, names the changes it was run with
    (none without it)."""
    from obow.config import load_config

    if minutes is None:
        raise ValueError(
            "--time-against plans a --minutes table from another's timed steps; --budget EPOCHS times nothing"
        )
    plan_path = source / "plan.json"
    if not plan_path.is_file():
        raise ValueError(f"--time-against {source}: no plan.json there (give a table folder, e.g. runs/x/table1)")
    other = json.loads(plan_path.read_text())
    if other.get("budget") != {"minutes": minutes}:
        raise ValueError(
            f"--time-against {source}: planned for {budget_text(other.get('budget'))}, this call for "
            f"{budget_text({'minutes': minutes})}: a lever gets its base's budget"
        )
    table_path = source / "table.json"
    changes = tuple(json.loads(table_path.read_text()).get("overrides", [])) if table_path.is_file() else ()
    common = with_changes(list(changes))
    values = placeholders(load_config(recipe, common), train_images)
    seconds = {
        key: stage["seconds_per_step"]
        for key, stage in other.get("stages", {}).items()
        if stage.get("seconds_per_step")
    }
    return Against(str(plan_path), seconds, changes, common, values)


def discard_plan(folder: Path) -> None:
    """``obow tables run --replan``: remove the ``plan.json`` of the table in ``folder`` (and the ``table.json`` and
    ``table.md`` made with it) so that this call plans the table anew, as long as no row has begun training there:
    a row's runs train for the plan's steps, and a new plan would leave them made for another. A ``ValueError``
    names the row runs that have begun (their folders); the random init's results are kept, being no training."""
    path = folder / "plan.json"
    if not path.exists():
        return
    begun = sorted(
        str(run.relative_to(folder))
        for run in folder.glob("*/seed*")
        if run.parent.name != "random_init" and run.is_dir() and any(run.iterdir())
    )
    if begun:
        raise ValueError(
            f"--replan: {folder} has rows that trained for its plan ({', '.join(begun)}); a table keeps its plan "
            "once a row trains: use another --out (or remove those folders)"
        )
    old = json.loads(path.read_text()).get("budget")
    for name in ("plan.json", "table.json", "table.md"):
        (folder / name).unlink(missing_ok=True)
    log.info("--replan: the plan of %s for %s is discarded (no row had trained)", folder, budget_text(old))


#: The precision of a plan that does not say: obow recorded none before ``train.precision: auto``, when every
#: table trained in float32.
UNRECORDED_PRECISION = "fp32"
#: The data pipeline of a plan that does not say: every table before the key made its views in loader workers.
UNRECORDED_PIPELINE = "workers"


def table_precision(folder: Path, asked: str, device: str, sources: list[str | Path | None]) -> str:
    """The ``train.precision`` every run of the table in ``folder`` trains and is timed at, so that its rows stay
    comparable whatever machine continues it: the precision in its ``plan.json``, or in the plans of the folders
    it takes plan, results or timed steps from (``sources``: ``--results-from``, ``--shared-from``,
    ``--timing-from``, ``--time-against``; they must agree); for a new table, ``asked`` (the recipe's
    ``train.precision`` with this call's changes) as :func:`obow.training.run.precision.resolve_precision` makes it on
    ``device`` (``auto``: bf16 where it is native). A ``ValueError`` when the plans disagree, or when ``asked``
    is neither ``auto`` nor theirs."""
    import torch

    from obow.training.run.precision import resolve_precision

    new = resolve_precision(asked, torch.device(device))
    return _table_setting(folder, "precision", "train.precision", asked, new, UNRECORDED_PRECISION, sources)


def table_pipeline(folder: Path, asked: str, device: str, sources: list[str | Path | None]) -> str:
    """The ``data.pipeline`` that makes every run's views in the table in ``folder``, kept in its ``plan.json`` as
    :func:`table_precision` keeps the precision (a table begun on a CPU, in loader workers, and continued on a
    GPU, where ``auto`` means the device pipeline, goes on in loader workers); for a new table, ``asked`` as
    :func:`obow.training.run.settle.resolve_pipeline` makes it on ``device``."""
    import torch

    from obow.training.run.settle import resolve_pipeline

    new = resolve_pipeline(asked, torch.device(device))
    return _table_setting(folder, "pipeline", "data.pipeline", asked, new, UNRECORDED_PIPELINE, sources)


def _table_setting(
    folder: Path, key: str, setting: str, asked: str, new: str, unrecorded: str, sources: list[str | Path | None]
) -> str:
    """``plan.json``'s ``key`` for the table in ``folder`` and the plans of ``sources`` (they must agree; a plan
    without it says ``unrecorded``), else ``new``; ``asked`` (``setting`` as this call gives it) must be ``auto``
    or that value."""
    plans = [folder / "plan.json", *(Path(source) / "plan.json" for source in sources if source is not None)]
    found = {str(path): json.loads(path.read_text()).get(key, unrecorded) for path in plans if path.is_file()}
    if not found:
        return new
    if len(set(found.values())) > 1:
        listed = ", ".join(f"{path}: {value}" for path, value in found.items())
        raise ValueError(f"these plans have different {setting} values ({listed}): their rows are not comparable")
    value = next(iter(found.values()))
    if asked not in ("auto", value):
        raise ValueError(
            f"{next(iter(found))} was planned at {setting}={value}, this call asks for {asked}: a table keeps one "
            f"{setting} (use another --out for a table with another)"
        )
    return value


def budget_plan(
    folder: Path,
    rows: list[Row],
    recipe: str,
    common: list[str],
    values: dict,
    budget: int | None,
    minutes: float | None,
    steps_per_epoch: int,
    timing_from: str | Path | None = None,
    anchor: Anchor | None = None,
    against: Against | None = None,
    precision: str = UNRECORDED_PRECISION,
    pipeline: str = UNRECORDED_PIPELINE,
) -> dict[str, Any]:
    """Epochs and warm-up of every row's stages, and the ``precision`` they train at (:func:`table_precision`) and
    the ``pipeline`` that makes their views (:func:`table_pipeline`), kept in ``<table>/plan.json`` so that every
    seed, and every
    later call that completes the table, trains a row the same way. A minutes budget times the rows' steps
    (:func:`obow.experiments.budget.seconds_per_step`, in alternating rounds) the first time a row is met, or
    takes them from the ``plan.json`` of the table folder ``timing_from`` where that folder timed them. With an
    ``anchor`` (a row shared with another table, :func:`share_rows`) the anchor row takes its turns with them,
    and each is planned at ``its time / the anchor's time x the anchor's seconds in the other table's plan``
    (``timing_anchor`` in the plan). With ``against`` (``--time-against``) each row that table timed is timed
    here as it was there and as it is here, in the same alternating rounds, and planned at ``its time here /
    its base's time here x its seconds there`` (``timing_against`` in the plan)."""
    from obow.config import load_config
    from obow.experiments.budget import plan_epochs, seconds_per_step, short_run_warmup

    path = folder / "plan.json"
    wanted = {"epochs": budget} if minutes is None else {"minutes": minutes}
    plan: dict[str, Any] = (
        json.loads(path.read_text()) if path.exists() else {"budget": wanted, "steps_per_epoch": steps_per_epoch}
    )
    if plan["budget"] != wanted or plan["steps_per_epoch"] != steps_per_epoch:
        raise ValueError(
            f"{folder} holds a table planned for {budget_text(plan['budget'])} a row and {plan['steps_per_epoch']} "
            f"steps an epoch; this call asks for {budget_text(wanted)} and {steps_per_epoch}: the same budget and "
            "images continue it, --replan plans it again while no row has trained, or use another --out"
        )
    recorded = "precision" in plan and "pipeline" in plan  # table_precision / _pipeline chose from this plan
    plan["precision"] = precision
    plan["pipeline"] = pipeline
    stages = plan.setdefault("stages", {})
    every = {f"{row.slug}/{stage.name}": stage for row in rows for stage in row.plan()}
    missing = {key: stage for key, stage in every.items() if key not in stages}
    if not missing:
        if not recorded:
            write_json(path, plan)
        return plan
    configs = {}
    for key, stage in missing.items():
        items = [*common, *fill_placeholders(stage.overrides, values)]
        if stage.teacher:
            items.append("bownet.teacher=unused-when-timing.pt")
        configs[key] = load_config(recipe, items)
    timed: dict[str, float] = {}
    if timing_from is not None:
        if minutes is None:
            raise ValueError("--timing-from lends timed steps to a --minutes table; --budget EPOCHS times nothing")
        other_path = Path(timing_from) / "plan.json"
        if not other_path.is_file():
            raise ValueError(
                f"--timing-from {timing_from}: no plan.json there (give a table folder, e.g. runs/x/mocov2)"
            )
        other = json.loads(other_path.read_text())
        if other["steps_per_epoch"] != steps_per_epoch:
            raise ValueError(
                f"--timing-from {timing_from} was planned for {other['steps_per_epoch']} steps an epoch, this table "
                f"has {steps_per_epoch}: not the same images or batch"
            )
        lent = {key: v["seconds_per_step"] for key, v in other.get("stages", {}).items() if key in missing}
        timed.update({key: seconds for key, seconds in lent.items() if seconds})
        plan.setdefault("timing_from", {}).update({key: str(other_path) for key in timed})
    if against is not None:
        lent = {key: against.seconds[key] for key in missing if against.seconds.get(key)}
        if lent:

            def as_there(key: str) -> list[str]:
                # the base's changes instead of this call's, on as many threads as this call's row (a ratio of
                # steps timed on different thread counts would measure the threads, not the lever)
                items = [*against.common, *fill_placeholders(every[key].overrides, against.values)]
                items.append(f"train.threads={configs[key].train.threads}")
                items += [f"train.precision={precision}", f"data.pipeline={pipeline}"]
                return items + (["bownet.teacher=unused-when-timing.pt"] if every[key].teacher else [])

            turns = {f"{key} [as there]": load_config(recipe, as_there(key)) for key in lent}
            here = seconds_per_step({**turns, **{key: configs[key] for key in lent}})
            for key, there in lent.items():
                base_here = here[f"{key} [as there]"]
                timed[key] = here[key] * there / base_here
                plan.setdefault("timing_against", {})[key] = {
                    "plan": against.plan,
                    "changes_there": list(against.changes),
                    "seconds_per_step_there": there,
                    "base_seconds_per_step_here": base_here,
                    "seconds_per_step_here": here[key],
                    "scale": there / base_here,
                }
    if minutes is not None and set(missing) - set(timed):
        untimed = {key: configs[key] for key in missing if key not in timed}
        if anchor is not None and anchor.seconds_per_step:
            here = seconds_per_step({anchor.key: anchor.config, **untimed})
            anchor_here = here.pop(anchor.key)
            scale = anchor.seconds_per_step / anchor_here
            timed.update({key: seconds * scale for key, seconds in here.items()})
            for key, seconds in here.items():
                plan.setdefault("timing_anchor", {})[key] = {
                    "anchor": anchor.key,
                    "anchor_plan": anchor.plan,
                    "seconds_per_step_here": seconds,
                    "anchor_seconds_per_step_here": anchor_here,
                    "scale": scale,
                }
        else:
            timed.update(seconds_per_step(untimed))
    for key, stage in missing.items():
        cfg = configs[key]
        if minutes is None:
            assert budget is not None  # an epochs budget, else minutes
            epochs = max(1, round(budget * stage.share))
        else:
            epochs = plan_epochs(minutes * stage.share, timed[key], steps_per_epoch)
        stages[key] = {
            "epochs": epochs,
            "warmup_epochs": short_run_warmup(cfg.optim.warmup_epochs, epochs),
            "seconds_per_step": timed.get(key),
            "steps": epochs * steps_per_epoch,
        }
    write_json(path, plan)
    return plan


def _read_table_folder(
    source: Path, option: str, expected: dict[str, Any], steps_per_epoch: int, what: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``table.json`` and ``plan.json`` of the table folder ``source`` named by ``option``, once everything in
    ``expected`` is theirs and the plan is for the same budget and steps an epoch; else a ``ValueError`` that
    names what differs."""
    table_path, plan_path = source / "table.json", source / "plan.json"
    if not table_path.is_file() or not plan_path.is_file():
        raise ValueError(f"{option} {source}: needs table.json and plan.json there (a table folder)")
    record, plan = json.loads(table_path.read_text()), json.loads(plan_path.read_text())
    for key, value in expected.items():
        if record.get(key) != value:
            theirs, ours = (
                (budget_text(record.get(key)), budget_text(value))
                if key == "budget"
                else (repr(record.get(key)), repr(value))
            )
            raise ValueError(
                f"{option} {source}: its {key} is {theirs}, this call's is {ours}; {what} on the "
                "same images, recipe, changes, protocol and budget"
            )
    if plan.get("steps_per_epoch") != steps_per_epoch or plan.get("budget") != expected["budget"]:
        raise ValueError(
            f"{option} {source}: its plan.json is not for {budget_text(expected['budget'])} and {steps_per_epoch} "
            "steps an epoch"
        )
    return record, plan


def import_results(source: Path, folder: Path, expected: dict[str, Any], steps_per_epoch: int) -> list[str]:
    """Continue the table whose ``table.json`` and ``plan.json`` are in ``source`` in the table folder ``folder``
    (``obow tables run --results-from``): a table that takes longer than one machine's session is finished over
    several, on machines that share only small text files. Everything in ``expected`` (table, recipe, budget,
    image counts, protocol, changes) must be the source's, or a ``ValueError`` names what differs. The source's
    plan becomes this folder's (the same steps for every row, however fast this machine is; a folder planned
    already must hold the same stages), and each of its finished row seeds is written as this folder's
    ``<row>/seed<N>/result.json``, marked ``"from"``, unless this folder has that result already. Returns the
    ``<row>/seed<N>`` names imported."""
    table_path, plan_path = source / "table.json", source / "plan.json"
    record, plan = _read_table_folder(
        source, "--results-from", expected, steps_per_epoch, "results can only continue the same table"
    )
    own_plan = folder / "plan.json"
    if own_plan.exists():
        own = json.loads(own_plan.read_text())
        if own.get("budget") != expected["budget"]:
            raise ValueError(f"--results-from {source}: {folder} is planned for another budget; use another --out")
        ours = own.get("stages", {})
        clash = [
            key for key, stage in plan.get("stages", {}).items() if key in ours and ours[key]["steps"] != stage["steps"]
        ]
        if clash:
            raise ValueError(
                f"--results-from {source}: {folder} planned {', '.join(clash)} with other steps; use another --out"
            )
        merged = {**plan.get("stages", {}), **ours}
        write_json(own_plan, {**own, "stages": merged})
    else:
        write_json(own_plan, {**plan, "plan_from": str(plan_path)})
    imported = []
    for row in (record["random_init"], *record["rows"]):
        for run in row["runs"]:
            name = f"{row['slug']}/seed{run['seed']}"
            target = folder / name / "result.json"
            if not target.exists():
                write_json(target, {**run, "from": str(table_path)})
                imported.append(name)
    if imported:
        log.info("continuing %s: %s imported from %s", folder, ", ".join(imported), table_path)
    return imported


@dataclass(frozen=True)
class Anchor:
    """A row this table shares with another table's folder (:func:`share_rows`): its stage key here, its
    configuration, and the seconds a step that folder's plan timed for it."""

    key: str
    config: Any
    seconds_per_step: float
    plan: str


def share_rows(
    source: Path,
    folder: Path,
    table: Table,
    recipe: str,
    common: list[str],
    values: dict[str, Any],
    expected: dict[str, Any],
    steps_per_epoch: int,
) -> Anchor:
    """Take over from another table's folder ``source`` (its ``table.json`` and ``plan.json``; ``obow tables run
    --shared-from``) the rows that ``table`` has in common with it: a row of one stage whose configuration is that
    of a row planned there (for example Table 2's first row, Table 3's "soft, dynamic" and Table 1's "queue,
    locally-averaged" are all OBoW vanilla). Each such row gets that row's plan entry (the same steps) in
    ``folder/plan.json``, recorded in its ``shared_from``, and that row's finished seeds (and the random init's)
    as its own ``result.json``, marked ``"from"``; nothing is trained twice (:func:`run_table` leaves a shared
    row's unfinished seeds to that table). Everything in ``expected`` (recipe,
    budget, image counts, protocol, changes) must be the source's. Returns the first shared row as the
    :class:`Anchor` that :func:`budget_plan` times this table's other rows against, so that their steps keep the
    ratio of step times measured in one run, whatever the speed of the machine on the day each table was timed."""
    from obow.config import load_config
    from obow.config.schema import to_dict

    table_path, plan_path = source / "table.json", source / "plan.json"
    record, plan = _read_table_folder(
        source, "--shared-from", expected, steps_per_epoch, "rows can only be shared between tables"
    )
    if record.get("table") == table.name:
        raise ValueError(f"--shared-from {source} is a folder of {table.name} itself: continue it with --results-from")
    other, planned = TABLES[record["table"]], plan.get("stages", {})

    def config(row: Row) -> Any:
        return load_config(recipe, [*common, *fill_placeholders(row.overrides, values)])

    theirs = {r.slug: to_dict(config(r)) for r in other.rows if not r.stages and f"{r.slug}/pretrain" in planned}
    matches: dict[str, str] = {}
    for row in table.rows:
        if not row.stages:
            settings = to_dict(config(row))
            same = [slug for slug, cfg in theirs.items() if cfg == settings]
            if same:
                matches[row.slug] = same[0]
    if not matches:
        raise ValueError(
            f"--shared-from {source}: no row of {table.name} has the configuration of a row planned in that "
            f"{other.name} folder; nothing to share"
        )
    own_path = folder / "plan.json"
    own = (
        json.loads(own_path.read_text())
        if own_path.exists()
        else {"budget": expected["budget"], "steps_per_epoch": steps_per_epoch}
    )
    if own.get("budget") != expected["budget"] or own.get("steps_per_epoch") != steps_per_epoch:
        raise ValueError(f"--shared-from {source}: {folder} is planned for another budget or images; use another --out")
    own.setdefault("precision", plan.get("precision", UNRECORDED_PRECISION))  # table_precision: they agree
    own.setdefault("pipeline", plan.get("pipeline", UNRECORDED_PIPELINE))  # table_pipeline: they agree
    stages = own.setdefault("stages", {})
    for mine, slug in matches.items():
        key, entry = f"{mine}/pretrain", planned[f"{slug}/pretrain"]
        if key in stages and stages[key]["steps"] != entry["steps"]:
            raise ValueError(
                f"--shared-from {source}: {folder} planned {key} for {stages[key]['steps']} steps, {other.name}'s "
                f"{slug} has {entry['steps']}; use another --out"
            )
        stages[key] = dict(entry)
        own.setdefault("shared_from", {})[key] = f"{plan_path}: {slug}/pretrain"
    write_json(own_path, own)
    by_slug = {r["slug"]: r for r in record["rows"]}
    imported = []
    for mine, slug in {"random_init": "random_init", **matches}.items():
        found = record["random_init"] if slug == "random_init" else by_slug.get(slug, {"runs": []})
        for run in found["runs"]:
            target = folder / mine / f"seed{run['seed']}" / "result.json"
            if not target.exists():
                write_json(target, {**run, "from": str(table_path)})
                imported.append(f"{mine}/seed{run['seed']}")
    log.info(
        "%s shares %s with %s%s",
        table.name,
        ", ".join(f"{mine} ({slug})" for mine, slug in matches.items()),
        source,
        f"; imported {', '.join(imported)}" if imported else "",
    )
    first = next(iter(matches))
    row = next(r for r in table.rows if r.slug == first)
    seconds = planned[f"{matches[first]}/pretrain"]["seconds_per_step"]
    return Anchor(f"{first}/pretrain", config(row), seconds, str(plan_path))
