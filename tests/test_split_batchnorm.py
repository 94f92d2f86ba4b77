"""Split batch norm (MoCo's single-device simulation of several GPUs): forward and backward against a float64
NumPy reference, the running statistics against a hand computation, evaluation mode, and the module swap."""

import copy

import numpy as np
import pytest
import torch
from torch import nn

from obow.methods.split_batchnorm import SplitBatchNorm2d, convert_split_batchnorm, split_batch_norm

EPS = 1e-5


def numpy_split_bn(x, w, b, splits, eps=EPS):
    """Float64 reference: each contiguous sub-batch normalised with its own mean and biased variance."""
    out, stats = [], []
    for part in np.split(x, splits, axis=0):
        mean = part.mean(axis=(0, 2, 3))
        var = part.var(axis=(0, 2, 3))  # biased, for normalising
        count = part.shape[0] * part.shape[2] * part.shape[3]
        xhat = (part - mean[None, :, None, None]) / np.sqrt(var + eps)[None, :, None, None]
        out.append(xhat * w[None, :, None, None] + b[None, :, None, None])
        stats.append((mean, var * count / (count - 1), xhat, var))
    return np.concatenate(out), stats


def numpy_split_bn_backward(dy, w, stats, splits, eps=EPS):
    """The batch-norm gradient by hand, per sub-batch: dx = invstd / M (M dxhat - sum dxhat - xhat sum dxhat xhat)."""
    dxs = []
    dw, db = np.zeros_like(w), np.zeros_like(w)
    for part, (_, _, xhat, var) in zip(np.split(dy, splits, axis=0), stats, strict=True):
        count = part.shape[0] * part.shape[2] * part.shape[3]
        dxhat = part * w[None, :, None, None]
        s1 = dxhat.sum(axis=(0, 2, 3))[None, :, None, None]
        s2 = (dxhat * xhat).sum(axis=(0, 2, 3))[None, :, None, None]
        invstd = 1 / np.sqrt(var + eps)[None, :, None, None]
        dxs.append(invstd / count * (count * dxhat - s1 - xhat * s2))
        dw += (part * xhat).sum(axis=(0, 2, 3))
        db += part.sum(axis=(0, 2, 3))
    return np.concatenate(dxs), dw, db


