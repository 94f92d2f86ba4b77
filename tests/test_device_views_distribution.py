"""The device pipeline's views fall where the worker pipeline's do, on every image shape: measured.

Coordinate-coded images (red = x, green = y) go through each pipeline as a run builds it (the device pipeline
through its cache and loader, :func:`obow.training.build.build_data`); every view's box in the original image is
read back from its pixels (``benchmarks/views_distribution.py``, whose measures these are). On landscape and
portrait images, the device pipeline's crops and patch views are compared with torchvision's
``RandomResizedCrop`` sampler and with the worker pipeline (PIL) by two-sample KS tests on the boxes' area
share, aspect and centre, and chi-square tests on the share reaching outside the central square, the share
upsampled, and the flip and grey rates; the teacher's view is the worker's box. Before the whole-image cache
(main at 50b7e95), the device pipeline cut every image to its central square: these tests failed there.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats

from obow.data.batched_views import BatchedViews
from obow.data.cache import padded_batch, sharp_side
from obow.methods import cache_side

spec = importlib.util.spec_from_file_location(
    "views_distribution", Path(__file__).resolve().parents[1] / "benchmarks" / "views_distribution.py"
)
vd = importlib.util.module_from_spec(spec)
spec.loader.exec_module(vd)

#: Two samples of one distribution fail a test at this level once in a thousand runs; the draws are seeded, so a
#: pass is repeatable and a failure a real difference.
ALPHA = 1e-3
#: The paper's views scaled to 100x75 images, as 500x375 ImageNet images see them (crops of 32 px, a teacher
#: resized to 52, a 52 px patch view): the same shares of the image, in a fraction of the time.
SMALL = [
    "views.teacher_resize=52", "views.teacher_size=44", "views.crop_size=32", "views.patch_grid_size=52",
    "views.patch_size=20", "model.stem=cifar",
]  # fmt: skip
SHAPES = {"landscape": (75, 100), "portrait": (100, 75), "square": (75, 75)}


def failures(device: dict, reference: dict, keys) -> list[str]:
    """The measures of ``keys`` on which ``device`` and ``reference`` (:func:`vd.measures`) differ at ``ALPHA``."""
    compared = vd.compare(device, reference)
    return [f"{k}: {compared[k]}" for k in keys if compared[k]["p"] <= ALPHA]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_device_views_follow_torchvisions_sampler_on_every_shape(shape, tmp_path):
    """The device pipeline's crops and patch views on 75x100, 100x75 and 75x75 images, read back from 256 crops
    and 128 patch views, against 2,000 boxes of torchvision's own sampler on the same size: area share, aspect,
    centre, reach outside the central square, upsampled share (in the cached image's pixels); flips half of the
    views, grey ones ``views.grayscale_prob``; the teacher's view the worker pipeline's box (within 0.5 px)."""
    size = SHAPES[shape]
    cfg = vd.config("imagenet_resnet50_full", SMALL)
    device, cached_scale = vd.device_boxes(cfg, size, 128, tmp_path)
    bad = []
    for group in ("crops", "grid"):
        ours = vd.measures(device[group], cfg.views, size, group, cached_scale)
        theirs = vd.measures(vd.sampler_boxes(cfg.views, size, group, 2000, seed=1), cfg.views, size, group)
        keys = ["area share", "aspect log(w/h)", "centre x", "centre y", "outside the central square", "upsampled"]
        bad += [f"{group} {line}" for line in failures(ours, theirs, keys)]
        n_flipped, n = int(ours["flipped"].sum()), len(ours["flipped"])
        if stats.binomtest(n_flipped, n, 0.5).pvalue <= ALPHA:
            bad.append(f"{group} flipped {n_flipped} of {n}")
        if stats.binomtest(int(ours["grey"].sum()), len(ours["grey"]), cfg.views.grayscale_prob).pvalue <= ALPHA:
            bad.append(f"{group} grey {ours['grey'].mean():.3f}")
    worker_teacher = vd.worker_boxes(cfg, size, 1, seed=0)["teacher"][0][0]
    device_teacher = np.array([box for box, _, _ in device["teacher"]])
    if np.abs(device_teacher - worker_teacher).max() > 0.5:
        bad.append(f"teacher box {device_teacher.mean(axis=0).round(2)} against {worker_teacher.round(2)}")
    assert not bad, bad


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["landscape", "portrait"])
def test_the_device_views_follow_the_worker_pipeline_at_the_papers_sizes(shape, tmp_path):
    """500x375 and 375x500 images with the paper's views, 400 images through each pipeline: every measure of
    ``benchmarks/views_distribution.py`` (area share, aspect, centre, reach outside the central square, upsampled,
    area outside the teacher's view; flip and grey rates) of the device pipeline against the worker
    pipeline's."""
    size = vd.SHAPES[shape]
    cfg = vd.config("imagenet_resnet50_full")
    device, cached_scale = vd.device_boxes(cfg, size, 400, tmp_path)
    workers = vd.worker_boxes(cfg, size, 400, seed=0)
    teacher = {name: np.median([b for b, _, _ in boxes["teacher"]], axis=0) for name, boxes in
               (("device", device), ("workers", workers))}  # fmt: skip
    assert np.abs(teacher["device"] - teacher["workers"]).max() < 0.5
    bad = []
    for group in ("crops", "grid"):
        ours = vd.measures(device[group], cfg.views, size, group, cached_scale, teacher["device"])
        theirs = vd.measures(workers[group], cfg.views, size, group, 1.0, teacher["workers"])
        bad += [f"{group} {line}" for line in failures(ours, theirs, ours.keys())]
    assert not bad, bad


def test_a_padded_batch_of_mixed_sizes_renders_each_image_as_alone():
    """Images of three shapes padded into one batch (:func:`obow.data.cache.padded_batch`) render the views each
    renders alone in a batch of its own size: the padding, the image's edge repeated, is never seen."""
    cfg = vd.config("cifar10_fast").views
    rng = np.random.default_rng(0)
    sizes = np.array([[20, 30], [30, 20], [25, 25]])
    images = [torch.from_numpy(rng.integers(0, 256, (3, h, w), dtype=np.uint8)) for h, w in sizes]
    flat = torch.cat([im.flatten() for im in images])
    offsets = np.concatenate([[0], np.cumsum(3 * sizes.prod(axis=1))[:-1]])
    batch = padded_batch(flat, offsets, sizes)
    assert batch.shape == (3, 3, 30, 30)
    views = BatchedViews(cfg)
    params = views.place(views.draw(3, torch.Generator().manual_seed(0)), torch.from_numpy(sizes))
    together = views.render(batch, params)
    for i, image in enumerate(images):
        alone = views.render(image.unsqueeze(0), params[i : i + 1])
        for key in together:
            torch.testing.assert_close(together[key][i : i + 1], alone[key], rtol=0, atol=1e-5)


def test_the_default_cache_side_is_where_no_view_is_upsampled():
    """The paper's crops (160 px, area share from 0.08, aspect ratio from 3/4) need a 654 px shorter side, its
    patch view 382 and its teacher 256; CIFAR-10's recipes need more than their 32 px images (kept as they are)."""
    from obow.config import load_config

    assert sharp_side(256, [(160, 0.08), (256, 0.6)]) == 654 == cache_side(load_config("imagenet_resnet50_full"))
    assert sharp_side(256, [(256, 0.6)]) == 382 and sharp_side(256, []) == 256
    assert cache_side(load_config("cifar10_fast")) > 32
    # at 654 px, the narrowest crop a square allows is 160 px (and 653 px gives 159.96: upsampled)
    assert round(654 * np.sqrt(0.08 * 3 / 4), 2) >= 160 > 653 * np.sqrt(0.08 * 3 / 4)
