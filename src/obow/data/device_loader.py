"""``data.pipeline: device``: batches of views made on the training device from decoded images.

:class:`DeviceLoader` stands where the ``DataLoader`` of :func:`obow.data.folders.build_loader` stands in the
training loop and yields the same batches (``{"image": views, "skipped": []}``), but no worker process decodes or
augments anything: the images come decoded from an :class:`obow.data.cache.ImageCache` (held on the GPU when it
fits in a quarter of its free memory, else gathered per batch on the CPU and copied), and
:class:`obow.data.batched_views.BatchedViews` makes all views of a batch with a few batched kernels.

The order of the images is the :class:`~obow.data.folders.EpochSampler`'s, and the random parameters of global
batch ``b`` of epoch ``e`` are drawn from a generator seeded with ``sample_seed(seed, e, b * G)``: a resumed
epoch sees the views an uninterrupted one saw, and every process of a multi-GPU run draws the parameters of the
whole global batch and renders its own share, so its views are those of a one-GPU run.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from obow.data.batched_views import BatchedViews
from obow.data.cache import ImageCache
from obow.data.folders import EpochSampler, sample_seed

#: The cache moves to the GPU when it takes at most this fraction of the GPU's free memory.
GPU_CACHE_FRACTION = 0.25


class DeviceLoader:
    """Batches of ``views`` of ``cache``'s images in ``sampler``'s order, made on ``device``."""

    def __init__(
        self, cache: ImageCache, sampler: EpochSampler, views: BatchedViews, device: torch.device, seed: int
    ) -> None:
        self.cache = cache
        self.sampler = sampler
        self.views = views
        self.device = device
        self.seed = seed
        self.resident: torch.Tensor | None = None  # the whole cache on the device, when it is held there
        if device.type == "cuda" and cache.nbytes <= GPU_CACHE_FRACTION * torch.cuda.mem_get_info(device)[0]:
            self.resident = torch.from_numpy(cache.pixels).to(device)
        elif device.type == "cpu" and cache.where == "memory":
            self.resident = torch.from_numpy(cache.pixels)

    @property
    def where(self) -> str:
        """Where the decoded images are read from, for the run's header."""
        if self.resident is not None and self.device.type == "cuda":
            return "on the GPU"
        return "in memory" if self.cache.where == "memory" else "memory-mapped"

    def __len__(self) -> int:
        return max(0, self.sampler.batches_per_epoch - self.sampler.start_batch)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        sampler = self.sampler
        for batch, indices, offset, size in sampler.batches():
            generator = torch.Generator().manual_seed(
                sample_seed(self.seed, sampler.epoch, batch * sampler.global_batch_size)
            )
            params = self.views.draw(size, generator)[offset : offset + len(indices)]
            index = torch.tensor(indices)
            if self.resident is not None:
                images = self.resident[index.to(self.resident.device)]
            else:
                images = self.cache.batch(index).pin_memory() if self.device.type == "cuda" else self.cache.batch(index)
            yield {"image": self.views.render(images.to(self.device, non_blocking=True), params), "skipped": []}
