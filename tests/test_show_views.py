"""obow show views: every view of the first images as its own PNG, the pixels the training pipeline makes (the
workers' and the device pipeline's), denormalised back to uint8; an overview picture; bad input in one line."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch
from conftest import one_error_line
from PIL import Image

from obow.config import load_config
from obow.data.folders import scan_images
from obow.training.build import build_data

#: The base colours of the test images, one per image, far apart: the teacher view (no colour jitter) of image
#: ``i`` is nearest to colour ``i``, which tells whether a file holds the image its name says.
COLOURS = [(200, 40, 40), (40, 200, 40), (40, 40, 200), (200, 200, 40), (40, 200, 200)]
#: Landscape, portrait and square images of different sizes (width, height).
SIZES = [(40, 30), (30, 40), (32, 32), (48, 36), (36, 36)]


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory):
    """Five images: a base colour each, with a diagonal gradient and noise (so that crops, flips and blurs
    change the pixels)."""
    root = tmp_path_factory.mktemp("views_data")
    rng = np.random.default_rng(0)
    for i, ((w, h), colour) in enumerate(zip(SIZES, COLOURS, strict=True)):
        y, x = np.mgrid[:h, :w]
        ramp = (x / w + y / h)[..., None] * 25
        pixels = np.array(colour) + ramp + rng.normal(0, 8, (h, w, 3))
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(root / f"{i}.png")
    return root


def expected_views(recipe, data, pipeline: str, n: int, tmp_path) -> tuple[dict[str, torch.Tensor], Any]:
    """The views of the first ``n`` images made through the training's entry point (``build_data``), one batch
    of ``n`` seeded as a run's first batch, rows put back in the folder's order; and the recipe's views."""
    cfg = copy.deepcopy(load_config(recipe, [f"data.path={data}"]))
    cfg.data.batch_size, cfg.data.cache_dir = n, str(tmp_path / "cache")
    found = scan_images(data)
    first = replace(found, paths=found.paths[:n])
    _, sampler, loader = build_data(cfg, torch.device("cpu"), first, pipeline=pipeline)
    batch = next(iter(loader))
    order = batch["index"].tolist() if "index" in batch else next(sampler.batches())[1]
    rows = torch.from_numpy(np.argsort(order))
    return {key: value[rows] for key, value in batch["image"].items()}, cfg.views


def denormalised(view: torch.Tensor, views_cfg) -> np.ndarray:
    """A normalised view ``[3, H, W]`` as ``[H, W, 3]`` values on the 0-255 scale, float64, not rounded."""
    mean = np.array(views_cfg.mean).reshape(3, 1, 1)
    std = np.array(views_cfg.std).reshape(3, 1, 1)
    return ((view.double().numpy() * std + mean) * 255).transpose(1, 2, 0)


@pytest.mark.parametrize("pipeline", ["workers", "device"])
def test_every_view_is_its_own_png_of_the_pipelines_pixels(pipeline, image_folder, tiny_recipe, tmp_path, obow_cli):
    out = tmp_path / "views"
    argv = ["show", "views", "--data", image_folder, "--config", tiny_recipe, "--out", out, "--images", 4]
    printed = obow_cli(*argv, "--pipeline", pipeline, "train.device=cpu", f"data.cache_dir={tmp_path / 'c'}").out
    assert f"{pipeline} pipeline on the cpu: wrote 16 views of 4 images" in printed  # 1 teacher, 1 crop, 2 patches
    names = {f"image{i:03d}_{v}.png" for i in range(4) for v in ("teacher", "crop1", "patch1", "patch2")}
    assert {p.name for p in out.iterdir()} == names | {"overview.png"}
    for i in range(4):
        assert f"image{i:03d}: {image_folder / f'{i}.png'}" in printed

    views, views_cfg = expected_views(tiny_recipe, image_folder, pipeline, 4, tmp_path)
    files = {"teacher": ["teacher"], "crops": ["crop1"], "patches": ["patch1", "patch2"]}
    rounding = []  # of the device's crops: its blur runs in floats
    for key, suffixes in files.items():
        for i in range(4):
            for j, suffix in enumerate(suffixes):
                view = views[key][i] if key == "teacher" else views[key][i, j]
                png = np.asarray(Image.open(out / f"image{i:03d}_{suffix}.png")).astype(np.float64)
                exact = np.clip(denormalised(view, views_cfg), 0, 255)
                assert png.shape == exact.shape
                # 8-bit views come back exactly (both pipelines round as Pillow does); the device's blurred crops
                # are floats, written to the nearest level
                floats = pipeline == "device" and key == "crops"
                np.testing.assert_allclose(png, exact, rtol=0, atol=0.5 + 1e-3 if floats else 1e-3)
                if floats:
                    rounding.append(np.abs(png - exact).mean())
    if pipeline == "device":  # the tolerance is needed there: the blurred crops are no 8-bit values
        assert 0 < np.mean(rounding) < 0.25
    for i in range(4):  # the file named image i holds image i: its teacher view has image i's colour
        teacher = np.asarray(Image.open(out / f"image{i:03d}_teacher.png")).reshape(-1, 3).mean(0)
        assert np.argmin([np.abs(teacher - c).sum() for c in COLOURS]) == i
    overview = Image.open(out / "overview.png")
    assert overview.width > 300 and overview.height > 300  # 4 rows of 4 views


