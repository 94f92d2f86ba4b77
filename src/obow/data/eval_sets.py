"""Evaluation sets: labelled image folders seen through the teacher's deterministic view.

Images are seen as the teacher saw them during pretraining: ``Resize(teacher_resize)``,
``CenterCrop(teacher_size)``, the recipe's mean and std (official notes 5.1-5.2 use 256 / 224 on ImageNet).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from PIL import Image

from obow.config import ViewsConfig, from_dict
from obow.data.folders import ImageDataset, ImageList, scan_images
from obow.data.transforms import eval_pixels_transform, eval_transform

#: The recipe settings that decide what evaluation images look like.
VIEW_KEYS = ("teacher_resize", "teacher_size", "mean", "std")


def views_dict(views: Any) -> dict[str, Any]:
    """The evaluation-relevant recipe settings of a :class:`~obow.config.ViewsConfig` as plain data."""
    return {key: list(v) if isinstance(v := getattr(views, key), tuple) else v for key in VIEW_KEYS}


def views_from_dict(values: dict[str, Any] | None, resize: int | None = None, size: int | None = None) -> ViewsConfig:
    """A :class:`~obow.config.ViewsConfig` holding a recorded evaluation view (``None``: the ImageNet 256 / 224
    defaults), with ``size`` and ``resize`` overriding it. A ``size`` without ``resize`` resizes to
    ``size * 256 / 224``, the paper's ratio. Only :data:`VIEW_KEYS` matter for evaluation."""
    values = {k: v for k, v in (values or {}).items() if k in VIEW_KEYS}
    if size is not None:
        values["teacher_size"] = size
        values["teacher_resize"] = round(size * 256 / 224)
    if resize is not None:
        values["teacher_resize"] = resize
    # the student's crops play no part in an evaluation: kept within the teacher's view, as a recipe's must be
    values["crop_size"] = min(ViewsConfig.crop_size, values.get("teacher_size", ViewsConfig.teacher_size))
    return from_dict(ViewsConfig, values)


def eval_dataset(
    root: str | Path | ImageList, views: Any, labels: str = "folders", *, pixels: bool = False
) -> ImageDataset:
    """The images under ``root`` (or an already scanned :class:`~obow.data.folders.ImageList`) through the teacher's
    deterministic view: resize, centre crop, normalise (``pixels=True``: not normalised, ``uint8`` tensors, for
    :func:`obow.evaluate.features.decode_set`).

    ``views`` is a :class:`~obow.config.ViewsConfig` or anything with its ``teacher_resize``,
    ``teacher_size``, ``mean`` and ``std``. With ``labels="folders"`` the immediate sub-folders are the
    classes; a folder without them raises ``ValueError`` saying so.
    """
    if isinstance(root, ImageList):
        images = root
    else:
        images = scan_labelled(root) if labels == "folders" else scan_images(root, labels=labels)
    # every image decoded whole (no reduced JPEG decoding, unlike training's): the features are those an export's
    # usage lines compute with torchvision, to float rounding
    if pixels:
        return ImageDataset(images, eval_pixels_transform(views.teacher_resize, views.teacher_size))
    return ImageDataset(images, eval_transform(views.teacher_resize, views.teacher_size, views.mean, views.std))


def scan_labelled(root: str | Path) -> ImageList:
    """The class-folder images under ``root``; a clear ``ValueError`` when there are no class folders."""
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"image folder {str(root)!r} does not exist")
    try:
        images = scan_images(root, labels="folders")
    except ValueError as err:
        raise ValueError(
            f"{root} holds no labelled images: this protocol needs class folders ({root}/<class>/<image>): {err}"
        ) from None
    return images


def align_classes(train: ImageList, test: ImageList) -> ImageList:
    """``test`` with its labels re-indexed to ``train``'s classes, matched by folder name.

    A test split may hold a subset of the training classes (their indices would otherwise shift); a test
    class absent from training raises ``ValueError`` naming it.
    """
    unknown = sorted(set(test.classes or ()) - set(train.classes or ()))
    if unknown:
        raise ValueError(
            f"{test.root} has classes that {train.root} lacks: {', '.join(unknown[:10])}"
            f"{' ...' if len(unknown) > 10 else ''}; every test class folder must also exist in the training split"
        )
    assert train.classes is not None and test.classes is not None and test.labels is not None  # labelled splits
    index = {name: i for i, name in enumerate(train.classes or ())}
    labels = [index[test.classes[label]] for label in test.labels]
    return ImageList(root=test.root, paths=test.paths, labels=labels, classes=list(train.classes))


#: Images whose median shorter side is at least this get the paper's ImageNet view (256 / 224).
LARGE_IMAGE_SIDE = 256
#: How many images (evenly spaced over the list) :func:`typical_side` reads the size of.
SIDE_SAMPLE = 64


def typical_side(images: ImageList, sample: int = SIDE_SAMPLE) -> int | None:
    """The median shorter side of ``sample`` images spread over ``images`` (read from the file headers only);
    ``None`` when none of them can be read."""
    step = max(1, len(images) // sample)
    sides = []
    for path in images.paths[::step][:sample]:
        try:
            with Image.open(path) as img:
                sides.append(min(img.size))
        except Exception:  # noqa: BLE001 - an unreadable file says nothing about the others
            continue
    return int(statistics.median(sides)) if sides else None


def choose_view(
    recorded: dict[str, Any] | None,
    images: ImageList,
    resize: int | None = None,
    size: int | None = None,
    recipe: str | None = None,
) -> tuple[ViewsConfig, str]:
    """The evaluation view and why it was chosen: ``size`` / ``resize`` when given; else the view recorded with
    the weights (their recipe's teacher view; ``recipe`` says whose it is when the weights were not trained with
    it, a random initialisation); else one that follows the images: the paper's 256 / 224 for images whose
    median side is at least :data:`LARGE_IMAGE_SIDE`, the images as they are (resized to their median side, no
    crop) below that, e.g. 32 px for CIFAR-10 rather than an upsampled 224 px crop."""
    if size is not None or resize is not None:
        view = views_from_dict(recorded, resize=resize, size=size)
        return view, "set by --size / --resize"
    if recorded is not None:
        return views_from_dict(recorded), recipe or "the recipe the weights were trained with"
    side = typical_side(images)
    if side is None or side >= LARGE_IMAGE_SIDE:
        why = "no recipe; " + (f"the images are large (median side {side} px)" if side else "image sizes unknown")
        return views_from_dict(None), f"{why}: the paper's ImageNet view"
    view = views_from_dict({"teacher_resize": side, "teacher_size": side})
    return view, f"no recipe: the images' median side ({side} px), uncropped"
