"""Wall-clock budgets: how many epochs of each recipe fit in the same minutes on this machine.

The paper compares methods at equal epochs on GPUs; on a CPU the fair comparison of a method with a cheap
step (MoCo v2: two views) against one with a dear step (OBoW full: a teacher view, 2 crops and 5 patches) is
equal wall-clock time. :func:`seconds_per_step` times real training steps of several recipes **in alternating
rounds**, so that the machine's noise (a neighbour's job, frequency changes) falls on all of them alike and
their *ratio* is what it is on a quiet machine; :func:`plan_epochs` turns minutes into whole epochs;
:func:`short_run_warmup` is the warm-up rule for runs shorter than their recipe.

The timed step is the training loop's own (loader, ``forward_backward`` under the recipe's precision, the
optimiser), with the batches loaded in the timing process (``num_workers=0``): on a 2-core machine the
loader's augmentations compete with the step for the same cores, so a serial step is the honest price of an
image, and it charges a recipe with more views for its dearer augmentations.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import replace
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


def seconds_per_step(configs: dict[str, Any], rounds: int = 4, skip: int = 1) -> dict[str, float]:
    """Median seconds of a training step of every config in ``configs`` (name -> :class:`obow.config.Config`),
    timed in ``skip + rounds`` alternating rounds (one step of each config per round; the first ``skip`` rounds
    warm up and are not counted). Steps run on the CPU (or the config's CUDA device) with the config's batch,
    views, precision and memory format, loading their batch in this process."""
    import torch

    from obow.data.folders import EpochSampler, ImageDataset, build_loader, scan_images
    from obow.methods import build_views
    from obow.training.loop import build_model, build_optimizer, forward_backward, precision_context, to_device

    if rounds < 1 or skip < 0:
        raise ValueError(f"need rounds >= 1 and skip >= 0, got {rounds} and {skip}")
    cuda = torch.cuda.is_available() and any(_wants_cuda(c) for c in configs.values())
    device = torch.device("cuda" if cuda else "cpu")
    steps: dict[str, Any] = {}
    for name, cfg in configs.items():
        cfg = replace(cfg, data=replace(cfg.data, num_workers=0))
        images = scan_images(cfg.data.path, cfg.data.labels, cfg.data.images_per_class)
        sampler = EpochSampler(len(images), cfg.data.batch_size, seed=cfg.train.seed)
        loader = build_loader(ImageDataset(images, build_views(cfg)), sampler, cfg.data.batch_size)
        batches = _endless(loader, sampler)
        model = build_model(cfg, total_iterations=1000, device=device, resuming=True).train()
        optimizer = build_optimizer(model, cfg)
        scaler = torch.amp.GradScaler(device.type, enabled=cfg.train.precision == "fp16")
        per_group = cfg.train.backward_per_group and model.supports_groups

        def step(cfg=cfg, batches=batches, model=model, optimizer=optimizer, scaler=scaler, per_group=per_group):
            batch = next(batches)
            teacher, views = to_device(batch["image"], device, cfg.train.channels_last)
            optimizer.zero_grad(set_to_none=True)
            autocast = precision_context(cfg.train.precision, device)
            forward_backward(model, teacher, views, scaler, autocast, per_group)
            scaler.step(optimizer)
            scaler.update()
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        steps[name] = step
    times: dict[str, list[float]] = {name: [] for name in configs}
    for r in range(skip + rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            if r >= skip:
                times[name].append(time.perf_counter() - start)
    result = {name: statistics.median(t) for name, t in times.items()}
    for name, seconds in result.items():
        log.info("timed %s: %.2f s a step (median of %d, alternating rounds)", name, seconds, rounds)
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
