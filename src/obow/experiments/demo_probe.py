"""Which demo recipe this machine can run within the demo's budget: measured at start-up, not read from CPU flags.

The same ``obow demo`` took 1.6 minutes on one 2-core CPU and 6 minutes on another (docs/results/demo.md), and
CPU flags say little about it: an AVX-512 BF16 CPU computes bf16 twice as fast as fp32, an AVX2-only one
emulates it 20x slower, and a busy core halves any of them. So the demo times what it is about to run: a short
probe (:func:`probe`), a few seconds, that

1. times a convolution of the demo's network in fp32 and in bf16 (milliseconds each), and keeps bf16 as a
   candidate only where it is faster (so that emulated bf16 is never run a whole step);
2. for each of the dataset's recipes, best first (:data:`obow.experiments.demo.DATASETS`), times four training
   steps on a full batch at each candidate precision, and one forward pass of a batch through the network (the
   kNN monitor's passes and the final evaluation are forward passes over the demo's images);
3. estimates the whole demo from those (:func:`estimate_seconds`) and stops at the first recipe and precision
   whose estimate is within :data:`BUDGET_SECONDS`; when none is, the cheapest.

The choice is said in one line and written into ``demo_results.json`` (recipe and precision), so results stay
comparable. The estimate leaves out the loading of images and the rendering of the views (a few percent of a
step on the device pipeline), and a machine that becomes busier after the probe: it is a guide, and the demo
prints the time it took.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from obow.config import Config

__all__ = ["BUDGET_SECONDS", "Choice", "Probe", "choose_by_probe", "estimate_seconds", "probe"]

#: The demo's time budget: 3 minutes in all, data and evaluation included, probe included.
BUDGET_SECONDS = 180.0
#: Share of the budget the estimate may fill (the estimate leaves out the views' rendering and a neighbour).
BUDGET_SHARE = 0.9
#: Seconds of the demo that do not depend on the recipe: writing the digit mosaics (once), decoding them into the
#: cache, the start of the run, printing: 17 s of the 147 s of a demo on a quiet 2-core AVX-512 BF16 EPYC (its wall
#: time less its epochs, monitor passes and the two evaluation passes; docs/results/demo.md, 2026-11-29).
FIXED_SECONDS = 17.0
#: Forward passes over all of the demo's images besides the kNN monitor's: the final table's, for the random and
#: the pretrained network.
EVALUATION_PASSES = 2


@dataclass(frozen=True)
class Probe:
    """What the probe measured for one recipe at one precision: seconds of a training step on a full batch, and
    of a forward pass over all of the demo's images (a kNN monitor's pass)."""

    recipe: str
    precision: str
    step_seconds: float
    pass_seconds: float


@dataclass(frozen=True)
class Choice:
    """The recipe and precision chosen, the estimate of the whole demo with them, and every probe made."""

    recipe: str
    precision: str
    estimate_seconds: float
    probes: tuple[Probe, ...]
    probe_seconds: float
    fits: bool

    def line(self) -> str:
        """The demo's first line: what it chose and why, in one line."""
        timed = ", ".join(f"{p.recipe} {p.precision} {p.step_seconds:.2f} s" for p in self.probes)
        budget = f"the {BUDGET_SECONDS / 60:.0f}-minute budget"
        verdict = f"within {budget}" if self.fits else f"over {budget}: the cheapest recipe"
        return (
            f"Demo: recipe '{self.recipe}' in {self.precision}, about {self.estimate_seconds / 60:.1f} min "
            f"({verdict}), chosen by a {self.probe_seconds:.0f} s probe "
            f"of this machine (a step: {timed}); `obow demo --recipe NAME` runs another"
        )


