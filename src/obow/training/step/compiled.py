"""``train.compile: step``: the whole training step as two compiled graphs, one call each from the host.

On a GPU the eager step is bound by the host issuing its kernels (thousands a step, docs/results/step_ops.md);
a step compiled whole, and then replayed as a CUDA graph, issues them in a few calls. :class:`CompiledStep` is
that step: the forward and the backward pass as one graph (``fullgraph=True``: a graph break is an error, not a
silent split; ``Tensor.backward`` is traced with ``torch._dynamo.config.trace_autograd_ops``), and the
optimiser step as a second one (PyTorch's compiled-optimiser pattern: ``optimizer.step`` graph-breaks on
purpose inside another graph).

Nothing a step changes is a Python value that the graphs read, so that nothing recompiles across steps, epochs,
a resumption, a change of learning rate or the last batch, and the host reads nothing from the device on an
unlogged step:

* the learning rate and the teacher momentum are 0-d device tensors written in place before each step (the
  optimiser's ``lr`` is that tensor; the method reads :attr:`~obow.methods.base.Method.momentum_input`); the
  momentum is float64, so that ``1 - momentum`` is the host's double, as in the eager step;
* the iteration, queue pointers and k-means statistics are buffers updated in place, with shapes that never
  depend on the data (:mod:`obow.bow.vocabulary`);
* the logged steps' diagnostics are a second compiled variant of the forward and backward graph (the method's
  ``diagnose``), compiled once, on the first logged step.

The compiled step computes what the eager one does: with ``backend="aot_eager"`` the same operators run, with
the same random numbers; with Inductor (the default), its generated kernels round differently, and its random
numbers are PyTorch's own (``fallback_random``), so that a compiled run draws what an eager one draws. The
optimiser runs as ``foreach`` rather than ``fused`` (Dynamo does not trace the fused kernel), with the same
momentum buffers, so a checkpoint moves between an eager run and a compiled one.

MoCo v2 compiles too: its key momentum is the same 0-d tensor, its queue is written through a pointer that stays
on the device (``index_copy_`` of rows ``(ptr + arange(n)) % size``), and the key batch's permutation (shuffled
batch norm) is drawn inside the graph from PyTorch's generator (``fallback_random`` under Inductor), so a
compiled run draws the numbers an eager one does.

Cut-mixed views (``model.cutmix``) compile too: the step draws its boxes and permutations on the host before the
graph, from the generator and in the order of the eager step (:meth:`obow.methods.base.Method.draw_host_inputs`),
writes them into tensors the graph reads (``model.host_inputs``), and the graph pastes through a mask
(:func:`obow.data.cutmix.cutmix_masked`): no box is a Python value in the graph.

Replayed as CUDA graphs (Inductor's ``triton.cudagraphs``, what ``mode="reduce-overhead"`` sets; :data:`OPTIONS`,
``benchmarks/throughput.py --compile-mode reduce-overhead``), each step marks a new CUDA-graph step before its
graphs run and returns copies of its metrics (a replay overwrites its outputs). Not measured on a GPU yet
(``benchmarks/gpu_compile.sh``).

Not yet: BoWNet and RotNet, several processes (DistributedDataParallel) and fp16 (the gradient scaler's skip
reads the device); each is refused with one line (:func:`obow.training.step.check_step_mode`).

What it costs: Inductor compiled the whole step of the tests' tiny network in minutes on 2 CPU cores (234 s,
docs/results/compile_cpu.md), and on an H200 with 16 cores the step of ``cifar10_resnet18`` had not finished
compiling after 140 s; a run pays that at every start. ``train.compile: graph`` (:mod:`obow.training.step.graphed`)
replays the eager step as a CUDA graph without compiling it.

Older torches (the GPU machines' 2.11) lack two things the step uses; each is detected by trying it on a toy
(:func:`traces_leaf_tensors`, :func:`lerps_as_eager`, once a process), and the step falls back, saying so in one
log line: a per-group backward (``train.backward_per_group``) makes leaf tensors inside the graph, which 2.11's
Dynamo refuses (``Tensor.requires_grad_``), so the step back-propagates the whole loss at once; and 2.11's Dynamo
decomposes ``torch._foreach_lerp_`` with a tensor weight into a multiply and an add (two roundings against the
eager kernel's one), so the teacher's EMA is ``Tensor.lerp_`` pair by pair
(:data:`obow.methods.base.FOREACH_TENSOR_LERP`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor

from obow.methods import base
from obow.methods.base import Method
from obow.training.step.shared import configure_optimizer, start_momentum_buffers

__all__ = [
    "CompiledStep",
    "lerps_as_eager",
    "step_per_group",
    "traces_leaf_tensors",
]

log = logging.getLogger("obow")

#: The Dynamo backend of a run's compiled step (the tests put aot_eager here: Inductor's C++ takes minutes on a CPU).
BACKEND: Any = "inductor"

#: Inductor options of a run's compiled step, e.g. ``{"triton.cudagraphs": True}`` (what ``mode="reduce-overhead"``
#: sets: the step replayed as CUDA graphs; benchmarks/throughput.py --compile-mode reduce-overhead).
OPTIONS: dict[str, Any] | None = None

#: ``forward_backward(teacher_images, student_views) -> metrics``: the loop's forward and backward pass of a step.
ForwardBackward = Callable[[Tensor, list[Tensor]], dict[str, Tensor]]


@functools.cache
def traces_leaf_tensors() -> bool:
    """Whether this torch's Dynamo makes a leaf tensor inside a graph and back-propagates to it, as the per-group
    backward does (:meth:`obow.methods.obow.OBoW.forward`: detached prediction weights). torch 2.11's refuses
    (``Unsupported Tensor.requires_grad_() call``); 2.14's can."""

    def probe(x: Tensor) -> Tensor:
        leaf = (x * 2).detach().requires_grad_(True)
        (leaf * x).sum().backward()
        assert leaf.grad is not None  # the backward just above
        return leaf.grad * 1

    try:
        with torch._dynamo.config.patch(trace_autograd_ops=True):
            torch.compile(probe, backend="eager", fullgraph=True)(torch.arange(3.0))
    except torch._dynamo.exc.Unsupported:
        return False
    return True


