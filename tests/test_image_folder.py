"""``obow.ImageFolder``: a folder read by a loop of one's own as ``obow pretrain`` reads it, where torchvision's
``ImageFolder`` stops at the first file Pillow cannot open (a macOS ``._`` file, a zero-byte or truncated image)."""

import os
import warnings

import numpy as np
import PIL
import pytest
import torch
import torchvision
from PIL import Image
from torch.utils.data import DataLoader
from torchvision.transforms import v2

from obow import ImageFolder, OBoWViews, load_config
from obow.notices import ObowWarning


def photo(seed: int, size=(20, 14)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)


def clean_folder(root, classes=("cat", "dog", "emu"), per_class=3):
    """``root/<class>/<i>.png`` (and one in a nested folder): RGB PNGs that both readers decode alike."""
    for c, name in enumerate(classes):
        for i in range(per_class):
            folder = root / name / ("deeper" if i == 0 else "")
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(photo(10 * c + i)).save(folder / f"{i}.png")
    return root


def messy_folder(root):
    """What a folder copied from a phone or a Mac holds besides its photos."""
    cat, dog = root / "cat", root / "dog"
    for folder in (cat, dog):
        folder.mkdir(parents=True)
    Image.fromarray(photo(0)).save(cat / "a.png")
    Image.fromarray(photo(1)).convert("CMYK").save(cat / "b.jpg")  # a print shop's JPEG
    Image.fromarray((np.arange(14 * 20).reshape(14, 20) * 200).astype(np.uint16)).save(cat / "c.png")  # 16-bit
    good = (cat / "a.png").read_bytes()
    (cat / "d.png").write_bytes(good[: len(good) // 2])  # a truncated copy
    (cat / "._a.png").write_bytes(b"\x00\x05\x16\x07" + os.urandom(100))  # macOS AppleDouble: not an image
    (cat / "notes.txt").write_text("not an image")
    (cat / "empty.jpg").write_bytes(b"")  # an interrupted copy
    Image.fromarray(photo(2)).save(cat / "e.png")
    Image.fromarray(photo(3)).save(dog / "f.png")
    return root


def test_the_listing_is_torchvisions_on_a_folder_both_read(tmp_path):
    """Same classes, indices, files and targets as ``torchvision.datasets.ImageFolder``, and the same pixels."""
    root = clean_folder(tmp_path)
    ours = ImageFolder(root, transform=v2.Compose([v2.ToImage(), v2.ToDtype(torch.uint8)]))
    theirs = torchvision.datasets.ImageFolder(root, transform=v2.Compose([v2.ToImage(), v2.ToDtype(torch.uint8)]))
    assert ours.classes == theirs.classes == ["cat", "dog", "emu"]
    assert ours.class_to_idx == theirs.class_to_idx
    assert ours.samples == theirs.samples and ours.targets == theirs.targets and len(ours) == len(theirs) == 9
    for i in range(len(ours)):
        (a, y), (b, z) = ours[i], theirs[i]
        assert y == z and torch.equal(a, b)


def test_a_messy_folder_is_read_where_torchvision_stops(tmp_path):
    root = messy_folder(tmp_path)
    theirs = torchvision.datasets.ImageFolder(root)
    with pytest.raises(PIL.UnidentifiedImageError, match="._a.png"):  # what users hit before: the AppleDouble file
        [theirs[i] for i in range(len(theirs))]

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        dataset = ImageFolder(root)
    lines = [str(w.message) for w in said if issubclass(w.category, ObowWarning)]
    assert any("zero-byte image file" in line and "empty.jpg" in line for line in lines), lines
    assert any("1 file left out" in line and ".txt 1" in line for line in lines), lines
    assert all(w.filename == __file__ for w in said), [w.filename for w in said]  # said at the caller's line
    names = [os.path.basename(p) for p, _ in dataset.samples]
    assert names == ["a.png", "b.jpg", "c.png", "d.png", "e.png", "f.png"]  # no ._a.png, notes.txt, empty.jpg

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        items = [dataset[i] for i in range(len(dataset))]
        again = dataset[3]
    lines = [str(w.message) for w in said if issubclass(w.category, ObowWarning)]
    assert len(lines) == 1, lines  # once per file and process, however often it is asked for
    assert "cat/d.png skipped: damaged" in lines[0] and "cat/e.png, takes its place" in lines[0]
    assert set(dataset.unreadable) == {str(root / "cat" / "d.png")}
    for image, _ in items:
        assert image.mode == "RGB" and image.size == (20, 14)
    assert [y for _, y in items] == [0, 0, 0, 0, 0, 1]
    # the truncated file's place: the next readable image, with its own label
    assert np.array_equal(np.asarray(items[3][0]), np.asarray(items[4][0])) and np.array_equal(
        np.asarray(again[0]), np.asarray(items[4][0])
    )
    # the conversions, against independent references: Pillow's CMYK -> RGB, 16-bit scaled to 8 bits
    with Image.open(root / "cat" / "b.jpg") as cmyk:
        assert np.array_equal(np.asarray(items[1][0]), np.asarray(cmyk.convert("RGB")))
    levels = np.arange(14 * 20).reshape(14, 20) * 200 * 255 / 65535
    grey = np.asarray(items[2][0]).astype(float)
    assert np.abs(grey - levels[..., None]).max() <= 1 and (grey[..., 0] == grey[..., 2]).all()


def test_unlabelled_images_have_target_minus_one_and_no_classes(tmp_path):
    clean_folder(tmp_path / "a" / "b")
    Image.fromarray(photo(7)).save(tmp_path / "top.png")
    dataset = ImageFolder(tmp_path)  # an image at the top: read as unlabelled, every image at any depth
    assert dataset.classes == [] and dataset.class_to_idx == {}
    assert len(dataset) == 10 and set(dataset.targets) == {-1}
    assert dataset[0][1] == -1
    assert ImageFolder(tmp_path / "a", labels="none").targets == [-1] * 9
    assert ImageFolder(tmp_path / "a" / "b", target_transform=lambda y: f"class {y}")[8][1] == "class 2"
    assert repr(ImageFolder(tmp_path / "a" / "b")).endswith(": 9 images, 3 classes)")


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda p: None, "does not exist"),
        (lambda p: p.mkdir(), "no images found under"),
        (lambda p: (p.mkdir(), (p / "x.txt").write_text("x")), "1 file left out: not images of a listed kind"),
        (lambda p: p.write_text("x"), "is not a folder"),
    ],
    ids=["missing", "empty", "no_images", "a_file"],
)
def test_a_folder_without_images_is_one_line(tmp_path, make, says):
    folder = tmp_path / "images"
    make(folder)
    with pytest.raises(ValueError, match=says) as raised:
        ImageFolder(folder)
    assert "\n" not in str(raised.value)


def test_the_views_come_through_loader_workers(tmp_path, tiny_recipe):
    """With ``OBoWViews`` and two worker processes, a messy folder gives whole batches of the recipe's views."""
    cfg = load_config(str(tiny_recipe))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ObowWarning)
        dataset = ImageFolder(messy_folder(tmp_path), transform=OBoWViews(cfg.views))
    loader = DataLoader(dataset, batch_size=3, num_workers=2, shuffle=True, generator=torch.Generator().manual_seed(0))
    batches = list(loader)
    assert len(batches) == 2
    for views, targets in batches:
        t, s = cfg.views.teacher_size, cfg.views.crop_size
        assert views["teacher"].shape == (3, 3, t, t) and views["crops"].shape == (3, cfg.views.num_crops, 3, s, s)
        assert torch.isfinite(views["teacher"]).all() and set(targets.tolist()) <= {0, 1}
    assert sorted(torch.cat([t for _, t in batches]).tolist()) == [0, 0, 0, 0, 0, 1]
