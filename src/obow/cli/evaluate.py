"""The ``obow eval`` commands.

    obow eval knn      --checkpoint runs/x/checkpoint.pt --data DIR [--k 200 20] [--temperature 0.1]
    obow eval linear   --checkpoint runs/x/checkpoint.pt --data DIR [--preset resnet18|resnet50] [--epochs N]
    obow eval fewshot  --checkpoint runs/x/checkpoint.pt --data DIR [--ways 50] [--shots 1 5] [--episodes 200]
    obow eval finetune --checkpoint runs/x/checkpoint.pt --data DIR [--fraction 0.01|0.1]
    obow eval svm      --checkpoint runs/x/checkpoint.pt --data VOCdevkit/VOC2007 [--costs 0.05 0.1 ...]
    obow eval knn --random-init --arch resnet18 --data DIR --out random.json     # the baseline
    obow eval knn --checkpoint runs/x/checkpoint.pt --data DIR --with-random-init  # both, one after the other
    obow eval knn --backbone runs/x/backbone.pth --data DIR --with-random-init     # the same for an export

``DIR`` holds ``train/`` and ``val/`` (or ``test/``) class folders. kNN, linear and fine-tuning train on
``train/`` and test on ``val/``; few-shot episodes are drawn from ``val/`` (the paper draws them from the
ImageNet validation images, appendix "Evaluation protocols in Section 4.1") unless ``--split train``.
``obow eval svm`` reads a folder in the VOC devkit layout instead (:mod:`obow.data.voc`): linear SVMs on
``trainval``, mAP on ``test`` (:mod:`obow.evaluate.svm`).
Each command prints a small table and writes a JSON report (default ``<checkpoint dir>/eval/<protocol>.json``,
``<protocol>_teacher.json`` for ``--network teacher``, ``<protocol>_random_init.json`` for ``--random-init`` of a
checkpoint's network, ``<backbone dir>/eval/<protocol>_backbone-<name>.json`` for ``--backbone`` (``<name>``: the
file's stem for a ``.pth`` file, its whole name otherwise) and ``<protocol>_random_init_backbone-<name>.json`` for
the random initialisation of its network; ``runs/eval/random_init_<recipe or arch_stem>/<protocol>.json`` for
``--random-init`` without a checkpoint, its name made of letters, digits, ``.``, ``_`` and ``-`` only). A default
report that is another file's (two checkpoints in one folder share ``eval/<protocol>.json``) is not replaced: the
command stops before its work and asks for ``--out``. ``--with-random-init`` evaluates the network of the
checkpoint or backbone file at its random initialisation (same seed, view and data) after the trained weights,
into its own report.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import re
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from obow import __version__
from obow.cli.common import NETWORKS, STEMS, device_from_name, positive_float, positive_int, splits_folder, write_json
from obow.notices import ObowWarning

if TYPE_CHECKING:
    import numpy as np
    import torch

    from obow.config import Config, ViewsConfig
    from obow.data.folders import ImageList
    from obow.data.voc import MultiLabelSet

PROTOCOLS = ("knn", "linear", "fewshot", "finetune", "svm")
EXTRACT_BATCH = 256
#: The split folders under --data; one of them given as --data is named in the error, with the folder to give.
# Spelled out so that building the parser imports no PyTorch; tests/test_rough_edges.py checks each.
LINEAR_PRESET_NAMES = ("resnet18", "resnet50")  # obow.evaluate.linear.LINEAR_PRESETS
#: Fine-tuning presets by labelled fraction (paper section 4.3; obow.evaluate.finetune.FINETUNE_PRESETS).
FRACTIONS = {0.01: "1%", 0.1: "10%"}
DEFAULT_TEMPERATURE = 0.1  # obow.evaluate.knn.DEFAULT_TEMPERATURE


def add_eval_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``obow eval PROTOCOL ...``; each protocol sets ``func`` to its runner."""
    parser = subparsers.add_parser(
        "eval",
        help="evaluate a pretrained backbone: knn, linear, fewshot, finetune or svm (VOC07)",
        description="Evaluate a backbone on a folder with train/ and val/ (or test/) class folders (svm: a folder "
        "in the PASCAL VOC devkit layout).",
    )
    protocols = parser.add_subparsers(title="protocols", dest="protocol", metavar="PROTOCOL", required=True)
    common = _common_options(CLASS_FOLDERS_HELP)

    p = protocols.add_parser("knn", parents=[common], help="weighted kNN on frozen pool5 features")
    p.add_argument("--k", type=positive_int, nargs="+", help="neighbours (default: both 200 and 20)")
    p.add_argument("--temperature", type=positive_float, default=DEFAULT_TEMPERATURE, help="default 0.1")
    p.set_defaults(func=with_baseline(run_knn))

    p = protocols.add_parser("linear", parents=[common], help="linear probe on pre-cached features (sec. 4.1)")
    p.add_argument("--preset", choices=LINEAR_PRESET_NAMES, help="default: resnet18 for resnet18/34, else resnet50")
    p.add_argument("--epochs", type=positive_int, help="override the preset's epochs")
    p.add_argument("--lr", type=positive_float, help="override the preset's learning rate")
    p.add_argument("--wd", type=float, help="override the preset's weight decay")
    p.add_argument("--batch", type=positive_int, help="override the preset's batch size")
    p.add_argument(
        "--batch-norm", action="store_true", help="a non-affine batch norm before the linear layer (scale-free)"
    )
    p.set_defaults(func=with_baseline(run_linear))

    p = protocols.add_parser("fewshot", parents=[common], help="N-way K-shot prototype episodes (sec. 4.1)")
    p.add_argument("--ways", type=positive_int, help="classes per episode (default min(50, classes))")
    p.add_argument("--shots", type=positive_int, nargs="+", default=[1, 5], help="default: 1 5")
    p.add_argument("--queries", type=positive_int, default=1, help="query images per class (default 1)")
    p.add_argument("--episodes", type=positive_int, default=200, help="default 200")
    p.add_argument("--split", choices=("val", "train"), default="val", help="where episodes come from (val)")
    p.set_defaults(func=with_baseline(run_fewshot))

    p = protocols.add_parser("finetune", parents=[common], help="semi-supervised fine-tuning (sec. 4.3)")
    p.add_argument("--fraction", type=float, choices=tuple(FRACTIONS), default=0.01, help="0.01 or 0.1")
    p.add_argument("--epochs", type=positive_int, help="override the preset's epochs")
    p.add_argument("--head-lr", type=positive_float, help="override the head's learning rate (0.5)")
    p.add_argument("--trunk-lr", type=float, help="override the trunk's learning rate (0.0002)")
    p.add_argument("--milestones", type=positive_int, nargs="*", help="override the decay epochs")
    p.add_argument("--gamma", type=positive_float, help="override the decay factor (0.2)")
    p.add_argument("--wd", type=float, help="override the weight decay (0)")
    p.set_defaults(func=with_baseline(run_finetune))

    p = protocols.add_parser(
        "svm", parents=[_common_options(VOC_HELP)], help="VOC07 classification: linear SVMs per class, mAP (Table 6)"
    )
    p.add_argument("--train-split", default="trainval", help="the split the SVMs learn from (trainval)")
    p.add_argument("--test-split", default="test", help="the split they are scored on (test)")
    p.add_argument("--costs", type=positive_float, nargs="+", help="SVM costs to cross-validate (the authors')")
    p.set_defaults(func=with_baseline(run_svm))
    return parser


