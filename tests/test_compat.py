"""Checkpoints written before the subpackage layout (tests/data/v1_run) still resume, evaluate and export."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from obow.config import load_config
from obow.weights.checkpoint import load_checkpoint, save_atomic
from obow.weights.load import load_backbone

V1 = Path(__file__).parent / "data" / "v1_run"


@pytest.fixture
def v1_run(tmp_path):
    """The old run's epoch-1 checkpoint in a fresh run folder, its recorded data path pointed at a copy of its
    images here (the only change: where the images are)."""
    images = shutil.copytree(V1 / "images", tmp_path / "images")
    ckpt = load_checkpoint(V1 / "checkpoint_epoch1.pt")
    ckpt["config"]["data"]["path"] = str(images)
    out = tmp_path / "run"
    save_atomic(ckpt, out / "checkpoint.pt")
    return images, out


def test_v1_checkpoint_resumes_to_the_old_final_state(v1_run):
    from obow.training.loop import pretrain

    images, out = v1_run
    cfg = load_config(V1 / "recipe.yaml", [f"data.path={images}"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the old run was written (OMP_NUM_THREADS=1): the same reduction order
    try:
        result = pretrain(cfg, out)
    finally:
        torch.set_num_threads(threads)
    assert result["iteration"] == 6 and result["epochs"] == 2
    expected = json.loads((V1 / "final_state.json").read_text())
    assert result["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    state = load_checkpoint(out / "checkpoint.pt")["model"]
    assert set(state) == set(expected["model_sum_abssum"])  # the state-dict names did not change
    for key, (total, abs_total) in expected["model_sum_abssum"].items():
        value = state[key].double()
        assert float(value.sum()) == pytest.approx(total, rel=1e-5, abs=1e-6), key
        assert float(value.abs().sum()) == pytest.approx(abs_total, rel=1e-5, abs=1e-6), key


def test_v1_checkpoint_evaluates_and_exports(tmp_path):
    from obow.cli import main

    backbone, info = load_backbone(V1 / "checkpoint_epoch1.pt", network="teacher")
    assert info["arch"] == "timm:resnet18" and info["epoch"] == 1 and info["iteration"] == 3
    features = backbone.eval()(torch.rand(2, 3, 40, 40)).pool5
    assert features.shape == (2, 16) and torch.isfinite(features).all()
    assert main(["export", "--checkpoint", str(V1 / "checkpoint_epoch1.pt"), "--out", str(tmp_path / "b.pth")]) == 0
    exported = torch.load(tmp_path / "b.pth", weights_only=True)  # timm's names: the student's "body.*"
    student = load_checkpoint(V1 / "checkpoint_epoch1.pt")["model"]
    body = {k.removeprefix("student.body."): v for k, v in student.items() if k.startswith("student.body.")}
    assert set(exported) - {"fc.weight", "fc.bias"} == set(body)  # plus timm's untrained classifier
    for key, value in body.items():
        assert torch.equal(exported[key], value), key
