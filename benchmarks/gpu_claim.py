"""The paper's central claim in one GPU call (issue 55; :mod:`obow.experiments.claim`): OBoW (full) against MoCo v2
with the same augmentations on all of CIFAR-10, both rows side by side on one GPU, one seed a call, the epochs
chosen on the machine, every measurement copied out as it grows.

    python3 benchmarks/gpu_claim.py run --data C10 --out OUT [--deadline 540] [--seed 0] [--recipe auto] [--step auto]
    python3 benchmarks/gpu_claim.py merge OUT docs/results/tables/cifar10-mocov2-gpu

``docs/results/tables/cifar10-mocov2-gpu/gpu.sh`` is the device call's one command (it unpacks CIFAR-10, then calls
``run``; the folder's README.md says the steps and why the estimates' values). What is here is what a single
time-limited call needs, against one clock (``--t0``, the call's start; all ends ``--deadline`` seconds after it):
the probe of the candidates, both rows side by side (:func:`probe`, :mod:`obow.experiments.tables.probe`), for
``--step auto`` the graphed step where CUDA runs, then the eager one, the faster kept, for ``--recipe auto``
``cifar10_resnet18`` when ``--min-epochs`` fit, else ``cifar10_fast``; the epochs that fit in the time left
(:func:`estimate_for`, :func:`obow.experiments.budget.choose_epochs`); ``obow tables run mocov2 --rows 2 4 --seeds
SEED --jobs 2 --budget EPOCHS --curve-every max(1, EPOCHS // 10) --random-init last`` stopped by SIGTERM
``--stop-s`` seconds before the deadline; the live copies into OUT (:class:`LiveCopy`: the rows' ``log.jsonl``,
``table.json``, ``table.md``, ``plan.json``, beside ``claim.json`` and ``summary.txt``: eight files at most, as a
device call returns); and ``merge``, which adds a returned OUT to the table folder seed by seed
(:func:`obow.experiments.tables.merge.merge_records`), with ``curves/``, ``calls/``, ``curves.md`` and the paired
verdict ``paired.md``. With ``--like FOLDER`` (a later seed) there is no probe: the recipe, epochs and changes are
the folder's; nor with ``--recipe``, ``--step`` and ``--epochs`` all given. ``--resume`` lets ``--runs`` hold an earlier
call's rows, which resume from their checkpoints: a run longer than one call, continued by the next call on the
same (warm) machine. Tested on a CPU: ``tests/test_gpu_claim.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from obow.experiments import budget
from obow.experiments.claim import (
    RECIPES,
    ROWS,
    TABLE,
    Data,
    batch_size,
    build_image_cache,
    cuda_available,
    decode_seconds,
    find_data,
    like_folder,
    row_items,
    rows_of_table,
    step_accepted,
    table_overrides,
    verdict_text,
    warm_gpu,
)
from obow.experiments.tables.merge import curves_markdown, merge_records, read_curves
from obow.experiments.tables.probe import Probe, probe_rows, row_progress, stop_process
from obow.experiments.tables.records import machine_description

# ----------------------------------------------------------------------------------------------- the live copy


class LiveCopy(threading.Thread):
    """Copies files into a folder every ``every`` seconds while they change (``sources()``: ``{name in the folder:
    source path}``, asked again each time, so that files that appear later are found), and once more on
    :meth:`stop`. Each copy is written beside its name and renamed over it: a reader never sees half a file."""

    def __init__(self, out: Path, sources: Callable[[], dict[str, Path]], every: float = 5.0) -> None:
        super().__init__(daemon=True)
        self.out, self.sources, self.every = out, sources, every
        self.seen: dict[str, tuple[int, int]] = {}
        self.halt = threading.Event()
        self.lock = threading.Lock()

    def copy_now(self) -> list[str]:
        """Copy what changed since the last copy; returns the names copied."""
        copied = []
        with self.lock:
            for name, source in self.sources().items():
                try:
                    stat = source.stat()
                except OSError:
                    continue
                key = (stat.st_size, stat.st_mtime_ns)
                if self.seen.get(name) == key:
                    continue
                partial = self.out / f".{name}.partial"
                with contextlib.suppress(OSError):
                    shutil.copyfile(source, partial)
                    os.replace(partial, self.out / name)
                    self.seen[name] = key
                    copied.append(name)
        return copied

    def run(self) -> None:
        while not self.halt.wait(self.every):
            self.copy_now()

    def stop(self) -> None:
        self.halt.set()
        if self.is_alive():
            self.join()
        self.copy_now()


# ----------------------------------------------------------------------------------------------- the call


class Call:
    """One device call's state: its clock, OUT, its log, its ``claim.json``."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.t0 = args.t0 if args.t0 is not None else time.time()
        self.deadline_at = self.t0 + args.deadline
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.log_path = self.out / "all.log"
        self.summary_path = self.out / "summary.txt"
        self.claim: dict[str, Any] = {
            "issue": 55,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv),
            "settings": {k: v for k, v in vars(args).items() if k != "func"},
            "seed": args.seed,
            "deadline_s": args.deadline,
        }
        self.stopping: str | None = None  # a signal this process received
        self.protocols: dict[str, dict[str, Any]] = {}  # the protocol's timing, per recipe
        start = time.perf_counter()
        # what the table command imports before its work (timed for its start, budget.Estimate.start_s)
        import torch  # noqa: F401

        import obow.cli  # noqa: F401
        import obow.data.eval_sets  # noqa: F401
        import obow.experiments.tables  # noqa: F401
        import obow.training.loop  # noqa: F401

        self.import_s = time.perf_counter() - start

    def elapsed(self) -> float:
        return time.time() - self.t0

    def left(self) -> float:
        return self.deadline_at - time.time()

    def say(self, text: str) -> None:
        """One line to stdout, ``summary.txt`` and ``all.log``, with the seconds since the call's start."""
        line = f"[{self.elapsed():6.1f} s] {text}"
        print(line, flush=True)
        for path in (self.summary_path, self.log_path):
            with open(path, "a") as f:
                f.write(line + "\n")

    def save_claim(self) -> None:
        partial = self.out / ".claim.json.partial"
        partial.write_text(json.dumps(self.claim, indent=2, default=str))
        os.replace(partial, self.out / "claim.json")


