"""The paper's comparisons as commands: ``obow tables`` and
``obow tables run NAME --data DIR (--minutes M | --budget EPOCHS) [--seeds 0 1]``.

Each table of the paper's analysis (Tables 1-5, ResNet-18 on 20% of ImageNet, 80 epochs) and the appendix
comparison with MoCo v2 is a list of rows. Every row is the same base recipe (the ``--recipe``, read as the
paper's *full* setting: ``conv4`` + ``conv5``, 2 crops + 5 patches) with the row's change applied, trained
for the same reduced budget, once per seed, then measured with one protocol (:mod:`obow.evaluate.protocol`:
linear probe, few-shot episodes, kNN, effective rank) beside the paper's numbers, as the mean and sample
standard deviation over the seeds. A "random init" row measures the base network at its random
initialisation (each seed's), the reference every learning claim needs.

The budget:

* ``--minutes M`` (the fair comparison on a CPU): every row gets the same wall-clock time of this machine,
  not the same epochs (a MoCo v2 step, two views, costs a fraction of an OBoW (full) step). Before a row is
  first trained, its step is timed together with the other rows' in alternating rounds
  (:func:`obow.experiments.budget.seconds_per_step`: loading included), and its epochs are the whole epochs
  that fit in M minutes; a BoWNet row's stages share the M minutes in the proportions below.
* ``--budget EPOCHS``: every row the same epochs (the paper's protocol; fair on equal hardware per step only).

Either way the plan (each row's epochs, warm-up, timed step) is written once to ``<table>/plan.json`` and reused by
every seed and by later calls that complete the table; asking the same folder for another budget or other images is
refused. ``--plan-only`` writes the plan and stops: time the rows on the quiet machine with every core, then train
however suits the machine. ``--timing-from DIR`` takes the timed steps of another folder of the same table (another
budget) instead of timing them again. ``--shared-from DIR`` takes from a folder of *another* table (same images,
recipe, changes, protocol and budget) the rows the two tables have in common (the same configuration: OBoW vanilla
is a row of Tables 1, 2, 3, 4 and 5) with their plan and finished seeds, so that no configuration is trained twice
and every table shows the same numbers for it; this table's other rows are then timed in turns with one shared row
and planned at the ratio of their step to its (:func:`share_rows`): the ratio is measured in one run, the machine's
speed on the day is not. The plan fixes each row's steps, not its threads: on a 2-core machine two tables can train
side by side with ``OMP_NUM_THREADS=1`` each; only the wall time in ``table.md`` changes. Measured (2026-11-24): the
MoCo v2 table on CIFAR-10 and on Imagenette side by side, one thread each, ran OBoW (full) at 7.1 and 7.4 s a step,
against 3.85 and 4.06 s timed alone with both cores: about 1.1x the work of one table at a time. ``--jobs N`` does
the same within one table: N of its row-seed runs at once, each in its own process (:func:`run_in_processes`).

Settings the tables change for a short run, the same rule for every row:

* **Warm-up**: the base recipe's warm-up in epochs (``cifar10_fast``: 1 epoch), *not* scaled with the
  budget, and at most half the row's epochs (:func:`obow.experiments.budget.short_run_warmup`). An earlier
  rule kept the recipe's proportion of the run: 8 steps of warm-up for a 117-step row, and OBoW (full) fell
  below its random init (kNN 23.0 against 26.9).
* Nothing else is scaled: the teacher momentum's cosine (0.99 -> 1) and the learning rate's cosine run over
  the row's own steps, as in any run; the temperature statistic's momentum is per step (the recipe's).

How the paper's settings map onto the base recipe:

* *vanilla*: ``model.levels=[conv5]``, one crop, no patches; *full*: the base recipe itself (with
  ``model.levels=[conv4, conv5]``).
* crop sizes: the paper's 224 px crop is the base's teacher view size, its 160 px crop the base's
  ``views.crop_size`` and its 96 px patch the base's ``views.patch_size`` (for CIFAR-10: 40, 28 and 17 px).
  The 224 px crop is a random-resized crop of scale (0.08, 1), torchvision's default.
* Table 2's learning rates 0.03 and 0.01 (paper base 0.05) are 0.6 and 0.2 times the base ``optim.lr``.
* Table 5's BoWNet is three stages within the row's budget, in the paper's proportions (40 + 80 + 80 of 200
  epochs): RotNet pretraining of the teacher (one crop of the teacher-view size), then two BoWNet rounds
  (hard codes, fixed linear head, k-means vocabulary of the previous stage's network), each stage at least one
  epoch. OBoW rows get the same total budget (the paper gave BoWNet 200 epochs and OBoW 80).
* MoCo v2 rows: ``moco.key_momentum=0.99`` (OBoW's teacher momentum, and what MoCo's CIFAR-10 demo uses; 0.999
  would leave the key encoder at its initialisation over a few hundred steps) and a queue of the largest
  multiple of the batch that is at most half the training images (and at most 65,536, MoCo's).

A table's folder holds one folder per row and seed (``<out>/<table>/<row>/seed<N>/``, a pretraining run
each, resumable) with ``result.json`` once finished; re-running the command trains and evaluates only what is
missing (``--rows`` picks rows, ``--seeds`` the seeds), so a table can be completed over several sessions.
``obow tables status <out>/<table>`` (:func:`table_status`) reports, from the files alone, each planned row and
seed's state and the minutes of training left.
``obow tables curves <out>/<table>`` (:func:`curves_text`) prints the kNN monitor of every row (``--curve-every``)
at equal steps and with its planned minutes.
``table.json`` and ``table.md`` hold the whole table: every seed's scores, their mean and spread, the plan,
the protocol and the machine.

``obow tables budgets TABLE ...`` (:func:`compare_budgets`) puts one table measured at several ``--minutes``
budgets side by side: the gain of each row over random init against the budget, and where the gap between two
rows would cross zero, read as a line in log-minutes. ``obow tables levers BASE LEVER ...`` (:func:`compare_levers`)
puts one table at one budget beside the same table run with ``key=value`` changes: each row's change against the
base's same row and seed, and the change in the gap between two rows.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from obow.files import writing

log = logging.getLogger("obow")

#: The paper's columns and the protocol's keys.
COLUMNS = {"1-shot": "fewshot_1", "5-shot": "fewshot_5", "linear": "linear"}

VANILLA = ("model.levels=[conv5]", "views.num_crops=1", "views.num_patches=0")
FULL = ("model.levels=[conv4, conv5]",)
CROP_224 = (
    "views.num_crops=1",
    "views.crop_size={teacher_size}",
    "views.crop_scale=[0.08, 1.0]",
    "views.num_patches=0",
)
BOWNET = ("model.method=bownet", "model.assignment=hard", "model.head=fixed", "model.levels=[conv5]")
ROTNET = ("model.method=rotnet", *CROP_224)
MOCO = ("model.method=mocov2", "moco.key_momentum=0.99", "moco.queue_size={moco_queue}")


@dataclass(frozen=True)
class Stage:
    """One pretraining run of a row: overrides on the base recipe and its share of the row's budget.
    ``teacher`` stages take the previous stage's checkpoint as ``bownet.teacher``."""

    name: str
    overrides: tuple[str, ...]
    share: float = 1.0
    teacher: bool = False


