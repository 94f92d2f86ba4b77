"""Wall-clock budgets: how many epochs of each recipe fit in the same minutes on this machine.

The paper compares methods at equal epochs on GPUs; on a CPU the fair comparison of a method with a cheap
step (MoCo v2: two views) against one with a dear step (OBoW full: a teacher view, 2 crops and 5 patches) is
equal wall-clock time. :func:`seconds_per_step` times real training steps of several recipes **in alternating
rounds**, so that the machine's noise (a neighbour's job, frequency changes) falls on all of them alike and
their *ratio* is what it is on a quiet machine; :func:`plan_epochs` turns minutes into whole epochs;
:func:`short_run_warmup` is the warm-up rule for runs shorter than their recipe; :func:`crossing_budget` reads
the gap between two methods measured at several budgets and says where a line in log-minutes would cross.

The timed step is the training loop's own: its loader and workers, its thread choice, ``forward_backward``
under the recipe's precision, the optimiser. On a 2-core machine the loader's augmentations compete with the
step for the cores, so a recipe with more views also pays for its dearer augmentations.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
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
