"""The sidecar's ``usage`` lines, run as they are printed, compute obow's own features (issue 60, item 11)."""

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
from obow.weights.export import export_backbone
from obow.weights.load import load_backbone

#: Every usage program, each in a fresh namespace given only ``files``, as a user would paste it.
RUNNER = """
import json, sys, torch
jobs, files = json.loads(open(sys.argv[1]).read()), json.loads(open(sys.argv[2]).read())
for job in jobs:
    scope = {"files": files}
    exec("\\n".join(job["usage"]), scope)
    torch.save(scope["features"], job["out"])
"""

#: (model.arch, model.stem, arch_options, view size, export file name)
CASES = [
    ("resnet18", "cifar", {}, 32, "r18_cifar.pth"),
    ("resnet18", "no_maxpool", {}, 64, "r18_nomax.safetensors"),
    ("resnet18", "torchvision", {}, 64, "r18.pth"),
    ("timm:resnet18", "cifar", {"channels": [16, 32, 48, 64], "stem_width": 16}, 32, "timm_cifar.pth"),
    ("timm:resnet10t", "cifar", {}, 32, "timm_10t_cifar.safetensors"),
    ("timm:regnetx_002", "torchvision", {}, 64, "timm_regnet.pth"),
    ("torchvision:mobilenet_v3_small", "torchvision", {}, 64, "tv_mobilenet.pth"),
]


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """Two class folders of photos of other sizes than the view (so that Resize and CenterCrop matter)."""
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    for c, name in enumerate(["cat", "dog"]):
        (root / name).mkdir()
        for i, (h, w) in enumerate([(45, 37), (80, 96)]):
            pixels = rng.integers(0, 255, (h, w, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / name / f"{i}.{'png' if c else 'jpg'}")
    return root


def export_and_extract(folder, make_checkpoint, images, case):
    """Export a random checkpoint of ``case``; its sidecar's usage lines and obow's features of ``images``."""
    arch, stem, options, size, name = case
    ckpt = make_checkpoint(folder / f"{name}.ckpt", arch=arch, stem=stem, size=size, options=options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the stem note, which the usage lines apply
        meta = export_backbone(ckpt, folder / name)
    assert json.loads((folder / f"{name}.json").read_text())["usage"] == meta["usage"]
    backbone, info = load_backbone(ckpt)
    features = extract_features(backbone, eval_dataset(images, views_from_dict(info["views"])), batch_size=3)[0]
    assert features.shape[0] == 4 and features.abs().sum() > 0
    return meta["usage"], features


def image_files(images):
    return eval_dataset(images, views_from_dict(None)).images.paths


@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=["torchvision", "timm"])
@pytest.mark.slow
def test_cifar_stem_usage_lines_run_as_printed_give_obows_features(tmp_path, make_checkpoint, images, case):
    usage, expected = export_and_extract(tmp_path, make_checkpoint, images, case)
    scope = {"files": image_files(images)}  # the one name the lines leave to the reader
    exec("\n".join(usage), scope)
    torch.testing.assert_close(scope["features"], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_usage_lines_as_printed_compute_obows_features(tmp_path, make_checkpoint, images):
    """Every source and stem, in another Python process without obow, as a user would paste them."""
    jobs, expected = [], {}
    for case in CASES:
        name = case[-1]
        usage, expected[name] = export_and_extract(tmp_path, make_checkpoint, images, case)
        jobs.append({"usage": usage, "out": str(tmp_path / f"{name}.features.pt")})
    files = image_files(images)
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    (tmp_path / "files.json").write_text(json.dumps(files))
    (tmp_path / "runner.py").write_text(RUNNER)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the user's Python: no obow on the path
    done = subprocess.run(
        [sys.executable, "-I", str(tmp_path / "runner.py"), str(tmp_path / "jobs.json"), str(tmp_path / "files.json")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    for job, (_, _, _, _, name) in zip(jobs, CASES, strict=True):
        torch.testing.assert_close(torch.load(job["out"]), expected[name], rtol=1e-5, atol=1e-5, msg=name)
