"""Curves of pretraining runs (``obow show run``): one PNG, a grid of panels, the runs overlaid.

The input is each run's ``log.jsonl`` as :class:`obow.training.run.logger.RunLogger` writes it: one JSON object per
logged step (``iteration``, ``lr``, ``loss``, ``loss/group<g>/<level>``, ``<level>/...`` diagnostics, ``images_per_s``,
...) and one ``{"type": "epoch", ...}`` object per epoch (``knn_top1`` when the monitor ran). A panel is drawn
when some run logged its keys and left out otherwise, so older or newer logs with other keys still plot.
"""

from __future__ import annotations

import json
import math
import re
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from obow.files import writing
from obow.show import drawable


@dataclass
class RunLog:
    """The step and epoch records of one run."""

    name: str
    steps: list[dict]
    epochs: list[dict]


@dataclass
class Panel:
    """A subplot: its title, x axis and the ``(key, dashed)`` series it draws from step or epoch records."""

    title: str
    source: str  # "steps" or "epochs"
    series: list[tuple[str, bool]]


def find_log(run_dir: str | Path) -> Path:
    """The ``log.jsonl`` of a run folder; a folder that holds one run folder (``obow demo``'s ``runs/demo``, whose
    run is ``pretrain/``) stands for it."""
    folder = Path(run_dir)
    if (folder / "log.jsonl").is_file():
        return folder / "log.jsonl"
    inner = sorted(p for p in folder.glob("*/log.jsonl") if p.is_file()) if folder.is_dir() else []
    if len(inner) == 1:
        return inner[0]
    if inner:
        runs = ", ".join(str(p.parent) for p in inner)
        raise ValueError(f"{run_dir} holds several runs ({runs}): give the ones to draw")
    raise ValueError(f"{run_dir} has no log.jsonl: give the --out folder of an `obow pretrain` run (or `obow demo`)")


def read_run(run_dir: str | Path) -> RunLog:
    """A run folder's ``log.jsonl`` (:func:`find_log`; a line cut short by a kill is skipped)."""
    path = find_log(run_dir)
    steps, epochs = [], []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and record.get("type") == "epoch":
            epochs.append(record)
        elif isinstance(record, dict) and "type" not in record:  # step records; others (plan changes) aside
            steps.append(record)
    if not steps and not epochs:
        raise ValueError(f"{path} holds no records yet")
    return RunLog(drawable(Path(run_dir).resolve().name), steps, epochs)  # a name to draw


def _numeric_keys(records: list[dict]) -> list[str]:
    keys: dict[str, None] = {}
    for record in records:
        for key, value in record.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                keys.setdefault(key)
    return list(keys)


def _level_sort(keys: list[str]) -> list[str]:
    return sorted(keys, key=lambda k: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", k)])


def panels_for(runs: Sequence[RunLog]) -> list[Panel]:
    """The panels the runs' keys allow, in a fixed order; empty ones are left out."""
    step_keys = _numeric_keys([r for run in runs for r in run.steps])
    epoch_keys = _numeric_keys([r for run in runs for r in run.epochs])

    def ending(suffix: str, dashed: bool = False) -> list[tuple[str, bool]]:
        return [(k, dashed) for k in _level_sort([k for k in step_keys if k.endswith(suffix)])]

    losses = [(k, False) for k in _level_sort([k for k in step_keys if k.startswith("loss/")])]
    if not losses and "loss" in step_keys:
        losses = [("loss", False)]
    candidates = [
        Panel("loss per group and level (dashed: kl_to_mean_bow)", "steps", losses + ending("/kl_to_mean_bow", True)),
        Panel(
            "BoW perplexity (solid: batch, dashed: per image)",
            "steps",
            ending("/perplexity_batch") + ending("/perplexity_image", True),
        ),
        Panel(
            "spread of the student's predicted BoWs (solid: KL to their mean; dashed: the targets')",
            "steps",
            predicted + ending("/kl_to_mean_bow", True) if (predicted := ending("/predicted_kl_to_mean")) else [],
        ),
        Panel("mean cosine between the prediction weights", "steps", ending("/weights_mean_cosine")),
        Panel("share of words used", "steps", ending("/words_used")),
    ]
    for key in sorted(k for k in step_keys if k.startswith("student/")):
        candidates.append(Panel(key, "steps", [(key, False)]))
    candidates += [
        Panel("learning rate", "steps", [("lr", False)] if "lr" in step_keys else []),
        Panel("kNN top-1 per epoch (%)", "epochs", [("knn_top1", False)] if "knn_top1" in epoch_keys else []),
        Panel("images/s", "steps", [("images_per_s", False)] if "images_per_s" in step_keys else []),
    ]
    return [p for p in candidates if p.series]


#: The markers that tell a run's curves of one panel apart when several runs share the panel (a colour per run),
#: and about how many marks each curve carries.
CURVE_MARKERS = ("o", "s", "^", "v", "D", "x", "P", "*")
MARKS_PER_CURVE = 8

#: Characters of a panel title's line: longer titles wrap, so that each stays over its own panel.
TITLE_WIDTH = 52


def runs_figure(runs: Sequence[RunLog]):
    """The matplotlib figure of :func:`plot_runs`: the panels of ``runs`` on a grid of three columns."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = panels_for(runs)
    if not panels:
        raise ValueError(f"no known metric in the logs of {', '.join(run.name for run in runs)}")
    columns = min(3, len(panels))
    rows = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5.5 * columns, 3.6 * rows), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, panel in zip(axes.flat, panels, strict=False):
        for r, run in enumerate(runs):
            records = run.steps if panel.source == "steps" else run.epochs
            x_key = "iteration" if panel.source == "steps" else "epoch"
            for s, (key, dashed) in enumerate(panel.series):
                points = [(rec[x_key], rec[key]) for rec in records if key in rec and x_key in rec]
                if not points:
                    continue
                xs, ys = zip(*points, strict=True)
                style: dict[str, Any] = {"linestyle": "--" if dashed else "-", "marker": "." if len(xs) < 20 else None}
                if len(runs) > 1:  # a colour per run; within a run, a marker per curve; the legend names both
                    colour = colours[r % len(colours)]
                    label = f"{run.name}: {key}" if len(panel.series) > 1 else run.name
                    if len(panel.series) > 1:
                        style["marker"] = CURVE_MARKERS[s % len(CURVE_MARKERS)]
                        style["markevery"] = max(1, len(xs) // MARKS_PER_CURVE)
                else:
                    colour, label = colours[s % len(colours)], key
                ax.plot(xs, ys, color=colour, label=label, **style)
        ax.set_title(textwrap.fill(panel.title, TITLE_WIDTH), fontsize=10)
        ax.set_xlabel("iteration" if panel.source == "steps" else "epoch")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    names = ", ".join(run.name for run in runs)
    fig.suptitle(f"obow runs: {names}" if len(runs) > 1 else f"obow run: {names}")
    fig.tight_layout()
    return fig


def plot_runs(run_dirs: Sequence[str | Path], out: str | Path) -> Path:
    """Write the panels of one or more runs to the PNG ``out``; returns its path."""
    import matplotlib.pyplot as plt

    if not run_dirs:
        raise ValueError("give at least one run folder")
    fig = runs_figure([read_run(d) for d in run_dirs])
    out = Path(out)
    with writing(out):
        fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
