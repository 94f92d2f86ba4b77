"""What one step of a run costs, for :mod:`obow.training.cost`: the bytes of the method's state, and a step's
activations and time, traced on fake tensors on a CPU (:func:`estimate_step`) or measured on steps of 1 and
:data:`PROBE_IMAGES` images on a GPU (:func:`measure_step`)."""

from __future__ import annotations

import contextlib
import logging
import time
import weakref
from typing import Any

import torch

from obow import distributed as D
from obow.config import Config

log = logging.getLogger("obow")

#: The images of the larger of the two steps measured (:func:`measure_step`).
PROBE_IMAGES = 2


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
        key = storage_key(tensor)
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


def storage_key(tensor: torch.Tensor) -> int:
    """Which storage ``tensor`` views: the address of its storage object, the same for every view of it, and
    distinct for every storage alive (a fake tensor's data address is 0 for all)."""
    return int(tensor.untyped_storage()._cdata)


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


def estimate_step(cfg: Config, device: torch.device) -> tuple[int, int, float | None, str]:
    """The same four as :func:`measure_step`, from one step of ``data.batch_size`` images per process traced on
    fake tensors (``torch._subclasses.fake_tensor``: shapes, dtypes and the autograd graph, no computation and
    no memory), on a CPU: the activations are the bytes that step keeps for its backward pass, counted as
    :class:`SavedPeak` counts a real one, and its time is its floating-point operations
    (``torch.utils.flop_counter``) at the rate this CPU does the student's forward and backward on one image of
    its smallest view (:func:`cpu_flop_rate`; ``None`` where the method has no ``student``). Seconds where the
    measured steps of the paper's ResNet-50 took minutes on a busy CPU."""
    from obow.methods import build_method
    from obow.training.run.precision import precision_context

    model = build_method(cfg, total_iterations=1000, resuming=True).to(device).train()
    # as on most steps of a run (the diagnostics are computed on the logged ones), at iteration 0: the teacher's
    # momentum without reading the iteration off the (fake) buffer
    model.begin_step(logged=False, iteration=0)
    states = state_bytes(model)
    per_group = cfg.train.backward_per_group and model.supports_groups
    batch = cfg.data.batch_size // D.world_size()
    autocast = precision_context(cfg.train.precision, device)
    student = model.student
    one = probe_batch(cfg, 1)
    rate = cpu_flop_rate(student, one, autocast) if isinstance(student, torch.nn.Module) else None
    shapes = [value.shape[1:] for key, value in one.items() if key != "teacher"]
    # the host's random draws of the step (OBoW's cut-mix boxes) made for real: they are read off the host
    model.write_host_inputs([torch.empty(batch, *shape, device="meta") for shape in shapes], device)
    try:
        activations, flops = trace_step(model, one, batch, device, cfg.train.channels_last, autocast, per_group)
    except Exception as err:  # noqa: BLE001 - an operation fake tensors cannot run (a value read off the device)
        del model
        if D.is_main_process():
            log.info("Cost: the step cannot be traced at its shapes (%s); measuring small steps instead", err)
        return measure_step(cfg, device)
    return states, activations, flops / rate if rate else None, "kept for the backward pass, a floor"


def trace_step(
    model: torch.nn.Module,
    one: dict[str, torch.Tensor],
    batch: int,
    device: torch.device,
    channels_last: bool,
    autocast: contextlib.AbstractContextManager,
    per_group: bool,
) -> tuple[int, int]:
    """The bytes a step of ``batch`` copies of the views ``one`` keeps for its backward pass, and its
    floating-point operations, from ``model``'s step traced on fake tensors (its weights and buffers replaced by
    fake ones of their shapes: the model is of no use afterwards)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    from obow.training.step.shared import forward_backward, to_device

    fake = FakeTensorMode(allow_non_fake_inputs=True)
    for module in model.modules():  # every weight and buffer as a fake tensor of its shape
        for name, param in list(module._parameters.items()):
            if param is not None:
                module._parameters[name] = torch.nn.Parameter(fake.from_tensor(param), param.requires_grad)
        for name, buffer in list(module._buffers.items()):
            if buffer is not None:
                module._buffers[name] = fake.from_tensor(buffer)
    with fake:
        views = {key: value.expand(batch, *value.shape[1:]).clone() for key, value in one.items()}
        teacher, groups = to_device(views, device, channels_last)
        with FlopCounterMode(display=False) as flops, SavedPeak().watching() as saved:
            forward_backward(model, teacher, groups, None, autocast, per_group)
    return saved.peak, flops.get_total_flops()


def cpu_flop_rate(
    student: torch.nn.Module, one: dict[str, torch.Tensor], autocast: contextlib.AbstractContextManager
) -> float:
    """Floating-point operations per second of this CPU on ``student``'s forward and backward pass of one image
    of the smallest view in ``one`` (a batch of one image's views): counted on a first pass, the faster of two more
    timed."""
    from torch.utils.flop_counter import FlopCounterMode

    image = min((value.flatten(0, -4)[:1] for value in one.values()), key=lambda view: view.shape[-1])
    training = student.training
    student.eval()  # batch norm on one image: its running statistics (a batch's would be of one value)
    with FlopCounterMode(display=False) as flops:
        student_pass(student, image, autocast)
    seconds = []
    for _ in range(2):  # the faster of two: a busy machine's pauses are not the CPU's speed
        start = time.perf_counter()
        student_pass(student, image, autocast)
        seconds.append(time.perf_counter() - start)
    student.train(training).zero_grad(set_to_none=True)
    return flops.get_total_flops() / max(min(seconds), 1e-9)


def student_pass(student: torch.nn.Module, image: torch.Tensor, autocast: contextlib.AbstractContextManager) -> None:
    with autocast:
        features = student(image).pool5
    features.float().sum().backward()
