"""The paper's tables as data: each :class:`Table` is a list of :class:`Row` s, each row the base recipe's
changes (``key=value`` items, with ``{placeholders}`` filled from the base recipe by :func:`fill_placeholders`)
and the paper's numbers beside which it is shown."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

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


def fill_placeholders(overrides: tuple[str, ...], values: dict[str, Any]) -> list[str]:
    return [item.format(**values) if "{" in item else item for item in overrides]


def placeholders(base: Any, train_images: int) -> dict[str, Any]:
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
    out: list[Row] = []
    for item in wanted:
        match = [r for i, r in enumerate(table.rows, start=1) if item in (r.label, r.slug, str(i))]
        if not match:
            choices = ", ".join(f"{i} ({r.slug})" for i, r in enumerate(table.rows, start=1))
            raise ValueError(f"{table.name} has no row {item!r}; rows: {choices}")
        out.extend(m for m in match if m not in out)
    return out
