"""Speed of a training step: precisions and memory formats compared, or OBoW next to its compute floor.

Two measurements, both on synthetic images put through the recipe's real view transform (so the tensors
have the shapes ``obow pretrain`` sees), with the recipe's batch unless ``--batch`` replaces it, on
``--threads`` intra-op threads (default: every core this process may use):

**Comparison** (``--compare``, or any ``--precision`` other than fp32): the full training step
(:func:`obow.training.loop.train_step`, the function ``obow pretrain`` calls, on a model and optimiser built
by the loop's own builders) in fp32 and at ``--precision``, each with and without ``train.channels_last``
(``--compare`` at fp32: the two memory formats only). All settings live in one process and are timed in
alternating rounds, each round in a rotated order, so that a neighbour's load hits every setting alike. It
prints, per setting, the median seconds per step, images per second (batch / median), and two speed-ups
over fp32: the ratio of the medians, and the median over rounds of the same round's ratio (the sturdier one
on a shared machine); then one line per setting, e.g. ``fp32 / bf16: R`` (R times faster; below 1: slower).

**Breakdown** (the default at fp32, ``--breakdown`` with another precision): one fresh process per step:

* **OBoW**: the full training step as above;
* **floor**: the same student forward+backward on the same views, the teacher forward, and the weight
  generator's forward+backward over the K words of every level, with nothing else (and the SGD step);
* **supervised**: one forward+backward+SGD step of the same backbone with a linear classifier on one view
  per image at ``--supervised-size`` (default 224, the paper's reference; 0: the recipe's teacher size);

and the peak memory of each (CUDA: ``max_memory_allocated``; CPU: the peak resident set size of the process,
which includes the interpreter and libraries, so the CPU ratios understate differences). It prints a table
and the ratios OBoW / floor, OBoW / supervised and memory OBoW / supervised.

    python benchmarks/step_time.py --config cifar10_fast --precision bf16        # the comparison
    python benchmarks/step_time.py --config imagenette_resnet18 --batch 32       # the breakdown
    python benchmarks/step_time.py --config imagenet_resnet50_full --batch 64 --precision bf16 --breakdown
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn
from torch.utils.data import default_collate

from obow.backbones import build_backbone
from obow.config import Config, load_config
from obow.methods import build_views
from obow.training.build import build_model, build_optimizer, prepare_step_model
from obow.training.loop import Run, train_step
from obow.training.run.precision import native_bf16, precision_context, resolve_precision
from obow.training.step import build_step
from obow.training.step.shared import to_device

MODES = ("obow", "floor", "supervised")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def recipe(args: argparse.Namespace, precision: str, channels_last: bool) -> Config:
    """The recipe with the benchmark's batch, the user's overrides, then the setting measured (last, so that it
    wins over an override of the same key)."""
    batch = [f"data.batch_size={args.batch}"] if args.batch else []
    setting = [f"train.precision={precision}", f"train.channels_last={str(channels_last).lower()}"]
    return load_config(args.config, [*batch, *args.overrides, *setting])


def synthetic_batch(cfg: Config, seed: int = 0) -> dict[str, torch.Tensor]:
    """One batch of views of random-noise images through the recipe's own transform, collated like the loader's
    (``{"teacher": [B, 3, T, T], "crops": [B, n, 3, c, c], ...}``): any method's views, at its sizes."""
    rng = np.random.default_rng(seed)
    side = max(cfg.views.teacher_resize, cfg.views.patch_grid_size, 32)
    transform = build_views(cfg)
    images = [
        Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)) for _ in range(cfg.data.batch_size)
    ]
    return default_collate([transform(img) for img in images])


def training_run(cfg: Config, device: torch.device) -> Run:
    """What :func:`~obow.training.loop.train_step` needs for ``cfg``, from the loop's own builders: model,
    optimiser, scaler (a run's data, logging and checkpointing are not part of a step: left out)."""
    model = build_model(cfg, total_iterations=10_000, device=device).train()
    optimizer = build_optimizer(model, cfg)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.train.precision == "fp16")
    step_model = prepare_step_model(model, cfg, device)
    step = build_step(cfg, model, step_model, optimizer, scaler, device)
    return Run(cfg, Path("."), device, model, step_model, optimizer, scaler, None, None, 1, None, None, step)


