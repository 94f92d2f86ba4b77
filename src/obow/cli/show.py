"""The ``obow show`` commands: pictures of what a run learned.

    obow show words --checkpoint runs/x/checkpoint.pt --data DIR --out runs/x/words [--level conv5]
        [--network teacher|student] [--words most-used|random|3,17,42] [--num-words 16]
    obow show run runs/x [runs/y ...] [--out runs/x/curves.png]
    obow show neighbours --checkpoint runs/x/checkpoint.pt --data DIR --out runs/x/neighbours.png [--queries 8]
    obow show views --data DIR --config RECIPE --out DIR [--pipeline workers|device] [--images 8] [key=value ...]

Building this parser imports nothing heavy; each command imports its module when it runs.
"""

from __future__ import annotations

import argparse
import os

from obow.cli.common import NETWORKS, device_from_name, positive_int

#: ``--pipeline`` choices: :data:`obow.config.choices.PIPELINES` but ``auto`` (the default, the recipe's own).
VIEW_PIPELINES = ("workers", "device")


def add_show_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``obow show words|run|neighbours|views``."""
    parser = subparsers.add_parser(
        "show",
        help="pictures of what a run learned (visual words, training curves, nearest neighbours) and of its views",
        description="Pictures of what a run learned, and of the views a recipe makes of your images.",
    )
    kinds = parser.add_subparsers(title="pictures", dest="picture", metavar="PICTURE", required=True)

    p = kinds.add_parser("words", help="the top image patches of visual words (PNG grid and HTML page)")
    p.add_argument("--checkpoint", required=True, help="a pretraining checkpoint, or the run folder of obow pretrain")
    p.add_argument("--data", required=True, help="a folder of images (any tree; class folders not needed)")
    p.add_argument("--out", required=True, help="output folder: words.png, index.html, patches/")
    p.add_argument("--network", choices=NETWORKS, default="teacher", help="whose feature maps (default teacher)")
    p.add_argument("--level", help="BoW level (default conv5, or the recipe's last level)")
    p.add_argument("--words", default="most-used", help="most-used (default), random, or indices such as 3,17,42")
    p.add_argument("--num-words", type=positive_int, default=16, help="words shown for most-used / random (16)")
    p.add_argument("--tile", type=positive_int, default=64, help="patch size in the grid, pixels (64)")
    _run_options(p, batch_size=32)
    p.set_defaults(func=run_words)

    p = kinds.add_parser("run", help="training curves of one or more runs (one PNG)")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="folders of obow pretrain runs (with log.jsonl)")
    p.add_argument("--out", help="output picture, .png, .pdf, .svg, ... (default: curves.png in the first RUN_DIR)")
    p.set_defaults(func=run_run)

    p = kinds.add_parser("neighbours", help="nearest training images of a few queries, learned vs random init")
    p.add_argument("--checkpoint", required=True, help="a pretraining checkpoint, or the run folder of obow pretrain")
    p.add_argument("--data", required=True, help="folder holding train/ and val/ (or test/) class folders")
    p.add_argument("--out", required=True, help="output picture (.png, .jpg, .webp, ...) or an existing folder")
    p.add_argument("--network", choices=NETWORKS, default="student", help="default student")
    p.add_argument("--queries", type=positive_int, default=8, help="query images from val/ or test/ (8)")
    p.add_argument("--k", type=positive_int, default=5, help="neighbours per query and network (5)")
    p.add_argument("--tile", type=positive_int, default=64, help="image size in the grid, pixels (64)")
    _run_options(p, batch_size=256)
    p.set_defaults(func=run_neighbours)

    p = kinds.add_parser(
        "views", help="the teacher view, crops and patches a recipe makes of a folder's images (PNGs and overview)"
    )
    p.add_argument("--data", required=True, help="a folder of images (any tree)")
    p.add_argument("--config", required=True, help="a built-in recipe name (see `obow recipes`) or a YAML file")
    p.add_argument("--out", required=True, help="output folder (not inside --data): overview.png and a PNG per view")
    p.add_argument(
        "--pipeline", choices=VIEW_PIPELINES, help="who makes the views (default: the recipe's data.pipeline)"
    )
    p.add_argument("--images", type=positive_int, default=8, help="the first N images of the folder (8)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="changes to the recipe, e.g. train.seed=1")
    p.set_defaults(func=run_views)
    return parser


def _run_options(p: argparse.ArgumentParser, batch_size: int) -> None:
    p.add_argument("--seed", type=int, default=0, help="random words, queries and random init (0)")
    p.add_argument("--batch-size", type=positive_int, default=batch_size, help=f"images per batch ({batch_size})")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    p.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1), help="data loaders (min(4, CPUs))")


#: Names of pictures, which a command that writes a folder (``show words``, ``show views``) refuses as ``--out``.
PICTURE_SUFFIXES = (".png", ".jpg", ".jpeg", ".pdf", ".svg", ".webp", ".gif", ".tif", ".tiff", ".bmp", ".html")


def check_out_folder(out: str, command: str, writes: str) -> None:
    """``--out`` of a command that writes a folder: one line when it names a picture (``views.jpg``), which
    would otherwise become a folder of that name."""
    suffix = os.path.splitext(os.path.normpath(out))[1]
    if suffix.lower() in PICTURE_SUFFIXES:
        folder = os.path.splitext(os.path.normpath(out))[0]
        raise ValueError(f"--out {out} names a picture, but obow show {command} writes a folder ({writes}): "
                         f"give a folder, e.g. --out {folder}")  # fmt: skip


def pil_suffixes() -> set[str]:
    """The file name endings Pillow writes a picture for (``.png``, ``.jpg``, ``.webp``, ...)."""
    from PIL import Image

    Image.init()
    return {suffix for suffix, kind in Image.registered_extensions().items() if kind in Image.SAVE}


def matplotlib_suffixes() -> set[str]:
    """The file name endings matplotlib saves a figure as (``.png``, ``.pdf``, ``.svg``, ...)."""
    from matplotlib.backend_bases import FigureCanvasBase

    return {f".{suffix}" for suffix in FigureCanvasBase.get_supported_filetypes()}


def picture_out(out: str, command: str, name: str, suffixes: set[str]) -> str:
    """``--out`` of a command that writes one picture, checked before the work: an existing folder gets the picture
    ``name`` inside it; a name without a picture's ending, or with one the writer does not know, is one line (the
    writers would otherwise fail after the work, or add ``.png`` to a name obow then reports without it)."""
    if os.path.isdir(out):
        return os.path.join(out, name)
    stem, suffix = os.path.splitext(os.path.normpath(out))
    if suffix.lower() not in suffixes:
        known = ", ".join(sorted(s for s in suffixes if s in PICTURE_SUFFIXES))
        said = f"cannot write a {suffix} picture (it writes {known})" if suffix else "writes one picture"
        raise ValueError(f"--out {out}: obow show {command} {said}; give e.g. --out {stem}.png, or an existing folder")
    return out


def run_words(args: argparse.Namespace) -> int:
    from obow.files import check_writable
    from obow.show.words import show_words
    from obow.weights.locate import checkpoint_path

    check_out_folder(args.out, "words", "words.png, index.html and patches/")
    check_writable(os.path.join(args.out, "words.png"))  # before the work

    result = show_words(
        checkpoint_path(args.checkpoint),
        args.data,
        args.out,
        network=args.network,
        level=args.level,
        words=args.words,
        num_words=args.num_words,
        seed=args.seed,
        tile=args.tile,
        batch_size=args.batch_size,
        device=device_from_name(args.device),
        num_workers=args.workers,
    )
    print(
        f"{result['level']}: {len(result['words'])} words over {result['num_images']} images "
        f"({result['num_locations']} locations)"
    )
    for word, usage in zip(result["words"], result["usage"], strict=True):
        print(f"  word {word:5d}  usage {100 * usage:6.2f}%")
    print(f"wrote {result['grid']} and {result['html']}")
    return 0


def run_run(args: argparse.Namespace) -> int:
    from obow.show.run_plots import plot_runs

    if args.out is None:
        out = os.path.join(args.runs[0], "curves.png")
    else:
        out = picture_out(args.out, "run", "curves.png", matplotlib_suffixes())
    print(f"wrote {plot_runs(args.runs, out)}")
    return 0


def run_neighbours(args: argparse.Namespace) -> int:
    from obow.files import check_writable
    from obow.show.neighbours import show_neighbours
    from obow.weights.locate import checkpoint_path

    args.out = picture_out(args.out, "neighbours", "neighbours.png", pil_suffixes())
    check_writable(args.out)  # before the work

    result = show_neighbours(
        checkpoint_path(args.checkpoint),
        args.data,
        args.out,
        network=args.network,
        queries=args.queries,
        k=args.k,
        seed=args.seed,
        tile=args.tile,
        batch_size=args.batch_size,
        device=device_from_name(args.device),
        num_workers=args.workers,
    )
    shares = ", ".join(f"{name} {100 * share:.1f}%" for name, share in result["same_class"].items())
    print(f"neighbours of the query's class: {shares}")
    print(f"wrote {result['path']}")
    return 0


def run_views(args: argparse.Namespace) -> int:
    from obow.config import load_config
    from obow.files import check_writable
    from obow.notices import notices_held
    from obow.show.views import show_views

    overrides = [*args.overrides, f"data.path={args.data}"]
    if args.pipeline is not None:
        overrides.append(f"data.pipeline={args.pipeline}")
    with notices_held():  # the recipe's warnings wait until the images are found
        cfg = load_config(args.config, overrides)
        check_out_folder(args.out, "views", "overview.png and a PNG per view")
        check_writable(os.path.join(args.out, "overview.png"))  # before the work
        result = show_views(cfg, args.out, images=args.images)
    for i, path in enumerate(result["paths"]):
        print(f"image{i:03d}: {path}")
    print(
        f"{result['pipeline']} pipeline on the {result['device']}: wrote {len(result['files'])} views of "
        f"{len(result['paths'])} images to {args.out} and {result['overview']}"
    )
    return 0
