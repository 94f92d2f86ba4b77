"""CutMix: the box, the paste, the mixing weights and targets, and an OBoW step with cutmix on."""

import math

import numpy as np
import pytest
import torch

from obow.bow.loss import bow_loss
from obow.config import ModelConfig
from obow.data.cutmix import (
    Box,
    clip_box,
    cutmix,
    cutmix_masked,
    draw_box,
    draw_cutmix,
    draw_permutation,
    mix_targets,
)
from obow.methods.obow import OBoW

from reference import kl_loss as ref_kl_loss
from reference import np64

TINY = dict(arch="resnet18", stem="cifar", num_words=16, kappa=5.0, delta_base=0.1, levels=("conv4",))


def test_box_is_pasted_from_the_permuted_image_and_nothing_else_changes():
    images = torch.randn(4, 3, 16, 16)
    box = clip_box(center_y=5, center_x=6, cut_h=6, cut_w=8, height=16, width=16)
    assert (box.top, box.bottom, box.left, box.right) == (2, 8, 2, 10)
    perm = torch.tensor([2, 0, 3, 1])
    mixed, weights = cutmix(images, box, perm)
    inside = np.zeros((16, 16), dtype=bool)
    inside[2:8, 2:10] = True
    for i in range(4):
        src = int(perm[i])
        np.testing.assert_array_equal(mixed[i].numpy()[:, inside], images[src].numpy()[:, inside])
        np.testing.assert_array_equal(mixed[i].numpy()[:, ~inside], images[i].numpy()[:, ~inside])
    np.testing.assert_array_equal(weights.numpy(), np.full(4, 1 - 48 / 256, dtype=np.float32))
    assert images.shape == mixed.shape and not torch.equal(images, mixed)


def test_view_groups_take_every_view_from_the_same_image():
    views = torch.randn(3, 2, 3, 8, 8)  # [B, n, 3, h, w]
    box = clip_box(4, 4, 4, 4, 8, 8)
    perm = torch.tensor([1, 2, 0])
    mixed, weights = cutmix(views, box, perm)
    assert weights.shape == (3, 2) and torch.all(weights == 1 - 16 / 64)
    for i in range(3):
        for j in range(2):
            assert torch.equal(mixed[i, j, :, 2:6, 2:6], views[int(perm[i]), j, :, 2:6, 2:6])
            outside = views[i, j].clone()
            outside[:, 2:6, 2:6] = mixed[i, j, :, 2:6, 2:6]
            assert torch.equal(mixed[i, j], outside)


@pytest.mark.parametrize(
    ("box", "inside"),
    [((2, 8, 2, 10), (slice(2, 8), slice(2, 10))), ((0, 16, 5, 6), (slice(0, 16), slice(5, 6))), ((3, 3, 0, 16), None)],
    ids=["inner", "full_height_one_column", "empty"],
)
def test_masked_paste_is_the_sliced_one(box, inside):
    """The compiled step's paste (box as a tensor, through a mask) against a hand-built one: the box's pixels of
    the permuted image, the rest untouched, and the weight given."""
    views = torch.randn(4, 2, 3, 16, 16)
    perm = torch.tensor([3, 2, 0, 1])
    weight = torch.tensor(0.8125, dtype=torch.float64)
    mixed, weights = cutmix_masked(views, torch.tensor(box), weight, perm)
    expected = views.clone()
    if inside is not None:
        expected[..., inside[0], inside[1]] = views[perm][..., inside[0], inside[1]]
    assert torch.equal(mixed, expected)
    assert weights.shape == (4, 2) and weights.dtype == torch.float32 and torch.all(weights == 0.8125)
    top, bottom, left, right = box
    sliced, _ = cutmix(views, Box(top, bottom, left, right, 16, 16), perm)
    assert torch.equal(mixed, sliced)


def test_draw_cutmix_draws_what_the_group_by_group_draws_did():
    """One box then one permutation per group, in group order, from the generator given: the numbers draw_box and
    draw_permutation draw one group after another; the weights are the boxes' (float64, as the host computes)."""
    shapes = [(6, 16, 16), (6, 8, 12)]
    draws = draw_cutmix(shapes, torch.Generator().manual_seed(11))
    replay = torch.Generator().manual_seed(11)
    for g, (batch, h, w) in enumerate(shapes):
        box = draw_box(h, w, replay)
        perm = draw_permutation(batch, replay)
        assert draws.boxes[g].tolist() == [box.top, box.bottom, box.left, box.right]
        assert float(draws.weights[g]) == box.weight and draws.weights.dtype == torch.float64
        assert torch.equal(draws.perms[g], perm)


def test_box_is_clipped_and_its_weight_is_the_clipped_area():
    box = clip_box(center_y=0, center_x=15, cut_h=6, cut_w=8, height=16, width=20)
    assert (box.top, box.bottom, box.left, box.right) == (0, 3, 11, 19)
    corner = clip_box(center_y=15, center_x=19, cut_h=10, cut_w=10, height=16, width=20)
    assert (corner.top, corner.bottom, corner.left, corner.right) == (10, 16, 14, 20)
    assert corner.area == 36 and corner.weight == 1 - 36 / 320
    assert clip_box(3, 3, 0, 0, 8, 8).weight == 1.0  # lam = 1: an empty box leaves the image alone


