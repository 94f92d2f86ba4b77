import json
import pickle
import warnings

import pytest
import safetensors
import safetensors.torch
import timm
import torch
import torchvision
from torch import nn

from obow.weights.export import FC_NOTE, detectron2_key, export_backbone, save_safetensors
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


@pytest.mark.slow
def test_resnet50_torchvision_export(r50, tmp_path):
    out = tmp_path / "r50.pth"
    export_backbone(r50, out)
    model = torchvision.models.resnet50()
    model.load_state_dict(torch.load(out), strict=True)
    ours, _ = load_backbone(r50)
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(torchvision_pool5(model, x), ours.eval()(x).pool5)


@pytest.mark.slow
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


# ------------------------------------------------------------------------------------------------ safetensors

#: float32 features of the same weights computed by two models (obow's and the library's) may differ in the last
#: bits: torch.testing's float32 default (rtol 1.3e-6, atol 1e-5) is the tolerance.
FLOAT32 = {"rtol": 1.3e-6, "atol": 1e-5}


def run_loading_lines(usage):
    """The model the sidecar's usage lines build and load (the lines before the images are read)."""
    scope = {}
    exec("\n".join(usage[: next(i for i, line in enumerate(usage) if line.startswith("preprocess"))]), scope)
    return scope["model"]


def read_header(path):
    with safetensors.safe_open(path, framework="pt") as f:
        return f.metadata()


@pytest.mark.parametrize("network", ["student", "teacher"])
@pytest.mark.slow
def test_safetensors_export_loads_into_torchvision_with_load_file(r18, tmp_path, network):
    out = tmp_path / "backbone.safetensors"
    meta = export_backbone(r18, out, network=network)
    assert meta["container"] == "safetensors" and meta["format"] == "torchvision"
    assert "model.load_state_dict(safetensors.torch.load_file(path))" in meta["usage"]
    # the sidecar's usage lines that load the model, run as they are written (all of them: test_export_usage)
    model = run_loading_lines(meta["usage"])
    ours, _ = load_backbone(r18, network=network)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(torchvision_pool5(model, x), ours.eval()(x).pool5, **FLOAT32)
    # the same tensors as the torch.save export, bit for bit, fc included
    export_backbone(r18, tmp_path / "backbone.pth", network=network)
    pth, st = torch.load(tmp_path / "backbone.pth"), safetensors.torch.load_file(out)
    assert st.keys() == pth.keys()
    for key, value in pth.items():
        assert st[key].dtype == value.dtype and torch.equal(st[key], value), key
    # the header: Hugging Face's "format" and the sidecar's JSON
    header = read_header(out)
    assert header["format"] == "pt"
    assert json.loads(header["obow"]) == json.loads((tmp_path / "backbone.safetensors.json").read_text()) == meta


@pytest.mark.parametrize(
    ("arch", "stem", "options"),
    [
        ("timm:resnet18", "cifar", {"channels": [16, 32, 48, 64], "stem_width": 16}),
        ("timm:regnetx_002", "torchvision", {}),
    ],
)
def test_safetensors_timm_export_loads_with_timms_pretrained_file(tmp_path, make_checkpoint, arch, stem, options):
    ckpt = make_checkpoint(tmp_path / "ckpt.pt", arch=arch, stem=stem, size=64, options=options)
    out = tmp_path / "backbone.safetensors"
    meta = export_backbone(ckpt, out)
    assert meta["format"] == "timm" and meta["container"] == "safetensors"
    assert any("pretrained_cfg_overlay=dict(file=path)" in line for line in meta["usage"])
    name = arch.partition(":")[2]
    # the sidecar's usage lines: the whole model, classifier included, so timm loads it strictly; obow's stem
    with_head = run_loading_lines(meta["usage"])
    # the usual way to take features: no classifier (timm drops the head's weights)
    headless = timm.create_model(
        name, pretrained=True, pretrained_cfg_overlay=dict(file=str(out)), num_classes=0, **options
    )
    with_head.reset_classifier(0)
    student, _ = load_backbone(ckpt)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        expected = student.eval()(x).pool5
        if stem == "cifar":  # the reader's side of the stem note (the usage lines did it for with_head)
            headless.conv1.stride, headless.maxpool = (1, 1), nn.Identity()
        for model in (with_head, headless):
            torch.testing.assert_close(model.eval()(x), expected, **FLOAT32)


def test_safetensors_export_reads_back_without_its_sidecar(r18, tmp_path):
    out = tmp_path / "backbone.safetensors"
    export_backbone(r18, out, network="teacher")
    reference, _ = load_backbone(r18, network="teacher")
    (tmp_path / "backbone.safetensors.json").unlink()  # the header describes the file
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "no sidecar" warning: nothing is guessed
        backbone, info = load_backbone(backbone_file=out)
    assert info["kind"] == "exported" and info["network"] == "teacher" and info["epoch"] == 3
    assert info["arch"] == "resnet18" and info["stem"] == "torchvision" and info["views"]["teacher_size"] == 64
    for key, value in reference.state_dict().items():
        assert torch.equal(backbone.state_dict()[key], value), key
    with pytest.raises(ValueError, match="resnet18.*resnet50"):
        load_backbone(backbone_file=out, arch="resnet50")


