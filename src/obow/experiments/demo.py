"""``obow demo``: pretrain on images that need no download, then show what was learned.

The default data (``--dataset digits``) are mosaics of scikit-learn's handwritten digits (1,797 greyscale 8x8
scans, 10 classes): each 32 px image holds 2 or 3 digits of one class (12 to 18 px), different scans of it,
turned and scattered at random, white on black (:func:`digit_mosaic`). The class is the digit, so every part
of an image says which class it is: OBoW's student, which predicts the whole image's bag of visual words from
crops of it, has to learn what the strokes of each digit look like. A random network's pooled features
follow how many digits there are, how large and where, more than which (kNN 16 to 20%, chance 10%).

What was measured before settling on this (docs/results/demo.md): on one digit per image (at random
placements, in random colours, or blended onto photographs, MNIST-M style) the demo's pretraining did not beat
the random network's features reliably; on the mosaics, more distinct images for the same number of steps
(:data:`MOSAICS_PER_SCAN`) helped, and once the recipe's network started as torchvision's does (the student
then beats the constant predictor), fewer and larger digits a mosaic tripled the gain.

``--dataset cifar10`` downloads CIFAR-10 with torchvision (it needs a network, once) and writes a subset of
it, sized for the demo's budget (:data:`CIFAR10_PER_CLASS`).

The images are written as ordinary class folders (``<out>/data/<dataset>/train`` and ``.../val``), so the demo
runs exactly the code a user runs on their own folders. It then pretrains with the dataset's recipe on the
training folder (labels unused) and measures the learned student next to the same network at its random
initialisation (the pretraining run's own starting weights), with the same protocol and features: few-shot
prototype episodes (the paper's second protocol) and weighted kNN on the validation folder.

The recipe depends on how fast this machine is, measured (:func:`choose_recipe`,
:mod:`obow.experiments.demo_probe`): the digits train with the first of ``demo``, ``demo_fp32`` (one crop a step,
the kNN monitor every 4 epochs) and ``demo_short`` (``demo_fp32``'s steps at half the batch) whose demo a probe of a few
seconds estimates within 3 minutes, in bf16 where this machine computes it faster than fp32.
"""

from __future__ import annotations

import functools
import json
import logging
import shutil
import time
import urllib.error
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image

from obow.files import writing

if TYPE_CHECKING:
    import torch

log = logging.getLogger("obow")

DEMO_IMAGE_SIZE = 32
#: Digits per mosaic (inclusive), their side in pixels (inclusive) and how far each is turned, either way.
DIGITS_PER_MOSAIC = (2, 3)
DIGIT_SIDE = (12, 18)
DIGIT_ROTATION = 30.0
#: Training mosaics built around each training scan (the validation folder has one per validation scan).
MOSAICS_PER_SCAN = 4
#: CIFAR-10 images per class written for ``--dataset cifar10``: training (from CIFAR-10's training set) and
#: validation (from its test set).
CIFAR10_PER_CLASS = (500, 100)
#: :func:`beats_constant_predictor`: the least spread of the student's predictions around their mean
#: (``predicted_kl_to_mean``), as a share of the targets' (``kl_to_mean_bow``), that counts as image-specific.
PREDICTION_SPREAD_SHARE = 0.1


class DemoDataUnavailable(RuntimeError):
    """The demo's data cannot be had here (CIFAR-10 without a network): the message says why, in one line."""


@dataclass(frozen=True)
class DemoData:
    """One of the demo's datasets: what the table calls it and the recipes that train on it, best first: the demo
    runs the first whose estimate fits its budget on this machine (:func:`choose_recipe`)."""

    title: str
    recipes: tuple[str, ...]


DATASETS = {
    "digits": DemoData("Digit mosaics (scikit-learn's digits)", ("demo", "demo_fp32", "demo_short")),
    "cifar10": DemoData(
        f"CIFAR-10 ({CIFAR10_PER_CLASS[0]} + {CIFAR10_PER_CLASS[1]} images a class)", ("demo_cifar10",)
    ),
}


