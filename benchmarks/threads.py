"""Training threads: every core (PyTorch's default, and obow's choice for one training process) against one
thread (what a machine busy with other jobs wants), in real ``obow pretrain`` runs, data loading included.

Each round runs the same short pretraining twice, once per setting, in alternating order (the machine's load
drifts), each in a fresh process and run folder, and reads the images/s from the wall time of its epochs
(``epoch_time_s`` of ``log.jsonl``: loading, augmentation and steps). Prints a table and the ratio.

    python benchmarks/threads.py                                  # the demo recipe on generated 32 px images
    python benchmarks/threads.py --config cifar10_fast --data /tmp/cifar10/train --images-per-class 100
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image


def write_images(root: Path, classes: int = 4, per_class: int = 64, size: int = 32) -> Path:
    rng = np.random.default_rng(0)
    for c in range(classes):
        folder = root / f"c{c}"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    return root


def run(args: argparse.Namespace, data: Path, out: Path, threads: int) -> tuple[float, int]:
    """Images/s over the run's epochs (first epoch left out: start-up), and the threads it reported."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    overrides = [
        f"optim.epochs={args.epochs}",
        f"data.num_workers={args.workers}",
        f"train.threads={threads}",
        "train.knn_every=0",
        "train.progress_bar=false",
        "train.tensorboard=false",
        f"data.batch_size={args.batch_size}",
    ]
    if args.images_per_class:
        overrides.append(f"data.images_per_class={args.images_per_class}")
    cmd = [
        sys.executable,
        "-m",
        "obow.cli",
        "pretrain",
        "--config",
        args.config,
        "--data",
        str(data),
        "--out",
        str(out),
    ]
    proc = subprocess.run([*cmd, *overrides], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-2000:])
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    epochs = [r for r in records if r.get("type") == "epoch"]
    steps = epochs[-1]["iteration"] - epochs[0]["iteration"]  # the epochs after the first (start-up)
    seconds = sum(r["epoch_time_s"] for r in epochs[1:])
    header = next(line for line in proc.stderr.splitlines() if "Threads:" in line)
    return steps * args.batch_size / seconds, int(header.split("Threads: ")[1].split()[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="demo")
    parser.add_argument("--data", help="training images (default: generated 32 px images)")
    parser.add_argument("--images-per-class", type=int)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if args.epochs < 2:
        parser.error("--epochs must be at least 2 (the first epoch is left out)")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(args.data) if args.data else write_images(Path(tmp) / "data")
        rates: dict[str, list[float]] = {"every core": [], "one thread": []}
        used: dict[str, int] = {}
        for r in range(args.rounds):
            order = ("every core", "one thread") if r % 2 == 0 else ("one thread", "every core")
            for name in order:
                # "every core": PyTorch's default and obow's choice for one training process; "one thread": what
                # a machine shared with other jobs wants (OMP_NUM_THREADS=1)
                threads = cores if name == "every core" else 1
                rate, threads = run(args, data, Path(tmp) / f"{name.split()[0]}{r}", threads)
                rates[name].append(rate)
                used[name] = threads
                print(f"round {r + 1} {name:8s} {threads} thread(s): {rate:7.1f} images/s", flush=True)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\n{args.config}, {cores} cores, {args.workers} loader worker(s), batch {args.batch_size}, load {load:.1f}")
    print("| setting | threads | images/s (median) |\n|---|---|---|")
    for name in rates:
        print(f"| {name} | {used[name]} | {statistics.median(rates[name]):.1f} |")
    ratio = statistics.median(rates["one thread"]) / statistics.median(rates["every core"])
    print(f"\none thread / every core: {ratio:.2f}x images/s  ({time.strftime('%Y-%m-%d %H:%M')})")


if __name__ == "__main__":
    main()
