"""``train.compile: graph``: the eager training step captured once as a CUDA graph and replayed, no compiler.

On a GPU the eager step is bound by the host issuing its kernels (about 770 operators a step for
``cifar10_resnet18``, docs/results/gpu_profile.md). A CUDA graph (``torch.cuda.CUDAGraph``, PyTorch's whole-network
capture) records the kernels of one step once, with their arguments and memory addresses, and replays them with
one call: the host's cost no longer grows with the operators. Unlike ``train.compile: step`` nothing is compiled
(that took longer than 140 s on an H200, docs/performance.md): the first replay follows the warm-up steps.

:class:`GraphedStep` is that step, :class:`~obow.training.step.TrainingStep`'s call:

* the first :data:`WARMUP_STEPS` unlogged steps run eagerly (on a side stream on a GPU, as PyTorch's capture
  asks: cuDNN's choice of algorithms, the gradients' and the optimiser's first allocations);
* the next unlogged step is captured (gradients zeroed in place, forward of teacher and student over every view,
  backward, fused SGD, the teacher's EMA, the vocabulary's queue or k-means update, MoCo's queue and shuffled
  batch norm), then replayed to compute it; every later unlogged step is one replay;
* the logged steps (the collapse diagnostics, with their SVD and host reads) run eagerly between the replays, on
  the same tensors: parameters, gradients, optimiser state and the step's inputs never move;
* what changes from step to step enters through tensors written in place before the replay: the batch (copied
  into static input buffers), the learning rate (fused SGD reads a 0-d tensor), the teacher momentum
  (:attr:`~obow.methods.base.Method.momentum_input`, float64) and the random numbers a method draws on the host
  (cut-mix boxes and permutations, :meth:`~obow.methods.base.Method.draw_host_inputs`); random numbers drawn on
  the device come from the default CUDA generator, whose state a replay advances as the eager step does, so a
  graphed run continues the eager run's random stream;
* the metrics a replay overwrites are copied out.

A capture that fails falls back to the eager step for the rest of the run, with one log line naming the cause.
The modes a method supports are part of its contract (:attr:`~obow.methods.base.Method.step_modes`); fp16 (the
gradient scaler's skip reads the device) and several processes are refused in one line before the run starts
(:func:`obow.training.step.check_step_mode`). On a CPU ``graph`` says in one line that CUDA graphs need a GPU and
runs the eager step.

:class:`TapeGraph` stands in for a CUDA graph where there is none (the tests, a CPU dry run of a GPU pass): its
capture runs the step while recording every operator it dispatches, and refuses (after the step) what a CUDA
capture would refuse, a host read or a tensor made from host values; its replay runs the recorded operators again
on the recorded tensors, with every non-tensor argument frozen as captured: what a CUDA graph replays. A step that
a tape replays as the eager loop computes reads no per-step host value.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import cast

import torch
from torch import Tensor

from obow.graphs import CaptureError, CudaStepGraph, StepGraph, TapeGraph
from obow.methods.base import Method
from obow.training.step.shared import configure_optimizer, start_momentum_buffers

__all__ = [
    "WARMUP_STEPS",
    "CaptureError",
    "CudaStepGraph",
    "GraphedStep",
    "StepGraph",
    "TapeGraph",
    "graph_factory",
]

log = logging.getLogger("obow")

#: Unlogged eager steps before the capture: PyTorch asks for a few on a side stream (cuDNN's benchmark mode tries
#: its algorithms on the first calls of each shape; lazily made state, such as gradients, exists afterwards).
WARMUP_STEPS = 3

#: Use :class:`TapeGraph` where there is no CUDA device (the tests set it, and a CPU dry run of a GPU pass).
STAND_IN = False

#: ``forward_backward(teacher_images, student_views) -> metrics``: the step's forward and backward pass.
ForwardBackward = Callable[[Tensor, list[Tensor]], dict[str, Tensor]]


def graph_factory(device: torch.device) -> Callable[[], StepGraph] | None:
    """What captures a step on ``device``: a CUDA graph on a GPU, the tape where :data:`STAND_IN` asks for it,
    else ``None`` (no graph: the eager step)."""
    if device.type == "cuda":
        return CudaStepGraph
    if STAND_IN:
        return TapeGraph
    return None


class GraphedStep:
    """The eager step of ``model``, captured as ``graph()`` and replayed (see the module docstring). Call it as the
    loop's step: ``metrics = step(teacher_images, student_views, lr)``.

    Attributes a benchmark reads: ``captured`` (a graph replays the unlogged steps), ``capture_s`` (the capture's
    wall time, its first replay included), ``replays``, ``eager_why`` (why the step stays eager, after a failed
    capture), ``graph`` (the :class:`StepGraph`)."""

    mode = "graph"

    def __init__(
        self,
        model: Method,
        optimizer: torch.optim.Optimizer,
        forward_backward: ForwardBackward,
        *,
        graph: Callable[[], StepGraph],
        warmup_steps: int = WARMUP_STEPS,
    ) -> None:
        if "graph" not in model.step_modes:
            raise ValueError(f"{type(model).__name__} does not support train.compile=graph")
        self.model = model
        self.optimizer = optimizer
        self.forward_backward = forward_backward
        self.lr = cast(Tensor, configure_optimizer(optimizer, step=True, graph=True))  # step=True: the 0-d lr
        self.momentum = torch.zeros((), dtype=torch.float64, device=self.lr.device)
        model.use_momentum_input(self.momentum)
        start_momentum_buffers(optimizer)  # the first step's graph is every later one's
        self.graph = graph()
        self.warmup_left = warmup_steps
        self.captured = False
        self.capture_s: float | None = None
        self.replays = 0
        self.eager_why: str | None = None
        self.inputs: tuple[Tensor, list[Tensor]] | None = None
        self.outputs: dict[str, Tensor] = {}
        self._other_shape_said = False

    def __call__(self, teacher_images: Tensor, student_views: list[Tensor], lr: float) -> dict[str, Tensor]:
        """One step at learning rate ``lr``; returns its detached metrics (device tensors the next step leaves be)."""
        inputs, static = self.write(teacher_images, student_views, lr)
        if self.model.diagnose or self.eager_why is not None or not static:
            return self.body(*inputs)
        if self.warmup_left > 0:
            self.warmup_left -= 1
            return self.graph.warmup(lambda: self.body(*inputs))
        if not self.captured:
            return self._capture(inputs)
        self.graph.replay()
        self.replays += 1
        return {key: value.clone() for key, value in self.outputs.items()}

    def write(
        self, teacher_images: Tensor, student_views: list[Tensor], lr: float
    ) -> tuple[tuple[Tensor, list[Tensor]], bool]:
        """What changes from step to step, written in place before the step: the batch (:meth:`_write_inputs`: the
        inputs to use, and whether they are the static ones), the learning rate, the teacher momentum and the
        host-drawn random numbers."""
        inputs, static = self._write_inputs(teacher_images, student_views)
        self.lr.fill_(lr)
        self.momentum.fill_(self.model.current_momentum())  # at the iteration begin_step gave: no read of the device
        self.model.write_host_inputs(inputs[1], self.lr.device)
        return inputs, static

    def body(self, teacher_images: Tensor, student_views: list[Tensor]) -> dict[str, Tensor]:
        """The step a graph captures, run eagerly on the step's tensors: gradients zeroed in place (they keep their
        memory), forward and backward, fused SGD at the learning rate tensor."""
        self.optimizer.zero_grad(set_to_none=False)
        metrics = self.forward_backward(teacher_images, student_views)
        self.optimizer.step()
        return metrics

    def _capture(self, inputs: tuple[Tensor, list[Tensor]]) -> dict[str, Tensor]:
        start = time.perf_counter()
        try:
            self.outputs = self.graph.capture(lambda: self.body(*inputs))
        except CaptureError as err:
            self.eager_why = str(err)
            log.warning(
                "train.compile=graph: the step could not be captured as a CUDA graph (%s); the run goes on with the "
                "eager step",
                err,
            )
            return err.outputs if err.step_done else self.body(*inputs)
        self.captured = True
        self.capture_s = time.perf_counter() - start
        log.info(
            "train.compile=graph: the step captured as one graph in %.1f s; the unlogged steps replay it",
            self.capture_s,
        )
        return {key: value.clone() for key, value in self.outputs.items()}

    def _write_inputs(
        self, teacher_images: Tensor, student_views: list[Tensor]
    ) -> tuple[tuple[Tensor, list[Tensor]], bool]:
        """The batch in the step's static input buffers (made on the first step), and whether it is there: a batch
        of another shape or layout than the captured one runs eagerly on its own tensors (said once)."""
        batch = [teacher_images, *student_views]
        if self.inputs is None and not self.captured:
            self.inputs = (teacher_images.clone(), [v.clone() for v in student_views])
        assert self.inputs is not None  # made on the first step, before any capture
        held = [self.inputs[0], *self.inputs[1]]
        if len(held) == len(batch) and all(same_layout(a, b) for a, b in zip(held, batch, strict=True)):
            for a, b in zip(held, batch, strict=True):
                a.copy_(b, non_blocking=True)
            return self.inputs, True
        if not self._other_shape_said:
            log.warning(
                "train.compile=graph: a batch of another shape than the captured step's (%s against %s) runs eagerly",
                [tuple(t.shape) for t in batch],
                [tuple(t.shape) for t in held],
            )
            self._other_shape_said = True
        return (teacher_images, student_views), False


def same_layout(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride() and a.device == b.device
