"""timm and torchvision backbones: the paper's level names on any convnet, OBoW steps with them, and exports
that load back into the library's own model with strict loading."""

import pytest
import timm
import torch
import torchvision
from torch import nn

from obow.backbones import build_backbone, level_map_size
from obow.config import Config, ConfigError, DataConfig, ModelConfig, ViewsConfig, load_config
from obow.methods.obow import OBoW
from obow.weights.export import export_backbone
from obow.weights.load import load_backbone

#: (arch, stem, options, expected (conv4, conv5) channels): two non-ResNet families from each library.
CASES = [
    ("timm:regnetx_002", "torchvision", {}, (152, 368)),
    ("timm:mobilenetv3_small_050", "torchvision", {}, (24, 288)),
    ("timm:resnet18", "cifar", {"channels": [16, 32, 48, 64], "stem_width": 16}, (48, 64)),
    ("torchvision:mobilenet_v3_small", "torchvision", {}, (48, 576)),
    ("torchvision:regnet_x_400mf", "torchvision", {}, (160, 400)),
]


@pytest.mark.parametrize(("arch", "stem", "options", "channels"), CASES)
def test_levels_are_the_last_two_stages(arch, stem, options, channels):
    torch.manual_seed(0)
    backbone = build_backbone(arch, stem, options).eval()
    assert (backbone.level_channels["conv4"], backbone.level_channels["conv5"]) == channels
    assert backbone.num_features == channels[1]
    x = torch.randn(2, 3, 64, 64)
    out = backbone(x, levels=("conv4", "conv5"))
    c4, c5 = out.maps["conv4"], out.maps["conv5"]
    assert c4.shape[1] == channels[0] and c5.shape[1] == channels[1]
    # conv5 is one stride-2 stage after conv4, and pool5 is its global average
    assert c4.shape[-1] == 2 * c5.shape[-1]
    assert c5.shape[-1] == level_map_size(arch, 64, "conv5", stem, options)
    torch.testing.assert_close(out.pool5, c5.mean(dim=(2, 3)), rtol=1e-6, atol=1e-6)


def test_timm_levels_equal_timms_own_feature_outputs():
    torch.manual_seed(0)
    backbone = build_backbone("timm:regnetx_002").eval()
    reference = timm.create_model("regnetx_002", features_only=True).eval()
    reference.load_state_dict(backbone.body.state_dict())
    x = torch.randn(2, 3, 64, 64)
    feats = reference(x)
    out = backbone(x, levels=("conv2", "conv3", "conv4", "conv5"))
    for level, ref in zip(("conv2", "conv3", "conv4", "conv5"), feats[-4:], strict=True):
        torch.testing.assert_close(out.maps[level], ref, rtol=0, atol=0)


def test_torchvision_conv5_is_the_input_of_the_classifier_pooling():
    torch.manual_seed(0)
    backbone = build_backbone("torchvision:mobilenet_v3_small").eval()
    model = torchvision.models.mobilenet_v3_small().eval()
    model.load_state_dict({**model.state_dict(), **backbone.export_state_dict()})
    x = torch.randn(2, 3, 96, 96)
    torch.testing.assert_close(backbone(x, levels=("conv5",)).maps["conv5"], model.features(x), rtol=0, atol=0)


def test_cifar_stem_of_a_timm_resnet_keeps_weight_shapes_and_quarters_the_stride():
    plain = build_backbone("timm:resnet10t", "torchvision")
    cifar = build_backbone("timm:resnet10t", "cifar")
    assert {k: v.shape for k, v in plain.state_dict().items()} == {k: v.shape for k, v in cifar.state_dict().items()}
    assert level_map_size("timm:resnet10t", 64, "conv5", "torchvision") == 2
    assert level_map_size("timm:resnet10t", 64, "conv5", "cifar") == 8
    with pytest.raises(ValueError, match="no max-pool in its stem"):
        build_backbone("timm:regnetx_002", "no_maxpool")


