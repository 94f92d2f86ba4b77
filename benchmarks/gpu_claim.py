"""The paper's central claim in one GPU call (issue 55): OBoW (full) against MoCo v2 with the same augmentations
(rows 2 and 4 of ``obow tables mocov2``; the paper: 50.89 against 43.13 linear) on all of CIFAR-10, both rows side
by side on one GPU, one seed a call, the epochs chosen on the machine, every measurement copied out as it grows.

    python3 benchmarks/gpu_claim.py run --data C10 --out OUT [--deadline 540] [--seed 0] [--recipe auto] [--step auto]
    python3 benchmarks/gpu_claim.py merge OUT docs/results/tables/cifar10-mocov2-gpu

``docs/results/tables/cifar10-mocov2-gpu/gpu.sh`` is the device call's one command (it unpacks CIFAR-10, then calls
``run``); the logic is here, where it is tested on a CPU (``tests/test_gpu_claim.py``). ``run``, against one clock
(``--t0``, the call's start; everything ends ``--deadline`` seconds after it):

1. the device pipeline's image cache of the training images, built once here (the probe's and the table's rows
   read it), the evaluation's decoding timed on a sample of the test images, and on a GPU a first convolution
   (a fresh machine's first CUDA work is slow: not inside a probe);
2. the probe (:func:`probe`): both rows side by side, each a plain ``obow pretrain`` on all the training images
   with the table's settings, until each has ``--probe-measure`` seconds of steps timed after ``--warmup-steps``
   (at most ``--probe-s``); the rates read from their ``log.jsonl`` (:func:`fit_intervals`). Candidates, in order:
   for ``--step auto`` the graphed step (when this tree's configuration takes ``train.compile=graph``) and the eager
   one (``off``), the faster that works kept; for ``--recipe auto`` ``cifar10_resnet18`` when at least
   ``--min-epochs`` fit with that step, else ``cifar10_fast``;
3. the epochs (:func:`choose_epochs`): the most whose estimated total (:class:`Estimate`) fits in the time left;
   fewer than ``--min-epochs`` are said plainly and run;
4. ``obow tables run mocov2 --rows 2 4 --seeds SEED --jobs 2 --budget EPOCHS --curve-every max(1, EPOCHS // 10)
   --random-init last``, sent SIGTERM ``--stop-s`` seconds before the deadline (each run finishes its step and
   writes its checkpoint; finished evaluations are kept). With ``--like FOLDER`` (a later seed) steps 2 and 3 are
   left out: the recipe, epochs and changes are those of the table merged there;
5. all along (:class:`LiveCopy`, every ``--copy-every`` seconds) and at the end: each row's ``log.jsonl`` (its
   steps, and its kNN curve in the epoch records) and the table's ``table.json``, ``table.md`` and ``plan.json``
   copied into OUT, beside ``claim.json`` (what was measured, estimated and chosen) and ``summary.txt``; eight
   files at most, as a device call returns. The checkpoints stay on the machine.

Every row gets the same batch (``--batch``, default 512) and the learning rate by one rule, linear scaling: the
recipe's ``optim.lr`` times ``batch / the recipe's data.batch_size`` (both CIFAR-10 recipes: 0.05 at 128, so
0.2 at 512).

``merge`` adds a returned OUT to a table folder (``docs/results/tables/cifar10-mocov2-gpu``): its runs join the
folder's ``table.json`` seed by seed (the same recipe, changes, epochs and images, or it refuses), ``table.md`` is
written again, the rows' logs go to ``curves/``, the call's ``claim.json`` and ``summary.txt`` to ``calls/``,
``curves.md`` lists the kNN curves and ``paired.md`` holds the paired verdict (``obow tables paired``'s rule).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TABLE = "mocov2"
#: The two rows of the claim, by their number in ``obow tables mocov2``: OBoW (full) and MoCo v2 (our aug.).
ROWS = ("2", "4")
RECIPES = ("cifar10_resnet18", "cifar10_fast")
#: The probe's rows train for this many epochs (their schedule only; they are stopped long before).
PROBE_EPOCHS = 1000


# ----------------------------------------------------------------------------------------------- the arithmetic


@dataclass(frozen=True)
class Interval:
    """Steps ``start`` (exclusive) to ``end`` (inclusive) of a run, between two logged steps, in ``seconds``;
    ``boundaries``: the epoch ends among them (each with its checkpoint)."""

    start: int
    end: int
    seconds: float
    boundaries: int

    @property
    def steps(self) -> int:
        return self.end - self.start


def intervals(records: list[dict[str, Any]], batch: int) -> list[Interval]:
    """The timed intervals of a run's ``log.jsonl`` records: each logged step's ``images_per_s`` covers the steps
    since the logged step before it (:class:`obow.training.logger.RunLogger`), so its seconds are ``steps x batch
    / images_per_s``."""
    steps = [r for r in records if r.get("type") is None and "iteration" in r]
    found = []
    for before, after in itertools.pairwise(steps):
        rate, n = after.get("images_per_s"), after["iteration"] - before["iteration"]
        if rate and n > 0:
            ends = after["epoch"] - before["epoch"]
            found.append(Interval(before["iteration"], after["iteration"], n * batch / rate, ends))
    return found


@dataclass(frozen=True)
class Fit:
    """A run's pace: ``seconds_per_step`` and, when measured, ``epoch_end_s`` (the extra seconds of an epoch's end:
    its record and checkpoint; ``0.0`` when every timed interval held epoch ends, which the rate then includes;
    ``None`` when none did), over ``measured_s`` seconds and ``steps`` steps."""

    seconds_per_step: float
    epoch_end_s: float | None
    measured_s: float
    steps: int


def fit_intervals(found: list[Interval], warmup_steps: int) -> Fit | None:
    """The pace of the intervals that start at step ``warmup_steps`` or later (``None``: none do). The steps' rate
    from the intervals without an epoch end; an epoch end's cost from those with one (their seconds beyond that
    rate, per epoch end). When every interval holds epoch ends (an epoch shorter than the logging interval), the
    rate is theirs, epoch ends included."""
    kept = [i for i in found if i.start >= warmup_steps]
    if not kept:
        return None
    plain = [i for i in kept if i.boundaries == 0]
    crossing = [i for i in kept if i.boundaries > 0]
    measured, steps = sum(i.seconds for i in kept), sum(i.steps for i in kept)
    if not plain:
        return Fit(measured / steps, 0.0, measured, steps)
    per_step = sum(i.seconds for i in plain) / sum(i.steps for i in plain)
    end = None
    if crossing:
        extra = sum(i.seconds for i in crossing) - per_step * sum(i.steps for i in crossing)
        end = max(0.0, extra / sum(i.boundaries for i in crossing))
    return Fit(per_step, end, measured, steps)


def curve_every(epochs: int, every: int = 0) -> int:
    """Epochs between two kNN monitor points: ``every``, or (0) a tenth of the run (every epoch below ten)."""
    return every or max(1, epochs // 10)


@dataclass(frozen=True)
class Estimate:
    """The seconds of a table run besides its training steps, as :func:`choose_epochs` counts them: from the
    command's start to the rows' first timed step (``start_s``), each epoch's end (``epoch_end_s``), the kNN
    monitor's first pass (it decodes the images: ``monitor_first_s``) and each later one (``monitor_pass_s``), one
    row's evaluation (``eval_s``; the two rows evaluate at once), and ``margin_s`` (stopping at the deadline, the
    last copies, slack). The rows train side by side, the slower one setting the pace."""

    start_s: float
    epoch_end_s: float
    monitor_first_s: float
    monitor_pass_s: float
    eval_s: float
    margin_s: float
    curve_every: int = 0  # epochs between two monitor passes (0: a tenth of the run)

    def total(self, epochs: int, steps_per_epoch: int, seconds_per_step: float) -> float:
        passes = epochs // curve_every(epochs, self.curve_every)
        monitor = self.monitor_first_s + (passes - 1) * self.monitor_pass_s if passes else 0.0
        training = epochs * (steps_per_epoch * seconds_per_step + self.epoch_end_s)
        return self.start_s + training + monitor + self.eval_s + self.margin_s


@dataclass(frozen=True)
class Choice:
    epochs: int  # 0: not one epoch fits
    fits: bool  # at least the minimum asked
    total_s: float  # the estimate for ``epochs`` (for the minimum when not one fits)
    text: str


def choose_epochs(
    seconds_left: float, estimate: Estimate, steps_per_epoch: int, seconds_per_step: float, minimum: int
) -> Choice:
    """The most epochs whose :meth:`Estimate.total` is at most ``seconds_left``, and a sentence that says whether
    ``minimum`` fit."""
    per_epoch = steps_per_epoch * seconds_per_step + estimate.epoch_end_s
    best = 0
    for epochs in range(1, int(seconds_left / per_epoch) + 2):
        if estimate.total(epochs, steps_per_epoch, seconds_per_step) <= seconds_left:
            best = epochs
    asked = estimate.total(minimum, steps_per_epoch, seconds_per_step)
    if best >= minimum:
        total = estimate.total(best, steps_per_epoch, seconds_per_step)
        text = f"{best} epochs fit (at least {minimum} asked): about {total:.0f} s of the {seconds_left:.0f} s left"
        return Choice(best, True, total, text)
    head = (
        f"{minimum} epochs do NOT fit: they would take about {asked:.0f} s, {seconds_left:.0f} s are left "
        f"({steps_per_epoch * seconds_per_step:.1f} s an epoch's steps, {estimate.eval_s:.0f} s an evaluation)"
    )
    if best == 0:
        return Choice(0, False, asked, f"{head}; not one epoch fits: nothing is trained")
    total = estimate.total(best, steps_per_epoch, seconds_per_step)
    return Choice(best, False, total, f"{head}; running the {best} that fit (about {total:.0f} s)")


def scaled_lr(base_lr: float, base_batch: int, batch: int) -> float:
    """The learning rate at ``batch`` by linear scaling from the recipe's ``base_lr`` at ``base_batch``."""
    return base_lr * batch / base_batch


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
        # what the table command imports before its work (timed for its start, Estimate.start_s)
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


