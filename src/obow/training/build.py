"""The parts of a run, built from its settled recipe (:mod:`obow.training.run.settle`): the process and its device
(:func:`setup_process`), the data (:func:`build_data`: images, sampler and loader, with views made in loader
workers or on the training device, ``data.pipeline``), the method (:func:`build_model`), the optimiser
(:func:`build_optimizer`) and what each step calls (:func:`prepare_step_model`). :mod:`obow.training.loop` and
the benchmarks use the same builders."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from obow import distributed as D
from obow.config import Config
from obow.data.batched_views import compiled_render, graphed_render
from obow.data.cache import ImageCache, build_cache
from obow.data.device_loader import DeviceLoader
from obow.data.folders import EpochSampler, ImageDataset, ImageList, build_loader, scan_images, tiny_below
from obow.methods import build_batched_views, build_method, build_views, cache_side, used_side
from obow.methods.base import Method
from obow.notices import counted
from obow.training.run.logger import log_main
from obow.training.run.precision import check_precision
from obow.training.run.state import RunError
from obow.training.step import compiled as compiled_module
from obow.training.step import graphed

__all__ = [
    "build_data",
    "build_model",
    "build_optimizer",
    "prepare_step_model",
    "setup_process",
    "training_device",
    "synchronises_batchnorm",
]


def training_device(cfg: Config, local_rank: int = 0) -> torch.device:
    """The device a process of a run of ``cfg`` trains on (``train.device``): its GPU (``local_rank``) when one is
    visible, unless ``cpu``; a :class:`~obow.training.run.state.RunError` for ``cuda`` when none is."""
    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        raise RunError("train.device=cuda but no CUDA device is visible; use train.device=cpu or auto")
    if cfg.train.device != "cpu" and torch.cuda.is_available():
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def setup_process(cfg: Config) -> torch.device:
    """Join the process group when launched by ``torchrun``; choose the device; set determinism."""
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1 and not D.is_distributed():
        use_cuda = cfg.train.device != "cpu" and torch.cuda.is_available()
        dist.init_process_group("nccl" if use_cuda else "gloo")
    device = training_device(cfg, int(os.environ.get("LOCAL_RANK", 0)))
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = not cfg.train.deterministic
        torch.backends.cuda.matmul.allow_tf32 = cfg.train.tf32  # this process's fp32 products: training, monitor
        torch.backends.cudnn.allow_tf32 = cfg.train.tf32
    if cfg.train.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    check_precision(cfg, device)
    return device


#: The devices where ``train.compile: step`` compiles the device pipeline's render as well
#: (:func:`obow.data.batched_views.compiled_render`). A GPU, where the eager render launches its few hundred
#: small kernels one by one (its gain there waits for a GPU: ``benchmarks/gpu_compile.sh``'s ``render`` part);
#: not a CPU, where the eager render measured faster (docs/results/render_cpu.md).
COMPILED_RENDER_DEVICES: tuple[str, ...] = ("cuda",)


def build_data(
    cfg: Config, device: torch.device, images: ImageList | None = None, *, pipeline: str
) -> tuple[ImageList, EpochSampler, Iterable[dict[str, Any]]]:
    """The training images (``images``, else those of ``data.path``) and their loader, the views made by
    ``pipeline`` (``workers`` or ``device``, as :func:`obow.training.run.settle.settle_run` settled it): every process
    sees its share of each global batch, augmentations seeded per image (workers) or per global batch (device
    pipeline), so a resumed epoch sees the same views."""
    world = D.world_size()
    if cfg.data.batch_size % world != 0:
        raise RunError(f"data.batch_size ({cfg.data.batch_size}) must be divisible by the {world} processes")
    if images is None:
        assert cfg.data.path is not None  # pretrain refuses a run without one
        images = scan_images(cfg.data.path, cfg.data.labels, cfg.data.images_per_class)
    local_batch = cfg.data.batch_size // world
    if pipeline == "device":
        cache = shared_cache(images, cfg, device)
        images = cache.images
    sampler = EpochSampler(len(images), local_batch, seed=cfg.train.seed, rank=D.rank(), world_size=world)
    if pipeline == "device":
        views = build_batched_views(cfg)
        render = None
        if cache.uniform is not None:  # else the batches' padded sizes change: no static shapes to compile or capture
            if cfg.train.compile == "step" and device.type in COMPILED_RENDER_DEVICES:
                render = compiled_render(views, device, backend=compiled_module.BACKEND)
            elif cfg.train.compile == "graph" and (factory := graphed.graph_factory(device)) is not None:
                render = graphed_render(views, device, factory)
        loader = DeviceLoader(cache, sampler, views, device, cfg.train.seed, render)
        held = "; held on the GPU" if loader.where == "on the GPU" else ""
        notes = [cast(Any, render).kind] if render is not None else []
        notes += ["eager: images of several sizes"] * (cache.uniform is None and cfg.train.compile in ("step", "graph"))
        notes += ["one batch ahead on a side stream"] * (device.type == "cuda")
        how = f" ({'; '.join(notes)})" if notes else ""
        log_main("Data: views made on the %s%s from %s%s", device.type, how, cache.describe(), held)
        return images, sampler, loader
    workers = build_loader(
        # a large JPEG decoded at a reduced scale, none of its views upsampled (a phone photo: ~10x less work)
        ImageDataset(images, build_views(cfg), tiny_below=tiny_below(used_side(cfg.views)), draft_side=cache_side(cfg)),
        sampler,
        local_batch,
        num_workers=cfg.data.num_workers,
        pin_memory=cfg.data.pin_memory and device.type == "cuda",
    )
    log_main("Data: views made by %s", counted(cfg.data.num_workers, "loader worker"))
    return images, sampler, workers


def shared_cache(images: ImageList, cfg: Config, device: torch.device) -> ImageCache:
    """The device pipeline's cache of ``images``, decoded by one process per machine (the first, ``LOCAL_RANK``
    0) while the others wait, then read by them; not by every process at once. When it fails there, every
    process stops (the others with a line that points at its message) instead of waiting for it."""

    def build() -> ImageCache:
        return build_cache(
            images, cache_side(cfg), cfg.data.cache_size, cfg.data.cache_dir, tiny_side=used_side(cfg.views)
        )

    if not D.is_distributed():
        return build()
    first = int(os.environ.get("LOCAL_RANK", 0)) == 0
    cache, error = None, None
    if first:
        try:
            cache = build()
        except ValueError as err:
            error = err
    if D.agree_any([error is not None], device)[0]:
        raise error or ValueError("the image cache could not be built: see the first process's message")
    return cache if cache is not None else build()


def synchronises_batchnorm(cfg: Config, device: torch.device) -> bool:
    """Whether :func:`build_model` makes the student's and teacher's batch norm ``SyncBatchNorm``: with
    ``train.sync_batchnorm`` on several GPUs, except for MoCo v2, whose query and key would then be normalised
    with the statistics of the same (global) batch, undoing its shuffled batch norm (the leak,
    :mod:`obow.methods.mocov2`; MoCo's code keeps each GPU's own statistics)."""
    wanted = cfg.train.sync_batchnorm and cfg.model.method != "mocov2"
    return wanted and D.is_distributed() and device.type == "cuda"


def build_model(cfg: Config, total_iterations: int, device: torch.device, resuming: bool = False) -> Method:
    """The method of ``cfg`` on ``device``. The same seed on every process gives the same initial weights and
    vocabulary; batch norm is synchronised across GPUs when asked (``train.sync_batchnorm``). ``resuming``: the
    weights come from a checkpoint next (so BoWNet does not read its teacher file)."""
    torch.manual_seed(cfg.train.seed)
    model = build_method(cfg, total_iterations, resuming=resuming)
    if synchronises_batchnorm(cfg, device):
        model.synchronise_batchnorm()
    model.to(device)
    if cfg.train.channels_last:
        model.to(memory_format=torch.channels_last)
    return model


def build_optimizer(model: nn.Module, cfg: Config) -> torch.optim.Optimizer:
    """SGD over the student and the head. The official code decays every parameter (BN and biases too);
    ``optim.decay_norm_and_bias: false`` exempts one-dimensional parameters instead.

    PyTorch's fused SGD: one kernel for all parameters where the default issues one small kernel per parameter
    and operation on a CPU (about 280 for a ResNet-18, ``benchmarks/step_ops.py``) or a few per chunk on a GPU;
    on 2 CPU cores it took 5 ms a step against 10 ms, with the same values bit for bit."""
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.optim.decay_norm_and_bias:
        groups = [{"params": params, "weight_decay": cfg.optim.weight_decay}]
    else:
        groups = [
            {"params": [p for p in params if p.ndim > 1], "weight_decay": cfg.optim.weight_decay},
            {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0},
        ]
    return torch.optim.SGD(
        groups, lr=cfg.optim.lr, momentum=cfg.optim.momentum, nesterov=cfg.optim.nesterov, fused=True
    )


def prepare_step_model(model: Method, cfg: Config, device: torch.device) -> nn.Module:
    """What each step calls: the model, wrapped for DDP when distributed; its networks compiled when asked."""
    step_model: nn.Module = model
    if D.is_distributed():
        step_model = D.ddp_without_buffer_sync(model, [device.index] if device.type == "cuda" else None)
    if cfg.train.compile == "networks":
        model.student.compile()
        if model.teacher is not None:
            model.teacher.compile()
    return step_model