def sample(n=12, c=3, h=4, w=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    # sub-batches with different means and scales, so that one statistic for all would be visibly wrong
    x = torch.randn(n, c, h, w, generator=g, dtype=torch.float64)
    x = x * torch.arange(1, n + 1, dtype=torch.float64).view(n, 1, 1, 1) + torch.arange(n).view(n, 1, 1, 1)
    return x


@pytest.mark.parametrize("splits", [1, 2, 3, 4])
def test_forward_and_backward_match_a_float64_reference(splits):
    x = sample().requires_grad_()
    bn = SplitBatchNorm2d(3, splits).double()
    with torch.no_grad():
        bn.weight.copy_(torch.tensor([0.5, 2.0, -1.0]))
        bn.bias.copy_(torch.tensor([0.1, -0.3, 0.7]))
    y = bn(x)
    w, b = bn.weight.detach().numpy(), bn.bias.detach().numpy()
    ref, stats = numpy_split_bn(x.detach().numpy(), w, b, splits)
    np.testing.assert_allclose(y.detach().numpy(), ref, rtol=1e-10, atol=1e-10)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y.backward(dy)
    dx, dw, db = numpy_split_bn_backward(dy.numpy(), w, stats, splits)
    np.testing.assert_allclose(x.grad.numpy(), dx, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(bn.weight.grad.numpy(), dw, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(bn.bias.grad.numpy(), db, rtol=1e-10, atol=1e-10)
    if splits > 1:  # one statistic for the whole batch gives other values
        whole, _ = numpy_split_bn(x.detach().numpy(), w, b, 1)
        assert np.abs(whole - ref).max() > 0.1


def test_a_sub_batch_output_depends_on_its_own_rows_only():
    bn = SplitBatchNorm2d(3, 3).double()
    x = sample()
    y = bn(x)
    changed = x.clone()
    changed[5] = 10 * changed[5] + 3  # one image of the second of three sub-batches of 4
    z = bn(changed)
    torch.testing.assert_close(z[:4], y[:4], rtol=0, atol=0)
    torch.testing.assert_close(z[8:], y[8:], rtol=0, atol=0)
    assert not torch.allclose(z[4:8], y[4:8])


@pytest.mark.parametrize("momentum", [0.1, None])
def test_running_statistics_are_the_mean_over_sub_batches_of_each_update(momentum):
    splits, x = 3, sample(seed=2)
    bn = SplitBatchNorm2d(3, splits, momentum=momentum).double()
    start_mean, start_var = np.array([0.5, -1.0, 2.0]), np.array([1.5, 0.2, 3.0])
    with torch.no_grad():
        bn.running_mean.copy_(torch.from_numpy(start_mean))
        bn.running_var.copy_(torch.from_numpy(start_var))
        bn.num_batches_tracked.fill_(3)  # the cumulative average (momentum None) then weighs this batch 1/4
    bn(x)
    m = 0.1 if momentum is not None else 1 / 4
    _, stats = numpy_split_bn(x.numpy(), np.ones(3), np.zeros(3), splits)
    mean = np.mean([(1 - m) * start_mean + m * s[0] for s in stats], axis=0)
    var = np.mean([(1 - m) * start_var + m * s[1] for s in stats], axis=0)  # s[1]: unbiased, as BatchNorm2d's
    np.testing.assert_allclose(bn.running_mean.numpy(), mean, rtol=1e-12)
    np.testing.assert_allclose(bn.running_var.numpy(), var, rtol=1e-12)
    assert int(bn.num_batches_tracked) == 4


def test_evaluation_mode_is_plain_batch_norm_and_one_split_is_batch_norm_itself():
    torch.manual_seed(0)
    plain = nn.BatchNorm2d(3).double()
    plain(sample(seed=3))  # running statistics that are not the initial ones
    split = convert_split_batchnorm(copy.deepcopy(plain), 4)
    x = sample(seed=4)
    torch.testing.assert_close(split.eval()(x), plain.eval()(x), rtol=0, atol=0)
    assert convert_split_batchnorm(plain, 1) is plain  # nothing swapped: plain batch norm, bit for bit
    # no running statistics kept: batch statistics in evaluation mode too, split as in training
    untracked = SplitBatchNorm2d(3, 2, track_running_stats=False).double().eval()
    ref, _ = numpy_split_bn(x.numpy(), np.ones(3), np.zeros(3), 2)
    np.testing.assert_allclose(untracked(x).detach().numpy(), ref, rtol=1e-10, atol=1e-10)


def test_channels_last_gives_the_same_values():
    bn = SplitBatchNorm2d(3, 2)
    x = sample().float()
    torch.testing.assert_close(bn(x.to(memory_format=torch.channels_last)), bn(x), rtol=1e-6, atol=1e-6)


def test_a_batch_that_does_not_divide_is_one_clear_error():
    with pytest.raises(ValueError, match="a batch of 10 does not divide into 4 equal sub-batches"):
        SplitBatchNorm2d(3, 4)(torch.randn(10, 3, 2, 2))
    with pytest.raises(ValueError, match="positive integer"):
        SplitBatchNorm2d(3, 0)
    with pytest.raises(ValueError, match="positive integer"):
        split_batch_norm(torch.randn(4, 3, 2, 2), 0, None, None, None, None, 0.1, EPS)


def test_convert_swaps_every_batch_norm_and_keeps_the_state_dict():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Sequential(nn.ReLU(), nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4))
    )
    model(torch.randn(6, 3, 5, 5))  # running statistics and num_batches_tracked away from their start
    before = {k: v.clone() for k, v in model.state_dict().items()}
    converted = convert_split_batchnorm(model, 2)
    assert converted is model
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert len(norms) == 2 and all(type(m) is SplitBatchNorm2d and m.splits == 2 for m in norms)
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], v) for k, v in before.items())
    # a plain model's checkpoint loads into the converted one and the other way round
    plain = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Sequential(nn.ReLU(), nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4))
    )
    plain.load_state_dict(after)
    model.load_state_dict(plain.state_dict())
    # a batch norm as the root is returned as a new module; other kinds are refused
    assert type(convert_split_batchnorm(nn.BatchNorm2d(3), 2)) is SplitBatchNorm2d
    with pytest.raises(ValueError, match="BatchNorm1d cannot be split"):
        convert_split_batchnorm(nn.Sequential(nn.BatchNorm1d(3)), 2)