@dataclass(frozen=True)
class Row:
    label: str
    overrides: tuple[str, ...] = ()
    paper: dict[str, float | None] = field(default_factory=dict)
    stages: tuple[Stage, ...] = ()

    @property
    def slug(self) -> str:
        return re.sub(r"[^a-z0-9]+", "_", self.label.lower()).strip("_")

    def plan(self) -> tuple[Stage, ...]:
        return self.stages or (Stage("pretrain", self.overrides),)


@dataclass(frozen=True)
class Table:
    name: str
    title: str
    note: str
    rows: tuple[Row, ...]
    columns: tuple[str, ...] = ("1-shot", "5-shot", "linear")


def _paper(one: float | None, five: float | None, linear: float | None) -> dict[str, float | None]:
    return {"1-shot": one, "5-shot": five, "linear": linear}


def _bownet_stages(crop: tuple[str, ...]) -> tuple[Stage, ...]:
    return (
        Stage("rotnet", ROTNET, share=40 / 200),
        Stage("round1", (*BOWNET, *crop), share=80 / 200, teacher=True),
        Stage("round2", (*BOWNET, *crop), share=80 / 200, teacher=True),
    )


TABLES: dict[str, Table] = {
    t.name: t
    for t in (
        Table(
            "table1",
            "Table 1: online vocabulary updates",
            "vanilla in the first five rows, full (multi-scale) in the last two",
            (
                Row(
                    "k-means, rare-word replacement", (*VANILLA, "model.vocabulary=kmeans"), _paper(40.98, 60.35, 44.45)
                ),
                Row(
                    "k-means, Sinkhorn balancing",
                    (*VANILLA, "model.vocabulary=kmeans", "model.assignment=sinkhorn", "model.rare_word_steps=null"),
                    _paper(37.20, 55.22, 39.74),
                ),
                Row("queue, local features", (*VANILLA, "model.queue_sampling=local"), _paper(40.29, 60.81, 44.39)),
                Row(
                    "queue, globally-averaged",
                    (*VANILLA, "model.queue_sampling=global_average"),
                    _paper(41.57, 62.54, 45.79),
                ),
                Row(
                    "queue, locally-averaged",
                    (*VANILLA, "model.queue_sampling=local_average"),
                    _paper(42.11, 62.44, 45.86),
                ),
                Row(
                    "multi-scale, globally-averaged",
                    (*FULL, "model.queue_sampling=global_average"),
                    _paper(41.29, 63.09, 49.40),
                ),
                Row(
                    "multi-scale, locally-averaged",
                    (*FULL, "model.queue_sampling=local_average"),
                    _paper(44.18, 64.89, 50.89),
                ),
            ),
        ),
        Table(
            "table2",
            "Table 2: teacher momentum alpha (vanilla)",
            "constant alpha unless annealed; lr relative to the base recipe's (paper: 0.05)",
            (
                Row("alpha 0.99 -> 1 (cosine), lr x1", VANILLA, _paper(42.11, 62.44, 45.86)),
                *(
                    Row(
                        f"alpha {a}, lr x1",
                        (*VANILLA, f"model.teacher_momentum={a}", "model.teacher_momentum_schedule=constant"),
                        _paper(*p),
                    )
                    for a, p in (
                        ("0.999", (40.87, 61.41, 45.76)),
                        ("0.99", (41.19, 61.65, 46.25)),
                        ("0.9", (40.79, 60.92, 44.89)),
                        ("0.5", (12.70, 23.20, 15.41)),
                        ("0.0", (13.19, 24.85, 17.47)),
                    )
                ),
                Row(
                    "alpha 0.5, lr x0.6",
                    (
                        *VANILLA,
                        "model.teacher_momentum=0.5",
                        "model.teacher_momentum_schedule=constant",
                        "optim.lr={lr_x06}",
                    ),
                    _paper(39.52, 60.18, 43.82),
                ),
                Row(
                    "alpha 0.0, lr x0.2",
                    (
                        *VANILLA,
                        "model.teacher_momentum=0.0",
                        "model.teacher_momentum_schedule=constant",
                        "optim.lr={lr_x02}",
                    ),
                    _paper(33.80, 55.02, 39.90),
                ),
            ),
        ),
        Table(
            "table3",
            "Table 3: soft vs hard codes, dynamic vs fixed head (vanilla)",
            "hard codes with a fixed head is not in the paper",
            (
                Row(
                    "soft, dynamic",
                    (*VANILLA, "model.assignment=soft", "model.head=dynamic"),
                    _paper(42.11, 62.44, 45.86),
                ),
                Row(
                    "hard, dynamic",
                    (*VANILLA, "model.assignment=hard", "model.head=dynamic"),
                    _paper(38.61, 59.98, 44.64),
                ),
                Row("soft, fixed", (*VANILLA, "model.assignment=soft", "model.head=fixed"), _paper(2.00, 2.00, 0.10)),
                Row("hard, fixed", (*VANILLA, "model.assignment=hard", "model.head=fixed"), _paper(None, None, None)),
            ),
        ),
        Table(
            "table4",
            "Table 4: image crops and multi-scale BoW",
            "224 / 160 / 96 px are the base's teacher view, crop and patch sizes",
            (
                Row("1 x 224", ("model.levels=[conv5]", *CROP_224), _paper(None, None, 31.39)),
                Row(
                    "1 x 224 + cutmix",
                    ("model.levels=[conv5]", *CROP_224, "model.cutmix=true"),
                    _paper(None, None, 39.46),
                ),
                Row("1 x 160", VANILLA, _paper(None, None, 45.86)),
                Row(
                    "2 x 160",
                    ("model.levels=[conv5]", "views.num_crops=2", "views.num_patches=0"),
                    _paper(None, None, 47.64),
                ),
                Row(
                    "5 x 96",
                    ("model.levels=[conv5]", "views.num_crops=0", "views.num_patches=5"),
                    _paper(None, None, 44.24),
                ),
                Row(
                    "2 x 160 + 5 x 96",
                    ("model.levels=[conv5]", "views.num_crops=2", "views.num_patches=5"),
                    _paper(None, None, 49.64),
                ),
                Row(
                    "2 x 160, multi-scale",
                    (*FULL, "views.num_crops=2", "views.num_patches=0"),
                    _paper(None, None, 49.00),
                ),
                Row(
                    "2 x 160 + 5 x 96, multi-scale",
                    (*FULL, "views.num_crops=2", "views.num_patches=5"),
                    _paper(None, None, 50.89),
                ),
            ),
        ),
        Table(
            "table5",
            "Table 5: BoWNet vs OBoW",
            "BoWNet = RotNet teacher + two BoWNet rounds (40 + 80 + 80 of 200 parts of the budget)",
            (
                Row(
                    "BoWNet", paper=_paper(33.80, 55.02, 41.30), stages=_bownet_stages((*CROP_224, "model.cutmix=true"))
                ),
                Row("BoWNet (160 crops)", paper=_paper(29.26, 49.68, 43.59), stages=_bownet_stages(VANILLA[1:])),
                Row("OBoW (vanilla)", VANILLA, _paper(42.11, 62.44, 45.86)),
                Row("OBoW (full)", FULL, _paper(44.18, 64.89, 50.89)),
            ),
        ),
        Table(
            "mocov2",
            "Appendix: MoCo v2 with the same augmentations",
            "MoCo v2 (our aug.): every OBoW crop and patch is a query against the key of the teacher view",
            (
                Row("OBoW (vanilla)", VANILLA, _paper(42.11, 62.44, 45.86)),
                Row("OBoW (full)", FULL, _paper(44.18, 64.89, 50.89)),
                Row("MoCo v2", (*MOCO, "moco.augmentation=mocov2"), _paper(24.75, 43.89, 35.00)),
                Row("MoCo v2 (our aug.)", (*MOCO, "moco.augmentation=ours", *FULL), _paper(36.90, 55.87, 43.13)),
            ),
        ),
    )
}


