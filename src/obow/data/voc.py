"""Multi-label image sets in the PASCAL VOC devkit layout (VOC07 classification, the paper's Table 6).

The layout, which any multi-label dataset can be written in::

    ROOT/JPEGImages/<id>.jpg                       # the images (any extension obow reads)
    ROOT/ImageSets/Main/<class>_<split>.txt        # one line per image of the split: "<id> <flag>"

with ``flag`` 1 (the class is present), -1 (absent) or 0 (present but *difficult*: ignored when scoring).
The classes are the ``<class>`` names found for the split; every class file of a split lists the same
images. ``VOCdevkit/VOC2007`` is such a ROOT, with the splits ``trainval`` and ``test``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from obow.data.folders import IMAGE_EXTENSIONS, ImageList

#: Target values, VOC's own flags: present, absent, difficult.
PRESENT, ABSENT, DIFFICULT = 1, -1, 0
_FLAGS = {"1": PRESENT, "-1": ABSENT, "0": DIFFICULT}


@dataclass
class MultiLabelSet:
    """The images of one split and their targets ``[N, C]`` (:data:`PRESENT`, :data:`ABSENT`,
    :data:`DIFFICULT`) over ``classes``."""

    root: str
    split: str
    image_ids: list[str]
    paths: list[str]
    classes: list[str]
    targets: np.ndarray

    def __len__(self) -> int:
        return len(self.paths)

    def image_list(self) -> ImageList:
        """The images as an :class:`~obow.data.folders.ImageList` whose label is each image's position, so that
        an image replaced by its neighbour (unreadable file) can be recognised after feature extraction."""
        return ImageList(root=self.root, paths=list(self.paths), labels=list(range(len(self))), classes=None)


def read_voc(root: str | Path, split: str) -> MultiLabelSet:
    """The ``split`` of the devkit-layout folder ``root`` (see the module docstring)."""
    root = Path(root)
    main = root / "ImageSets" / "Main"
    if not main.is_dir():
        raise ValueError(f"{root} is not a VOC devkit folder: it has no ImageSets/Main/ (expected <class>_<split>.txt)")
    files = sorted(main.glob(f"*_{split}.txt"))
    if not files:
        raise ValueError(f"{main} has no <class>_{split}.txt files: is {split!r} a split of this dataset?")
    classes = [f.name[: -len(f"_{split}.txt")] for f in files]
    flags: dict[str, dict[str, int]] = {}
    for name, file in zip(classes, files, strict=True):
        flags[name] = _read_flags(file)
    image_ids = list(flags[classes[0]])
    for name in classes[1:]:
        if set(flags[name]) != set(image_ids):
            missing = sorted(set(image_ids) ^ set(flags[name]))[:3]
            raise ValueError(
                f"{main}/{name}_{split}.txt and {classes[0]}_{split}.txt list different images (e.g. {missing}); "
                "every class file of a split must list the same images"
            )
    targets = np.array([[flags[c][i] for c in classes] for i in image_ids], dtype=np.int8).reshape(-1, len(classes))
    paths = [_image_path(root, i) for i in image_ids]
    return MultiLabelSet(str(root), split, image_ids, paths, classes, targets)


def _read_flags(file: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for number, line in enumerate(file.read_text().splitlines(), start=1):
        parts = line.split()
        if not parts:
            continue
        if len(parts) != 2 or parts[1] not in _FLAGS:
            raise ValueError(f"{file}:{number}: expected '<image id> <1, -1 or 0>', got {line!r}")
        out[parts[0]] = _FLAGS[parts[1]]
    if not out:
        raise ValueError(f"{file} lists no images")
    return out


def _image_path(root: Path, image_id: str) -> str:
    for ext in IMAGE_EXTENSIONS:
        for candidate in (root / "JPEGImages" / f"{image_id}{ext}", root / "JPEGImages" / f"{image_id}{ext.upper()}"):
            if candidate.is_file():
                return str(candidate)
    raise ValueError(f"image {image_id!r} of {root}/ImageSets/Main is not in {root}/JPEGImages/")
