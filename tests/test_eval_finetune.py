from collections import Counter

import pytest
import torch

from obow.data.eval_sets import eval_dataset, views_from_dict
from obow.data.folders import ImageDataset, scan_images
from obow.evaluate.finetune import (
    FINETUNE_PRESETS,
    balanced_subset,
    finetune,
    finetune_optimizer,
    finetune_transform,
)
from obow.evaluate.linear import linear_head
from obow.weights.load import load_backbone

COLOURS = {"blue": (40, 60, 200), "red": (200, 50, 40)}


def test_balanced_subset_takes_the_fraction_of_every_class():
    labels = [0] * 100 + [1] * 50 + [2] * 7
    subset = balanced_subset(labels, 0.1, seed=0)
    assert Counter(labels[i] for i in subset) == {0: 10, 1: 5, 2: 1}  # round(0.7) = 1
    assert Counter(labels[i] for i in balanced_subset(labels, 0.01, seed=0)) == {0: 1, 1: 1, 2: 1}  # at least 1
    assert subset == sorted(set(subset))
    assert subset == balanced_subset(labels, 0.1, seed=0)
    assert subset != balanced_subset(labels, 0.1, seed=1)
    assert len(balanced_subset(labels, 1.0, seed=0)) == len(labels)


def test_balanced_subset_rejects_bad_fractions():
    for fraction in (0.0, 1.5):
        with pytest.raises(ValueError, match="fraction"):
            balanced_subset([0, 1], fraction)


def test_presets_hold_the_paper_numbers():
    one, ten = FINETUNE_PRESETS["1%"], FINETUNE_PRESETS["10%"]
    assert (one.fraction, one.epochs, one.milestones) == (0.01, 40, (24, 32))
    assert (ten.fraction, ten.epochs, ten.milestones) == (0.1, 20, (12, 16))
    for p in (one, ten):
        assert (p.head_lr, p.trunk_lr, p.gamma, p.weight_decay, p.batch_size) == (0.5, 0.0002, 0.2, 0.0, 256)


def test_optimizer_has_a_trunk_and_a_head_learning_rate():
    backbone, _ = load_backbone(random_init=True, arch="resnet18", stem="cifar")
    head = linear_head(backbone.num_features, 3)
    optimizer = finetune_optimizer(backbone, head, head_lr=0.5, trunk_lr=0.0002)
    trunk_group, head_group = optimizer.param_groups
    assert (trunk_group["name"], trunk_group["lr"]) == ("trunk", 0.0002)
    assert (head_group["name"], head_group["lr"]) == ("head", 0.5)
    assert {id(p) for p in trunk_group["params"]} == {id(p) for p in backbone.parameters()}
    assert {id(p) for p in head_group["params"]} == {id(p) for p in head.parameters()}


@pytest.fixture(scope="module")
def colour_data(tmp_path_factory, colour_folders):
    root = colour_folders(tmp_path_factory.mktemp("colours"), COLOURS, {"train": 20, "val": 10}, size=32, noise=30)
    views = views_from_dict(None, size=16)
    train = ImageDataset(scan_images(root / "train", labels="folders"), finetune_transform(views))
    return train, eval_dataset(root / "val", views)


def calibrate_batch_norm(backbone, dataset):
    """Running BN statistics of ``dataset`` (as a pretrained network has them for its data), so that the
    eval-mode test pass of a randomly initialised trunk is not dominated by its initial statistics."""
    for m in backbone.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.reset_running_stats()
            m.momentum = None  # cumulative average over the calibration pass
    with torch.no_grad():
        backbone.train()(torch.stack([dataset[i]["image"] for i in range(len(dataset))]))
    for m in backbone.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.momentum = 0.1


@pytest.mark.slow
def test_tiny_finetune_learns_and_decays_both_learning_rates(colour_data):
    train, test = colour_data
    backbone, _ = load_backbone(random_init=True, arch="resnet18", stem="cifar", seed=0)
    calibrate_batch_norm(backbone, test)
    before = backbone.conv1.weight.detach().clone()
    subset = balanced_subset(train.images.labels, 0.5, seed=0)
    result = finetune(
        backbone, train, test, subset, epochs=3, head_lr=0.02, trunk_lr=0.001, milestones=[2], batch_size=5, seed=0
    )
    assert result["top1"] >= 80  # chance is 50
    assert result["num_train"] == 20 and result["num_test"] == 20
    assert result["lr_head"] == pytest.approx([0.02, 0.02, 0.004])
    assert result["lr_trunk"] == pytest.approx([0.001, 0.001, 0.0002])
    assert not torch.equal(backbone.conv1.weight, before)  # the trunk is fine-tuned too


def test_zero_trunk_learning_rate_freezes_the_trunk_weights(colour_data):
    train, test = colour_data
    backbone, _ = load_backbone(random_init=True, arch="resnet18", stem="cifar", seed=0)
    before = {k: v.clone() for k, v in backbone.named_parameters()}
    finetune(
        backbone, train, test, list(range(0, 40, 4)), epochs=1, head_lr=0.5, trunk_lr=0.0, milestones=[], batch_size=5
    )
    assert all(torch.equal(before[k], v) for k, v in backbone.named_parameters())
