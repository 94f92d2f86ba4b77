"""The image patches a visual word stands for (``obow show words``; the official ``--visualize-words``,
official notes 6.2).

Every image of a folder goes through the recipe's evaluation view and the teacher (or student); each location
of the chosen level's map, after border removal, is soft-assigned to the vocabulary exactly as the BoW targets
are (:func:`obow.bow.targets.squared_distances`, :func:`obow.bow.targets.soft_assignment`,
``delta = delta_base * mu_MSD``), with the checkpoint's state and nothing updated. For every word the locations
with the highest assignment score are kept, and each is shown as the patch of the view it looks at.

Memory does not grow with the number of images: batches are streamed, and only a running top-``n`` per word
(scores, image indices and locations: ``K * n`` of each) and the per-word usage counts are kept. The patches
are cut after the pass, from the few images that hold them.
"""

from __future__ import annotations

import html
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw
from torch import Tensor, nn

from obow.bow.targets import flatten_locations, remove_border, soft_assignment, squared_distances
from obow.data.folders import EpochSampler, ImageDataset, build_loader
from obow.files import make_folder, writing

#: Patches kept per word (the official visualisation also shows 8).
TOP = 8
WORD_CHOICES = ("most-used", "random")
#: Height of the title band of the grid picture, pixels.
TITLE_HEIGHT = 20


@dataclass
class LevelVocabulary:
    """What assigning a level's locations to its words needs, read from a checkpoint (nothing is updated)."""

    level: str
    words: Tensor  # [K, C]
    delta: float  # delta_base * mu_MSD
    border: int

    @property
    def num_words(self) -> int:
        return self.words.shape[0]


@dataclass
class WordStatistics:
    """The outcome of one pass over the images.

    ``counts[k]``: locations whose nearest word is ``k`` (of ``total``); ``scores``, ``images``, ``rows``,
    ``cols`` ``[K, n]``: each word's best locations, best first (``images == -1`` where fewer than ``n``
    locations exist); rows and columns index the border-free map. ``map_size``: the level's whole map
    ``(h, w)``; ``view_size``: the evaluated input ``(H, W)``.
    """

    counts: Tensor
    total: int
    scores: Tensor
    images: Tensor
    rows: Tensor
    cols: Tensor
    map_size: tuple[int, int]
    view_size: tuple[int, int]

    def usage(self) -> Tensor:
        """Share of all locations whose nearest word each word is."""
        return self.counts.double() / max(self.total, 1)


