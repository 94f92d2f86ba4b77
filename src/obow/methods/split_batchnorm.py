"""Split batch norm: batch norm whose training-mode statistics come from sub-batches, to simulate several GPUs on one.

MoCo needs the key encoder's batch statistics to come from other images than its query's (otherwise the
pretext task is solved through them, :mod:`obow.methods.mocov2`); MoCo's authors got that from several GPUs,
each normalising its own share of a shuffled batch, and simulated it on one GPU by splitting batch norm into
sub-batches. This module is that simulation, for any backbone built of ``nn.BatchNorm2d``:

* :func:`split_batch_norm`: the training-mode maths on a tensor: the batch ``[N, C, H, W]`` is cut into
  ``splits`` contiguous sub-batches of ``N / splits`` rows (rows ``0 .. N/s - 1``, then the next ``N/s``, ...),
  each normalised with its own mean and biased variance; the running statistics become the mean over the
  sub-batches of what each sub-batch's update would leave (``(1 - m) * running + m * batch_stat``, the variance
  unbiased, as ``nn.BatchNorm2d`` updates them), as MoCo's single-GPU code leaves them;
* :class:`SplitBatchNorm2d`: an ``nn.BatchNorm2d`` (the same parameters, buffers and ``state_dict`` keys) that
  uses it in training mode and is plain batch norm in evaluation mode;
* :func:`convert_split_batchnorm`: swaps every ``nn.BatchNorm2d`` of a model for one, sharing its tensors.

MoCo's code reshapes ``[N, C, H, W]`` to ``[N / s, s * C, H, W]``, which makes sub-batch ``k`` the rows
``k, k + s, k + 2s, ...``; contiguous sub-batches are used here instead, so that the views of one image, which
the methods lay out image-major, share one sub-batch, and so that any memory format works (``channels_last``
cannot be reshaped that way without a copy).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def split_batch_norm(
    x: Tensor,
    splits: int,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    momentum: float,
    eps: float,
) -> Tensor:
    """Training-mode batch norm of ``x`` ``[N, C, ...]`` with statistics per contiguous sub-batch of ``N / splits``.

    Each sub-batch is normalised with its own mean and biased variance over its rows and spatial positions,
    then scaled by ``weight`` and shifted by ``bias``. ``running_mean`` and ``running_var`` (``None``: none
    kept) are updated in place to the mean over sub-batches of ``(1 - momentum) * running + momentum * stat``,
    ``stat`` the sub-batch's mean and unbiased variance. Gradients flow as through ``splits`` batch norms.
    """
    n = x.shape[0]
    if isinstance(splits, bool) or not isinstance(splits, int) or splits < 1:
        raise ValueError(f"splits must be a positive integer, got {splits!r}")
    if n % splits != 0:
        raise ValueError(f"split batch norm: a batch of {n} does not divide into {splits} equal sub-batches")
    if splits == 1:
        return F.batch_norm(x, running_mean, running_var, weight, bias, True, momentum, eps)
    if running_mean is None or running_var is None:
        parts = [F.batch_norm(part, None, None, weight, bias, True, momentum, eps) for part in x.chunk(splits)]
        return torch.cat(parts)
    # one row of running statistics per sub-batch, each updated by its own batch norm call
    means = running_mean.expand(splits, -1).clone()
    variances = running_var.expand(splits, -1).clone()
    parts = [
        F.batch_norm(part, mean, var, weight, bias, True, momentum, eps)
        for part, mean, var in zip(x.chunk(splits), means, variances, strict=True)
    ]
    with torch.no_grad():
        running_mean.copy_(means.mean(dim=0))
        running_var.copy_(variances.mean(dim=0))
    return torch.cat(parts)


class SplitBatchNorm2d(nn.BatchNorm2d):
    """``nn.BatchNorm2d`` whose batch statistics come from ``splits`` contiguous sub-batches (:func:`split_batch_norm`)
    wherever batch norm uses batch statistics (training mode, or no running statistics kept); evaluation mode with
    running statistics is plain batch norm. ``splits`` is not part of the ``state_dict``, whose keys are
    ``nn.BatchNorm2d``'s."""

    def __init__(self, num_features: int, splits: int = 1, **kwargs) -> None:
        super().__init__(num_features, **kwargs)
        if isinstance(splits, bool) or not isinstance(splits, int) or splits < 1:
            raise ValueError(f"splits must be a positive integer, got {splits!r}")
        self.splits = splits

    def forward(self, x: Tensor) -> Tensor:
        batch_stats = self.training or self.running_mean is None
        if self.splits == 1 or not batch_stats:
            return super().forward(x)
        self._check_input_dim(x)
        momentum = 0.0 if self.momentum is None else self.momentum
        update = self.training and self.track_running_stats
        if update:
            assert self.num_batches_tracked is not None  # kept with the running statistics (track_running_stats)
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # a cumulative average, as nn.BatchNorm2d's
                momentum = 1.0 / float(self.num_batches_tracked)
        return split_batch_norm(
            x,
            self.splits,
            self.running_mean if update else None,
            self.running_var if update else None,
            self.weight,
            self.bias,
            momentum,
            self.eps,
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, splits={self.splits}"


def convert_split_batchnorm(module: nn.Module, splits: int) -> nn.Module:
    """``module`` with every ``nn.BatchNorm2d`` replaced by a :class:`SplitBatchNorm2d` of ``splits`` sharing its
    parameters and buffers (so the ``state_dict`` is the same, keys and tensors); the module itself is changed in
    place and returned (a new one where ``module`` is itself a batch norm). ``splits=1`` returns it unchanged.

    Other batch norms (e.g. a subclass that also applies an activation, or ``SyncBatchNorm``) cannot be split
    faithfully and raise ``ValueError``."""
    if isinstance(splits, bool) or not isinstance(splits, int) or splits < 1:
        raise ValueError(f"splits must be a positive integer, got {splits!r}")
    if splits == 1:
        return module
    if isinstance(module, SplitBatchNorm2d):
        module.splits = splits
        return module
    if type(module) is nn.BatchNorm2d:
        split = SplitBatchNorm2d(
            module.num_features,
            splits,
            eps=module.eps,
            momentum=module.momentum,
            affine=module.affine,
            track_running_stats=module.track_running_stats,
        )
        split.weight, split.bias = module.weight, module.bias
        split.running_mean, split.running_var = module.running_mean, module.running_var
        split.num_batches_tracked = module.num_batches_tracked
        split.train(module.training)
        return split
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        raise ValueError(
            f"batch norm of type {type(module).__name__} cannot be split into sub-batches (only nn.BatchNorm2d): "
            "use a backbone built of nn.BatchNorm2d, or moco.bn_splits=1"
        )
    for name, child in module.named_children():
        new = convert_split_batchnorm(child, splits)
        if new is not child:
            setattr(module, name, new)
    return module
