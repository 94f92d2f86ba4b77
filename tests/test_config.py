import pytest

from obow.backbones import feature_map_size
from obow.config import (
    Config,
    ConfigError,
    ModelConfig,
    available_recipes,
    from_dict,
    load_config,
    parse_override,
    save_config,
    to_dict,
)

PAPER_R50 = "imagenet_resnet50_full"


def test_every_builtin_recipe_loads_and_keeps_bow_maps_of_at_least_3x3():
    names = available_recipes()
    assert {"imagenet_resnet50_full", "imagenet20_resnet18_full", "imagenet20_resnet18_vanilla"} <= set(names)
    assert {"imagenette_resnet18", "cifar10_resnet18", "demo"} <= set(names)
    for name, description in names.items():
        cfg = load_config(name)
        assert description, name
        for level in cfg.model.levels:
            side = feature_map_size(cfg.views.teacher_size, level, cfg.model.stem) - 2 * cfg.model.border
            assert side >= 3, (name, level, side)


def test_paper_recipes_hold_the_paper_numbers():
    r50 = load_config(PAPER_R50)
    assert (r50.model.arch, r50.model.levels, r50.model.num_words) == ("resnet50", ("conv4", "conv5"), 8192)
    assert r50.model.kappa == 8 and r50.model.delta_base == pytest.approx(1 / 15)
    assert (r50.optim.epochs, r50.data.batch_size, r50.optim.lr, r50.optim.warmup_epochs) == (200, 256, 0.03, 10)
    assert r50.optim.weight_decay == 1e-4 and r50.optim.end_lr == 3e-5
    assert (r50.views.num_crops, r50.views.crop_size, r50.views.num_patches, r50.views.patch_size) == (2, 160, 5, 96)
    assert r50.views.crop_scale == (0.08, 0.6) and r50.views.teacher_size == 224
    full = load_config("imagenet20_resnet18_full")
    vanilla = load_config("imagenet20_resnet18_vanilla")
    for cfg in (full, vanilla):
        assert cfg.model.kappa == 5 and cfg.model.delta_base == pytest.approx(0.1) and cfg.optim.epochs == 80
    assert full.model.levels == ("conv4", "conv5") and vanilla.model.levels == ("conv5",)
    assert (vanilla.views.num_crops, vanilla.views.num_patches) == (1, 0)
    assert full.data.images_per_class == 260


def test_overrides_and_fractions():
    cfg = load_config(
        PAPER_R50, ["model.num_words=4096", "optim.lr=0.05", "model.delta_base=1/10", "model.levels=[conv5]"]
    )
    assert cfg.model.num_words == 4096 and cfg.optim.lr == 0.05
    assert cfg.model.delta_base == pytest.approx(0.1) and cfg.model.levels == ("conv5",)
    assert parse_override("a.b.c=3") == {"a": {"b": {"c": 3}}}
    assert load_config(None).model == ModelConfig()
    # one override as a string (iterated, its characters were taken for overrides: "override 'm' must look like ...")
    assert load_config(PAPER_R50, "model.num_words=4096") == load_config(PAPER_R50, ["model.num_words=4096"])


