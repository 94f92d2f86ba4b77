"""Is the data pipeline fast enough to keep the training step busy?

Measures, for a recipe's views (teacher view + crops + patches, as ``obow pretrain`` makes them):

* the augmentation rate of one worker (images/s of ``ImageDataset`` + ``OBoWViews`` in one process, JPEG
  decoding included);
* the DataLoader's rate with ``--workers`` worker processes (pinned memory when a GPU is used);
* the rate at which a training step consumes images on ``--device`` (a few real steps),

and prints how many workers one training process needs: consumption / per-worker rate.

    python benchmarks/loader_throughput.py --config imagenette_resnet18 --data /tmp/imagenette/train
    python benchmarks/loader_throughput.py --config imagenette_resnet18          # synthetic 160 px JPEGs
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from obow.config import load_config
from obow.data.folders import EpochSampler, ImageDataset, build_loader, scan_images
from obow.data.transforms import OBoWViews
from obow.methods.obow import OBoW
from obow.training.run.precision import precision_context
from obow.training.step.shared import forward_backward


def synthetic_folder(root: Path, count: int, size: int) -> Path:
    rng = np.random.default_rng(0)
    for i in range(count):
        pixels = rng.integers(0, 255, size=(size, size, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / f"{i:05d}.jpg", quality=85)
    return root


def rate_one_worker(dataset: ImageDataset, count: int) -> float:
    start = time.perf_counter()
    for i in range(count):
        dataset[(i % len(dataset), i)]
    return count / (time.perf_counter() - start)


def rate_loader(dataset: ImageDataset, batch: int, workers: int, batches: int, pin: bool) -> float:
    sampler = EpochSampler(len(dataset), batch, seed=0)
    loader = build_loader(dataset, sampler, batch, num_workers=workers, pin_memory=pin)
    it = iter(loader)
    next(it)  # worker start-up is not part of the steady state
    start = time.perf_counter()
    n = 0
    for _ in range(batches):
        try:
            next(it)
        except StopIteration:
            break
        n += batch
    return n / (time.perf_counter() - start)


def rate_step(cfg, batch: int, device: torch.device, precision: str, steps: int) -> float:
    v = cfg.views
    model = OBoW.from_config(cfg.model, total_iterations=1000).to(device).train()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01, momentum=0.9)
    teacher = torch.randn(batch, 3, v.teacher_size, v.teacher_size, device=device)
    groups = ((v.num_crops, v.crop_size), (v.num_patches, v.patch_size))
    views = [torch.randn(batch, n, 3, s, s, device=device) for n, s in groups if n]
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    autocast = precision_context(precision, device)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        forward_backward(model, teacher, views, scaler, autocast, True)
        scaler.step(opt)
        scaler.update()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return steps * batch / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="imagenette_resnet18")
    parser.add_argument("--data", help="an image folder (default: synthetic JPEGs at --size px)")
    parser.add_argument("--size", type=int, default=160, help="side of the synthetic images")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    parser.add_argument("--samples", type=int, default=200, help="images for the one-worker rate")
    parser.add_argument("--steps", type=int, default=3, help="training steps for the consumption rate")
    args = parser.parse_args()
    cfg = load_config(args.config, [f"data.batch_size={args.batch}"])
    device = torch.device(args.device)

    with tempfile.TemporaryDirectory() as tmp:
        root = (
            Path(args.data) if args.data else synthetic_folder(Path(tmp), max(args.samples, 4 * args.batch), args.size)
        )
        dataset = ImageDataset(scan_images(root, labels="none"), OBoWViews(cfg.views))
        per_worker = rate_one_worker(dataset, args.samples)
        loaders = {w: rate_loader(dataset, args.batch, w, batches=8, pin=device.type == "cuda") for w in args.workers}
    consumption = rate_step(cfg, args.batch, device, args.precision, args.steps)

    print(f"\n{args.config} views, batch {args.batch}, {'data ' + args.data if args.data else 'synthetic JPEGs'}")
    print(f"| {'what':34s} | {'images/s':>9s} |")
    print(f"|{'-' * 36}|{'-' * 11}|")
    print(f"| {'augmentation, one worker':34s} | {per_worker:9.1f} |")
    for w, rate in loaders.items():
        print(f"| {f'DataLoader, {w} worker(s)':34s} | {rate:9.1f} |")
    print(f"| {f'training step on {device.type} ({args.precision})':34s} | {consumption:9.1f} |")
    print(
        f"workers needed per training process: {math.ceil(consumption / per_worker)} "
        f"(consumption {consumption:.1f} / per-worker {per_worker:.1f} images/s)"
    )


if __name__ == "__main__":
    main()