def estimate_seconds(cfg: Config, probe: Probe, write_data: bool) -> float:
    """The whole demo with ``cfg`` at ``probe``'s speed: its steps, the kNN monitor's passes (every
    ``train.knn_every`` epochs and at the end) and the final evaluation's two, and :data:`FIXED_SECONDS` when
    the data are still to be written."""
    from obow.experiments.demo import training_images

    steps = cfg.optim.epochs * (training_images() // cfg.data.batch_size)
    every = cfg.train.knn_every
    monitor_passes = 0 if not every else len({*range(every, cfg.optim.epochs + 1, every), cfg.optim.epochs})
    passes = monitor_passes + EVALUATION_PASSES
    return steps * probe.step_seconds + passes * probe.pass_seconds + (FIXED_SECONDS if write_data else 0.0)


def fast_precisions(device: torch.device) -> tuple[str, ...]:
    """``("bf16", "fp32")`` where a 256 x 256 matrix product runs faster in bf16 than in fp32 on ``device``
    (bf16 in hardware: 3.5x on an AVX-512 BF16 EPYC), else ``("fp32",)`` (bf16 emulated: 300x slower there with
    PyTorch's AVX2 kernels), so that emulated bf16 is never probed a whole step. On a GPU, both."""
    import torch

    if device.type != "cpu":
        return ("bf16", "fp32")
    seconds = {}
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a = torch.randn(256, 256, device=device).to(dtype)
        times = []
        for _ in range(4):
            start = time.perf_counter()
            a @ a
            times.append(time.perf_counter() - start)
        seconds[precision] = min(times[1:])
    return ("bf16", "fp32") if seconds["bf16"] < seconds["fp32"] else ("fp32",)


def probe(cfg: Config, device: torch.device, recipe: str, precision: str, steps: int = 4) -> Probe:
    """Time ``steps`` training steps of ``cfg`` at ``precision`` on a full batch of grey images (after one that
    sets things up), and a forward pass of one batch, scaled to a pass over the demo's images."""
    import torch

    from obow.methods import build_method
    from obow.training.run.precision import precision_context
    from obow.training.step.shared import forward_backward, to_device
    from obow.training.step_cost import probe_batch

    rng = torch.random.get_rng_state()
    try:
        model = build_method(cfg, total_iterations=1000, resuming=True).to(device).train()
        model.begin_step(False)  # as on most steps of a run: the diagnostics are computed on the logged ones
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9)
        teacher, views = to_device(probe_batch(cfg, cfg.data.batch_size), device, cfg.train.channels_last)
        autocast = precision_context(precision, device)
        per_group = cfg.train.backward_per_group and model.supports_groups
        times = []
        for _ in range(steps + 1):
            start = time.perf_counter()
            forward_backward(model, teacher, views, None, autocast, per_group)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            synchronize(device)
            times.append(time.perf_counter() - start)
        student = model.student
        student.eval()
        with torch.no_grad(), precision_context(precision, device):
            student(teacher)  # sets things up
            start = time.perf_counter()
            student(teacher)
            synchronize(device)
            batch_seconds = time.perf_counter() - start
    finally:
        torch.random.set_rng_state(rng)
    images = training_images_and_validation()
    return Probe(recipe, precision, statistics.median(times[1:]), batch_seconds * images / cfg.data.batch_size)


def training_images_and_validation() -> int:
    from obow.experiments.demo import training_images, validation_images

    return training_images() + validation_images()


def synchronize(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def choose_by_probe(
    configs: dict[str, Config],
    device: torch.device,
    write_data: bool,
    budget: float = BUDGET_SECONDS,
    precisions: str | None = None,
) -> Choice:
    """The first of ``configs`` (recipe name -> the recipe with the user's settings, best first) whose estimated
    demo fits ``budget`` at the faster of the precisions that :func:`fast_precisions` keeps (or at
    ``precisions``, the user's ``train.precision``, alone); else the cheapest probed. The probe's own seconds
    count against the budget."""
    import torch

    from obow.training.run.busy import others_now, threads_for
    from obow.training.run.threads import available_cores

    start = time.perf_counter()
    previous = torch.get_num_threads()
    # the threads the run will train on: those that other processes' work leaves (obow.training.run.busy)
    others = others_now() if device.type == "cpu" else None
    if others is not None:
        torch.set_num_threads(threads_for(others, available_cores(), previous))
    try:
        return probe_recipes(configs, device, write_data, budget, precisions, start)
    finally:
        torch.set_num_threads(previous)


def probe_recipes(
    configs: dict[str, Config],
    device: torch.device,
    write_data: bool,
    budget: float,
    precisions: str | None,
    start: float,
) -> Choice:
    """:func:`choose_by_probe`'s probes, on the threads it set, from ``start`` (its clock)."""
    from obow.training.run.precision import resolve_precision

    kept = (resolve_precision(precisions, device),) if precisions else fast_precisions(device)
    probes: list[Probe] = []
    best: tuple[float, Probe] | None = None
    for recipe, cfg in configs.items():
        measured = [probe(cfg, device, recipe, precision) for precision in kept]
        probes.extend(measured)
        fastest = min(measured, key=lambda p: p.step_seconds)
        spent = time.perf_counter() - start
        estimate = spent + estimate_seconds(cfg, fastest, write_data)
        if best is None or estimate < best[0]:
            best = (estimate, fastest)
        if estimate <= BUDGET_SHARE * budget:
            return Choice(recipe, fastest.precision, estimate, tuple(probes), spent, True)
    assert best is not None, "no recipe to probe"
    return Choice(best[1].recipe, best[1].precision, best[0], tuple(probes), time.perf_counter() - start, False)