def timed_step(run: Run, batch: dict[str, torch.Tensor]) -> Callable[[], None]:
    """One call = one step of ``obow pretrain`` on ``batch``, at the recipe's base learning rate."""
    return lambda: train_step(run, batch, run.cfg.optim.lr)


def round_order(names: Sequence[str], round_index: int) -> list[str]:
    """The order of the settings in round ``round_index``: rotated by one each round, so that every setting
    is timed equally often first (on a cold cache) and right after each of the others."""
    shift = round_index % len(names)
    return [*names[shift:], *names[:shift]]


def time_interleaved(
    steps: dict[str, Callable[[], None]], warmup: int, repeats: int, device: torch.device
) -> dict[str, list[float]]:
    """Seconds of each setting's step in each of ``repeats`` rounds, after ``warmup`` untimed steps of each."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    synchronize(device)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(repeats):
        for name in round_order(list(steps), r):
            start = time.perf_counter()
            steps[name]()
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    return times


def speedups(times: dict[str, list[float]], reference: str) -> dict[str, tuple[float, float]]:
    """Per setting, how many times faster than ``reference`` its step is: (median of the reference / median of
    the setting, median over rounds of the same round's ratio)."""
    ref = times[reference]
    return {
        name: (
            statistics.median(ref) / statistics.median(t),
            statistics.median(a / b for a, b in zip(ref, t, strict=True)),
        )
        for name, t in times.items()
    }


def setting_name(precision: str, channels_last: bool) -> str:
    return precision + (" + channels_last" if channels_last else "")


def compare(args: argparse.Namespace, device: torch.device) -> None:
    precisions = list(dict.fromkeys(("fp32", args.precision)))
    settings = [(p, cl) for cl in (False, True) for p in precisions]
    cfgs = {setting_name(p, cl): recipe(args, p, cl) for p, cl in settings}
    cfg = next(iter(cfgs.values()))
    batch = synthetic_batch(cfg)
    steps = {name: timed_step(training_run(c, device), batch) for name, c in cfgs.items()}
    times = time_interleaved(steps, args.warmup, args.repeats, device)
    ratios = speedups(times, "fp32")
    print(f"\n{describe(args, cfg, device)}; {args.repeats} alternating rounds after {args.warmup} warm-up steps each")
    print(f"| {'setting':22s} | {'median s/step':>13s} | {'img/s':>7s} | {'fp32 / setting':>14s} | {'per round':>9s} |")
    print(f"|{'-' * 24}|{'-' * 15}|{'-' * 9}|{'-' * 16}|{'-' * 11}|")
    for name, t in times.items():
        median = statistics.median(t)
        of_medians, per_round = ratios[name]
        print(
            f"| {name:22s} | {median:13.3f} | {cfg.data.batch_size / median:7.1f} | {of_medians:14.2f} | "
            f"{per_round:9.2f} |"
        )
    for name in list(times)[1:]:
        of_medians, per_round = ratios[name]
        print(f"fp32 / {name}: {of_medians:.2f} (ratio of medians; {per_round:.2f} median of the rounds' ratios)")


def describe(args: argparse.Namespace, cfg: Config, device: torch.device) -> str:
    v, m = cfg.views, cfg.model
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    where += f", native bf16: {'yes' if native_bf16(device) else 'no'} (train.precision=auto -> "
    where += f"{resolve_precision('auto', device)})"
    return (
        f"{args.config}: {m.method}, {m.arch} ({m.stem} stem), batch {cfg.data.batch_size}, teacher {v.teacher_size}"
        f" px, {v.num_crops} x {v.crop_size} + {v.num_patches} x {v.patch_size} px, K={m.num_words}, "
        f"{'+'.join(m.levels)}; {where}"
    )


def measure(args: argparse.Namespace, mode: str) -> dict[str, float]:
    """One step of the breakdown (``mode``), in this process: median seconds and peak memory."""
    torch.manual_seed(0)
    device = torch.device(args.device)
    cfg = recipe(args, args.precision, args.channels_last)
    batch = synthetic_batch(cfg)
    autocast = precision_context(args.precision, device)
    fmt = torch.channels_last if args.channels_last else torch.contiguous_format

    if mode == "obow":
        step = timed_step(training_run(cfg, device), batch)

    elif mode == "floor":
        if cfg.model.method != "obow":
            raise SystemExit(f"the floor is OBoW's (teacher, BoW head); this recipe's method is {cfg.model.method}")
        model = build_model(cfg, total_iterations=10_000, device=device).train()
        opt = build_optimizer(model, cfg)
        teacher, views = to_device(batch, device, args.channels_last)
        words = [model.extractors[lvl].vocabulary.words.clone() for lvl in model.levels]

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            with autocast:
                with torch.no_grad():
                    model.teacher(teacher, levels=model.levels)
                weights = model.predictor.weights(words)
            sum(w.float().sum() for w in weights).backward()
            for group in views:
                with autocast:
                    pooled = model.student(group.flatten(0, 1).contiguous(memory_format=fmt)).pool5
                pooled.float().sum().backward()
            opt.step()

    else:
        m = cfg.model
        backbone = build_backbone(m.arch, m.stem, m.arch_options).to(device).train()
        if args.channels_last:
            backbone.to(memory_format=fmt)
        head = nn.Linear(backbone.num_features, 1000).to(device)
        params = list(backbone.parameters()) + list(head.parameters())
        opt = torch.optim.SGD(params, lr=0.01, momentum=0.9, weight_decay=1e-4)
        size = args.supervised_size or cfg.views.teacher_size
        b = cfg.data.batch_size
        images = torch.randn(b, 3, size, size, device=device).contiguous(memory_format=fmt)
        labels = torch.randint(0, 1000, (b,), device=device)
        scaler = torch.amp.GradScaler(device.type, enabled=args.precision == "fp16")

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            with autocast:
                loss = nn.functional.cross_entropy(head(backbone(images).pool5), labels)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = time_interleaved({mode: step}, args.warmup, args.repeats, device)[mode]
    if device.type == "cuda":
        memory = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        memory = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {"median_s": statistics.median(times), "memory_mib": memory}


def breakdown(args: argparse.Namespace, device: torch.device, argv: Sequence[str]) -> None:
    results = {}
    for mode in MODES:  # one fresh process per mode, so that CPU peak memory is per mode
        cmd = [sys.executable, __file__, "--mode", mode, *argv]
        out = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
        if out.returncode != 0:
            sys.exit(f"{mode} failed:\n{out.stderr}")
        results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    cfg = recipe(args, args.precision, args.channels_last)
    b = cfg.data.batch_size
    print(
        f"\n{describe(args, cfg, device)}; supervised at {args.supervised_size or cfg.views.teacher_size} px; "
        f"{setting_name(args.precision, args.channels_last)}"
    )
    print(f"| {'step':12s} | {'median s':>9s} | {'img/s':>8s} | {'peak MiB':>9s} |")
    print(f"|{'-' * 14}|{'-' * 11}|{'-' * 10}|{'-' * 11}|")
    for mode, r in results.items():
        print(f"| {mode:12s} | {r['median_s']:9.4f} | {b / r['median_s']:8.1f} | {r['memory_mib']:9.0f} |")
    o, f, s = results["obow"], results["floor"], results["supervised"]
    print(
        f"OBoW / floor: {o['median_s'] / f['median_s']:.2f}   OBoW / supervised: {o['median_s'] / s['median_s']:.2f}"
        f"   memory OBoW / supervised: {o['memory_mib'] / s['memory_mib']:.2f}"
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="imagenette_resnet18", help="a built-in recipe or a YAML file")
    parser.add_argument("--batch", type=int, default=0, help="images per step (default: the recipe's batch)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=cores, help=f"intra-op threads (default: {cores}, the cores)")
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    parser.add_argument("--channels-last", action="store_true", help="the breakdown's memory format")
    parser.add_argument(
        "--compare", action="store_true", help="fp32 against --precision, both memory formats (implied by bf16/fp16)"
    )
    parser.add_argument("--breakdown", action="store_true", help="the breakdown too, at --precision")
    parser.add_argument("--supervised-size", type=int, default=224, help="0: the recipe's teacher size")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="recipe overrides, e.g. model.num_words=4096")
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error("--threads must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.mode:  # a child process measuring one step of the breakdown
        print(json.dumps(measure(args, args.mode)))
        return
    if args.compare or args.precision != "fp32":
        compare(args, device)
    if args.breakdown or not (args.compare or args.precision != "fp32"):
        breakdown(args, device, argv)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
