import json
import pickle

import pytest
import torch
import torchvision
from torch import nn

from obow.weights.export import FC_NOTE, detectron2_key, export_backbone
from obow.weights.load import load_backbone


def torchvision_pool5(model, x):
    model.fc = nn.Identity()
    return model.eval()(x)


@pytest.fixture(scope="module")
def r18(tmp_path_factory, make_checkpoint):
    return make_checkpoint(tmp_path_factory.mktemp("r18") / "checkpoint.pt", stem="torchvision", size=64)


@pytest.fixture(scope="module")
def r50(tmp_path_factory, make_checkpoint):
    return make_checkpoint(
        tmp_path_factory.mktemp("r50") / "checkpoint.pt", arch="resnet50", stem="torchvision", size=64
    )


@pytest.mark.parametrize("network", ["student", "teacher"])
def test_torchvision_file_loads_strictly_and_gives_the_same_features(r18, tmp_path, network):
    out = tmp_path / "backbone.pth"
    export_backbone(r18, out, network=network)
    model = torchvision.models.resnet18()
    model.load_state_dict(torch.load(out), strict=True)
    x = torch.randn(2, 3, 64, 64)
    ours, _ = load_backbone(r18, network=network)
    other, _ = load_backbone(r18, network="teacher" if network == "student" else "student")
    with torch.no_grad():
        expected = ours.eval()(x).pool5
        got = torchvision_pool5(model, x)
        assert not torch.allclose(other.eval()(x).pool5, expected)  # student and teacher differ
    torch.testing.assert_close(got, expected)
    raw = torch.load(r18, weights_only=False)["model"]
    assert torch.equal(torch.load(out)["layer3.1.bn2.running_var"], raw[f"{network}.layer3.1.bn2.running_var"])


def test_torchvision_fc_is_the_seeded_init_and_the_metadata_says_so(r18, tmp_path):
    out = tmp_path / "backbone.pth"
    export_backbone(r18, out)
    torch.manual_seed(0)
    reference = torchvision.models.resnet18()
    state = torch.load(out)
    assert torch.equal(state["fc.weight"], reference.fc.weight) and torch.equal(state["fc.bias"], reference.fc.bias)
    assert list(state) == list(reference.state_dict())
    meta = json.loads((tmp_path / "backbone.pth.json").read_text())
    assert meta["arch"] == "resnet18" and meta["stem"] == "torchvision" and meta["network"] == "student"
    assert meta["source_checkpoint"] == str(r18) and meta["epoch"] == 3 and meta["iteration"] == 30
    assert meta["fc"] == FC_NOTE == "untrained, torchvision init, seed 0"
    assert meta["obow_version"] and meta["views"]["teacher_size"] == 64 and "stem_note" not in meta


def test_resnet50_torchvision_export(r50, tmp_path):
    out = tmp_path / "r50.pth"
    export_backbone(r50, out)
    model = torchvision.models.resnet50()
    model.load_state_dict(torch.load(out), strict=True)
    ours, _ = load_backbone(r50)
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(torchvision_pool5(model, x), ours.eval()(x).pool5)


def test_cifar_stem_export_warns_and_loads_into_a_modified_torchvision_model(tmp_path, make_checkpoint):
    ckpt = make_checkpoint(tmp_path / "checkpoint.pt")
    out = tmp_path / "backbone.pth"
    with pytest.warns(UserWarning, match="3x3 stride-1"):
        meta = export_backbone(ckpt, out)
    assert "without max-pool" in meta["stem_note"]
    assert json.loads((tmp_path / "backbone.pth.json").read_text())["stem"] == "cifar"
    plain = torchvision.models.resnet18()
    with pytest.raises(RuntimeError, match="conv1.weight"):
        plain.load_state_dict(torch.load(out))
    model = torchvision.models.resnet18()
    model.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    model.maxpool = nn.Identity()
    model.load_state_dict(torch.load(out), strict=True)
    ours, _ = load_backbone(ckpt)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(torchvision_pool5(model, x), ours.eval()(x).pool5)


