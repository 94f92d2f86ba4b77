"""What a recipe's views make of a folder's images (``obow show views``): the teacher's view, the student's
crops and its patches, made by the pipeline that training would use.

The views come from the training's own entry point (:func:`obow.training.build.build_data`), with either
pipeline: the loader workers' PIL and torchvision transforms (:mod:`obow.data.transforms`) or the device
pipeline's cache and batched views (:mod:`obow.data.cache`, :mod:`obow.data.batched_views`). The first
``images`` images of the folder (in its scanning order) are one batch, seeded by ``train.seed`` as the first
batch of a run's first epoch is; the device pipeline's cache of them is decoded into a temporary folder unless
``data.cache_dir`` is set, so that it never takes the place of a training run's cache.

Every view is written as its own lossless PNG, its normalised pixels mapped back to ``uint8``
(``round(255 * (x * std + mean))``, :func:`obow.show.words.view_pixels`): ``image003_teacher.png``,
``image003_crop1.png``, ``image003_patch4.png``, the number being the image's position in the folder's order.
The views were 8-bit images before normalisation and come back exactly, but for the device pipeline's blurred
crops (its blur runs in floats), rounded to the nearest level. ``overview.png`` shows the first few images'
views side by side, each at its own size in pixels.
"""

from __future__ import annotations

import copy
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from obow.config import Config
from obow.files import is_inside, writing
from obow.notices import release_notices
from obow.show import drawable
from obow.show.words import view_pixels

#: The keys of a batch's views (both pipelines, every method) and the word each view's file name holds.
VIEW_NAMES = {"teacher": "teacher", "crops": "crop", "patches": "patch"}


def check_out_of_data(out: str | Path, data: str | Path) -> None:
    """Refuse an output folder inside the image folder: its PNGs would be read as training images next time."""
    if is_inside(out, data):
        raise ValueError(f"--out {out} is inside --data {data}: its PNGs would become training images; write elsewhere")


def make_views(cfg: Config, images: int, device: torch.device) -> tuple[str, list[str], dict[str, np.ndarray]]:
    """The views of the first ``images`` images of ``cfg.data.path``, by the pipeline ``cfg.data.pipeline``
    settles to on ``device``: ``(pipeline, the images' paths, {"teacher": [n, H, W, 3] uint8, "crops": [n, m, H,
    W, 3], ...})``, rows in the folder's order."""
    from obow.data.folders import scan_images
    from obow.training.build import build_data
    from obow.training.run.settle import resolve_pipeline

    pipeline = resolve_pipeline(cfg.data.pipeline, device)
    assert cfg.data.path is not None  # the command's --data
    found = scan_images(cfg.data.path, cfg.data.labels, cfg.data.images_per_class)
    release_notices()  # the lines `obow show views` held until the images were found
    n = min(images, len(found))
    first = replace(found, paths=found.paths[:n], labels=None if found.labels is None else found.labels[:n])
    cfg = copy.deepcopy(cfg)
    cfg.data.batch_size = n  # one batch: every view of every image
    cfg.data.num_workers = min(cfg.data.num_workers, n)
    cfg.train.compile = "off"  # the eager render: the same views, without a compilation
    with tempfile.TemporaryDirectory(prefix="obow-views-") as scratch:
        if cfg.data.cache_dir is None:
            cfg.data.cache_dir = scratch
        used, sampler, loader = build_data(cfg, device, first, pipeline=pipeline)
        batch = next(iter(loader))
    rows = batch.get("index")  # the workers name each row's image (an unreadable one is replaced by the next)
    order = rows.tolist() if rows is not None else next(sampler.batches())[1]
    views = {key: batch["image"][key].cpu() for key in VIEW_NAMES if key in batch["image"]}
    by_folder = np.argsort(order, kind="stable")
    pixels = {key: to_pixels(value[torch.from_numpy(by_folder)], cfg) for key, value in views.items()}
    return pipeline, [used.paths[order[i]] for i in by_folder], pixels


def to_pixels(views: torch.Tensor, cfg: Config) -> np.ndarray:
    """Normalised views ``[..., 3, H, W]`` -> ``uint8`` pixels ``[..., H, W, 3]``."""
    flat = views.reshape(-1, *views.shape[-3:])
    pixels = np.stack([view_pixels(v, cfg.views.mean, cfg.views.std) for v in flat])
    return pixels.reshape(*views.shape[:-3], *pixels.shape[1:])


def view_files(pixels: dict[str, np.ndarray], out: Path) -> list[Path]:
    """Write every view of ``pixels`` (:func:`make_views`) as its own PNG in ``out``; returns the paths."""
    written = []
    for key, array in pixels.items():
        for i, views in enumerate(array):
            for j, view in enumerate([views] if key == "teacher" else views):
                name = f"image{i:03d}_{VIEW_NAMES[key]}" + ("" if key == "teacher" else str(j + 1))
                with writing(out / f"{name}.png") as path:
                    Image.fromarray(view).save(path)
                written.append(path)
    return written


def overview_figure(pixels: dict[str, np.ndarray], paths: list[str], title: str):
    """A matplotlib figure: a row per image (``paths``), its teacher view, crops and patches left to right, each
    panel's width proportional to its view's side, so that every view is drawn at one scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = [(key, j) for key in pixels for j in range(1 if key == "teacher" else pixels[key].shape[1])]
    sides = [pixels[key].shape[-2] for key, _ in columns]
    scale = 1.6 / max(sides)  # inches per pixel: the largest view 1.6 inches wide
    fig, axes = plt.subplots(
        len(paths),
        len(columns),
        figsize=(scale * sum(sides) + 0.3 * len(columns), (scale * max(sides) + 0.55) * len(paths) + 0.4),
        gridspec_kw={"width_ratios": sides},
        squeeze=False,
    )
    for i, path in enumerate(paths):
        for (key, j), ax in zip(columns, axes[i], strict=True):
            ax.imshow(pixels[key][i] if key == "teacher" else pixels[key][i, j], interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            side = pixels[key].shape[-2]
            label = VIEW_NAMES[key] if key == "teacher" else f"{VIEW_NAMES[key]} {j + 1}"
            ax.set_title(f"{label} ({side} px)" if i == 0 else label, fontsize=7)
        axes[i, 0].set_ylabel(drawable(f"{i}: {Path(path).name}"), fontsize=7)
    fig.suptitle(drawable(title), fontsize=9)
    fig.tight_layout()
    return fig


def show_views(cfg: Config, out: str | Path, *, images: int = 8, overview: int = 4) -> dict[str, Any]:
    """Write the views of the first ``images`` images of ``cfg.data.path`` into ``out``: each view as a PNG
    (:func:`view_files`) and ``overview.png`` with the first ``overview`` images' views. Returns ``{"pipeline",
    "device", "paths", "files", "overview"}``."""
    import matplotlib.pyplot as plt

    out = Path(out)
    assert cfg.data.path is not None  # the command's --data
    check_out_of_data(out, cfg.data.path)
    from obow.training.build import training_device

    device = training_device(cfg)
    pipeline, paths, pixels = make_views(cfg, images, device)
    files = view_files(pixels, out)
    shown = min(overview, len(paths))
    title = f"views of {cfg.data.path}: {pipeline} pipeline on the {device.type}, train.seed={cfg.train.seed}"
    fig = overview_figure({key: value[:shown] for key, value in pixels.items()}, paths[:shown], title)
    with writing(out / "overview.png") as picture:
        fig.savefig(picture, dpi=120)
    plt.close(fig)
    return {"pipeline": pipeline, "device": device.type, "paths": paths, "files": files, "overview": picture}