def test_unknown_keys_and_bad_values_name_the_key_and_what_is_allowed():
    with pytest.raises(ConfigError, match=r"unknown key 'model.num_word'; allowed keys here: .*num_words"):
        load_config(PAPER_R50, ["model.num_word=10"])
    with pytest.raises(ConfigError, match=r"unknown key 'modle'"):
        load_config(PAPER_R50, ["modle.arch=resnet18"])
    with pytest.raises(ConfigError, match=r"model.num_words must be an integer"):
        load_config(PAPER_R50, ["model.num_words=many"])
    # every form a network can be named in, not only the torchvision ResNets (issue 39)
    with pytest.raises(
        ConfigError, match=r"model.arch='resnet9' is not understood: .*resnet18.*timm:<name>.*torchvision:<name>"
    ):
        load_config(PAPER_R50, ["model.arch=resnet9"])
    with pytest.raises(
        ConfigError, match=r"model.arch='resnet18d' is not understood: .*; did you mean timm:resnet18d\?$"
    ):
        load_config(PAPER_R50, ["model.arch=resnet18d"])
    with pytest.raises(ConfigError, match=r"model.assignment='fuzzy' is not allowed; choose one of 'soft', 'hard'"):
        load_config(PAPER_R50, ["model.assignment=fuzzy"])
    with pytest.raises(ConfigError, match=r"optim.lr must be > 0"):
        load_config(PAPER_R50, ["optim.lr=-1"])
    with pytest.raises(ConfigError, match=r"model.delta_base must be a number"):
        load_config(PAPER_R50, ["model.delta_base=1/0"])
    with pytest.raises(ConfigError, match=r"train.precision='fp8' is not allowed"):
        load_config(PAPER_R50, ["train.precision=fp8"])
    with pytest.raises(ConfigError, match=r"must look like section.key=value"):
        load_config(PAPER_R50, ["optim.lr"])
    with pytest.raises(ConfigError, match=r"override 'optim.lr=\[1,': cannot read the value \(while parsing") as bad:
        load_config(PAPER_R50, ["optim.lr=[1,"])
    assert "\n" not in str(bad.value)  # YAML's message spans three lines: one here
    # a path named in no UTF-8 (bytes read as surrogates), which YAML cannot read, is the string it is
    assert load_config(PAPER_R50, ["data.path=/data/caf\udce9"]).data.path == "/data/caf\udce9"
    with pytest.raises(ConfigError, match=r"unknown recipe 'nope'.*imagenet_resnet50_full"):
        load_config("nope")


def test_small_bow_maps_are_rejected_with_the_keys_to_change():
    # 96 px with the standard stem: conv5 is 3x3, 1x1 after border removal
    with pytest.raises(ConfigError, match=r"conv5 BoW map is 1x1 .*views.teacher_size=96.*model.stem='torchvision'"):
        load_config(PAPER_R50, ["views.teacher_size=96", "views.teacher_resize=110", "views.crop_size=68"])
    # CIFAR stem at 32 px: 4x4, 2x2 after border removal
    with pytest.raises(ConfigError, match=r"conv5 BoW map is 2x2"):
        load_config("cifar10_resnet18", ["views.teacher_size=32"])
    assert load_config("cifar10_resnet18", ["views.teacher_size=32", "model.levels=[conv4]"]).model.levels == ("conv4",)


def test_queue_size_must_be_a_multiple_of_the_batch():
    with pytest.raises(ConfigError, match=r"model.num_words \(8192\) must be a multiple of data.batch_size \(100\)"):
        load_config(PAPER_R50, ["data.batch_size=100"])
    assert load_config(PAPER_R50, ["data.batch_size=100", "model.vocabulary=kmeans"]).data.batch_size == 100


def test_view_rules():
    with pytest.raises(ConfigError, match="views.teacher_resize"):
        load_config(PAPER_R50, ["views.teacher_resize=200"])
    with pytest.raises(ConfigError, match="views.num_patches must be <= 9"):
        load_config(PAPER_R50, ["views.num_patches=10"])
    with pytest.raises(ConfigError, match="views.crop_scale"):
        load_config(PAPER_R50, ["views.crop_scale=[0.6, 0.08]"])
    with pytest.raises(ConfigError, match="views.patch_grid_size"):
        load_config(PAPER_R50, ["views.patch_grid_size=100"])


def test_recipe_files_with_base_and_round_trip(tmp_path):
    child = tmp_path / "mine.yaml"
    child.write_text("base: imagenet20_resnet18_full\nmodel:\n  num_words: 2048\n")
    cfg = load_config(child)
    assert cfg.model.num_words == 2048 and cfg.model.arch == "resnet18" and cfg.optim.epochs == 80
    saved = tmp_path / "saved.yaml"
    save_config(cfg, saved)
    assert load_config(saved) == cfg
    assert from_dict(Config, to_dict(cfg)) == cfg
    (tmp_path / "loop.yaml").write_text("base: loop.yaml\n")
    with pytest.raises(ConfigError, match="inherits from itself"):
        load_config(tmp_path / "loop.yaml")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
