"""What the command groups share: the parsers' choices (spelled out so that building a parser imports no
PyTorch, and ``obow --help`` is instant; tests/test_rough_edges.py checks each against the library's own
list), argument types, the device option and JSON reports."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

ARCHITECTURES = (
    "resnet18",
    "resnet34",
    "resnet50",
    "resnet101",
    "resnet152",
    "resnext50_32x4d",
    "wide_resnet50_2",
)  # obow.backbones.ARCHITECTURES
STEMS = ("torchvision", "no_maxpool", "cifar")  # obow.backbones.STEMS
NETWORKS = ("student", "teacher")  # obow.weights.load.NETWORKS
FORMATS = ("torchvision", "timm", "detectron2", "onnx")  # obow.weights.export.FORMATS


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def write_json(path: Path, obj: Any) -> None:
    from obow.files import writing

    with writing(path):
        path.write_text(json.dumps(obj, indent=2) + "\n")


def device_from_name(name: str) -> torch.device:
    """``--device``: ``auto`` (a GPU when one is visible), ``cpu``, ``cuda`` or ``cuda:N``."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine; use --device cpu")
    return device


#: The folders an evaluation's ``--data`` holds (training images, and the images evaluated).
SPLITS = ("train", "val", "test")


def splits_folder(folder: str | Path) -> Path | None:
    """The folder that holds ``folder`` as one of its :data:`SPLITS` beside another (``my_images`` for
    ``my_images/train`` beside ``my_images/val``): what ``obow eval`` takes as ``--data``; else ``None``."""
    given = Path(folder)
    resolved = given.resolve()
    if resolved.name in SPLITS and sum((resolved.parent / split).is_dir() for split in SPLITS) >= 2:
        return given.parent if given.name == resolved.name else resolved.parent
    return None
