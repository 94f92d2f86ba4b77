"""``obow demo``: pretrain on real images that ship with scikit-learn, then show what was learned.

The images are scikit-learn's handwritten digits (1,797 greyscale 8x8 scans, 10 classes), upscaled to 32 px
and blended onto random crops of the two photographs that ship with scikit-learn (``china.jpg`` and
``flower.jpg``), as MNIST-M (Ganin & Lempitsky, ICML 2015) blends MNIST onto BSDS500 photographs: each
pixel is ``|background - digit|``, per colour channel. On the plain digits a random network's features are
already near perfect (kNN 91%), which leaves a pretraining method nothing to show; on the blended digits the
background's colours and textures dominate a random network's features (kNN 34% for the demo's network) and
what matters, the digit's shape, has to be learnt. The images are written as ordinary class folders
(``<out>/data/train`` and ``<out>/data/val``, a stratified half each), so the demo runs exactly the code a
user runs on their own folders. It then pretrains with the ``demo`` recipe
on the training half (labels unused) and measures the learned student next to the same network at its
random initialisation (the pretraining run's own starting weights), with the same protocol and features:
few-shot prototype episodes (the paper's second protocol) and weighted kNN on the validation half.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np
from PIL import Image

from obow.files import writing

log = logging.getLogger("obow")

DEMO_IMAGE_SIZE = 32


def blend_on_background(glyph: np.ndarray, background: np.ndarray) -> np.ndarray:
    """MNIST-M's blend: ``|background - glyph|`` per channel, for a ``[H, W]`` glyph and a ``[H, W, 3]``
    background, both uint8; the result is uint8 ``[H, W, 3]``."""
    diff = background.astype(np.int16) - glyph.astype(np.int16)[..., None]
    return np.abs(diff).astype(np.uint8)


def write_digits(root: Path, size: int = DEMO_IMAGE_SIZE, seed: int = 0, backgrounds: bool = True) -> tuple[Path, Path]:
    """Write scikit-learn's digits as ``root/{train,val}/<digit>/<n>.png`` (RGB, ``size`` px); return both folders.

    With ``backgrounds`` (the demo's data) each digit is blended onto a random ``size`` px crop of one of
    scikit-learn's two sample photographs, downscaled by 2 (:func:`blend_on_background`); without, the plain
    grey digits. The crops are drawn from ``seed``: the same call writes the same files. Already written
    folders are kept as they are.
    """
    from sklearn.datasets import load_digits, load_sample_images
    from sklearn.model_selection import train_test_split

    train_dir, val_dir = root / "train", root / "val"
    done = root / ".complete"
    if done.exists():
        return train_dir, val_dir
    digits = load_digits()
    photos = [
        np.asarray(Image.fromarray(p).resize((p.shape[1] // 2, p.shape[0] // 2), Image.BILINEAR))
        for p in load_sample_images().images
    ]
    rng = np.random.default_rng(seed)
    indices = np.arange(len(digits.target))
    train_idx, val_idx = train_test_split(indices, test_size=0.5, stratify=digits.target, random_state=seed)
    for split_dir, split in ((train_dir, train_idx), (val_dir, val_idx)):
        for i in split:
            pixels = (digits.images[i] * (255.0 / 16.0)).round().astype(np.uint8)
            glyph = np.asarray(Image.fromarray(pixels, mode="L").resize((size, size), Image.BICUBIC))
            if backgrounds:
                photo = photos[rng.integers(len(photos))]
                y, x = rng.integers(photo.shape[0] - size), rng.integers(photo.shape[1] - size)
                image = Image.fromarray(blend_on_background(glyph, photo[y : y + size, x : x + size]))
            else:
                image = Image.fromarray(glyph, mode="L").convert("RGB")
            with writing(split_dir / str(digits.target[i]) / f"{i:04d}.png") as path:
                image.save(path)
    with writing(done):
        done.touch()
    return train_dir, val_dir


def run_demo(out: Path, overrides: list[str]) -> dict:
    """Write the data, pretrain with the ``demo`` recipe, compare with random init; return the numbers."""
    import torch

    from obow.config import load_config
    from obow.data.eval_sets import eval_dataset
    from obow.diagnostics import feature_diagnostics
    from obow.evaluate.features import extract_features
    from obow.evaluate.fewshot import prototype_accuracy, sample_episodes
    from obow.evaluate.knn import knn_accuracy
    from obow.evaluate.monitor import KNNMonitor
    from obow.training.loop import pretrain
    from obow.weights.load import load_backbone

    start = time.time()
    train_dir, val_dir = write_digits(out / "data")
    cfg = load_config("demo", [*overrides, f"data.path={train_dir}", f"data.val_path={val_dir}"])
    log.info("Demo: pretraining %s on %s (recipe 'demo')", cfg.model.arch, train_dir)
    result = pretrain(cfg, out / "pretrain", monitor=KNNMonitor)
    pretrain_time = time.time() - start

    train_set = eval_dataset(train_dir, cfg.views)
    val_set = eval_dataset(val_dir, cfg.views)
    rows = {}
    for name, kwargs in (
        ("random init", {"random_init": True, "arch": cfg.model.arch, "stem": cfg.model.stem, "seed": cfg.train.seed}),
        ("OBoW pretrained", {"checkpoint": result["checkpoint"]}),
    ):
        if name == "random init":
            kwargs["arch_options"] = cfg.model.arch_options
        backbone, _ = load_backbone(**kwargs)
        train_x, train_y = extract_features(backbone, train_set, batch_size=256)
        val_x, val_y = extract_features(backbone, val_set, batch_size=256)
        row = {"knn_k20": knn_accuracy(train_x, train_y, val_x, val_y, k=20, temperature=0.07)}
        row.update({k: float(v) for k, v in feature_diagnostics(val_x).items()})
        for shots in (1, 5):
            episodes = sample_episodes(val_y, n_way=10, n_shot=shots, n_query=15, n_episodes=200, seed=0)
            mean, ci = prototype_accuracy(val_x, val_y, episodes)
            row[f"fewshot_10way_{shots}shot"] = mean
            row[f"fewshot_10way_{shots}shot_ci95"] = ci
        rows[name] = row
        del backbone
        torch.cuda.empty_cache() if torch.cuda.is_available() else None

    total = time.time() - start
    pretext = pretext_summary(out / "pretrain" / "log.jsonl", cfg.model.levels)
    curve = knn_curve(out / "pretrain" / "log.jsonl")
    report = {
        "results": rows,
        "knn_per_epoch": curve,
        "pretext": pretext,
        "pretrain_seconds": pretrain_time,
        "total_seconds": total,
        "out": str(out),
    }
    with writing(out / "demo_results.json") as path, open(path, "w") as f:
        json.dump(report, f, indent=2)
    print_table(rows, pretext, pretrain_time, total, curve)
    return report


def knn_curve(log_path: Path) -> list[tuple[int, float]]:
    """``(epoch, kNN top-1)`` of the pretraining run's kNN monitor (same k and temperature as the table)."""
    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    return [(r["epoch"], r["knn_top1"]) for r in records if r.get("type") == "epoch" and "knn_top1" in r]


def pretext_summary(log_path: Path, levels: tuple[str, ...]) -> dict[str, float]:
    """How well the student does its own task: the BoW-prediction loss per view group and level (the mean of
    the logged ``loss/group*/<level>``) at the first logged step and over the last epoch, next to the loss of
    a student that predicts the batch's average BoW for every image (``kl_to_mean_bow``)."""
    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    steps = [r for r in records if "type" not in r]
    last_epoch = [r for r in steps if r["epoch"] == steps[-1]["epoch"]]

    def group_loss(r: dict) -> float:
        return float(np.mean([v for k, v in r.items() if k.startswith("loss/group")]))

    def average_bow(r: dict) -> float:
        return float(np.mean([r[f"{level}/kl_to_mean_bow"] for level in levels]))

    return {
        "first_loss": group_loss(steps[0]),
        "last_epoch_loss": float(np.mean([group_loss(r) for r in last_epoch])),
        "last_epoch_average_bow_loss": float(np.mean([average_bow(r) for r in last_epoch])),
    }


def print_table(
    rows: dict[str, dict[str, float]],
    pretext: dict[str, float],
    pretrain_time: float,
    total: float,
    curve: list[tuple[int, float]] = (),
) -> None:
    columns = (
        ("kNN k=20", "knn_k20"),
        ("10-way 1-shot", "fewshot_10way_1shot"),
        ("10-way 5-shot", "fewshot_10way_5shot"),
        ("eff. rank", "effective_rank"),
    )
    print(
        "\nDigits on photographs, validation half (kNN: k=20, T=0.07, the main metric; few-shot: 200 episodes, "
        "15 queries per class, mean +- 95% CI; effective rank of the features):"
    )
    print(f"| {'features':16s} | " + " | ".join(f"{c:>15s}" for c, _ in columns) + " |")
    print(f"|{'-' * 18}|" + "|".join("-" * 17 for _ in columns) + "|")
    for name, row in rows.items():
        cells = []
        for _, key in columns:
            ci = row.get(f"{key}_ci95")
            cells.append(f"{row[key]:6.2f}" + (f" +- {ci:4.2f}" if ci is not None else " " * 8))
        print(f"| {name:16s} | " + " | ".join(f"{c:>15s}" for c in cells) + " |")
    gain = rows["OBoW pretrained"]["knn_k20"] - rows["random init"]["knn_k20"]
    if curve:
        line = ", ".join(f"{e}: {v:.1f}" for e, v in curve)
        print(f"\nkNN k=20 during pretraining (epoch: top-1), random init {rows['random init']['knn_k20']:.1f}: {line}")
    print(
        f"\nBoW prediction (the pretext task), per view group and level: loss {pretext['first_loss']:.2f} at the "
        f"first logged step, {pretext['last_epoch_loss']:.2f} over the last epoch; predicting the batch's average "
        f"BoW would score {pretext['last_epoch_average_bow_loss']:.2f}."
    )
    print(
        f"kNN accuracy, pretrained minus random init: {gain:+.2f} points; pretraining {pretrain_time / 60:.1f} "
        f"min, demo total {total / 60:.1f} min."
    )
    if gain <= 0:
        print(
            "This run did not improve on the random network's features (see README, 'What the demo shows', for\n"
            "what was measured and at which budgets OBoW does)."
        )