def machine_text() -> str:
    from obow.experiments.tables import machine_description

    return machine_description()


def step_accepted(recipe: str, step: str) -> str | None:
    """``None`` when this tree's configuration takes ``train.compile=step``, else why not (one line)."""
    from obow.config import ConfigError, load_config

    try:
        load_config(recipe, [f"train.compile={step}"])
    except (ConfigError, ValueError) as err:
        return str(err).splitlines()[0]
    return None


def batch_size(recipe: str, batch: int | None) -> int:
    """The call's batch: ``batch``, or the recipe's when ``None``."""
    from obow.config import load_config

    return batch or load_config(recipe).data.batch_size


def table_overrides(recipe: str, step: str, batch: int | None, extra: list[str]) -> list[str]:
    """The changes every row of the call gets (the table's ``overrides``): the batch, its learning rate by linear
    scaling, the device pipeline, channels_last, the step mode, kNN k=200 for the curves."""
    from obow.config import load_config

    base = load_config(recipe)
    size = batch_size(recipe, batch)
    lr = scaled_lr(base.optim.lr, base.data.batch_size, size)
    return [
        f"data.batch_size={size}",
        f"optim.lr={lr:.6g}",
        "data.pipeline=device",
        "train.channels_last=true",
        f"train.compile={step}",
        "train.knn_k=200",
        "train.tensorboard=false",
        *extra,
    ]