@functools.cache
def digit_scans() -> tuple[int, int]:
    """How many of scikit-learn's digit scans the training and the validation halves hold (:func:`write_digits`);
    read once a process (the demo's probe asks for each recipe it estimates)."""
    from sklearn.datasets import load_digits

    n = len(load_digits().target)
    return n - (n + 1) // 2, (n + 1) // 2


def training_images() -> int:
    """The digit mosaics the demo pretrains on: :data:`MOSAICS_PER_SCAN` per training scan."""
    return digit_scans()[0] * MOSAICS_PER_SCAN


def validation_images() -> int:
    """The digit mosaics of the validation folder: one per validation scan."""
    return digit_scans()[1]


def render_digit(pixels: np.ndarray, side: int, angle: float, size: int = DEMO_IMAGE_SIZE) -> np.ndarray:
    """An ``[8, 8]`` digit scan (scikit-learn's 0-16 levels) as a white-on-black ``side`` px glyph turned by
    ``angle`` degrees: upscaled to ``size`` px (bicubic), turned there (bilinear), then shrunk to ``side`` px
    (PIL's antialiased bilinear). Turning at the larger size keeps the strokes smooth. Returns uint8
    ``[side, side]``; with ``side`` = ``size`` = 8 and ``angle`` 0 it is the scan in 8 bits."""
    scan = np.round(np.asarray(pixels, dtype=np.float64) * (255.0 / 16.0)).astype(np.uint8)
    glyph = Image.fromarray(scan, mode="L").resize((size, size), Image.Resampling.BICUBIC)
    glyph = glyph.rotate(angle, Image.Resampling.BILINEAR)
    return np.asarray(glyph.resize((side, side), Image.Resampling.BILINEAR))


def paint_glyphs(glyphs: list[np.ndarray], offsets: list[tuple[int, int]], size: int) -> np.ndarray:
    """Paint square uint8 glyphs onto a black ``size`` px image, each with its top-left corner at its ``(x, y)``
    offset; where glyphs overlap the brighter pixel wins (white strokes stay whole)."""
    canvas = np.zeros((size, size), dtype=np.uint8)
    for glyph, (x, y) in zip(glyphs, offsets, strict=True):
        side = glyph.shape[0]
        if not (0 <= x <= size - side and 0 <= y <= size - side):
            raise ValueError(f"a {side} px glyph at {(x, y)} does not fit a {size} px image")
        np.maximum(canvas[y : y + side, x : x + side], glyph, out=canvas[y : y + side, x : x + side])
    return canvas


def digit_mosaic(scans: list[np.ndarray], rng: np.random.Generator, size: int = DEMO_IMAGE_SIZE) -> np.ndarray:
    """One mosaic: each scan rendered at a random side in :data:`DIGIT_SIDE` and angle in +-
    :data:`DIGIT_ROTATION`, at a random position inside the image (:func:`render_digit`, :func:`paint_glyphs`)."""
    glyphs, offsets = [], []
    for pixels in scans:
        side = int(rng.integers(DIGIT_SIDE[0], DIGIT_SIDE[1] + 1))
        glyphs.append(render_digit(pixels, side, float(rng.uniform(-DIGIT_ROTATION, DIGIT_ROTATION)), size))
        y, x = rng.integers(0, size - side + 1, size=2)
        offsets.append((int(y), int(x)))
    return paint_glyphs(glyphs, offsets, size)


