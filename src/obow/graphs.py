"""CUDA graphs of a step, and their CPU stand-in: what captures a training step or a render once and replays it.

:class:`CudaStepGraph` is a ``torch.cuda.CUDAGraph``; :class:`TapeGraph` stands in for one where there is none (the
tests, a CPU dry run of a GPU pass): its capture runs the step while recording every operator it dispatches and
refuses (after the step) what a CUDA capture would refuse, a host read or a tensor made from host values; its
replay runs the recorded operators again on the recorded tensors, with every non-tensor argument frozen as
captured: what a CUDA graph replays. Used by :mod:`obow.training.step.graphed` (the training step) and
:func:`obow.data.batched_views.graphed_render` (the device pipeline's views).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CaptureError", "CudaStepGraph", "StepGraph", "TapeGraph"]

T = TypeVar("T")


class CaptureError(RuntimeError):
    """A step could not be captured. ``step_done``: the step was computed all the same (a tape's capture runs it,
    and finds what a CUDA capture would refuse only as it runs), with ``outputs`` its result."""

    def __init__(self, cause: str, step_done: bool = False, outputs: Any = None) -> None:
        super().__init__(cause)
        self.step_done = step_done
        self.outputs = outputs


class StepGraph(Protocol):
    """One captured step: :meth:`warmup` runs an eager step as a capture wants its warm-up run, :meth:`capture`
    captures ``fn`` and computes it once (returning its result), :meth:`replay` computes it again."""

    def warmup(self, fn: Callable[[], T]) -> T: ...

    def capture(self, fn: Callable[[], T]) -> T: ...

    def replay(self) -> None: ...


class CudaStepGraph:
    """A step as a ``torch.cuda.CUDAGraph``."""

    def __init__(self) -> None:
        self.graph = torch.cuda.CUDAGraph()

    def warmup(self, fn: Callable[[], T]) -> T:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            out = fn()
        torch.cuda.current_stream().wait_stream(stream)
        return out

    def capture(self, fn: Callable[[], T]) -> T:
        try:
            with torch.cuda.graph(self.graph):
                out = fn()
        except Exception as err:  # noqa: BLE001 - any failure of the capture makes the run go on eagerly
            raise CaptureError(f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}") from err
        self.graph.replay()  # a capture records the kernels without running them
        return out

    def replay(self) -> None:
        self.graph.replay()


#: Operators whose result the host reads (``.item()``, ``bool()``, ``.tolist()``): a CUDA capture refuses them.
HOST_READS = frozenset({"_local_scalar_dense", "is_nonzero", "equal"})
#: A tensor made from host values (``torch.tensor(x)``): on a GPU a copy from the host, which a capture refuses.
FROM_HOST = frozenset({"lift_fresh", "lift_fresh_copy"})


@dataclasses.dataclass
class _Op:
    func: Any
    args: tuple
    kwargs: dict
    outputs: list[Tensor | None]  # the results the capture made, each written again by a replay (None: an alias)


def _fresh_outputs(func: Any, out: Any) -> list[Tensor | None]:
    """``out``'s tensors, ``None`` for those that alias an input (views, in-place results: nothing to write)."""
    returns = func._schema.returns
    leaves = out if isinstance(out, (tuple, list)) else [out]
    if len(returns) == 1 and len(leaves) != 1 or isinstance(out, list):  # one returned list of tensors
        aliased = [returns[0].alias_info is not None] * len(leaves)
    else:
        aliased = [r.alias_info is not None for r in returns]
    return [None if a or not isinstance(t, Tensor) else t for t, a in zip(leaves, aliased, strict=False)]


class _Recorder(TorchDispatchMode):
    def __init__(self, tape: list[_Op], refusals: list[str]) -> None:
        super().__init__()
        self.tape = tape
        self.refusals = refusals

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in HOST_READS:
            self.refusals.append(f"the step reads the device on the host ({func})")
        elif name in FROM_HOST:
            self.refusals.append(f"the step makes a tensor from host values ({func}, e.g. torch.tensor)")
        out = func(*args, **kwargs)
        if func.namespace != "profiler":
            self.tape.append(_Op(func, args, kwargs, _fresh_outputs(func, out)))
        return out


class TapeGraph:
    """A CUDA graph's stand-in on any device (see the module docstring): the operators of one step, recorded as the
    step runs, replayed on the recorded tensors with the recorded non-tensor arguments."""

    def __init__(self) -> None:
        self.tape: list[_Op] = []

    def warmup(self, fn: Callable[[], T]) -> T:
        return fn()

    def capture(self, fn: Callable[[], T]) -> T:
        refusals: list[str] = []
        with _Recorder(self.tape, refusals):
            out = fn()
        if refusals:
            self.tape.clear()
            raise CaptureError(refusals[0], step_done=True, outputs=out)
        return out

    def replay(self) -> None:
        with torch.no_grad():
            for op in self.tape:
                result = op.func(*op.args, **op.kwargs)
                leaves = result if isinstance(result, (tuple, list)) else [result]
                for made, fresh in zip(op.outputs, leaves, strict=False):
                    if made is None:
                        continue
                    if made.shape != fresh.shape:
                        raise RuntimeError(
                            f"{op.func} made {tuple(fresh.shape)} where its capture made {tuple(made.shape)}"
                        )
                    made.copy_(fresh)

    @property
    def operators(self) -> int:
        """How many operators a replay runs (on a GPU: about the kernels a graph launches)."""
        return len(self.tape)
