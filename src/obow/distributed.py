"""Thin wrappers over ``torch.distributed`` that fall back to the identity in a single process.

OBoW keeps every process's vocabulary identical: sampled words are gathered in rank order, the temperature
statistic and k-means statistics are averaged or summed, random choices are made on rank 0 and broadcast
(official notes 2.5). All of that goes through the functions here, so the single-process code path is the
same code.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def is_main_process() -> bool:
    return rank() == 0


class _AllReduceSum(torch.autograd.Function):
    """Sum over processes; its gradient is the sum over processes of the gradients (every process's loss
    depends on the sum)."""

    @staticmethod
    def forward(ctx, tensor: Tensor) -> Tensor:
        out = tensor.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        out = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out


class _AllGatherCat(torch.autograd.Function):
    """Concatenation in rank order; the gradient of a process's part is the sum over processes of the
    gradients of that part (summed with an all-reduce, which every backend has, then sliced)."""

    @staticmethod
    def forward(ctx, tensor: Tensor) -> Tensor:
        ctx.rows = tensor.shape[0]
        parts = [torch.empty_like(tensor, memory_format=torch.contiguous_format) for _ in range(world_size())]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        total = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        start = rank() * ctx.rows
        return total[start : start + ctx.rows]


def all_reduce_sum(tensor: Tensor) -> Tensor:
    """Sum of ``tensor`` over processes (a new tensor; the input is left as it is).

    Differentiable: the gradient reaching every process's input is the sum of all processes' gradients.
    """
    return _AllReduceSum.apply(tensor) if is_distributed() else tensor.clone()


def all_reduce_mean(tensor: Tensor) -> Tensor:
    """Mean of ``tensor`` over processes."""
    return all_reduce_sum(tensor) / world_size()


@torch.no_grad()
def all_reduce_max(tensor: Tensor) -> Tensor:
    """Element-wise maximum of ``tensor`` over processes."""
    if not is_distributed():
        return tensor.clone()
    out = tensor.clone()
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return out


def agree_any(flags: Sequence[bool], device: torch.device) -> list[bool]:
    """Each flag, true on every process when it is true on any one (one small all-reduce on ``device``, which
    must suit the backend: a CUDA device under NCCL)."""
    if not is_distributed():
        return list(flags)
    out = torch.tensor([float(f) for f in flags], device=device)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return [bool(v) for v in out.tolist()]


def all_gather_cat(tensor: Tensor) -> Tensor:
    """Concatenate ``tensor`` (same shape on every process) along dim 0, in rank order.

    Differentiable: each process's part receives the sum over processes of the gradients of that part.
    """
    return _AllGatherCat.apply(tensor) if is_distributed() else tensor


@torch.no_grad()
def broadcast_(tensor: Tensor, src: int = 0) -> Tensor:
    """Overwrite ``tensor`` in place with its value on process ``src``."""
    if is_distributed():
        dist.broadcast(tensor, src=src)
    return tensor


def ddp_without_buffer_sync(module: nn.Module, device_ids: list[int] | None = None) -> nn.Module:
    """``DistributedDataParallel`` that broadcasts buffers from rank 0 once, at construction, but not at every
    forward: OBoW keeps its buffers (vocabularies, statistics) identical on every process by itself, and
    re-sending them each step would only cost time (8192 x 3072 floats per step for ResNet-50)."""
    ddp = nn.parallel.DistributedDataParallel
    if "forward_sync_buffers" in inspect.signature(ddp.__init__).parameters:  # newer torch renamed the option
        return ddp(module, device_ids=device_ids, forward_sync_buffers=False)
    return ddp(module, device_ids=device_ids, broadcast_buffers=False)
