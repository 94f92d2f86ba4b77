"""obow import-official: official-format files built by hand from an obow model round-trip to the same model."""

import pytest
import torch
import torchvision

from obow import cli
from obow.config import ModelConfig
from obow.methods.obow import OBoW
from obow.methods.official import backbone_key, import_official
from obow.show.words import load_level_vocabulary
from obow.weights.checkpoint import load_checkpoint
from obow.weights.load import load_backbone

GENERATOR_NAMES = {
    "named": lambda i: {"fc1": f"b{i}_fc", "bn": f"b{i}_bn", "fc2": f"b{i}_last_layer"},
    "positional": lambda i: {"fc1": "1", "bn": "2", "fc2": "4"},
}


def official_backbone(state, prefix=""):
    """obow / torchvision backbone names -> the authors' ``_feature_blocks`` names, written out by hand."""
    out = {}
    for key, value in state.items():
        head, _, rest = key.partition(".")
        if head == "conv1":
            out[f"{prefix}_feature_blocks.0.0.{rest}"] = value
        elif head == "bn1":
            out[f"{prefix}_feature_blocks.0.1.{rest}"] = value
        else:
            out[f"{prefix}_feature_blocks.{int(head[-1])}.{rest}"] = value
    return out


def official_model(model, naming="named", ddp=False):
    """The ``network`` state_dict the authors' OBoW module would hold for ``model``."""
    sd = model.state_dict()
    student = {k[8:]: v for k, v in sd.items() if k.startswith("student.")}
    teacher = {k[8:]: v for k, v in sd.items() if k.startswith("teacher.")}
    out = {
        **official_backbone(student, "feature_extractor."),
        **official_backbone(teacher, "feature_extractor_teacher."),
    }
    for i, level in enumerate(model.levels):
        extractor = f"bow_extractor.bow_extractor.{i}."
        out[extractor + "_embedding"] = sd[f"extractors.{level}.vocabulary.words"]
        out[extractor + "_embedding_ptr"] = sd[f"extractors.{level}.vocabulary.ptr"].reshape(1)
        out[extractor + "_min_distance_mean"] = sd[f"extractors.{level}.min_distance_mean"].reshape(1)
        out[extractor + "_track_num_batches"] = torch.ones(1) * 7
        names = GENERATOR_NAMES[naming](i)
        for ours, theirs in names.items():
            for key, value in sd.items():
                if key.startswith(f"predictor.generators.{i}.{ours}."):
                    out[f"bow_predictor.layers_w.{i}.{theirs}.{key.rsplit('.', 1)[1]}"] = value
    out["bow_predictor.scale"] = torch.full((len(model.levels),), model.predictor.kappa)
    out["_alpha"], out["_iteration"] = torch.tensor([0.995]), torch.tensor([42.0])
    out["linear_classifier.layers.1.weight"] = torch.randn(10, 512)  # the monitoring head: dropped
    return {f"module.{k}" if ddp else k: v for k, v in out.items()}


@pytest.fixture(scope="module")
def trained():
    torch.manual_seed(0)
    cfg = ModelConfig(arch="resnet18", levels=("conv4", "conv5"), num_words=16, kappa=5.0, delta_base=0.1)
    model = OBoW.from_config(cfg, total_iterations=100)
    with torch.no_grad():  # student, teacher, vocabularies and statistics all different from their init
        for p in model.student.parameters():
            p.add_(0.01 * torch.randn_like(p))
        for name, buf in model.named_buffers():
            if "running" in name or "words" in name:
                buf.add_(0.1 * torch.rand_like(buf))
            if "min_distance_mean" in name:
                buf.fill_(0.37)
            if name.endswith("ptr"):
                buf.fill_(8)
    model.iteration.fill_(42)
    return model


def pool5(backbone, x):
    return backbone.eval()(x).pool5


def test_backbone_key_by_hand():
    assert backbone_key("_feature_blocks.0.0.weight") == "conv1.weight"
    assert backbone_key("_feature_blocks.0.1.running_var") == "bn1.running_var"
    assert backbone_key("_feature_blocks.3.1.conv2.weight") == "layer3.1.conv2.weight"
    assert backbone_key("_feature_blocks.5.anything") is None and backbone_key("fc.weight") is None


@pytest.mark.parametrize(("naming", "ddp"), [("named", True), ("positional", False)])
@pytest.mark.slow
def test_full_model_round_trip(trained, tmp_path, naming, ddp):
    src = tmp_path / "model_net_checkpoint_80.pth.tar"
    torch.save({"epoch": 80, "network": official_model(trained, naming, ddp), "meters": None}, src)
    summary = import_official(src, tmp_path / "imported.pt")
    assert summary == {
        "kind": "full", "arch": "resnet18", "epoch": 80, "levels": ["conv4", "conv5"], "num_words": 16, "kappa": 5.0,
    }  # fmt: skip
    ckpt = load_checkpoint(tmp_path / "imported.pt")
    original = trained.state_dict()
    assert set(ckpt["model"]) == set(original)
    for key, value in original.items():
        assert torch.equal(ckpt["model"][key], value), key
    assert ckpt["config"]["model"]["delta_base"] == 0.1 and ckpt["iteration"] == 42
    x = torch.randn(2, 3, 64, 64)
    for network in ("student", "teacher"):
        backbone, info = load_backbone(tmp_path / "imported.pt", network=network)
        assert info["epoch"] == 80
        assert torch.equal(pool5(backbone, x), pool5(getattr(trained, network), x))


@pytest.mark.slow
def test_backbone_only_files(trained, tmp_path, capsys):
    student = trained.student.state_dict()
    x = torch.randn(2, 3, 64, 64)
    expected = pool5(trained.student, x)
    extractor_only = tmp_path / "feature_extractor_net_checkpoint_200.pth.tar"
    torch.save({"epoch": 200, "network": official_backbone(student), "meters": None}, extractor_only)
    tv = torchvision.models.resnet18(num_classes=16)  # the authors' torchvision format: fc = generated weights
    tv.load_state_dict({**student, "fc.weight": torch.randn(16, 512), "fc.bias": torch.zeros(16)})
    torchvision_format = tmp_path / "tochvision_resnet18_student_K16_epoch200.pth.tar"
    torch.save({"network": tv.state_dict()}, torchvision_format)
    for i, src in enumerate((extractor_only, torchvision_format)):
        out = tmp_path / f"imported{i}.pt"
        assert cli.main(["import-official", str(src), "--out", str(out)]) == 0
        assert "the student backbone only" in capsys.readouterr().out
        backbone, _ = load_backbone(out)
        assert torch.equal(pool5(backbone, x), expected)
        with pytest.raises(ValueError, match="holds no 'teacher' weights"):
            load_backbone(out, network="teacher")
        with pytest.raises(ValueError, match="holds no conv5 vocabulary"):
            load_level_vocabulary(out)


def test_not_an_official_file(tmp_path, capsys):
    path = tmp_path / "other.pth"
    torch.save({"network": {"encoder.weight": torch.zeros(2)}}, path)
    assert cli.main(["import-official", str(path), "--out", str(tmp_path / "x.pt")]) == 2
    assert "does not look like an official OBoW checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "x.pt").exists()