def probe(call: Call, data: Data, recipe: str, step: str) -> Probe:
    """Both rows side by side (:func:`obow.experiments.tables.probe.probe_rows`), each ``obow pretrain`` with the
    call's settings on all the training images, until each has ``--probe-measure`` seconds timed after
    ``--warmup-steps`` (at most ``--probe-s`` seconds, and never past the deadline); said and kept in the claim."""
    from obow.training.run.threads import available_cores

    args = call.args
    why = step_accepted(recipe, step)
    if why is not None:
        call.say(f"probe {recipe} / step {step}: not tried, the configuration refuses it ({why})")
        return Probe(recipe, step, {}, error=f"refused by the configuration: {why}")
    overrides = table_overrides(recipe, step, args.batch, args.extra)
    rows, values = row_items(recipe, data, overrides)
    batch = batch_size(recipe, args.batch)
    threads = max(1, available_cores() // len(rows))
    call.say(f"probe {recipe} / step {step}: both rows started (batch {batch}, {threads} threads each)")
    result, took = probe_rows(
        rows, values, recipe, step, data.train, overrides, batch=batch, seed=args.seed, threads=threads,
        folder=Path(args.runs) / f"probe-{recipe}-{step}", warmup_steps=args.warmup_steps,
        measure_s=args.probe_measure, cap_s=min(args.probe_s, max(call.left() - args.stop_s, 1.0)),
        stopping=lambda: call.stopping is not None, log_path=call.log_path,
    )  # fmt: skip
    rates = ", ".join(
        f"{slug} {e['images_per_s']:.0f} images/s ({e['steps_per_s']:.2f} steps/s over {e['measured_s']:.1f} s)"
        for slug, e in result.rows.items()
        if "images_per_s" in e
    )
    failure = f"; {result.error}" if result.error else ""
    call.say(f"probe {recipe} / step {step} ({took:.0f} s): {rates or 'no rate'}{failure}")
    call.claim.setdefault("probes", []).append(dataclasses.asdict(result))
    call.save_claim()
    return result


def estimate_for(call: Call, data: Data, recipe: str, found: Probe, decode_s: float) -> budget.Estimate:
    """The :class:`~obow.experiments.budget.Estimate` for a table run of ``recipe`` at the pace ``found``: what is
    measured on this machine (the start: this process's imports, the images' listing, the probe's rows' start; the
    epoch ends; the decoding; the protocol's CPU work by :func:`~obow.experiments.budget.time_protocol`) and what is
    stated (``--table-start-s``, ``--monitor-pass-s``, ``--eval-start-s``, and ``--epoch-end-s`` when the probe saw
    no epoch end; docs/results/tables/cifar10-mocov2-gpu/README.md says why these values)."""
    from obow.data.folders import decoding_workers
    from obow.training.run.threads import available_cores

    args = call.args
    if recipe not in call.protocols:
        width = budget.feature_width(recipe)
        threads = max(1, available_cores() // 2)
        call.protocols[recipe] = {"width": width, "threads": threads}
        call.protocols[recipe].update(budget.time_protocol(width, data.train_images, data.test_images, threads))
        timed = call.protocols[recipe]
        call.say(
            f"evaluation protocol ({width}-d features, {threads} threads), timed on random features: linear "
            f"{timed['linear_s']:.1f} s, kNN {timed['knn_s']:.1f} s, few-shot {timed['fewshot_s']:.1f} s, "
            f"diagnostics {timed['diagnostics_s']:.1f} s"
        )
        call.claim["protocol_timing"] = call.protocols
    images = data.train_images + data.test_images
    # decoded by one loader worker per core (decoding_workers), the two rows side by side sharing the cores
    decode_pass_s = images * decode_s / max(1.0, decoding_workers(images, 1) / 2)
    epoch_end = found.epoch_end_s if found.epoch_end_s is not None else args.epoch_end_s
    return budget.Estimate(
        # the table command imports torch and obow as this process did, lists the images, plans and starts its rows,
        # which start as the probe's did
        start_s=args.table_start_s + call.import_s + data.scan_s + (found.start_s or 0.0),
        epoch_end_s=epoch_end,
        # its first pass starts the recipe's loader workers (imports, as this process's) and decodes every image
        monitor_first_s=call.import_s + decode_pass_s + args.monitor_pass_s,
        monitor_pass_s=args.monitor_pass_s,
        eval_s=args.eval_start_s + decode_pass_s + args.monitor_pass_s + call.protocols[recipe]["total_s"],
        margin_s=args.margin_s,
        curve_every=args.curve_every,
    )


def choose(call: Call, data: Data, decode_s: float) -> tuple[str, str, budget.Choice, budget.Estimate, Probe] | None:
    """Probe the candidates (see the module's docstring) and choose the recipe, the step and the epochs. The first
    recipe probes every step asked and keeps the faster that works; a later one probes that step first, and the
    others only if it fails there."""
    args = call.args
    recipes = list(RECIPES) if args.recipe == "auto" else [args.recipe]
    steps = [args.step]
    if args.step == "auto":
        steps = ["graph", "off"] if cuda_available() else ["off"]
        if steps == ["off"]:
            call.say("step graph: not tried, CUDA graphs need a CUDA device (it would run the eager step)")
    preferred, decided = None, None
    for recipe in recipes:
        order = steps if preferred is None else [preferred, *(s for s in steps if s != preferred)]
        working = []
        for step in order:
            if call.stopping:
                return None
            found = probe(call, data, recipe, step)
            if found.ok:
                working.append(found)
                if preferred is not None:
                    break
        if not working:
            continue
        best = min(working, key=lambda p: p.seconds_per_step)
        preferred = best.step
        steps_per_epoch = data.train_images // batch_size(recipe, args.batch)
        estimate = estimate_for(call, data, recipe, best, decode_s)
        choice = budget.choose_epochs(call.left(), estimate, steps_per_epoch, best.seconds_per_step, args.min_epochs)
        call.say(f"{recipe} / step {best.step}: {choice.text}")
        decided = (recipe, best.step, choice, estimate, best)
        if choice.fits:
            break
    return decided


def table_sources(runs: Path, seed: int) -> dict[str, Path]:
    """What the live copy takes from the table folder ``runs/mocov2``: the rows' logs and the table's files."""
    folder = runs / TABLE
    found = {name: folder / name for name in ("table.json", "table.md", "plan.json")}
    for row in rows_of_table():
        found[f"{row.slug}-seed{seed}.log.jsonl"] = folder / row.slug / f"seed{seed}" / "log.jsonl"
    return found


def run_table_call(call: Call, data: Data, recipe: str, step: str, epochs: int, overrides: list[str]) -> int | None:
    """``obow tables run`` for the call's rows and seed, copied out as it grows, stopped before the deadline."""
    args = call.args
    runs = Path(args.runs)
    command = [
        sys.executable, "-m", "obow", "tables", "run", TABLE, "--data", str(data.root), "--budget", str(epochs),
        "--recipe", recipe, "--out", str(runs), "--rows", *ROWS, "--seeds", str(args.seed), "--jobs", "2",
        "--curve-every", str(budget.curve_every(epochs, args.curve_every)), "--random-init", "last", *overrides,
    ]  # fmt: skip
    call.claim["table_command"] = " ".join(command)
    call.claim["run"] = {"started_s": round(call.elapsed(), 1)}
    call.save_claim()
    every = budget.curve_every(epochs, args.curve_every)
    call.say(f"table: {epochs} epochs a row, kNN every {every}: {' '.join(command[2:])}")
    copier = LiveCopy(call.out, lambda: table_sources(runs, args.seed), args.copy_every)
    with open(call.log_path, "a") as log:
        log.write("===== obow tables run\n")
        log.flush()
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    copier.start()
    cut = None
    last_note = time.monotonic()
    while process.poll() is None:
        if call.stopping:
            cut = f"{call.stopping} received"
        elif call.left() <= args.stop_s:
            cut = f"the deadline ({args.deadline} s) less {args.stop_s:g} s"
        if cut:
            call.say(f"table: stopped ({cut}): SIGTERM, each run writes its checkpoint")
            stop_process(process, max(args.stop_s - 5, 2.0))
            break
        if time.monotonic() - last_note >= args.copy_every:
            call.claim["rows"] = row_progress(runs / TABLE, rows_of_table(), args.seed)
            call.claim["run"]["elapsed_s"] = round(call.elapsed(), 1)
            call.save_claim()
            last_note = time.monotonic()
        time.sleep(0.5)
    copier.stop()
    code = process.poll()
    call.claim["rows"] = row_progress(runs / TABLE, rows_of_table(), args.seed)
    call.claim["run"].update({"ended_s": round(call.elapsed(), 1), "exit_code": code, "cut": cut})
    call.save_claim()
    done = ", ".join(f"{slug} {e['epochs_done']} epochs" for slug, e in call.claim["rows"].items())
    how = f"exit code {code}" + (f", cut: {cut}" if cut else "")
    call.say(f"table: ended ({how}); {done}; in OUT: {', '.join(sorted(copier.seen))}")
    return code


def cmd_run(args: argparse.Namespace) -> int:
    runs = Path(args.runs)
    planned = args.like is None and args.epochs > 0 and "auto" not in (args.recipe, args.step)
    if args.resume and not (planned or args.like):
        raise SystemExit("--resume continues an earlier call's rows: give their --recipe, --step and --epochs")
    if runs.exists() and any(runs.iterdir()) and not args.resume:
        raise SystemExit(f"{runs} holds an earlier call's files: give another --runs, or --resume to continue them")
    call = Call(args)

    def received(signum: int, frame: Any) -> None:
        call.stopping = signal.Signals(signum).name

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, received)
    runs.mkdir(parents=True, exist_ok=True)
    call.claim["machine"] = machine = machine_description()
    call.say(f"machine: {machine}; deadline {args.deadline} s, seed {args.seed}; imports {call.import_s:.1f} s")
    try:
        data = find_data(Path(args.data))
    except ValueError as err:
        raise SystemExit(str(err)) from None
    call.claim["data"] = dataclasses.asdict(data)
    call.say(f"data: {data.train_images} training and {data.test_images} test images under {data.root}")
    first_recipe = RECIPES[0] if args.recipe == "auto" else args.recipe
    described, built = build_image_cache(data, first_recipe)
    call.say(f"image cache: {described} ({built:.1f} s)")
    decode_s, n = decode_seconds(data, first_recipe, args.decode_sample)
    call.say(f"evaluation decoding: {decode_s * 1e3:.3f} ms an image ({n} test images, one at a time)")
    call.claim["images"] = {"cache_s": round(built, 2), "decode_ms_per_image": round(decode_s * 1e3, 4)}
    if (warmed := warm_gpu()) is not None:
        call.say(warmed)
    if args.like is not None:
        try:
            recipe, epochs, overrides, earlier = like_folder(Path(args.like), args.seed)
        except ValueError as err:
            raise SystemExit(str(err)) from None
        for line in earlier:
            call.say(line)
        step = next((o.split("=", 1)[1] for o in overrides if o.startswith("train.compile=")), "off")
        call.say(f"--like {args.like}: {recipe}, {epochs} epochs, its changes {' '.join(overrides)} (no probe)")
        call.claim["choice"] = {"recipe": recipe, "step": step, "epochs": epochs, "like": args.like}
    elif planned:
        recipe, step, epochs = args.recipe, args.step, args.epochs
        resumed = (runs / TABLE).is_dir()
        call.say(
            f"{recipe}, step {step}, {epochs} epochs given: no probe"
            + ("; the rows in --runs resume from their checkpoints" if resumed else "")
        )
        call.claim["choice"] = {"recipe": recipe, "step": step, "epochs": epochs, "planned": True, "resumed": resumed}
        overrides = table_overrides(recipe, step, args.batch, args.extra)
    else:
        decided = choose(call, data, decode_s)
        if decided is None:
            why = f"{call.stopping} received" if call.stopping else "no candidate ran (their output is in all.log)"
            call.say(f"{why}: nothing trained")
            call.save_claim()
            return 1
        recipe, step, choice, estimate, found = decided
        epochs = args.epochs or choice.epochs
        if args.epochs:
            call.say(f"--epochs {args.epochs} given: the choice ({choice.epochs}) is not used")
        call.claim["choice"] = {
            "recipe": recipe,
            "step": step,
            "epochs": epochs,
            "chosen_epochs": choice.epochs,
            "fits_min_epochs": choice.fits,
            "min_epochs": args.min_epochs,
            "text": choice.text,
            "estimate": dataclasses.asdict(estimate),
            "estimated_total_s": round(choice.total_s, 1),
            "seconds_per_step": found.seconds_per_step,
            "left_at_choice_s": round(call.left(), 1),
        }
        if epochs < 1:
            call.save_claim()
            return 1
        overrides = table_overrides(recipe, step, args.batch, args.extra)
    call.claim["overrides"] = overrides
    call.save_claim()
    code = run_table_call(call, data, recipe, step, epochs, overrides)
    call.say(f"total {call.elapsed():.0f} s")
    call.save_claim()
    return 0 if code == 0 else 1


# ----------------------------------------------------------------------------------------------- merging


def cmd_merge(args: argparse.Namespace) -> int:
    from obow.experiments.tables import TABLES, markdown

    source, folder = Path(args.source), Path(args.folder)
    if not (source / "table.json").is_file():
        raise SystemExit(
            f"{source} holds no table.json: that call evaluated nothing (its curves, if any, are the "
            "*-seed*.log.jsonl files there); nothing merged"
        )
    new = json.loads((source / "table.json").read_text())
    claim = json.loads((source / "claim.json").read_text()) if (source / "claim.json").is_file() else {}
    seeds = new["seeds"]
    folder.mkdir(parents=True, exist_ok=True)
    old_path = folder / "table.json"
    try:
        record = merge_records(json.loads(old_path.read_text()), new) if old_path.is_file() else new
    except ValueError as err:
        raise SystemExit(f"{source} not merged into {folder}: {err}") from None
    (folder / "curves").mkdir(exist_ok=True)
    for path in source.glob("*-seed*.log.jsonl"):
        shutil.copyfile(path, folder / "curves" / path.name)
    (folder / "calls").mkdir(exist_ok=True)
    tag = "seed" + "-".join(map(str, seeds))
    for name in ("claim.json", "summary.txt"):
        if (source / name).is_file():
            shutil.copyfile(source / name, folder / "calls" / f"{tag}-{name}")
    partial = folder / ".table.json.partial"
    partial.write_text(json.dumps(record, indent=2))
    os.replace(partial, old_path)
    (folder / "plan.json").write_text(json.dumps(record["plan"], indent=2))
    (folder / "table.md").write_text(markdown(record, TABLES[TABLE].columns))
    (folder / "curves.md").write_text(curves_markdown(read_curves(folder, TABLE)))
    (folder / "paired.md").write_text(verdict_text(record))
    epochs = claim.get("choice", {}).get("epochs", record["budget"].get("epochs"))
    print(f"merged seed(s) {seeds} ({epochs} epochs) into {folder}: table.json, table.md, plan.json, curves/, calls/, "
          f"curves.md, paired.md; seeds there now: {record['seeds']}")  # fmt: skip
    print((folder / "paired.md").read_text())
    return 0


# ----------------------------------------------------------------------------------------------- the command


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(required=True)
    r = sub.add_parser("run", help="one device call: probe, choose the epochs, train both rows, copy out")
    r.add_argument("--data", required=True, help="CIFAR-10 as train/ and test/ class folders")
    r.add_argument("--out", required=True, help="the call's output folder (what a device call returns)")
    r.add_argument("--runs", required=True, help="where the runs and checkpoints go (stays on the machine)")
    r.add_argument("--t0", type=float, help="the call's start (seconds since the epoch; default: now)")
    r.add_argument("--deadline", type=float, default=540, help="seconds after --t0 by which all is done")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--recipe", default="auto", help="auto: cifar10_resnet18 when --min-epochs fit, else cifar10_fast")
    r.add_argument("--step", default="auto", help="train.compile: auto (graph if it works and is faster, else off)")
    r.add_argument("--batch", type=int, default=512, help="every row's batch (0: the recipe's); lr scaled linearly")
    r.add_argument("--min-epochs", type=int, default=50)
    r.add_argument("--epochs", type=int, default=0, help="train this many epochs whatever fits (a dry run's cut)")
    r.add_argument("--curve-every", type=int, default=0, help="epochs between two kNN points (0: a tenth of the run)")
    r.add_argument("--like", help="a table folder: a later seed with its recipe, epochs and changes (no probe)")
    r.add_argument(
        "--resume", action="store_true",
        help="--runs holds an earlier call's rows (same seed, recipe, step, epochs): they go on from their checkpoints",
    )  # fmt: skip
    r.add_argument("--extra", nargs="*", default=[], help="more key=value changes for every row")
    r.add_argument("--probe-s", type=float, default=40, help="the longest a probe may take")
    r.add_argument("--probe-measure", type=float, default=12, help="seconds of steps a probe times after warm-up")
    r.add_argument("--warmup-steps", type=int, default=20, help="steps a probe leaves out before timing")
    r.add_argument("--decode-sample", type=int, default=2000, help="test images timed for the evaluation's decoding")
    r.add_argument("--table-start-s", type=float, default=5, help="estimate: the table command's plan and spawns")
    r.add_argument("--epoch-end-s", type=float, default=1.0, help="estimate of an epoch's end when the probe saw none")
    r.add_argument("--monitor-pass-s", type=float, default=1.5, help="estimate: a kNN monitor pass after the first")
    r.add_argument("--eval-start-s", type=float, default=10, help="estimate: an evaluation's loading")
    r.add_argument("--margin-s", type=float, default=30, help="kept free: stopping, the last copies, slack")
    r.add_argument("--stop-s", type=float, default=20, help="SIGTERM to the table this long before the deadline")
    r.add_argument("--copy-every", type=float, default=5, help="seconds between two live copies")
    r.set_defaults(func=cmd_run)
    m = sub.add_parser("merge", help="add a returned OUT to a table folder, with the curves and the paired verdict")
    m.add_argument("source", help="a call's returned OUT")
    m.add_argument("folder", help="the table folder, e.g. docs/results/tables/cifar10-mocov2-gpu")
    m.set_defaults(func=cmd_merge)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "batch", None) == 0:
        args.batch = None
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
