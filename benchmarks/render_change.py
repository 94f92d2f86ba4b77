"""How far the device pipeline's views moved from the render of a git commit, on real images, and why.

Renders ``--images`` images of one size found under ``--folder`` (e.g. CIFAR-10 written out by ``unpack.py``) with
today's :class:`obow.data.batched_views.BatchedViews` and with the module as it was at ``--baseline REF``
(``benchmarks/render.py``'s loader), on the same draws, and says in levels of 255:

* ``resampling``: each view kind's resized box alone (``resized_crops`` of the same boxes: the teacher's view, the
  crops, the patch grid's view) today against the baseline and against Pillow (torchvision's RandomResizedCrop or
  Resize + CenterCrop of the PIL image, what the worker pipeline makes), split into the pixels whose filter reads
  only the box (``inside``) and those at its edge (``edge``);
* ``jitter``: the crops through every view's colour jitter (all jittered): the mean brightness against Pillow's
  (ColorJitter on the PIL image), in percent, and how many views are Pillow's level for level;
* ``views``: the whole views (``render``, the recipe's augmentations) today against the baseline: mean and largest
  absolute difference, mean signed difference.

    python3 ../shared/data/unpack.py cifar10 /tmp/cifar10 --per-class 103
    python benchmarks/render_change.py --config cifar10_fast --folder /tmp/cifar10/train --baseline 6aa5d3d
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

from obow.config import load_config
from obow.data import batched_views as today

SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".webp"}
JITTER_OPS = [TF.adjust_brightness, TF.adjust_contrast, TF.adjust_saturation, TF.adjust_hue]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--folder", type=Path, required=True, help="images of one size, in any sub-folders")
    parser.add_argument("--baseline", default="6aa5d3d", help="a git commit whose render is compared")
    parser.add_argument("--images", type=int, default=1024, help="the first N images, by path")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--json", type=Path)
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. views.crop_size=32")
    return parser


def baseline_module(ref: str):
    spec = importlib.util.spec_from_file_location("benchmark_render", Path(__file__).with_name("render.py"))
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    return render.baseline_module(ref)


def on_levels(module) -> bool:
    """Whether a baseline's render works in 8-bit levels (issue 67 on) rather than floats in [0, 1]."""
    return hasattr(module, "to_levels")


def read_images(folder: Path, n: int) -> np.ndarray:
    paths = sorted(p for p in folder.rglob("*") if p.suffix.lower() in SUFFIXES)[:n]
    if not paths:
        raise SystemExit(f"render_change.py: no images under {folder}")
    images = [np.asarray(Image.open(p).convert("RGB")) for p in paths]
    if len({im.shape for im in images}) > 1:
        raise SystemExit(f"render_change.py: the images under {folder} are of several sizes; one size is compared")
    return np.stack(images)


def inside(start: torch.Tensor, length: torch.Tensor, out: int) -> torch.Tensor:
    """Which of ``out`` output pixels of boxes ``[*]`` from ``start`` over ``length`` read only the box with Pillow's
    filter (its triangle reaches ``max(1, length / out)`` pixels from the centre: no pixel centre outside the box
    within that reach; when enlarging, also where bilinear sampling, roi_align's, reads only the box)."""
    scale = length / out
    centre = start[..., None] + (torch.arange(out, dtype=torch.float64) + 0.5) * scale[..., None]
    reach = scale.clamp_min(1.0)[..., None]
    first, last = start[..., None] - 0.5, (start + length)[..., None] + 0.5  # the centres of the pixels beyond
    return (centre - reach >= first - 1e-9) & (centre + reach <= last + 1e-9)


def split(diff: torch.Tensor, mask: torch.Tensor | None) -> dict[str, float]:
    out = {"mean": float(diff.mean()), "max": float(diff.max())}
    if mask is not None:
        out |= {"inside_mean": float(diff[mask].mean()), "inside_max": float(diff[mask].max())}
        if bool((~mask).any()):
            out |= {"edge_mean": float(diff[~mask].mean()), "edge_max": float(diff[~mask].max())}
    return out


def resampling(imgs: np.ndarray, images: torch.Tensor, old, params, cfg) -> dict[str, dict]:
    """Each view kind's box resized today, at the baseline and by Pillow (levels, ``[n, m, 3, s, s]``)."""
    n, height, width = imgs.shape[:3]
    result = {}
    kinds = {"teacher": (params.teacher_box[:, None], cfg.teacher_size)}
    if params.crops is not None:
        kinds["crops"] = (params.crops.boxes, cfg.crop_size)
    if params.grid is not None:
        kinds["patch grid"] = (params.grid.boxes, cfg.patch_grid_size)
    for kind, (boxes, size) in kinds.items():
        whole = torch.tensor([[[0, 0, height, width]]]).expand(n, 1, 4) if kind == "teacher" else None
        now = today.resized_crops(images, boxes, size, whole).double()
        # a render before issue 67 filtered the teacher's box with roi_align, reading beyond it: no bounds
        before = (
            old.resized_crops(images, boxes, size, whole) if on_levels(old) else old.resized_crops(images, boxes, size)
        ).double()
        if kind == "teacher":
            pil = [[v2.CenterCrop(size)(v2.Resize(cfg.teacher_resize)(Image.fromarray(im)))] for im in imgs]
            mask = None  # the filter reads the whole image: no box edge
        else:
            pil = [[Image.fromarray(im).crop((x, y, x + w, y + h)).resize((size, size), Image.BILINEAR)
                    for y, x, h, w in b.tolist()] for im, b in zip(imgs, boxes, strict=True)]  # fmt: skip
            b = boxes.double()
            rows, cols = inside(b[..., 0], b[..., 2], size), inside(b[..., 1], b[..., 3], size)
            mask = (rows[..., :, None] & cols[..., None, :])[:, :, None].expand_as(now)
        theirs = torch.from_numpy(np.stack([np.stack([np.asarray(p) for p in row]) for row in pil]))
        theirs = theirs.permute(0, 1, 4, 2, 3)
        reduction = (boxes[..., 2:].double() / size).flatten()
        result[kind] = {
            "views": int(boxes.shape[0] * boxes.shape[1]),
            "box_per_view": [float(reduction.min()), float(reduction.median()), float(reduction.max())],
            "inside_share": None if mask is None else float(mask.double().mean()),
            "today_vs_baseline": split((now - before).abs(), mask),
            "today_vs_pillow": split((now - theirs.double()).abs(), mask),
            "baseline_vs_pillow": split((before - theirs.double()).abs(), mask),
        }
    return result


