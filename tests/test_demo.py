import json

import numpy as np
import pytest
import torch
from PIL import Image

from obow.config import load_config
from obow.experiments.demo import beats_constant_predictor, demo_settings, run_demo, write_digits
from obow.methods.obow import OBoW
from obow.weights.load import load_backbone


@pytest.fixture(scope="module")
def digits_root(tmp_path_factory):
    """The demo's data written once (seed 0, one mosaic per training scan instead of the demo's
    four: the same code with a third of the files to write) for the tests below."""
    root = tmp_path_factory.mktemp("digits") / "seed0"
    write_digits(root, seed=0, copies=1)
    return root


def test_write_digits_makes_a_stratified_class_folder_split(digits_root):
    train, val = digits_root / "train", digits_root / "val"
    counts = {split.name: {d.name: len(list(d.glob("*.png"))) for d in split.iterdir()} for split in (train, val)}
    assert set(counts["train"]) == set(counts["val"]) == {str(i) for i in range(10)}
    assert sum(counts["train"].values()) + sum(counts["val"].values()) == 1797
    assert abs(sum(counts["train"].values()) - sum(counts["val"].values())) <= 1
    for digit in counts["train"]:  # stratified: every class's scans split in halves
        assert abs(counts["train"][digit] - counts["val"][digit]) <= 1
    image = Image.open(next((train / "3").glob("*.png")))
    assert image.size == (32, 32) and image.mode == "RGB"
    pixels = np.asarray(image)
    assert (pixels[..., 0] == pixels[..., 1]).all() and pixels.max() > 200  # white strokes, no colour
    before = sorted(p.stat().st_mtime_ns for p in train.rglob("*.png"))
    assert write_digits(digits_root) == (train, val)  # already written: kept as it is
    assert sorted(p.stat().st_mtime_ns for p in train.rglob("*.png")) == before


def test_digit_mosaics_are_reproducible(digits_root, tmp_path):
    a_train = digits_root / "train"
    b_train, _ = write_digits(tmp_path / "b", seed=0, copies=1)
    c_train, _ = write_digits(tmp_path / "c", seed=1, copies=1)
    a_files = sorted(p.relative_to(a_train) for p in a_train.rglob("*.png"))
    assert a_files == sorted(p.relative_to(b_train) for p in b_train.rglob("*.png"))
    for rel in a_files[:50]:
        np.testing.assert_array_equal(np.asarray(Image.open(a_train / rel)), np.asarray(Image.open(b_train / rel)))
    shared = [rel for rel in a_files if (c_train / rel).exists()]
    assert any(
        not np.array_equal(np.asarray(Image.open(a_train / rel)), np.asarray(Image.open(c_train / rel)))
        for rel in shared
    )


def test_random_init_baseline_is_the_pretraining_runs_starting_network():
    """The demo compares with 'the same network at its random initialisation': the weights that obow.training.build
    builds before its first step (seed, then OBoW.from_config)."""
    cfg = load_config("demo")
    torch.manual_seed(cfg.train.seed)
    start = OBoW.from_config(cfg.model, total_iterations=10).student.state_dict()
    baseline, info = load_backbone(
        random_init=True,
        arch=cfg.model.arch,
        stem=cfg.model.stem,
        seed=cfg.train.seed,
        arch_options=cfg.model.arch_options,
    )
    assert info["kind"] == "random_init"
    for name, value in start.items():
        torch.testing.assert_close(baseline.state_dict()[name], value, rtol=0, atol=0, msg=name)


def test_demo_keeps_the_decoded_images_in_its_own_folder_unless_told_otherwise(tmp_path):
    train, val = tmp_path / "data" / "digits" / "train", tmp_path / "data" / "digits" / "val"
    cfg = load_config("demo", demo_settings(tmp_path, ["train.seed=3"], train, val))
    assert cfg.data.pipeline == "device" and cfg.train.seed == 3
    assert (cfg.data.cache_dir, cfg.data.path, cfg.data.val_path) == tuple(
        str(p) for p in (tmp_path / "data" / "cache", train, val)
    )
    mine = load_config("demo", demo_settings(tmp_path, ["data.cache_dir=/elsewhere", "data.path=/x"], train, val))
    assert (mine.data.cache_dir, mine.data.path) == ("/elsewhere", str(train))  # the folders it wrote win


@pytest.mark.slow
def test_demo_runs_end_to_end_at_a_tiny_size(tmp_path, capsys):
    report = run_demo(
        tmp_path,
        [
            "optim.epochs=2",
            "data.images_per_class=32",
            "views.num_patches=0",
            "model.num_words=128",
            "data.num_workers=0",
            "train.progress_bar=false",
        ],
    )
    rows = report["results"]
    for row in rows.values():
        for key in ("fewshot_10way_1shot", "fewshot_10way_5shot", "knn_k20"):
            assert 0 <= row[key] <= 100
    # A random network's features barely tell the mosaics apart (that is the point of the data); the seeded
    # network on the seeded data scores what the demo's measured runs report (docs/demo.md: 16.24 at seed 0),
    # and the trained one differs.
    assert rows["random init"]["knn_k20"] == pytest.approx(16.24, abs=0.5)
    assert rows["OBoW pretrained"]["knn_k20"] != rows["random init"]["knn_k20"]
    # the recipe's device pipeline made the views, from a decoded copy under the demo's folder
    assert load_config(tmp_path / "pretrain" / "config.yaml").data.pipeline == "device"
    assert list((tmp_path / "data" / "cache").glob("*.u8"))
    saved = json.loads((tmp_path / "demo_results.json").read_text())
    assert saved["results"] == rows and saved["pretext"]["first_loss"] > 0
    # the verdict on the pretext task, from the run's own log (its logic: tests/test_demo_verdict.py)
    pretext = report["pretext"]
    assert 0 <= pretext["last_epoch_predicted_kl_to_mean"] and 0 < pretext["last_epoch_average_bow_loss"]
    verdict, sentence = beats_constant_predictor(pretext)
    assert saved["beats_constant_predictor"] is verdict
    out = capsys.readouterr().out
    assert "random init" in out and "OBoW pretrained" in out and "pretext task" in out
    assert sentence in out
