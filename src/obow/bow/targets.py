"""Bag-of-visual-words targets from the teacher's feature maps (paper section 3.1, official notes 2.2-2.4).

For one level, the teacher map ``T(x)`` of shape ``[B, C, H, W]`` becomes a BoW target ``y_T(x)`` of
shape ``[B, K]``:

1. drop the border (one cell on every side by default, as BoWNet and the official code do);
2. squared Euclidean distances ``d_k(u) = ||T(x)[u] - v_k||^2`` of every location ``u`` to the ``K`` words;
3. assignment codes ``q(x)[u]``: soft ``softmax_k(-d_k(u) / delta)`` with the adaptive temperature
   ``delta = delta_base * mu_MSD`` (``mu_MSD``: exponential moving average of the mean squared distance to
   the nearest word), hard one-hot codes (the ablation of Table 3), or Sinkhorn-balanced codes (appendix);
4. reduce over locations by max pooling (average pooling as an option);
5. L1-normalise to a distribution over the ``K`` words.

The pure functions below do one step each; :class:`BoWExtractor` chains them and holds the per-level state
(the temperature statistic and the vocabulary).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from obow import distributed as D
from obow.bow.vocabulary import Vocabulary
from obow.checks import check_choice, check_positive, check_unit_interval
from obow.config.choices import ASSIGNMENTS, POOLINGS

if TYPE_CHECKING:
    from obow.backbones import Backbone
    from obow.config import ModelConfig


def at_least_float32(tensor: Tensor) -> Tensor:
    """Half-precision tensors in float32; float32 and float64 unchanged (float64 serves reference runs)."""
    return tensor.float() if tensor.dtype in (torch.float16, torch.bfloat16) else tensor


def remove_border(feature_map: Tensor, width: int = 1) -> Tensor:
    """Drop ``width`` cells on each side of a ``[B, C, H, W]`` map (official notes 2.2)."""
    if width == 0:
        return feature_map
    h, w = feature_map.shape[-2:]
    if h <= 2 * width or w <= 2 * width:
        raise ValueError(
            f"a {h}x{w} feature map has no interior left after removing border={width}; "
            "use larger views, a stem with a smaller stride, or a smaller border"
        )
    return feature_map[..., width:-width, width:-width]


def flatten_locations(feature_map: Tensor) -> Tensor:
    """``[B, C, H, W]`` -> ``[B, H*W, C]``: one row per location."""
    return feature_map.flatten(2).transpose(1, 2)


def squared_distances(features: Tensor, words: Tensor) -> Tensor:
    """Squared Euclidean distances ``||u - v_k||^2`` of ``[B, N, C]`` features to ``[K, C]`` words.

    Expanded as ``||u||^2 + ||v||^2 - 2 <u, v>`` so that nothing larger than the ``[B, N, K]`` result is
    materialised. Rounding can make the expansion slightly negative; it is clamped at zero.
    """
    b, n, c = features.shape
    flat = features.reshape(b * n, c)
    word_sq = (words * words).sum(dim=1)
    dist = torch.addmm(word_sq.unsqueeze(0), flat, words.t(), beta=1.0, alpha=-2.0)
    dist += (flat * flat).sum(dim=1, keepdim=True)
    return dist.clamp_min_(0.0).view(b, n, -1)


def soft_assignment(distances: Tensor, delta: float | Tensor) -> Tensor:
    """Soft codes ``softmax_k(-d_k / delta)`` over the last dimension (paper, soft-assignment equation)."""
    return torch.softmax(distances / -delta, dim=-1)


def hard_assignment(distances: Tensor) -> Tensor:
    """One-hot codes of the nearest word (BoWNet's hard assignment, Table 3 ablation)."""
    return F.one_hot(distances.argmin(dim=-1), distances.shape[-1]).to(distances.dtype)


def sinkhorn_assignment(distances: Tensor, epsilon: float | Tensor, iterations: int) -> Tensor:
    """Balanced codes from entropic optimal transport (appendix, "Enforcing uniform assignments").

    Solves ``min_Q <Q, D> + epsilon * sum Q log Q`` with every word receiving ``1/K`` of the mass and every
    local feature ``1/M`` (``M`` local features in the whole, possibly distributed, batch), by ``iterations``
    rounds of Sinkhorn-Knopp in the log domain. The last half-step normalises each feature's code, so the
    returned ``[..., K]`` codes are distributions; the words' totals approach ``M/K`` as iterations grow.
    """
    k = distances.shape[-1]
    log_q = at_least_float32(distances.reshape(-1, k)) / -epsilon
    m_total = D.all_reduce_sum(log_q.new_full((), float(log_q.shape[0])))
    for _ in range(iterations):
        # Words: every row of Q (here a column of log_q) must carry 1/K of the mass, summed over all processes.
        local = torch.logsumexp(log_q, dim=0)
        per_word = torch.logsumexp(D.all_gather_cat(local.unsqueeze(0)), dim=0)
        log_q = log_q - per_word - math.log(k)
        # Features: every local feature carries 1/M of the mass.
        log_q = log_q - torch.logsumexp(log_q, dim=1, keepdim=True) - torch.log(m_total)
    codes = torch.softmax(log_q, dim=1)  # the final feature normalisation, scaled so each code sums to one
    return codes.to(distances.dtype).view_as(distances)


def pool_codes(codes: Tensor, mode: str = "max") -> Tensor:
    """Reduce ``[B, N, K]`` codes over the ``N`` locations: channel-wise max (default) or average."""
    check_choice("pooling", mode, POOLINGS)
    return codes.amax(dim=1) if mode == "max" else codes.mean(dim=1)


def l1_normalize(bow: Tensor, eps: float = 1e-12) -> Tensor:
    """``y[k] = y~[k] / sum_k' y~[k']`` (non-negative inputs)."""
    return bow / bow.sum(dim=-1, keepdim=True).clamp_min(eps)


def ema_update(average: Tensor, value: Tensor, momentum: float) -> Tensor:
    """``momentum * average + (1 - momentum) * value`` (no bias correction, as the official code)."""
    return average * momentum + value * (1.0 - momentum)


def entropy(p: Tensor, dim: int = -1) -> Tensor:
    """Shannon entropy in nats with ``0 log 0 = 0``."""
    return -torch.special.xlogy(p, p).sum(dim=dim)


def bow_perplexity(targets: Tensor) -> tuple[Tensor, Tensor]:
    """Perplexities of ``[B, K]`` BoW targets: of the batch's mean BoW, and the mean of per-image ones."""
    return entropy(targets.mean(dim=0)).exp(), entropy(targets).exp().mean()


def kl_to_mean_bow(targets: Tensor) -> Tensor:
    """``mean_i KL(y_i || mean_j y_j)`` over a ``[B, K]`` batch of targets.

    The loss of a student that ignores its input and predicts the batch's average BoW; a student whose loss
    is not below it has learnt nothing image-specific. Equal to ``H(mean_i y_i) - mean_i H(y_i)``.
    """
    return entropy(targets.mean(dim=0)) - entropy(targets).mean()


def target_diagnostics(targets: Tensor, nearest: Tensor, num_words: int, gather: bool = False) -> dict[str, Tensor]:
    """How informative one step's ``[B, K]`` targets are: the perplexities of :func:`bow_perplexity`,
    :func:`kl_to_mean_bow`, the share of zero entries, and ``words_used``: the share of the ``num_words`` words that
    are the nearest word of at least one location (``nearest``: word indices), over all processes when ``gather``."""
    used = torch.zeros(num_words, device=targets.device)
    used[nearest.flatten()] = 1.0
    batch_perplexity, image_perplexity = bow_perplexity(targets)
    return {
        "words_used": (D.all_reduce_max(used) if gather else used).mean(),
        "perplexity_batch": batch_perplexity,
        "perplexity_image": image_perplexity,
        "kl_to_mean_bow": kl_to_mean_bow(targets),
        "zero_target_share": (targets == 0).float().mean(),
    }


@dataclass
class BoWTargets:
    """What the teacher side of one level produces in one step."""

    targets: Tensor  # [B, K] distributions
    diagnostics: dict[str, Tensor]


class BoWExtractor(nn.Module):
    """Turns a teacher feature map into BoW targets over a vocabulary, and keeps that level's state.

    State (registered buffers, saved in ``state_dict``): ``min_distance_mean`` (``mu_MSD``) and whatever
    the vocabulary holds.

    Order within a training step (official notes 2.3, 2.5): the temperature statistic is updated with the
    current batch before the codes are computed; the vocabulary is updated after the targets, so student and
    teacher use the same vocabulary ``V_t`` within a step. ``update=False`` (or eval mode) changes nothing.

    With :attr:`record_intermediates` set (for debugging and reproduction), each call keeps its step's
    intermediates in :attr:`intermediates`: ``"codes"`` ``[B, N, K]``, ``"distances"`` ``[B, N, K]``,
    ``"nearest"`` ``[B, N]`` and, after an update of a queue, ``"enqueued"``: the words it added ``[B, C]``.

    Args:
        vocabulary: the update rule and its words (see :mod:`obow.bow.vocabulary`).
        delta_base: ``delta = delta_base * mu_MSD`` (1/15 for the ResNet-50 recipe, 1/10 for ResNet-18).
        assignment: ``"soft"`` (paper), ``"hard"`` (ablation) or ``"sinkhorn"`` (balanced k-means codes).
        pooling: ``"max"`` (paper) or ``"avg"``.
        border: cells dropped on each side of the map before anything else.
        temperature_momentum: momentum of the ``mu_MSD`` moving average (0.99).
        temperature_init: initial ``mu_MSD`` (0.5 in the official code, whatever the feature scale), or
            ``None`` to start from the first training batch's statistic instead (no cold start).
        sinkhorn_epsilon: entropic regularisation, relative to ``mu_MSD`` like ``delta_base``.
        sinkhorn_iterations: Sinkhorn-Knopp rounds.
    """

    min_distance_mean: Tensor

    def __init__(
        self,
        vocabulary: Vocabulary,
        *,
        delta_base: float = 1 / 15,
        assignment: str = "soft",
        pooling: str = "max",
        border: int = 1,
        temperature_momentum: float = 0.99,
        temperature_init: float | None = 0.5,
        sinkhorn_epsilon: float = 1 / 15,
        sinkhorn_iterations: int = 3,
    ) -> None:
        super().__init__()
        check_positive("delta_base", delta_base)
        check_choice("assignment", assignment, ASSIGNMENTS)
        check_choice("pooling", pooling, POOLINGS)
        if not isinstance(border, int) or border < 0:
            raise ValueError(f"border must be an integer >= 0, got {border!r}")
        check_unit_interval("temperature_momentum", temperature_momentum, closed=False)
        if temperature_init is not None:
            check_positive("temperature_init", temperature_init)
        check_positive("sinkhorn_epsilon", sinkhorn_epsilon)
        if not isinstance(sinkhorn_iterations, int) or sinkhorn_iterations < 1:
            raise ValueError(f"sinkhorn_iterations must be an integer >= 1, got {sinkhorn_iterations!r}")
        self.vocabulary = vocabulary
        self.delta_base = float(delta_base)
        self.assignment = assignment
        self.pooling = pooling
        self.border = border
        self.temperature_momentum = float(temperature_momentum)
        self.sinkhorn_epsilon = float(sinkhorn_epsilon)
        self.sinkhorn_iterations = sinkhorn_iterations
        initial = float("nan") if temperature_init is None else float(temperature_init)
        self.register_buffer("min_distance_mean", torch.tensor(initial))
        self.intermediates: dict[str, Tensor] = {}

    @property
    def record_intermediates(self) -> bool:
        return self.vocabulary.record_intermediates

    @record_intermediates.setter
    def record_intermediates(self, value: bool) -> None:
        self.vocabulary.record_intermediates = bool(value)
        self.intermediates = {}

    @property
    def num_words(self) -> int:
        return self.vocabulary.num_words

    @torch.no_grad()
    def forward(self, feature_map: Tensor, update: bool | None = None, diagnose: bool = True) -> BoWTargets:
        """Targets ``[B, K]`` for the teacher map ``[B, C, H, W]``; updates the state when ``update``.

        ``update`` defaults to ``self.training``. All of it runs in float32 (float64 for float64 maps),
        whatever autocast says. ``diagnose=False`` leaves out the targets' diagnostics (perplexities,
        ``kl_to_mean_bow``, ``words_used``, ``zero_target_share``): the training loop computes them on the steps
        it logs only, as each is a few more kernels per step. The temperature's (``temperature_stat``, ``delta``,
        ``batch_msd``) and the vocabulary's are always there.
        """
        update = self.training if update is None else update
        with torch.autocast(feature_map.device.type, enabled=False):
            interior = remove_border(at_least_float32(feature_map), self.border)
            features = flatten_locations(interior)
            words = self.vocabulary.words
            distances = squared_distances(features, words)
            min_dist, nearest = distances.min(dim=-1)
            batch_msd = D.all_reduce_mean(min_dist.mean()) if update else min_dist.mean()
            # NaN marks "start from the first batch's statistic" (temperature_init=None).
            uninitialised = self.min_distance_mean.isnan()
            mu = torch.where(uninitialised, batch_msd, self.min_distance_mean)
            if update:
                mu = torch.where(uninitialised, mu, ema_update(mu, batch_msd, self.temperature_momentum))
                self.min_distance_mean.copy_(mu)
            scale = self.delta_base * mu
            if self.assignment == "soft":
                codes = soft_assignment(distances, scale)
            elif self.assignment == "hard":
                codes = hard_assignment(distances)
            else:
                codes = sinkhorn_assignment(distances, self.sinkhorn_epsilon * mu, self.sinkhorn_iterations)
            targets = l1_normalize(pool_codes(codes, self.pooling))

            diagnostics = {"temperature_stat": mu.clone(), "delta": scale.clone(), "batch_msd": batch_msd}
            if diagnose:
                diagnostics.update(target_diagnostics(targets, nearest, self.num_words, gather=update))
            if self.record_intermediates:
                self.intermediates = {"codes": codes, "distances": distances, "nearest": nearest}
            if update:
                self.vocabulary.last_enqueued = None
                extra = self.vocabulary.update(interior, distances, codes if self.assignment == "sinkhorn" else None)
                diagnostics.update(extra)
                if self.record_intermediates and self.vocabulary.last_enqueued is not None:
                    self.intermediates["enqueued"] = self.vocabulary.last_enqueued
        return BoWTargets(targets=targets, diagnostics=diagnostics)


def build_extractors(
    cfg: ModelConfig, student: Backbone, vocabulary: Callable[[int], Vocabulary]
) -> dict[str, BoWExtractor]:
    """One extractor per level of ``cfg.levels``, with ``cfg``'s target settings; ``vocabulary(channels)`` makes
    each level's vocabulary for the width of the ``student``'s map there (OBoW: the online rule ``cfg``
    names, :func:`~obow.bow.vocabulary.build_vocabulary`; BoWNet: its static k-means words)."""
    return {
        level: BoWExtractor(
            vocabulary(student.level_channels[level]),
            delta_base=cfg.delta_base,
            assignment=cfg.assignment,
            pooling=cfg.pooling,
            border=cfg.border,
            temperature_momentum=cfg.temperature_momentum,
            temperature_init=cfg.temperature_init,
            sinkhorn_epsilon=cfg.sinkhorn_epsilon,
            sinkhorn_iterations=cfg.sinkhorn_iterations,
        )
        for level in cfg.levels
    }
