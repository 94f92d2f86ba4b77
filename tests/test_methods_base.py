"""The method contract (obow.methods.base): the shared EMA update, the group-by-group bookkeeping, and every
registered method built from a tiny recipe and held to the contract."""

import copy
import math

import numpy as np
import pytest
import torch
from torch import nn

from obow.config import load_config, to_dict
from obow.config.choices import METHODS
from obow.methods import build_method
from obow.methods.base import GroupedStep, Method, StepOutput, check_views, ema_update_, group_weight
from obow.weights.checkpoint import build_checkpoint, save_atomic

from reference import np64

# ---------------------------------------------------------------------------------------------------- EMA


def test_ema_update_matches_a_float64_numpy_reference():
    shapes = [(3, 4), (5,), (2, 1, 3)]
    averages = [torch.randn(s, dtype=torch.float64) for s in shapes]
    sources = [nn.Parameter(torch.randn(s, dtype=torch.float64)) for s in shapes]  # gradients must not flow
    before, source_values = [np64(a).copy() for a in averages], [np64(s).copy() for s in sources]
    ema_update_(averages, sources, 0.9)
    for a, a0, s in zip(averages, before, source_values, strict=True):
        np.testing.assert_allclose(np64(a), 0.9 * a0 + 0.1 * s, rtol=1e-14, atol=1e-15)
        assert a.grad_fn is None
    for s, s0 in zip(sources, source_values, strict=True):
        np.testing.assert_array_equal(np64(s), s0)  # the sources are read, never written


def test_ema_update_at_momentum_zero_copies_and_at_one_changes_nothing():
    averages, sources = [torch.randn(4, 2)], [torch.randn(4, 2)]
    frozen = averages[0].clone()
    ema_update_(averages, sources, 1.0)
    assert torch.equal(averages[0], frozen)
    ema_update_(averages, sources, 0.0)
    assert torch.equal(averages[0], sources[0])


def test_ema_update_takes_empty_lists_and_refuses_unpaired_ones():
    ema_update_([], [], 0.5)  # a parameter-free network has nothing to average
    with pytest.raises(ValueError, match="2 averages for 1 sources"):
        ema_update_([torch.zeros(1), torch.zeros(1)], [torch.ones(1)], 0.5)
    with pytest.raises(ValueError, match="1 averages for 0 sources"):
        ema_update_([torch.zeros(1)], [], 1.0)  # refused even when the momentum would make it a no-op


# ---------------------------------------------------------------------------------------------------- views


def test_check_views_adds_the_view_axis_and_refuses_other_batches():
    teacher = torch.zeros(2, 3, 8, 8)
    groups = check_views(teacher, [torch.zeros(2, 3, 4, 4), torch.zeros(2, 5, 3, 2, 2)])
    assert [tuple(g.shape) for g in groups] == [(2, 1, 3, 4, 4), (2, 5, 3, 2, 2)]
    with pytest.raises(ValueError, match="at least one group"):
        check_views(teacher, [])
    with pytest.raises(ValueError, match=r"student_views\[1\] .* B=2"):
        check_views(teacher, [torch.zeros(2, 3, 4, 4), torch.zeros(3, 1, 3, 4, 4)])
    # one tensor given for the list: iterated, its images would be taken for groups
    with pytest.raises(
        ValueError, match=r"a list of view groups, e\.g\. \[crops\] .* one tensor of shape \(2, 5, 3, 2, 2\)"
    ):
        check_views(teacher, torch.zeros(2, 5, 3, 2, 2))
    # pixels as read from files (torchvision.io.read_image): torch's own error would be "expected scalar type Byte"
    with pytest.raises(ValueError, match=r"teacher_images must hold float images.* got torch\.uint8"):
        check_views(teacher.to(torch.uint8), [torch.zeros(2, 3, 4, 4)])
    with pytest.raises(ValueError, match=r"student_views\[1\] must hold float images.* got torch\.uint8"):
        check_views(teacher, [torch.zeros(2, 3, 4, 4), torch.zeros(2, 3, 4, 4, dtype=torch.uint8)])
    check_views(teacher.bfloat16(), [torch.zeros(2, 3, 4, 4, dtype=torch.float16)])  # any float type


def test_group_weight_sums_group_means_or_averages_views():
    groups = [torch.zeros(1, 2, 3, 4, 4), torch.zeros(1, 6, 3, 2, 2)]
    assert group_weight(2, groups, "group_sum") == 1.0
    assert group_weight(2, groups, "view_mean") == 2 / 8 and group_weight(6, groups, "view_mean") == 6 / 8


# ---------------------------------------------------------------------------------------------------- groups


def counting_shared_side():
    calls = []

    def shared_side():
        calls.append(len(calls))
        return {"call": len(calls)}

    return shared_side, calls


def test_grouped_step_computes_the_shared_side_once_and_forgets_it_after_the_last_group():
    method, (shared_side, calls) = Method(), counting_shared_side()
    steps = [method.grouped_step(g, 3, shared_side) for g in range(3)]
    assert calls == [0]
    assert all(s.state is steps[0].state for s in steps)
    assert [(s.groups, s.first, s.last) for s in steps] == [([0], True, False), ([1], False, False), ([2], False, True)]
    with pytest.raises(RuntimeError, match="group=0 before the other groups"):
        method.grouped_step(1, 3, shared_side)  # the step ended: a new one starts at group 0
    assert calls == [0]


def test_grouped_step_whole_and_single_group_steps_start_and_end_at_once():
    method, (shared_side, calls) = Method(), counting_shared_side()
    assert method.grouped_step(None, 3, shared_side) == GroupedStep({"call": 1}, [0, 1, 2], True, True)
    assert method.grouped_step(0, 1, shared_side) == GroupedStep({"call": 2}, [0], True, True)
    method.grouped_step(0, 2, shared_side)
    method.grouped_step(None, 2, shared_side)  # a whole step abandons the half-done one
    with pytest.raises(RuntimeError, match="group=0"):
        method.grouped_step(1, 2, shared_side)
    assert calls == [0, 1, 2, 3]


