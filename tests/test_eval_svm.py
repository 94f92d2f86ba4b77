"""VOC07 SVM classification: the devkit reader, VOC's average precision by hand, the protocol on features
whose answer is known, and `obow eval svm` end to end on a tiny VOC-layout folder."""

import json

import numpy as np
import pytest
from PIL import Image
from sklearn.metrics import average_precision_score

from obow.cli import main
from obow.data.voc import read_voc
from obow.evaluate.svm import l2_normalize, svm_classification, voc_average_precision


def test_average_precision_by_hand():
    # ranks: +, -, +, -  -> precision 1 at recall 1/2, 2/3 at recall 1: (1 + 2/3) / 2
    assert voc_average_precision([0.9, 0.8, 0.7, 0.6], [1, -1, 1, -1]) == pytest.approx(100 * 5 / 6)
    # the negative at rank 2 marked difficult is left out: +, + -> 100
    assert voc_average_precision([0.9, 0.8, 0.7, 0.6], [1, 0, 1, -1]) == pytest.approx(100.0)
    # ranks: -, +, +: precision 1/2 at recall 1/2, 2/3 at recall 1; interpolated: 2/3 at both recalls
    assert voc_average_precision([3.0, 2.0, 1.0], [-1, 1, 1]) == pytest.approx(100 * 2 / 3)
    # scikit-learn's (not interpolated) gives (1/2 + 2/3) / 2 there: VOC's envelope is what the devkit scores
    assert average_precision_score([0, 1, 1], [3.0, 2.0, 1.0]) == pytest.approx(7 / 12)
    assert np.isnan(voc_average_precision([1.0, 2.0], [-1, 0]))


def test_average_precision_matches_sklearn_when_precision_only_falls():
    rng = np.random.default_rng(0)
    scores = rng.normal(size=50)
    labels = np.where(scores + 0.01 * rng.normal(size=50) > 0.8, 1, -1)  # positives ranked first
    assert voc_average_precision(scores, labels) == pytest.approx(100 * average_precision_score(labels == 1, scores))


def test_l2_normalize():
    x = np.array([[3.0, 4.0], [0.0, 0.0]])
    np.testing.assert_allclose(l2_normalize(x), [[3 / 5.00001, 4 / 5.00001], [0.0, 0.0]])


def write_devkit(root, flags: dict[str, dict[str, list[int]]], colours: dict[str, tuple[int, int, int]]):
    """A VOC-layout folder: ``flags[split][class]`` is the flag of every image of the split, in order."""
    (root / "JPEGImages").mkdir(parents=True)
    (root / "ImageSets" / "Main").mkdir(parents=True)
    rng = np.random.default_rng(0)
    for split, per_class in flags.items():
        count = len(next(iter(per_class.values())))
        ids = [f"{split}{i:03d}" for i in range(count)]
        for name, values in per_class.items():
            lines = [f"{i} {v:2d}" for i, v in zip(ids, values, strict=True)]
            (root / "ImageSets" / "Main" / f"{name}_{split}.txt").write_text("\n".join(lines) + "\n")
        for n, image_id in enumerate(ids):
            pixels = rng.integers(0, 40, size=(24, 24, 3)).astype(np.int32)
            for name, values in per_class.items():
                if values[n] != -1:  # present or difficult: the class's colour in one half of the image
                    half = slice(0, 12) if name == "red" else slice(12, 24)
                    pixels[half] += np.array(colours[name])
            Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(root / "JPEGImages" / f"{image_id}.jpg")
    return root


FLAGS = {
    "trainval": {"red": [1, 1, 1, 1, -1, -1, -1, -1, 1, -1, 1, -1], "blue": [-1, -1, 1, 1, 1, 1, -1, -1, 1, 1, -1, -1]},
    "test": {"red": [1, -1, 1, -1, 0, -1], "blue": [-1, 1, 1, -1, -1, 0]},
}


def test_read_voc(tmp_path):
    root = write_devkit(tmp_path / "VOC", FLAGS, {"red": (200, 0, 0), "blue": (0, 0, 200)})
    test = read_voc(root, "test")
    assert test.classes == ["blue", "red"] and test.image_ids == [f"test{i:03d}" for i in range(6)]
    np.testing.assert_array_equal(test.targets[:, 1], FLAGS["test"]["red"])
    np.testing.assert_array_equal(test.targets[:, 0], FLAGS["test"]["blue"])
    assert test.paths[0].endswith("JPEGImages/test000.jpg")
    (root / "ImageSets" / "Main" / "red_test.txt").write_text("test000 1\ntest001 2\n")
    with pytest.raises(ValueError, match=r"red_test.txt:2: expected '<image id> <1, -1 or 0>'"):
        read_voc(root, "test")
    with pytest.raises(ValueError, match="no <class>_val.txt files"):
        read_voc(root, "val")


