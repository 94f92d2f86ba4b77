"""What stops or warns a run that has gone wrong: a non-finite loss (a diverging run) and a collapse.

A loss that becomes ``nan`` or ``inf`` (too high a learning rate: ``optim.lr=1e8``) makes every weight non-finite
within a step or two; a checkpoint written after it holds nothing worth resuming. :class:`RunGuard` notes the
first step whose loss is not finite, and the learning rate it ran at, on the device (a few tensor operations per
step, no wait for the device), and :meth:`RunGuard.check` reads it where the loop reads the device anyway: at the
logged steps and before every checkpoint, where it also checks that the weights are finite (an update can make
them so while its loss was finite), so that the run stops before a checkpoint holds the damage, with one line
naming the iteration, the learning rate and the checkpoint kept.

A collapse does not stop a run: the student's features all point one way (an effective rank near 1,
:func:`obow.diagnostics.effective_rank`; ``optim.lr=3`` reached 1.09) while the loss stays finite.
:meth:`RunGuard.logged` warns about it once, the first time a logged step's rank is under :data:`COLLAPSED_RANK`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from obow import distributed as D
from obow.training.run.state import RunError

log = logging.getLogger("obow")

#: An effective rank of the student's features under this is a collapse (1: one feature for every image).
COLLAPSED_RANK = 1.5


def kept_checkpoint(out: Path, iteration: int | None) -> str:
    """What a run stopped now keeps: its last checkpoint and the iteration it holds, or that there is none."""
    if iteration is None:
        return f"no checkpoint was written in {out} yet"
    return f"the last checkpoint, {out / 'checkpoint.pt'} (iteration {iteration}), is kept"


def all_finite(model: nn.Module) -> bool:
    """Whether every floating-point weight and buffer of ``model`` is finite (one wait for the device)."""
    tensors = [t for t in model.state_dict().values() if torch.is_floating_point(t)]
    return bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all()) if tensors else True


class RunGuard:
    """The first non-finite loss of a run and its learning rate, noted on the device (:meth:`note`, every step)
    and read on the host (:meth:`check`); the collapse warning (:meth:`logged`)."""

    def __init__(self) -> None:
        self.bad_iteration: torch.Tensor | None = None  # 0: every loss so far finite
        self.bad_lr: torch.Tensor | None = None
        self.last = (0, 0.0)  # the last step noted: its iteration and learning rate
        self.warned_collapse = False

    def note(self, loss: torch.Tensor, iteration: int, lr: float) -> None:
        """After the step that made ``iteration`` at learning rate ``lr``: remember it if its ``loss`` is the
        first that is not finite (on the loss's device, without reading it)."""
        if self.bad_iteration is None:
            self.bad_iteration = torch.zeros((), dtype=torch.int64, device=loss.device)
            self.bad_lr = torch.zeros((), dtype=torch.float64, device=loss.device)
        assert self.bad_lr is not None  # made with bad_iteration
        first = ~torch.isfinite(loss.detach()) & (self.bad_iteration == 0)
        self.bad_iteration = torch.where(first, iteration, self.bad_iteration)
        self.bad_lr = torch.where(first, lr, self.bad_lr)
        self.last = (iteration, lr)

    def check(self, out: Path, saved_at: int | None, device: torch.device, model: nn.Module | None = None) -> None:
        """A :class:`~obow.training.run.state.RunError` when a loss noted so far was not finite, or (given the
        ``model``, before a checkpoint) a weight or buffer of it is not: the last step's update may have made them
        so with a finite loss. On any process (one small all-reduce when distributed); the line names the
        iteration, the learning rate and the checkpoint kept."""
        iteration = int(self.bad_iteration) if self.bad_iteration is not None else 0
        weights_bad = model is not None and not iteration and not all_finite(model)
        if not any(D.agree_any([iteration > 0, weights_bad], device)):
            return
        if iteration:
            assert self.bad_lr is not None  # noted with the iteration
            what = f"the loss became non-finite at iteration {iteration} (learning rate {float(self.bad_lr):.3g})"
        elif weights_bad:
            what = f"the weights became non-finite by iteration {self.last[0]} (learning rate {self.last[1]:.3g})"
        else:
            what = "the loss or the weights became non-finite on another process"
        raise RunError(
            f"{what}: the run diverged and stops before a checkpoint keeps it; {kept_checkpoint(out, saved_at)}. "
            "Lower optim.lr (or use train.precision=fp32) and start again with another --out (a resume keeps the "
            "run's optim.lr)"
        )

    def logged(self, metrics: dict[str, float], iteration: int) -> None:
        """At a logged step: warn once when the student's features have collapsed."""
        rank = metrics.get("student/effective_rank")
        if self.warned_collapse or rank is None or not rank < COLLAPSED_RANK:
            return
        self.warned_collapse = True
        if D.is_main_process():
            log.warning(
                "the student's features have collapsed: effective rank %.2f at iteration %d (1: every image gives "
                "the same feature); the run goes on: lower optim.lr if the rank stays there",
                rank,
                iteration,
            )
