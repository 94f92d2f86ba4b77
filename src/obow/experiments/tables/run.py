"""Training and evaluating a table's rows and seeds (:func:`run_table`), in this process or in several
(:func:`run_in_processes`), and writing ``table.json`` / ``table.md`` after each finished run."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from obow.experiments.tables.catalog import TABLES, Row, fill_placeholders, placeholders, select_rows
from obow.experiments.tables.plan import (
    budget_plan,
    discard_plan,
    import_results,
    read_time_against,
    share_rows,
    table_pipeline,
    table_precision,
)
from obow.experiments.tables.records import (
    aggregate,
    finished_runs,
    machine_description,
    markdown,
    training_minutes,
    write_json,
)
from obow.files import writing
from obow.notices import route_warnings

log = logging.getLogger("obow")


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
    replan: bool = False,
    random_init: str = "first",
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
    machine's load on the day. ``replan`` discards the folder's ``plan.json`` first, while no row has trained
    there (a folder planned for a wrong budget; :func:`discard_plan`). ``random_init`` is ``"first"`` (each seed's
    random init evaluated before its rows: the reference comes early) or ``"last"`` (after every row of every
    seed: a call that may be stopped spends its time on the rows first; :func:`table_tasks`). ``jobs`` > 1 trains
    and evaluates that many row-seed runs at once, each in its own process with ``train.threads`` threads
    (unset: this process's cores divided by ``jobs``, or by the number of runs left if fewer)
    (:func:`run_in_processes`); the plan is made first, here."""
    from obow.config import load_config
    from obow.data.eval_sets import align_classes, eval_dataset
    from obow.data.folders import scan_images
    from obow.training.run.lock import RunLock
    from obow.training.run.threads import available_cores

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
    if random_init not in RANDOM_INIT_ORDERS:
        raise ValueError(f"--random-init must be one of {', '.join(RANDOM_INIT_ORDERS)}, got {random_init!r}")
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
    values = placeholders(base, len(train_images))
    protocol = {"k": k, "temperature": temperature, "episodes": episodes}
    folder = Path(out) / name
    chosen = select_rows(table, rows)
    check_stages(chosen, recipe, common, values, len(train_images), train_dir)  # before anything is written
    steps_per_epoch = len(train_images) // base.data.batch_size
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
        if replan:
            discard_plan(folder)
        sources = [results_from, shared_from, timing_from, time_against]
        precision = table_precision(folder, base.train.precision, device, sources)
        pipeline = table_pipeline(folder, base.data.pipeline, device, sources)
        # every run and timing of the table, whatever the recipe and the machine
        common = [*common, f"train.precision={precision}", f"data.pipeline={pipeline}"]
        if results_from is not None:
            import_results(Path(results_from), folder, expected, steps_per_epoch)
        anchor = None
        if shared_from is not None:
            same = {key: value for key, value in expected.items() if key != "table"}
            anchor = share_rows(Path(shared_from), folder, table, recipe, common, values, same, steps_per_epoch)
        against = None
        if time_against is not None:
            against = read_time_against(Path(time_against), recipe, with_changes, len(train_images), minutes)
        plan = budget_plan(
            folder, chosen, recipe, common, values, budget, minutes, steps_per_epoch, timing_from, anchor, against,
            precision, pipeline,
        )  # fmt: skip
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
                "random_init": aggregate("random init", "random_init", {}, finished_runs(folder / "random_init")),
                "rows": [],
            }
            for r in table.rows:  # rows of this call, and rows finished by earlier calls (--rows)
                runs = finished_runs(folder / r.slug)
                if runs:
                    record["rows"].append(aggregate(r.label, r.slug, r.paper, runs))
            found = {run["seed"] for r in (record["random_init"], *record["rows"]) for run in r["runs"]}
            record["seeds"] = sorted(found)
            record["continued_from"] = sorted(
                {run["from"] for r in (record["random_init"], *record["rows"]) for run in r["runs"] if "from" in run}
            )
            write_json(folder / "table.json", record)
            with writing(folder / "table.md") as path:
                path.write_text(markdown(record, table.columns))
            return record

        tasks = [task for task in table_tasks(chosen, seeds, random_init) if not task.result(folder).exists()]
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

        def done(task: Task) -> None:
            write_table()
            log.info("%s: %s done", name, task)

        if jobs == 1 or len(tasks) < 2:
            run_in_order(
                tasks,
                lambda task: _run_task(task, folder, recipe, common, values, plan, base, sets, device, protocol),
                done,
            )
        else:
            threads = base.train.threads or max(1, available_cores() // min(jobs, len(tasks)))
            job_common = [*common, f"train.threads={threads}"]
            run_in_processes(
                tasks,
                jobs,
                threads,
                lambda task: (task, folder, recipe, job_common, values, plan, base, sets, device, protocol),
                done,
            )
        record = write_table()
        return record


#: Where the random init's evaluations go among a table's tasks (``--random-init``).
RANDOM_INIT_ORDERS = ("first", "last")


def table_tasks(rows: list[Row], seeds: tuple[int, ...], random_init: str = "first") -> list[Task]:
    """The table's tasks in the order they start: seed by seed, the random init then the rows (``"first"``), or
    every row of every seed, then the random inits (``"last"``)."""
    if random_init == "first":
        return [Task(row, seed) for seed in seeds for row in (None, *rows)]
    return [Task(row, seed) for seed in seeds for row in rows] + [Task(None, seed) for seed in seeds]


def check_stages(
    rows: list[Row], recipe: str, common: list[str], values: dict[str, Any], train_images: int, train_dir: Path
) -> None:
    """A ``ValueError`` when a stage of ``rows`` could not train on ``train_images`` images (its batch larger
    than them), found before the table's folder, plan or any result is written: a corrected call then starts
    afresh instead of meeting a plan made for the failed one."""
    from obow.config import load_config

    for row in rows:
        for stage in row.plan():
            items = [*common, *fill_placeholders(stage.overrides, values)]
            cfg = load_config(recipe, items + (["bownet.teacher=unused-when-checking.pt"] if stage.teacher else []))
            if cfg.data.batch_size > train_images:
                which = f"{row.label!r}" + (f" ({stage.name})" if len(row.plan()) > 1 else "")
                raise ValueError(
                    f"row {which} trains with data.batch_size={cfg.data.batch_size}, more than the {train_images} "
                    f"training images under {train_dir} (after --per-class / data.images_per_class): give a "
                    f"smaller batch (e.g. data.batch_size={largest_batch(train_images)}) or more images; nothing "
                    "was written"
                )


def largest_batch(images: int) -> int:
    """A batch to suggest for ``images`` training images: the largest power of two that leaves at least two
    steps an epoch (one when there are fewer than two images)."""
    batch = 1
    while batch * 4 <= images:
        batch *= 2
    return batch


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
    write_json(result, {**done, "seed": task.seed, **_provenance(device)})


def _provenance(device: str) -> dict[str, str]:
    """Where a run trained and was evaluated: a table may be finished on several machines (``--results-from``),
    so each ``result.json`` names its own, and ``table.md`` lists the runs from a machine other than the
    table's."""
    return {"device": device, "machine": machine_description()}


def run_in_order(tasks: list[Task], body: Callable[[Task], Any], finished: Callable[[Task], Any]) -> None:
    """Run ``tasks`` one after another in this process, ``body(task)`` then ``finished(task)`` for each.

    While a run trains, SIGINT and SIGTERM belong to the training loop (it finishes the step, writes a checkpoint
    and raises :class:`~obow.training.loop.Interrupted`). Outside training (a row's evaluation, the random
    init's, writing the table, between two runs) a signal stops the table at once with
    :class:`~obow.training.loop.Interrupted`, and no later task starts: the finished tasks' results are kept, as
    is a trained row's complete checkpoint, which the same command then evaluates without training again."""
    from obow.training.loop import Interrupted
    from obow.training.run.signals import STOP_SIGNALS, nohup

    def stop(signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        log.warning("%s outside training: stopping now, no new task starts; finished results and checkpoints are "
                    "kept, the same command resumes", name)  # fmt: skip
        raise Interrupted(name)

    try:
        previous = {s: signal.signal(s, stop) for s in STOP_SIGNALS if not nohup(s)}
    except ValueError:  # not the main thread: leave signals alone
        previous = {}
    try:
        for task in tasks:
            body(task)
            finished(task)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _task_process(task_args: tuple, threads: int) -> None:
    """The body of one ``--jobs`` process: its own log prefix and threads, then :func:`_run_task`; a run stopped
    by a signal exits with the shell's code for it (``128 + signal``) after its checkpoint."""
    import torch

    from obow.training.cost import out_of_memory
    from obow.training.loop import Interrupted

    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s %(levelname)s [{task_args[0]}] %(message)s", datefmt="%H:%M:%S"
    )
    route_warnings()  # as in the obow command that started it
    torch.set_num_threads(threads)  # the evaluation's threads; training takes train.threads
    try:
        _run_task(*task_args)
    except Interrupted as err:
        sys.exit(err.exit_code)
    except (RuntimeError, MemoryError) as err:  # one line naming what to lower, not a traceback
        if (oom := out_of_memory(err, None)) is None:
            raise
        log.error("%s", oom)
        sys.exit(2)


def run_in_processes(
    tasks: list[Task],
    jobs: int,
    threads: int,
    arguments: Callable[[Task], tuple],
    finished: Callable[[Task], Any],
    target: Callable[[tuple, int], None] = _task_process,
) -> None:
    """Run ``tasks`` in order, at most ``jobs`` at a time, each in a fresh process (``spawn``) with ``threads``
    intra-op threads, calling ``finished(task)`` here after each one that wrote its result. SIGINT and SIGTERM
    received here are passed on to the running processes (which finish their step, write a checkpoint and stop;
    the terminal's Ctrl-C reaches them as well, and the two count as one request) and no task is started after
    them (a process that was starting when one arrived is sent it too); then
    :class:`~obow.training.loop.Interrupted` is raised. ``target(arguments(task), threads)`` is each process's
    body (:func:`_task_process`). A task that fails lets the running ones
    finish, starts no other, then raises ``RuntimeError`` naming it: nothing finished is lost, and the same
    command resumes."""
    import multiprocessing
    import multiprocessing.connection

    from obow.training.loop import Interrupted
    from obow.training.run.signals import STOP_SIGNALS, nohup

    context = multiprocessing.get_context("spawn")
    pending = list(tasks)
    running: dict[Any, tuple[Any, Task]] = {}  # a process's sentinel -> the process and its task
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
        previous = {s: signal.signal(s, forward) for s in STOP_SIGNALS if not nohup(s)}
    except ValueError:  # not the main thread: leave signals alone
        previous = {}
    try:
        while running or (pending and not received and not failed):
            while pending and not received and not failed and len(running) < jobs:
                task_args = arguments(pending[0])
                if received:  # the signal came while this task's arguments were built: it does not start
                    break
                task = pending.pop(0)
                process = context.Process(target=target, args=(task_args, threads), name=str(task))
                process.start()
                running[process.sentinel] = (process, task)
                log.info("started %s (process %d, %d thread(s))", task, process.pid, threads)
                if received and process.is_alive() and process.pid is not None:  # the signal came while it started
                    os.kill(process.pid, signal.Signals[received[0]])
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
    write_json(run / "result.json", {"seed": seed, "scores": scores, "steps": 0, "minutes": 0.0, **_provenance(device)})


def _scores(network: Any, sets: tuple, device: str, protocol: dict) -> dict[str, Any]:
    from obow.evaluate.protocol import evaluate_backbone
    from obow.weights.load import load_backbone

    if isinstance(network, (str, Path)):
        network, _ = load_backbone(network)
    return evaluate_backbone(network, *sets, device=device, **protocol)


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
            *fill_placeholders(stage.overrides, values),
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


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