def list_tables() -> str:
    lines = []
    for t in TABLES.values():
        lines.append(f"{t.name:8s} {t.title} ({len(t.rows)} rows; {t.note})")
        lines.extend(f"           - {r.label}" for r in t.rows)
    return "\n".join(lines)


def _fill(overrides: tuple[str, ...], values: dict[str, Any]) -> list[str]:
    return [item.format(**values) if "{" in item else item for item in overrides]


def _placeholders(base: Any, train_images: int) -> dict[str, Any]:
    half = min(65536, train_images // 2)
    queue = max(base.data.batch_size, half // base.data.batch_size * base.data.batch_size)
    return {
        "teacher_size": base.views.teacher_size,
        "lr_x06": base.optim.lr * 0.6,
        "lr_x02": base.optim.lr * 0.2,
        "moco_queue": queue,
    }


def select_rows(table: Table, wanted: list[str] | None) -> list[Row]:
    """The rows named in ``wanted`` (labels, slugs or 1-based numbers), all rows when ``None``."""
    if not wanted:
        return list(table.rows)
    out = []
    for item in wanted:
        match = [r for i, r in enumerate(table.rows, start=1) if item in (r.label, r.slug, str(i))]
        if not match:
            choices = ", ".join(f"{i} ({r.slug})" for i, r in enumerate(table.rows, start=1))
            raise ValueError(f"{table.name} has no row {item!r}; rows: {choices}")
        out.extend(m for m in match if m not in out)
    return out


def run_table(
    name: str,
    data: str | Path,
    budget: int | None = None,
    *,
    minutes: float | None = None,
    seeds: tuple[int, ...] | list[int] = (0,),
    recipe: str = "cifar10_fast",
    out: str | Path = "runs/tables",
    per_class: int | None = None,
    test_per_class: int | None = None,
    rows: list[str] | None = None,
    overrides: list[str] | None = None,
    k: int = 200,
    temperature: float = 0.1,
    episodes: int = 200,
    curve_every: int = 0,
    plan_only: bool = False,
    timing_from: str | Path | None = None,
    results_from: str | Path | None = None,
    shared_from: str | Path | None = None,
    jobs: int = 1,
    time_against: str | Path | None = None,
) -> dict[str, Any]:
    """Train and evaluate the rows of table ``name`` (see the module docstring) for every seed in ``seeds``,
    each row for ``budget`` epochs or for ``minutes`` of this machine; returns the table's record, also written
    to ``<out>/<name>/table.json`` and ``table.md``. ``curve_every`` > 0 runs the kNN monitor on the test images
    every that many epochs (the learning curves in each run's ``log.jsonl``; its time is not in the budget).
    ``plan_only`` writes ``<out>/<name>/plan.json`` (timing the rows not yet planned) and returns the plan
    without training or evaluating anything. ``timing_from`` (a table folder of the same table, images and
    machine, planned for another ``minutes``) lends its timed steps to the rows not yet planned here, so that a
    second budget is planned from the same timing and needs no quiet machine. ``results_from`` (a folder with a
    ``table.json`` and ``plan.json`` of the same table, images, recipe, changes, protocol and budget, e.g. a
    published ``docs/results/tables/...`` folder) continues that table on this machine: its plan becomes this
    folder's, and its finished rows and seeds count as done here (:func:`import_results`). ``shared_from`` (a
    folder of *another* table on the same images, recipe, changes, protocol and budget) gives the rows this table
    has in common with it that table's plan and finished results, and times this table's other rows in turns
    with one shared row, at the ratio of their step to its (:func:`share_rows`). ``time_against`` (a folder of
    the same table planned for the same ``minutes``, usually without this call's changes) plans a lever whose
    changes alter a step's cost (``data.batch_size``, ``model.num_words``, views): each row it timed is timed
    here in turns as it was there and as it is here, and planned at ``its seconds there x the ratio of the two``
    (``timing_against`` in the plan), so that the lever gets the base's wall-clock budget whatever the
    machine's load on the day. ``jobs`` > 1 trains
    and evaluates that many row-seed runs at once, each in its own process with ``train.threads`` threads
    (unset: this process's cores divided by ``jobs``, or by the number of runs left if fewer)
    (:func:`run_in_processes`); the plan is made first, here."""
    from obow.config import load_config
    from obow.data.eval_sets import align_classes, eval_dataset
    from obow.data.folders import scan_images
    from obow.training.lock import RunLock
    from obow.training.loop import available_cores

    if name not in TABLES:
        raise ValueError(f"unknown table {name!r}; choose one of: {', '.join(TABLES)}")
    if (budget is None) == (minutes is None):
        raise ValueError("give the budget either in epochs (--budget) or in minutes (--minutes), not both")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise ValueError(f"--budget must be a whole number of epochs >= 1, got {budget!r}")
    if minutes is not None and not minutes > 0:
        raise ValueError(f"--minutes must be > 0, got {minutes!r}")
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"--jobs must be a whole number >= 1, got {jobs!r}")
    if time_against is not None and (timing_from is not None or shared_from is not None):
        raise ValueError(
            "--time-against times this table's rows anew: it cannot be combined with --timing-from or --shared-from"
        )
    seeds = tuple(seeds)
    if not seeds or len(set(seeds)) != len(seeds) or any(isinstance(s, bool) or not isinstance(s, int) for s in seeds):
        raise ValueError(f"--seeds must be distinct whole numbers, got {list(seeds)!r}")
    table = TABLES[name]
    data = Path(data)
    train_dir = data / "train"
    test_dir = next((data / d for d in ("test", "val") if (data / d).is_dir()), None)
    if not train_dir.is_dir() or test_dir is None:
        raise ValueError(f"{data} must hold train/ and test/ (or val/) folders of class folders")

    def with_changes(changes: list[str]) -> list[str]:
        items = [f"data.path={train_dir}", "train.progress_bar=false", *changes]
        items += (
            [f"train.knn_every={curve_every}", f"data.val_path={test_dir}"] if curve_every else ["train.knn_every=0"]
        )
        return items + ([f"data.images_per_class={per_class}"] if per_class is not None else [])

    common = with_changes(list(overrides or []))
    base = load_config(recipe, common)
    train_images = scan_images(train_dir, "folders", base.data.images_per_class)
    test_images = align_classes(train_images, scan_images(test_dir, "folders", test_per_class))
    sets = eval_dataset(train_images, base.views), eval_dataset(test_images, base.views)
    values = _placeholders(base, len(train_images))
    protocol = {"k": k, "temperature": temperature, "episodes": episodes}
    steps_per_epoch = max(1, len(train_images) // base.data.batch_size)
    folder = Path(out) / name
    chosen = select_rows(table, rows)
    with RunLock(folder):  # one `obow tables run` per table folder: its rows' runs and results are shared
        device = "cuda" if base.train.device != "cpu" and _cuda() else "cpu"
        expected = {
            "table": name,
            "recipe": recipe,
            "budget": {"epochs": budget} if minutes is None else {"minutes": minutes},
            "train_images": len(train_images),
            "test_images": len(test_images),
            "protocol": protocol,
            "overrides": list(overrides or []),
        }
        if results_from is not None:
            import_results(Path(results_from), folder, expected, steps_per_epoch)
        anchor = None
        if shared_from is not None:
            same = {key: value for key, value in expected.items() if key != "table"}
            anchor = share_rows(Path(shared_from), folder, table, recipe, common, values, same, steps_per_epoch)
        against = None
        if time_against is not None:
            against = _timing_against(Path(time_against), recipe, with_changes, len(train_images), minutes)
        plan = _budget_plan(
            folder, chosen, recipe, common, values, budget, minutes, steps_per_epoch, timing_from, anchor, against
        )
        if plan_only:
            return plan

        def write_table() -> dict[str, Any]:
            """``table.json`` and ``table.md`` from every result in the folder (this call's and earlier ones'),
            rewritten after each finished run so that an interrupted table still shows what it has."""
            record = {
                "table": name,
                "title": table.title,
                "note": table.note,
                "recipe": recipe,
                "budget": plan["budget"],
                "plan": plan,
                "train_images": len(train_images),
                "test_images": len(test_images),
                "protocol": protocol,
                "overrides": list(overrides or []),
                "machine": machine_description(),
                "random_init": _aggregate("random init", "random_init", {}, _results(folder / "random_init")),
                "rows": [],
            }
            for r in table.rows:  # rows of this call, and rows finished by earlier calls (--rows)
                runs = _results(folder / r.slug)
                if runs:
                    record["rows"].append(_aggregate(r.label, r.slug, r.paper, runs))
            found = {run["seed"] for r in (record["random_init"], *record["rows"]) for run in r["runs"]}
            record["seeds"] = sorted(found)
            record["continued_from"] = sorted(
                {run["from"] for r in (record["random_init"], *record["rows"]) for run in r["runs"] if "from" in run}
            )
            _write(folder / "table.json", record)
            with writing(folder / "table.md") as path:
                path.write_text(markdown(record, table.columns))
            return record

        tasks = [
            Task(row, seed) for seed in seeds for row in (None, *chosen) if not Task(row, seed).result(folder).exists()
        ]
        shared = {key.split("/")[0] for key in plan.get("shared_from", {})}
        waiting = [task for task in tasks if task.row is not None and task.row.slug in shared]
        if waiting:  # trained by the table they are shared with, never twice
            log.info(
                "%s: not trained here, shared with the table in plan.json's shared_from and not finished there: %s; "
                "run again with --shared-from once it is",
                name,
                "; ".join(map(str, waiting)),
            )
            tasks = [task for task in tasks if task not in waiting]
        if jobs == 1 or len(tasks) < 2:
            for task in tasks:
                _run_task(task, folder, recipe, common, values, plan, base, sets, device, protocol)
                write_table()
                log.info("%s: %s done", name, task)
        else:
            threads = base.train.threads or max(1, available_cores() // min(jobs, len(tasks)))
            job_common = [*common, f"train.threads={threads}"]
            run_in_processes(
                tasks,
                jobs,
                threads,
                lambda task: (task, folder, recipe, job_common, values, plan, base, sets, device, protocol),
                lambda task: (write_table(), log.info("%s: %s done", name, task)),
            )
        record = write_table()
        return record


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


def _timing_against(
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
            f"--time-against {source}: planned for {other.get('budget')}, this call for {{'minutes': {minutes}}}: "
            "a lever gets its base's budget"
        )
    table_path = source / "table.json"
    changes = tuple(json.loads(table_path.read_text()).get("overrides", [])) if table_path.is_file() else ()
    common = with_changes(list(changes))
    values = _placeholders(load_config(recipe, common), train_images)
    seconds = {
        key: stage["seconds_per_step"]
        for key, stage in other.get("stages", {}).items()
        if stage.get("seconds_per_step")
    }
    return Against(str(plan_path), seconds, changes, common, values)


def _budget_plan(
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
) -> dict[str, Any]:
    """Epochs and warm-up of every row's stages, kept in ``<table>/plan.json`` so that every seed, and every
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
    plan = json.loads(path.read_text()) if path.exists() else {"budget": wanted, "steps_per_epoch": steps_per_epoch}
    if plan["budget"] != wanted or plan["steps_per_epoch"] != steps_per_epoch:
        raise ValueError(
            f"{folder} holds a table planned for {plan['budget']} and {plan['steps_per_epoch']} steps an epoch; "
            f"this call asks for {wanted} and {steps_per_epoch}: use another --out, or the same budget and images"
        )
    stages = plan.setdefault("stages", {})
    every = {f"{row.slug}/{stage.name}": stage for row in rows for stage in row.plan()}
    missing = {key: stage for key, stage in every.items() if key not in stages}
    if not missing:
        return plan
    configs = {}
    for key, stage in missing.items():
        items = [*common, *_fill(stage.overrides, values)]
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
                items = [*against.common, *_fill(every[key].overrides, against.values)]
                items.append(f"train.threads={configs[key].train.threads}")
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
            epochs = max(1, round(budget * stage.share))
        else:
            epochs = plan_epochs(minutes * stage.share, timed[key], steps_per_epoch)
        stages[key] = {
            "epochs": epochs,
            "warmup_epochs": short_run_warmup(cfg.optim.warmup_epochs, epochs),
            "seconds_per_step": timed.get(key),
            "steps": epochs * steps_per_epoch,
        }
    _write(path, plan)
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
            raise ValueError(
                f"{option} {source}: its {key} is {record.get(key)!r}, this call's is {value!r}; {what} on the "
                "same images, recipe, changes, protocol and budget"
            )
    if plan.get("steps_per_epoch") != steps_per_epoch or plan.get("budget") != expected["budget"]:
        raise ValueError(
            f"{option} {source}: its plan.json is not for {expected['budget']} and {steps_per_epoch} steps an epoch"
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
        _write(own_plan, {**own, "stages": merged})
    else:
        _write(own_plan, {**plan, "plan_from": str(plan_path)})
    imported = []
    for row in (record["random_init"], *record["rows"]):
        for run in row["runs"]:
            name = f"{row['slug']}/seed{run['seed']}"
            target = folder / name / "result.json"
            if not target.exists():
                _write(target, {**run, "from": str(table_path)})
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
    :class:`Anchor` that :func:`_budget_plan` times this table's other rows against, so that their steps keep the
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
        return load_config(recipe, [*common, *_fill(row.overrides, values)])

    theirs = {r.slug: to_dict(config(r)) for r in other.rows if not r.stages and f"{r.slug}/pretrain" in planned}
    matches: dict[str, str] = {}
    for row in table.rows:
        if not row.stages:
            mine = to_dict(config(row))
            same = [slug for slug, cfg in theirs.items() if cfg == mine]
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
    _write(own_path, own)
    by_slug = {r["slug"]: r for r in record["rows"]}
    imported = []
    for mine, slug in {"random_init": "random_init", **matches}.items():
        found = record["random_init"] if slug == "random_init" else by_slug.get(slug, {"runs": []})
        for run in found["runs"]:
            target = folder / mine / f"seed{run['seed']}" / "result.json"
            if not target.exists():
                _write(target, {**run, "from": str(table_path)})
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


@dataclass(frozen=True)
class Task:
    """One run of a table: a row (``None``: the random init) at a seed."""

    row: Row | None
    seed: int

    def result(self, folder: Path) -> Path:
        return folder / (self.row.slug if self.row else "random_init") / f"seed{self.seed}" / "result.json"

    def __str__(self) -> str:
        return f"{self.row.label if self.row else 'random init'}, seed {self.seed}"


def _run_task(
    task: Task, folder: Path, recipe: str, common: list[str], values: dict, plan: dict, base: Any, sets: tuple,
    device: str, protocol: dict,
) -> None:  # fmt: skip
    """Train (a row) and evaluate one task, then write its ``result.json``."""
    result = task.result(folder)
    if task.row is None:
        _random_init_result(result.parent, base, task.seed, sets, device, protocol)
        return
    done = _run_row(task.row, result.parent, recipe, [*common, f"train.seed={task.seed}"], values, plan)
    done["scores"] = _scores(done.pop("checkpoint"), sets, device, protocol)
    _write(result, {**done, "seed": task.seed})


def _task_process(task_args: tuple, threads: int) -> None:
    """The body of one ``--jobs`` process: its own log prefix and threads, then :func:`_run_task`; a run stopped
    by a signal exits with the shell's code for it (``128 + signal``) after its checkpoint."""
    import torch

    from obow.training.loop import Interrupted

    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s %(levelname)s [{task_args[0]}] %(message)s", datefmt="%H:%M:%S"
    )
    torch.set_num_threads(threads)  # the evaluation's threads; training takes train.threads
    try:
        _run_task(*task_args)
    except Interrupted as err:
        sys.exit(err.exit_code)


def run_in_processes(
    tasks: list[Task], jobs: int, threads: int, arguments: Callable[[Task], tuple], finished: Callable[[Task], Any]
) -> None:
    """Run ``tasks`` in order, at most ``jobs`` at a time, each in a fresh process (``spawn``) with ``threads``
    intra-op threads, calling ``finished(task)`` here after each one that wrote its result. SIGINT and SIGTERM
    received here are passed on to the running processes (which finish their step, write a checkpoint and stop;
    the terminal's Ctrl-C reaches them as well, and the two count as one request) and no task is started after
    them; then :class:`~obow.training.loop.Interrupted` is raised. A task that fails lets the running ones
    finish, starts no other, then raises ``RuntimeError`` naming it: nothing finished is lost, and the same
    command resumes."""
    import multiprocessing
    import multiprocessing.connection

    from obow.training.loop import Interrupted

    context = multiprocessing.get_context("spawn")
    pending, running = list(tasks), {}
    received: list[str] = []
    failed: list[tuple[Task, int | None]] = []

    def forward(signum: int, frame: Any) -> None:
        if not received:
            received.append(signal.Signals(signum).name)
            log.warning("%s: the running tasks finish their step and write a checkpoint; no new task starts",
                        received[0])  # fmt: skip
        for process, _ in running.values():
            if process.is_alive():
                os.kill(process.pid, signum)

    try:
        previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # not the main thread: leave signals alone
        previous = {}
    try:
        while running or (pending and not received and not failed):
            while pending and not received and not failed and len(running) < jobs:
                task = pending.pop(0)
                process = context.Process(target=_task_process, args=(arguments(task), threads), name=str(task))
                process.start()
                running[process.sentinel] = (process, task)
                log.info("started %s (process %d, %d thread(s))", task, process.pid, threads)
            for sentinel in multiprocessing.connection.wait(list(running)):
                process, task = running.pop(sentinel)
                process.join()
                if process.exitcode == 0:
                    finished(task)
                elif not received:
                    failed.append((task, process.exitcode))
                    log.error("%s failed (exit code %s): the running tasks finish, no new one starts",
                              task, process.exitcode)  # fmt: skip
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if failed:
        which = "; ".join(f"{task} (exit code {code})" for task, code in failed)
        raise RuntimeError(f"{which} failed: its error is in the log above; the same command resumes")
    if received:
        raise Interrupted(received[0])


def _random_init_result(run: Path, base: Any, seed: int, sets: tuple, device: str, protocol: dict) -> None:
    from obow.weights.load import load_backbone

    if (run / "result.json").exists():
        return
    net, _ = load_backbone(
        random_init=True, arch=base.model.arch, stem=base.model.stem, seed=seed, arch_options=base.model.arch_options
    )
    scores = _scores(net, sets, device, protocol)
    _write(run / "result.json", {"seed": seed, "scores": scores, "steps": 0, "minutes": 0.0})


def _scores(network: Any, sets: tuple, device: str, protocol: dict) -> dict[str, Any]:
    from obow.evaluate.protocol import evaluate_backbone
    from obow.weights.load import load_backbone

    if isinstance(network, (str, Path)):
        network, _ = load_backbone(network)
    return evaluate_backbone(network, *sets, device=device, **protocol)


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


def _results(row_folder: Path) -> list[dict[str, Any]]:
    """The finished seeds of a row, in seed order; a trained run's minutes are read again from its logs
    (:func:`training_minutes`)."""
    found = []
    for path in row_folder.glob("seed*/result.json"):
        result = json.loads(path.read_text())
        minutes = training_minutes(path.parent) if result.get("steps") else None
        found.append({**result, "minutes": result["minutes"] if minutes is None else minutes})
    return sorted(found, key=lambda r: r["seed"])


def _aggregate(label: str, slug: str, paper: dict, runs: list[dict[str, Any]]) -> dict[str, Any]:
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


def _run_row(row: Row, folder: Path, recipe: str, common: list[str], values: dict, plan: dict) -> dict[str, Any]:
    from obow.config import load_config
    from obow.evaluate.monitor import KNNMonitor
    from obow.training.loop import pretrain

    checkpoint, steps, seconds = None, 0, 0.0
    stages = row.plan()
    for stage in stages:
        stage_plan = plan["stages"][f"{row.slug}/{stage.name}"]
        items = [
            *common,
            *_fill(stage.overrides, values),
            f"optim.epochs={stage_plan['epochs']}",
            f"optim.warmup_epochs={stage_plan['warmup_epochs']}",
        ]
        if stage.teacher:
            items.append(f"bownet.teacher={checkpoint}")
        cfg = load_config(recipe, items)
        run_dir = folder if len(stages) == 1 else folder / stage.name
        start = time.time()
        summary = pretrain(cfg, run_dir, monitor=KNNMonitor)
        seconds += time.time() - start
        checkpoint, steps = summary["checkpoint"], steps + summary["iteration"]
    minutes = training_minutes(folder)
    return {
        "label": row.label,
        "slug": row.slug,
        "checkpoint": checkpoint,
        "steps": steps,
        "minutes": seconds / 60 if minutes is None else minutes,
    }


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
    from obow.training.lock import describe_holder, live_holder
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
        state = "done" if (folder / "random_init" / f"seed{seed}" / "result.json").is_file() else "not evaluated"
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
            f"Left: {waiting} run(s) to finish or evaluate, {total} (evaluation not counted); the same "
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
            value, n = mean_at(label, it)
            cells.append(f"{value:.2f}" + (f" ({n})" if n < len(seen) else ""))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "Every point, with its planned minutes (steps x the row's timed seconds a step):", ""]
    lines += ["| row | step | planned min | kNN |", "|---|---|---|---|"]
    for label in curves:
        per_step = seconds(label)
        for it in sorted(set().union(*map(set, curves[label].values()))):
            value, n = mean_at(label, it)
            minutes = "-" if per_step is None else f"{it * per_step / 60:.1f}"
            lines.append(f"| {label} | {it} | {minutes} | {value:.2f}" + (f" ({n})" if n < len(seen) else "") + " |")
    return "\n".join(lines) + "\n"


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


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _write(path: Path, record: dict[str, Any]) -> None:
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
    return f"{budget['epochs']} epoch(s) per row"


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
        f"(kNN k={protocol['k']}, T={protocol['temperature']}; few-shot {protocol['episodes']} episodes). "
        f"Machine: {record.get('machine', 'not recorded')}."
        + (f" Changes to the recipe for every row: {', '.join(f'`{o}`' for o in overrides)}." if overrides else "")
        + (
            f" Continued from {', '.join(f'`{p}`' for p in record['continued_from'])}: the runs found there were "
            "trained and evaluated elsewhere (another machine, session or folder) with the same plan (their seeds "
            'carry `"from"` in table.json).'
            if record.get("continued_from")
            else ""
        )
        + _shared_text(record.get("plan", {})),
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


def _scores_measured(record: dict[str, Any]) -> list[str]:
    """The numeric scores a table's runs hold (knn, linear, fewshot_1, ...), confidence intervals and k aside."""
    return sorted(
        {
            k
            for row in [record["random_init"], *record["rows"]]
            for run in row["runs"]
            for k, v in run["scores"].items()
            if isinstance(v, (int, float)) and not k.endswith(("_ci", "_k"))
        }
    )


def _find_row(record: dict[str, Any], name: str) -> dict[str, Any] | None:
    """A row by label or folder name (slug); ``random_init`` names the random-init row."""
    return next((row for row in [record["random_init"], *record["rows"]] if name in (row["label"], row["slug"])), None)


def _by_seed(row: dict[str, Any] | None, score: str, seeds: set[int] | None = None) -> dict[int, float]:
    if row is None:
        return {}
    return {
        run["seed"]: run["scores"][score]
        for run in row["runs"]
        if (seeds is None or run["seed"] in seeds) and isinstance(run["scores"].get(score), (int, float))
    }


def _paired(a: dict[int, float], b: dict[int, float]) -> list[float]:
    """``a - b`` for every seed both hold: differences of the same seed, so the seed spread cancels."""
    return [a[s] - b[s] for s in sorted(a) if s in b]


def _signed_cell(values: list[float], signed: bool = True) -> str:
    """Mean ± sample deviation (number of values), or ``-`` for none."""
    if not values:
        return "-"
    mean = statistics.fmean(values)
    spread = f" ± {statistics.stdev(values):.2f}" if len(values) > 1 else ""
    return f"{mean:+.2f}{spread} ({len(values)})" if signed else f"{mean:.2f}{spread} ({len(values)})"


def _check_score(record: dict[str, Any], score: str) -> None:
    known = _scores_measured(record)
    if score not in known:
        raise ValueError(f"score {score!r} was not measured; choose one of: {', '.join(known)}")


def _default_versus(slugs: list[str], versus: tuple[str, str] | None) -> tuple[str, str] | None:
    if versus is None and {"obow_full", "moco_v2_our_aug"} <= set(slugs):
        return ("obow_full", "moco_v2_our_aug")
    return versus


def compare_budgets(records: list[dict[str, Any]], score: str = "knn", versus: tuple[str, str] | None = None) -> str:
    """One table measured at several ``--minutes`` budgets (its ``table.json`` records, each from its own
    ``--out``): every row's gain over the random init of the same seed (mean ± sample deviation over the seeds
    measured at every budget) at each budget, and for the pair ``versus`` (row labels or slugs; default OBoW (full)
    against MoCo v2 (our aug.) when the table has both) the gap per budget and where it would cross zero
    (:func:`obow.experiments.budget.crossing_budget`). Within one run the curve cannot answer that question:
    every run's learning-rate cosine ends at its own budget."""
    from obow.experiments.budget import crossing_budget

    if not records:
        raise ValueError("no tables to compare: give the table.json of each budget")
    first = records[0]
    for r in records:
        if "minutes" not in r["budget"]:
            raise ValueError(f"table {r['table']} was planned in epochs ({r['budget']}); compare --minutes tables")
        for key in ("table", "recipe", "train_images", "test_images", "overrides"):
            if r.get(key) != first.get(key):
                raise ValueError(f"tables differ in {key}: {first.get(key)!r} and {r.get(key)!r}; compare one table")
    _check_score(first, score)
    records = sorted(records, key=lambda r: r["budget"]["minutes"])
    minutes = [r["budget"]["minutes"] for r in records]
    if len(set(minutes)) != len(minutes):
        raise ValueError(f"two tables at the same budget ({minutes} minutes); give one table per budget")

    # seeds measured at every budget (random init included): a trend read from different seeds at different
    # budgets would mix the seed spread into it
    shared_seeds = set.intersection(*({run["seed"] for run in r["random_init"]["runs"]} for r in records))
    if not shared_seeds:
        raise ValueError("no seed has a random init row at every budget; run the same --seeds at each budget")

    slugs = list(dict.fromkeys(row["slug"] for r in records for row in r["rows"]))
    labels = {row["slug"]: row["label"] for r in records for row in r["rows"]}
    head = " | ".join(f"{m:g} min" for m in minutes)
    lines = [
        f"### {first['title']}: {score} gain over random init against budget",
        "",
        f"Recipe `{first['recipe']}`, {first['train_images']} training images; each cell: mean ± sample deviation "
        "over seeds of (row - random init of the same seed), number of seeds in brackets; only the seeds measured "
        f"at every budget count ({', '.join(map(str, sorted(shared_seeds)))}).",
        "",
        f"| row | {head} |",
        "|---|" + "---|" * len(minutes),
    ]
    for slug in slugs:
        cells = []
        for r in records:
            row = _find_row(r, slug)
            gains = _paired(_by_seed(row, score, shared_seeds), _by_seed(r["random_init"], score, shared_seeds))
            cells.append("-" if row is None else _signed_cell(gains))
        lines.append(f"| {labels[slug]} | {' | '.join(cells)} |")
    versus = _default_versus(slugs, versus)
    if versus is not None:
        a_name, b_name = versus
        gaps, at = [], []
        row_cells = []
        for r, m in zip(records, minutes, strict=True):
            values = _paired(
                _by_seed(_find_row(r, a_name), score, shared_seeds), _by_seed(_find_row(r, b_name), score, shared_seeds)
            )
            row_cells.append(_signed_cell(values))
            if values:
                gaps.append(statistics.fmean(values))
                at.append(m)
        a_label = next((labels[s] for s in slugs if a_name in (s, labels[s])), a_name)
        b_label = next((labels[s] for s in slugs if b_name in (s, labels[s])), b_name)
        lines.append(f"| gap: {a_label} - {b_label} | {' | '.join(row_cells)} |")
        lines.append("")
        if gaps:
            lines.append(crossing_budget(at, gaps).describe(a_label, b_label) + ".")
        else:
            lines.append(f"{a_label} and {b_label} were not both measured at any budget.")
    return "\n".join(lines) + "\n"


def compare_levers(records: list[dict[str, Any]], score: str = "knn", versus: tuple[str, str] | None = None) -> str:
    """One table at one budget, run as it is (``records[0]``, the base) and with levers (each later record: the
    same table, recipe, images and budget with other ``key=value`` changes for every row, each its own
    ``--out``). Per row and table: the score (mean ± sample deviation over seeds), and for a lever its change
    against the base *of the same seed*; then the gap between the rows ``versus`` (default OBoW (full) against
    MoCo v2 (our aug.)) in each table and its change against the base's gap; for a lever run on one of the two
    rows only, also that row against the other as the base ran it (seed by seed): the method at its lever
    against its rival as it is. A lever is tried on every row, so that whatever helps one method is given to
    the other too."""
    if len(records) < 2:
        raise ValueError("give the base table first and at least one lever table (each a table.json or its folder)")
    base = records[0]
    for r in records[1:]:
        for key in ("table", "recipe", "train_images", "test_images", "budget"):
            if r.get(key) != base.get(key):
                raise ValueError(
                    f"tables differ in {key}: {base.get(key)!r} and {r.get(key)!r}; a lever changes only key=value "
                    "settings (run it with the base's command and budget)"
                )
        if sorted(r.get("overrides", [])) == sorted(base.get("overrides", [])):
            raise ValueError(f"a lever table has the base's own settings {base.get('overrides', [])}: nothing changed")
    _check_score(base, score)

    def changes(r: dict[str, Any]) -> str:
        extra = [o for o in r.get("overrides", []) if o not in base.get("overrides", [])]
        gone = [o for o in base.get("overrides", []) if o not in r.get("overrides", [])]
        return ", ".join([*(f"`{o}`" for o in extra), *(f"without `{o}`" for o in gone)])

    def describe(values: dict[int, float], base_values: dict[int, float] | None) -> str:
        text = _signed_cell(list(values.values()), signed=False)
        if base_values is not None and values:
            text += f"; {_signed_cell(_paired(values, base_values))} vs base"
        return text

    slugs = ["random_init", *dict.fromkeys(row["slug"] for r in records for row in r["rows"])]
    labels = {"random_init": base["random_init"]["label"]}
    labels |= {row["slug"]: row["label"] for r in records for row in r["rows"]}
    base_name = ", ".join(f"`{o}`" for o in base.get("overrides", [])) or "the recipe as it is"
    budget = (
        f"{base['budget']['minutes']:g} minutes"
        if "minutes" in base["budget"]
        else f"{base['budget']['epochs']} epochs"
    )
    lines = [
        f"### {base['title']}: {score} with levers, {budget} per row and seed",
        "",
        f"Recipe `{base['recipe']}`, {base['train_images']} training images. Each cell: {score} mean ± sample "
        "deviation (seeds); for a lever, then its change against the base table's same row and seed (mean ± "
        "deviation over the seeds both measured). Base: " + base_name + ".",
        "",
        "| row | base | " + " | ".join(changes(r) for r in records[1:]) + " |",
        "|---|---|" + "---|" * (len(records) - 1),
    ]
    for slug in slugs:
        base_values = _by_seed(_find_row(base, slug), score)
        cells = [describe(base_values, None)]
        cells += [describe(_by_seed(_find_row(r, slug), score), base_values) for r in records[1:]]
        if any(c != "-" for c in cells):
            lines.append(f"| {labels[slug]} | {' | '.join(cells)} |")
    versus = _default_versus(slugs, versus)
    if versus is not None:
        a_name, b_name = versus

        def gaps(r: dict[str, Any], r_b: dict[str, Any] | None = None) -> dict[int, float]:
            """Seed by seed, row ``a_name`` of ``r`` minus row ``b_name`` of ``r_b`` (default ``r``)."""
            a, b = _by_seed(_find_row(r, a_name), score), _by_seed(_find_row(r if r_b is None else r_b, b_name), score)
            return {s: a[s] - b[s] for s in a if s in b}

        base_gaps = gaps(base)
        cells = [_signed_cell(list(base_gaps.values()))]
        for r in records[1:]:
            lever_gaps = gaps(r)
            cell = _signed_cell(list(lever_gaps.values()))
            if lever_gaps and base_gaps:
                cell += f"; {_signed_cell(_paired(lever_gaps, base_gaps))} vs base"
            cells.append(cell)
        a_label, b_label = labels.get(a_name, a_name), labels.get(b_name, b_name)
        lines.append(f"| gap: {a_label} - {b_label} | {' | '.join(cells)} |")

        def mixed(r: dict[str, Any]) -> str:
            """A lever given to one of the two rows only, against the other row as the base ran it."""
            has_a, has_b = bool(_by_seed(_find_row(r, a_name), score)), bool(_by_seed(_find_row(r, b_name), score))
            if has_a == has_b:
                return "-"
            return _signed_cell(list(gaps(r if has_a else base, r if has_b else base).values()))

        cells = [mixed(r) for r in records[1:]]
        if any(c != "-" for c in cells):
            lines.append(
                f"| gap, the row a lever lacks as in the base: {a_label} - {b_label} | - | {' | '.join(cells)} |"
            )
    return "\n".join(lines) + "\n"
