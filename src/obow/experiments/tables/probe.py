"""A table's rows timed side by side, as a call with a deadline times them before it chooses its epochs
(``benchmarks/gpu_claim.py``): each row a plain ``obow pretrain`` in its own process, all at once on the same
machine (on a GPU they share it, as the table's ``--jobs`` rows will), stopped once each has enough steps timed
after its warm-up; their pace read from their ``log.jsonl`` (:func:`obow.experiments.budget.fit_intervals`).
:func:`row_progress` reads how far each row of a table run has come while it trains.

Unlike :func:`obow.experiments.budget.seconds_per_step` (the configs in turns, in one process: what one run a
step costs alone), the rows here run together, so the pace is that of the table run with its rows in parallel.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from obow.experiments.budget import Fit, fit_intervals, intervals, read_records
from obow.experiments.tables.catalog import Row, fill_placeholders

__all__ = ["Probe", "probe_rows", "row_progress", "stop_process"]

#: The probe's rows train for this many epochs (their schedule only; they are stopped long before).
PROBE_EPOCHS = 1000


@dataclass
class Probe:
    recipe: str
    step: str
    rows: dict[str, dict[str, Any]]
    seconds_per_step: float | None = None  # the slower row's
    epoch_end_s: float | None = None
    start_s: float | None = None  # launch to the first step, the slower row
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.seconds_per_step is not None


def stop_process(process: subprocess.Popen, wait_s: float) -> int | None:
    """SIGTERM to ``process`` (it finishes its step and writes its checkpoint), then SIGKILL to its whole process
    group after ``wait_s`` seconds; its exit code (``None`` if it outlived both)."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(max(wait_s, 0.1))
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)  # its children too (a table's row processes)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(5)
    return process.poll()


