"""A table's record: the finished runs of each row read from its folder, their mean and spread over the seeds
(:func:`aggregate`), the machine, and the Markdown table (:func:`markdown`)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from obow.experiments.tables.catalog import COLUMNS
from obow.files import writing
from obow.notices import counted


def training_minutes(run: Path) -> float | None:
    """Minutes of training of a row's run folder (every stage's ``log.jsonl`` under it): the sum of its epochs'
    ``epoch_time_s``, which a resumed run carries over from its checkpoint, so that a run trained over several
    sessions counts all of them; the kNN monitor and the evaluation are not counted. ``None`` without a log."""
    logs = sorted(run.rglob("log.jsonl"))
    if not logs:
        return None
    seconds = 0.0
    for log_path in logs:
        per_epoch = {}  # an epoch logged again after a resume counts once, with its last record
        for line in log_path.read_text().splitlines():
            record = json.loads(line)
            if record.get("type") == "epoch":
                per_epoch[record["epoch"]] = record.get("epoch_time_s", 0.0)
        seconds += sum(per_epoch.values())
    return seconds / 60


def finished_runs(row_folder: Path) -> list[dict[str, Any]]:
    """The finished seeds of a row, in seed order; a trained run's minutes are read again from its logs
    (:func:`training_minutes`)."""
    found = []
    for path in row_folder.glob("seed*/result.json"):
        result = json.loads(path.read_text())
        minutes = training_minutes(path.parent) if result.get("steps") else None
        found.append({**result, "minutes": result["minutes"] if minutes is None else minutes})
    return sorted(found, key=lambda r: r["seed"])


def aggregate(label: str, slug: str, paper: dict, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A row over its seeds: every seed's scores, and the mean and sample standard deviation of each score
    (the standard deviation is ``None`` with one seed)."""
    keys = [key for key, value in runs[0]["scores"].items() if isinstance(value, (int, float))] if runs else []
    mean, std = {}, {}
    for key in keys:
        numbers = [r["scores"][key] for r in runs if isinstance(r["scores"].get(key), (int, float))]
        mean[key] = statistics.fmean(numbers) if numbers else None
        std[key] = statistics.stdev(numbers) if len(numbers) > 1 else None
    notes = list(dict.fromkeys(n for r in runs for n in r["scores"].get("notes", [])))
    return {
        "label": label,
        "slug": slug,
        "paper": paper,
        "runs": runs,
        "mean": mean,
        "std": std,
        "notes": notes,
        "steps": runs[0]["steps"] if runs else 0,
        "minutes": statistics.fmean(r["minutes"] for r in runs) if runs else 0.0,
    }


def machine_description() -> str:
    """Where the table was measured: processor, cores and PyTorch build (tables are read against it)."""
    import os
    import platform

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpu = f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    return f"{cpu}, {cores} cores{gpu}; torch {torch.__version__}"


def write_json(path: Path, record: dict[str, Any]) -> None:
    with writing(path):
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=2))
        tmp.replace(path)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _spread(row: dict[str, Any], key: str) -> str:
    """``mean ± sd`` over the row's seeds (the mean alone with one seed), ``-`` when not measured."""
    mean, std = row["mean"].get(key), row["std"].get(key)
    if mean is None:
        return "-"
    return f"{mean:.2f}" if std is None else f"{mean:.2f} ± {std:.2f}"


def _budget_text(record: dict[str, Any]) -> str:
    budget = record["budget"]
    if "minutes" in budget:
        return (
            f"{budget['minutes']:g} minutes of this machine per row and seed (each row's epochs from its timed "
            "step, in whole epochs)"
        )
    return f"{counted(budget['epochs'], 'epoch')} per row"


def _shared_text(plan: dict[str, Any]) -> str:
    """The sentence naming the rows a table shares with another table's folder (``--shared-from``), or the
    table its rows were timed against (``--time-against``)."""
    shared, anchored = plan.get("shared_from", {}), plan.get("timing_anchor", {})
    against = plan.get("timing_against", {})
    if against:
        where = sorted({v["plan"] for v in against.values()})
        scales = ", ".join(
            f"`{key.split('/')[0]}` x{v['seconds_per_step_here'] / v['base_seconds_per_step_here']:.2f}"
            for key, v in against.items()
        )
        return (
            f" Timed against {', '.join(f'`{w}`' for w in where)}: each row's step timed here in turns with the same "
            f"row as planned there, and planned at that row's seconds there times the ratio ({scales}; "
            "`timing_against` in plan.json)."
        )
    if not shared:
        return ""
    rows = ", ".join(f"`{key.split('/')[0]}` (= {where})" for key, where in shared.items())
    text = f" Rows shared with another table (the same configuration, steps and results): {rows}."
    if anchored:
        anchors = sorted({v["anchor"].split("/")[0] for v in anchored.values()})
        text += (
            f" The other rows were timed in turns with {', '.join(f'`{a}`' for a in anchors)} and planned at the "
            "ratio of their step to its (`timing_anchor` in plan.json)."
        )
    return text


