"""Reading a table folder while it trains or after: ``obow tables status`` (:func:`table_status`) and
``obow tables curves`` (:func:`curves_text`), from its files alone, without taking its lock."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import cast

from obow.experiments.tables.catalog import TABLES
from obow.notices import counted


def read_table_plan(folder: Path) -> dict:
    """The ``plan.json`` of a table folder ``<out>/<table>``, or a ``ValueError`` that says what to give."""
    if not (folder / "plan.json").is_file():
        raise ValueError(f"no plan.json in {folder}: give a table folder, <out>/<table> (e.g. runs/tables/mocov2)")
    if folder.name not in TABLES:
        raise ValueError(f"{folder} is not named after a table ({', '.join(TABLES)}): give <out>/<table>")
    return json.loads((folder / "plan.json").read_text())


def table_status(folder: str | Path, seeds: list[int] | None = None) -> str:
    """Where a table folder stands (``obow tables status``), read from its files without taking any lock:
    every planned row and seed (``seeds``, or every seed with a folder there) as done, trained but not yet
    evaluated, stopped at iteration *i* of *n*, running now, or not started, with the minutes of training left
    at the plan's timed steps (evaluation and the kNN monitor not counted)."""
    from obow.training.run.lock import describe_holder, live_holder
    from obow.weights.checkpoint import load_checkpoint

    folder = Path(folder)
    plan = read_table_plan(folder)
    stages = plan.get("stages", {})
    rows = [r for r in TABLES[folder.name].rows if any(f"{r.slug}/{s.name}" in stages for s in r.plan())]
    if seeds is None:
        found = {int(m.group(1)) for p in folder.glob("*/seed*") if (m := re.fullmatch(r"seed(\d+)", p.name))}
        seeds = sorted(found) or [0]
    budget = plan["budget"]
    planned = f"{budget['minutes']:g} minutes" if "minutes" in budget else f"{budget['epochs']} epoch(s)"
    lines = [f"Table {folder.name} in {folder}: {planned} a row and seed, {plan['steps_per_epoch']} steps an epoch."]
    holder = live_holder(folder)
    if holder:
        lines.append(f"Being run now by {describe_holder(holder)}.")
    lines += ["", "| row | seed | state | steps | minutes left |", "|---|---|---|---|---|"]
    left_total, unknown, waiting = 0.0, False, 0
    for seed in seeds:
        state: str | None = (
            "done" if (folder / "random_init" / f"seed{seed}" / "result.json").is_file() else "not evaluated"
        )
        waiting += state != "done"
        lines.append(f"| random init | {seed} | {state} | - | - |")
        for row in rows:
            run = folder / row.slug / f"seed{seed}"
            multi = len(row.plan()) > 1
            done_steps, all_steps, left, state = 0, 0, 0.0, None
            for stage in row.plan():
                entry = stages.get(f"{row.slug}/{stage.name}")
                if entry is None:  # planned by a later call (--rows)
                    state, unknown = state or f"{stage.name} not planned yet", True
                    continue
                all_steps += entry["steps"]
                if (run / "result.json").is_file():
                    done_steps += entry["steps"]
                    continue
                run_dir = run / stage.name if multi else run
                ckpt = run_dir / "checkpoint.pt"
                at = load_checkpoint(ckpt)["iteration"] if ckpt.is_file() else 0
                done_steps += at
                if entry.get("seconds_per_step") is None:
                    unknown = unknown or at < entry["steps"]
                else:
                    left += max(0, entry["steps"] - at) * entry["seconds_per_step"] / 60
                if at < entry["steps"] and state is None:
                    which = f" ({stage.name})" if multi else ""
                    if live_holder(run_dir):
                        state = f"running, iteration {at} of {entry['steps']}{which}"
                    else:
                        state = f"stopped at iteration {at} of {entry['steps']}{which}" if at else f"not started{which}"
            if (run / "result.json").is_file():
                state = "done"
            else:
                state = state or "trained, not yet evaluated"
                waiting += 1
            left_total += left
            lines.append(f"| {row.label} | {seed} | {state} | {done_steps} / {all_steps} | {left:.1f} |")
    if waiting:
        total = f"about {left_total:.1f} minutes of training" + (" and stages without a timed step" if unknown else "")
        lines += [
            "",
            f"Left: {counted(waiting, 'run')} to finish or evaluate, {total} (evaluation not counted); the same "
            "`obow tables run` command (with these --seeds) resumes them.",
        ]
    else:
        lines += ["", "Every planned row is done for these seeds."]
    return "\n".join(lines) + "\n"


