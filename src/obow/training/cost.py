"""What a run will cost, said before its first step: memory and time per epoch on this device, and what a run that
clearly does not fit, or that runs out of memory, is told.

The paper's recipe (ResNet-50, batch 256, 224 px teacher, 2 crops and 5 patches) on a CPU was killed by the
kernel for memory without a word (exit 137). :func:`check_budget` measures the run's step before it starts:

* the memory: the weights, buffers, gradients and momentum of the method (counted), plus the activations of a
  step, on a line through steps of 1 and 2 images out to ``data.batch_size``: on a CPU the most bytes kept at
  once for the backward pass
  (through ``torch.autograd.graph.saved_tensors_hooks``, view groups back-propagated one by one as the run does),
  which leaves out temporary buffers (e.g. the teacher's distances to the vocabulary), so it is a floor; on a GPU
  the allocator's own peak, temporary buffers included;
* the time per epoch: a step's time on the same line, times the steps of an epoch, loading the images not counted
  (on a CPU, where a step's time grows about in proportion to its images; a GPU's small steps say little about a
  full batch, so none is given there). On a busy machine it is rough;
* what the machine has: ``MemAvailable`` of ``/proc/meminfo``, the control group's limit less its use, and the
  address-space limit (``ulimit -v``) less what the process maps; on a GPU, ``torch.cuda.mem_get_info``.

A run whose estimate is above :data:`REFUSE_ABOVE` of what is available is refused with one line naming what to
lower; above :data:`WARN_ABOVE`, warned about. The measurement costs three small steps on a model built for it
(4 images in all), so it is made only where a generous bound (:func:`rough_bound`) says the run may need more
than a quarter of the memory available; the random generators are left as they were.

An out-of-memory error during training still happens where the estimate is low (temporary buffers, another job
taking memory): :func:`out_of_memory` turns the allocator's message into one line naming what to lower.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import resource
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from obow import distributed as D
from obow.config import Config
from obow.training.run.random_states import get_rng_state, set_rng_state
from obow.training.run.state import RunError

log = logging.getLogger("obow")

#: Refused above this share of the memory available, warned about above :data:`WARN_ABOVE`.
REFUSE_ABOVE = 1.0
WARN_ABOVE = 0.8
#: Bytes of activation kept per pixel of a step's views per image, an upper bound for the ResNets obow trains in fp32
#: (ResNet-50 keeps about 3 kB per pixel of its input: about 150 MB for a 224 px image).
BYTES_PER_PIXEL = 4096
#: The images of the larger of the two steps measured (:func:`measure_step`).
PROBE_IMAGES = 2
#: The step is measured only when :func:`rough_bound` is above a quarter of the memory available, or this where
#: that is unknown (a test-sized run is not measured).
MEASURE_FROM = 1 << 30

GIB = 1 << 30

#: What lowers a run's memory, for the lines that say it does not fit.
LOWER = "lower data.batch_size, views.crop_size / views.patch_size / views.teacher_size or views.num_crops"


@dataclass
class Cost:
    """A run's estimated peak memory (``states`` + ``activations``, bytes) and seconds per epoch (``None``: not
    estimated), ``available`` bytes on the device, and how the activations were measured."""

    states: int
    activations: int
    epoch_seconds: float | None
    available: int | None
    how: str

    @property
    def total(self) -> int:
        return self.states + self.activations


def step_pixels(cfg: Config) -> int:
    """Pixels of the views of one image a step computes on: the teacher's and the student's."""
    v = cfg.views
    if cfg.model.method == "mocov2" and cfg.moco.augmentation == "mocov2":
        return 2 * v.teacher_size**2
    return v.num_crops * v.crop_size**2 + v.num_patches * v.patch_size**2 + v.teacher_size**2


def rough_bound(cfg: Config) -> int:
    """A generous bound of the activations of a step (:data:`BYTES_PER_PIXEL` per student pixel), from the recipe
    alone: whether the step is worth measuring."""
    return BYTES_PER_PIXEL * step_pixels(cfg) * cfg.data.batch_size // D.world_size()


def available_memory(device: torch.device) -> int | None:
    """Bytes this process may still take on ``device`` (``None``: unknown)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    limits = []
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                limits.append(int(line.split()[1]) * 1024)
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        with contextlib.suppress(OSError, ValueError):
            limit = Path(limit_file).read_text().strip()
            if limit != "max" and int(limit) < 1 << 60:
                limits.append(int(limit) - int(Path(usage_file).read_text()))
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        with contextlib.suppress(OSError, ValueError):
            mapped = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
            limits.append(soft - mapped)
    return max(min(limits), 0) if limits else None


