import math

import pytest
import torch

from obow.evaluate.linear import LINEAR_PRESETS, linear_head, lr_at_epoch, preset_settings, train_linear_probe

FAST = dict(epochs=5, lr=0.5, batch_size=250, weight_decay=0.0, schedule="cosine")


def gaussian_classes(n, num_classes=10, dim=64, noise=0.5, seed=0):
    """Class means shared by every seed (so train and test agree), noise drawn from ``seed``."""
    means = 2.0 * torch.randn(num_classes, dim, generator=torch.Generator().manual_seed(99))
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(num_classes, (n,), generator=g)
    return means[labels] + noise * torch.randn(n, dim, generator=g), labels


def test_separable_features_are_learned_with_one_and_two_views():
    train, train_labels = gaussian_classes(1000, seed=0)
    test, test_labels = gaussian_classes(500, seed=1)
    flipped = train + 0.1 * torch.randn(train.shape, generator=torch.Generator().manual_seed(2))
    one = train_linear_probe([train], train_labels, test, test_labels, **FAST)
    two = train_linear_probe([train, flipped], train_labels, test, test_labels, **FAST)
    assert one["top1"] >= 98 and two["top1"] >= 98
    assert two["top5"] == 100.0 and two["num_views"] == 2


def test_the_second_view_is_used():
    # view 0 is pure noise, view 1 carries the classes: only a probe that also trains on view 1 can learn
    train, labels = gaussian_classes(1000, seed=0)
    test, test_labels = gaussian_classes(500, seed=1)
    noise = torch.randn(train.shape, generator=torch.Generator().manual_seed(5))
    assert train_linear_probe([noise, train], labels, test, test_labels, **FAST)["top1"] >= 90
    assert train_linear_probe([noise], labels, test, test_labels, **FAST)["top1"] < 30


def test_random_labels_give_chance():
    g = torch.Generator().manual_seed(0)
    num_classes, n_test = 10, 2000
    train, test = torch.randn(2000, 64, generator=g), torch.randn(n_test, 64, generator=g)
    train_labels = torch.randint(num_classes, (2000,), generator=g)
    test_labels = torch.randint(num_classes, (n_test,), generator=g)
    acc = train_linear_probe([train], train_labels, test, test_labels, **FAST)["top1"]
    sd = 100 * math.sqrt(0.1 * 0.9 / n_test)
    assert abs(acc - 10.0) < 4 * sd


def test_step_schedule_of_the_resnet18_preset():
    p = LINEAR_PRESETS["resnet18"]
    lr = [lr_at_epoch(e, base_lr=p.lr, epochs=p.epochs, schedule="step", milestones=p.milestones) for e in range(50)]
    assert lr[0] == lr[14] == 10.0
    assert lr[15] == pytest.approx(1.0) and lr[29] == pytest.approx(1.0)
    assert lr[30] == pytest.approx(0.1) and lr[45] == pytest.approx(0.01) and lr[49] == pytest.approx(0.01)


def test_cosine_schedule():
    assert lr_at_epoch(0, base_lr=10.0, epochs=100, schedule="cosine") == 10.0
    assert lr_at_epoch(50, base_lr=10.0, epochs=100, schedule="cosine") == pytest.approx(5.0)
    assert lr_at_epoch(25, base_lr=10.0, epochs=100, schedule="cosine") == pytest.approx(5 * (1 + math.sqrt(0.5)))
    assert lr_at_epoch(99, base_lr=10.0, epochs=100, schedule="cosine") == pytest.approx(
        5 * (1 - math.cos(math.pi / 100))
    )


def test_training_applies_the_schedule_per_epoch():
    x, y = gaussian_classes(64, num_classes=3, dim=8)
    out = train_linear_probe(
        [x], y, x, y, epochs=6, lr=1.0, batch_size=32, weight_decay=0.0, schedule="step", milestones=(2, 4), gamma=0.1
    )
    assert out["lr_per_epoch"] == pytest.approx([1.0, 1.0, 0.1, 0.1, 0.01, 0.01])
    assert "top5" not in out  # fewer than 5 classes


def test_presets_hold_the_paper_numbers():
    assert preset_settings("resnet18") == dict(
        epochs=50,
        lr=10.0,
        batch_size=256,
        weight_decay=2e-6,
        momentum=0.9,
        schedule="step",
        milestones=(15, 30, 45),
        gamma=0.1,
    )
    r50 = LINEAR_PRESETS["resnet50"]
    assert (r50.epochs, r50.lr, r50.batch_size, r50.weight_decay, r50.momentum, r50.schedule) == (
        100,
        10.0,
        1024,
        0.0,
        0.9,
        "cosine",
    )


def test_head_initialisation():
    torch.manual_seed(0)
    head = linear_head(512, 1000)
    assert abs(head.weight.std().item() - 0.01) < 0.0005 and abs(head.weight.mean().item()) < 0.0005
    assert torch.count_nonzero(head.bias) == 0


def test_reproducible_from_the_seed():
    x, y = gaussian_classes(200, num_classes=4, dim=8, noise=3.0)
    runs = [train_linear_probe([x, -x], y, x, y, **FAST, seed=s)["train_loss"] for s in (0, 0, 1)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_bad_views_raise():
    x, y = gaussian_classes(10, num_classes=2, dim=4)
    with pytest.raises(ValueError, match="1 or 2 views"):
        train_linear_probe([x, x, x], y, x, y, **FAST)
    with pytest.raises(ValueError, match="list"):
        train_linear_probe(x, y, x, y, **FAST)


def test_batch_norm_makes_the_probe_indifferent_to_feature_scale():
    # The classes live in 64 dimensions of tiny scale (1e-3); 8 uninformative dimensions are huge and offset.
    # Plain SGD is dominated by the huge ones; the non-affine batch norm standardises every dimension, and its
    # test-time statistics (cumulative averages over the training batches) must match the features' own
    # tiny variance, or the test predictions fall apart although the training loss is near zero.
    train, train_labels = gaussian_classes(1000, seed=0)
    test, test_labels = gaussian_classes(500, seed=1)
    g = torch.Generator().manual_seed(3)

    def badly_scaled(x):
        return torch.cat([1e-3 * x, 1000 + 100 * torch.randn(x.shape[0], 8, generator=g)], dim=1)

    a, b = badly_scaled(train), badly_scaled(test)
    settings = dict(epochs=10, lr=0.1, batch_size=256, weight_decay=0.0, schedule="cosine")
    plain = train_linear_probe([a], train_labels, b, test_labels, **settings)
    normed = train_linear_probe([a], train_labels, b, test_labels, batch_norm=True, **settings)
    assert plain["top1"] < 30 and not plain["batch_norm"]
    assert normed["top1"] >= 98 and normed["batch_norm"]
