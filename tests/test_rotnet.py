"""RotNet: the four rotations, their labels, and the loss against a re-computation."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from obow.config import load_config
from obow.methods import build_method
from obow.methods.rotnet import RotNet, rotate_batch

from reference import log_softmax, np64


def test_four_rotations_of_an_asymmetric_image():
    image = torch.arange(9.0).view(1, 1, 3, 3)  # [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    rotated, labels = rotate_batch(image)
    expected = [
        [[0, 1, 2], [3, 4, 5], [6, 7, 8]],
        [[2, 5, 8], [1, 4, 7], [0, 3, 6]],  # 90 degrees counter-clockwise
        [[8, 7, 6], [5, 4, 3], [2, 1, 0]],
        [[6, 3, 0], [7, 4, 1], [8, 5, 2]],  # 270 degrees counter-clockwise = 90 clockwise
    ]
    np.testing.assert_array_equal(rotated[:, 0].numpy(), np.array(expected, dtype=np.float32))
    assert labels.tolist() == [0, 1, 2, 3]


def test_labels_are_rotation_major_and_channels_rotate_together():
    images = torch.randn(2, 3, 5, 5)
    rotated, labels = rotate_batch(images)
    assert labels.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    for r in range(4):
        for i in range(2):
            np.testing.assert_array_equal(rotated[r * 2 + i].numpy(), np.rot90(images[i].numpy(), r, axes=(1, 2)))


def test_non_square_images_are_refused():
    with pytest.raises(ValueError, match="square"):
        rotate_batch(torch.randn(2, 3, 8, 6))


def tiny_rotnet():
    cfg = load_config(overrides=["model.method=rotnet", "model.arch=resnet18", "model.stem=cifar"])
    model = build_method(cfg, total_iterations=5)
    assert isinstance(model, RotNet) and not model.supports_groups
    return model


def test_loss_equals_cross_entropy_of_the_rotated_crops():
    model = tiny_rotnet().train()
    teacher = torch.randn(2, 3, 16, 16)
    crops = torch.randn(2, 2, 3, 16, 16)
    out = model(teacher, [crops, torch.randn(2, 3, 3, 8, 8)])  # only the first group (the crops) is used
    flat = crops.flatten(0, 1)
    rotated = torch.cat(
        [flat, flat.transpose(-1, -2).flip(-2), flat.flip(-1).flip(-2), flat.transpose(-1, -2).flip(-1)]
    )
    labels = torch.arange(4).repeat_interleave(4)
    with torch.no_grad():
        logits = model.classifier(model.student(rotated).pool5)
    np.testing.assert_allclose(float(out.loss.detach()), float(F.cross_entropy(logits, labels)), rtol=1e-5)
    ref = -log_softmax(np64(logits))[np.arange(16), labels.numpy()].mean()
    np.testing.assert_allclose(float(out.loss.detach()), ref, rtol=1e-5)
    accuracy = (logits.argmax(1) == labels).float().mean()
    assert float(out.metrics["rotnet/accuracy"]) == pytest.approx(float(accuracy))
    assert {"loss", "student/effective_rank", "student/mean_cosine"} <= set(out.metrics)
    assert int(model.iteration) == 1
    out.loss.backward()
    assert model.classifier.weight.grad is not None and model.student.conv1.weight.grad is not None


def test_teacher_images_are_used_without_view_groups():
    model = tiny_rotnet().eval()
    teacher = torch.randn(2, 3, 16, 16)
    out = model(teacher, [])
    with torch.no_grad():
        rotated, labels = rotate_batch(teacher)
        expected = F.cross_entropy(model.classifier(model.student(rotated).pool5), labels)
    np.testing.assert_allclose(float(out.loss.detach()), float(expected), rtol=1e-5)
    assert int(model.iteration) == 0
