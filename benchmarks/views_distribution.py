"""Where the views fall in an image: the device pipeline against the worker pipeline and torchvision's sampler.

Each pipeline renders views of coordinate-coded images (red = x, green = y, on a 0-255 scale across the image;
blue 0), with the recipe's geometry and flips but no colour jitter or blur, the patch grid's nine cells without
jitter (so that its patches tile the patch view); each view's box in the original image is read back from its
pixels (a line fitted to each axis' code). Per group (``crops``: the student's crops; ``grid``: the patch view),
over the non-grey views: the box's area share of the image, aspect ``log(w / h)``, centre, whether it reaches
outside the image's central square, whether it is upsampled (fewer than one source pixel of the cached image per
output pixel on an axis), its area outside the teacher's view; and the flip and grey rates. Each measure of the
device pipeline is compared with the worker pipeline's (PIL, :mod:`obow.data.transforms`) and torchvision's
``RandomResizedCrop.get_params`` on the same image size, by two-sample KS tests (continuous measures) and
chi-square tests (rates). ``tests/test_device_views_distribution.py`` runs the same measures.

    python benchmarks/views_distribution.py --images 1500 --json docs/results/views_distribution.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from scipy import stats
from torchvision.transforms import v2

from obow.config import load_config
from obow.data.transforms import OBoWViews

#: The views a measurement renders: the recipe's geometry and flips, nothing that moves the coded values.
GEOMETRY_ONLY = ["views.color_jitter_prob=0", "views.blur_prob=0", "views.patch_jitter=0", "views.num_patches=9"]
#: The shapes measured, (height, width): ImageNet's most common landscape and portrait ones, and a square.
SHAPES = {"landscape": (375, 500), "portrait": (500, 375), "square": (375, 375)}


def coded_image(height: int, width: int) -> np.ndarray:
    """``[height, width, 3]`` uint8: red the column, green the row, each from 0 to 255 across the image."""
    y, x = np.mgrid[0:height, 0:width]
    code = np.stack([x * 255 / max(width - 1, 1), y * 255 / max(height - 1, 1), np.zeros_like(x, float)], axis=-1)
    return np.round(code).astype(np.uint8)


def ends(profile: np.ndarray, extent: int) -> tuple[float, float]:
    """The image coordinate (pixel centres, 0 to ``extent - 1``) read at the first and last sample of ``profile``
    (codes along one axis of a view), from a least-squares line."""
    slope, intercept = np.polyfit(np.arange(len(profile)), profile * (extent - 1) / 255, 1)
    return float(intercept), float(intercept + slope * (len(profile) - 1))


def axis_box(first_last: list[tuple[float, float]], samples: int) -> tuple[float, float]:
    """``(start, length)`` of a box sampled at ``samples`` pixel centres whose outermost centres are among
    ``first_last``: the samples sit at ``start + (j + 1/2) * length / samples - 1/2``."""
    lo, hi = min(min(p) for p in first_last), max(max(p) for p in first_last)
    length = (hi - lo) * samples / (samples - 1)
    return lo - 0.5 * length / samples + 0.5, length


def read_box(patches: np.ndarray, side: int, size: tuple[int, int]) -> tuple[np.ndarray, bool, bool]:
    """The box ``(top, left, height, width)`` in the image of ``size`` that a view of ``side`` px shows, whether it
    is flipped and whether it is grey, from its pixels ``[P, 3, p, p]`` on a 0-255 scale (``P = 1``, ``p = side``:
    a whole view; else the patches that tile it)."""
    if patches[:, 2].mean() > 1:  # grey: blue is the luma, the codes are lost
        return np.full(4, np.nan), False, True
    xs = [ends(patch[0].mean(axis=0), size[1]) for patch in patches]
    ys = [ends(patch[1].mean(axis=1), size[0]) for patch in patches]
    (left, width), (top, height) = axis_box(xs, side), axis_box(ys, side)
    return np.array([top, left, height, width]), xs[0][1] < xs[0][0], False


def pixels(views: torch.Tensor, cfg) -> np.ndarray:
    """Normalised views ``[..., 3, h, w]`` back on a 0-255 scale."""
    mean, std = (torch.tensor(v).view(3, 1, 1) for v in (cfg.mean, cfg.std))
    return ((views * std + mean) * 255).numpy()


def boxes_of(batch: dict[str, torch.Tensor], v, size: tuple[int, int]) -> dict[str, list]:
    """Every view's :func:`read_box` in a collated batch of views (``v``: the views' config) of an image of ``size``:
    ``teacher``, ``crops`` and ``grid``."""
    out: dict[str, list] = {"teacher": [], "crops": [], "grid": []}
    for teacher in pixels(batch["teacher"], v):
        out["teacher"].append(read_box(teacher[None], v.teacher_size, size))
    for crops in pixels(batch["crops"], v):
        out["crops"] += [read_box(crop[None], v.crop_size, size) for crop in crops]
    for patches in pixels(batch["patches"], v):
        out["grid"].append(read_box(patches, v.patch_grid_size, size))
    return out


def merged(parts: list[dict[str, list]]) -> dict[str, list]:
    return {key: [box for part in parts for box in part[key]] for key in parts[0]}


def worker_boxes(cfg, size: tuple[int, int], n: int, seed: int) -> dict[str, list]:
    """The worker pipeline's views of ``n`` draws on the coded image (PIL and torchvision, one image at a time)."""
    views, image = OBoWViews(cfg.views), Image.fromarray(coded_image(*size))
    torch.manual_seed(seed)
    parts = [boxes_of({k: t.unsqueeze(0) for k, t in views(image).items()}, cfg.views, size) for _ in range(n)]
    return merged(parts)