def monitor_curves(folder: str | Path, seeds: list[int] | None = None) -> dict[str, dict[int, dict[int, float]]]:
    """The kNN monitor's points of every row of a table folder (``--curve-every``), read from each run's
    ``log.jsonl``: ``{row label: {seed: {iteration: knn_top1}}}``. A row of several stages counts its later
    stages' iterations after the earlier stages' planned steps. Rows and seeds without points are left out."""
    folder = Path(folder)
    stages = read_table_plan(folder).get("stages", {})
    curves: dict[str, dict[int, dict[int, float]]] = {}
    for row in TABLES[folder.name].rows:
        runs = [p for p in folder.glob(f"{row.slug}/seed*") if re.fullmatch(r"seed\d+", p.name)]
        for run in sorted(runs, key=lambda p: int(p.name[4:])):
            if seeds is not None and int(run.name[4:]) not in seeds:
                continue
            points, offset = {}, 0
            for stage in row.plan():
                log_path = (run / stage.name if len(row.plan()) > 1 else run) / "log.jsonl"
                for line in log_path.read_text().splitlines() if log_path.is_file() else []:
                    record = json.loads(line)
                    if record.get("type") == "epoch" and "knn_top1" in record:
                        points[offset + record["iteration"]] = record["knn_top1"]
                offset += stages.get(f"{row.slug}/{stage.name}", {}).get("steps", 0)
            if points:
                curves.setdefault(row.label, {})[int(run.name[4:])] = points
    return curves


def curves_text(folder: str | Path, seeds: list[int] | None = None) -> str:
    """``obow tables curves``: the kNN monitor of every row at the iterations every row monitored (equal
    steps: what a step of each method learns), then every point with its planned minutes (the row's steps times
    its timed seconds a step: equal time), each the mean over the seeds that reached it."""
    folder = Path(folder)
    curves = monitor_curves(folder, seeds)
    if not curves:
        raise ValueError(f"{folder}: no kNN monitor points in any run's log.jsonl (run the table with --curve-every N)")
    plan = read_table_plan(folder)
    slugs = {r.label: r.slug for r in TABLES[folder.name].rows}

    def mean_at(label: str, it: int) -> tuple[float, int] | None:
        values = [points[it] for points in curves[label].values() if it in points]
        return (statistics.fmean(values), len(values)) if values else None

    def seconds(label: str) -> float | None:
        timed = [
            v.get("seconds_per_step") for k, v in plan.get("stages", {}).items() if k.startswith(slugs[label] + "/")
        ]
        return timed[0] if len(timed) == 1 and timed[0] else None

    shared = sorted(set.intersection(*(set().union(*map(set, c.values())) for c in curves.values())))
    seen = sorted({s for c in curves.values() for s in c})
    lines = [
        f"kNN monitor (top-1 %, test images) of table {folder.name} in {folder}; mean over seeds "
        f"{', '.join(map(str, seen))} (a point's seed count in brackets where fewer seeds reached it).",
        "",
        "At equal steps (the iterations every row monitored):",
        "",
    ]
    if not shared:
        lines.append("(no iteration was monitored by every row: give the rows the same --curve-every)")
    else:
        lines += ["| row | " + " | ".join(f"step {it}" for it in shared) + " |", "|---|" + "---|" * len(shared)]
    for label in curves if shared else ():
        cells = []
        for it in shared:
            value, n = cast(tuple[float, int], mean_at(label, it))  # a point some seed reached
            cells.append(f"{value:.2f}" + (f" ({n})" if n < len(seen) else ""))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "Every point, with its planned minutes (steps x the row's timed seconds a step):", ""]
    lines += ["| row | step | planned min | kNN |", "|---|---|---|---|"]
    for label in curves:
        per_step = seconds(label)
        for it in sorted(set().union(*map(set, curves[label].values()))):
            value, n = cast(tuple[float, int], mean_at(label, it))  # a point some seed reached
            minutes = "-" if per_step is None else f"{it * per_step / 60:.1f}"
            lines.append(f"| {label} | {it} | {minutes} | {value:.2f}" + (f" ({n})" if n < len(seen) else "") + " |")
    return "\n".join(lines) + "\n"