def jitter(images: torch.Tensor, old, params, cfg) -> dict[str, dict]:
    """The crops (today's resampling) through each view's colour jitter, today, at the baseline (on floats in
    [0, 1] before issue 67) and by Pillow."""
    x = today.resized_crops(images, params.crops.boxes, cfg.crop_size).flatten(0, 1)
    p = params.crops.photo.flatten()
    every = torch.ones(len(x), dtype=torch.bool)
    unit = 1.0 if on_levels(old) else 255.0
    made = {"today": today.color_jitter(x, p.factors, p.order, every),
            "baseline": old.color_jitter(x / unit, p.factors, p.order, every) * unit}  # fmt: skip
    theirs = []
    for view, factors, order in zip(x, p.factors, p.order.tolist(), strict=True):
        img = Image.fromarray(view.permute(1, 2, 0).to(torch.uint8).numpy())
        for k in order:
            img = JITTER_OPS[k](img, float(factors[k]))
        theirs.append(torch.from_numpy(np.array(img)).permute(2, 0, 1).float())
    pil = torch.stack(theirs)
    out = {}
    for name, a in made.items():
        relative = (a.mean(dim=(1, 2, 3)) / pil.mean(dim=(1, 2, 3)) - 1).numpy() * 100
        out[name] = {
            "brightness_vs_pillow_pct": [float(np.percentile(relative, q)) for q in (5, 50, 95)],
            "brightness_vs_pillow_pct_mean": float(relative.mean()),
            "pixel_vs_pillow_mean": float((a - pil).abs().mean()),
            "pillows_level_for_level": f"{sum(torch.equal(a[i], pil[i]) for i in range(len(x)))}/{len(x)}",
        }
    return out


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    cfg = load_config(args.config, args.overrides).views
    imgs = read_images(args.folder, args.images)
    images = torch.from_numpy(imgs).permute(0, 3, 1, 2).contiguous()
    old = baseline_module(args.baseline)
    sizes = torch.tensor([imgs.shape[1:3]]).expand(len(imgs), 2)
    now_views, old_views = today.BatchedViews(cfg), old.BatchedViews(cfg)
    draws = now_views.draw(len(imgs), torch.Generator().manual_seed(args.seed))
    params = now_views.place(draws, sizes)
    std = torch.tensor(cfg.std).view(3, 1, 1)  # a normalised difference times std is one in [0, 1]
    rendered = [
        v.render(images, v.place(v.draw(len(imgs), torch.Generator().manual_seed(args.seed)), sizes))
        for v in (now_views, old_views)
    ]
    views = {}
    for key in rendered[0]:
        diff = ((rendered[0][key] - rendered[1][key]) * std * 255).double()
        views[key] = {
            "mean": float(diff.abs().mean()),
            "max": float(diff.abs().max()),
            "signed_mean": float(diff.mean()),
        }
    result = {
        "config": args.config,
        "overrides": args.overrides,
        "folder": str(args.folder),
        "images": len(imgs),
        "size": list(imgs.shape[1:3]),
        "baseline": args.baseline,
        "seed": args.seed,
        "resampling": resampling(imgs, images, old, params, cfg),
        "jitter": jitter(images, old, params, cfg) if params.crops is not None else None,
        "views": views,
    }
    print(f"{len(imgs)} images of {imgs.shape[1]}x{imgs.shape[2]} px, {args.config}'s views, today against "
          f"{args.baseline} and Pillow, in levels of 255 (mean / max; inside the box | at its edge):")  # fmt: skip
    for kind, r in result["resampling"].items():
        print(f"  {kind}: {r['views']} views, box/view {r['box_per_view'][0]:.2f}-{r['box_per_view'][2]:.2f}")
        for name in ("today_vs_baseline", "today_vs_pillow", "baseline_vs_pillow"):
            d = r[name]
            line = f"    {name:19s} {d['mean']:.3f} / {d['max']:.2f}"
            if "inside_mean" in d:
                line += f"  (inside {d['inside_mean']:.3f} / {d['inside_max']:.2f}"
                line += f" | edge {d['edge_mean']:.3f} / {d['edge_max']:.2f})" if "edge_mean" in d else ")"
            print(line)
    if result["jitter"]:
        for name, j in result["jitter"].items():
            low, _, high = j["brightness_vs_pillow_pct"]
            print(f"  jitter, {name}: brightness vs Pillow's {j['brightness_vs_pillow_pct_mean']:+.2f} % (5-95 %: "
                  f"{low:+.2f} to {high:+.2f}), Pillow's level for level: {j['pillows_level_for_level']}")  # fmt: skip
    for key, d in views.items():
        print(f"  whole {key}: today - baseline {d['mean']:.3f} / {d['max']:.2f}, signed mean {d['signed_mean']:+.3f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
