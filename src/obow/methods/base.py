"""The method contract: what the training loop needs from every pretraining method, written once.

A method is an ``nn.Module`` (a subclass of :class:`Method`) with

* ``student``: the backbone being trained (what ``obow eval`` and ``obow export`` read, as the ``student.*``
  entries of the checkpoint);
* ``teacher``: the network that makes the targets (OBoW's EMA teacher, MoCo v2's key encoder, BoWNet's static
  teacher), or ``None`` (RotNet); it never gets gradients. Every method sets it, ``None`` included;
* :attr:`~Method.step_modes`: the ``train.compile`` modes its step supports (:mod:`obow.training.step`): every
  method runs ``off`` and ``networks``; a method whose step is made of tensors only (no host value reaches an
  operator, no host read, no tensor replaced by another from step to step) adds ``step`` and ``graph``, and
  offers :meth:`~Method.current_momentum` (its teacher's momentum as a host float, which those steps write into
  :attr:`~Method.momentum_input`) and :meth:`~Method.draw_host_inputs` (the random numbers its step draws on the
  host, which those steps draw before the step and write into :attr:`~Method.host_inputs`);
* :attr:`~Method.supports_groups`: whether :meth:`~Method.forward` may be called one view group at a time
  (``group=0, 1, ...``), so that the loop back-propagates each group before building the next;
* :meth:`~Method.begin_step`: what a step needs from the training loop, told before each step (whether it is
  logged, its iteration); :meth:`~Method.realign_iteration`: the method's own count of steps set where a resumed
  run counts them otherwise. The training loop talks to a method through its calls only (these, and
  :meth:`~Method.use_momentum_input`, :meth:`~Method.write_host_inputs`, :meth:`~Method.synchronise_batchnorm`):
  it sets and probes none of its attributes (``tests/test_layers.py``);
* :meth:`~Method.prepare`: work done once before the first step of a new run (not on resumption: what it
  computes must live in the ``state_dict``), e.g. BoWNet's off-line k-means; nothing by default;
* :meth:`~Method.forward` ``(teacher_images, student_views, group=None, grad_scale=1.0)`` returning a
  :class:`StepOutput`: the teacher's images ``[B, 3, T, T]`` and the student's view groups
  ``[B, n, 3, h, w]``, as :func:`obow.methods.build_views` and the loop's ``to_device`` give them.

And the pieces the methods with a teacher share: the parameter EMA (:func:`ema_update_`), the view-group
check (:func:`check_views`), the groups' loss weights (:func:`group_weight`) and the bookkeeping of a step
computed group by group (:meth:`Method.grouped_step`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from obow.backbones import Backbone
    from obow.config import Config
    from obow.data.folders import ImageList


@dataclass
class StepOutput:
    """One training step of a method: the loss to back-propagate and detached diagnostics (``metrics``, with
    ``"loss"`` among them), computed without extra passes; ``targets`` are what the student was asked to
    predict (OBoW: the BoW of every level; MoCo v2: the keys), for tests and inspection."""

    loss: Tensor
    metrics: dict[str, Tensor]
    targets: dict[str, Tensor] = field(default_factory=dict)


@dataclass
class GroupedStep:
    """What one call of :meth:`Method.forward` computes of its step (see :meth:`Method.grouped_step`)."""

    state: dict  # what every view group of the step shares (the teacher side)
    groups: list[int]  # the view groups whose loss terms this call computes
    first: bool  # this call computed ``state``: the step's own metrics belong to its output
    last: bool  # this call ends the step: no later group will use ``state``


#: How :func:`ema_update_` interpolates with a 0-d tensor momentum (a compiled step's): ``torch._foreach_lerp_``,
#: or ``Tensor.lerp_`` pair by pair where Dynamo computes the former otherwise than eager (torch 2.11: a multiply,
#: then an add; set by :class:`obow.training.step.compiled.CompiledStep` after
#: :func:`~obow.training.step.compiled.lerps_as_eager`). Both compute what the float momentum's update does, eagerly.
FOREACH_TENSOR_LERP = True


@torch.no_grad()
def ema_update_(averages: Iterable[Tensor], sources: Iterable[Tensor], momentum: float | Tensor) -> None:
    """``average <- momentum * average + (1 - momentum) * source`` in place, pair by pair.

    The teacher update of paper eq. 2 and MoCo's key-encoder update; the callers pass parameters only, so that
    the average's batch-norm statistics stay its own (official notes 2.10). ``momentum >= 1`` changes nothing.
    A 0-d tensor ``momentum`` (a compiled or graphed step's, :mod:`obow.training.step`; float64 so that
    ``1 - momentum`` is the host's double) is not read by the host: its ``1 - momentum`` is the interpolation
    weight, rounded to the averages' dtype as the host's float is (a weight of 0 leaves finite averages unchanged).
    """
    averages, sources = list(averages), [s.detach() for s in sources]
    if len(averages) != len(sources):
        raise ValueError(f"{len(averages)} averages for {len(sources)} sources: they must pair up")
    if not averages:  # _foreach_lerp_ rejects empty lists (a parameter-free network)
        return
    if isinstance(momentum, Tensor):
        weight = (1.0 - momentum).to(averages[0].dtype)
        # Eagerly (a graphed step), ``torch._foreach_lerp_`` reads a tensor weight on the host (``.item()``), which
        # a CUDA graph's capture refuses; ``Tensor.lerp_`` does not, and in a graph its launches cost nothing.
        if FOREACH_TENSOR_LERP and torch.compiler.is_compiling():
            torch._foreach_lerp_(averages, sources, weight)  # type: ignore[call-overload]  # a 0-d tensor weight: torch takes it, its stub lists scalars only
        else:
            for average, source in zip(averages, sources, strict=True):
                average.lerp_(source, weight)
    elif momentum < 1.0:
        torch._foreach_lerp_(averages, sources, 1.0 - momentum)


def whole_recipe(cfg: Any, method: str) -> Any:
    """``cfg`` when it is a whole recipe (:class:`~obow.config.Config`: ``load_config(...)``), which ``method``'s
    ``from_config`` reads beyond its model section; one line when it is a section of one."""
    if not hasattr(cfg, "model"):
        raise TypeError(
            f"{method}.from_config takes a whole recipe, load_config(...), not its {type(cfg).__name__}: it reads "
            "more than the model section"
        )
    return cfg


def check_views(teacher_images: Tensor, student_views: Sequence[Tensor]) -> list[Tensor]:
    """The student's view groups as ``[B, n, 3, h, w]`` tensors (a ``[B, 3, h, w]`` group gets ``n = 1``),
    checked against the teacher batch ``B``, all float images (:class:`~obow.data.transforms.OBoWViews` makes them)."""
    if isinstance(student_views, Tensor):  # iterating over it would take each image for a group
        raise ValueError(
            f"student_views must be a list of view groups, e.g. [crops] or [crops, patches], got one tensor of shape "
            f"{tuple(student_views.shape)}"
        )
    if len(student_views) == 0:
        raise ValueError("student_views must hold at least one group of views")
    named = [("teacher_images", teacher_images), *((f"student_views[{i}]", v) for i, v in enumerate(student_views))]
    for name, images in named:
        if not images.is_floating_point():
            raise ValueError(
                f"{name} must hold float images, normalised as OBoWViews makes them, got {images.dtype} (pixels as "
                "read from files: make the views with OBoWViews, or convert and normalise them as it does)"
            )
    batch = teacher_images.shape[0]
    groups = [v if v.dim() == 5 else v.unsqueeze(1) for v in student_views]
    for i, views in enumerate(groups):
        if views.dim() != 5 or views.shape[0] != batch:
            raise ValueError(
                f"student_views[{i}] must be [B, n, 3, h, w] or [B, 3, h, w] with B={batch} "
                f"(the teacher batch), got {tuple(student_views[i].shape)}"
            )
    return groups


def tensor_shapes(record: Any) -> list[torch.Size]:
    """The shapes of a dataclass of tensors (a method's host inputs)."""
    return [getattr(record, f.name).shape for f in dataclasses.fields(record)]


def group_weight(n: int, groups: Sequence[Tensor], loss_weighting: str) -> float:
    """The weight of a group of ``n`` views' mean loss: 1 (``group_sum``, official: the groups' means are
    summed) or ``n / all views`` (``view_mean``: a mean over every view)."""
    if loss_weighting == "group_sum":
        return 1.0
    return n / sum(v.shape[1] for v in groups)


class Method(nn.Module):
    """Base class of the pretraining methods (see the module docstring for the contract)."""

    #: The training loop may call :meth:`forward` group by group (``group=0, 1, ...``).
    supports_groups: ClassVar[bool] = True
    #: The ``train.compile`` modes this method's step supports (see the module docstring).
    step_modes: ClassVar[frozenset[str]] = frozenset({"off", "networks"})

    student: Backbone
    teacher: Backbone | None

    def __init__(self) -> None:
        super().__init__()
        self._pending: dict | None = None  # the shared side of a step computed group by group
        #: Compute the step's diagnostics: collapse and prediction (:mod:`obow.diagnostics`), and OBoW's targets'
        #: and prediction weights'. :meth:`begin_step` sets it (the training loop: on the steps it logs only; the
        #: effective rank's float64 SVD took 59 of a 101 ms GPU step, and each of the others is a few more kernel
        #: launches).
        self.diagnose = True
        #: The iteration of the step about to run, as the training loop counts it (:meth:`begin_step`; equal to the
        #: ``iteration`` buffer of the methods that keep one), so that a schedule read on every step does not read
        #: the device (a synchronisation on a GPU); ``None``: read the buffer.
        self.host_iteration: int | None = None
        #: The momentum of the step about to run as a 0-d float64 tensor, written in place by a compiled or graphed
        #: step (:meth:`use_momentum_input`) so that a changing value is neither a host value nor a recompilation;
        #: ``None``: the method computes it on the host.
        self.momentum_input: Tensor | None = None
        #: The random numbers of the step about to run that the method draws on the host
        #: (:meth:`draw_host_inputs`), on the device, written in place before each step of a compiled or graphed
        #: step (:meth:`write_host_inputs`); ``None``: the step draws them itself.
        self.host_inputs: Any = None

    def begin_step(self, logged: bool, iteration: int | None = None) -> None:
        """What the step about to run needs from the training loop, told before each step, whatever mode runs it
        (eager, compiled, graphed: :mod:`obow.training.step`): whether it is ``logged`` (it computes the
        diagnostics, :attr:`diagnose`) and its ``iteration`` (the steps done so far, as the loop counts them,
        :attr:`host_iteration`; ``None``: the method reads its own count)."""
        self.diagnose = logged
        self.host_iteration = iteration

    def realign_iteration(self, iteration: int) -> None:
        """Count the steps done as ``iteration``, where a resumed run's plan counts them otherwise than its
        checkpoint did (its steps per epoch changed with its images, ``data.on_change: continue``). The methods
        that keep an ``iteration`` buffer set it; nothing by default."""

    def synchronise_batchnorm(self) -> None:
        """The student's and the teacher's batch norm layers made ``SyncBatchNorm``: statistics over the batches of
        every process (``train.sync_batchnorm`` on several GPUs)."""
        self.student = nn.SyncBatchNorm.convert_sync_batchnorm(self.student)
        if self.teacher is not None:
            self.teacher = nn.SyncBatchNorm.convert_sync_batchnorm(self.teacher)

    def use_momentum_input(self, momentum: Tensor | None) -> None:
        """Read the teacher's momentum from the 0-d float64 tensor ``momentum`` (:attr:`momentum_input`), which a
        compiled or graphed step writes in place before each step; ``None``: compute it on the host."""
        self.momentum_input = momentum

    def write_host_inputs(self, student_views: Sequence[Tensor], device: torch.device) -> None:
        """Draw the host-drawn random numbers of the step about to run (:meth:`draw_host_inputs`: the same generator
        and order as the eager step) and write them into :attr:`host_inputs`, the tensors a compiled or graphed
        step reads (in place once they exist: a graph keeps reading the same memory)."""
        draws = self.draw_host_inputs(student_views)
        if draws is None:
            return
        held = self.host_inputs
        if held is None or tensor_shapes(held) != tensor_shapes(draws):
            self.host_inputs = draws.to(device)
        else:
            held.copy_(draws, non_blocking=True)

    def current_momentum(self) -> float:
        """The teacher's momentum for the step about to run, computed on the host (a compiled or graphed step
        writes it into :attr:`momentum_input`); the methods with ``step`` in :attr:`step_modes` define it."""
        raise NotImplementedError(f"{type(self).__name__} has no teacher momentum for a compiled or graphed step")

    def draw_host_inputs(self, student_views: Sequence[Tensor]) -> Any:
        """The random numbers the step about to run draws on the host, as tensors with ``.to(device)`` and an
        in-place ``.copy_(other)`` (OBoW's cut-mix boxes and permutations), or ``None``: nothing (the default)."""
        return None

    def prepare(self, images: ImageList, cfg: Config, device: torch.device) -> Any:
        """Once, before the first step of a new run; nothing by default."""
        return None

    def forward(
        self,
        teacher_images: Tensor,
        student_views: Sequence[Tensor],
        group: int | None = None,
        grad_scale: float = 1.0,
    ) -> StepOutput:
        raise NotImplementedError

    def grouped_step(self, group: int | None, num_groups: int, shared_side: Callable[[], dict]) -> GroupedStep:
        """The part of a step that this call of :meth:`forward` computes, and the state its groups share.

        ``group=None``: the whole step, ``shared_side()`` computed now. ``group=0``: computed now and kept for
        the later groups of the step; ``group=g > 0``: the kept state, refused when group 0 of this step never
        ran (``shared_side`` runs once a step: it updates the teacher). After the last group the state is
        dropped, so that the next step starts again at group 0.
        """
        if group is not None and not 0 <= group < num_groups:
            raise ValueError(f"group={group} is out of range for {num_groups} view groups")
        first = group is None or group == 0
        if first:
            state = shared_side()
        elif self._pending is None:
            raise RuntimeError("call forward with group=0 before the other groups of a step")
        else:
            state = self._pending
        last = group is None or group == num_groups - 1
        self._pending = None if last else state
        return GroupedStep(state, list(range(num_groups)) if group is None else [group], first, last)