def test_safetensors_from_elsewhere_is_recognised_from_its_weights(tmp_path):
    torch.manual_seed(0)
    model = torchvision.models.resnet34()
    path = tmp_path / "model.safetensors"
    safetensors.torch.save_file(model.state_dict(), path)  # no obow header, no sidecar
    with pytest.warns(UserWarning, match="recognised from its weights as resnet34"):
        backbone, info = load_backbone(backbone_file=path)
    assert info["arch"] == "resnet34" and info["network"] is None
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(backbone.eval()(x).pool5, torchvision_pool5(model, x), **FLOAT32)


def test_safetensors_shared_and_non_contiguous_tensors_are_written_as_separate_contiguous_ones(tmp_path):
    weight = torch.randn(4, 6)
    state = {
        "tied.a": weight,
        "tied.b": weight,  # the same storage (tied weights)
        "transposed": weight.t(),  # a view, not contiguous
        "channels_last": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "expanded": torch.randn(3, 1).expand(3, 4),  # stride 0
        "steps": torch.tensor(7),
    }
    with pytest.raises(RuntimeError, match="share memory"):  # what the copies are for
        safetensors.torch.save({"tied.a": weight, "tied.b": weight})
    with pytest.raises(ValueError, match="non contiguous"):
        safetensors.torch.save({"transposed": weight.t()})
    path = tmp_path / "s.safetensors"
    save_safetensors(state, path, {"arch": "x"})
    back = safetensors.torch.load_file(path)
    assert back.keys() == state.keys()
    for key, value in state.items():
        assert back[key].dtype == value.dtype and torch.equal(back[key], value), key
    assert json.loads(read_header(path)["obow"]) == {"arch": "x"}


def test_detectron2_refuses_a_safetensors_name_before_any_work(tmp_path, obow_cli):
    out = tmp_path / "model.safetensors"
    missing = tmp_path / "checkpoint.pt"  # refused before the checkpoint is read
    result = obow_cli("export", "--checkpoint", missing, "--out", out, "--format", "detectron2", check=False)
    assert result.code == 2
    lines = result.err.strip().splitlines()
    assert len(lines) == 1 and "does not read safetensors" in lines[0] and "--out model.pkl" in lines[0]
    assert not out.exists() and not (tmp_path / "model.safetensors.json").exists()


@pytest.mark.slow
def test_obow_eval_knn_reads_a_safetensors_export(tmp_path, make_checkpoint, colour_folders, obow_cli):
    colour_folders(tmp_path / "data", {"blue": (40, 60, 200), "red": (200, 50, 40)}, {"train": 6, "val": 4})
    ckpt = make_checkpoint(tmp_path / "run" / "checkpoint.pt", size=16)
    out = tmp_path / "export" / "backbone.safetensors"
    printed = obow_cli("export", "--checkpoint", ckpt, "--out", out, "--network", "teacher").out
    assert f"wrote {out} (torchvision, safetensors: resnet18" in printed
    fast = ("--k", 5, "--workers", 0, "--device", "cpu", "--data", tmp_path / "data")
    obow_cli("eval", "knn", "--backbone", out, "--out", tmp_path / "from_file.json", *fast)
    obow_cli("eval", "knn", "--checkpoint", ckpt, "--network", "teacher", "--out", tmp_path / "from_ckpt.json", *fast)
    from_file = json.loads((tmp_path / "from_file.json").read_text())
    from_ckpt = json.loads((tmp_path / "from_ckpt.json").read_text())
    assert from_file["results"] == from_ckpt["results"]
    assert from_file["source"]["kind"] == "exported" and from_file["source"]["network"] == "teacher"


def write_bad_header(path):
    path.write_bytes(safetensors.torch.save({"w": torch.zeros(2)}, metadata={"obow": "{not json"}))


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (lambda p: p.write_bytes(p.read_bytes()[:-100]), "damaged or cut short"),
        (lambda p: p.write_bytes(p.read_bytes()[:5]), "damaged or cut short"),
        (lambda p: p.write_bytes(b""), "the file is empty"),
        (lambda p: torch.save({"w": torch.zeros(2)}, p), "not a safetensors file"),
        (write_bad_header, "'obow' entry is not the JSON object"),
    ],
    ids=["cut", "header-cut", "empty", "torch-save", "bad-header"],
)
def test_a_bad_safetensors_file_is_one_line_and_exit_2(r18, tmp_path, obow_cli, damage, why):
    path = tmp_path / "backbone.safetensors"
    export_backbone(r18, path)
    damage(path)
    with pytest.raises(ValueError, match=why):
        load_backbone(backbone_file=path)
    result = obow_cli("eval", "knn", "--backbone", path, "--data", tmp_path, "--device", "cpu", check=False)
    assert result.code == 2
    lines = result.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("obow: error: ") and f"backbone file '{path}'" in lines[0]
    assert why in lines[0] and "Traceback" not in result.err
