"""A folder of images read the way obow's commands read it, as a torchvision-style dataset for a loop of one's own.

``torchvision.datasets.ImageFolder`` stops a loop at the first file Pillow cannot open: the ``._IMG_0001.JPG``
that macOS writes beside every photo copied to a foreign disk, a zero-byte file from an interrupted copy, a
truncated download. ``obow pretrain`` and ``obow eval`` read such a folder anyway, saying what they left out. This
dataset does the same for the library's users, so that a script and the commands agree on what a folder holds:

- the listing is :func:`obow.data.folders.scan_images`: class sub-folders (``labels="folders"``) or every image
  at any depth (``"none"``), hidden files and folders skipped, zero-byte files and files of other kinds left out,
  each kind in one warning line;
- the decoding is :func:`obow.data.decode.load_rgb`: EXIF orientation applied, grayscale, palette, CMYK and
  16-bit images converted, transparency composited onto white;
- a file that cannot be decoded is replaced by the next readable image (its own label with it, so no image
  gets another's label), with one warning per file and process naming it and why.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

from torch.utils.data import Dataset

from obow.data.folders import ImageDataset, scan_images
from obow.notices import ObowWarning


class ImageFolder(Dataset):
    """The images under ``root`` as ``(image, target)`` pairs, listed and decoded as ``obow pretrain`` does.

    ``image`` is ``transform(PIL RGB image)`` (the image itself without a transform); ``target`` is
    ``target_transform(class index)``, with -1 as the index of unlabelled images. The attributes of
    ``torchvision.datasets.ImageFolder`` are kept: ``classes``, ``class_to_idx``, ``samples`` (``(path,
    class index)``), ``targets``, and ``root``. ``unreadable`` holds the files this process could not decode,
    with why. Raises ``ValueError`` (one line: the reason) for a folder without images.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        transform: Callable[[Any], Any] | None = None,
        target_transform: Callable[[int], Any] | None = None,
        labels: str = "auto",
    ) -> None:
        with warnings.catch_warnings(record=True) as said:  # what the listing left out, said at the caller's line
            warnings.simplefilter("always")
            self.images = scan_images(root, labels)
        for warning in said:
            warnings.warn(warning.message, warning.category, stacklevel=2)
        self.root = self.images.root
        self.transform = transform
        self.target_transform = target_transform
        self.classes: list[str] = list(self.images.classes or [])
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}
        self.targets = list(self.images.labels) if self.images.labels is not None else [-1] * len(self.images)
        self.samples = list(zip(self.images.paths, self.targets, strict=True))
        self._read = ImageDataset(self.images)
        self._warned: set[str] = set()

    @property
    def unreadable(self) -> dict[str, str]:
        """The files this process found it cannot decode, each with why."""
        return dict(self._read.unreadable)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        item = self._read[index]
        for path, why in item["reasons"]:
            if path not in self._warned:
                self._warned.add(path)
                used = self.images.paths[item["index"]]
                warnings.warn(
                    f"unreadable image {path} skipped: {why}; the next readable one, {used}, takes its place",
                    ObowWarning,
                    stacklevel=2,
                )
        image, target = item["image"], item["label"]
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target

    def __repr__(self) -> str:
        what = f"{len(self.classes)} classes" if self.classes else "unlabelled"
        return f"ImageFolder({self.root!r}: {len(self)} images, {what})"