def state_bytes(model: torch.nn.Module) -> int:
    """The method's weights and buffers, with a gradient and a momentum buffer per trainable weight."""
    params = sum(p.numel() * p.element_size() * (3 if p.requires_grad else 1) for p in model.parameters())
    return params + sum(b.numel() * b.element_size() for b in model.buffers())


class SavedPeak:
    """The most bytes of activations the autograd graph holds at once while the block runs: every tensor it saves
    for a backward pass counted once per storage, from when it is saved until its graph is freed."""

    def __init__(self) -> None:
        self.live: dict[int, list[int]] = {}  # storage address -> [bytes, holders]
        self.now = 0
        self.peak = 0

    def pack(self, tensor: torch.Tensor) -> Any:
        holder = _Held(tensor)
        key = tensor.untyped_storage().data_ptr()
        entry = self.live.setdefault(key, [tensor.untyped_storage().nbytes(), 0])
        if entry[1] == 0:
            self.now += entry[0]
            self.peak = max(self.peak, self.now)
        entry[1] += 1
        weakref.finalize(holder, self.release, key)
        return holder

    def release(self, key: int) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.live[key]

    @contextlib.contextmanager
    def watching(self) -> Any:
        with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda held: held.tensor):
            yield self


class _Held:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def probe_batch(cfg: Config, images: int) -> dict[str, torch.Tensor]:
    """``images`` copies of the views of one grey image, as the loader batches them."""
    from PIL import Image

    from obow.methods import build_views, used_side

    side = used_side(cfg.views)
    views = build_views(cfg)(Image.new("RGB", (side, side), (128, 128, 128)))
    return {key: torch.stack([value] * images) for key, value in views.items() if isinstance(value, torch.Tensor)}