@dataclass
class Data:
    root: Path
    train: Path
    test: Path
    train_images: int
    test_images: int
    scan_s: float  # listing both folders' images, as the table command does at its start


def find_data(root: Path) -> Data:
    from obow.data.folders import scan_images

    test = next((root / d for d in ("test", "val") if (root / d).is_dir()), None)
    if not (root / "train").is_dir() or test is None:
        raise SystemExit(f"{root} must hold train/ and test/ class folders (C10: CIFAR-10 unpacked)")
    start = time.perf_counter()
    counts = [len(scan_images(folder, "folders")) for folder in (root / "train", test)]
    return Data(root, root / "train", test, *counts, round(time.perf_counter() - start, 3))


def prepare_images(call: Call, data: Data, recipe: str) -> float:
    """Build the device pipeline's cache of the training images (what every row would otherwise decode at its
    start) and time the evaluation's decoding on a sample of the test images; returns seconds per image."""
    from dataclasses import replace

    from obow.config import load_config
    from obow.data.cache import build_cache
    from obow.data.eval_sets import eval_dataset
    from obow.data.folders import scan_images
    from obow.methods import cache_side

    cfg = load_config(recipe)
    start = time.perf_counter()
    train = scan_images(data.train, "folders")
    cache = build_cache(train, cache_side(cfg), cfg.data.cache_size, cfg.data.cache_dir)
    built = time.perf_counter() - start
    call.say(f"image cache: {cache.describe()} ({built:.1f} s)")
    test = scan_images(data.test, "folders")
    n = min(len(test), call.args.decode_sample)
    sample = eval_dataset(replace(test, paths=test.paths[:n], labels=test.labels[:n]), cfg.views)
    start = time.perf_counter()
    for i in range(n):
        sample[i]
    per_image = (time.perf_counter() - start) / n
    call.say(f"evaluation decoding: {per_image * 1e3:.3f} ms an image ({n} test images, one at a time)")
    call.claim["images"] = {"cache_s": round(built, 2), "decode_ms_per_image": round(per_image * 1e3, 4)}
    return per_image


