"""What a run will cost, said before its first step: memory and time per epoch on this device, and what a run that
clearly does not fit, or that runs out of memory, is told (a step's own cost, traced or measured:
:mod:`obow.training.step_cost`, whose functions are named below).

The paper's recipe (ResNet-50, batch 256, 224 px teacher, 2 crops and 5 patches) on a CPU was killed by the
kernel for memory without a word (exit 137). :func:`check_budget` says what it measures, then measures the run's
step before it starts:

* the memory: the weights, buffers, gradients and momentum of the method (counted), plus the activations of a
  step. On a CPU (:func:`estimate_step`) the step of the whole batch is traced on fake tensors, shapes without
  computation (three real steps of 1, 2 and 1 images of the paper's recipe took 749 s on a busy CPU before a
  refusal; the trace takes seconds), and its activations are the most bytes kept at once for the backward pass
  (through ``torch.autograd.graph.saved_tensors_hooks``, view groups back-propagated one by one as the run does),
  which leaves out temporary buffers (e.g. the teacher's distances to the vocabulary), so it is a floor. On a GPU
  (:func:`measure_step`) steps of 1 and 2 images are run, a line through them out to ``data.batch_size``, the
  allocator's own peak, temporary buffers included;
* the time per epoch, on a CPU: the traced step's floating-point operations at the rate this CPU does the
  student's forward and backward pass on one image (:func:`cpu_flop_rate`), times the steps of an epoch, loading
  the images not counted (a GPU's small steps say little about a full batch, so none is given there). On a busy
  machine it is rough;
* what the machine has: ``MemAvailable`` of ``/proc/meminfo``, the control group's limit less its use, and the
  address-space limit (``ulimit -v``) less what the process maps; on a GPU, ``torch.cuda.mem_get_info``.

A run whose estimate is above :data:`REFUSE_ABOVE` of what is available is refused with one line naming what to
lower; above :data:`WARN_ABOVE`, warned about. The measurement builds the method once, so it is made only where a
generous bound (:func:`rough_bound`) says the run may need more than a quarter of the memory available; the
random generators are left as they were.

An out-of-memory error still happens where the estimate is low (temporary buffers, another job taking memory),
and before the first step (the image cache, the kNN monitor): :func:`out_of_memory` turns the allocator's message
(or Python's ``MemoryError``) into one line naming where it happened and what to lower.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import resource
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from obow import distributed as D
from obow.config import Config
from obow.training.run.random_states import get_rng_state, set_rng_state
from obow.training.run.state import RunError
from obow.training.step_cost import PROBE_IMAGES, estimate_step, measure_step

log = logging.getLogger("obow")

#: Refused above this share of the memory available, warned about above :data:`WARN_ABOVE`.
REFUSE_ABOVE = 1.0
WARN_ABOVE = 0.8
#: Bytes of activation kept per pixel of a step's views per image, an upper bound for the ResNets obow trains in fp32
#: (ResNet-50 keeps about 3 kB per pixel of its input: about 150 MB for a 224 px image).
BYTES_PER_PIXEL = 4096
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


def check_budget(cfg: Config, device: torch.device, iters_per_epoch: int) -> Cost | None:
    """Measure the run's cost before its first step (when :func:`rough_bound` is above a quarter of the memory
    available), say it in one line, and refuse (:class:`~obow.training.run.state.RunError`) or warn when it clearly
    exceeds what the device has. ``None``: not measured."""
    available = available_memory(device)
    if rough_bound(cfg) < (available / 4 if available is not None else MEASURE_FROM):
        return None
    if D.is_main_process():
        log.info("Cost: %s", what_is_measured(cfg, device))
    rng = get_rng_state()
    seconds: float | None
    try:
        if device.type == "cpu":  # traced at the batch's shapes: seconds, where measured steps took minutes
            states, activations, seconds, how = estimate_step(cfg, device)
        else:  # a GPU's steps of 1 and 2 images take a fraction of a second
            states, activations, seconds, how = measure_step(cfg, device)
    finally:
        set_rng_state(rng)
    epoch = seconds * iters_per_epoch if device.type == "cpu" and seconds is not None else None
    cost = Cost(states, activations, epoch, available, how)
    judge(cost, cfg, device)
    return cost


def what_is_measured(cfg: Config, device: torch.device) -> str:
    """The line said before :func:`check_budget` measures: what it measures, and how."""
    batch = f"data.batch_size={cfg.data.batch_size}" + (f" ({D.world_size()} processes)" if D.world_size() > 1 else "")
    if device.type == "cpu":
        return (
            f"estimating the memory and time of a step at {batch} before the first step: its tensors traced at "
            "their shapes (no computation), the time from this CPU's speed on one image"
        )
    return f"measuring steps of 1 and {PROBE_IMAGES} images on {device} before the first step, out to {batch}"


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


def allocation_failed(err: BaseException) -> str | None:
    """For an out-of-memory error (PyTorch's CPU or GPU allocator, or Python's ``MemoryError``): how much it asked
    for, as `` (it asked for N more)`` (empty when its message does not say); ``None`` for any other error."""
    text = str(err)
    if not (
        isinstance(err, (torch.OutOfMemoryError, MemoryError))
        or "not enough memory" in text
        or "can't allocate memory" in text
    ):
        return None
    found = re.search(r"[Tt]ried to allocate (\d+ bytes|[\d.]+ [KMGT]iB)", text)
    return f" (it asked for {found.group(1)} more)" if found else ""


#: Where in a run an out-of-memory error happened, by a module its traceback passed through (the first entry that
#: matches), and what lowers that part's memory; the rest of a run is its steps (:data:`LOWER`).
PHASES = (
    (
        "obow/data/cache.py",
        "building or reading the image cache of data.pipeline=device",
        "lower data.cache_size (the side every image is cached at), or use data.pipeline=workers",
    ),
    (
        "obow/evaluate/monitor.py",
        "in the kNN monitor (its --val images' features)",
        "use fewer --val images, or train.knn_every=0 (no monitor)",
    ),
    (  # the demo's and the tables' evaluation once a run is trained (obow eval says its own line)
        "obow/evaluate/",
        "evaluating the trained network's features",
        "evaluate fewer images (obow tables run: --per-class, --test-per-class), or use a machine with more memory",
    ),
)


def out_of_memory(err: BaseException, cfg: Config | None) -> RunError | None:
    """One line for an out-of-memory error of the allocator (CPU or GPU) or of Python, naming where in the run it
    happened (:data:`PHASES`: the image cache, the kNN monitor, an evaluation after training; else the steps, at
    ``cfg``'s batch size when given) and what to lower; ``None`` for any other error."""
    asked = allocation_failed(err)
    if asked is None:
        return None
    # the frames it passed through, and the text of a loader worker's traceback, which it carries in its message
    seen = [frame.filename.replace(os.sep, "/") for frame in traceback.extract_tb(err.__traceback__)] + [str(err)]
    for part, where, lower in PHASES:
        if any(part in name for name in seen):
            return RunError(f"out of memory {where}{asked}: {lower}")
    batch = f" at data.batch_size={cfg.data.batch_size}" if cfg is not None else ""
    return RunError(f"out of memory during training{asked}{batch}: {LOWER}")


#: How many images :func:`check_view_sizes` opens (their headers only), spread over the folder.
SIZE_SAMPLE = 32
#: Images whose median shorter side is at least this many times the side the views are made from (the teacher's
#: resize) are far above the recipe's size: ``cifar10_fast`` (40 px) on phone photos, 3024 px, is 76x; the paper's
#: recipes on ImageNet (256 px, images of about 400-500 px) are under 2x, ``imagenette_fast`` on Imagenette 1.8x.
SHRUNK_FACTOR = 8


def check_view_sizes(cfg: Config, paths: list[str]) -> float | None:
    """Warn once when the views are far above the images' size: more than
    :data:`~obow.data.folders.TINY_UPSCALE` times the median shorter side of a sample of the images (500 px views
    of 32 px images: 44 to 59 s a step and 9 GB, computing on pixels the images do not have); and when the images
    are far above the views' (:data:`SHRUNK_FACTOR`: a CIFAR recipe on phone photos). Returns how many times
    larger the views are (``None``: no image could be read)."""
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
    shrunk = median / max(v.teacher_resize, 1)
    if shrunk >= SHRUNK_FACTOR and D.is_main_process():
        log.warning(
            "the images are far above the recipe's size: a shorter side of %g px (the median of %d images) against "
            "views made from %d px images (views.teacher_resize), 1/%.0f of each side: what is finer than that is "
            "lost to the network; a recipe made for larger images keeps more of it (`obow recipes`, docs/recipes.md)",
            median,
            len(sides),
            v.teacher_resize,
            shrunk,
        )
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
