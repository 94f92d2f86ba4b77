"""Nearest training images of a few queries, under the learned features and under random ones
(``obow show neighbours``).

Each row is a query image of the ``val/`` (or ``test/``) split, its ``k`` nearest ``train/`` images by cosine
similarity of ``pool5`` features of the checkpoint's network, then its ``k`` nearest under the same
architecture at random initialisation (the baseline every number of obow is compared with). A neighbour's
frame is green when its class is the query's, red otherwise. Images are shown as the evaluation view sees them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw
from torch import Tensor

from obow.files import writing
from obow.show.words import view_pixels

MATCH, MISMATCH = (30, 170, 60), (210, 40, 40)


def nearest(train: Tensor, queries: Tensor, k: int) -> Tensor:
    """Indices ``[Q, k]`` of the ``k`` training rows most cosine-similar to each query row, best first."""
    similarity = F.normalize(queries, dim=1) @ F.normalize(train, dim=1).t()
    return similarity.topk(min(k, train.shape[0]), dim=1).indices


def pick_queries(labels: Tensor, n: int, seed: int) -> list[int]:
    """``n`` query indices drawn without replacement, seeded, in drawn order."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(labels.numel(), generator=generator)[: min(n, labels.numel())].tolist()


def write_neighbour_grid(
    rows: list[dict[str, Any]], path: Path, tile: int = 64, headers: tuple[str, str] = ("learned", "random init")
) -> Image.Image:
    """``rows``: ``{"query": pixels, "learned": [(pixels, match)], "random": [(pixels, match)]}``.

    Layout: the query, a gap, the learned neighbours, a gap, the random-init ones; a 3 px frame around every
    neighbour (green: same class as the query, red: another class).
    """
    k = max(len(r["learned"]) for r in rows)
    gap, frame, header = 6, 3, 16
    cell = tile + 2 * frame + gap
    width = cell * (1 + 2 * k) + 2 * gap
    image = Image.new("RGB", (width, header + cell * len(rows)), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    starts = (0, cell + gap, cell * (1 + k) + 2 * gap)
    for x, text in zip(starts, ("query", *headers), strict=True):
        draw.text((x + frame, 2), text, fill=(0, 0, 0))

    def paste(pixels: Any, x: int, y: int, colour: tuple[int, int, int] | None) -> None:
        if colour is not None:
            draw.rectangle([x, y, x + tile + 2 * frame - 1, y + tile + 2 * frame - 1], fill=colour)
        image.paste(Image.fromarray(pixels).resize((tile, tile), Image.Resampling.BICUBIC), (x + frame, y + frame))

    for i, row in enumerate(rows):
        y = header + i * cell
        paste(row["query"], starts[0], y, None)
        for start, key in zip(starts[1:], ("learned", "random"), strict=True):
            for j, (pixels, match) in enumerate(row[key]):
                paste(pixels, start + j * cell, y, MATCH if match else MISMATCH)
    with writing(path):
        image.save(path)
    return image


def show_neighbours(
    checkpoint: str | Path,
    data: str | Path,
    out: str | Path,
    *,
    network: str = "student",
    queries: int = 8,
    k: int = 5,
    seed: int = 0,
    tile: int = 64,
    batch_size: int = 256,
    device: str | torch.device = "cpu",
    num_workers: int = 0,
) -> dict[str, Any]:
    """Write the grid to ``out`` (a PNG); returns ``path``, ``queries`` (indices in the test split) and the
    share of neighbours of the query's class under ``learned`` and ``random`` features."""
    from obow.data.eval_sets import align_classes, eval_dataset, scan_labelled, views_from_dict
    from obow.data.folders import ImageList
    from obow.evaluate.features import extract_features
    from obow.weights.load import load_backbone

    data = Path(data)
    test_dir = next((data / name for name in ("val", "test") if (data / name).is_dir()), None)
    if not (data / "train").is_dir() or test_dir is None:
        raise ValueError(f"{data} must hold train/ and val/ (or test/) class folders")
    learned, info = load_backbone(checkpoint, network=network)
    random_net, _ = load_backbone(checkpoint, random_init=True, seed=seed)
    views = views_from_dict(info["views"])
    train = scan_labelled(data / "train")
    test = align_classes(train, scan_labelled(test_dir))
    assert test.labels is not None  # scan_labelled: a labelled split
    chosen = pick_queries(torch.tensor(test.labels), queries, seed)
    query_list = ImageList(test.root, [test.paths[i] for i in chosen], [test.labels[i] for i in chosen], test.classes)
    train_set, query_set = eval_dataset(train, views), eval_dataset(query_list, views)
    kwargs: dict[str, Any] = {"batch_size": batch_size, "device": device, "num_workers": num_workers}
    found = {}
    for name, backbone in (("learned", learned), ("random", random_net)):
        train_x, train_y = extract_features(backbone, train_set, **kwargs)
        query_x, query_y = extract_features(backbone, query_set, **kwargs)
        index = nearest(train_x, query_x, k)
        found[name] = (index, train_y[index] == query_y.unsqueeze(1))
    rows = []
    for q in range(len(query_list)):
        row: dict[str, Any] = {"query": view_pixels(query_set[q]["image"], views.mean, views.std)}
        for name, (index, match) in found.items():
            row[name] = [
                (view_pixels(train_set[int(i)]["image"], views.mean, views.std), bool(m))
                for i, m in zip(index[q], match[q], strict=True)
            ]
        rows.append(row)
    epoch = info["epoch"]
    path = Path(out)
    write_neighbour_grid(rows, path, tile, (f"learned ({network}, epoch {epoch})", "random init"))
    return {
        "path": path,
        "queries": chosen,
        "same_class": {name: float(match.float().mean()) for name, (_, match) in found.items()},
    }
