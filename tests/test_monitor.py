"""The kNN monitor keeps its evaluation images decoded: the same features and numbers as reading them every pass."""

import logging
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from obow.backbones import build_backbone
from obow.config import load_config
from obow.data.eval_sets import eval_dataset
from obow.data.folders import scan_images
from obow.data.transforms import eval_pixels_transform, eval_transform, normalize_pixels
from obow.evaluate import monitor as monitor_module
from obow.evaluate.features import DecodedSet, decode_set, decoded_features, extract_features
from obow.evaluate.monitor import KNNMonitor
from obow.notices import ObowWarning

MEAN, STD = (0.49, 0.48, 0.45), (0.25, 0.24, 0.26)
SIZES = [(40, 30), (24, 24), (33, 50), (64, 20), (28, 28), (31, 45), (90, 60)]


def write_mixed_folder(root, per_class=4, classes=2, seed=0):
    """Class folders of noisy images of :data:`SIZES` (non-square, smaller and larger than the view)."""
    rng = np.random.default_rng(seed)
    for c in range(classes):
        (root / f"c{c}").mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            w, h = SIZES[(c * per_class + i) % len(SIZES)]
            base = np.zeros((h, w, 3), dtype=np.uint8)
            base[..., c % 3] = 150
            Image.fromarray(base + rng.integers(0, 100, (h, w, 3), dtype=np.uint8)).save(root / f"c{c}" / f"{i}.png")
    return root


def small_backbone():
    torch.manual_seed(0)
    net = build_backbone("timm:resnet18", "cifar", {"channels": [8, 8, 16, 16], "stem_width": 8})
    with torch.no_grad():  # running statistics away from 0 / 1, so that eval mode is not the identity
        for m in net.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 1.5)
    return net.train()


def test_normalised_kept_pixels_equal_the_evaluation_transform_bit_for_bit(tmp_path):
    folder = write_mixed_folder(tmp_path)
    for path in sorted(folder.rglob("*.png")):
        with Image.open(path) as img:
            expected = eval_transform(28, 24, MEAN, STD)(img.convert("RGB"))
            pixels = eval_pixels_transform(28, 24)(img.convert("RGB"))
        assert pixels.dtype == torch.uint8 and pixels.shape == (3, 24, 24)
        assert torch.equal(normalize_pixels(pixels[None], MEAN, STD)[0], expected)


def test_decoded_features_equal_extracted_features_and_restore_training_mode(tmp_path, noise_images):
    folder = write_mixed_folder(tmp_path / "data", per_class=5)
    (folder / "c1" / "9.png").write_bytes(b"not an image")  # left out by both paths
    views = SimpleNamespace(teacher_resize=28, teacher_size=24, mean=MEAN, std=STD)
    images = scan_images(folder, "folders")
    backbone = small_backbone()
    skipped_a, skipped_b = [], []
    with pytest.warns(ObowWarning, match="1 unreadable image under .* left out"):
        expected, labels = extract_features(backbone, eval_dataset(images, views), batch_size=4, skipped=skipped_a)
    with pytest.warns(ObowWarning, match="1 unreadable image under .* left out"):
        decoded = decode_set(eval_dataset(images, views, pixels=True), views.mean, views.std, skipped=skipped_b)
    assert skipped_a == skipped_b == [str(folder / "c1" / "9.png")]
    readable = [label for path, label in zip(images.paths, images.labels, strict=True) if not path.endswith("9.png")]
    assert decoded.pixels.dtype == torch.uint8 and decoded.nbytes == (len(images) - 1) * 3 * 24 * 24
    assert decoded.labels.tolist() == labels.tolist() == readable  # each readable image once, none repeated
    features = decoded_features(backbone, decoded, batch_size=4)
    assert backbone.training
    assert features.shape == expected.shape == (len(images) - 1, 16)
    assert torch.equal(features, expected)
    with pytest.raises(ValueError, match=r"uint8 views: build the dataset with eval_dataset\(..., pixels=True\)"):
        decode_set(eval_dataset(images, views), views.mean, views.std)


