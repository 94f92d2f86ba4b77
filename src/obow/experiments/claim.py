"""The paper's central claim as one experiment (issue 55): OBoW (full) against MoCo v2 with the same augmentations,
rows 2 and 4 of ``obow tables mocov2`` (the paper: 50.89 against 43.13 linear), on all of CIFAR-10, side by side on
one GPU. What a call of it is made of, whatever its deadline: its rows and the changes every row gets
(:func:`table_overrides`: one batch, its learning rate by linear scaling from the recipe's, the device pipeline,
channels_last, the step mode, kNN k=200), its data (:func:`find_data`), what it prepares before it times anything
(:func:`build_image_cache`, :func:`decode_seconds`, :func:`warm_gpu`) and its verdict (:func:`verdict_text`).

The call itself, against its deadline (the probe, the epochs that fit, the table run, the live copies into the
call's folder, the merge of a returned call): ``benchmarks/gpu_claim.py``.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from obow.experiments.budget import scaled_lr
from obow.experiments.tables.catalog import TABLES, Row, placeholders, select_rows
from obow.experiments.tables.compare import compare_rows

TABLE = "mocov2"
#: The two rows of the claim, by their number in ``obow tables mocov2``: OBoW (full) and MoCo v2 (our aug.).
ROWS = ("2", "4")
#: The recipes a call may train, the full width first.
RECIPES = ("cifar10_resnet18", "cifar10_fast")


def step_accepted(recipe: str, step: str) -> str | None:
    """``None`` when this tree's configuration takes ``train.compile=step``, else why not (one line)."""
    from obow.config import ConfigError, load_config

    try:
        load_config(recipe, [f"train.compile={step}"])
    except (ConfigError, ValueError) as err:
        return str(err).splitlines()[0]
    return None


def batch_size(recipe: str, batch: int | None) -> int:
    """The call's batch: ``batch``, or the recipe's when ``None``."""
    from obow.config import load_config

    return batch or load_config(recipe).data.batch_size


def table_overrides(recipe: str, step: str, batch: int | None, extra: list[str]) -> list[str]:
    """The changes every row of the call gets (the table's ``overrides``): the batch, its learning rate by linear
    scaling, the device pipeline, channels_last, the step mode, kNN k=200 for the curves."""
    from obow.config import load_config

    base = load_config(recipe)
    size = batch_size(recipe, batch)
    lr = scaled_lr(base.optim.lr, base.data.batch_size, size)
    return [
        f"data.batch_size={size}",
        f"optim.lr={lr:.6g}",
        "data.pipeline=device",
        "train.channels_last=true",
        f"train.compile={step}",
        "train.knn_k=200",
        "train.tensorboard=false",
        *extra,
    ]


@dataclass
class Data:
    root: Path
    train: Path
    test: Path
    train_images: int
    test_images: int
    scan_s: float  # listing both folders' images, as the table command does at its start


def find_data(root: Path) -> Data:
    """The claim's images: ``root/train`` and ``root/test`` (or ``val``) class folders, counted; a one-line
    ``ValueError`` when they are not there."""
    from obow.data.folders import scan_images

    test = next((root / d for d in ("test", "val") if (root / d).is_dir()), None)
    if not (root / "train").is_dir() or test is None:
        raise ValueError(f"{root} must hold train/ and test/ class folders (C10: CIFAR-10 unpacked)")
    start = time.perf_counter()
    train_images, test_images = (len(scan_images(folder, "folders")) for folder in (root / "train", test))
    return Data(root, root / "train", test, train_images, test_images, round(time.perf_counter() - start, 3))


def build_image_cache(data: Data, recipe: str) -> tuple[str, float]:
    """The device pipeline's cache of the training images, built once (what every row would otherwise decode at its
    start): its description and the seconds it took."""
    from obow.config import load_config
    from obow.data.cache import build_cache
    from obow.data.folders import scan_images
    from obow.methods import cache_side

    cfg = load_config(recipe)
    start = time.perf_counter()
    train = scan_images(data.train, "folders")
    cache = build_cache(train, cache_side(cfg), cfg.data.cache_size, cfg.data.cache_dir)
    return cache.describe(), time.perf_counter() - start


def decode_seconds(data: Data, recipe: str, sample: int) -> tuple[float, int]:
    """The evaluation's decoding timed on the first ``sample`` test images, one at a time: seconds an image, and
    the images timed."""
    from obow.config import load_config
    from obow.data.eval_sets import eval_dataset
    from obow.data.folders import scan_images

    test = scan_images(data.test, "folders")
    assert test.labels is not None  # class folders
    n = min(len(test), sample)
    images = eval_dataset(
        dataclasses.replace(test, paths=test.paths[:n], labels=test.labels[:n]), load_config(recipe).views
    )
    start = time.perf_counter()
    for i in range(n):
        images[i]
    return (time.perf_counter() - start) / n, n


