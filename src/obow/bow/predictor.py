"""BoW prediction heads: the dynamic weight generator (paper section 3.2) and a fixed linear head.

The student predicts the BoW of every level from its single ``pool5`` vector ``S(x~)`` (official notes 2.6):
``y_S(x~)[k] = softmax_k(kappa * <w_k, S(x~)>)`` with unit-norm weights ``w_k`` and an unnormalised
``S(x~)``: a scaled dot product, not a cosine (the authors report that normalising ``S`` costs a little).

* :class:`DynamicBoWPredictor`: ``w_k = G_l(v_k)``, one weight generator per level applied to the whole
  current vocabulary every step, so the head follows a vocabulary whose words are replaced constantly.
* :class:`FixedBoWPredictor`: free, learned ``w_k`` per word slot (the paper's Table 3 ablation); it cannot
  follow a refreshing queue, which is the point of the ablation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from obow import distributed as D
from obow.checks import check_positive

if TYPE_CHECKING:
    from obow.backbones import Backbone
    from obow.config import ModelConfig


class WeightGenerator(nn.Module):
    """``G(v)``: L2-normalise -> Linear(no bias) -> BatchNorm1d -> ReLU -> Linear -> L2-normalise.

    The hidden width is ``2 * feature_dim``. The batch norm's batch is the ``K`` words of the vocabulary.

    Every process holds the same vocabulary, so by default (as in the official code) every process runs the
    generator over all ``K`` words. With ``split=True`` and several processes, process ``r`` runs it over its
    ``K / world`` contiguous words only; the batch norm's statistics are summed over processes and the
    outputs gathered in rank order, both through differentiable collectives (``obow.distributed``), so the
    weights, their gradients (after DDP's averaging) and the batch norm's running statistics equal the
    unsplit computation's: each
    process does ``1 / world`` of the generator's work, plus three collectives.
    """

    def __init__(self, word_dim: int, feature_dim: int, split: bool = False) -> None:
        super().__init__()
        hidden = 2 * feature_dim
        self.fc1 = nn.Linear(word_dim, hidden, bias=False)
        self.bn = nn.BatchNorm1d(hidden)
        self.fc2 = nn.Linear(hidden, feature_dim)
        self.split = split

    def forward(self, words: Tensor) -> Tensor:
        world = D.world_size()
        if not (self.split and world > 1):
            hidden = F.relu(self.bn(self.fc1(F.normalize(words, dim=1))))
            return F.normalize(self.fc2(hidden), dim=1)
        k = words.shape[0]
        if k % world:
            raise ValueError(f"the generator split needs K={k} divisible by the {world} processes")
        mine = words.chunk(world)[D.rank()]
        hidden = F.relu(self._split_batch_norm(self.fc1(F.normalize(mine, dim=1)), k))
        out = F.normalize(self.fc2(hidden), dim=1)
        return D.all_gather_cat(out)

    def _split_batch_norm(self, x: Tensor, total: int) -> Tensor:
        """``self.bn`` over the ``total`` rows held by all processes together (``x``: this process's rows)."""
        bn = self.bn
        if not bn.training:
            return bn(x)
        mean = D.all_reduce_sum(x.sum(dim=0)) / total
        var = D.all_reduce_sum((x - mean).pow(2).sum(dim=0)) / total  # biased, as batch norm normalises
        with torch.no_grad():
            assert bn.num_batches_tracked is not None and bn.running_mean is not None and bn.running_var is not None
            bn.num_batches_tracked.add_(1)
            m = bn.momentum if bn.momentum is not None else 1.0 / float(bn.num_batches_tracked)
            bn.running_mean.lerp_(mean.detach(), m)
            bn.running_var.lerp_(var.detach() * total / (total - 1), m)  # unbiased, as nn.BatchNorm1d keeps
        return (x - mean) * torch.rsqrt(var + bn.eps) * bn.weight + bn.bias


class BoWPredictor(nn.Module):
    """Common interface: :meth:`weights` once per step, then :meth:`forward` for every student view group."""

    num_levels: int  # set by each predictor

    def __init__(
        self, kappa: float, normalize_features: bool = False, levels: int = 1, learn_kappa: bool = False
    ) -> None:
        super().__init__()
        check_positive("kappa", kappa)
        self.kappa = float(kappa)
        self.normalize_features = normalize_features
        # learn_kappa (the official code's option, off in its recipes): one learned scale per level, starting at
        # kappa and trained (and weight-decayed) with the head, as there; without it kappa is a constant.
        self.learned_kappa = nn.Parameter(torch.full((levels,), self.kappa)) if learn_kappa else None

    def kappas(self) -> list[Tensor | float]:
        """Each level's scale: the learned one, or the constant ``kappa``."""
        if self.learned_kappa is None:
            return [self.kappa for _ in range(self.num_levels)]
        return list(self.learned_kappa.unbind())

    def weights(self, vocabularies: Sequence[Tensor]) -> list[Tensor]:
        """Unit-norm prediction weights ``[K, c]`` for each level's vocabulary ``[K, C_l]``."""
        raise NotImplementedError

    def forward(self, features: Tensor, weights: Sequence[Tensor]) -> list[Tensor]:
        """Logits ``kappa * S(x~) W_l^T`` of shape ``[M, K]`` per level, from ``[M, c]`` student features.

        With ``normalize_features`` the features are L2-normalised first (cosine logits, bounded by kappa).
        """
        if self.normalize_features:
            features = F.normalize(features, dim=1)
        return [kappa * features @ w.t() for kappa, w in zip(self.kappas(), weights, strict=True)]


class DynamicBoWPredictor(BoWPredictor):
    """The dynamic BoW prediction head: one :class:`WeightGenerator` per BoW level."""

    def __init__(
        self,
        word_dims: Sequence[int],
        feature_dim: int,
        kappa: float = 8.0,
        normalize_features: bool = False,
        split_generator: bool = False,
        learn_kappa: bool = False,
    ) -> None:
        super().__init__(kappa, normalize_features, len(word_dims), learn_kappa)
        self.num_levels = len(word_dims)
        self.generators = nn.ModuleList(WeightGenerator(c, feature_dim, split_generator) for c in word_dims)

    def weights(self, vocabularies: Sequence[Tensor]) -> list[Tensor]:
        return [g(v) for g, v in zip(self.generators, vocabularies, strict=True)]


class FixedBoWPredictor(BoWPredictor):
    """A learned weight vector per word slot and level, L2-normalised and scaled by ``kappa`` like the
    dynamic head, so that the two differ only in where the weights come from (Table 3 ablation)."""

    def __init__(
        self,
        num_words: Sequence[int],
        feature_dim: int,
        kappa: float = 8.0,
        normalize_features: bool = False,
        learn_kappa: bool = False,
    ) -> None:
        super().__init__(kappa, normalize_features, len(num_words), learn_kappa)
        self.num_levels = len(num_words)
        self.slot_weights = nn.ParameterList(nn.Parameter(0.01 * torch.randn(k, feature_dim)) for k in num_words)

    def weights(self, vocabularies: Sequence[Tensor]) -> list[Tensor]:
        return [F.normalize(w, dim=1) for w in self.slot_weights]


def build_predictor(cfg: ModelConfig, student: Backbone) -> BoWPredictor:
    """The head ``cfg.head`` names: the dynamic weight generator or fixed per-word weights, for every level."""
    if cfg.head == "dynamic":
        word_dims = [student.level_channels[level] for level in cfg.levels]
        return DynamicBoWPredictor(
            word_dims, student.num_features, cfg.kappa, cfg.normalize_student, cfg.split_generator, cfg.learn_kappa
        )
    return FixedBoWPredictor(
        [cfg.num_words] * len(cfg.levels), student.num_features, cfg.kappa, cfg.normalize_student, cfg.learn_kappa
    )