CLASS_FOLDERS_HELP = "folder holding train/ and val/ (or test/) class folders"
VOC_HELP = (
    "a folder in the PASCAL VOC devkit layout, e.g. VOCdevkit/VOC2007: JPEGImages/<id>.jpg and "
    "ImageSets/Main/<class>_<split>.txt (not class folders)"
)


def _common_options(data_help: str) -> argparse.ArgumentParser:
    """The options every protocol takes; ``data_help`` says what ``--data`` holds for it."""
    common = argparse.ArgumentParser(add_help=False)
    src = common.add_argument_group("what to evaluate")
    src.add_argument("--checkpoint", help="a pretraining checkpoint, or the run folder of obow pretrain")
    src.add_argument("--network", choices=NETWORKS, help="which network of the checkpoint (default student)")
    src.add_argument(
        "--backbone",
        help="instead of --checkpoint: a file written by `obow export` (--format torchvision or timm), read with "
        "the FILE.json beside it (without it the network is recognised from the weights; --stem if needed)",
    )
    src.add_argument(
        "--random-init",
        action="store_true",
        help="a randomly initialised network (the baseline): that of --checkpoint, --backbone or --config, or --arch",
    )
    src.add_argument(
        "--with-random-init",
        action="store_true",
        help="with --checkpoint or --backbone: then the same network at its random initialisation (same seed, view "
        "and data), its table below and its own report (<protocol>_random_init.json, "
        "<protocol>_random_init_backbone-<name>.json)",
    )
    src.add_argument(
        "--arch",
        help="architecture for --random-init without a checkpoint, or of a --backbone file without its FILE.json "
        "(resnet18, timm:NAME, torchvision:NAME)",
    )
    src.add_argument(
        "--stem",
        choices=STEMS,
        help="stem for --random-init without a checkpoint, or of a --backbone file without its FILE.json "
        "(default torchvision)",
    )
    src.add_argument(
        "--config", help="a recipe (name or YAML) whose network and view --random-init takes, e.g. cifar10_fast"
    )
    run = common.add_argument_group("data and run")
    run.add_argument("--data", required=True, help=data_help)
    run.add_argument(
        "--out",
        help="JSON report (default <checkpoint dir>/eval/<protocol>.json (_teacher, _random_init: their own), "
        "<backbone dir>/eval/<protocol>_backbone-<name>.json for --backbone (name: the file's stem for .pth, else "
        "its name), or for --random-init without a checkpoint runs/eval/random_init_<recipe, or "
        "arch_stem>/<protocol>.json; a default report of another file is not replaced)",
    )
    run.add_argument(
        "--size",
        type=positive_int,
        help="centre-crop size (default: the recipe's teacher size; without a recipe, from the images)",
    )
    run.add_argument("--resize", type=positive_int, help="resize before the crop (default: the recipe's)")
    run.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    run.add_argument("--batch-size", type=positive_int, help="images per batch (default 256)")
    run.add_argument(
        "--workers",
        type=int,
        default=min(4, os.cpu_count() or 1),
        help="data loaders (default: min(4, CPUs))",
    )
    run.add_argument("--seed", type=int, default=0, help="random init, episodes, subsets and shuffling (0)")
    return common