def plan_mosaics(labels: np.ndarray, split: np.ndarray, copies: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Which scans each mosaic of one split holds: ``copies`` mosaics per scan of ``split`` (indices into
    ``labels``), each that scan first, then 1 or 2 more (:data:`DIGITS_PER_MOSAIC`) drawn from the same split's
    scans of the same class, so that no training scan shows up in a validation image."""
    plans = []
    for index in np.repeat(split, copies):
        same_class = split[labels[split] == labels[index]]
        others = rng.choice(same_class, size=int(rng.integers(*DIGITS_PER_MOSAIC, endpoint=True)) - 1)
        plans.append(np.concatenate([[index], others]))
    return plans


def write_digits(
    root: Path, size: int = DEMO_IMAGE_SIZE, seed: int = 0, copies: int = MOSAICS_PER_SCAN
) -> tuple[Path, Path]:
    """Write mosaics of scikit-learn's digits as ``root/{train,val}/<digit>/<scan>_<n>.png`` (RGB, ``size`` px):
    the scans split in stratified halves, ``copies`` mosaics per training scan and one per validation scan
    (:func:`plan_mosaics`, :func:`digit_mosaic`), all drawn from ``seed``: the same call writes the same files.
    Returns both folders; already written folders are kept as they are."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    train_dir, val_dir = root / "train", root / "val"
    done = root / ".complete"
    if done.exists():
        return train_dir, val_dir
    digits = load_digits()
    rng = np.random.default_rng(seed)
    indices = np.arange(len(digits.target))
    train_idx, val_idx = train_test_split(indices, test_size=0.5, stratify=digits.target, random_state=seed)
    for split_dir, split, n in ((train_dir, train_idx, copies), (val_dir, val_idx, 1)):
        for k, plan in enumerate(plan_mosaics(digits.target, split, n, rng)):
            image = digit_mosaic([digits.images[i] for i in plan], rng, size)
            with writing(split_dir / str(digits.target[plan[0]]) / f"{plan[0]:04d}_{k % n}.png") as path:
                Image.fromarray(image, mode="L").convert("RGB").save(path)
    with writing(done):
        done.touch()
    return train_dir, val_dir


def first_missing(path: Path) -> Path | None:
    """The outermost folder of ``path`` (``path`` included) that does not exist yet, the one whose removal undoes
    making ``path`` with its parents; ``None`` when ``path`` exists."""
    missing = None
    for folder in (path, *path.parents):
        if folder.exists():
            break
        missing = folder
    return missing


def write_cifar10(root: Path, download_dir: Path, per_class: tuple[int, int] = CIFAR10_PER_CLASS) -> tuple[Path, Path]:
    """Download CIFAR-10 with torchvision into ``download_dir`` (skipped when it is already there) and write
    the first ``per_class`` images of each class of its training and test sets as
    ``root/{train,val}/<class>/<n>.png``. Returns both folders; already written folders are kept as they are.

    Raises :class:`DemoDataUnavailable` when the archive cannot be fetched (no network), after removing what the
    attempt made (the folders it created, or the files it added to an existing ``download_dir``), or when the
    archive is corrupted.
    """
    from torchvision.datasets import CIFAR10

    train_dir, val_dir = root / "train", root / "val"
    done = root / ".complete"
    if done.exists():
        return train_dir, val_dir
    created = first_missing(download_dir)
    before = set() if created is not None else set(download_dir.iterdir())
    try:
        sets = [CIFAR10(download_dir, train=train, download=True) for train in (True, False)]
    except (urllib.error.URLError, OSError) as e:
        # Leave nothing of a failed download behind: the folders it made, or what it added to an existing one.
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        else:
            for entry in set(download_dir.iterdir()) - before:
                shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
        reason = getattr(e, "reason", e)
        raise DemoDataUnavailable(
            f"cannot download CIFAR-10 from {CIFAR10.url} ({reason}): no network here? "
            f"`obow demo` without --dataset needs none"
        ) from e
    except RuntimeError as e:  # torchvision's md5 checks
        raise DemoDataUnavailable(f"CIFAR-10 under {download_dir} is incomplete or corrupted ({e}): delete it") from e
    for split_dir, dataset, count in ((train_dir, sets[0], per_class[0]), (val_dir, sets[1], per_class[1])):
        targets = np.asarray(dataset.targets)
        for label, name in enumerate(dataset.classes):
            for i in np.flatnonzero(targets == label)[:count]:
                with writing(split_dir / name / f"{i:05d}.png") as path:
                    Image.fromarray(dataset.data[i]).save(path)
    with writing(done):
        done.touch()
    return train_dir, val_dir


def write_demo_data(dataset: str, root: Path) -> tuple[Path, Path]:
    """Write one of :data:`DATASETS` as class folders under ``root``; return the training and validation folders."""
    if dataset == "cifar10":
        return write_cifar10(root / "cifar10", root / "download")
    return write_digits(root / dataset)


def demo_settings(out: Path, overrides: list[str], train_dir: Path, val_dir: Path) -> list[str]:
    """The settings the demo adds to its recipe around the user's ``overrides``: the device pipeline's decoded copy
    of the images (the ``demo`` recipe's ``data.pipeline: device``) under the demo's own folder,
    ``<out>/data/cache``, not ``~/.cache/obow`` (an override of ``data.cache_dir`` wins), and the data folders
    it wrote (which win over any override)."""
    return [
        f"data.cache_dir={out / 'data' / 'cache'}",
        *overrides,
        f"data.path={train_dir}",
        f"data.val_path={val_dir}",
    ]


def training_device(cfg_device: str) -> torch.device:
    """The device a run with ``train.device: cfg_device`` trains on (as :func:`obow.training.build.setup_process`
    chooses it for one process): the GPU when one is visible and not refused, else the CPU."""
    import torch

    return torch.device("cuda" if cfg_device != "cpu" and torch.cuda.is_available() else "cpu")


def asked_train(overrides: list[str]) -> dict:
    """The ``train.*`` settings among the user's ``key=value`` overrides, as one dict."""
    from obow.config import parse_override

    asked = [parse_override(item).get("train", {}) for item in overrides]
    return {k: v for item in asked if isinstance(item, dict) for k, v in item.items()}


def choose_recipe(
    data: DemoData, overrides: list[str], recipe: str | None = None, write_data: bool = True
) -> tuple[str, str | None, list[str]]:
    """The recipe the demo trains ``data`` with on this machine, the line that says why (``None``: no choice was
    made), and the settings the choice adds (the precision it measured faster). ``recipe`` when the user named one
    (``obow demo --recipe``); the dataset's only recipe when it has one, and its first on a GPU; else, on a CPU,
    the first of ``data.recipes`` (best first) whose demo a short probe of this machine estimates within the
    budget, at the faster precision (:func:`obow.experiments.demo_probe.choose_by_probe`). The device is the one
    the run would train on with the user's ``overrides`` (``train.device``); their ``key=value`` changes apply to
    whichever recipe is chosen, and win over it (a ``train.precision`` of theirs is the only one probed).
    ``write_data``: whether the demo's images are still to be written (part of the estimate)."""
    from obow.config import load_config

    if recipe is not None:
        load_config(recipe)  # an unknown recipe: an error before the data is written
        return recipe, None, []
    if len(data.recipes) == 1:
        return data.recipes[0], None, []
    train = asked_train(overrides)
    device = training_device(train.get("device", load_config(data.recipes[0]).train.device))
    if device.type != "cpu":
        return data.recipes[0], None, []
    from obow.experiments.demo_probe import choose_by_probe

    configs = {name: load_config(name, overrides) for name in data.recipes}
    choice = choose_by_probe(configs, device, write_data, precisions=train.get("precision"))
    added = [] if "precision" in train else [f"train.precision={choice.precision}"]
    return choice.recipe, choice.line(), added


#: The demo's choice (its recipe and the settings the choice added), kept in its folder beside the run.
CHOICE_FILE = "demo_choice.json"


def earlier_choice(
    out: Path, dataset: str, overrides: list[str], recipe: str | None
) -> tuple[str, str, list[str]] | None:
    """What :func:`choose_recipe` chose when the demo in ``out`` began (its :data:`CHOICE_FILE`), as
    ``choose_recipe`` returns it, when that demo's run has a checkpoint to go on from and the user names neither a
    recipe nor a precision now; else ``None`` (choose again). A probe times this machine as it is now: on a busy
    machine it can pick another precision than it did, and the run in ``out`` would then be refused as one of other
    settings."""
    begun = (out / "pretrain" / "checkpoint.pt").is_file()
    if recipe is not None or not begun or "precision" in asked_train(overrides):
        return None
    try:
        saved = json.loads((out / CHOICE_FILE).read_text())
        earlier, added, kind = saved["recipe"], [str(item) for item in saved["added"]], saved["dataset"]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # a demo folder of an obow before this file: choose again
    if kind != dataset or not isinstance(earlier, str):
        return None
    how = " ".join(added) or "its own settings"
    line = (
        f"Demo: going on with the demo in {out}: recipe '{earlier}' with {how}, as chosen when it began (no new "
        "probe); `obow demo --recipe NAME` or another --out runs another"
    )
    return earlier, line, added


def run_demo(out: Path, overrides: list[str], dataset: str = "digits", recipe: str | None = None) -> dict:
    """Write the data, pretrain with the dataset's recipe (or the one :func:`choose_recipe` picks for this CPU,
    or ``recipe``), compare with random init; return the numbers."""
    import torch

    from obow.config import load_config
    from obow.data.eval_sets import eval_dataset
    from obow.diagnostics import feature_diagnostics
    from obow.evaluate.features import decode_set, decoded_features
    from obow.evaluate.fewshot import prototype_accuracy, sample_episodes
    from obow.evaluate.knn import knn_accuracy
    from obow.evaluate.monitor import KNNMonitor
    from obow.training.loop import pretrain
    from obow.training.run.precision import resolve_precision
    from obow.training.run.settings_check import SettingsChanged
    from obow.training.run.state import RunError
    from obow.weights.load import load_backbone

    start = time.time()
    from obow.checks import check_choice

    check_choice("dataset", dataset, tuple(DATASETS))
    data = DATASETS[dataset]
    written = (out / "data" / dataset / ".complete").exists()
    kept = earlier_choice(out, dataset, overrides, recipe)
    recipe, why, chosen = kept or choose_recipe(data, overrides, recipe, write_data=not written)
    if why:
        print(why, flush=True)
    train_dir, val_dir = write_demo_data(dataset, out / "data")  # data that cannot be had: nothing left in out
    choice = json.dumps({"dataset": dataset, "recipe": recipe, "added": chosen}, indent=2) + "\n"
    if not (out / "pretrain" / "checkpoint.pt").is_file():  # a new run: its choice, kept should it be stopped
        with writing(out / CHOICE_FILE) as path:
            path.write_text(choice)
    cfg = load_config(recipe, demo_settings(out, [*chosen, *overrides], train_dir, val_dir))
    log.info("Demo: pretraining %s on %s (recipe '%s')", cfg.model.arch, train_dir, recipe)
    try:
        result = pretrain(cfg, out / "pretrain", monitor=KNNMonitor)
    except SettingsChanged as err:  # said for the demo: no checkpoint or epochs to know about
        raise RunError(
            f"{out} holds a demo run with other settings ({err.diffs}): an earlier obow's recipe or other "
            f"key=value settings. `obow demo --out OTHER_FOLDER` starts a new demo there; removing {out} starts it here"
        ) from None
    if kept is None:  # the run took a choice made now (a refused one never gets here); a kept one is on file
        with writing(out / CHOICE_FILE) as path:
            path.write_text(choice)
    # a run finished by an earlier call trains nothing now: its time is the one that call wrote down
    pretrained_earlier = bool(result.get("already_finished"))
    pretrain_time = earlier_pretrain_seconds(out) if pretrained_earlier else run_seconds(out / "pretrain" / "log.jsonl")

    # the evaluation images decoded once (the teacher's deterministic view, uint8) for both networks: reading the
    # 4,491 files through a loader for each network cost about as much as the two networks' forward passes
    train_images, val_images = (
        decode_set(eval_dataset(folder, cfg.views, pixels=True), cfg.views.mean, cfg.views.std)
        for folder in (train_dir, val_dir)
    )
    train_y, val_y = train_images.labels, val_images.labels
    rows = {}
    for name, kwargs in (
        ("random init", {"random_init": True, "arch": cfg.model.arch, "stem": cfg.model.stem, "seed": cfg.train.seed}),
        ("OBoW pretrained", {"checkpoint": result["checkpoint"]}),
    ):
        if name == "random init":
            kwargs["arch_options"] = cfg.model.arch_options
        backbone, _ = load_backbone(**kwargs)
        if cfg.train.channels_last:  # as the run trained; with the single decode the evaluation of a finished demo
            # took 10.4-10.7 s against 15.0-15.5 s (docs/results/demo.md)
            backbone = backbone.to(memory_format=torch.channels_last)
        train_x, val_x = (decoded_features(backbone, images) for images in (train_images, val_images))
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
        "beats_constant_predictor": beats_constant_predictor(pretext)[0],
        "pretrain_seconds": pretrain_time,  # None: the run was finished by a call whose report is gone
        "pretrained_earlier": pretrained_earlier,
        "total_seconds": total,
        "dataset": dataset,
        "recipe": recipe,
        "precision": resolve_precision(cfg.train.precision, training_device(cfg.train.device)),
        "choice": why,
        "out": str(out),
    }
    with writing(out / "demo_results.json") as path, open(path, "w") as f:
        json.dump(report, f, indent=2)
    print_table(rows, pretext, pretrain_time, total, curve, data.title, pretrained_earlier=pretrained_earlier)
    print(
        f"\nwritten: {out / 'demo_results.json'} (these numbers), the run in {out / 'pretrain'} (checkpoint.pt, "
        f"log.jsonl); its curves: obow show run {out}"
    )
    return report