def test_draw_box_follows_the_cutmix_recipe():
    g, replay = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    for _ in range(50):
        box = draw_box(12, 20, g)
        lam = float(torch.rand((), generator=replay))
        cy, cx = int(torch.randint(12, (), generator=replay)), int(torch.randint(20, (), generator=replay))
        ch, cw = int(12 * math.sqrt(1 - lam)), int(20 * math.sqrt(1 - lam))
        top, left = cy - ch // 2, cx - cw // 2
        expected = (max(top, 0), min(top + ch, 12), max(left, 0), min(left + cw, 20))
        assert (box.top, box.bottom, box.left, box.right) == expected
        assert 0 <= box.top <= box.bottom <= 12 and 0 <= box.left <= box.right <= 20
        assert box.weight == pytest.approx(1 - (expected[1] - expected[0]) * (expected[3] - expected[2]) / 240)
    perm = draw_permutation(6, torch.Generator().manual_seed(1))
    assert sorted(perm.tolist()) == list(range(6))


def test_mixed_targets_sum_to_one_and_match_the_hand_computation():
    targets = torch.softmax(torch.randn(4, 10), dim=-1)
    perm = torch.tensor([3, 2, 1, 0])
    w = torch.tensor([[0.75, 0.75], [0.5, 0.5], [1.0, 1.0], [0.2, 0.2]])
    mixed = mix_targets(targets, perm, w)
    assert mixed.shape == (4, 2, 10)
    y = np64(targets)
    for i in range(4):
        for j in range(2):
            wij = float(w[i, j])
            np.testing.assert_allclose(np64(mixed[i, j]), wij * y[i] + (1 - wij) * y[int(perm[i])], rtol=1e-6)
    np.testing.assert_allclose(np64(mixed.sum(-1)), np.ones((4, 2)), rtol=1e-6)
    flat = mix_targets(targets, perm, w[:, 0])
    assert flat.shape == (4, 10) and torch.allclose(flat, mixed[:, 0])


def test_bow_loss_takes_per_view_targets():
    logits = torch.randn(3, 2, 10) * 3
    per_view = torch.softmax(torch.randn(3, 2, 10) * 2, dim=-1)
    expected = ref_kl_loss(np64(logits).reshape(6, 10), np64(per_view).reshape(6, 10))
    np.testing.assert_allclose(float(bow_loss(logits, per_view)), expected, rtol=1e-5)
    shared = torch.softmax(torch.randn(3, 10), dim=-1)
    assert torch.allclose(bow_loss(logits, shared), bow_loss(logits, shared.unsqueeze(1).expand(3, 2, 10)))
    with pytest.raises(ValueError, match="targets must be"):
        bow_loss(logits, torch.softmax(torch.randn(3, 4, 10), dim=-1))


def _tiny(cutmix):
    return OBoW.from_config(ModelConfig(**TINY, cutmix=cutmix), total_iterations=10)


def test_obow_step_with_cutmix_equals_a_recomputation_with_mixed_targets():
    torch.manual_seed(0)
    model = _tiny(cutmix=True).train()
    plain = _tiny(cutmix=False).train()
    plain.load_state_dict(model.state_dict())
    teacher = torch.randn(4, 3, 40, 40)
    views = [torch.randn(4, 2, 3, 24, 24), torch.randn(4, 3, 3, 16, 16)]
    vocab = {lvl: model.extractors[lvl].vocabulary.words.clone() for lvl in model.levels}
    model.cutmix_generator = torch.Generator().manual_seed(3)
    out = model(teacher, views)
    assert torch.isfinite(out.loss)

    replay = torch.Generator().manual_seed(3)
    with torch.no_grad():
        weights = model.predictor.weights([vocab[lvl] for lvl in model.levels])
        expected = 0.0
        for g, v in enumerate(views):
            b, n = v.shape[:2]
            box = draw_box(v.shape[-2], v.shape[-1], replay)
            perm = draw_permutation(b, replay)
            assert float(out.metrics[f"cutmix/group{g}/weight"]) == pytest.approx(box.weight)
            mixed = v.clone()
            mixed[..., box.top : box.bottom, box.left : box.right] = v[perm][
                ..., box.top : box.bottom, box.left : box.right
            ]
            logits = model.predictor(model.student(mixed.flatten(0, 1)).pool5, weights)
            levels = []
            for lvl, z in zip(model.levels, logits, strict=True):
                y = np64(out.targets[lvl])
                ym = box.weight * y + (1 - box.weight) * y[perm.numpy()]  # by hand, one target per image
                levels.append(ref_kl_loss(np64(z), np.repeat(ym, n, axis=0)))
            expected += np.mean(levels)
    np.testing.assert_allclose(float(out.loss.detach()), expected, rtol=1e-4)

    # the same step group by group draws the same boxes in the same order
    again = _tiny(cutmix=True).train()
    again.load_state_dict(plain.state_dict())
    again.cutmix_generator = torch.Generator().manual_seed(3)
    total = sum(float(again(teacher, views, group=g).loss.detach()) for g in range(2))
    np.testing.assert_allclose(total, float(out.loss.detach()), rtol=1e-5)

    without = plain(teacher, views)
    assert torch.isfinite(without.loss) and abs(float(without.loss.detach()) - float(out.loss.detach())) > 1e-4


def test_cutmix_is_off_in_eval_mode():
    model = _tiny(cutmix=True).eval()
    model.cutmix_generator = torch.Generator().manual_seed(0)
    state = model.cutmix_generator.get_state()
    out = model(torch.randn(2, 3, 40, 40), [torch.randn(2, 1, 3, 16, 16)])
    assert torch.equal(model.cutmix_generator.get_state(), state)
    assert not any(k.startswith("cutmix/") for k in out.metrics)


def test_box_must_fit_the_images():
    with pytest.raises(ValueError, match="drawn for 8x8"):
        cutmix(torch.randn(2, 3, 16, 16), Box(0, 2, 0, 2, 8, 8), torch.tensor([1, 0]))
