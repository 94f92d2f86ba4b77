"""``data.pipeline: device``: batches of views made on the training device from decoded images.

:class:`DeviceLoader` stands where the ``DataLoader`` of :func:`obow.data.folders.build_loader` stands in the
training loop and yields the same batches (``{"image": views, "skipped": [paths], "reasons": [(path, why)], "tiny":
[(path, shorter side)]}``: the images the cache left out, with why, in the first batch of every epoch, so that a run
counts the same ``skipped_images`` as the worker pipeline, which meets them in the epoch),
but no worker process decodes or augments anything: the images come decoded from an
:class:`obow.data.cache.ImageCache` (held on the GPU when it fits in a quarter of its free memory, else gathered per
batch on the CPU and copied), each whole at its own size, gathered into one tensor padded to the batch's largest
height and width (:meth:`~obow.data.cache.ImageCache.batch`), and :class:`obow.data.batched_views.BatchedViews`
makes all views of a batch with a few batched kernels, the boxes placed on each image's own size.

The order of the images is the :class:`~obow.data.folders.EpochSampler`'s, and the random parameters of global
batch ``b`` of epoch ``e`` are drawn from a generator seeded with ``sample_seed(seed, e, b * G)``: a resumed
epoch sees the views an uninterrupted one saw, and every process of a multi-GPU run draws the parameters of the
whole global batch and renders its own share, so its views are those of a one-GPU run (the draws do not depend on
the images; each process places its share's boxes on its own images' sizes).

On a GPU each batch is made on a side stream one batch ahead (:func:`made_ahead`): while the step of batch ``b``
runs on the main stream, the views of ``b + 1`` are rendered beside it. ``render`` may be a compiled render
(:func:`obow.data.batched_views.compiled_render`, with ``train.compile: step`` on a GPU): the same views to
float32 rounding, a few kernels instead of hundreds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import numpy as np
import torch

from obow.data.batched_views import BatchedViews, ViewParams
from obow.data.cache import ImageCache
from obow.data.folders import EpochSampler, sample_seed

#: The cache moves to the GPU when it takes at most this fraction of the GPU's free memory.
GPU_CACHE_FRACTION = 0.25


class DeviceLoader:
    """Batches of ``views`` of ``cache``'s images in ``sampler``'s order, made on ``device``."""

    def __init__(
        self,
        cache: ImageCache,
        sampler: EpochSampler,
        views: BatchedViews,
        device: torch.device,
        seed: int,
        render: Callable[[torch.Tensor, ViewParams], dict[str, torch.Tensor]] | None = None,
    ) -> None:
        self.cache = cache
        self.sampler = sampler
        self.views = views
        self.device = device
        self.seed = seed
        self.render = render or views.render  # views.render, or its compiled form
        self.resident: torch.Tensor | None = None  # the whole cache on the device, when it is held there
        # the flat buffer of every image's pixels (ImageCache.pixels), shared with the cache on the CPU
        if device.type == "cuda" and cache.nbytes <= GPU_CACHE_FRACTION * torch.cuda.mem_get_info(device)[0]:
            self.resident = resident_copy(cache, device)
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

    @property
    def compiled(self) -> bool:
        """Whether the views are rendered by a compiled render rather than ``views.render``."""
        return self.render != self.views.render

    def __iter__(self) -> Iterator[dict[str, Any]]:
        batches = ((planned, i == 0) for i, planned in enumerate(self.sampler.batches()))
        if self.device.type == "cuda":
            return made_ahead(self._make, batches, self.device)
        return (self._make(batch) for batch in batches)

    def _make(self, item: tuple[tuple[int, list[int], int, int], bool]) -> dict[str, Any]:
        """The views of one batch as the sampler plans it: ``(batch, indices, offset, size)``, and whether it is the
        first of the iteration (which names the images the cache left out)."""
        (batch, indices, offset, size), first = item
        sampler = self.sampler
        seed = sample_seed(self.seed, sampler.epoch, batch * sampler.global_batch_size)
        generator = torch.Generator().manual_seed(seed)
        params = self.views.draw(size, generator)[offset : offset + len(indices)]
        params = self.views.place(params, torch.from_numpy(self.cache.sizes[indices]))
        index = torch.tensor(indices)
        if self.resident is not None:
            images = self.cache.batch(index, self.resident)
        else:
            images = self.cache.batch(index).pin_memory() if self.device.type == "cuda" else self.cache.batch(index)
        tiny = [(self.cache.images.paths[i], self.cache.tiny[i]) for i in indices if i in self.cache.tiny]
        left_out = self.cache.left_out if first else []
        return {
            "image": self.render(images.to(self.device, non_blocking=True), params),
            "skipped": [path for path, _ in left_out],
            "reasons": list(left_out),
            "tiny": tiny,
        }


def resident_copy(cache: ImageCache, device: torch.device) -> torch.Tensor:
    """:attr:`ImageCache.pixels` on ``device``, copied block by block, each block checked against its checksum as it
    is read (:meth:`ImageCache.checked_blocks`): a memory-mapped cache is read once, not once to check and once
    to copy. A cache read into memory was checked as it was read: copied at once."""
    if cache.checked.all() and cache.where == "memory":
        return torch.from_numpy(cache.pixels).to(device)
    resident = torch.empty(cache.nbytes, dtype=torch.uint8, device=device)
    for start, chunk in cache.checked_blocks():
        resident[start : start + len(chunk)].copy_(torch.from_numpy(np.array(chunk)))
    return resident


T = TypeVar("T")


def made_ahead(
    make: Callable[[T], dict[str, Any]], planned: Iterable[T], device: torch.device
) -> Iterator[dict[str, Any]]:
    """``make(p)`` for each ``p`` of ``planned``, each made on a side CUDA stream one batch ahead: the next batch's
    work is queued on the side stream before the current batch is handed over, so that it runs while the training
    step of the current one runs on the main stream. A batch is handed over once the main stream waits for the
    event recorded after its own work on the side stream (not for the next batch's), and with each of its tensors
    marked as used on the main stream (``record_stream``), so that the allocator does not give their memory to
    the side stream's next batches while the step still reads them. One batch of views more is held on the
    device; nothing else changes: the same kernels make the same views."""
    side = torch.cuda.Stream(device)
    main = torch.cuda.current_stream(device)
    side.wait_stream(main)  # what the side stream reads (a resident copy of the cache) was written on the main one
    pending: tuple[dict[str, Any], torch.cuda.Event] | None = None
    for item in planned:
        with torch.cuda.stream(side):
            made = make(item)
        done = side.record_event()
        if pending is not None:
            yield _handed_over(*pending, main)
        pending = made, done
    if pending is not None:
        yield _handed_over(*pending, main)


def _handed_over(batch: dict[str, Any], done: torch.cuda.Event, main: torch.cuda.Stream) -> dict[str, Any]:
    main.wait_event(done)
    for tensor in batch["image"].values():
        tensor.record_stream(main)
    return batch