def test_train_seed_draws_other_views(image_folder, tiny_recipe, tmp_path, obow_cli):
    """``train.seed`` is the run's seed: another seed, other views (the same seed makes the training's views, the
    test above)."""
    argv = ["show", "views", "--data", image_folder, "--config", tiny_recipe, "--images", 2, "--pipeline", "device"]
    for seed in (0, 1):
        obow_cli(*argv, "--out", tmp_path / str(seed), "train.device=cpu", f"train.seed={seed}")
    crops = [np.asarray(Image.open(tmp_path / str(seed) / "image001_crop1.png")) for seed in (0, 1)]
    assert crops[0].shape == crops[1].shape and not np.array_equal(*crops)


def test_the_cli_pipelines_are_the_librarys():
    from obow.cli.show import VIEW_PIPELINES
    from obow.config.choices import PIPELINES

    assert set(VIEW_PIPELINES) == set(PIPELINES) - {"auto"}


def test_bad_input_is_one_line_and_writes_nothing(image_folder, tiny_recipe, tmp_path, obow_cli):
    out = tmp_path / "out"
    base = ["show", "views", "--config", tiny_recipe, "--out", out, "train.device=cpu"]
    empty = tmp_path / "empty"
    empty.mkdir()
    line = one_error_line(obow_cli(*base, "--data", empty, check=False))
    assert line.startswith("obow: error: ") and "no image" in line
    line = one_error_line(obow_cli(*base, "--data", image_folder, "views.crop_sise=3", check=False))
    assert line.startswith("obow: error: ") and "crop_sise" in line
    # argparse's errors: a usage line, then the error
    bad = obow_cli(*base, "--data", image_folder, "--pipeline", "gpu", check=False)
    assert bad.code == 2 and "argument --pipeline: invalid choice: 'gpu'" in bad.err.strip().splitlines()[-1]
    missing = obow_cli("show", "views", "--config", tiny_recipe, "--out", out, check=False)
    assert missing.code == 2 and "the following arguments are required: --data" in missing.err.strip().splitlines()[-1]
    inside = image_folder / "views"
    line = one_error_line(obow_cli(*base[:-3], "--out", inside, "--data", image_folder, check=False))
    assert line == f"obow: error: --out {inside} is inside --data {image_folder}: its PNGs would become training " + (
        "images; write elsewhere"
    )
    assert not out.exists() and not inside.exists()
    picture = tmp_path / "views.JPG"  # a folder of that name, before
    line = one_error_line(obow_cli(*base[:-3], "--out", picture, "--data", image_folder, check=False))
    assert line == (
        f"obow: error: --out {picture} names a picture, but obow show views writes a folder (overview.png and a PNG "
        f"per view): give a folder, e.g. --out {tmp_path / 'views'}"
    )
    assert not picture.exists()


def test_show_words_refuses_a_picture_as_its_folder(tiny_run, obow_cli, tmp_path):
    out = tmp_path / "words.png"
    result = obow_cli("show", "words", "--checkpoint", tiny_run.out, "--data", tiny_run.data, "--out", out, check=False)
    assert result.code == 2 and not out.exists()
    assert f"--out {out} names a picture, but obow show words writes a folder" in result.err