def warm_gpu() -> str | None:
    """On a GPU, a first convolution forward and backward here (bf16, channels_last, cuDNN's tuning on): a fresh
    machine's first CUDA process pays the driver's start and its kernels' first loading, which would otherwise fall
    in the first probe's 40 s."""
    import torch

    if not torch.cuda.is_available():
        return None
    start = time.perf_counter()
    torch.backends.cudnn.benchmark = True
    conv = torch.nn.Conv2d(3, 64, 3, padding=1).cuda().to(memory_format=torch.channels_last)
    images = torch.randn(512, 3, 32, 32, device="cuda").to(memory_format=torch.channels_last)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        conv(images).float().square().mean().backward()
    torch.cuda.synchronize()
    return f"GPU warmed: {torch.cuda.get_device_name(0)}, a first convolution in {time.perf_counter() - start:.1f} s"


def rows_of_table() -> list[Row]:
    return select_rows(TABLES[TABLE], list(ROWS))


def row_items(recipe: str, data: Data, overrides: list[str]) -> tuple[list[Row], dict[str, Any]]:
    """The claim's rows and the values of their placeholders (:func:`~obow.experiments.tables.placeholders`)."""
    from obow.config import load_config

    base = load_config(recipe, [f"data.path={data.train}", *overrides])
    return rows_of_table(), placeholders(base, data.train_images)


def verdict_text(record: dict[str, Any]) -> str:
    """``paired.md``: OBoW (full) minus MoCo v2 (our aug.), and each row minus the random init, seed by seed, with
    ``obow tables paired``'s verdicts."""
    measured = {row["slug"] for row in record["rows"] if row["runs"]}
    runs = [run for row in (record["random_init"], *record["rows"]) for run in row["runs"]]
    # the scores every run has (5-shot needs 6 test images a class: a tiny dry run has fewer)
    scores = tuple(s for s in ("knn", "linear", "fewshot_1", "fewshot_5") if all(s in run["scores"] for run in runs))
    parts = ["# The paired verdict (`obow tables paired`'s rule: a difference counts when every seed agrees and the "
             "mean exceeds the spread; one seed is not judged)", ""]  # fmt: skip
    if {"obow_full", "moco_v2_our_aug"} <= measured:
        parts.append(compare_rows(record, "moco_v2_our_aug", scores))
    else:
        parts.append(f"Not both rows evaluated (measured: {', '.join(sorted(measured)) or 'none'}): no verdict.\n")
    if record["random_init"]["runs"] and measured:
        parts.append(compare_rows(record, "random_init", scores))
    return "\n".join(parts)


def cuda_available() -> bool:
    """Whether this machine has a CUDA device (asked in a child process: this one stays free of CUDA)."""
    probe = [sys.executable, "-c", "import torch; print(torch.cuda.is_available())"]
    try:
        return subprocess.run(probe, capture_output=True, text=True, timeout=120).stdout.strip() == "True"
    except (OSError, subprocess.TimeoutExpired):
        return False


def like_folder(folder: Path, seed: int) -> tuple[str, int, list[str], list[str]]:
    """A later seed's recipe, epochs and changes: those of the table folder ``folder`` (``--like``), so that its
    runs join that folder's seed by seed; and a line for each call merged there (its ``calls/*claim.json``): how
    long its table took, with no probe this call's only guide to whether the epochs fit. A one-line ``ValueError``
    when ``folder`` holds ``seed`` already."""
    record = json.loads((folder / "table.json").read_text())
    seeds = {run["seed"] for row in record["rows"] for run in row["runs"]}
    if seed in seeds:
        raise ValueError(f"{folder} already holds seed {seed}: give another --seed")
    lines = []
    for path in sorted((folder / "calls").glob("*claim.json")):
        earlier = json.loads(path.read_text())
        run = earlier.get("run", {})
        how = f"cut ({run['cut']})" if run.get("cut") else "finished"
        lines.append(
            f"{path.name}: {earlier.get('choice', {}).get('epochs')} epochs on {earlier.get('machine')}: table "
            f"started at {run.get('started_s')} s, ended at {run.get('ended_s')} s of its call, {how}"
        )
    return record["recipe"], record["budget"]["epochs"], list(record["overrides"]), lines
