"""The kNN monitor's pass: reading the evaluation images every pass, against decoding them once and keeping them.

:class:`obow.evaluate.monitor.KNNMonitor` keeps its images decoded when they fit (``KEEP_FRACTION`` of the memory
available), so only its first pass reads and decodes them; a pass that reads them again costs the decoding every
time (``data.num_workers`` loader workers, as a run has). This times, in alternating rounds on the same random-init
backbone of ``--config``: a reading monitor's pass, a keeping monitor's first pass (decode + forward + kNN) and its
later passes (forward + kNN), and checks that every pass gives the same numbers (``same_numbers``). Prints the
median seconds of each and writes ``--json``. ``--first-passes N``: N more alternating rounds of a new keeping
monitor's decoding (its first pass less the forward and the kNN) by the recipe's ``data.num_workers`` only (as
before 2026-11-30) against one loader worker per core (:func:`obow.data.folders.decoding_workers`, for 4,096 images
or more), checking that both decode the same pixels.

    python benchmarks/monitor.py --config cifar10_fast --train /tmp/c10/train --val /tmp/c10/test --per-class 500
    python benchmarks/monitor.py --config cifar10_resnet18 --train DIR/train --val DIR/test --device cuda
    python benchmarks/monitor.py --config cifar10_fast --train C10/train --val C10/test --rounds 0 --first-passes 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from obow.backbones import build_backbone
from obow.config import load_config
from obow.data import folders as folders_module
from obow.data.folders import scan_images
from obow.evaluate import monitor as monitor_module
from obow.evaluate.monitor import KNNMonitor


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--train", required=True, type=Path, help="the kNN memory: class folders")
    parser.add_argument("--val", required=True, type=Path, help="the queries: class folders (data.val_path)")
    parser.add_argument("--per-class", type=int, help="training images per class (data.images_per_class)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (the keeping monitor: one pass more)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads on a CPU (0: torch's default)")
    parser.add_argument("--first-passes", type=int, default=0, help="rounds of first passes: asked workers / per core")
    parser.add_argument("--json", type=Path)
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. data.num_workers=8")
    return parser


def timed(monitor: KNNMonitor, backbone: torch.nn.Module, device: torch.device) -> tuple[float, dict[str, float]]:
    start = time.perf_counter()
    numbers = monitor(backbone)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, numbers


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    extra = [f"data.images_per_class={args.per_class}"] if args.per_class else []
    cfg = load_config(args.config, [f"data.val_path={args.val}", "train.knn_every=1", *extra, *args.overrides])
    images = scan_images(args.train, "folders", cfg.data.images_per_class)
    torch.manual_seed(0)
    backbone = build_backbone(cfg.model.arch, cfg.model.stem, cfg.model.arch_options).to(device)
    keeping = KNNMonitor(cfg, images, device)
    if not keeping.keeps_pixels:
        sys.exit(f"the evaluation images do not fit in {monitor_module.KEEP_FRACTION:.0%} of the memory available")
    fraction, monitor_module.KEEP_FRACTION = monitor_module.KEEP_FRACTION, 0.0
    reading = KNNMonitor(cfg, images, device)
    monitor_module.KEEP_FRACTION = fraction
    seconds: dict[str, list[float]] = {"reading": [], "keeping_later": []}
    if args.rounds:
        first, numbers = timed(keeping, backbone, device)
        results = [numbers]
    else:  # --first-passes alone: the decoding only (a CPU's forward over 60,000 images takes minutes a pass)
        first, results = float("nan"), []
        keeping._decode()
    for _ in range(args.rounds):
        for name, monitor in (("reading", reading), ("keeping_later", keeping)):
            took, numbers = timed(monitor, backbone, device)
            seconds[name].append(took)
            results.append(numbers)
    firsts: dict[str, list[float]] = {"asked_workers": [], "per_core": []}
    line, same_pixels = folders_module.DECODING_WORKERS_MIN_IMAGES, True
    pixels = keeping.decoded
    for _ in range(args.first_passes):
        for name, min_images in (("asked_workers", sys.maxsize), ("per_core", line)):
            folders_module.DECODING_WORKERS_MIN_IMAGES = min_images
            start = time.perf_counter()
            decoded = KNNMonitor(cfg, images, device)._decode()
            firsts[name].append(time.perf_counter() - start)
            same_pixels &= pixels is not None and all(
                torch.equal(a.pixels, b.pixels) for a, b in zip(pixels, decoded, strict=True)
            )
    folders_module.DECODING_WORKERS_MIN_IMAGES = line
    summary = {
        "config": args.config,
        "device": str(device),
        "images": len(images) + len(keeping.val_set),
        "num_workers": cfg.data.num_workers,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "keeping_first_s": round(first, 2) if args.rounds else None,
        **{f"{name}_s": round(statistics.median(values), 2) for name, values in seconds.items() if values},
        "rounds": {name: [round(v, 2) for v in values] for name, values in seconds.items()},
        "per_core_workers": folders_module.decoding_workers(len(images) + len(keeping.val_set), cfg.data.num_workers),
        "decoding_rounds": {name: [round(v, 2) for v in values] for name, values in firsts.items()},
        "same_pixels": same_pixels,
        "same_numbers": all(r == results[0] for r in results),
        "knn_top1": results[0]["knn_top1"] if results else None,
    }
    if args.rounds:
        summary["speedup"] = round(summary["reading_s"] / summary["keeping_later_s"], 2)
        print(
            f"{summary['images']} images on {device}: reading every pass {summary['reading_s']:.2f} s, "
            f"keeping: first pass {first:.2f} s, later passes {summary['keeping_later_s']:.2f} s "
            f"({summary['speedup']:.2f}x); the same numbers: {summary['same_numbers']}"
        )
    if args.first_passes:
        asked, per_core = (statistics.median(firsts[name]) for name in ("asked_workers", "per_core"))
        print(
            f"decoding {summary['images']} images: {cfg.data.num_workers} loader worker(s) asked {asked:.2f} s, "
            f"{summary['per_core_workers']} (one per core) {per_core:.2f} s ({asked / per_core:.2f}x; rounds "
            f"{summary['decoding_rounds']['asked_workers']} / {summary['decoding_rounds']['per_core']}); the same "
            f"pixels: {same_pixels}"
        )
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return summary


if __name__ == "__main__":
    main()