def test_detectron2_key_renaming():
    assert detectron2_key("conv1.weight") == "stem.conv1.weight"
    assert detectron2_key("bn1.running_mean") == "stem.conv1.norm.running_mean"
    assert detectron2_key("layer1.0.conv1.weight") == "res2.0.conv1.weight"
    assert detectron2_key("layer1.0.bn1.running_mean") == "res2.0.conv1.norm.running_mean"
    assert detectron2_key("layer4.2.bn3.weight") == "res5.2.conv3.norm.weight"
    assert detectron2_key("layer2.0.downsample.0.weight") == "res3.0.shortcut.weight"
    assert detectron2_key("layer2.0.downsample.1.bias") == "res3.0.shortcut.norm.bias"
    assert detectron2_key("fc.weight") is None and detectron2_key("fc.bias") is None


def test_detectron2_pickle_has_renamed_keys_and_original_values(r50, tmp_path):
    out = tmp_path / "r50.pkl"
    meta = export_backbone(r50, out, fmt="detectron2")
    with open(out, "rb") as f:
        obj = pickle.load(f)
    assert obj["__author__"] == "obow" and obj["matching_heuristics"] is True
    weights = obj["model"]
    raw = torch.load(r50, weights_only=False)["model"]
    pairs = {
        "stem.conv1.weight": "conv1.weight",
        "stem.conv1.norm.weight": "bn1.weight",
        "res2.0.conv1.weight": "layer1.0.conv1.weight",
        "res2.0.conv1.norm.running_mean": "layer1.0.bn1.running_mean",
        "res3.0.shortcut.weight": "layer2.0.downsample.0.weight",
        "res3.0.shortcut.norm.running_var": "layer2.0.downsample.1.running_var",
        "res5.2.conv3.norm.bias": "layer4.2.bn3.bias",
    }
    for new, old in pairs.items():
        assert torch.equal(torch.from_numpy(weights[new]), raw[f"student.{old}"]), new
    assert not any(k.startswith(("fc", "layer")) or ".bn" in k or "downsample" in k for k in weights)
    assert len(weights) == len([k for k in raw if k.startswith("student.")])
    assert meta["detectron2_config"]["MODEL.RESNETS.DEPTH"] == 50
    assert meta["detectron2_config"]["MODEL.RESNETS.STRIDE_IN_1X1"] is False


def test_detectron2_refuses_the_cifar_stem(tmp_path, make_checkpoint):
    ckpt = make_checkpoint(tmp_path / "checkpoint.pt")
    with pytest.raises(ValueError, match="cifar stem"):
        export_backbone(ckpt, tmp_path / "out.pkl", fmt="detectron2")
    assert not (tmp_path / "out.pkl").exists()


def test_exported_file_loads_back_and_checks_the_architecture(r18, tmp_path):
    out = tmp_path / "backbone.pth"
    export_backbone(r18, out, network="teacher")
    backbone, info = load_backbone(backbone_file=out)
    reference, _ = load_backbone(r18, network="teacher")
    assert info["kind"] == "exported" and info["network"] == "teacher" and info["arch"] == "resnet18"
    for k, v in reference.state_dict().items():
        assert torch.equal(backbone.state_dict()[k], v), k
    with pytest.raises(ValueError, match="resnet18.*resnet50"):
        load_backbone(backbone_file=out, arch="resnet50")
    # without the sidecar the architecture is recognised from the weights
    (tmp_path / "backbone.pth.json").unlink()
    assert load_backbone(backbone_file=out)[1]["arch"] == "resnet18"


def test_checkpoint_of_another_architecture_is_named(r18):
    with pytest.raises(ValueError, match="holds a resnet18 backbone.*resnet50 was requested"):
        load_backbone(r18, arch="resnet50")


def test_weights_that_do_not_fit_are_explained(tmp_path):
    torch.manual_seed(0)
    path = tmp_path / "resnet34.pth"
    torch.save(torchvision.models.resnet34().state_dict(), path)  # no .json sidecar: recognised from the weights
    with pytest.raises(ValueError, match="holds a resnet34 backbone.*resnet18 was requested"):
        load_backbone(backbone_file=path, arch="resnet18")
    assert load_backbone(backbone_file=path)[1]["arch"] == "resnet34"
    state = torchvision.models.resnet18().state_dict()
    del state["layer4.1.conv2.weight"]
    torch.save(state, path)
    with pytest.raises(ValueError, match=r"do not fit a resnet18 .*1 missing keys \(e.g. layer4.1.conv2.weight\)"):
        load_backbone(backbone_file=path, arch="resnet18")
