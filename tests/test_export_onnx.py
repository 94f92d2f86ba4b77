"""``obow export --out FILE.onnx``: the whole network (its stem too) as an ONNX graph, checked with ONNX Runtime, whose
sidecar's usage lines give obow's own features with NumPy, Pillow and ONNX Runtime alone."""

import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from obow.data.eval_sets import eval_dataset, views_from_dict
from obow.evaluate.features import extract_features
from obow.weights import onnx as obow_onnx
from obow.weights.export import export_backbone
from obow.weights.load import load_backbone

onnxruntime = pytest.importorskip("onnxruntime")  # the dev extra installs it (CI does)

#: (model.arch, model.stem, arch_options, view size): stems that the torchvision and timm formats need edits for
CASES = [
    ("resnet18", "cifar", {}, 32),
    ("timm:resnet18", "no_maxpool", {"channels": [16, 32, 48, 64], "stem_width": 16}, 48),
    ("torchvision:mobilenet_v3_small", "torchvision", {}, 64),
]


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """Photos of other sizes and shapes than the view (Resize and CenterCrop matter), portrait and landscape."""
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    for name in ["cat", "dog"]:
        (root / name).mkdir()
        for i, (h, w) in enumerate([(45, 37), (80, 97), (61, 61)]):
            Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(root / name / f"{i}.png")
    return root


def export_quietly(checkpoint, out, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return export_backbone(checkpoint, out, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=["resnet18_cifar", "timm_no_maxpool", "torchvision_mobilenet"])
def test_the_usage_lines_give_obows_features_with_onnxruntime_alone(tmp_path, make_checkpoint, images, case):
    """Run as printed, in a Python process that cannot import obow (nor torch: it is blocked), they compute what
    ``obow eval`` does: pool5 of the recipe's evaluation view."""
    arch, stem, options, size = case
    checkpoint = make_checkpoint(tmp_path / "run.ckpt", arch=arch, stem=stem, size=size, options=options)
    meta = export_quietly(checkpoint, tmp_path / "backbone.onnx")
    assert json.loads((tmp_path / "backbone.onnx.json").read_text()) == meta
    assert meta["format"] == meta["container"] == "onnx" and meta["stem"] == stem and meta["opset"] >= 17
    assert meta["checked"].startswith(f"onnxruntime {onnxruntime.__version__}: pool5 and conv5 equal PyTorch's to ")
    assert not (tmp_path / "backbone.onnx.partial").exists()

    backbone, info = load_backbone(checkpoint)
    expected = extract_features(backbone, eval_dataset(images, views_from_dict(info["views"])), batch_size=4)[0]
    files = eval_dataset(images, views_from_dict(None)).images.paths
    program = "\n".join(
        [
            "import json, sys",
            "sys.modules['torch'] = None  # the usage lines must not need PyTorch",
            f"files = {files!r}",
            *meta["usage"],
            "json.dump(features.tolist(), open('features.json', 'w'))",
        ]
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-I", "-c", program], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    got = torch.tensor(json.loads((tmp_path / "features.json").read_text()))
    assert got.shape == expected.shape == (6, backbone.num_features)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))


@pytest.fixture(scope="module")
def teacher_export(tmp_path_factory):
    """A ResNet-18 checkpoint (CIFAR stem) and its teacher exported as ONNX, for the tests that only read them."""
    from conftest import write_checkpoint

    folder = tmp_path_factory.mktemp("teacher_export")
    checkpoint = write_checkpoint(folder / "run.ckpt", arch="resnet18", stem="cifar", size=32)
    export_quietly(checkpoint, folder / "b.onnx", network="teacher")
    return checkpoint, folder / "b.onnx"