def test_a_large_evaluation_set_is_decoded_by_one_worker_per_core_and_decodes_the_same(
    tmp_path, noise_images, monkeypatch
):
    from obow.data import folders as folders_module
    from obow.evaluate import features as features_module

    assert folders_module.decoding_workers(4095, 1) == 1  # a small set: the workers asked for
    assert folders_module.decoding_workers(10**6, 0) == folders_module.max_decoding_workers()
    assert folders_module.decoding_workers(10**6, 40) == 40  # never fewer than asked
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert folders_module.max_decoding_workers() == min(16, cores)
    monkeypatch.setattr(folders_module.sys, "platform", "darwin")  # no forked workers there
    assert folders_module.max_decoding_workers() == 0 and folders_module.decoding_workers(10**6, 2) == 2
    monkeypatch.undo()

    folder = write_mixed_folder(tmp_path / "data", per_class=5)
    (folder / "c0" / "2.png").write_bytes(b"not an image")
    views = SimpleNamespace(teacher_resize=28, teacher_size=24, mean=MEAN, std=STD)
    images = scan_images(folder, "folders")
    backbone = small_backbone()

    def run():
        skipped = []
        with pytest.warns(ObowWarning, match="1 unreadable image under .* left out"):
            decoded = decode_set(eval_dataset(images, views, pixels=True), MEAN, STD, batch_size=3, skipped=skipped)
        with pytest.warns(ObowWarning, match="1 unreadable image under .* left out"):
            features, labels = extract_features(backbone, eval_dataset(images, views), batch_size=3)
        return decoded, features, labels, skipped

    one = run()  # 10 images: below the line, in this process
    started = []
    real_build = features_module.build_loader
    monkeypatch.setattr(folders_module, "DECODING_WORKERS_MIN_IMAGES", 2)
    monkeypatch.setattr(folders_module, "max_decoding_workers", lambda: 2)
    monkeypatch.setattr(features_module, "build_loader", lambda *a, **k: started.append(a[3]) or real_build(*a, **k))
    many = run()
    assert started == [2, 2]  # both passes by two worker processes
    assert torch.equal(one[0].pixels, many[0].pixels) and torch.equal(one[0].labels, many[0].labels)
    assert torch.equal(one[1], many[1]) and torch.equal(one[2], many[2])
    assert one[3] == many[3] == [str(folder / "c0" / "2.png")]


def monitor_for(tmp_path, tiny_recipe):
    train = write_mixed_folder(tmp_path / "train", per_class=6)
    val = write_mixed_folder(tmp_path / "val", per_class=3, seed=1)
    cfg = load_config(tiny_recipe, [f"data.val_path={val}", "train.knn_k=3"])
    return KNNMonitor(cfg, scan_images(train, "folders"), torch.device("cpu")), train, val


def test_the_monitor_decodes_once_and_measures_as_a_reading_monitor_does(tmp_path, tiny_recipe, monkeypatch, caplog):
    backbone = small_backbone()
    monkeypatch.setattr(monitor_module, "KEEP_FRACTION", 0.0)
    with caplog.at_level(logging.INFO, logger="obow"):
        reading, _, _ = monitor_for(tmp_path / "a", tiny_recipe)
    assert not reading.keeps_pixels
    assert "its 18 images would take 0 MiB decoded, more than 0% of the memory available" in caplog.text
    expected = reading(backbone)
    assert reading.decoded is None
    monkeypatch.undo()

    keeping, train, val = monitor_for(tmp_path / "b", tiny_recipe)
    assert keeping.keeps_pixels
    with caplog.at_level(logging.INFO, logger="obow"):
        first = keeping(backbone)
    assert "kNN monitor: 18 images decoded once and kept" in caplog.text
    assert first == expected and set(first) == {"knn_top1", "knn_effective_rank", "knn_mean_cosine"}
    for path in [*train.rglob("*.png"), *val.rglob("*.png")]:
        path.unlink()  # a later pass reads no file
    assert keeping(backbone) == expected
    with torch.no_grad():  # and it measures the backbone as it is now
        next(backbone.parameters()).mul_(-1)
    assert keeping(backbone) != expected


def test_kept_images_are_pinned_for_a_gpu_up_to_a_limit(tmp_path, tiny_recipe, monkeypatch):
    pinned = []

    def decode_set(dataset, mean, std, *, pin_memory, **kwargs):  # what the monitor asks for, not a real decode
        pinned.append(pin_memory)
        return DecodedSet(torch.zeros(1, 3, 24, 24, dtype=torch.uint8), torch.zeros(1, dtype=torch.long), mean, std)

    monkeypatch.setattr(monitor_module, "decode_set", decode_set)
    train = write_mixed_folder(tmp_path / "train", per_class=2)
    val = write_mixed_folder(tmp_path / "val", per_class=1, seed=1)
    cfg = load_config(tiny_recipe, [f"data.val_path={val}"])
    for device, limit, expected in (("cpu", 2**30, False), ("cuda", 2**30, True), ("cuda", 100, False)):
        monkeypatch.setattr(monitor_module, "PIN_LIMIT", limit)
        monitor = KNNMonitor(cfg, scan_images(train, "folders"), torch.device(device))
        assert monitor.needed == 6 * 3 * 24 * 24 and monitor.keeps_pixels
        pinned.clear()
        monitor._decode()
        assert pinned == [expected, expected]
