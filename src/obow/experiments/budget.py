"""Wall-clock budgets: how many epochs of each recipe fit in the same minutes on this machine.

The paper compares methods at equal epochs on GPUs; on a CPU the fair comparison of a method with a cheap
step (MoCo v2: two views) against one with a dear step (OBoW full: a teacher view, 2 crops and 5 patches) is
equal wall-clock time. :func:`seconds_per_step` times real training steps of several recipes **in alternating
rounds**, so that the machine's noise (a neighbour's job, frequency changes) falls on all of them alike and
their *ratio* is what it is on a quiet machine; :func:`plan_epochs` turns minutes into whole epochs;
:func:`short_run_warmup` is the warm-up rule for runs shorter than their recipe; :func:`crossing_budget` reads
the gap between two methods measured at several budgets and says where a line in log-minutes would cross.

A call with a deadline (``benchmarks/gpu_claim.py``) reads its rows' pace from their logs (:func:`intervals`,
:func:`fit_intervals`), estimates everything its table run does besides the steps (:class:`Estimate`, the
evaluation timed by :func:`time_protocol`) and takes the most epochs that fit (:func:`choose_epochs`).

The timed step is the training loop's own: its loader and workers, its thread choice, ``forward_backward``
under the recipe's precision, the optimiser. On a 2-core machine the loader's augmentations compete with the
step for the cores, so a recipe with more views also pays for its dearer augmentations.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import statistics
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("obow")


def plan_epochs(minutes: float, seconds_per_step: float, steps_per_epoch: int) -> int:
    """The whole epochs of ``steps_per_epoch`` steps that fit in ``minutes`` at ``seconds_per_step`` (at least
    one; rounded down, so that no run gets more than its budget)."""
    if minutes <= 0 or seconds_per_step <= 0 or steps_per_epoch < 1:
        raise ValueError(
            f"need minutes > 0, seconds_per_step > 0, steps_per_epoch >= 1; got {minutes}, {seconds_per_step}, "
            f"{steps_per_epoch}"
        )
    return max(1, math.floor(minutes * 60 / (seconds_per_step * steps_per_epoch)))


def short_run_warmup(recipe_warmup_epochs: float, epochs: int) -> float:
    """The warm-up of a run of ``epochs`` made from a recipe planned for longer: the recipe's warm-up **in
    epochs, not scaled down** with the run (a warm-up is there to let the vocabulary and the temperature
    statistic settle before the full learning rate, which takes steps, not a share of the run), but at most
    half the run. Scaling it with the run left 8 steps of warm-up for a 117-step table row, and the OBoW
    (full) row fell below its own random init (kNN 23.0 against 26.9, a table run of an earlier session)."""
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    return min(float(recipe_warmup_epochs), epochs / 2)


@dataclass(frozen=True)
class Crossing:
    """The gap ``a - b`` between two methods' scores at several budgets, read as a line in log-minutes.

    ``change_per_doubling``: how much the gap grows each time the budget doubles (``None`` with one budget);
    ``gap_at_largest``: the gap measured at the largest budget; ``minutes``: where the line reaches zero, when
    ``a`` is behind at the largest budget and the gap is closing (an extrapolation, ``None`` otherwise);
    ``verdict``: one of ``ahead``, ``crossing``, ``not closing``, ``one budget``."""

    change_per_doubling: float | None
    gap_at_largest: float
    minutes: float | None
    verdict: str

    def describe(self, a: str, b: str) -> str:
        gap = f"{a} - {b} = {self.gap_at_largest:+.2f} at the largest budget"
        if self.verdict == "one budget":
            return f"{gap}; one budget measured: no trend (measure a second budget)"
        trend = f"{self.change_per_doubling:+.2f} per doubling of the budget"
        if self.verdict == "ahead":
            return f"{gap}, {trend}: {a} is already ahead"
        if self.verdict == "crossing":
            return (
                f"{gap}, {trend}: the line crosses zero near {self.minutes:.0f} minutes "
                "(an extrapolation in log-minutes, not a measurement)"
            )
        return f"{gap}, {trend}: the gap is not closing, no crossing predicted"


def crossing_budget(minutes: Sequence[float], gap: Sequence[float]) -> Crossing:
    """Fit ``gap = c + s * log2(minutes)`` by least squares to the gap between two methods (``a - b``, for
    example kNN of OBoW minus kNN of MoCo v2) measured at several budgets, and say where it reaches zero.

    Two budgets give an exact line: the estimate has no error bar of its own, and the seed spread of each gap
    is what says whether the trend is real. Minutes must be positive and at least one budget given."""
    if len(minutes) != len(gap) or not minutes:
        raise ValueError(f"need one gap per budget and at least one budget; got {len(minutes)} and {len(gap)}")
    if any(m <= 0 for m in minutes):
        raise ValueError(f"budgets must be positive minutes, got {list(minutes)}")
    largest = max(range(len(minutes)), key=lambda i: minutes[i])
    last = float(gap[largest])
    x = [math.log2(m) for m in minutes]
    if len(set(x)) < 2:
        return Crossing(None, last, None, "one budget")
    mean_x, mean_y = statistics.fmean(x), statistics.fmean(gap)
    slope = sum((xi - mean_x) * (yi - mean_y) for xi, yi in zip(x, gap, strict=True)) / sum(
        (xi - mean_x) ** 2 for xi in x
    )
    if last >= 0:
        return Crossing(slope, last, None, "ahead")
    if slope <= 0:
        return Crossing(slope, last, None, "not closing")
    intercept = mean_y - slope * mean_x
    return Crossing(slope, last, 2 ** (-intercept / slope), "crossing")


def seconds_per_step(configs: dict[str, Any], rounds: int = 3, block: int = 4) -> dict[str, float]:
    """Median seconds of a training step of every config in ``configs`` (name -> :class:`obow.config.Config`).

    Each config is run as its training run would be: its loader and data-loading workers, the loop's thread
    choice (:func:`obow.training.run.threads.choose_threads`), batch, views, precision and memory format. The configs
    take turns, ``block`` consecutive steps each, for ``rounds`` rounds; the first step of every block is not
    counted (its batch may have been loaded while another config ran), so a counted step costs what it costs
    in a run: the step, or the loading when that is slower. Turns spread the machine's noise over all configs."""
    import torch

    from obow.training.build import build_data, build_model, build_optimizer
    from obow.training.run.precision import precision_context
    from obow.training.run.settle import resolve_pipeline
    from obow.training.run.threads import choose_threads
    from obow.training.step.shared import forward_backward, to_device

    if rounds < 1 or block < 2:
        raise ValueError(f"need rounds >= 1 and block >= 2, got {rounds} and {block}")
    cuda = torch.cuda.is_available() and any(_wants_cuda(c) for c in configs.values())
    device = torch.device("cuda" if cuda else "cpu")
    runs: dict[str, Any] = {}
    for name, cfg in configs.items():
        _, sampler, loader = build_data(cfg, device, pipeline=resolve_pipeline(cfg.data.pipeline, device))
        model = build_model(cfg, total_iterations=1000, device=device, resuming=True).train()
        runs[name] = (cfg, _endless(loader, sampler), model, build_optimizer(model, cfg))
    times: dict[str, list[float]] = {name: [] for name in configs}
    previous = torch.get_num_threads()
    for _ in range(rounds):
        for name, (cfg, batches, model, optimizer) in runs.items():
            scaler = torch.amp.GradScaler(device.type, enabled=cfg.train.precision == "fp16")
            per_group = cfg.train.backward_per_group and model.supports_groups
            torch.set_num_threads(choose_threads(cfg)[0])  # the run's choice (its header says it once)
            try:
                for i in range(block):
                    start = time.perf_counter()
                    teacher, views = to_device(next(batches)["image"], device, cfg.train.channels_last)
                    optimizer.zero_grad(set_to_none=True)
                    autocast = precision_context(cfg.train.precision, device)
                    forward_backward(model, teacher, views, scaler, autocast, per_group)
                    scaler.step(optimizer)
                    scaler.update()
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    if i > 0:
                        times[name].append(time.perf_counter() - start)
            finally:
                torch.set_num_threads(previous)
    result = {name: statistics.median(t) for name, t in times.items()}
    for name, seconds in result.items():
        log.info("timed %s: %.2f s a step (median of %d, in turns)", name, seconds, len(times[name]))
    return result


