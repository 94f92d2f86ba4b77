"""End-to-end training throughput of a recipe for each data pipeline, with the loader alone and the step alone.

For every pipeline named (``--pipelines workers device``: ``data.pipeline``), the run is built with the training
loop's own builders (:func:`obow.training.build.build_data`, ``build_model``, ``build_optimizer``) on the images of
``--data`` (repeated until there are at least ``--min-images``, so that small folders do not end an epoch every
few batches), then three things are timed, each for ``--steps`` batches, in ``--rounds`` alternating rounds (the
pipelines in a rotated order each round):

* **end to end**: the loader's next batch, then :func:`~obow.training.loop.train_step` on it (what ``obow
  pretrain`` does);
* **loader alone**: the loader's batches only (worker processes decoding and augmenting; or the device pipeline
  gathering and rendering on the device);
* **step alone**: ``train_step`` again and again on one batch already on the device.

The step computes the collapse diagnostics on every ``train.log_every``-th step, as ``obow pretrain`` does
(``--diagnose every logged`` times both settings in the same rounds). ``--compile off networks step`` times each
``train.compile`` setting in the same alternating rounds (``--compile-mode reduce-overhead``: the compiled step
replayed as CUDA graphs; ``graph``: the eager step captured as one CUDA graph, ``--stand-in`` its CPU stand-in);
the warm-up, which compiles or captures (its first step a logged one, so that the logged variant is compiled before
the timing), is timed apart and reported as ``warmup_s``. ``--jsonl FILE`` appends every measurement (each warm-up,
each round of each measure, with the GPU's peak memory and a graphed step's capture time) as a JSON line the moment
it is made, so that a pass stopped by its time limit keeps what it measured. Before each timing of a worker loader, the
batches its workers had prefetched meanwhile are taken untimed, so that a buffer filled during another
measurement is not counted. Images per second count source images (each
makes the recipe's teacher view, crops and patches). Prints a Markdown table; ``--json`` writes the numbers.

    python benchmarks/throughput.py --config cifar10_resnet18 --data /tmp/c10/train --device cuda --workers 12
    python benchmarks/throughput.py --config cifar10_fast --data /tmp/c10/train data.batch_size=512 \\
        train.precision=bf16 train.channels_last=true
    python benchmarks/throughput.py --config cifar10_resnet18 --data /tmp/c10/train --pipelines device \\
        --compile off networks step --warmup 10 --steps 30 --rounds 3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from obow.config import Config, load_config
from obow.data.folders import scan_images
from obow.training.build import build_data, build_model, build_optimizer, prepare_step_model
from obow.training.loop import Run, train_step
from obow.training.run.settle import resolve_pipeline
from obow.training.step import build_step, check_step_mode
from obow.training.step import compiled as compiled_module
from obow.training.step import graphed as graphed_module
from obow.training.step.graphed import GraphedStep


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def endless(loader: Any, sampler: Any) -> Iterator[dict[str, Any]]:
    """The loader's batches epoch after epoch."""
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


@dataclasses.dataclass
class Setup:
    name: str
    cfg: Config
    run: Run
    batches: Iterator[dict[str, Any]]
    prefetched: int  # batches a worker loader holds ready (taken untimed before each timing)
    diagnose_every: int = 1  # the step computes the collapse diagnostics every this many steps
    steps: int = 0
    fixed: dict[str, torch.Tensor] | None = None


