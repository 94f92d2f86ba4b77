import pytest
import torch
import torchvision

from obow.backbones import LEVEL_TO_STAGE, ResNetBackbone, feature_map_size


@pytest.mark.parametrize("arch", ["resnet18", "resnet50"])
def test_state_dict_loads_into_plain_torchvision_model(arch):
    backbone = ResNetBackbone(arch)
    reference = torchvision.models.get_model(arch, weights=None)
    state = backbone.state_dict()
    assert set(state) | {"fc.weight", "fc.bias"} == set(reference.state_dict())
    state.update({"fc.weight": reference.fc.weight, "fc.bias": reference.fc.bias})
    reference.load_state_dict(state, strict=True)
    reference.fc = torch.nn.Identity()
    backbone.eval()
    reference.eval()
    x = torch.randn(2, 3, 64, 64)
    torch.testing.assert_close(backbone(x).pool5, reference(x), rtol=0, atol=0)


def test_levels_are_the_torchvision_stages():
    backbone = ResNetBackbone("resnet18").eval()
    x = torch.randn(2, 3, 96, 96)
    out = backbone(x, levels=("conv4", "conv5"))
    h = backbone.maxpool(backbone.relu(backbone.bn1(backbone.conv1(x))))
    h = backbone.layer2(backbone.layer1(h))
    conv4 = backbone.layer3(h)
    torch.testing.assert_close(out.maps["conv4"], conv4, rtol=0, atol=0)
    torch.testing.assert_close(out.maps["conv5"], backbone.layer4(conv4), rtol=0, atol=0)
    torch.testing.assert_close(out.pool5, backbone.layer4(conv4).mean(dim=(2, 3)))
    assert backbone.level_channels == {"conv2": 64, "conv3": 128, "conv4": 256, "conv5": 512}
    assert ResNetBackbone("resnet50").level_channels["conv4"] == 1024
    assert ResNetBackbone("resnet50").num_features == 2048


@pytest.mark.parametrize("stem", ["torchvision", "no_maxpool", "cifar"])
@pytest.mark.parametrize("size", [32, 33, 40, 64, 95, 96, 160])
def test_feature_map_size_matches_a_forward_pass(stem, size):
    backbone = ResNetBackbone("resnet18", stem=stem).eval()
    with torch.no_grad():
        maps = backbone(torch.zeros(1, 3, size, size), levels=tuple(LEVEL_TO_STAGE)).maps
    for level, fmap in maps.items():
        assert fmap.shape[-1] == fmap.shape[-2] == feature_map_size(size, level, stem), (level, size, stem)


def test_known_map_sizes():
    # Paper setting: 224 px teacher view -> conv4 14x14, conv5 7x7 (official notes 2.2).
    assert feature_map_size(224, "conv4") == 14 and feature_map_size(224, "conv5") == 7
    # The warnings: 96 px with stride 32 gives 3x3 conv5; CIFAR stem at 32 px gives 4x4.
    assert feature_map_size(96, "conv5") == 3
    assert feature_map_size(32, "conv5", "cifar") == 4
    assert feature_map_size(96, "conv5", "no_maxpool") == 6


def test_cifar_stem():
    backbone = ResNetBackbone("resnet18", stem="cifar")
    assert backbone.conv1.weight.shape == (64, 3, 3, 3) and backbone.conv1.stride == (1, 1)
    assert isinstance(backbone.maxpool, torch.nn.Identity)


def test_bad_arguments_name_the_parameter():
    with pytest.raises(ValueError, match="arch='resnet9'"):
        ResNetBackbone("resnet9")
    with pytest.raises(ValueError, match="stem="):
        ResNetBackbone("resnet18", stem="tiny")
    with pytest.raises(ValueError, match="level='conv6'"):
        ResNetBackbone("resnet18")(torch.zeros(1, 3, 32, 32), levels=("conv6",))