def probe_rows(
    rows: list[Row],
    values: dict[str, Any],
    recipe: str,
    step: str,
    train: Path,
    overrides: list[str],
    *,
    batch: int,
    seed: int,
    threads: int,
    folder: Path,
    warmup_steps: int,
    measure_s: float,
    cap_s: float,
    stopping: Callable[[], bool],
    log_path: Path,
) -> tuple[Probe, float]:
    """``rows`` of a table side by side, each ``obow pretrain --config recipe --data train`` with ``overrides``
    (the table's changes, then the row's own, ``values`` filling its placeholders), in ``folder``, until each has
    ``measure_s`` seconds timed after ``warmup_steps`` steps, for at most ``cap_s`` seconds, or until one stops by
    itself or ``stopping()``; each row's output is appended to ``log_path``. The :class:`Probe` (its pace: the
    slower row's) and the seconds it took."""
    processes, logs, outputs = {}, {}, {}
    start = time.monotonic()
    for row in rows:
        run = folder / row.slug
        run.mkdir(parents=True, exist_ok=True)
        items = [
            *overrides,
            "train.progress_bar=false",
            "train.knn_every=0",
            f"train.seed={seed}",
            f"train.threads={threads}",
            *fill_placeholders(row.overrides, values),
            f"optim.epochs={PROBE_EPOCHS}",
        ]
        command = [sys.executable, "-m", "obow", "pretrain", "--config", recipe, "--data", str(train)]
        outputs[row.slug] = open(run.parent / f"{row.slug}.out", "w")  # noqa: SIM115 - closed below
        processes[row.slug] = subprocess.Popen(
            [*command, "--out", str(run), *items], stdout=outputs[row.slug], stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        logs[row.slug] = run / "log.jsonl"
    first: dict[str, float] = {}
    first_steps: dict[str, int] = {}
    fits: dict[str, Fit | None] = {}
    failed = None
    while True:
        waited = time.monotonic() - start
        for slug, path in logs.items():
            records = read_records(path)
            if records and slug not in first:  # its first logged step: when, and after how many steps
                first[slug] = waited
                first_steps[slug] = records[0].get("iteration", 0)
            fits[slug] = fit_intervals(intervals(records, batch), warmup_steps)
        if all(f is not None and f.measured_s >= measure_s for f in fits.values()):
            break
        failed = next((slug for slug, p in processes.items() if p.poll() is not None), None)
        if failed is not None or waited >= cap_s or stopping():
            break
        time.sleep(0.5)
    codes = {slug: stop_process(p, 1.0) for slug, p in processes.items()}  # no checkpoint needed
    for handle in outputs.values():
        handle.close()
    result = Probe(recipe, step, {})
    for row in rows:
        fit, output = fits.get(row.slug), folder / f"{row.slug}.out"
        entry: dict[str, Any] = {"first_log_s": first.get(row.slug), "exit_code": codes[row.slug]}
        if fit is not None:
            entry.update(dataclasses.asdict(fit))
            entry["steps_per_s"] = 1 / fit.seconds_per_step
            entry["images_per_s"] = batch / fit.seconds_per_step
        if row.slug == failed or fit is None:
            entry["output_tail"] = output.read_text()[-1500:] if output.exists() else ""
        with open(log_path, "a") as f:
            f.write(f"===== probe {recipe} / {step} / {row.slug}\n")
            f.write(output.read_text() if output.exists() else "(no output)\n")
        result.rows[row.slug] = entry
    took = time.monotonic() - start
    measured = [fits.get(row.slug) for row in rows]
    if failed is not None and any(f is None or f.measured_s < measure_s for f in measured):
        result.error = f"{failed} stopped by itself (exit code {codes[failed]}) before it was timed"
    elif any(f is None for f in measured):
        result.error = f"not every row logged a timed interval after {warmup_steps} steps in {took:.0f} s"
    else:
        timed = [f for f in measured if f is not None]
        result.seconds_per_step = max(f.seconds_per_step for f in timed)
        ends = [f.epoch_end_s for f in timed if f.epoch_end_s is not None]
        result.epoch_end_s = max(ends) if ends else None
        # the launch to the first timed step: the seconds to the first logged step, less its steps at the rate
        result.start_s = max(
            max(0.0, first[slug] - first_steps[slug] * fit.seconds_per_step)
            for slug in first
            if (fit := fits[slug]) is not None
        )
    return result, took


def row_progress(folder: Path, rows: list[Row], seed: int) -> dict[str, Any]:
    """How far each of ``rows`` of the table run in ``folder`` has come at ``seed``, from its ``log.jsonl``: its
    epochs done, its kNN points, its training and monitor seconds, its median images a second, the seconds of its
    evaluation once written, its configuration."""
    found = {}
    for row in rows:
        run = folder / row.slug / f"seed{seed}"
        records = read_records(run / "log.jsonl")
        epochs = [r for r in records if r.get("type") == "epoch"]
        curve = {r["epoch"]: r["knn_top1"] for r in epochs if "knn_top1" in r}
        rates = [r["images_per_s"] for r in records if r.get("type") is None and r.get("images_per_s")]
        entry: dict[str, Any] = {"epochs_done": epochs[-1]["epoch"] if epochs else 0, "knn_curve": curve}
        if epochs:
            entry["train_s"] = round(sum(r.get("epoch_time_s", 0.0) for r in epochs), 1)
            entry["monitor_s"] = round(sum(r.get("monitor_time_s", 0.0) for r in epochs), 1)
        if rates:
            entry["median_images_per_s"] = round(sorted(rates)[len(rates) // 2], 1)
        result, checkpoint = run / "result.json", run / "checkpoint.pt"
        if result.exists() and checkpoint.exists():
            entry["eval_s"] = round(result.stat().st_mtime - checkpoint.stat().st_mtime, 1)  # trained, then evaluated
        if (run / "config.yaml").exists():
            entry["config_yaml"] = (run / "config.yaml").read_text()
        found[row.slug] = entry
    return found