def measure_step(cfg: Config, device: torch.device) -> tuple[int, int, float, str]:
    """Build the method anew and run steps of 1, :data:`PROBE_IMAGES` and again 1 image: its state bytes, then the
    activation bytes and the seconds of a step of ``data.batch_size`` images per process, each on a line through
    the small steps (part of a step does not grow with its images: the vocabulary's, the weight generator's; the
    first step, which sets things up, is not timed), and how the memory was measured."""
    from obow.methods import build_method
    from obow.training.run.precision import precision_context
    from obow.training.step.shared import forward_backward, to_device

    model = build_method(cfg, total_iterations=1000, resuming=True).to(device).train()
    model.begin_step(logged=False)  # as on most steps of a run: the diagnostics are computed on the logged ones
    states = state_bytes(model)
    per_group = cfg.train.backward_per_group and model.supports_groups
    peaks: dict[int, int] = {}
    seconds: dict[int, float] = {}
    for images in (1, PROBE_IMAGES, 1):
        teacher, views = to_device(probe_batch(cfg, images), device, cfg.train.channels_last)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        start = time.perf_counter()
        with SavedPeak().watching() as saved:
            forward_backward(model, teacher, views, None, precision_context(cfg.train.precision, device), per_group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            peaks.setdefault(images, torch.cuda.max_memory_allocated(device) - before)
        else:
            peaks.setdefault(images, saved.peak)
        seconds[images] = time.perf_counter() - start  # the last of each size: the first step sets things up
        model.zero_grad(set_to_none=True)
    del model, teacher, views
    if device.type == "cuda":
        torch.cuda.empty_cache()
    batch = cfg.data.batch_size // D.world_size()
    n = PROBE_IMAGES
    activations = peaks[1] + max(peaks[n] - peaks[1], 0) * (batch - 1) // (n - 1)
    per_image = (seconds[n] - seconds[1]) / (n - 1)
    step = seconds[1] + per_image * (batch - 1) if per_image > 0 else seconds[n] / n * batch  # else: noise
    how = "the allocator's peak" if device.type == "cuda" else "kept for the backward pass, a floor"
    return states, activations, step, how


def check_budget(cfg: Config, device: torch.device, iters_per_epoch: int) -> Cost | None:
    """Measure the run's cost before its first step (when :func:`rough_bound` is above a quarter of the memory
    available), say it in one line, and refuse (:class:`~obow.training.run.state.RunError`) or warn when it clearly
    exceeds what the device has. ``None``: not measured."""
    available = available_memory(device)
    if rough_bound(cfg) < (available / 4 if available is not None else MEASURE_FROM):
        return None
    rng = get_rng_state()
    try:
        states, activations, seconds, how = measure_step(cfg, device)
    finally:
        set_rng_state(rng)
    epoch = seconds * iters_per_epoch if device.type == "cpu" else None
    cost = Cost(states, activations, epoch, available, how)
    judge(cost, cfg, device)
    return cost


def judge(cost: Cost, cfg: Config, device: torch.device) -> None:
    """Say ``cost``; refuse a run above :data:`REFUSE_ABOVE` of the memory available, warn above
    :data:`WARN_ABOVE`."""
    where = "this CPU" if device.type == "cpu" else str(device)
    time_text = (
        f", about {format_duration(cost.epoch_seconds)} of steps per epoch on {where}" if cost.epoch_seconds else ""
    )
    has = f"; {cost.available / GIB:.1f} GiB available" if cost.available is not None else ""
    line = (
        f"about {cost.total / GIB:.1f} GiB at data.batch_size={cfg.data.batch_size} ({cost.states / GIB:.2f} GiB of "
        f"weights, gradients and momentum, {cost.activations / GIB:.1f} GiB of activations: {cost.how}){has}"
    )
    if cost.available is not None and cost.total > REFUSE_ABOVE * cost.available:
        raise RunError(f"this run does not fit in memory: {line}; {LOWER}, or run it on a larger machine")
    if cost.available is not None and cost.total > WARN_ABOVE * cost.available:
        log_line = "Cost: %s%s: close to what the machine has; if it is killed for memory, %s"
        if D.is_main_process():
            log.warning(log_line, line, time_text, LOWER)
        return
    if D.is_main_process():
        log.info("Cost: %s%s", line, time_text)


def format_duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def out_of_memory(err: BaseException, cfg: Config) -> RunError | None:
    """One line for an out-of-memory error of the allocator (CPU or GPU), naming what to lower; ``None`` for any
    other error."""
    text = str(err)
    if not (isinstance(err, torch.OutOfMemoryError) or "not enough memory" in text or "can't allocate memory" in text):
        return None
    found = re.search(r"[Tt]ried to allocate (\d+ bytes|[\d.]+ [KMGT]iB)", text)
    asked = f" (it asked for {found.group(1)} more)" if found else ""
    return RunError(f"out of memory during training{asked} at data.batch_size={cfg.data.batch_size}: {LOWER}")


#: How many images :func:`check_view_sizes` opens (their headers only), spread over the folder.
SIZE_SAMPLE = 32


def check_view_sizes(cfg: Config, paths: list[str]) -> float | None:
    """Warn once when the views are far above the images' size: more than
    :data:`~obow.data.folders.TINY_UPSCALE` times the median shorter side of a sample of the images (500 px views
    of 32 px images: 44 to 59 s a step and 9 GB, computing on pixels the images do not have). Returns how many
    times larger the views are (``None``: no image could be read)."""
    import statistics

    from PIL import Image

    from obow.data.folders import TINY_UPSCALE

    sides = []
    for path in paths[:: max(1, len(paths) // SIZE_SAMPLE)][:SIZE_SAMPLE]:
        with contextlib.suppress(OSError, ValueError, Image.DecompressionBombError), Image.open(path) as img:
            sides.append(min(img.size))
    if not sides:
        return None
    v = cfg.views
    largest = max(v.teacher_size, v.crop_size if v.num_crops else 0)
    median = statistics.median(sides)
    ratio = largest / max(median, 1)
    if ratio > TINY_UPSCALE and D.is_main_process():
        log.warning(
            "the views are far above the images' size: views.teacher_size=%d, views.crop_size=%d against a "
            "shorter side of %g px (the median of %d images), %.0fx: every view is upscaled, and a step computes "
            "on pixels the images do not have at the cost of the larger size; views near the images' size are "
            "as informative and far cheaper",
            v.teacher_size,
            v.crop_size,
            median,
            len(sides),
            ratio,
        )
    return ratio
