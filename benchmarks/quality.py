"""Quality benchmark: does a budget-limited OBoW run give better features than the same network at random init?

For every run given, it pretrains with the recipe (and overrides) on ``DATA/train`` (all of it or the first
``--per-class`` images of each class), then measures, on the student's ``pool5`` features of the recipe's
evaluation view (resize + centre crop, the teacher's view), for the pretrained network AND for the same
architecture at its random initialisation (the run's own starting weights: same seed), with the same
feature extraction:

* weighted kNN, k=200, T=0.1 (the InstDisc / MoCo / lightly protocol): memory = the training images used for
  pretraining, queries = ``DATA/test`` (or ``val``; all of it or ``--test-per-class`` per class);
* a linear probe on the frozen features (non-affine batch norm + linear layer, the ``resnet18`` preset's SGD
  settings: 50 epochs, lr 10 divided by 10 at 15/30/45, batch 256; the centre view only);
* the collapse diagnostics of the test features: effective rank and mean pairwise cosine.

It prints one table and writes ``<out>/quality.json``. Runs are resumable: a finished pretraining is reused.

    python benchmarks/quality.py --data cifar10 --out runs/quality \\
        --run "current cifar10_resnet18 optim.epochs=1" \\
        --run "fast cifar10_fast" --per-class 500 --test-per-class 200

Budgets: ``optim.epochs`` (an override) fixes the steps; ``--minutes M`` instead times a few steps of each
run first (:func:`obow.experiments.budget.seconds_per_step`) and sets ``optim.epochs`` to the whole epochs that
fit in M minutes, keeping the recipe's warm-up up to half the run (the tables' rule). The wall time of the
pretraining is measured and reported either way; on a shared machine it is longer than on an idle one.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch

from obow.config import load_config
from obow.data.eval_sets import align_classes, eval_dataset
from obow.data.folders import scan_images
from obow.evaluate.monitor import KNNMonitor
from obow.evaluate.protocol import evaluate_backbone
from obow.experiments.budget import plan_epochs, seconds_per_step, short_run_warmup
from obow.files import WriteError, writing
from obow.training.loop import pretrain
from obow.training.run.lock import FolderInUse, RunLock
from obow.weights.load import load_backbone


def parse_run(text: str) -> tuple[str, str, list[str]]:
    parts = shlex.split(text)
    if len(parts) < 2:
        raise SystemExit(f"--run {text!r}: give 'NAME RECIPE [key=value ...]'")
    return parts[0], parts[1], parts[2:]


def test_folder(data: Path) -> Path:
    for name in ("test", "val"):
        if (data / name).is_dir():
            return data / name
    raise SystemExit(f"{data} has no test/ or val/ folder")


def evaluate(backbone: torch.nn.Module, train_set, test_set, k: int, temperature: float) -> dict[str, float]:
    """kNN, the BN + linear probe and the diagnostics of :mod:`obow.evaluate.protocol` (no few-shot here)."""
    return evaluate_backbone(backbone, train_set, test_set, k=k, temperature=temperature, shots=())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, type=Path, help="a folder with train/ and test/ (or val/)")
    parser.add_argument("--out", default=Path("runs/quality"), type=Path)
    parser.add_argument("--run", action="append", required=True, help="'NAME RECIPE [key=value ...]', repeatable")
    parser.add_argument("--per-class", type=int, default=None, help="pretrain on the first N images per class")
    parser.add_argument("--test-per-class", type=int, default=None, help="query with the first N test images")
    parser.add_argument("--minutes", type=float, default=None, help="fit optim.epochs to this training time")
    parser.add_argument("--k", type=int, default=200, help="kNN neighbours (default 200)")
    parser.add_argument("--temperature", type=float, default=0.1, help="kNN temperature (default 0.1)")
    args = parser.parse_args()

    train_dir, test_dir = args.data / "train", test_folder(args.data)
    with RunLock(args.out):  # one benchmark per output folder: its runs and quality.json are shared
        rows = []
        for text in args.run:
            name, recipe, overrides = parse_run(text)
            out = args.out / name
            common = [f"data.path={train_dir}", "train.progress_bar=false"]
            if args.per_class:
                common.append(f"data.images_per_class={args.per_class}")
            overrides = [*common, *overrides]
            if args.minutes is not None and not (out / "checkpoint.pt").exists():
                probe_cfg = load_config(recipe, overrides)
                per_epoch = len(scan_images(train_dir, "folders", probe_cfg.data.images_per_class)) // (
                    probe_cfg.data.batch_size
                )
                seconds = seconds_per_step({name: probe_cfg})[name]
                epochs = plan_epochs(args.minutes, seconds, per_epoch)
                warmup = short_run_warmup(probe_cfg.optim.warmup_epochs, epochs)
                overrides += [f"optim.epochs={epochs}", f"optim.warmup_epochs={warmup}"]
                print(f"{name}: {seconds:.2f} s/step, {per_epoch} steps/epoch -> {epochs} epochs", flush=True)
            cfg = load_config(recipe, overrides)
            start = time.time()
            result = pretrain(cfg, out, monitor=KNNMonitor)
            wall = time.time() - start
            timing = out / "quality_timing.json"  # the first (real) pretraining's wall time, kept across re-runs
            if not timing.exists():
                with writing(timing):
                    timing.write_text(json.dumps({"pretrain_seconds": wall}))
            history = json.loads(timing.read_text())

            train_images = scan_images(train_dir, "folders", cfg.data.images_per_class)
            test_images = align_classes(train_images, scan_images(test_dir, "folders", args.test_per_class))
            train_set, test_set = eval_dataset(train_images, cfg.views), eval_dataset(test_images, cfg.views)
            random_net, _ = load_backbone(
                random_init=True,
                arch=cfg.model.arch,
                stem=cfg.model.stem,
                seed=cfg.train.seed,
                arch_options=cfg.model.arch_options,
            )
            trained_net, _ = load_backbone(result["checkpoint"])
            random_scores = evaluate(random_net, train_set, test_set, args.k, args.temperature)
            trained_scores = evaluate(trained_net, train_set, test_set, args.k, args.temperature)
            epochs = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
            curve = [(r["epoch"], r["knn_top1"]) for r in epochs if r.get("type") == "epoch" and "knn_top1" in r]
            rows.append(
                {
                    "name": name,
                    "recipe": recipe,
                    "overrides": overrides,
                    "arch": cfg.model.arch,
                    "steps": result["iteration"],
                    "train_images": len(train_images),
                    "test_images": len(test_images),
                    "pretrain_minutes": history["pretrain_seconds"] / 60,
                    "random_init": random_scores,
                    "pretrained": trained_scores,
                    "knn_gain": trained_scores["knn"] - random_scores["knn"],
                    "linear_gain": trained_scores["linear"] - random_scores["linear"],
                    "monitor_knn_per_epoch": curve,
                }
            )
            with writing(args.out / "quality.json") as path:
                path.write_text(json.dumps(rows, indent=2))
            print_table(rows)
    return 0


def print_table(rows: list[dict]) -> None:
    print(
        "\n| run | arch | steps | train min | kNN random | kNN OBoW | kNN gain | linear random | linear OBoW "
        "| linear gain | eff. rank random / OBoW |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        a, b = r["random_init"], r["pretrained"]
        print(
            f"| {r['name']} | {r['arch']} | {r['steps']} | {r['pretrain_minutes']:.1f} | {a['knn']:.2f} | "
            f"{b['knn']:.2f} | {r['knn_gain']:+.2f} | {a['linear']:.2f} | {b['linear']:.2f} | "
            f"{r['linear_gain']:+.2f} | {a['effective_rank']:.1f} / {b['effective_rank']:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (FolderInUse, WriteError) as err:  # another benchmark on --out, or a failed write: one line
        sys.exit(f"quality.py: error: {err}")
