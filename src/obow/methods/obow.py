"""The OBoW model: student, EMA teacher, per-level BoW extractors, BoW prediction head and loss.

One call of :meth:`OBoW.forward` in training mode is the maths of one training step (official notes 2.1):

1. the teacher becomes ``alpha * teacher + (1 - alpha) * student`` (parameters only, paper eq. 2), with
   ``alpha`` from the cosine schedule at the current iteration;
2. the vocabularies ``V_t`` are snapshotted for the student's head;
3. the teacher maps the unperturbed images to one BoW target per level, updating the temperature
   statistics, then the vocabularies (so ``V_{t+1}`` only takes effect at the next step);
4. each group of student views (e.g. 2 x 160 px crops, 5 x 96 px patches) goes through the student on its
   own (cut-mixed with another image of the batch when ``cutmix``, its targets mixed by area), and its
   ``pool5`` features predict every level's BoW through the head over ``V_t``;
5. the loss: KL(target || prediction), averaged over a group's views and over levels, summed over groups
   (official notes 2.8); ``loss_weighting="view_mean"`` averages over all views instead.

The caller does the backward pass and the optimiser step.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import ClassVar, cast

import torch
from torch import Tensor, nn

from obow.backbones import Backbone, build_backbone
from obow.bow.loss import bow_loss, prediction_diagnostics
from obow.bow.predictor import BoWPredictor, build_predictor
from obow.bow.targets import BoWExtractor, BoWTargets, build_extractors
from obow.bow.vocabulary import build_vocabulary
from obow.checks import check_choice, check_unit_interval
from obow.config import Config, ModelConfig
from obow.config.choices import LOSS_WEIGHTINGS, MOMENTUM_SCHEDULES
from obow.data.cutmix import CutmixDraws, cutmix_masked, draw_cutmix, mix_targets
from obow.diagnostics import feature_diagnostics, mean_pairwise_cosine
from obow.methods.base import Method, StepOutput, check_views, ema_update_, group_weight
from obow.schedules import teacher_momentum


class OBoW(Method):
    """Student, EMA teacher, one :class:`~obow.bow.targets.BoWExtractor` per level and a BoW prediction head.

    Args:
        student: the backbone being trained; the teacher starts as an exact copy and never gets gradients.
        extractors: level name (e.g. ``"conv4"``) -> extractor holding that level's vocabulary.
        predictor: the head mapping ``pool5`` features to every level's BoW logits.
        total_iterations: length of the run, for the teacher momentum schedule.
        teacher_momentum: ``alpha`` at iteration 0 (0.99).
        teacher_momentum_schedule: ``"cosine"`` (to 1 at the end) or ``"constant"``.
        loss_weighting: ``"group_sum"`` (official) or ``"view_mean"``.
        cutmix: in training, cut-mix every student view group (one box and one permutation of the batch per
            group, :mod:`obow.data.cutmix`) and mix its BoW targets by area. The draws come from
            :attr:`cutmix_generator` when set (a CPU ``torch.Generator``), else from torch's global CPU
            generator (saved in checkpoints), all of a step's groups at its start, before the teacher side (a
            compiled or graphed step draws them before its graph, :meth:`draw_host_inputs`, and writes them into
            :attr:`~obow.methods.base.Method.host_inputs`).
    """

    iteration: Tensor
    teacher: Backbone  # always there (the EMA teacher)

    step_modes: ClassVar[frozenset[str]] = frozenset({"off", "networks", "step", "graph"})

    def __init__(
        self,
        student: Backbone,
        extractors: Mapping[str, BoWExtractor],
        predictor: BoWPredictor,
        *,
        total_iterations: int,
        teacher_momentum: float = 0.99,
        teacher_momentum_schedule: str = "cosine",
        loss_weighting: str = "group_sum",
        cutmix: bool = False,
    ) -> None:
        super().__init__()
        if not extractors:
            raise ValueError("extractors must hold at least one BoW level")
        if isinstance(total_iterations, bool) or not isinstance(total_iterations, int) or total_iterations < 1:
            raise ValueError(f"total_iterations must be a positive integer, got {total_iterations!r}")
        check_unit_interval("teacher_momentum", teacher_momentum)
        check_choice("teacher_momentum_schedule", teacher_momentum_schedule, MOMENTUM_SCHEDULES)
        check_choice("loss_weighting", loss_weighting, LOSS_WEIGHTINGS)
        self.student = student
        self.teacher = copy.deepcopy(student).requires_grad_(False)
        self.levels = tuple(extractors)
        self.extractors = nn.ModuleDict(extractors)
        self.predictor = predictor
        self.total_iterations = total_iterations
        self.base_momentum = float(teacher_momentum)
        self.momentum_schedule = teacher_momentum_schedule
        self.loss_weighting = loss_weighting
        self.cutmix = bool(cutmix)
        self.cutmix_generator: torch.Generator | None = None
        self.register_buffer("iteration", torch.zeros((), dtype=torch.long))

    @classmethod
    def from_config(cls, cfg: ModelConfig | Config, total_iterations: int) -> OBoW:
        """Assemble the model a :class:`~obow.config.ModelConfig` describes (a whole recipe's ``model`` section when
        given one, ``load_config(...)``)."""
        if isinstance(cfg, Config):
            cfg = cfg.model
        student = build_backbone(cfg.arch, cfg.stem, cfg.arch_options)
        extractors = build_extractors(cfg, student, lambda channels: build_vocabulary(cfg, channels))
        return cls(
            student,
            extractors,
            build_predictor(cfg, student),
            total_iterations=total_iterations,
            teacher_momentum=cfg.teacher_momentum,
            teacher_momentum_schedule=cfg.teacher_momentum_schedule,
            loss_weighting=cfg.loss_weighting,
            cutmix=cfg.cutmix,
        )

    def realign_iteration(self, iteration: int) -> None:
        """The ``iteration`` buffer (the steps done) set to ``iteration`` (:meth:`Method.realign_iteration
        <obow.methods.base.Method.realign_iteration>`)."""
        self.iteration.fill_(iteration)

    def current_momentum(self) -> float:
        """``alpha`` for the step about to run, at :attr:`host_iteration` when the loop gives it (:meth:`begin_step`;
        checked against the ``iteration`` buffer on the steps that compute diagnostics, which read the device
        anyway)."""
        iteration = self.host_iteration
        if iteration is None:
            iteration = int(self.iteration)
        elif self.diagnose and iteration != int(self.iteration):
            raise RuntimeError(f"host_iteration {iteration} is not the model's iteration {int(self.iteration)}")
        return teacher_momentum(iteration, self.total_iterations, self.base_momentum, self.momentum_schedule)

    @torch.no_grad()
    def update_teacher(self, momentum: float | Tensor) -> None:
        """``theta_T <- momentum * theta_T + (1 - momentum) * theta_S`` over parameters only; the teacher's
        batch-norm statistics are its own (official notes 2.10)."""
        ema_update_(self.teacher.parameters(), self.student.parameters(), momentum)

    @torch.no_grad()
    def teacher_targets(self, images: Tensor, update: bool | None = None) -> dict[str, BoWTargets]:
        """BoW targets of every level for the teacher's views ``[B, 3, H, W]``."""
        # a Backbone stops at the deepest level (conv5 is not run for conv4 alone); any other module runs whole
        teacher = self.teacher
        maps = teacher.maps(images, self.levels) if isinstance(teacher, Backbone) else teacher(images, self.levels).maps
        return {level: self.extractors[level](maps[level], update, self.diagnose) for level in self.levels}

    def forward(
        self,
        teacher_images: Tensor,
        student_views: Sequence[Tensor],
        group: int | None = None,
        grad_scale: float = 1.0,
    ) -> StepOutput:
        """One step's maths. ``student_views``: one tensor per view group, ``[B, n, 3, h, w]`` or ``[B, 3, h, w]``.

        In training mode this updates the teacher, the temperature statistics and the vocabularies.

        ``group=None`` computes the whole loss (sum over groups) in one graph. ``group=g`` computes group ``g``'s
        term only, so that the caller can back-propagate each group before the next one is built and hold the
        activations of one group at a time (the loss is a sum over groups). Call it for ``g = 0, 1, ...`` in
        order with the same arguments, each followed by ``backward()``: group 0 also runs the teacher side; the
        prediction weights ``G(V)`` are computed once, and the last call's loss carries their gradient from all
        groups (pass the loss scale as ``grad_scale`` when the backward passes are scaled, as with fp16).
        """
        groups = check_views(teacher_images, student_views)
        step = self.grouped_step(group, len(groups), lambda: self._teacher_side(teacher_images, groups))
        state = step.state
        if step.first and group is not None:  # (only then: a compiled whole step must not return such leaves)
            state["leaf_weights"] = [w.detach().requires_grad_(w.requires_grad) for w in state["weights"]]
        metrics = dict(state["metrics"]) if step.first else {}
        loss = teacher_images.new_zeros((), dtype=torch.float32)
        for g in step.groups:
            # Separate groups before the last use detached weights; their gradient is collected below.
            with_graph = group is None or g == len(groups) - 1
            weights = state["weights"] if with_graph else state["leaf_weights"]
            loss = loss + self._group_loss(g, groups, weights, state["bows"], state["cutmix"], metrics)
        metrics["loss"] = loss.detach()
        if group is not None and step.last:
            # dL/dG(V) accumulated by the earlier groups' backward passes, added through a surrogate that leaves
            # the loss value unchanged: this backward pass then carries the generator's whole gradient. (The
            # metric is taken before: with fp16, an overflowed earlier gradient makes the surrogate inf, and
            # inf - inf would report a NaN loss for a step that the gradient scaler simply skips.)
            earlier = [w.grad for w in state["leaf_weights"]]
            if all(e is not None for e in earlier):
                surrogate = sum((w * (e / grad_scale)).sum() for w, e in zip(state["weights"], earlier, strict=True))
                loss = loss + surrogate - surrogate.detach()
        return StepOutput(loss=loss, metrics=metrics, targets={k: b.targets for k, b in state["bows"].items()})

    def draw_host_inputs(self, student_views: Sequence[Tensor]) -> CutmixDraws | None:
        """The step's cut-mix draws when :attr:`cutmix` (on the CPU), else ``None``."""
        return self.draw_cutmix(student_views) if self.cutmix and self.training else None

    def draw_cutmix(self, groups: Sequence[Tensor]) -> CutmixDraws:
        """The step's cutmix draws for its view groups (``[B, n, 3, h, w]`` or ``[B, 3, h, w]``), on the CPU."""
        return draw_cutmix([(v.shape[0], v.shape[-2], v.shape[-1]) for v in groups], self.cutmix_generator)

    def _teacher_side(self, teacher_images: Tensor, groups: list[Tensor]) -> dict:
        """Cutmix draws, EMA update, BoW targets (and the vocabulary update), and the prediction weights over
        ``V_t``."""
        metrics: dict[str, Tensor] = {}
        cutmix = None
        if self.cutmix and self.training:
            cutmix = self.host_inputs
            if cutmix is None:
                cutmix = self.draw_cutmix(groups).to(teacher_images.device, non_blocking=True)
        if self.training:
            momentum = self.current_momentum() if self.momentum_input is None else self.momentum_input
            self.update_teacher(momentum)
            self.iteration += 1
            metrics["teacher_momentum"] = torch.as_tensor(momentum, dtype=torch.float32)
        vocabularies = [cast(BoWExtractor, self.extractors[level]).vocabulary.words.clone() for level in self.levels]
        bows = self.teacher_targets(teacher_images)
        for level, bow in bows.items():
            metrics.update({f"{level}/{k}": v for k, v in bow.diagnostics.items()})
        weights = self.predictor.weights(vocabularies)
        for level, w, kappa in zip(self.levels, weights, self.predictor.kappas(), strict=True):
            # Near 1, the weights share one direction and the logits kappa <w_k, S> differ little between words
            # however the student's feature varies: a common part adds the same logit to every word.
            if self.diagnose:
                metrics[f"{level}/weights_mean_cosine"] = mean_pairwise_cosine(w.detach())
            if isinstance(kappa, Tensor):  # model.learn_kappa
                metrics[f"{level}/kappa"] = kappa.detach().clone()
        return {
            "metrics": metrics,
            "bows": bows,
            "weights": weights,
            "cutmix": cutmix,
        }

    def _group_loss(
        self,
        g: int,
        groups: list[Tensor],
        weights: list[Tensor],
        bows: dict[str, BoWTargets],
        cutmix: CutmixDraws | None,
        metrics: dict,
    ) -> Tensor:
        """Group ``g``'s term: mean over its views and over levels, weighted as ``loss_weighting`` says."""
        views = groups[g]
        batch, n = views.shape[:2]
        targets = {level: bows[level].targets for level in self.levels}
        if cutmix is not None:
            perm = cutmix.perms[g]
            views, mix_weights = cutmix_masked(views, cutmix.boxes[g], cutmix.weights[g], perm)
            targets = {level: mix_targets(t, perm, mix_weights) for level, t in targets.items()}  # [B, n, K]
            metrics[f"cutmix/group{g}/weight"] = cutmix.weights[g].to(torch.float32)
        features = self.student(views.flatten(0, 1)).pool5
        if self.diagnose and g == 0 and features.shape[0] > 1:  # collapse diagnostics, on the first group's views
            metrics.update({f"student/{k}": v for k, v in feature_diagnostics(features).items()})
        logits = self.predictor(features, weights)
        level_losses = []
        for level, z in zip(self.levels, logits, strict=True):
            level_loss = bow_loss(z.view(batch, n, -1), targets[level])
            metrics[f"loss/group{g}/{level}"] = level_loss.detach()
            if self.diagnose and g == 0:  # can the student tell images apart yet? (predictions against targets)
                metrics.update({f"{level}/{k}": v for k, v in prediction_diagnostics(z).items()})
            level_losses.append(level_loss)
        group_loss = torch.stack(level_losses).mean()
        return group_loss * group_weight(n, groups, self.loss_weighting)