# --------------------------------------------------------------------------------------------- protocols


def with_baseline(runner: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """``runner``, and with ``--with-random-init`` the same protocol again on the network of the checkpoint or
    backbone file at its random initialisation, into its own report (:func:`report_name`, or beside ``--out``)."""

    runner = out_of_memory_in_one_line(runner)

    @functools.wraps(runner)
    def run(args: argparse.Namespace) -> int:
        if not args.with_random_init:
            return runner(args)
        if args.random_init:
            raise ValueError(
                "--with-random-init evaluates trained weights and then their network at its random initialisation; "
                "--random-init leaves no trained weights: drop one of the two"
            )
        if args.checkpoint is None and args.backbone is None:
            raise ValueError(
                "--with-random-init evaluates trained weights and then their network at its random initialisation: "
                "give the weights, --checkpoint or --backbone"
            )
        baseline_out = None
        if args.out:  # beside the checkpoint's report, not over it
            out = Path(args.out)
            baseline_out = str(out.with_name(f"{out.stem}_random_init{out.suffix or '.json'}"))
        code = runner(args)
        if code:
            return code
        print()
        return runner(argparse.Namespace(**{**vars(args), "random_init": True, "network": None, "out": baseline_out}))

    return run


def out_of_memory_in_one_line(runner: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """``runner``, with an out-of-memory error of the allocator (CPU or GPU) or of Python said in one line that
    names what lowers an evaluation's memory, instead of the allocator's message."""

    @functools.wraps(runner)
    def run(args: argparse.Namespace) -> int:
        try:
            return runner(args)
        except (RuntimeError, MemoryError) as err:
            from obow.training.cost import allocation_failed

            asked = allocation_failed(err)
            if asked is None:
                raise
            batch = args.batch_size or (None if args.protocol == "finetune" else EXTRACT_BATCH)
            now = f", now {batch}" if batch else ""
            raise RuntimeError(
                f"out of memory in obow eval {args.protocol}{asked}: lower --batch-size (images per batch{now}), "
                f"--size (the view's side) or --workers (now {args.workers}); on a GPU, --device cpu has more"
            ) from None

    return run


def run_knn(args: argparse.Namespace) -> int:
    """Weighted kNN of ``val/`` against ``train/`` for each ``k`` (default 200 and 20, T = 0.1)."""
    from obow.evaluate.knn import DEFAULT_KS, knn_scores, top1_top5

    run = _Run(args, "knn")
    train_images, test_images = run.splits()
    assert train_images.classes is not None and train_images.labels is not None  # labelled (scan_labelled)
    train_x, train_y = run.features(train_images)
    test_x, test_y = run.features(test_images)
    num_classes = len(train_images.classes)
    # about 2^28 similarities (1 GiB) per chunk of queries, whatever the size of the memory bank
    chunk = max(1, min(1024, 2**28 // len(train_y)))
    train_x, train_y, test_x = train_x.to(run.device), train_y.to(run.device), test_x.to(run.device)
    rows = []
    for k in args.k or DEFAULT_KS:
        scores = knn_scores(
            train_x, train_y, test_x, k=k, temperature=args.temperature, num_classes=num_classes, chunk_size=chunk
        )
        row = {"k": k, "k_used": min(k, len(train_y)), "temperature": args.temperature}
        rows.append({**row, **top1_top5(scores, test_y)})
    run.print_table(
        ["k", "T", "top-1", "top-5"], [[r["k_used"], r["temperature"], r["top1"], r.get("top5")] for r in rows]
    )
    run.write({"knn": rows}, {"k": list(args.k or DEFAULT_KS), "temperature": args.temperature})
    return 0


def run_linear(args: argparse.Namespace) -> int:
    """Linear probe trained on centre-crop and flipped features of ``train/``, tested on ``val/``."""
    from obow.evaluate.linear import capped_lr, preset_for_arch, preset_settings, train_linear_probe

    run = _Run(args, "linear")
    preset = args.preset or preset_for_arch(run.info["arch"])
    settings = preset_settings(preset)
    overrides = {"epochs": args.epochs, "lr": args.lr, "weight_decay": args.wd, "batch_size": args.batch}
    settings.update({k: v for k, v in overrides.items() if v is not None})
    train_images, test_images = run.splits()
    assert train_images.classes is not None and train_images.labels is not None  # labelled (scan_labelled)
    train_x, train_y = run.features(train_images)
    train_flip, _ = run.features(train_images, flip=True)
    test_x, test_y = run.features(test_images)
    classes = len(train_images.classes)
    preset_lr = settings["lr"]
    if args.lr is None:  # the preset's rate, for ImageNet's classes and features, lowered where these diverge at once
        settings["lr"] = capped_lr(preset_lr, train_x, classes, settings["momentum"], args.batch_norm)
        if settings["lr"] < preset_lr:
            print(
                f"linear: lr {settings['lr']:.3g}, not the {preset} preset's {preset_lr:g}: with these features and "
                f"{classes} classes that rate diverges from its first steps (half the largest stable rate is "
                "taken; --lr sets it)"
            )
    with warnings.catch_warnings():  # a divergence is this command's error line below, not a warning before it too
        warnings.filterwarnings("ignore", "the linear probe diverged", ObowWarning)
        result = train_linear_probe(
            [train_x, train_flip],
            train_y,
            test_x,
            test_y,
            **settings,
            seed=args.seed,
            device=run.device,
            num_classes=classes,
            batch_norm=args.batch_norm,
        )
    settings_used = {"preset": preset, "preset_lr": preset_lr}
    if result["diverged"]:  # its accuracy is the noise of a head that blew up, not the features'
        numbers = {"diverged": result["diverged"], "train_loss": result["train_loss"]}
        rest = {k: v for k, v in result.items() if k not in (*numbers, "top1", "top5")}
        run.write(numbers, {**settings_used, **rest})
        raise RuntimeError(
            f"the linear probe diverged at lr {result['lr']:.3g}: {result['diverged']}; no accuracy is reported "
            f"(it would be that of a head that blew up, not of the features); give a smaller --lr, or --batch-norm"
        )
    run.print_table(
        ["preset", "epochs", "top-1", "top-5"], [[preset, result["epochs"], result["top1"], result.get("top5")]]
    )
    numbers = {key: result[key] for key in ("top1", "top5", "train_loss") if key in result}
    run.write(numbers, {**settings_used, **{k: v for k, v in result.items() if k not in numbers}})
    return 0


def run_fewshot(args: argparse.Namespace) -> int:
    """Prototype classification on ``n_way``-way ``n_shot``-shot episodes of one split."""
    from obow.data.eval_sets import scan_labelled
    from obow.evaluate.fewshot import default_ways, prototype_accuracy, sample_episodes

    run = _Run(args, "fewshot")
    split = run.train_dir() if args.split == "train" else run.test_dir()
    images = scan_labelled(split)
    assert images.classes is not None and images.labels is not None  # labelled (scan_labelled)
    ways = args.ways or default_ways(len(images.classes))
    for shots in args.shots:  # fail on impossible settings before the (slow) feature extraction
        sample_episodes(
            images.labels, n_way=ways, n_shot=shots, n_query=args.queries, n_episodes=1, class_names=images.classes
        )
    features, labels = run.features(images)
    rows = []
    for shots in args.shots:
        episodes = sample_episodes(
            labels,
            n_way=ways,
            n_shot=shots,
            n_query=args.queries,
            n_episodes=args.episodes,
            seed=args.seed,
            class_names=images.classes,
        )
        mean, ci95 = prototype_accuracy(features, labels, episodes)
        rows.append({"ways": ways, "shots": shots, "queries": args.queries, "accuracy": mean, "ci95": ci95})
    run.print_table(
        ["ways", "shots", "accuracy", "+-95%"], [[r["ways"], r["shots"], r["accuracy"], r["ci95"]] for r in rows]
    )
    settings = {"ways": ways, "shots": list(args.shots), "queries": args.queries, "episodes": args.episodes}
    run.write({"fewshot": rows}, {**settings, "split": args.split}, data={"split": str(split), **run.data_info(images)})
    return 0


def run_finetune(args: argparse.Namespace) -> int:
    """Fine-tune backbone + linear head on a class-balanced fraction of ``train/``; test on ``val/``."""
    from obow.data.eval_sets import eval_dataset
    from obow.data.folders import ImageDataset
    from obow.evaluate.finetune import FINETUNE_PRESETS, balanced_subset, finetune, finetune_transform
    from obow.evaluate.linear import divergence
    from obow.files import check_writable

    run = _Run(args, "finetune")
    preset_name = FRACTIONS[args.fraction]
    preset = FINETUNE_PRESETS[preset_name]
    settings: dict[str, Any] = {
        "epochs": args.epochs or preset.epochs,
        "head_lr": args.head_lr or preset.head_lr,
        "trunk_lr": preset.trunk_lr if args.trunk_lr is None else args.trunk_lr,
        "milestones": list(preset.milestones if args.milestones is None else args.milestones),
        "gamma": args.gamma or preset.gamma,
        "weight_decay": preset.weight_decay if args.wd is None else args.wd,
        "momentum": preset.momentum,
        "batch_size": args.batch_size or preset.batch_size,
    }
    train_images, test_images = run.splits()
    assert train_images.classes is not None and train_images.labels is not None  # labelled (scan_labelled)
    run.choose_view(train_images)
    subset = balanced_subset(train_images.labels, args.fraction, seed=args.seed)
    subset_file = run.out.with_name(f"{run.out.stem}_subset.json")
    write_json(check_writable(subset_file), subset_listing(train_images, subset))
    result = finetune(
        run.backbone,
        ImageDataset(train_images, finetune_transform(run.views)),
        eval_dataset(test_images, run.views),
        subset,
        **settings,
        device=run.device,
        num_workers=args.workers,
        seed=args.seed,
        num_classes=len(train_images.classes),
    )
    run.skipped.extend(result.pop("skipped_images"))
    if diverged := divergence(result["train_loss"], len(train_images.classes)):
        kept = {"diverged": diverged, "train_loss": result["train_loss"]}
        extra = {k: v for k, v in result.items() if k not in (*kept, "top1", "top5", *settings)}
        run.write(kept, {"preset": preset_name, "fraction": args.fraction, **settings, **extra})
        raise RuntimeError(
            f"fine-tuning diverged at head lr {settings['head_lr']:g}, trunk lr {settings['trunk_lr']:g}: {diverged}; "
            "no accuracy is reported (it would be that of a network that blew up); give a smaller --head-lr and "
            "--trunk-lr"
        )
    run.print_table(
        ["labels", "epochs", "top-1", "top-5"], [[preset_name, settings["epochs"], result["top1"], result.get("top5")]]
    )
    numbers: dict[str, Any] = {
        key: result[key] for key in ("top1", "top5", "train_loss", "train_top1") if key in result
    }
    extra = {k: v for k, v in result.items() if k not in numbers and k not in settings}
    run.write(
        numbers,
        {"preset": preset_name, "fraction": args.fraction, **settings, **extra, "subset_file": str(subset_file)},
    )
    return 0


def run_svm(args: argparse.Namespace) -> int:
    """One linear SVM per class on ``--train-split``, cost by 3-fold cross-validation; AP per class on
    ``--test-split`` without its difficult images, and their mean."""
    from obow.data.voc import DIFFICULT, read_voc
    from obow.evaluate.svm import DEFAULT_COSTS, svm_classification

    run = _Run(args, "svm")
    train, test = read_voc(run.data, args.train_split), read_voc(run.data, args.test_split)
    if train.classes != test.classes:
        raise ValueError(
            f"the classes of {args.train_split} and {args.test_split} differ: {train.classes} vs {test.classes}"
        )
    (train_x, train_t), (test_x, test_t) = run.multilabel_features(train), run.multilabel_features(test)
    costs = tuple(args.costs or DEFAULT_COSTS)
    result = svm_classification(train_x, train_t, test_x, test_t, train.classes, costs)
    rows = [[name, r["ap"], r["cost"]] for name, r in result["per_class"].items()]
    run.print_table(["class", "AP", "cost"], [*rows, ["mAP", result["mAP"], None]])
    data = {
        "train_split": args.train_split,
        "test_split": args.test_split,
        "num_train": len(train_x),
        "num_test": len(test_x),
        "classes": list(train.classes),
        "difficult_test_labels": int((test_t == DIFFICULT).sum()),
    }
    run.write({"mAP": result["mAP"], "per_class": result["per_class"]}, {"costs": list(costs)}, data=data)
    return 0


def subset_listing(images: ImageList, indices: Sequence[int]) -> list[dict[str, Any]]:
    """The images of a fine-tuning subset as ``{"path" (relative to the split), "label", "class"}``."""
    assert images.classes is not None and images.labels is not None  # labelled (scan_labelled)
    return [
        {
            "path": os.path.relpath(images.paths[i], images.root),
            "label": images.labels[i],
            "class": images.classes[images.labels[i]],
        }
        for i in indices
    ]


# ------------------------------------------------------------------------------------------------ shared


class _Run:
    """What every protocol does the same way: load the backbone, find the splits, extract, report."""

    def __init__(self, args: argparse.Namespace, protocol: str) -> None:
        from obow.files import check_writable
        from obow.weights.load import load_backbone

        self.args = args
        self.protocol = protocol
        self.data = Path(args.data)
        if not self.data.is_dir():
            raise ValueError(f"data folder {str(self.data)!r} does not exist")
        if args.network is not None and args.checkpoint is None:
            raise ValueError("--network picks the student or teacher of a --checkpoint; it needs --checkpoint")
        if args.checkpoint is not None:  # a run folder: its newest checkpoint (its reports then go beside it)
            from obow.weights.locate import checkpoint_path

            args.checkpoint = checkpoint_path(args.checkpoint)
        recipe = self._recipe()
        self.backbone, self.info = load_backbone(
            args.checkpoint,
            network=args.network or "student",
            backbone_file=args.backbone,
            random_init=args.random_init,
            arch=args.arch or (recipe.model.arch if recipe else None),
            stem=args.stem or (recipe.model.stem if recipe else None),
            seed=args.seed,
            arch_options=dict(recipe.model.arch_options) if recipe else None,
        )
        if recipe is not None:
            from obow.data.eval_sets import views_dict

            self.info["views"] = views_dict(recipe.views)
        self._views: ViewsConfig | None = None
        self.view_reason = ""
        self.device = device_from_name(args.device)
        self.out = check_writable(self._out_path())  # now, not after the evaluation
        if not args.out:
            check_not_another(self.out, self.info)
        self.skipped: list[str] = []
        self._data_info: dict[str, Any] = {}

    def _recipe(self) -> Config | None:
        """``--config``: the recipe whose network and view a random initialisation takes."""
        if self.args.config is None:
            return None
        if self.args.checkpoint is not None or self.args.backbone is not None or not self.args.random_init:
            raise ValueError(
                "--config gives a random initialisation its network and view (with --random-init and no "
                "--checkpoint or --backbone, whose own recipe is used)"
            )
        from obow.config import load_config

        return load_config(self.args.config)

    def choose_view(self, images: ImageList) -> ViewsConfig:
        """The evaluation view, chosen once (see :func:`obow.data.eval_sets.choose_view`) and said."""
        if self._views is None:
            from obow.data.eval_sets import choose_view

            recipe = None
            if self.info["kind"] == "random_init":  # a recipe's view, but nothing trained with it
                recipe = f"recipe {self.args.config}" if self.args.config else "the checkpoint's recipe"
                recipe = "the backbone file's recipe" if self.args.backbone else recipe
                recipe += " (its network, untrained)"
            self._views, self.view_reason = choose_view(
                self.info["views"], images, self.args.resize, self.args.size, recipe=recipe
            )
        return self._views

    @property
    def views(self) -> ViewsConfig:
        if self._views is None:
            raise RuntimeError("the evaluation view is chosen from the first images evaluated (choose_view)")
        return self._views

    def _out_path(self) -> Path:
        if self.args.out:
            return Path(self.args.out)
        anchor = self.args.checkpoint or self.args.backbone
        if anchor is None:  # a random initialisation of --config or --arch / --stem: a folder of its own
            name = Path(self.args.config).stem if self.args.config else f"{self.info['arch']}_{self.info['stem']}"
            return Path("runs") / "eval" / f"random_init_{safe_name(name)}" / f"{self.protocol}.json"
        return Path(anchor).parent / "eval" / f"{report_name(self.protocol, self.info, self.args.backbone)}.json"

    def train_dir(self) -> Path:
        path = self.data / "train"
        if not path.is_dir():
            raise ValueError(
                f"{self.data} has no train/ folder; expected {self.data}/train/<class>/ and {self.data}/val/<class>/"
                + self._split_given()
            )
        return path

    def test_dir(self) -> Path:
        for name in ("val", "test"):
            if (self.data / name).is_dir():
                return self.data / name
        raise ValueError(
            f"{self.data} has no val/ or test/ folder; expected {self.data}/train/<class>/ and {self.data}/val/<class>/"
            + self._split_given()
        )

    def _split_given(self) -> str:
        """When ``--data`` is itself one of the splits (``my_images/train``) beside the other: which folder to give."""
        if (folder := splits_folder(self.data)) is not None:
            return f" ({self.data} looks like one of them: give the folder that holds both, --data {folder})"
        return ""

    def splits(self) -> tuple[ImageList, ImageList]:
        from obow.data.eval_sets import align_classes, scan_labelled

        train = scan_labelled(self.train_dir())
        test = align_classes(train, scan_labelled(self.test_dir()))
        assert train.classes is not None  # labelled (scan_labelled)
        self._data_info = {"train": train.root, "test": test.root, "num_train": len(train), "num_test": len(test)}
        self._data_info.update(num_classes=len(train.classes), classes=list(train.classes))
        return train, test

    @staticmethod
    def data_info(images: ImageList) -> dict[str, Any]:
        assert images.classes is not None  # labelled (scan_labelled)
        return {"num_images": len(images), "num_classes": len(images.classes), "classes": list(images.classes)}

    def features(self, images: ImageList, flip: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        from obow.data.eval_sets import eval_dataset
        from obow.evaluate.features import extract_features

        return extract_features(
            self.backbone,
            eval_dataset(images, self.choose_view(images)),
            batch_size=self.args.batch_size or EXTRACT_BATCH,
            device=self.device,
            num_workers=self.args.workers,
            flip=flip,
            skipped=self.skipped,
        )

    def multilabel_features(self, images: MultiLabelSet) -> tuple[np.ndarray, np.ndarray]:
        """Features and targets of a multi-label split (its images' labels are their indices); an unreadable image
        is left out with its targets (:func:`obow.evaluate.features.extract_features`), and counted."""
        features, used = self.features(images.image_list())
        return features.numpy(), images.targets[used.numpy()]

    def print_table(self, headers: list[str], rows: list[list[Any]]) -> None:
        source = self.info
        if source["kind"] == "random_init":
            what = f"random init (seed {source['seed']})"
        else:
            what = f"{source['network'] or 'exported'} of {source['path']}"
            what += f", epoch {source['epoch']}" if source["epoch"] is not None else ""  # unknown without a sidecar
        view = f"{self.views.teacher_resize}/{self.views.teacher_size} px ({self.view_reason})"
        print(f"{self.protocol}: {source['arch']} ({source['stem']} stem), {what}, view {view}, data {self.data}")
        cells = [headers] + [[_cell(v) for v in row] for row in rows]
        widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
        for row in cells:
            print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))

    def write(self, numbers: dict[str, Any], settings: dict[str, Any], data: dict[str, Any] | None = None) -> None:
        from obow.data.eval_sets import views_dict

        source = {k: v for k, v in self.info.items() if k != "views"}
        report = {
            "protocol": self.protocol,
            "results": numbers,
            "settings": {
                **settings,
                "view": views_dict(self.views),
                "view_source": self.view_reason,
                "seed": self.args.seed,
                "device": str(self.device),
                "extract_batch_size": self.args.batch_size or EXTRACT_BATCH,
            },
            "source": source,
            "data": {"root": str(self.data), **self._data_info, **(data or {})},
            "skipped_images": sorted(set(self.skipped)),
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "obow_version": __version__,
        }
        write_json(self.out, report)
        print(f"wrote {self.out}")


def report_name(protocol: str, info: dict[str, Any], backbone_file: str | None = None) -> str:
    """The default report's name in ``<dir>/eval/``, one per source so that none overwrites another:
    ``<protocol>`` for a checkpoint's student, ``<protocol>_teacher`` for its teacher, ``<protocol>_random_init``
    for a random initialisation of its network; for an exported ``backbone_file``,
    ``<protocol>_backbone-<name>`` and ``<protocol>_random_init_backbone-<name>`` for its network at random init,
    where ``<name>`` is the file's stem for a ``.pth`` file (``backbone.pth``: ``backbone``) and its whole name
    otherwise (``backbone.safetensors``), so that two exports of one stem keep a report each. An export usually
    lies in its checkpoint's folder; the ``backbone-`` prefix keeps one named ``teacher.pth`` or
    ``random_init.pth`` off the checkpoint's own reports."""
    if backbone_file is not None:
        path = Path(backbone_file)
        name = path.stem if path.suffix == ".pth" else path.name
        return f"{protocol}{'_random_init' if info['kind'] == 'random_init' else ''}_backbone-{name}"
    if info["kind"] == "random_init":
        return f"{protocol}_random_init"
    return f"{protocol}_teacher" if info["network"] == "teacher" else protocol


def check_not_another(report: Path, info: dict[str, Any]) -> None:
    """Refuse to replace the default ``report`` when it is the report of another file (a checkpoint or export of
    another name in the same folder, such as ``checkpoints/epoch_0010.pt`` and ``epoch_0020.pt``, which share
    ``eval/<protocol>.json``); a report of the same file, or a file that is no report, is replaced. Files are
    told apart by name and kind (the report lies beside them, so their folder is the same)."""
    try:
        source = json.loads(report.read_text())["source"]
        recorded = (source["kind"], source["path"] and Path(source["path"]).name)
    except (OSError, ValueError, TypeError, KeyError):
        return
    if recorded != (info["kind"], info["path"] and Path(info["path"]).name):
        raise ValueError(
            f"{report} is the report of {source['path'] or 'a random initialisation'} ({source['kind']}), not of "
            f"{info['path'] or 'a random initialisation'}: it is not replaced; give --out for this report"
        )


def safe_name(name: str) -> str:
    """``name`` with every run of characters other than letters, digits, ``.``, ``_`` and ``-`` made one ``-``: a
    folder name that every file system and shell takes (``timm:resnet18`` -> ``timm-resnet18``)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}" if abs(value) >= 0.1 or value == 0 else f"{value:g}"
    return str(value)