def _knn_k_text(record: dict[str, Any]) -> str:
    """``k=<the k the runs used>``: the protocol's ``k`` is capped at the number of training images (the kNN
    memory), and each run's scores record the k it used (``knn_k``); the asked k is said when it differs."""
    asked = record["protocol"]["k"]
    runs = [run for row in (record["random_init"], *record["rows"]) for run in row["runs"]]
    used = sorted({run["scores"]["knn_k"] for run in runs if isinstance(run["scores"].get("knn_k"), int)})
    if not used or used == [asked]:
        return f"k={asked}"
    return (
        f"k={'/'.join(map(str, used))} ({asked} asked; at most the {record['train_images']} training images the "
        "kNN memory holds)"
    )


def _precision_text(plan: dict[str, Any]) -> str:
    """A sentence for a table trained in mixed precision (none for float32, which every table before
    ``train.precision: auto`` used without recording it), and one for views made on the device pipeline."""
    precision = plan.get("precision", "fp32")
    text = "" if precision == "fp32" else f" Every run trained with `train.precision={precision}` (autocast)."
    if plan.get("pipeline", "workers") != "workers":  # loader workers, as every table before the key
        text += f" Every run made its views with `data.pipeline={plan['pipeline']}`."
    return text


def _elsewhere_text(record: dict[str, Any]) -> str:
    """A sentence naming the runs whose ``result.json`` records a machine other than the table's (a table
    finished on several machines; runs written before results recorded their machine are not listed)."""
    here = record.get("machine")
    others: dict[str, list[str]] = {}
    for row in (record["random_init"], *record["rows"]):
        for run in row["runs"]:
            machine = run.get("machine")
            if machine and machine != here:
                device = f" ({run['device']})" if run.get("device") else ""
                others.setdefault(f"{machine}{device}", []).append(f"{row['label']} seed {run['seed']}")
    return "".join(f" Trained and evaluated on {m}: {'; '.join(runs)}." for m, runs in others.items())


def markdown(record: dict[str, Any], columns: tuple[str, ...]) -> str:
    """The table: the paper's numbers beside this run's (mean ± standard deviation over the seeds), then kNN,
    its gain over the random init of the same network, the effective rank and the budget of each row."""
    paper_cols = " | ".join(f"paper {c}" for c in columns)
    ours_cols = " | ".join(columns)
    seeds = ", ".join(str(s) for s in record["seeds"])
    protocol = record["protocol"]
    overrides = record.get("overrides") or []
    lines = [
        f"### {record['title']}",
        "",
        f"{record['note']}. Recipe `{record['recipe']}`, {_budget_text(record)}, on {record['train_images']} training "
        f"images; seeds {seeds} (mean ± sample standard deviation); evaluated on {record['test_images']} test images "
        f"(kNN {_knn_k_text(record)}, T={protocol['temperature']}; few-shot {protocol['episodes']} episodes). "
        f"Machine: {record.get('machine', 'not recorded')}."
        + _precision_text(record.get("plan", {}))
        + (f" Changes to the recipe for every row: {', '.join(f'`{o}`' for o in overrides)}." if overrides else "")
        + (
            f" Continued from {', '.join(f'`{p}`' for p in record['continued_from'])}: the runs found there were "
            "trained and evaluated elsewhere (another machine, session or folder) with the same plan (their seeds "
            'carry `"from"` in table.json).'
            if record.get("continued_from")
            else ""
        )
        + _shared_text(record.get("plan", {}))
        + _elsewhere_text(record),
        "",
        f"| row | {paper_cols} | {ours_cols} | kNN | kNN gain | eff. rank | seeds | steps | s/step | train min |",
        "|---|" + "---|" * (2 * len(columns) + 7),
    ]
    reference = record["random_init"]["mean"].get("knn")
    stages = record.get("plan", {}).get("stages", {})

    def line(label: str, row: dict) -> str:
        theirs = " | ".join(_fmt(row["paper"].get(c)) for c in columns)
        ours = " | ".join(_spread(row, COLUMNS[c]) for c in columns)
        knn = row["mean"].get("knn")
        gain = "-" if knn is None or reference is None or row["slug"] == "random_init" else f"{knn - reference:+.2f}"
        timed = [v["seconds_per_step"] for key, v in stages.items() if key.startswith(row["slug"] + "/")]
        per_step = "-" if not timed or None in timed else " + ".join(f"{t:.2f}" for t in timed)
        return (
            f"| {label} | {theirs} | {ours} | {_spread(row, 'knn')} | {gain} | {_spread(row, 'effective_rank')} | "
            f"{len(row['runs'])} | {row['steps']} | {per_step} | {row['minutes']:.1f} |"
        )

    lines.append(line("random init (same network)", record["random_init"]))
    for r in record["rows"]:
        lines.append(line(r["label"], r))
    lines.extend(
        [
            "",
            "s/step: the plan's timed step; train min: the training time of a seed, mean over seeds (its epochs' "
            "times summed across resumes; the kNN monitor and the evaluation not counted).",
        ]
    )
    notes = dict.fromkeys(n for r in (record["random_init"], *record["rows"]) for n in r["notes"])
    lines.extend(["", *(f"- `-`: {note}" for note in notes)] if notes else [])
    return "\n".join(lines) + "\n"
