"""One loader worker's images/s on phone-sized photos: each JPEG decoded whole, against decoded at a reduced scale
that keeps the recipe's sharp side (``ImageDataset(draft_side=...)``, what ``obow pretrain`` does), in
alternating rounds, with the recipe's views (decoding, EXIF, crops, colour jitter, blur: a worker's whole work);
then, in alternating rounds too, one process decoding the photos into the device pipeline's image cache (decoding,
EXIF, the resize to the sharp side: ``obow.data.cache._decode``), whole against reduced.

    python benchmarks/photo_decoding.py --config imagenette_fast --size 4032 3024 --rounds 3
    python benchmarks/photo_decoding.py --config imagenette_fast --folder DIR    # your own photos

Without ``--folder`` the photos are scikit-learn's two sample photos resized to ``--size`` and saved as JPEGs
(quality 90) in a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from obow.config import load_config
from obow.data.cache import _decode
from obow.data.folders import ImageDataset, scan_images
from obow.methods import build_views, cache_side

sys.path.insert(0, str(Path(__file__).parent))
from loader_throughput import rate_one_worker  # noqa: E402


def sample_photos(folder: Path, count: int, width: int, height: int) -> Path:
    from sklearn.datasets import load_sample_image

    bases = [Image.fromarray(load_sample_image(name)) for name in ("china.jpg", "flower.jpg")]
    for i in range(count):
        photo = bases[i % 2].resize((width, height), Image.Resampling.BICUBIC).rotate(37 * i)
        photo.save(folder / f"IMG_{i:04d}.jpg", quality=90)
    return folder


def rate_cache_decoding(paths: list[str], side: int, reduced: bool, images: int) -> float:
    """Images/s of ``images`` photos (``paths`` in turn) decoded into the cache at ``side`` by one process."""
    start = time.perf_counter()
    for i in range(images):
        pixels, why = _decode(paths[i % len(paths)], side, exact=False, reduced=reduced)
        assert pixels is not None, why
    return images / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="imagenette_fast")
    parser.add_argument("--folder", help="a folder of photos (default: sample photos of --size)")
    parser.add_argument("--size", nargs=2, type=int, default=[4032, 3024], metavar=("W", "H"))
    parser.add_argument("--photos", type=int, default=8, help="sample photos made (without --folder)")
    parser.add_argument("--images", type=int, default=24, help="images a round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)  # one loader worker's view of the machine
    cfg = load_config(args.config)
    side = cache_side(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.folder) if args.folder else sample_photos(Path(tmp), args.photos, *args.size)
        images = scan_images(folder, labels="none")
        views = build_views(cfg)
        datasets = {"whole": ImageDataset(images, views), "reduced": ImageDataset(images, views, draft_side=side)}
        for dataset in datasets.values():
            rate_one_worker(dataset, 2)  # first reads: the page cache, the transforms' set-up
        rates: dict[str, list[float]] = {name: [] for name in datasets}
        for r in range(args.rounds):
            for name, dataset in datasets.items():
                rates[name].append(rate_one_worker(dataset, args.images))
            print(f"round {r + 1}: " + ", ".join(f"{name} {rates[name][-1]:.1f}" for name in datasets) + " images/s")
        decoded = datasets["reduced"][(0, 0)]
        cache_rates: dict[str, list[float]] = {"whole": [], "reduced": []}
        rate_cache_decoding(images.paths, side, True, 2)
        for r in range(args.rounds):
            for name in cache_rates:
                cache_rates[name].append(rate_cache_decoding(images.paths, side, name == "reduced", args.images))
            line = ", ".join(f"{name} {values[-1]:.1f}" for name, values in cache_rates.items())
            print(f"cache round {r + 1}: {line} images/s")
        stored = _decode(images.paths[0], side, exact=False)[0]
    medians = {name: float(np.median(values)) for name, values in rates.items()}
    cache_medians = {name: float(np.median(values)) for name, values in cache_rates.items()}
    result = {
        "config": args.config,
        "sharp_side": side,
        "photos": args.folder or f"{args.photos} sample photos of {args.size[0]}x{args.size[1]}",
        "images_per_round": args.images,
        "rounds": rates,
        "median_images_per_s": medians,
        "speedup": medians["reduced"] / medians["whole"],
        "views_shapes": {k: list(v.shape) for k, v in decoded["image"].items()},
        "cache_rounds": cache_rates,
        "cache_median_images_per_s": cache_medians,
        "cache_speedup": cache_medians["reduced"] / cache_medians["whole"],
        "cache_stored_shape": list(stored.shape) if stored is not None else None,
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
    }
    print(
        f"{args.config}, sharp side {side} px: whole {medians['whole']:.1f}, reduced {medians['reduced']:.1f} "
        f"images/s a worker ({result['speedup']:.1f}x)"
    )
    print(
        f"the image cache: whole {cache_medians['whole']:.1f}, reduced {cache_medians['reduced']:.1f} images/s a "
        f"process ({result['cache_speedup']:.1f}x)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
