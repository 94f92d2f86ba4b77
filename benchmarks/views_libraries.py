"""Batched student crops with each image's own parameters: obow's own path against the libraries made for it.

One student crop group of a recipe (``views.num_crops`` random-resized crops of ``views.crop_size`` px with colour
jitter, grayscale, blur, flip and normalisation, every image with its own parameters) made from a batch of
decoded ``uint8`` images already on ``--device``, by:

* ``obow``: :class:`obow.data.batched_views.BatchedViews` (parameters drawn on the CPU, Pillow's resampling filter
  as two batched matrix products for all crops, batched colour maths, one grouped convolution for the blur);
* ``kornia``: ``kornia.augmentation`` (per-sample parameters by default): RandomResizedCrop, ColorJitter,
  RandomGrayscale, RandomGaussianBlur, RandomHorizontalFlip, Normalize in an ``AugmentationSequential``;
* ``torchvision``: ``torchvision.transforms.v2`` on one image at a time (its batched transforms share one draw of
  the parameters per call, so per-image parameters need a loop).

Alternating rounds; prints crops per second. Skips a library that is not installed.

    python benchmarks/views_libraries.py --config cifar10_resnet18 --device cuda --batch 512
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torchvision.transforms import v2

from obow.config import load_config
from obow.data.batched_views import BatchedViews, place_boxes


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def obow_crops(views: BatchedViews, generator: torch.Generator) -> Callable[[torch.Tensor], torch.Tensor]:
    cfg = views.cfg

    def make(images: torch.Tensor) -> torch.Tensor:
        group = views._draw_group(images.shape[0], cfg.num_crops, cfg.crop_scale, True, generator)
        sizes = torch.tensor([images.shape[-2:]]).expand(images.shape[0], cfg.num_crops, 2)  # the boxes on the images
        group = dataclasses.replace(group, boxes=place_boxes(group.draws, sizes))
        return views._render_group(images, group, cfg.crop_size)

    return make


def kornia_crops(cfg, side: int, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor] | None:
    try:
        import kornia.augmentation as K
    except ImportError:
        return None
    v = cfg
    kernel = 2 * max(1, math.ceil(3 * v.blur_sigma[1])) + 1
    aug = K.AugmentationSequential(
        K.RandomResizedCrop((v.crop_size, v.crop_size), scale=tuple(v.crop_scale)),
        K.ColorJitter(*v.color_jitter, p=v.color_jitter_prob),
        K.RandomGrayscale(p=v.grayscale_prob),
        K.RandomGaussianBlur((kernel, kernel), tuple(v.blur_sigma), p=v.blur_prob),
        K.RandomHorizontalFlip(),
        K.Normalize(mean=torch.tensor(v.mean), std=torch.tensor(v.std)),
    ).to(device)

    def make(images: torch.Tensor) -> torch.Tensor:
        x = images.float().div(255).repeat_interleave(v.num_crops, dim=0)
        return aug(x).view(images.shape[0], v.num_crops, 3, v.crop_size, v.crop_size)

    return make


def torchvision_crops(cfg) -> Callable[[torch.Tensor], torch.Tensor]:
    v = cfg
    kernel = 2 * max(1, math.ceil(3 * v.blur_sigma[1])) + 1
    one = v2.Compose(
        [
            v2.RandomResizedCrop(v.crop_size, scale=tuple(v.crop_scale), antialias=True),
            v2.RandomApply([v2.ColorJitter(*v.color_jitter)], p=v.color_jitter_prob),
            v2.RandomGrayscale(p=v.grayscale_prob),
            v2.RandomApply([v2.GaussianBlur(kernel, tuple(v.blur_sigma))], p=v.blur_prob),
            v2.RandomHorizontalFlip(),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(mean=list(v.mean), std=list(v.std)),
        ]
    )

    def make(images: torch.Tensor) -> torch.Tensor:
        return torch.stack([torch.stack([one(img) for _ in range(v.num_crops)]) for img in images])

    return make


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--side", type=int, default=0, help="decoded image side (default: the recipe's views')")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip", nargs="*", default=[], help="methods to leave out")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    cfg = load_config(args.config).views
    side = args.side or max(cfg.teacher_resize, cfg.patch_grid_size)
    images = torch.randint(0, 256, (args.batch, 3, side, side), dtype=torch.uint8, device=device)
    makers = {"obow": obow_crops(BatchedViews(cfg, side), torch.Generator().manual_seed(0))}
    kornia = kornia_crops(cfg, side, device)
    if kornia is not None:
        makers["kornia"] = kornia
    makers["torchvision"] = torchvision_crops(cfg)
    makers = {k: f for k, f in makers.items() if k not in args.skip}
    for make in makers.values():
        make(images)  # warm-up
    times: dict[str, list[float]] = {k: [] for k in makers}
    for r in range(args.repeats):
        names = list(makers)
        for name in names[r % len(names) :] + names[: r % len(names)]:
            synchronize(device)
            start = time.perf_counter()
            makers[name](images)
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    rates = {k: args.batch * cfg.num_crops / statistics.median(t) for k, t in times.items()}
    print(f"\n{args.config}: {cfg.num_crops} x {cfg.crop_size} px crops of {side} px images, batch {args.batch}, "
          f"{args.device}; median of {args.repeats} alternating rounds")  # fmt: skip
    print("| method | crops/s | obow / method |")
    print("|---|---|---|")
    for name, rate in rates.items():
        print(f"| {name} | {rate:,.0f} | {rates['obow'] / rate:.2f} |")
    return rates


if __name__ == "__main__":
    main(sys.argv[1:])