def _endless(loader: Any, sampler: Any) -> Any:
    """The loader's batches, epoch after epoch (a small folder may hold fewer batches than the timed rounds)."""
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def _wants_cuda(cfg: Any) -> bool:
    return cfg.train.device != "cpu"


# ------------------------------------------------------------------------------- a call with a deadline
# A time-limited call (benchmarks/gpu_claim.py: a lent GPU for ten minutes) times its rows in a short probe, reads
# their pace from their logs, and chooses the most epochs whose whole run fits in the time left: the steps, and
# what a run does besides them (its start, the epochs' ends, the kNN monitor's passes, the evaluation).


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
    since the logged step before it (:class:`obow.training.run.logger.RunLogger`), so its seconds are ``steps x
    batch / images_per_s``."""
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
    # the whole epochs that fit at this pace, epoch ends included (the overheads then take some of them back)
    most = plan_epochs(seconds_left / 60, per_epoch / steps_per_epoch, steps_per_epoch) if seconds_left > 0 else 0
    best = 0
    for epochs in range(1, most + 2):
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


def read_records(path: Path) -> list[dict[str, Any]]:
    records = []
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                records.append(json.loads(line))
    return records


def time_protocol(dim: int, train_images: int, test_images: int, threads: int, classes: int = 10) -> dict[str, float]:
    """The evaluation protocol's CPU work (:func:`obow.evaluate.protocol.evaluate_features`: the features are moved to
    the CPU, whatever the device) timed here on random features of the rows' width, scaled down and extrapolated:
    the linear probe's first epoch of its preset's, the kNN of a tenth of the test images, a tenth of the few-shot
    episodes, the diagnostics whole; with ``threads`` threads, as each of the two evaluations gets. Seconds."""
    import torch

    from obow.diagnostics import feature_diagnostics
    from obow.evaluate.fewshot import default_ways, prototype_accuracy, sample_episodes
    from obow.evaluate.knn import knn_accuracy
    from obow.evaluate.linear import capped_lr, preset_settings, train_linear_probe
    from obow.notices import ObowWarning

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
        start = time.perf_counter()  # the protocol's rate first (a power iteration), then one epoch at it
        settings["lr"] = capped_lr(settings["lr"], train_x, classes, settings["momentum"], batch_norm=True)
        rate_s = time.perf_counter() - start
        start = time.perf_counter()
        with warnings.catch_warnings():  # random features: whether this one epoch diverges says nothing
            warnings.simplefilter("ignore", ObowWarning)
            train_linear_probe([train_x], train_y, test_x, test_y, batch_norm=True, **settings)
        seconds["linear_s"] = rate_s + (time.perf_counter() - start) * epochs
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
