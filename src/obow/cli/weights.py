"""The commands that move weights in and out of obow.

obow export --checkpoint runs/x/checkpoint.pt --out backbone.pth [--format FORMAT]   # FORMATS: cli.common
obow export --checkpoint runs/x/checkpoint.pt --out backbone.safetensors   # the same weights as safetensors
obow export --checkpoint runs/x/checkpoint.pt --out backbone.onnx   # the network as an ONNX graph (obow[onnx])
obow import-official FILE --out CKPT             # the authors' released weights as an obow checkpoint
"""

from __future__ import annotations

import argparse
import sys
import warnings

from obow.cli.common import ARCHITECTURES, FORMATS, NETWORKS, positive_float


def add_export_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``obow export --checkpoint PATH --out FILE --format FORMAT`` (one of :data:`FORMATS`)."""
    p = subparsers.add_parser(
        "export",
        help=f"write a pretrained backbone for {', '.join(FORMATS[:-1])} or {FORMATS[-1]}",
        description="Write the backbone of a pretraining checkpoint, plus FILE.json describing it. The name of "
        "FILE picks the container: FILE.safetensors is written as safetensors (the metadata of FILE.json in its "
        "header too), FILE.onnx as an ONNX graph of the whole network, stem included (input images, outputs pool5 "
        'and conv5; needs pip install "obow[onnx]", and is checked with onnxruntime where it is installed), any '
        "other name with torch.save; --format detectron2 writes a pickle (FILE.pkl).",
    )
    p.add_argument("--checkpoint", required=True, help="a pretraining checkpoint, or the run folder of obow pretrain")
    p.add_argument(
        "--out",
        required=True,
        metavar="FILE",
        help="output file: FILE.safetensors for safetensors (torchvision and timm formats), FILE.onnx for ONNX, "
        "else torch.save",
    )
    p.add_argument(
        "--format",
        choices=FORMATS,
        default=None,
        help="default: onnx for FILE.onnx, timm for timm: backbones, else torchvision",
    )
    p.add_argument("--network", choices=NETWORKS, default="student", help="default student")
    p.set_defaults(func=run_export)
    return p


def add_import_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``obow import-official FILE --out CKPT``."""
    p = subparsers.add_parser(
        "import-official",
        help="turn a checkpoint released by the authors (valeoai/obow) into an obow checkpoint",
        description="Read an official OBoW checkpoint (full model, feature extractor only, or torchvision format) "
        "and write an obow checkpoint for obow eval, export and show.",
    )
    p.add_argument("file", help="the official .pth.tar file")
    p.add_argument("--out", required=True, help="the obow checkpoint to write")
    p.add_argument("--arch", choices=ARCHITECTURES, help="the backbone (default: recognised from the weights)")
    p.add_argument("--delta-base", type=positive_float, help="delta_base (default: the matching recipe's)")
    p.set_defaults(func=run_import)
    return p


def run_export(args: argparse.Namespace) -> int:
    """``obow export``: write the backbone and its ``.json`` sidecar; print what was written."""
    from obow.weights.export import export_backbone
    from obow.weights.locate import checkpoint_path

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        meta = export_backbone(checkpoint_path(args.checkpoint), args.out, network=args.network, fmt=args.format)
    for warning in caught:  # before the line that says what was written: which checkpoint it came from, first
        print(f"warning: {warning.message}", file=sys.stderr)
    print(
        f"wrote {args.out} ({meta['format']}, {meta['container']}: {meta['arch']}, {meta['stem']} stem, "
        f"{meta['network']}{'' if meta['epoch'] is None else ', epoch ' + str(meta['epoch'])}) and {args.out}.json"
    )
    if "checked" in meta:
        print(f"checked: {meta['checked']}")
    return 0


def run_import(args: argparse.Namespace) -> int:
    """``obow import-official``: convert, then say what was written and what it can be used for."""
    from obow.methods.official import import_official

    summary = import_official(args.file, args.out, arch=args.arch, delta_base=args.delta_base)
    if summary["kind"] == "full":
        what = (
            f"student, teacher, {', '.join(summary['levels'])} vocabularies of {summary['num_words']} words, "
            f"kappa {summary['kappa']:g}"
        )
    else:
        what = "the student backbone only"
    epoch = "" if summary["epoch"] is None else f", epoch {summary['epoch']}"
    print(f"wrote {args.out}: {summary['arch']}{epoch}, {what}")
    print(f"next: obow eval knn --checkpoint {args.out} --data <folder with train/ and val/>")
    return 0