@functools.cache
def lerps_as_eager() -> bool:
    """Whether this torch's Dynamo computes ``torch._foreach_lerp_`` with a 0-d tensor weight as the eager kernel
    does (one rounding). torch 2.11's decomposes it into a multiply and an add, 1 ulp apart on most elements;
    2.14's through ``addcmul`` is exact."""

    def lerp(averages: list[Tensor], sources: list[Tensor], weight: Tensor) -> None:
        torch._foreach_lerp_(averages, sources, weight)  # type: ignore[call-overload]  # a 0-d tensor weight: torch takes it, its stub lists scalars only

    g = torch.Generator().manual_seed(0)
    start, end = torch.randn(4096, generator=g), torch.randn(4096, generator=g)
    weight = torch.tensor(0.01)
    expected, got = [start.clone()], [start.clone()]
    torch._foreach_lerp_(expected, [end], float(weight))
    torch.compile(lerp, backend="eager", fullgraph=True)(got, [end], weight)
    return torch.equal(got[0], expected[0])


def step_per_group(requested: bool) -> bool:
    """Whether a compiled step back-propagates per view group: as ``requested`` (``train.backward_per_group``, and
    a method that has groups), unless this torch cannot (:func:`traces_leaf_tensors`), which it says in one line."""
    if requested and not traces_leaf_tensors():
        log.warning(
            "train.compile=step: torch %s cannot make leaf tensors in a compiled graph (Dynamo refuses "
            "Tensor.requires_grad_), so the step back-propagates the whole loss at once, not per view group "
            "(train.backward_per_group ignored: the same gradients to rounding, more activation memory)",
            torch.__version__,
        )
        return False
    return requested