def test_protocol_on_separable_features_and_the_difficult_rule():
    # class 0 is feature 0, class 1 feature 1; the test image 3 looks like class 0 but is labelled absent
    train_x = np.array([[1, 0], [0.9, 0.1], [1, 0.2], [0.1, 1], [0, 0.9], [0.2, 1]], dtype=float)
    train_t = np.array([[1, -1], [1, -1], [1, -1], [-1, 1], [-1, 1], [-1, 1]])
    test_x = np.array([[1, 0.1], [0.1, 1], [0.95, 0], [0.97, 0.05]])
    test_t = np.array([[1, -1], [-1, 1], [1, -1], [-1, -1]])
    result = svm_classification(train_x, train_t, test_x, test_t, ["a", "b"], costs=(0.1, 1.0))
    assert result["per_class"]["b"]["ap"] == pytest.approx(100.0)
    # class a: after L2 normalisation the test images lie on the unit circle at angles 0.0997 (image 0,
    # present), 0 (image 2, present) and 0.0515 (image 3, absent) from feature 0; any SVM with a positive weight
    # on feature 0 and a negative one on feature 1 ranks them 2, 3, 0: +, -, + -> (1 + 2/3) / 2
    assert result["per_class"]["a"]["ap"] == pytest.approx(100 * 5 / 6)
    assert result["mAP"] == pytest.approx((100 * 5 / 6 + 100.0) / 2)
    # marked difficult instead, the same image is left out: class a is perfect
    test_t[3, 0] = 0
    result = svm_classification(train_x, train_t, test_x, test_t, ["a", "b"], costs=(0.1, 1.0))
    assert result["per_class"]["a"]["ap"] == pytest.approx(100.0) and result["mAP"] == pytest.approx(100.0)
    assert set(result["per_class"]["a"]["cv_ap"]) == {0.1, 1.0}


def test_protocol_needs_three_of_each():
    x = np.eye(4)
    with pytest.raises(ValueError, match=r"class 'a': .* at least 3 positive and 3 negative .* has 1 and 3"):
        svm_classification(x, np.array([[1], [-1], [-1], [-1]]), x, np.array([[1], [-1], [-1], [-1]]), ["a"])


def test_eval_svm_end_to_end(tmp_path, capsys):
    root = write_devkit(tmp_path / "VOC", FLAGS, {"red": (200, 0, 0), "blue": (0, 0, 200)})
    out = tmp_path / "svm.json"
    args = ["eval", "svm", "--random-init", "--arch", "timm:resnet18", "--stem", "cifar", "--data", str(root)]
    code = main([*args, "--size", "24", "--out", str(out), "--workers", "0", "--costs", "0.1", "1"])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["protocol"] == "svm" and report["data"]["num_train"] == 12 and report["data"]["num_test"] == 6
    assert report["data"]["difficult_test_labels"] == 2 and report["settings"]["costs"] == [0.1, 1.0]
    per_class = report["results"]["per_class"]
    assert set(per_class) == {"blue", "red"}
    assert report["results"]["mAP"] == pytest.approx((per_class["blue"]["ap"] + per_class["red"]["ap"]) / 2)
    # the same protocol on the same network's features, computed here, gives the same numbers
    from obow.data.eval_sets import eval_dataset, views_from_dict
    from obow.evaluate.features import extract_features
    from obow.weights.load import load_backbone

    backbone, _ = load_backbone(random_init=True, arch="timm:resnet18", stem="cifar", seed=0)
    views = views_from_dict(None, size=24)
    train, test = read_voc(root, "trainval"), read_voc(root, "test")
    train_x, _ = extract_features(backbone, eval_dataset(train.image_list(), views))
    test_x, _ = extract_features(backbone, eval_dataset(test.image_list(), views))
    expected = svm_classification(train_x.numpy(), train.targets, test_x.numpy(), test.targets, train.classes, (0.1, 1))
    assert report["results"]["mAP"] == pytest.approx(expected["mAP"], abs=1e-6)
    assert "mAP" in capsys.readouterr().out


def test_eval_svm_drops_an_unreadable_image_with_its_targets(tmp_path):
    root = write_devkit(tmp_path / "VOC", FLAGS, {"red": (200, 0, 0), "blue": (0, 0, 200)})
    (root / "JPEGImages" / "test001.jpg").write_bytes(b"not a jpeg")
    out = tmp_path / "svm.json"
    args = ["eval", "svm", "--random-init", "--arch", "timm:resnet18", "--stem", "cifar", "--data", str(root)]
    assert main([*args, "--size", "24", "--out", str(out), "--workers", "0", "--costs", "1"]) == 0
    report = json.loads(out.read_text())
    assert report["data"]["num_test"] == 5 and report["skipped_images"] == [str(root / "JPEGImages" / "test001.jpg")]


def option_help(help_text: str, option: str) -> str:
    """The help of ``option`` in an argparse ``--help`` text, its wrapped lines joined."""
    lines = help_text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"  {option} "))  # not the usage line
    text = [lines[start].strip()]
    for line in lines[start + 1 :]:
        if not line.startswith("    ") or line.strip().startswith("-"):
            break
        text.append(line.strip())
    return " ".join(text)


def test_eval_svm_help_says_data_is_a_voc_devkit_and_exports_of_any_format_work(capsys):
    with pytest.raises(SystemExit):
        main(["eval", "svm", "--help"])
    text = capsys.readouterr().out
    data = option_help(text, "--data")
    assert "VOC devkit layout" in data and "ImageSets/Main/<class>_<split>.txt" in data
    assert "train/ and val/" not in data
    backbone = option_help(text, "--backbone")
    assert "--format torchvision or timm" in backbone
    with pytest.raises(SystemExit):
        main(["eval", "knn", "--help"])
    assert "train/ and val/ (or test/) class folders" in option_help(capsys.readouterr().out, "--data")