def device_boxes(cfg, size: tuple[int, int], n: int, folder: Path, copies: int = 64) -> tuple[dict[str, list], float]:
    """The device pipeline's views of ``n`` draws (``copies`` files of the coded image, whole epochs of one batch),
    made as a run makes them (:func:`obow.training.build.build_data`), and how many cached pixels there are per
    original pixel."""
    from obow.training.build import build_data

    (folder / "images" / "a").mkdir(parents=True, exist_ok=True)
    for i in range(copies):
        Image.fromarray(coded_image(*size)).save(folder / "images" / "a" / f"{i:03d}.png")
    cfg.data.path, cfg.data.cache_dir, cfg.data.batch_size = str(folder / "images"), str(folder / "cache"), copies
    _, sampler, loader = build_data(cfg, torch.device("cpu"), pipeline="device")
    parts = []
    for epoch in range(-(-n // copies)):
        sampler.set_epoch(epoch)
        parts += [boxes_of(batch["image"], cfg.views, size) for batch in loader]
    cache = loader.cache
    cached = int(cache.sizes.min()) if hasattr(cache, "sizes") else cache.side  # before version 3: S px squares
    return {k: v[: n * len(v) // (len(parts) * copies)] for k, v in merged(parts).items()}, cached / min(size)


def sampler_boxes(v, size: tuple[int, int], group: str, n: int, seed: int) -> list:
    """``n`` boxes of torchvision's own ``RandomResizedCrop.get_params`` for ``group`` on an image of ``size``."""
    torch.manual_seed(seed)
    scale = list(v.crop_scale if group == "crops" else v.patch_scale)
    img = torch.zeros(3, *size)
    return [
        (np.array(v2.RandomResizedCrop.get_params(img, scale, [3 / 4, 4 / 3]), float), False, False) for _ in range(n)
    ]


def measures(boxes: list, v, size: tuple[int, int], group: str, cached_scale=1.0, teacher=None) -> dict:
    """Per box of ``group`` on an image of ``size``: area share, log aspect, centre (relative), reach outside the
    central square, upsampled (``cached_scale``: cached pixels per original pixel), area share outside
    ``teacher``'s box; flip and grey rates over all views."""
    h_img, w_img = size
    side = v.crop_size if group == "crops" else v.patch_grid_size
    b = np.array([box for box, _, grey in boxes if not grey])
    top, left, h, w = (np.round(b * cached_scale) / cached_scale).T  # boxes are whole pixels of the (cached) image
    long_lo, long_len = (left, w) if w_img > h_img else (top, h)
    margin = (max(size) - min(size)) / 2
    out = {
        "area share": h * w / (h_img * w_img),
        "aspect log(w/h)": np.log(w / h),
        "centre x": (left + w / 2) / w_img,
        "centre y": (top + h / 2) / h_img,
        "outside the central square": (long_lo < margin - 1) | (long_lo + long_len > margin + min(size) + 1)
        if margin > 0
        else np.zeros(len(b), bool),  # fmt: skip
        "upsampled": np.minimum(h, w) * cached_scale < side - 0.5,
    }
    if teacher is not None:
        t_top, t_left, t_h, t_w = teacher
        inter_h = np.clip(np.minimum(top + h, t_top + t_h) - np.maximum(top, t_top), 0, None)
        inter_w = np.clip(np.minimum(left + w, t_left + t_w) - np.maximum(left, t_left), 0, None)
        out["area outside the teacher's view"] = 1 - inter_h * inter_w / (h * w)
    out["flipped"] = np.array([flip for _, flip, grey in boxes if not grey])
    out["grey"] = np.array([grey for _, _, grey in boxes])
    return out


def compare(a: dict, b: dict) -> dict:
    """Per measure: the median (rates: the share) of each and the test of their difference (``D`` and ``p`` of a
    two-sample KS test, ``p`` of a chi-square test for rates)."""
    out = {}
    for key in a.keys() & b.keys():
        x, y = a[key], b[key]
        if x.dtype == bool:
            table = np.array([[x.sum(), len(x) - x.sum()], [y.sum(), len(y) - y.sum()]]) + 0.5
            out[key] = {"a": float(x.mean()), "b": float(y.mean()), "p": float(stats.chi2_contingency(table).pvalue)}
        else:
            ks = stats.ks_2samp(x, y)
            out[key] = {
                "a": float(np.median(x)),
                "b": float(np.median(y)),
                "D": float(ks.statistic),
                "p": float(ks.pvalue),
            }
    return out


def config(recipe: str, overrides: list[str] = ()):
    return load_config(recipe, [*GEOMETRY_ONLY, "train.device=cpu", "data.pipeline=device", *overrides])


def measure_shape(cfg, size: tuple[int, int], n: int, seed: int = 0) -> dict:
    """Every group's measures on one image size, for the three samplers, and the device pipeline's comparisons."""
    with tempfile.TemporaryDirectory() as tmp:
        device, cached_scale = device_boxes(cfg, size, n, Path(tmp))
    workers = worker_boxes(cfg, size, n, seed)
    teacher = {name: np.nanmedian(np.array([b for b, _, g in boxes["teacher"] if not g]), axis=0)
               for name, boxes in (("workers", workers), ("device", device))}  # fmt: skip
    result = {"teacher box (top, left, height, width)": {k: v.round(2).tolist() for k, v in teacher.items()}}
    for group in ("crops", "grid"):
        dev = measures(device[group], cfg.views, size, group, cached_scale, teacher["device"])
        wrk = measures(workers[group], cfg.views, size, group, 1.0, teacher["workers"])
        tv = measures(sampler_boxes(cfg.views, size, group, 4 * n, seed + 1), cfg.views, size, group)
        result[group] = {"device vs workers": compare(dev, wrk), "device vs torchvision": compare(dev, tv)}
    return result


def colour_difference(n: int, seed: int = 0) -> dict:
    """The device pipeline's colour jitter against PIL's, both rounding to 8 bits after each operation
    (torchvision's functions on PIL images, what the workers run): ``n`` draws of the paper's factors on
    a photo-like image (colour ramps with noise), each operation alone and all four in a random order; per draw
    the mean absolute difference (in 0-255 levels) and the difference of the views' mean brightness (relative)."""
    from torchvision.transforms.v2 import functional as TF

    from obow.data.batched_views import color_jitter, jitter_ranges

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:64, 0:64] / 63
    smooth = np.stack([0.2 + 0.6 * x, 0.3 + 0.5 * y, 0.7 - 0.5 * x * y], -1)
    image = np.clip(smooth + rng.normal(0, 0.05, smooth.shape), 0, 1)
    pil = Image.fromarray((image * 255).round().astype(np.uint8))
    base = torch.from_numpy(np.array(pil)).permute(2, 0, 1).float()  # 8-bit levels, as the device's colour maths
    ops = [TF.adjust_brightness, TF.adjust_contrast, TF.adjust_saturation, TF.adjust_hue]
    out = {}
    for name, only in {"brightness": 0, "contrast": 1, "saturation": 2, "hue": 3, "all four": None}.items():
        levels, brightness = [], []
        for _ in range(n):
            drawn = [rng.uniform(lo, hi) for lo, hi in jitter_ranges((0.4, 0.4, 0.4, 0.1))]
            if only is not None:  # the others at their identity (exact for the blends, 1e-7 for a hue shift of 0)
                drawn = [drawn[k] if k == only else (0.0 if k == 3 else 1.0) for k in range(4)]
            order = [int(k) for k in rng.permutation(4)]
            worker = pil
            for k in order:
                worker = ops[k](worker, drawn[k]) if only is None or k == only else worker
            ours = color_jitter(base[None], torch.tensor([drawn]), torch.tensor([order]), torch.tensor([True]))[0]
            theirs = torch.from_numpy(np.array(worker)).permute(2, 0, 1).float()
            levels.append(float((ours - theirs).abs().mean()))
            brightness.append(float(ours.mean() / theirs.mean() - 1))
        out[name] = {
            "mean abs levels": float(np.mean(levels)),
            "brightness, mean |relative|": float(np.mean(np.abs(brightness))),
            "brightness, relative, mean": float(np.mean(brightness)),
        }
    return out


def table(results: dict) -> str:
    lines = ["| shape | group | measure | workers | device | KS D (p) / chi2 p |", "|---|---|---|---|---|---|"]
    for shape, result in results.items():
        for group in ("crops", "grid"):
            for key, c in sorted(result[group]["device vs workers"].items()):
                test = f"{c['D']:.3f} ({c['p']:.2g})" if "D" in c else f"{c['p']:.2g}"
                lines.append(f"| {shape} | {group} | {key} | {c['b']:.3f} | {c['a']:.3f} | {test} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="imagenet_resnet50_full")
    parser.add_argument("--images", type=int, default=1500, help="draws per pipeline and shape")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--colour", type=int, default=500, help="draws of the colour jitter comparison")
    parser.add_argument("--json", type=Path)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    colour = colour_difference(args.colour)
    print("colour jitter, device minus workers:", json.dumps(colour, indent=1))
    results = {s: measure_shape(config(args.config, args.overrides), SHAPES[s], args.images) for s in args.shapes}
    print(table(results))
    for shape, result in results.items():
        print(shape, "teacher box:", result["teacher box (top, left, height, width)"])
    if args.json:
        meta = {"config": args.config, "overrides": args.overrides, "images": args.images, "torch": torch.__version__}
        args.json.write_text(json.dumps({"meta": meta, "colour": colour, "shapes": results}, indent=1) + "\n")
    return results


if __name__ == "__main__":
    sys.exit(main() and 0)
