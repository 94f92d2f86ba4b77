"""A table's record and its runs' curves gathered from several calls (``benchmarks/gpu_claim.py merge``: one seed
a lent GPU call): :func:`merge_records` joins a call's ``table.json`` to a folder's seed by seed, refusing another
table, plan or seed already there; :func:`read_curves` and :func:`curves_markdown` the kNN monitor's points of
every row and seed kept in the folder's ``curves/``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from obow.experiments.budget import read_records
from obow.experiments.tables.catalog import TABLES
from obow.experiments.tables.records import aggregate

__all__ = ["curves_markdown", "merge_records", "read_curves"]


def merge_records(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``old`` (a table folder's ``table.json``) with the runs of ``new`` (a call's) joined seed by seed; a
    ``ValueError`` when they are not the same table (recipe, changes, budget, images, protocol, plan) or both hold
    the same row at the same seed."""
    for key in ("table", "recipe", "budget", "train_images", "test_images", "protocol", "overrides"):
        if old.get(key) != new.get(key):
            raise ValueError(f"not the same table: {key} {old.get(key)!r} there, {new.get(key)!r} in this call")
    stages = ("stages", "precision", "pipeline", "steps_per_epoch")
    if any(old["plan"].get(k) != new["plan"].get(k) for k in stages if k in new["plan"]):
        raise ValueError("not the same plan (epochs, steps, precision or pipeline differ): the seeds would not pair")
    merged = json.loads(json.dumps(old))

    def join(mine: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
        have = {run["seed"] for run in mine["runs"]}
        clash = have & {run["seed"] for run in theirs["runs"]}
        if clash:
            raise ValueError(f"{mine['label']}: seed(s) {sorted(clash)} are there already")
        runs = sorted(mine["runs"] + theirs["runs"], key=lambda run: run["seed"])
        return aggregate(mine["label"], mine["slug"], mine.get("paper", {}), runs)

    merged["random_init"] = join(old["random_init"], new["random_init"])
    by_slug = {row["slug"]: row for row in old["rows"]}
    for row in new["rows"]:
        by_slug[row["slug"]] = join(by_slug[row["slug"]], row) if row["slug"] in by_slug else row
    order = [row.slug for row in TABLES[new["table"]].rows]
    merged["rows"] = [by_slug[slug] for slug in order if slug in by_slug]
    merged["seeds"] = sorted({run["seed"] for r in (merged["random_init"], *merged["rows"]) for run in r["runs"]})
    merged["plan"] = {**old["plan"], **{k: v for k, v in new["plan"].items() if k not in old["plan"]}}
    return merged


def curves_markdown(curves: dict[str, dict[int, dict[int, float]]]) -> str:
    """``{row label: {seed: {epoch: kNN}}}`` as one table per row: every monitored epoch, one column per seed."""
    lines = ["# kNN monitor (top-1 %, the test images; k=200, or every training image if fewer) of each row and seed"]
    lines.append("")
    for label, seeds in curves.items():
        epochs = sorted({e for points in seeds.values() for e in points})
        lines += [f"## {label}", "", "| epoch | " + " | ".join(f"seed {s}" for s in sorted(seeds)) + " |"]
        lines.append("|---|" + "---|" * len(seeds))
        for epoch in epochs:
            cells = [f"{seeds[s][epoch]:.2f}" if epoch in seeds[s] else "-" for s in sorted(seeds)]
            lines.append(f"| {epoch} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def read_curves(folder: Path, table: str) -> dict[str, dict[int, dict[int, float]]]:
    """The kNN points of ``folder/curves/<slug>-seed<N>.log.jsonl`` (the rows of ``table``): ``{row label: {seed:
    {epoch: kNN}}}``."""
    labels = {row.slug: row.label for row in TABLES[table].rows}
    curves: dict[str, dict[int, dict[int, float]]] = {}
    for path in sorted((folder / "curves").glob("*-seed*.log.jsonl")):
        slug, _, seed = path.name[: -len(".log.jsonl")].rpartition("-seed")
        points = {r["epoch"]: r["knn_top1"] for r in read_records(path) if r.get("type") == "epoch" and "knn_top1" in r}
        if points and slug in labels:
            curves.setdefault(labels[slug], {})[int(seed)] = points
    return curves
