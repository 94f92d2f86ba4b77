"""The evaluation view without a recipe follows the images; --config gives a random init its recipe."""

import json

import numpy as np
import pytest
from PIL import Image

from obow.cli import main
from obow.data.eval_sets import LARGE_IMAGE_SIDE, choose_view, typical_side
from obow.data.folders import scan_images


def write_split(root, size, n=3, seed=0):
    rng = np.random.default_rng(seed)
    for split in ("train", "val"):
        for c, rgb in enumerate(((200, 40, 40), (40, 40, 200))):
            folder = root / split / f"c{c}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                w, h = size if isinstance(size, tuple) else (size, size)
                pixels = np.clip(np.array(rgb) + rng.normal(0, 30, (h, w, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.png")
    return root


def test_typical_side_is_the_median_shorter_side(tmp_path):
    for i, (w, h) in enumerate([(40, 30), (32, 32), (64, 20), (50, 60), (33, 90)]):
        Image.new("RGB", (w, h)).save(tmp_path / f"{i}.png")
    (tmp_path / "5.png").write_bytes(b"broken")
    assert typical_side(scan_images(tmp_path)) == 32  # shorter sides 30, 32, 20, 50, 33: median 32


def test_choose_view_rule(tmp_path):
    small = scan_images(write_split(tmp_path / "small", 32) / "train")
    view, why = choose_view(None, small)
    assert (view.teacher_resize, view.teacher_size) == (32, 32) and "median side (32 px)" in why
    view, why = choose_view(None, small, size=24)
    assert (view.teacher_resize, view.teacher_size) == (27, 24) and "--size" in why
    recorded = {"teacher_resize": 40, "teacher_size": 36, "mean": [0.5] * 3, "std": [0.5] * 3}
    view, why = choose_view(recorded, small)
    assert (view.teacher_resize, view.teacher_size, view.mean) == (40, 36, (0.5, 0.5, 0.5)) and "recipe" in why
    large = scan_images(write_split(tmp_path / "large", (LARGE_IMAGE_SIDE + 20, LARGE_IMAGE_SIDE), n=1) / "train")
    view, why = choose_view(None, large)
    assert (view.teacher_resize, view.teacher_size) == (256, 224) and "ImageNet view" in why


def test_random_init_baseline_uses_the_images_view_and_says_so(tmp_path, capsys):
    data = write_split(tmp_path / "data", 32)
    out = tmp_path / "knn.json"
    argv = ["eval", "knn", "--random-init", "--arch", "timm:resnet18", "--stem", "cifar", "--data", str(data)]
    assert main([*argv, "--k", "3", "--out", str(out), "--workers", "0"]) == 0
    settings = json.loads(out.read_text())["settings"]
    assert (settings["view"]["teacher_resize"], settings["view"]["teacher_size"]) == (32, 32)
    assert settings["view_source"] == "no recipe: the images' median side (32 px), uncropped"
    assert "view 32/32 px (no recipe: the images' median side (32 px), uncropped)" in capsys.readouterr().out


def test_random_init_takes_network_and_view_from_a_recipe(tmp_path):
    data = write_split(tmp_path / "data", 32)
    out = tmp_path / "knn.json"
    argv = ["eval", "knn", "--random-init", "--config", "cifar10_fast", "--data", str(data), "--k", "3"]
    assert main([*argv, "--out", str(out), "--workers", "0"]) == 0
    report = json.loads(out.read_text())
    assert report["source"]["arch"] == "timm:resnet18" and report["source"]["stem"] == "cifar"
    assert report["source"]["arch_options"] == {"channels": [32, 64, 128, 256], "stem_width": 32}
    from obow.config import load_config

    views = load_config("cifar10_fast").views
    view = report["settings"]["view"]
    assert (view["teacher_resize"], view["teacher_size"]) == (views.teacher_resize, views.teacher_size)
    assert report["settings"]["view_source"] == "recipe cifar10_fast (its network, untrained)"


def test_config_is_only_for_a_random_init(tmp_path, capsys):
    data = write_split(tmp_path / "data", 32)
    assert main(["eval", "knn", "--config", "cifar10_fast", "--data", str(data)]) == 2
    assert "--config gives a random initialisation its network and view" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["eval", "knn", "--random-init", "--config"])