def test_grouped_step_refuses_groups_out_of_range_before_computing_anything():
    method, (shared_side, calls) = Method(), counting_shared_side()
    for group in (-1, 2, 7):
        with pytest.raises(ValueError, match=f"group={group} is out of range for 2 view groups"):
            method.grouped_step(group, 2, shared_side)
    assert calls == []


# ---------------------------------------------------------------------------------------------------- registry

# A narrow ResNet-18 (timm), so that float64 steps on the CPU take a moment.
TINY = ["model.arch=timm:resnet18", "model.arch_options={channels: [8, 16, 32, 64], stem_width: 8}",
        "model.stem=cifar", "model.levels=[conv4]", "model.num_words=16", "model.kappa=5.0", "data.batch_size=4",
        "moco.queue_size=16", "views.crop_size=16", "views.teacher_size=24"]  # fmt: skip


@pytest.fixture(scope="module")
def rotnet_checkpoint(tmp_path_factory):
    """A RotNet checkpoint as BoWNet's static teacher (its weights do not matter here)."""
    cfg = load_config(overrides=[*TINY, "model.method=rotnet"])
    path = tmp_path_factory.mktemp("teacher") / "rotnet.pt"
    save_atomic(build_checkpoint(to_dict(cfg), build_method(cfg, 1).state_dict(), epoch=1, iteration=1), path)
    return path


def tiny_method(method, teacher_path):
    extra = [f"model.method={method}"]
    if method == "bownet":
        extra += [f"bownet.teacher={teacher_path}", "model.assignment=hard", "model.head=fixed"]
    model = build_method(load_config(overrides=[*TINY, *extra]), total_iterations=10)
    if method == "bownet":  # the k-means of prepare() needs images; any words will do for the contract
        channels = model.extractors["conv4"].vocabulary.words.shape[1]
        model.set_vocabularies({"conv4": torch.rand(16, channels)})
    return model.train()


def tiny_batch(dtype=torch.float32):
    teacher = torch.randn(4, 3, 24, 24, dtype=dtype)
    return teacher, [torch.randn(4, 2, 3, 16, 16, dtype=dtype), torch.randn(4, 3, 3, 8, 8, dtype=dtype)]


@pytest.mark.parametrize("method", METHODS)
def test_every_method_keeps_the_contract(method, rotnet_checkpoint):
    model = tiny_method(method, rotnet_checkpoint)
    assert isinstance(model, Method)
    assert isinstance(model.student, nn.Module) and model.student in model.children()
    if method == "rotnet":
        assert model.teacher is None
    else:  # a submodule, so that it is saved, moved and restored with the method
        assert isinstance(model.teacher, nn.Module) and model.teacher in model.children()
        assert not any(p.requires_grad for p in model.teacher.parameters())
    out = model(*tiny_batch())
    assert isinstance(out, StepOutput)
    assert math.isfinite(float(out.metrics["loss"])) and float(out.metrics["loss"]) == float(out.loss.detach())
    out.loss.backward()
    assert all(p.grad is not None for p in model.student.parameters())


@pytest.mark.parametrize("method", [m for m in METHODS if m != "rotnet"])
def test_group_by_group_gradients_equal_the_whole_step(method, rotnet_checkpoint):
    torch.manual_seed(3)
    whole = tiny_method(method, rotnet_checkpoint).double()
    grouped = copy.deepcopy(whole)
    assert whole.supports_groups
    for step in range(2):  # the second step also checks that the first left no state behind
        teacher, views = tiny_batch(torch.float64)
        whole.zero_grad()
        grouped.zero_grad()
        torch.manual_seed(step)
        out = whole(teacher, views)
        out.loss.backward()
        torch.manual_seed(step)
        total = 0.0
        for g in range(len(views)):
            part = grouped(teacher, views, group=g)
            part.loss.backward()
            total += float(part.metrics["loss"])
        np.testing.assert_allclose(total, float(out.metrics["loss"]), rtol=1e-12)
        named = dict(grouped.named_parameters())
        compared = 0
        for name, p in whole.named_parameters():
            if p.grad is None:
                assert named[name].grad is None, name
                continue
            np.testing.assert_allclose(np64(named[name].grad), np64(p.grad), rtol=1e-9, atol=1e-12, err_msg=name)
            compared += 1
        assert compared > 0
        grouped_state = grouped.state_dict()
        for name, value in whole.state_dict().items():  # teacher, vocabularies, queue: one update a step
            torch.testing.assert_close(grouped_state[name], value, rtol=0, atol=0, msg=name)


def test_from_config_takes_what_each_method_reads(rotnet_checkpoint):
    """``OBoW.from_config`` takes the model section or the whole recipe (its model section: the same model); the
    baselines read more than the model section (MoCo's ``moco`` and ``data``), and given only it say so in one line
    instead of an AttributeError."""
    from obow import BoWNet, MoCoV2, OBoW, RotNet

    cfg = load_config(overrides=TINY)
    torch.manual_seed(0)
    whole = OBoW.from_config(cfg, total_iterations=10)
    torch.manual_seed(0)
    section = OBoW.from_config(cfg.model, total_iterations=10)
    assert whole.state_dict().keys() == section.state_dict().keys()
    pairs = zip(whole.state_dict().values(), section.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    for method in (MoCoV2, RotNet, BoWNet):
        with pytest.raises(TypeError, match=rf"^{method.__name__}\.from_config takes a whole recipe, load_config"):
            method.from_config(cfg.model, total_iterations=10)