@pytest.mark.slow
def test_the_graph_takes_any_batch_and_size_and_gives_conv5_too(teacher_export):
    checkpoint, path = teacher_export
    backbone, _ = load_backbone(checkpoint, network="teacher")
    session = onnxruntime.InferenceSession(str(path))
    assert [i.name for i in session.get_inputs()] == ["images"]
    assert [o.name for o in session.get_outputs()] == ["pool5", "conv5"]
    for shape in [(1, 3, 32, 32), (5, 3, 40, 24)]:
        x = torch.randn(shape, generator=torch.Generator().manual_seed(shape[0]))
        pool5, conv5 = session.run(None, {"images": x.numpy()})
        with torch.no_grad():
            out = backbone.eval()(x, ("conv5",))
        torch.testing.assert_close(torch.from_numpy(pool5), out.pool5, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(torch.from_numpy(conv5), out.maps["conv5"], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_the_check_refuses_a_graph_that_computes_something_else(teacher_export):
    """ONNX Runtime against another network's numbers (one weight changed after the export): refused, one line."""
    checkpoint, path = teacher_export
    backbone, _ = load_backbone(checkpoint, network="teacher")
    model = obow_onnx._Features(backbone).eval()
    assert obow_onnx.check_with_onnxruntime(model, path, 32).startswith("onnxruntime ")
    with torch.no_grad():
        backbone.layer4[1].conv2.weight.mul_(1.01)  # 1 % on one convolution
    with pytest.raises(ValueError, match=r"ONNX Runtime's (pool5|conv5) differs from PyTorch's by .* not kept"):
        obow_onnx.check_with_onnxruntime(model, path, 32)


@pytest.mark.slow
def test_a_failed_check_leaves_nothing(tmp_path, make_checkpoint, monkeypatch):
    checkpoint = make_checkpoint(tmp_path / "run.ckpt", arch="resnet18", stem="cifar", size=32)

    def refuse(model, path, side):
        assert path.name == "b.onnx.partial" and path.is_file()  # checked before it takes its name
        raise ValueError("ONNX Runtime's pool5 differs")

    monkeypatch.setattr(obow_onnx, "check_with_onnxruntime", refuse)
    with pytest.raises(ValueError, match="differs"):
        export_quietly(checkpoint, tmp_path / "b.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.ckpt"]


@pytest.mark.parametrize(
    ("out", "fmt", "says"),
    [
        ("b.pth", "onnx", "--format onnx writes an ONNX file: give --out b.onnx"),
        ("b.onnx", "timm", "--out b.onnx names an ONNX file: leave out --format timm, or give another name"),
    ],
)
def test_a_format_and_a_name_that_disagree_are_one_line(obow_cli, tmp_path, out, fmt, says):
    result = obow_cli(
        "export", "--checkpoint", tmp_path / "none.pt", "--out", tmp_path / out, "--format", fmt, check=False
    )
    assert result.code == 2 and f"obow: error: {says}" in result.err and result.out == ""


def test_missing_exporter_packages_are_one_line_with_the_install_command(
    obow_cli, tmp_path, make_checkpoint, monkeypatch
):
    checkpoint = make_checkpoint(tmp_path / "run.ckpt", arch="resnet18", stem="cifar", size=32)
    monkeypatch.setattr(obow_onnx, "missing_packages", lambda: ["onnxscript"])
    result = obow_cli("export", "--checkpoint", checkpoint, "--out", tmp_path / "b.onnx", check=False)
    assert result.code == 2 and result.out == ""
    assert 'writing ONNX needs onnxscript, not installed here: pip install "obow[onnx]"' in result.err
    assert not (tmp_path / "b.onnx").exists()


@pytest.mark.slow
def test_the_command_says_what_it_checked_and_reading_the_graph_as_weights_is_one_line(
    obow_cli, tmp_path, make_checkpoint
):
    checkpoint = make_checkpoint(tmp_path / "run.ckpt", arch="resnet18", stem="cifar", size=32)
    result = obow_cli("export", "--checkpoint", checkpoint, "--out", tmp_path / "b.onnx")
    assert result.code == 0, result.err
    lines = result.out.splitlines()
    assert lines[0].startswith(f"wrote {tmp_path / 'b.onnx'} (onnx, onnx: resnet18, cifar stem, student")
    assert lines[1].startswith("checked: onnxruntime ") and len(lines) == 2
    assert "unused nodes" not in result.err and "INFO" not in result.err.replace("INFO --checkpoint", "")

    read = obow_cli("eval", "knn", "--checkpoint", tmp_path / "b.onnx", "--data", tmp_path, check=False)
    assert read.code != 0 and "it is not a file written by torch.save but an ONNX graph" in read.err