def warm_gpu(call: Call) -> None:
    """On a GPU, a first convolution forward and backward here (bf16, channels_last, cuDNN's tuning on): a fresh
    machine's first CUDA process pays the driver's start and its kernels' first loading, which would otherwise fall
    in the first probe's 40 s."""
    import torch

    if not torch.cuda.is_available():
        return
    start = time.perf_counter()
    torch.backends.cudnn.benchmark = True
    conv = torch.nn.Conv2d(3, 64, 3, padding=1).cuda().to(memory_format=torch.channels_last)
    images = torch.randn(512, 3, 32, 32, device="cuda").to(memory_format=torch.channels_last)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        conv(images).float().square().mean().backward()
    torch.cuda.synchronize()
    call.say(f"GPU warmed: {torch.cuda.get_device_name(0)}, a first convolution in {time.perf_counter() - start:.1f} s")


def time_protocol(dim: int, train_images: int, test_images: int, threads: int, classes: int = 10) -> dict[str, float]:
    """The evaluation protocol's CPU work (:func:`obow.evaluate.protocol.evaluate_features`: the features are moved to
    the CPU, whatever the device) timed here on random features of the rows' width, scaled down and extrapolated:
    the linear probe's first epoch of its preset's, the kNN of a tenth of the test images, a tenth of the few-shot
    episodes, the diagnostics whole; with ``threads`` threads, as each of the two evaluations gets. Seconds."""
    import torch

    from obow.diagnostics import feature_diagnostics
    from obow.evaluate.fewshot import default_ways, prototype_accuracy, sample_episodes
    from obow.evaluate.knn import knn_accuracy
    from obow.evaluate.linear import preset_settings, train_linear_probe

    generator = torch.Generator().manual_seed(0)
    train_x = torch.randn(train_images, dim, generator=generator).relu()
    test_x = torch.randn(test_images, dim, generator=generator).relu()
    train_y, test_y = torch.arange(train_images) % classes, torch.arange(test_images) % classes
    settings = preset_settings("resnet18")
    epochs, settings["epochs"] = settings["epochs"], 1
    queries = max(1, test_images // 10)
    episodes = 20  # of the protocol's 200
    shots = [n for n in (1, 5) if test_images // classes >= n + 1]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    seconds: dict[str, float] = {}
    try:
        start = time.perf_counter()
        train_linear_probe([train_x], train_y, test_x, test_y, batch_norm=True, **settings)
        seconds["linear_s"] = (time.perf_counter() - start) * epochs
        start = time.perf_counter()
        knn_accuracy(train_x, train_y, test_x[:queries], test_y[:queries], k=min(200, train_images), temperature=0.1)
        seconds["knn_s"] = (time.perf_counter() - start) * test_images / queries
        start = time.perf_counter()
        for n_shot in shots:
            tasks = sample_episodes(test_y, n_way=default_ways(classes), n_shot=n_shot, n_episodes=episodes, seed=0)
            prototype_accuracy(test_x, test_y, tasks)
        seconds["fewshot_s"] = (time.perf_counter() - start) * 200 / episodes
        start = time.perf_counter()
        feature_diagnostics(test_x)
        seconds["diagnostics_s"] = time.perf_counter() - start
    finally:
        torch.set_num_threads(previous)
    seconds["total_s"] = sum(seconds.values())
    return {key: round(value, 2) for key, value in seconds.items()}


def feature_width(recipe: str) -> int:
    """The width of the recipe's ``pool5`` features (what the evaluation's linear probe and kNN see)."""
    from obow.config import load_config
    from obow.weights.load import load_backbone

    model = load_config(recipe).model
    net, _ = load_backbone(random_init=True, arch=model.arch, stem=model.stem, arch_options=model.arch_options)
    return net.num_features


def rows_of_table() -> list[Any]:
    from obow.experiments.tables import TABLES, select_rows

    return select_rows(TABLES[TABLE], list(ROWS))


def row_items(recipe: str, data: Data, overrides: list[str]) -> tuple[list[Any], dict[str, Any]]:
    from obow.config import load_config
    from obow.experiments.tables import placeholders

    base = load_config(recipe, [f"data.path={data.train}", *overrides])
    return rows_of_table(), placeholders(base, data.train_images)


def read_records(path: Path) -> list[dict[str, Any]]:
    records = []
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                records.append(json.loads(line))
    return records


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


def probe(call: Call, data: Data, recipe: str, step: str) -> Probe:
    """Both rows side by side, each ``obow pretrain`` with the call's settings on all the training images, until
    each has ``--probe-measure`` seconds timed after ``--warmup-steps`` (at most ``--probe-s`` seconds, and never
    past the deadline); their pace from their ``log.jsonl``."""
    from obow.experiments.tables import fill_placeholders
    from obow.training.threads import available_cores

    args = call.args
    why = step_accepted(recipe, step)
    if why is not None:
        call.say(f"probe {recipe} / step {step}: not tried, the configuration refuses it ({why})")
        return Probe(recipe, step, {}, error=f"refused by the configuration: {why}")
    overrides = table_overrides(recipe, step, args.batch, args.extra)
    rows, values = row_items(recipe, data, overrides)
    batch = batch_size(recipe, args.batch)
    threads = max(1, available_cores() // len(rows))
    folder = Path(args.runs) / f"probe-{recipe}-{step}"
    processes, logs, outputs = {}, {}, {}
    start = time.monotonic()
    for row in rows:
        run = folder / row.slug
        run.mkdir(parents=True, exist_ok=True)
        items = [
            *overrides,
            "train.progress_bar=false",
            "train.knn_every=0",
            f"train.seed={args.seed}",
            f"train.threads={threads}",
            *fill_placeholders(row.overrides, values),
            f"optim.epochs={PROBE_EPOCHS}",
        ]
        command = [sys.executable, "-m", "obow", "pretrain", "--config", recipe, "--data", str(data.train)]
        outputs[row.slug] = open(run.parent / f"{row.slug}.out", "w")  # noqa: SIM115 - closed below
        processes[row.slug] = subprocess.Popen(
            [*command, "--out", str(run), *items], stdout=outputs[row.slug], stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        logs[row.slug] = run / "log.jsonl"
    call.say(f"probe {recipe} / step {step}: both rows started (batch {batch}, {threads} threads each)")
    first: dict[str, float] = {}
    first_steps: dict[str, int] = {}
    fits: dict[str, Fit | None] = {}
    cap = min(args.probe_s, max(call.left() - args.stop_s, 1.0))
    failed = None
    while True:
        waited = time.monotonic() - start
        for slug, path in logs.items():
            records = read_records(path)
            if records and slug not in first:  # its first logged step: when, and after how many steps
                first[slug] = waited
                first_steps[slug] = records[0].get("iteration", 0)
            fits[slug] = fit_intervals(intervals(records, batch), args.warmup_steps)
        if all(f is not None and f.measured_s >= args.probe_measure for f in fits.values()):
            break
        failed = next((slug for slug, p in processes.items() if p.poll() is not None), None)
        if failed is not None or waited >= cap or call.stopping:
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
        with open(call.log_path, "a") as f:
            f.write(f"===== probe {recipe} / {step} / {row.slug}\n")
            f.write(output.read_text() if output.exists() else "(no output)\n")
        result.rows[row.slug] = entry
    took = time.monotonic() - start
    measured = [fits.get(row.slug) for row in rows]
    if failed is not None and any(f is None or f.measured_s < args.probe_measure for f in measured):
        result.error = f"{failed} stopped by itself (exit code {codes[failed]}) before it was timed"
    elif any(f is None for f in measured):
        result.error = f"not every row logged a timed interval after {args.warmup_steps} steps in {took:.0f} s"
    else:
        result.seconds_per_step = max(f.seconds_per_step for f in measured)
        ends = [f.epoch_end_s for f in measured if f.epoch_end_s is not None]
        result.epoch_end_s = max(ends) if ends else None
        # the launch to the first timed step: the seconds to the first logged step, less its steps at the rate
        result.start_s = max(max(0.0, first[slug] - first_steps[slug] * fits[slug].seconds_per_step) for slug in first)
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


def estimate_for(call: Call, data: Data, recipe: str, found: Probe, decode_s: float) -> Estimate:
    """The :class:`Estimate` for a table run of ``recipe`` at the pace ``found``: what is measured on this machine
    (the start: this process's imports, the images' listing, the probe's rows' start; the epoch ends; the decoding;
    the protocol's CPU work by :func:`time_protocol`) and what is
    stated (``--table-start-s``, ``--monitor-pass-s``, ``--eval-start-s``, and ``--epoch-end-s`` when the probe saw
    no epoch end; docs/results/tables/cifar10-mocov2-gpu/README.md says why these values)."""
    from obow.training.threads import available_cores

    args = call.args
    if recipe not in call.protocols:
        width = feature_width(recipe)
        threads = max(1, available_cores() // 2)
        call.protocols[recipe] = {"width": width, "threads": threads}
        call.protocols[recipe].update(time_protocol(width, data.train_images, data.test_images, threads))
        timed = call.protocols[recipe]
        call.say(
            f"evaluation protocol ({width}-d features, {threads} threads), timed on random features: linear "
            f"{timed['linear_s']:.1f} s, kNN {timed['knn_s']:.1f} s, few-shot {timed['fewshot_s']:.1f} s, "
            f"diagnostics {timed['diagnostics_s']:.1f} s"
        )
        call.claim["protocol_timing"] = call.protocols
    images = data.train_images + data.test_images
    epoch_end = found.epoch_end_s if found.epoch_end_s is not None else args.epoch_end_s
    return Estimate(
        # the table command imports torch and obow as this process did, lists the images, plans and starts its rows,
        # which start as the probe's did
        start_s=args.table_start_s + call.import_s + data.scan_s + (found.start_s or 0.0),
        epoch_end_s=epoch_end,
        # its first pass starts the recipe's loader workers (imports, as this process's) and decodes every image
        monitor_first_s=call.import_s + images * decode_s + args.monitor_pass_s,
        monitor_pass_s=args.monitor_pass_s,
        eval_s=args.eval_start_s + images * decode_s + args.monitor_pass_s + call.protocols[recipe]["total_s"],
        margin_s=args.margin_s,
        curve_every=args.curve_every,
    )


def cuda_available() -> bool:
    """Whether this machine has a CUDA device (asked in a child process: this one stays free of CUDA)."""
    probe = [sys.executable, "-c", "import torch; print(torch.cuda.is_available())"]
    try:
        return subprocess.run(probe, capture_output=True, text=True, timeout=120).stdout.strip() == "True"
    except (OSError, subprocess.TimeoutExpired):
        return False


def choose(call: Call, data: Data, decode_s: float) -> tuple[str, str, Choice, Estimate, Probe] | None:
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
        choice = choose_epochs(call.left(), estimate, steps_per_epoch, best.seconds_per_step, args.min_epochs)
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


def progress(runs: Path, seed: int) -> dict[str, Any]:
    """Each row's epochs done, its last kNN point and its training images a second, from its ``log.jsonl``."""
    found = {}
    for row in rows_of_table():
        run = runs / TABLE / row.slug / f"seed{seed}"
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


def run_table_call(call: Call, data: Data, recipe: str, step: str, epochs: int, overrides: list[str]) -> int | None:
    """``obow tables run`` for the call's rows and seed, copied out as it grows, stopped before the deadline."""
    args = call.args
    runs = Path(args.runs)
    command = [
        sys.executable, "-m", "obow", "tables", "run", TABLE, "--data", str(data.root), "--budget", str(epochs),
        "--recipe", recipe, "--out", str(runs), "--rows", *ROWS, "--seeds", str(args.seed), "--jobs", "2",
        "--curve-every", str(curve_every(epochs, args.curve_every)), "--random-init", "last", *overrides,
    ]  # fmt: skip
    call.claim["table_command"] = " ".join(command)
    call.claim["run"] = {"started_s": round(call.elapsed(), 1)}
    call.save_claim()
    every = curve_every(epochs, args.curve_every)
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
            call.claim["rows"] = progress(runs, args.seed)
            call.claim["run"]["elapsed_s"] = round(call.elapsed(), 1)
            call.save_claim()
            last_note = time.monotonic()
        time.sleep(0.5)
    copier.stop()
    code = process.poll()
    call.claim["rows"] = progress(runs, args.seed)
    call.claim["run"].update({"ended_s": round(call.elapsed(), 1), "exit_code": code, "cut": cut})
    call.save_claim()
    done = ", ".join(f"{slug} {e['epochs_done']} epochs" for slug, e in call.claim["rows"].items())
    how = f"exit code {code}" + (f", cut: {cut}" if cut else "")
    call.say(f"table: ended ({how}); {done}; in OUT: {', '.join(sorted(copier.seen))}")
    return code


def from_folder(call: Call, folder: Path) -> tuple[str, int, list[str]]:
    """A later seed's recipe, epochs and changes: those of the table folder ``folder`` (``--like``), so that its
    runs join that folder's seed by seed; says how long the calls merged there took (their ``calls/*claim.json``):
    with no probe, that is this call's only guide to whether the epochs fit."""
    record = json.loads((folder / "table.json").read_text())
    seeds = {run["seed"] for row in record["rows"] for run in row["runs"]}
    if call.args.seed in seeds:
        raise SystemExit(f"{folder} already holds seed {call.args.seed}: give another --seed")
    for path in sorted((folder / "calls").glob("*claim.json")):
        earlier = json.loads(path.read_text())
        run = earlier.get("run", {})
        how = f"cut ({run['cut']})" if run.get("cut") else "finished"
        call.say(
            f"{path.name}: {earlier.get('choice', {}).get('epochs')} epochs on {earlier.get('machine')}: table "
            f"started at {run.get('started_s')} s, ended at {run.get('ended_s')} s of its call, {how}"
        )
    return record["recipe"], record["budget"]["epochs"], list(record["overrides"])


def cmd_run(args: argparse.Namespace) -> int:
    call = Call(args)

    def received(signum: int, frame: Any) -> None:
        call.stopping = signal.Signals(signum).name

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, received)
    runs = Path(args.runs)
    if runs.exists() and any(runs.iterdir()):
        raise SystemExit(f"{runs} holds an earlier call's files: give another --runs")
    runs.mkdir(parents=True, exist_ok=True)
    call.say(f"machine: {machine_text()}; deadline {args.deadline} s, seed {args.seed}; imports {call.import_s:.1f} s")
    call.claim["machine"] = machine_text()
    data = find_data(Path(args.data))
    call.claim["data"] = dataclasses.asdict(data)
    call.say(f"data: {data.train_images} training and {data.test_images} test images under {data.root}")
    first_recipe = RECIPES[0] if args.recipe == "auto" else args.recipe
    decode_s = prepare_images(call, data, first_recipe)
    warm_gpu(call)
    if args.like is not None:
        recipe, epochs, overrides = from_folder(call, Path(args.like))
        step = next((o.split("=", 1)[1] for o in overrides if o.startswith("train.compile=")), "off")
        call.say(f"--like {args.like}: {recipe}, {epochs} epochs, its changes {' '.join(overrides)} (no probe)")
        call.claim["choice"] = {"recipe": recipe, "step": step, "epochs": epochs, "like": args.like}
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


def merge_records(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``old`` (a table folder's ``table.json``) with the runs of ``new`` (a call's) joined seed by seed; a
    ``ValueError`` when they are not the same table (recipe, changes, budget, images, protocol, plan) or both hold
    the same row at the same seed."""
    from obow.experiments.tables import aggregate

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
    order = [row.slug for row in _table().rows]
    merged["rows"] = [by_slug[slug] for slug in order if slug in by_slug]
    merged["seeds"] = sorted({run["seed"] for r in (merged["random_init"], *merged["rows"]) for run in r["runs"]})
    merged["plan"] = {**old["plan"], **{k: v for k, v in new["plan"].items() if k not in old["plan"]}}
    return merged


def _table() -> Any:
    from obow.experiments.tables import TABLES

    return TABLES[TABLE]


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


def read_curves(folder: Path) -> dict[str, dict[int, dict[int, float]]]:
    """The kNN points of ``folder/curves/<slug>-seed<N>.log.jsonl``: ``{row label: {seed: {epoch: kNN}}}``."""
    labels = {row.slug: row.label for row in _table().rows}
    curves: dict[str, dict[int, dict[int, float]]] = {}
    for path in sorted((folder / "curves").glob("*-seed*.log.jsonl")):
        slug, _, seed = path.name[: -len(".log.jsonl")].rpartition("-seed")
        points = {r["epoch"]: r["knn_top1"] for r in read_records(path) if r.get("type") == "epoch" and "knn_top1" in r}
        if points and slug in labels:
            curves.setdefault(labels[slug], {})[int(seed)] = points
    return curves


def verdict_text(record: dict[str, Any]) -> str:
    """``paired.md``: OBoW (full) minus MoCo v2 (our aug.), and each row minus the random init, seed by seed, with
    ``obow tables paired``'s verdicts."""
    from obow.experiments.tables import compare_rows

    measured = {row["slug"] for row in record["rows"] if row["runs"]}
    runs = [run for row in (record["random_init"], *record["rows"]) for run in row["runs"]]
    # the scores every run has (5-shot needs 6 test images a class: a tiny dry run has fewer)
    scores = tuple(s for s in ("knn", "linear", "fewshot_1", "fewshot_5") if all(s in run["scores"] for run in runs))
    parts = ["# The paired verdict (`obow tables paired`'s rule: a difference counts when every seed agrees and the "
             "mean exceeds the spread; one seed is not judged)", ""]  # fmt: skip
    if {"obow_full", "moco_v2_our_aug"} <= measured:
        parts.append(compare_rows(record, "moco_v2_our_aug", scores))
    else:
        parts.append(f"Not both rows evaluated (measured: {', '.join(sorted(measured)) or 'none'}): no verdict.\n")
    if record["random_init"]["runs"] and measured:
        parts.append(compare_rows(record, "random_init", scores))
    return "\n".join(parts)


def cmd_merge(args: argparse.Namespace) -> int:
    from obow.experiments.tables import markdown

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
    (folder / "table.md").write_text(markdown(record, _table().columns))
    (folder / "curves.md").write_text(curves_markdown(read_curves(folder)))
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