@pytest.mark.parametrize(("arch", "stem", "options", "channels"), [CASES[0], CASES[2], CASES[3]])
def test_an_obow_step_trains_every_family(arch, stem, options, channels):
    torch.manual_seed(0)
    cfg = ModelConfig(arch=arch, stem=stem, arch_options=options, levels=("conv4", "conv5"), num_words=32)
    model = OBoW.from_config(cfg, total_iterations=10).train()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    size = 40 if stem == "cifar" else 160  # conv5 at least 5x5 before border removal
    assert level_map_size(arch, size, "conv5", stem, options) >= 5
    teacher = torch.rand(4, 3, size, size)
    views = [torch.rand(4, 2, 3, size // 2, size // 2), torch.rand(4, 3, 3, size // 4, size // 4)]
    before = [p.detach().clone() for p in model.student.parameters()]
    out = model(teacher, views)
    assert torch.isfinite(out.loss) and out.loss > 0
    out.loss.backward()
    assert all(p.grad is not None for p in model.student.parameters() if p.requires_grad)
    assert all(p.grad is None for p in model.teacher.parameters())
    optimizer.step()
    assert any(not torch.equal(a, b) for a, b in zip(before, model.student.parameters(), strict=True))
    assert 1.0 <= float(out.metrics["student/effective_rank"]) <= 8.0  # 8 views of the first group


def test_config_accepts_prefixed_names_and_rejects_bad_ones():
    cfg = load_config(None, ["model.arch=timm:regnetx_002", "views.teacher_size=160", "views.teacher_resize=182"])
    assert cfg.model.arch == "timm:regnetx_002"
    with pytest.raises(ConfigError, match="model.arch='tmm:x' is not understood"):
        load_config(None, ["model.arch=tmm:x"])
    with pytest.raises(ConfigError, match="timm cannot build it"):
        load_config(None, ["model.arch=timm:no_such_net"])
    with pytest.raises(ConfigError, match="the plain resnet18 takes none"):
        load_config(None, ["model.arch=resnet18", "model.arch_options={stem_width: 32}"])
    # regnetx_002 has stride 32: at 96 px its conv5 map is 3x3, 1x1 after border removal
    with pytest.raises(ConfigError, match="conv5 BoW map is 1x1"):
        Config(
            model=ModelConfig(arch="timm:regnetx_002"),
            views=ViewsConfig(teacher_resize=110, teacher_size=96, crop_size=68),
            data=DataConfig(batch_size=256),
        )


@pytest.mark.parametrize(
    ("arch", "stem", "options"),
    [
        ("timm:resnet18", "cifar", {"channels": [16, 32, 48, 64], "stem_width": 16}),
        ("timm:regnetx_002", "torchvision", {}),
    ],
)
def test_exported_timm_backbone_loads_strictly_into_timm_create_model(tmp_path, make_checkpoint, arch, stem, options):
    ckpt = make_checkpoint(tmp_path / "ckpt.pt", arch=arch, stem=stem, size=64, options=options)
    meta = export_backbone(ckpt, tmp_path / "backbone.pth")
    assert meta["format"] == "timm" and meta["arch"] == arch
    name = arch.partition(":")[2]
    model = timm.create_model(name, **{k: tuple(v) if isinstance(v, list) else v for k, v in options.items()})
    model.load_state_dict(torch.load(tmp_path / "backbone.pth", weights_only=True), strict=True)
    if stem == "cifar":  # the reader's side of the stem note
        model.conv1.stride, model.maxpool = (1, 1), nn.Identity()
    student, _ = load_backbone(ckpt)
    student.eval()
    model.eval().reset_classifier(0)
    x = torch.randn(2, 3, 64, 64)
    torch.testing.assert_close(model(x), student(x).pool5, rtol=1e-5, atol=1e-5)
    # and obow reads the export back
    again, info = load_backbone(backbone_file=tmp_path / "backbone.pth")
    assert info["arch"] == arch
    torch.testing.assert_close(again.eval()(x).pool5, student(x).pool5, rtol=0, atol=0)


def test_random_init_of_a_timm_backbone_is_seeded():
    a, _ = load_backbone(random_init=True, arch="timm:regnetx_002", seed=3)
    b, _ = load_backbone(random_init=True, arch="timm:regnetx_002", seed=3)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert ka == kb and torch.equal(va, vb)


@pytest.mark.parametrize("arch", ["resnet18", "timm:resnet18", "torchvision:resnet18"])
@pytest.mark.parametrize("levels", [("conv4",), ("conv5",), ("conv4", "conv5"), ("conv5", "conv4"), ("conv3",)])
def test_maps_alone_equal_the_full_pass_and_stop_at_the_deepest_level(arch, levels):
    """``Backbone.maps`` (what OBoW's teacher calls) returns exactly ``forward(x, levels).maps``, in train mode
    (batch statistics) too; for the ResNets and timm it does not run the stages after the deepest level asked."""
    from obow.backbones import build_backbone

    torch.manual_seed(0)
    backbone = build_backbone(arch, stem="torchvision" if arch.startswith("torchvision:") else "cifar").train()
    x = torch.randn(4, 3, 32, 32)
    full = backbone(x, levels).maps
    ran = []
    hooks = [m.register_forward_hook(lambda *_, name=n: ran.append(name)) for n, m in backbone.named_modules()]
    alone = backbone.maps(x, levels)
    for hook in hooks:
        hook.remove()
    assert list(alone) == list(levels)
    for level in levels:
        assert torch.equal(alone[level], full[level])
    if arch != "torchvision:resnet18" and "conv5" not in levels:
        assert not [n for n in ran if "layer4" in n]  # conv5's stage never ran