def build(name: str, cfg: Config, device: torch.device, min_images: int, diagnose: str = "logged") -> Setup:
    images = scan_images(cfg.data.path, cfg.data.labels, cfg.data.images_per_class)
    repeats = max(1, -(-min_images // len(images)))
    images = dataclasses.replace(
        images, paths=images.paths * repeats, labels=None if images.labels is None else images.labels * repeats
    )
    images, sampler, loader = build_data(cfg, device, images, pipeline=resolve_pipeline(cfg.data.pipeline, device))
    model = build_model(cfg, total_iterations=100_000, device=device).train()
    optimizer = build_optimizer(model, cfg)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.train.precision == "fp16")
    if why := check_step_mode(cfg):
        raise SystemExit(f"throughput.py: {why}")
    step_model = prepare_step_model(model, cfg, device)
    step = build_step(cfg, model, step_model, optimizer, scaler, device)
    run = Run(cfg, Path("."), device, model, step_model, optimizer, scaler, sampler,
              loader, len(images) // cfg.data.batch_size, None, None, step)  # fmt: skip
    workers = cfg.data.num_workers if cfg.data.pipeline == "workers" else 0
    every = cfg.train.log_every if diagnose == "logged" else 1
    return Setup(name, cfg, run, endless(loader, sampler), prefetched=2 * workers, diagnose_every=every)


def step(setup: Setup, batch: dict[str, Any], logged: bool | None = None) -> None:
    """One training step; ``logged``: whether it computes the diagnostics (``None``: as the loop would)."""
    setup.steps += 1
    if logged is None:
        logged = setup.steps % setup.diagnose_every == 0  # as the loop: on its logged steps
    setup.run.model.begin_step(logged, setup.steps - 1)  # as the loop counts the iterations
    train_step(setup.run, batch["image"], setup.cfg.optim.lr)


def timed(setup: Setup, what: str, steps: int, device: torch.device) -> float:
    """Seconds for ``steps`` batches of ``what`` (``end_to_end``, ``loader`` or ``step``)."""
    if what != "step":
        for _ in range(setup.prefetched):
            next(setup.batches)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        if what == "step":
            step(setup, setup.fixed)
        elif what == "loader":
            next(setup.batches)
        else:
            step(setup, next(setup.batches))
    synchronize(device)
    return time.perf_counter() - start


MEASURES = ("end_to_end", "loader", "step")


def graph_state(setup: Setup) -> dict[str, Any]:
    """A graphed step's state (``train.compile=graph``): captured, its capture's seconds, replays, why it stayed
    eager; nothing for another step."""
    step_ = setup.run.step
    if not isinstance(step_, GraphedStep):
        return {}
    return {"captured": step_.captured, "capture_s": step_.capture_s, "replays": step_.replays,
            "eager_why": step_.eager_why}  # fmt: skip


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> dict[str, float]:
    """The GPU memory peak since the last reset, in GiB (nothing on a CPU)."""
    if device.type != "cuda":
        return {}
    return {"peak_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 3)}


class Records:
    """``record(**fields)``: one JSON line appended to ``path`` at once (flushed), with the time since the start;
    nothing without a path."""

    def __init__(self, path: str | None, common: dict[str, Any]) -> None:
        self.path = Path(path) if path else None
        self.common = common
        self.start = time.perf_counter()

    def __call__(self, **fields: Any) -> None:
        if self.path is None:
            return
        line = {**self.common, **fields, "t_s": round(time.perf_counter() - self.start, 2)}
        with self.path.open("a") as f:
            f.write(json.dumps(line) + "\n")


def benchmark_config(
    config: str, data: str, pipeline: str, workers: int, device: torch.device, cache_dir: str | None, overrides: list
) -> Config:
    """The recipe ``config`` on the images in ``data`` with ``pipeline`` on ``device``, as the benchmarks run it
    (``cache_dir``: the device pipeline's ``data.cache_dir``; ``overrides``: the command line's, applied last)."""
    items = [f"data.path={data}", f"data.pipeline={pipeline}", f"data.num_workers={workers}",
             f"train.device={device.type}"]  # fmt: skip
    if cache_dir:
        items.append(f"data.cache_dir={cache_dir}")
    return load_config(config, [*items, *overrides])


def build_parser() -> argparse.ArgumentParser:
    """The command line (tests/test_benchmarks.py parses the docs' commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--data", required=True, help="a folder of training images")
    parser.add_argument("--pipelines", nargs="+", default=["workers", "device"], choices=["workers", "device"])
    parser.add_argument("--workers", type=int, default=8, help="loader workers of the workers pipeline")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=30, help="batches timed per measurement")
    parser.add_argument("--warmup", type=int, default=5, help="untimed end-to-end steps per pipeline first")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--min-images", type=int, default=10_000)
    parser.add_argument("--cache-dir", default=None, help="data.cache_dir of the device pipeline")
    parser.add_argument("--json", default=None, help="write the numbers here")
    parser.add_argument("--label", default="", help="a name for this setting in the output")
    parser.add_argument(
        "--diagnose",
        nargs="+",
        default=["logged"],
        choices=["logged", "every"],
        help="collapse diagnostics on the loop's logged steps (every train.log_every-th, as obow "
        "pretrain) or on every step (as before 2026-11-27); both: compared in the same rounds",
    )
    parser.add_argument(
        "--compile",
        nargs="+",
        default=None,
        choices=["off", "networks", "step", "graph"],
        help="train.compile settings timed in the same rounds (default: the recipe's own)",
    )
    parser.add_argument(
        "--stand-in",
        action="store_true",
        help="train.compile=graph on a CPU: the tape that stands in for a CUDA graph (a dry run of the plumbing)",
    )
    parser.add_argument(
        "--jsonl",
        default=None,
        help="append each measurement here as a JSON line the moment it is made (a pass cut short keeps them)",
    )
    parser.add_argument(
        "--compile-mode",
        default="default",
        choices=["default", "reduce-overhead"],
        help="the compiled step's mode (train.compile=step): reduce-overhead replays it as CUDA graphs",
    )
    parser.add_argument(
        "--compile-backend",
        default="inductor",
        help="the compiled step's Dynamo backend (aot_eager: a dry run of the plumbing without Inductor's compiler)",
    )
    parser.add_argument(
        "--measures", nargs="+", default=list(MEASURES), choices=MEASURES, help="what is timed (default: all three)"
    )
    parser.add_argument("overrides", nargs="*", help="recipe overrides, key=value")
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    compiled_module.BACKEND = args.compile_backend
    graphed_module.STAND_IN = args.stand_in
    record = Records(args.jsonl, {"config": args.config, "overrides": args.overrides, "device": args.device})
    cudagraphs = args.compile_mode == "reduce-overhead" and device.type == "cuda" and args.compile_backend == "inductor"
    if cudagraphs:
        compiled_module.OPTIONS = {"triton.cudagraphs": True}  # what torch.compile's mode="reduce-overhead" sets
    setups = []
    compiles = args.compile or [None]
    for pipeline in args.pipelines:
        for diagnose in args.diagnose:
            for compile_ in compiles:
                name = pipeline if len(args.diagnose) == 1 else f"{pipeline}, diagnostics {diagnose}"
                if compile_ is not None and len(compiles) > 1:
                    name = f"{name}, compile {compile_}"
                overrides = [*args.overrides, *([f"train.compile={compile_}"] if compile_ else [])]
                where = (args.config, args.data, pipeline, args.workers, device, args.cache_dir)
                cfg = benchmark_config(*where, overrides)
                setups.append(build(name, cfg, device, args.min_images, diagnose))
    warmup_s = {}
    for setup in setups:
        synchronize(device)
        start = time.perf_counter()
        for i in range(args.warmup):
            # the first warm-up step logged: a compiled step compiles its logged variant here, not in a timing
            step(setup, next(setup.batches), logged=True if i == 0 and setup.diagnose_every > 1 else None)
        setup.fixed = next(setup.batches)
        step(setup, setup.fixed)
        synchronize(device)
        warmup_s[setup.name] = time.perf_counter() - start
        record(setting=setup.name, measure="warmup", seconds=warmup_s[setup.name], steps=args.warmup + 1,
               **graph_state(setup), **peak_memory(device))  # fmt: skip
    measures = [m for m in MEASURES if m in args.measures]
    times: dict[str, dict[str, list[float]]] = {s.name: {m: [] for m in measures} for s in setups}
    for r in range(args.rounds):
        shift = r % len(setups)
        for setup in setups[shift:] + setups[:shift]:
            for what in measures:
                reset_peak_memory(device)
                seconds = timed(setup, what, args.steps, device)
                times[setup.name][what].append(seconds)
                images_per_s = args.steps * setup.cfg.data.batch_size / seconds
                record(setting=setup.name, measure=what, round=r, seconds=seconds, steps=args.steps,
                       batch=setup.cfg.data.batch_size, images_per_s=images_per_s, **graph_state(setup),
                       **peak_memory(device))  # fmt: skip
    cfg = setups[0].cfg
    batch = cfg.data.batch_size
    rates = {
        name: {m: args.steps * batch / statistics.median(t) for m, t in per.items()} for name, per in times.items()
    }
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    label = args.label or f"batch {batch}, {cfg.train.precision}{', channels_last' if cfg.train.channels_last else ''}"
    compiles_step = args.compile is not None and "step" in args.compile
    mode = f", step {args.compile_backend}{' + CUDA graphs' if cudagraphs else ''}" if compiles_step else ""
    print(f"\n{args.config} ({label}{mode}) on {where}; {args.steps} batches x {args.rounds} alternating rounds")
    print("| pipeline | end to end img/s | loader alone img/s | step alone img/s | warm-up s (compilation) |")
    print("|---|---|---|---|---|")
    for name, r in rates.items():
        workers = f" ({args.workers} workers)" if name.startswith("workers") else ""
        cells = " | ".join(f"{r[m]:,.0f}" if m in r else "-" for m in MEASURES)
        print(f"| {name}{workers} | {cells} | {warmup_s[name]:.1f} ({args.warmup + 1} steps) |")
    if len(rates) == 2 and "workers" in rates and "device" in rates and "end_to_end" in measures:
        print(f"device / workers end to end: {rates['device']['end_to_end'] / rates['workers']['end_to_end']:.2f}")
    result = {
        "config": args.config,
        "label": label,
        "device": where,
        "batch": batch,
        "precision": cfg.train.precision,
        "channels_last": cfg.train.channels_last,
        "workers": args.workers,
        "diagnose": args.diagnose,
        "compile": args.compile,
        "compile_mode": args.compile_mode,
        "compile_backend": args.compile_backend,
        "cudagraphs": cudagraphs,
        "warmup_steps": args.warmup + 1,
        "warmup_s": warmup_s,
        "steps": args.steps,
        "rounds": args.rounds,
        "overrides": args.overrides,
        "images_per_s": rates,
        "seconds": times,
        "graph": {s.name: graph_state(s) for s in setups if graph_state(s)},
    }
    record(measure="summary", images_per_s=rates)
    if args.json:
        path = Path(args.json)
        existing = json.loads(path.read_text()) if path.is_file() else []
        path.write_text(json.dumps([*existing, result], indent=1))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