def earlier_pretrain_seconds(out: Path) -> float | None:
    """The pretraining seconds the last ``obow demo`` in ``out`` wrote in its ``demo_results.json`` (``None`` when
    none says)."""
    try:
        seconds = json.loads((out / "demo_results.json").read_text())["pretrain_seconds"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return float(seconds) if isinstance(seconds, int | float) else None


def run_seconds(log_path: Path) -> float:
    """The seconds the run trained, over every call that trained it (a resumed run's earlier calls too): its
    epochs' steps and kNN monitor, from the epoch records of its log."""
    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    epochs = [r for r in records if r.get("type") == "epoch"]
    return sum(r.get("epoch_time_s", 0.0) + r.get("monitor_time_s", 0.0) for r in epochs)


def knn_curve(log_path: Path) -> list[tuple[int, float]]:
    """``(epoch, kNN top-1)`` of the pretraining run's kNN monitor (same k and temperature as the table)."""
    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    return [(r["epoch"], r["knn_top1"]) for r in records if r.get("type") == "epoch" and "knn_top1" in r]


def pretext_summary(log_path: Path, levels: tuple[str, ...]) -> dict[str, float]:
    """How well the student does its own task: the BoW-prediction loss per view group and level (the mean of
    the logged ``loss/group*/<level>``) at the first logged step and over the last epoch, next to the loss of
    a student that predicts the batch's average BoW for every image (``kl_to_mean_bow``), and how far its
    predictions spread around their own mean over the last epoch (``predicted_kl_to_mean``: 0 when it predicts
    one BoW for every image), each the mean over levels and logged steps."""
    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    steps = [r for r in records if "type" not in r]
    last_epoch = [r for r in steps if r["epoch"] == steps[-1]["epoch"]]

    def group_loss(r: dict) -> float:
        return float(np.mean([v for k, v in r.items() if k.startswith("loss/group")]))

    def average_bow(r: dict) -> float:
        return float(np.mean([r[f"{level}/kl_to_mean_bow"] for level in levels]))

    def spread(r: dict) -> float:
        return float(np.mean([r[f"{level}/predicted_kl_to_mean"] for level in levels]))

    return {
        "first_loss": group_loss(steps[0]),
        "last_epoch_loss": float(np.mean([group_loss(r) for r in last_epoch])),
        "last_epoch_average_bow_loss": float(np.mean([average_bow(r) for r in last_epoch])),
        "last_epoch_predicted_kl_to_mean": float(
            np.mean([spread(r) for r in last_epoch if f"{levels[0]}/predicted_kl_to_mean" in r])
        ),
    }


def beats_constant_predictor(pretext: dict[str, float]) -> tuple[bool, str]:
    """Does the student do better at its pretext task than predicting one BoW, the batch's average, for every
    image? Yes when, over the last epoch (:func:`pretext_summary`), its loss is below that constant predictor's
    (``kl_to_mean_bow``) and its predictions differ between images: their ``predicted_kl_to_mean`` is at least
    :data:`PREDICTION_SPREAD_SHARE` of the targets' ``kl_to_mean_bow`` (what predictions equal to their targets
    would reach). Returns the verdict and a sentence that says it with the numbers."""
    loss, constant = pretext["last_epoch_loss"], pretext["last_epoch_average_bow_loss"]
    spread = pretext["last_epoch_predicted_kl_to_mean"]
    lower, spreads = loss < constant, spread >= PREDICTION_SPREAD_SHARE * constant
    numbers = (
        f"loss {loss:.3f} against {constant:.3f} for the batch's average BoW, predictions spread "
        f"{spread:.3f} around their mean (predicted_kl_to_mean; the targets spread {constant:.3f})"
    )
    if lower and spreads:
        return True, f"The student beats the constant predictor over the last epoch: {numbers}."
    why = "its loss is not below the constant predictor's" if not lower else "its predictions barely differ"
    if not lower and not spreads:
        why += " and its predictions barely differ"
    return False, f"The student does NOT beat the constant predictor over the last epoch ({why}): {numbers}."


def print_table(
    rows: dict[str, dict[str, float]],
    pretext: dict[str, float],
    pretrain_time: float | None,
    total: float,
    curve: Sequence[tuple[int, float]] = (),
    title: str = DATASETS["digits"].title,
    pretrained_earlier: bool = False,
) -> None:
    """The demo's table and closing lines; ``pretrained_earlier``: the run was finished by an earlier call, which
    took ``pretrain_time`` seconds to pretrain (``None``: unknown)."""
    columns = (
        ("kNN k=20", "knn_k20"),
        ("10-way 1-shot", "fewshot_10way_1shot"),
        ("10-way 5-shot", "fewshot_10way_5shot"),
        ("eff. rank", "effective_rank"),
    )
    print(
        f"\n{title}, validation folder (kNN: k=20, T=0.07, the main metric; few-shot: 200 episodes, "
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
    print(beats_constant_predictor(pretext)[1])
    if not pretrained_earlier:
        assert pretrain_time is not None  # timed by this call
        took = f"pretraining {pretrain_time / 60:.1f} min, demo total {total / 60:.1f} min"
    else:
        before = "" if pretrain_time is None else f" in {pretrain_time / 60:.1f} min"
        took = (
            f"pretraining already done by an earlier obow demo{before} (the run is finished: nothing was trained "
            f"now), evaluated again in {total / 60:.1f} min"
        )
    print(f"kNN accuracy, pretrained minus random init: {gain:+.2f} points; {took}.")
    if gain <= 0:
        print(
            "This run did not improve on the random network's features (docs/results/demo.md and\n"
            "docs/short-runs.md say what was measured, and at which budgets OBoW does)."
        )
