"""The scripts of ``examples/`` run as a user runs them: a separate Python process on real image files, a few steps.

``pretrain_loop.py`` pretrains with obow's public classes inside a plain PyTorch loop and saves the student;
``extract_features.py`` reads an ``obow export`` file and fits a scikit-learn classifier on its features."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from obow import build_backbone, load_config

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def run_example(name: str, *args, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"{name} exited {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


@pytest.mark.slow
def test_pretrain_loop_trains_the_student_and_saves_it(tmp_path, tiny_recipe, write_images):
    data = write_images(tmp_path / "images", per_class=8, classes=2, size=32)
    out = tmp_path / "student.pt"
    args = ["--data", data, "--config", tiny_recipe, "--batch-size", 8, "--workers", 0, "--epochs", 3]
    result = run_example("pretrain_loop.py", *args, "--max-steps", 3, "--out", out, cwd=tmp_path)
    assert "epoch 1: loss" in result.stdout and "(step 2 of 6)" in result.stdout
    assert "epoch 2: loss" in result.stdout and "(step 3 of 6)" in result.stdout
    assert "epoch 3" not in result.stdout  # --max-steps stopped it
    saved = torch.load(out, weights_only=True)
    cfg = load_config(str(tiny_recipe))
    torch.manual_seed(0)  # the script's --seed, set just before it builds the model (the student first)
    initial = build_backbone(cfg.model.arch, cfg.model.stem, cfg.model.arch_options)
    start = {k: v.clone() for k, v in initial.state_dict().items()}
    initial.load_state_dict(saved)  # the student's weights, in the recipe's architecture (strict)
    convs = [k for k, v in start.items() if v.dim() == 4]
    assert convs and all(not torch.equal(saved[k], start[k]) for k in convs)  # every convolution was trained


@pytest.mark.slow
def test_extract_features_reads_an_export_and_fits_a_classifier(tiny_run, obow_cli, tmp_path):
    export = tmp_path / "backbone.pth"
    obow_cli("export", "--checkpoint", tiny_run.out / "checkpoint.pt", "--out", export)
    result = run_example("extract_features.py", "--backbone", export, "--data", tiny_run.data, cwd=tmp_path)
    lines = result.stdout.splitlines()
    # tiny_run's data: train/ 2 classes x 12, val/ 2 classes x 3; the tiny network's pool5 has 16 channels
    assert lines[0] == "timm:resnet18 features: (24, 16) for training, (6, 16) for testing"
    assert lines[1].startswith("logistic regression on the pretrained features: ")
    assert lines[1].endswith("% top-1 on 6 test images")


@pytest.mark.slow
def test_extract_features_reads_a_folder_as_obow_eval_does_and_says_what_it_needs(tiny_run, obow_cli, tmp_path):
    """A macOS ``._`` file and a note among the images are left out (torchvision's ImageFolder stopped the script
    at the first); a folder without train/ is one line."""
    export = tmp_path / "backbone.pth"
    obow_cli("export", "--checkpoint", tiny_run.out / "checkpoint.pt", "--out", export)
    data = tmp_path / "copied"
    shutil.copytree(tiny_run.data, data)
    first = sorted((data / "train").iterdir())[0]
    (first / "._000.png").write_bytes(b"\x00\x05\x16\x07" + bytes(100))
    (first / "notes.txt").write_text("not an image")
    result = run_example("extract_features.py", "--backbone", export, "--data", data, cwd=tmp_path)
    assert result.stdout.splitlines()[0] == "timm:resnet18 features: (24, 16) for training, (6, 16) for testing"
    assert "1 file left out: not images of a listed kind (.txt 1)" in result.stderr

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    script = [sys.executable, str(EXAMPLES / "extract_features.py"), "--backbone", str(export)]
    flat = subprocess.run([*script, "--data", str(first)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert flat.returncode == 1 and flat.stdout == ""
    needs = "needs train/ and test/ (or val/) folders of class sub-folders"
    assert flat.stderr == f"{first} {needs}, e.g. {first}/train/cat/\n"


def test_the_examples_use_only_public_names():
    """The examples import from ``obow`` itself, the names docs/api.md promises to keep."""
    import obow

    for script in EXAMPLES.glob("*.py"):
        imports = [line for line in script.read_text().splitlines() if line.startswith(("from obow", "import obow"))]
        assert imports, f"{script.name} does not use obow"
        for line in imports:
            assert line.startswith("from obow import "), f"{script.name}: {line} (import from obow itself)"
            names = [n.strip() for n in line.removeprefix("from obow import ").split(",")]
            assert set(names) <= set(obow.__all__), f"{script.name}: {names} not all in obow.__all__"