def top_n_earliest(values: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """The ``n`` largest entries of each row of ``[K, M]`` ``values`` and their column indices, best first;
    equal values are ranked by column, the earliest first.

    ``topk`` alone breaks ties arbitrarily, and ties are common: an untrained or sharp vocabulary saturates
    the soft assignment at exactly 1. A full stable sort of every row would cost ten times more.
    """
    m = values.shape[1]
    n = min(n, m)
    top = values.topk(n, dim=1)
    threshold, index = top.values[:, -1:], top.indices
    crowded = ((values >= threshold).sum(dim=1) > n).nonzero().flatten()  # rows where topk had to choose
    if crowded.numel():
        # every entry above the n-th value, then the earliest ones equal to it: a topk on a rank key
        sub, limit = values[crowded], threshold[crowded]
        earlier = torch.arange(m, 0, -1, device=values.device, dtype=torch.float64)
        key = torch.where(sub > limit, 2.0 * m + earlier, torch.where(sub == limit, m + earlier, 0.0))
        index[crowded] = key.topk(n, dim=1).indices
    index = index.sort(dim=1).values
    picked = values.gather(1, index)
    order = picked.sort(dim=1, descending=True, stable=True).indices
    return picked.gather(1, order), index.gather(1, order)


class RunningTopK:
    """The ``n`` best (score, image, location) entries of each of ``K`` words over a stream of batches.

    Each batch's ``n`` best candidates per word are merged with the running ones; a word's entries stay
    sorted by score, best first, and equal scores keep the stream's order (the earlier image first).
    """

    def __init__(self, num_words: int, n: int = TOP) -> None:
        self.n = n
        self.scores = torch.full((num_words, n), -math.inf, dtype=torch.float64)
        self.images = torch.full((num_words, n), -1, dtype=torch.long)
        self.locations = torch.full((num_words, n), -1, dtype=torch.long)

    def update(self, codes: Tensor, image_ids: Tensor) -> None:
        """``codes`` ``[B, N, K]`` of ``B`` images (ids ``[B]``) at ``N`` locations each."""
        b, n_loc, k = codes.shape
        per_word = codes.permute(2, 0, 1).reshape(k, b * n_loc).double().cpu()
        values, index = top_n_earliest(per_word, self.n)
        images = image_ids.cpu().long()[index // n_loc]
        self.scores, merged = top_n_earliest(torch.cat([self.scores, values], dim=1), self.n)
        self.images = torch.cat([self.images, images], dim=1).gather(1, merged)
        self.locations = torch.cat([self.locations, index % n_loc], dim=1).gather(1, merged)


@torch.no_grad()
def collect_word_statistics(
    backbone: nn.Module,
    vocabulary: LevelVocabulary,
    dataset: ImageDataset,
    *,
    n: int = TOP,
    batch_size: int = 32,
    device: str | torch.device = "cpu",
    num_workers: int = 0,
) -> WordStatistics:
    """One streamed pass: usage counts and the running top-``n`` locations of every word.

    ``backbone(images, levels=(level,)).maps[level]`` gives the level's map; it runs in eval mode (its
    training mode is restored).
    """
    device = torch.device(device)
    was_training = backbone.training
    backbone.eval().to(device)
    words = vocabulary.words.to(device, torch.float32)
    counts = torch.zeros(vocabulary.num_words, dtype=torch.long)
    top = RunningTopK(vocabulary.num_words, n)
    total = 0
    map_size = view_size = (0, 0)
    sampler = EpochSampler(len(dataset), batch_size, shuffle=False, drop_last=False)
    loader = build_loader(dataset, sampler, batch_size, num_workers)
    try:
        for batch in loader:
            images = batch["image"].to(device)
            feature_map = backbone(images, levels=(vocabulary.level,)).maps[vocabulary.level].float()
            map_size, view_size = tuple(feature_map.shape[-2:]), tuple(images.shape[-2:])
            interior = remove_border(feature_map, vocabulary.border)
            distances = squared_distances(flatten_locations(interior), words)
            codes = soft_assignment(distances, vocabulary.delta)
            counts += torch.bincount(distances.argmin(dim=-1).flatten().cpu(), minlength=vocabulary.num_words)
            total += distances.shape[0] * distances.shape[1]
            top.update(codes, batch["index"])
    finally:
        backbone.train(was_training)
    width = map_size[1] - 2 * vocabulary.border
    valid = top.images >= 0
    rows = torch.where(valid, top.locations // max(width, 1), -1)
    cols = torch.where(valid, top.locations % max(width, 1), -1)
    return WordStatistics(counts, total, top.scores, top.images, rows, cols, map_size, view_size)


def choose_words(stats: WordStatistics, words: str, num_words: int = 16, seed: int = 0) -> list[int]:
    """``"most-used"`` (the ``num_words`` words with the most nearest locations, unused words left out),
    ``"random"`` (seeded) or comma-separated indices such as ``"3,17,42"``."""
    k = stats.counts.numel()
    if words == "most-used":  # words no location chose have no patches to show: left out
        order = torch.argsort(stats.counts, descending=True, stable=True)
        return [w for w in order[: min(num_words, k)].tolist() if stats.counts[w] > 0]
    if words == "random":
        generator = torch.Generator().manual_seed(seed)
        return torch.randperm(k, generator=generator)[: min(num_words, k)].tolist()
    try:
        chosen = [int(part) for part in words.split(",") if part.strip()]
    except ValueError:
        raise ValueError(
            f"--words {words!r}: give {' or '.join(WORD_CHOICES)}, or word indices such as 3,17,42"
        ) from None
    bad = [w for w in chosen if not 0 <= w < k]
    if not chosen or bad:
        raise ValueError(f"--words {words!r}: word indices must be in [0, {k - 1}] (the vocabulary has {k} words)")
    return chosen


def receptive_box(
    row: int, col: int, map_size: tuple[int, int], view_size: tuple[int, int], border: int, context: int = 1
) -> tuple[int, int, int, int]:
    """The view region ``(top, left, bottom, right)`` (end-exclusive) that location ``(row, col)`` of the
    border-free map looks at.

    The map's stride relative to the view is ``view / map`` on each axis; the location is cell
    ``(row + border, col + border)`` of the whole map, whose box is widened by ``context`` cells on each side
    (a deep unit's theoretical receptive field spans most of the image, but its effective one concentrates
    around its cell) and clipped to the view.
    """
    (h, w), (height, width) = map_size, view_size
    stride_y, stride_x = height / h, width / w
    r, c = row + border, col + border
    top = max(0, math.floor((r - context) * stride_y))
    left = max(0, math.floor((c - context) * stride_x))
    bottom = min(height, math.ceil((r + 1 + context) * stride_y))
    right = min(width, math.ceil((c + 1 + context) * stride_x))
    return top, left, bottom, right


def view_pixels(image: Tensor, mean: Any, std: Any) -> np.ndarray:
    """An evaluation view ``[3, H, W]`` (normalised) back to ``uint8`` pixels ``[H, W, 3]``."""
    mean_t = torch.tensor(mean, dtype=torch.float32).view(3, 1, 1)
    std_t = torch.tensor(std, dtype=torch.float32).view(3, 1, 1)
    pixels = (image.float() * std_t + mean_t) * 255.0
    return pixels.round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()


def cut_patches(
    stats: WordStatistics,
    dataset: ImageDataset,
    words: list[int],
    mean: Any,
    std: Any,
    border: int,
    context: int = 1,
) -> dict[int, list[dict[str, Any]]]:
    """For each chosen word, its best locations as ``{"pixels", "box", "image", "path", "name", "row", "col",
    "score"}``, best first (``name``: the image's path under the data folder). Each image is read once, however
    many patches it holds."""
    views: dict[int, np.ndarray] = {}
    out: dict[int, list[dict[str, Any]]] = {}
    for word in words:
        patches = []
        for j in range(stats.images.shape[1]):
            index = int(stats.images[word, j])
            if index < 0:
                continue
            if index not in views:
                views[index] = view_pixels(dataset[index]["image"], mean, std)
            row, col = int(stats.rows[word, j]), int(stats.cols[word, j])
            box = receptive_box(row, col, stats.map_size, stats.view_size, border, context)
            top, left, bottom, right = box
            patches.append(
                {
                    "pixels": views[index][top:bottom, left:right],
                    "box": box,
                    "image": index,
                    "path": dataset.images.paths[index],
                    # under the data folder: class folders often hold files of the same names (0002.jpg)
                    "name": Path(os.path.relpath(dataset.images.paths[index], dataset.images.root)).as_posix(),
                    "row": row,
                    "col": col,
                    "score": float(stats.scores[word, j]),
                }
            )
        out[word] = patches
    return out


def word_label(word: int, usage: float) -> str:
    return f"word {word}\nusage {100 * usage:.2f}%"


def write_grid(
    patches: dict[int, list[dict[str, Any]]],
    usage: Tensor,
    path: Path,
    tile: int = 64,
    n: int = TOP,
    title: str | None = None,
) -> Image.Image:
    """One row per word: its index and usage on the left, then its patches resized to ``tile`` px; ``title``
    (e.g. the level and network) in a band of :data:`TITLE_HEIGHT` px above the rows."""
    gap, label_width = 4, 110
    top = TITLE_HEIGHT if title else 0
    words = list(patches)
    size = (label_width + n * (tile + gap), top + max(1, len(words)) * (tile + gap) + gap)
    grid = Image.new("RGB", size, (255, 255, 255))
    draw = ImageDraw.Draw(grid)
    if title:
        draw.text((4, 4), title, fill=(0, 0, 0))
    for i, word in enumerate(words):
        y = top + gap + i * (tile + gap)
        draw.multiline_text((4, y + tile // 3), word_label(word, float(usage[word])), fill=(0, 0, 0))
        for j, patch in enumerate(patches[word]):
            resized = Image.fromarray(patch["pixels"]).resize((tile, tile), Image.Resampling.BICUBIC)
            grid.paste(resized, (label_width + j * (tile + gap), y))
    with writing(path):
        grid.save(path)
    return grid


def write_html(patches: dict[int, list[dict[str, Any]]], usage: Tensor, out: Path, title: str, tile: int = 64) -> Path:
    """``out/index.html`` and ``out/patches/word<k>_<j>.png`` (each patch at its own size in the view)."""
    make_folder(out / "patches")
    sections = []
    for word, items in patches.items():
        figures = []
        for j, patch in enumerate(items):
            name = f"patches/word{word}_{j}.png"
            with writing(out / name):
                Image.fromarray(patch["pixels"]).save(out / name)
            top, left, bottom, right = patch["box"]
            caption = (
                f"{patch['name']}, location ({patch['row']}, {patch['col']}), "
                f"pixels y {top}-{bottom} x {left}-{right}, score {patch['score']:.3f}"
            )
            figures.append(
                f'<figure><img src="{name}" width="{tile}" height="{tile}" alt="{html.escape(caption)}">'
                f"<figcaption>{html.escape(caption)}</figcaption></figure>"
            )
        heading = f"word {word}: usage {100 * float(usage[word]):.2f}% of locations, {len(items)} patches"
        sections.append(f"<section><h2>{heading}</h2>\n{''.join(figures)}\n</section>")
    style = (
        "body{font-family:sans-serif}figure{display:inline-block;width:"
        f"{tile + 96}px;margin:4px;vertical-align:top}}figcaption{{font-size:11px}}"
        "img{image-rendering:pixelated}"
    )
    page = (
        f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{style}</style></head>\n<body><h1>{html.escape(title)}</h1>\n"
        + "\n".join(sections)
        + "\n</body></html>\n"
    )
    with writing(out / "index.html") as path:
        path.write_text(page, encoding="utf-8", errors="backslashreplace")  # a file name in no UTF-8: its escapes
    return path


def load_level_vocabulary(checkpoint: str | Path, level: str | None = None) -> tuple[LevelVocabulary, Any]:
    """A level's words, ``delta`` and border from a pretraining checkpoint, and its recipe.

    ``level`` defaults to ``conv5`` when the recipe has it, else the recipe's last level.
    """
    from obow.config import Config, from_dict
    from obow.weights.checkpoint import load_checkpoint

    ckpt = load_checkpoint(checkpoint)
    cfg = from_dict(Config, ckpt["config"])
    levels = cfg.model.levels
    level = level or ("conv5" if "conv5" in levels else levels[-1])
    if level not in levels:
        raise ValueError(
            f"checkpoint {str(checkpoint)!r} has no vocabulary for {level}; its levels: {', '.join(levels)}"
        )
    state = ckpt["model"]
    prefix = f"extractors.{level}."
    if f"{prefix}vocabulary.words" not in state:
        raise ValueError(
            f"checkpoint {str(checkpoint)!r} holds no {level} vocabulary (a backbone-only import?); "
            "showing words needs a full model checkpoint"
        )
    mu = float(state[f"{prefix}min_distance_mean"])
    if not math.isfinite(mu):
        raise ValueError(f"checkpoint {str(checkpoint)!r}: the {level} temperature statistic was never measured")
    vocabulary = LevelVocabulary(
        level=level, words=state[f"{prefix}vocabulary.words"].float(), delta=cfg.model.delta_base * mu,
        border=cfg.model.border,
    )  # fmt: skip
    return vocabulary, cfg


def show_words(
    checkpoint: str | Path,
    data: str | Path,
    out: str | Path,
    *,
    network: str = "teacher",
    level: str | None = None,
    words: str = "most-used",
    num_words: int = 16,
    seed: int = 0,
    tile: int = 64,
    batch_size: int = 32,
    device: str | torch.device = "cpu",
    num_workers: int = 0,
) -> dict[str, Any]:
    """``obow show words``: ``out/words.png`` (the grid), ``out/index.html`` and ``out/patches/``.

    Returns what was written and shown: ``grid``, ``html``, ``level``, ``words``, ``usage`` (of the chosen
    words), ``num_images``, ``num_locations``.
    """
    from obow.data.eval_sets import eval_dataset, views_from_dict
    from obow.weights.load import load_backbone

    vocabulary, cfg = load_level_vocabulary(checkpoint, level)
    backbone, info = load_backbone(checkpoint, network=network)
    views = views_from_dict(info["views"])
    dataset = eval_dataset(data, views, labels="auto")
    stats = collect_word_statistics(
        backbone, vocabulary, dataset, batch_size=batch_size, device=device, num_workers=num_workers
    )
    chosen = choose_words(stats, words, num_words, seed)
    patches = cut_patches(stats, dataset, chosen, views.mean, views.std, vocabulary.border)
    usage = stats.usage()
    out = Path(out)
    grid = out / "words.png"
    write_grid(
        patches, usage, grid, tile, title=f"{vocabulary.level} visual words, {network} network, epoch {info['epoch']}"
    )
    title = (
        f"{vocabulary.level} words of the {network} of {checkpoint} (epoch {info['epoch']}), "
        f"{len(dataset)} images of {data}"
    )
    page = write_html(patches, usage, out, title, tile)
    return {
        "grid": grid,
        "html": page,
        "level": vocabulary.level,
        "words": chosen,
        "usage": [float(usage[w]) for w in chosen],
        "num_images": len(dataset),
        "num_locations": stats.total,
    }