class CompiledStep:
    """One training step of ``model`` as two compiled graphs: ``forward_backward`` (the loop's, closed over the
    model, precision and per-group setting) and ``optimizer.step()``. Call it as the loop's step:
    ``metrics = step(teacher_images, student_views, lr)``.

    ``backend``: ``"inductor"`` (the default; with ``fallback_random``) or e.g. ``"aot_eager"`` (the tests'), or a
    Dynamo backend object (a compile counter). ``options``: Inductor's, e.g. ``{"triton.cudagraphs": True}``.
    """

    mode = "step"

    def __init__(
        self,
        model: Method,
        optimizer: torch.optim.Optimizer,
        forward_backward: ForwardBackward,
        *,
        backend: Any = "inductor",
        options: dict[str, Any] | None = None,
    ) -> None:
        if "step" not in model.step_modes:
            raise ValueError(f"{type(model).__name__} does not support train.compile=step")
        self.model = model
        self.optimizer = optimizer
        self.forward_backward = forward_backward
        self.lr = cast(Tensor, configure_optimizer(optimizer, step=True))  # step=True: the 0-d learning rate
        device = self.lr.device
        self.momentum = torch.zeros((), dtype=torch.float64, device=device)
        model.use_momentum_input(self.momentum)
        if base.FOREACH_TENSOR_LERP and not lerps_as_eager():
            log.warning(
                "train.compile=step: torch %s's Dynamo rounds torch._foreach_lerp_ with a tensor weight otherwise "
                "than eager (a multiply, then an add), so the EMA updates use Tensor.lerp_ per parameter",
                torch.__version__,
            )
            base.FOREACH_TENSOR_LERP = False
        start_momentum_buffers(optimizer)
        #: replayed as CUDA graphs: a graph's outputs live in memory its next replay overwrites
        self.cudagraphs = bool(options and options.get("triton.cudagraphs"))
        if backend == "inductor":
            options = {"fallback_random": True, **(options or {})}
        compile_ = dict(backend=backend, options=options) if options else dict(backend=backend)
        self._unlogged = torch.compile(self._forward_backward_unlogged, fullgraph=True, **compile_)
        self._logged = torch.compile(self._forward_backward_logged, fullgraph=True, **compile_)
        self._step = torch.compile(self._optimizer_step, **compile_)

    def __call__(self, teacher_images: Tensor, student_views: list[Tensor], lr: float) -> dict[str, Tensor]:
        """One step at learning rate ``lr``; returns its detached metrics (device tensors)."""
        self.lr.fill_(lr)
        self.momentum.fill_(self.model.current_momentum())  # at the iteration begin_step gave: no read of the device
        self.model.write_host_inputs(student_views, self.lr.device)
        self.optimizer.zero_grad(set_to_none=True)
        if self.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()  # a new step: the previous one's outputs are done with
        forward_backward = self._logged if self.model.diagnose else self._unlogged
        with torch._dynamo.config.patch(trace_autograd_ops=True):
            metrics = forward_backward(teacher_images, student_views)
        self._step()
        if self.cudagraphs:  # the caller may hold them past the next step (the progress bar, a logged step's floats)
            metrics = {key: value.clone() for key, value in metrics.items()}
        return metrics

    # Two functions with the same body: Dynamo keeps compiled code per Python function, so the logged variant
    # (diagnose=True) is a second graph compiled once, not a recompilation of the first on every logged step.
    def _forward_backward_unlogged(self, teacher_images: Tensor, student_views: list[Tensor]) -> dict[str, Tensor]:
        return self.forward_backward(teacher_images, student_views)

    def _forward_backward_logged(self, teacher_images: Tensor, student_views: list[Tensor]) -> dict[str, Tensor]:
        return self.forward_backward(teacher_images, student_views)

    def _optimizer_step(self) -> None:
        self.optimizer.step()
