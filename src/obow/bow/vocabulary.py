"""Online vocabularies of visual words (paper section 3.1 and appendix "On-line k-means").

Every rule is a :class:`Vocabulary`: an ``nn.Module`` whose words ``[K, C]`` and statistics are registered
buffers, and whose :meth:`Vocabulary.update` is called once per training step, after that step's targets
were computed, with the border-free teacher map of the level, the distances and (for balanced k-means) the
Sinkhorn codes.

* :class:`QueueVocabulary`: a FIFO ring of ``K`` words; each step every image of the (global) batch pushes
  one feature: (a) ``"local"``, a random location; (b) ``"global_average"``, the average over locations;
  (c) ``"local_average"`` (default), a random location of the 3x3, stride-1, unpadded local average.
* :class:`KMeansVocabulary`: online k-means with exponential moving averages of counts ``N_k`` and sums
  ``M_k`` (``v_k = M_k / N_k``, VQ-VAE style), optionally replacing words that have not been any location's
  nearest word for ``rare_word_steps`` steps by a random local feature of the current batch; when the
  extractor's assignment is ``"sinkhorn"``, the balanced codes weight the statistics.

In a distributed run every process applies identical updates: sampled features are gathered in rank order,
statistics are summed over processes, and random replacements are drawn on rank 0 and broadcast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from obow import distributed as D
from obow.checks import check_choice, check_unit_interval
from obow.config.choices import QUEUE_SAMPLINGS
from obow.notices import counted

if TYPE_CHECKING:
    from obow.config import ModelConfig


def sample_one_feature_per_image(
    feature_map: Tensor, mode: str = "local_average", generator: torch.Generator | None = None
) -> Tensor:
    """One ``C``-dimensional feature per image of a ``[B, C, H, W]`` map (paper section 3.1, options a-c).

    The random locations come from ``generator`` when given (drawn on its device), else from torch's global
    generator for the map's device.
    """
    check_choice("queue_sampling", mode, QUEUE_SAMPLINGS)
    if mode == "global_average":
        return feature_map.mean(dim=(2, 3))
    if mode == "local_average":
        h, w = feature_map.shape[-2:]
        if h < 3 or w < 3:
            raise ValueError(
                f"queue_sampling='local_average' needs a map of at least 3x3 after border removal, got {h}x{w}; "
                "use larger teacher views, a stem with a smaller stride, or queue_sampling='local'"
            )
        feature_map = F.avg_pool2d(feature_map, kernel_size=3, stride=1, padding=0)
    b, c = feature_map.shape[:2]
    flat = feature_map.flatten(2)
    if generator is None:
        index = torch.randint(flat.shape[2], (b,), device=flat.device)
    else:
        index = torch.randint(flat.shape[2], (b,), device=generator.device, generator=generator).to(flat.device)
    return flat[torch.arange(b, device=flat.device), :, index]


class Vocabulary(nn.Module):
    """Base class: ``K`` words of dimension ``C``, initialised to ReLU'd Gaussian noise (official notes 2.5).

    Subclasses implement :meth:`update`, which returns a dict of diagnostics (possibly empty). With
    :attr:`record_intermediates` set, an update keeps what it added in :attr:`last_enqueued` (for debugging
    and reproduction; not saved in the ``state_dict``).
    """

    words: Tensor

    record_intermediates: bool = False
    last_enqueued: Tensor | None = None

    def __init__(self, num_words: int, num_channels: int) -> None:
        super().__init__()
        for name, value in (("num_words", num_words), ("num_channels", num_channels)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.num_words = num_words
        self.num_channels = num_channels
        self.register_buffer("words", torch.randn(num_words, num_channels).clamp_min_(0.0))

    def update(self, feature_map: Tensor, distances: Tensor, codes: Tensor | None) -> dict[str, Tensor]:
        """Refresh the words with one step's border-free teacher map ``[B, C, H, W]``.

        ``distances`` ``[B, H*W, K]`` are to the current words; ``codes`` are given for Sinkhorn assignment.
        """
        raise NotImplementedError


class QueueVocabulary(Vocabulary):
    """FIFO queue of the ``K`` most recently sampled teacher features (the paper's default vocabulary).

    Buffers: ``words`` and ``ptr`` (the slot the next feature goes to). The global batch must divide ``K``
    (official notes 2.5), which keeps every enqueued block contiguous. ``generator`` (also settable as an
    attribute) draws the random locations instead of torch's global generator, to reproduce a run's queue
    exactly; each process draws for its own images, and the words are then gathered in rank order.
    """

    ptr: Tensor

    def __init__(
        self,
        num_words: int,
        num_channels: int,
        sampling: str = "local_average",
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__(num_words, num_channels)
        check_choice("queue_sampling", sampling, QUEUE_SAMPLINGS)
        self.sampling = sampling
        self.generator = generator
        self.register_buffer("ptr", torch.zeros((), dtype=torch.long))

    @torch.no_grad()
    def update(self, feature_map: Tensor, distances: Tensor, codes: Tensor | None) -> dict[str, Tensor]:
        new_words = D.all_gather_cat(sample_one_feature_per_image(feature_map, self.sampling, self.generator))
        n = new_words.shape[0]
        if self.num_words % n != 0:
            raise ValueError(
                f"num_words={self.num_words} must be a multiple of the global batch size ({n} images "
                f"over {counted(D.world_size(), 'process', 'processes')}): the queue enqueues one word per image per "
                "step"
            )
        slots = (self.ptr + torch.arange(n, device=self.ptr.device)) % self.num_words
        self.words.index_copy_(0, slots, new_words.to(self.words.dtype))
        self.ptr.copy_((self.ptr + n) % self.num_words)
        if self.record_intermediates:
            self.last_enqueued = new_words
        return {}


class KMeansVocabulary(Vocabulary):
    """Online k-means with exponential moving averages (appendix, equations for ``N_k`` and ``M_k``).

    ``N_k <- gamma N_k + (1 - gamma) n_k`` and ``M_k <- gamma M_k + (1 - gamma) m_k`` with ``n_k``, ``m_k``
    the count and sum of the batch's local features assigned to word ``k`` (nearest word, or the Sinkhorn
    codes as weights); ``v_k = M_k / N_k``. Both start at zero, so a word jumps to the mean of its first
    assigned features (the ratio needs no bias correction); a word assigned nothing keeps its value.

    With ``rare_word_steps`` (paper: 1000), a word that has not been the nearest word of any location for
    more than that many steps is replaced by a random local feature of the current batch and its statistics
    reset. At most one replacement per image of the global batch per step; the stalest words go first.

    Buffers: ``words``, ``counts`` (``N``), ``sums`` (``M``), ``last_assigned`` and ``step``.
    """

    counts: Tensor
    sums: Tensor
    last_assigned: Tensor
    step: Tensor

    def __init__(
        self, num_words: int, num_channels: int, momentum: float = 0.99, rare_word_steps: int | None = 1000
    ) -> None:
        super().__init__(num_words, num_channels)
        check_unit_interval("kmeans_momentum", momentum, closed=False)
        if rare_word_steps is not None and (not isinstance(rare_word_steps, int) or rare_word_steps < 1):
            raise ValueError(f"rare_word_steps must be a positive integer or None, got {rare_word_steps!r}")
        self.momentum = float(momentum)
        self.rare_word_steps = rare_word_steps
        self.register_buffer("counts", torch.zeros(num_words))
        self.register_buffer("sums", torch.zeros(num_words, num_channels))
        self.register_buffer("last_assigned", torch.zeros(num_words, dtype=torch.long))
        self.register_buffer("step", torch.zeros((), dtype=torch.long))

    @torch.no_grad()
    def update(self, feature_map: Tensor, distances: Tensor, codes: Tensor | None) -> dict[str, Tensor]:
        k, c = self.num_words, self.num_channels
        features = feature_map.flatten(2).transpose(1, 2).reshape(-1, c)
        nearest = distances.reshape(-1, k).argmin(dim=1)
        if codes is None:
            # (not bincount, whose length depends on the data: one graph for a compiled step; exact below 2^24)
            batch_counts = torch.zeros(k, device=features.device).index_add_(
                0, nearest, torch.ones_like(features[:, 0])
            )
            batch_sums = torch.zeros(k, c, device=features.device).index_add_(0, nearest, features)
        else:
            weights = codes.reshape(-1, k)
            batch_counts = weights.sum(dim=0)
            batch_sums = weights.t() @ features
        batch_counts = D.all_reduce_sum(batch_counts)
        batch_sums = D.all_reduce_sum(batch_sums)
        g = self.momentum
        # (torch.add with alpha, one rounding as eager's add_(alpha=) has: torch 2.11's Dynamo splits Tensor.add_
        # with alpha into a multiply and an add, so a compiled step's statistics were 1 ulp off the eager ones)
        self.counts.copy_(torch.add(self.counts * g, batch_counts, alpha=1 - g))
        self.sums.copy_(torch.add(self.sums * g, batch_sums, alpha=1 - g))
        assigned = batch_counts > 0
        centroids = self.sums / self.counts.clamp_min(torch.finfo(self.counts.dtype).tiny).unsqueeze(1)
        self.words.copy_(torch.where(assigned.unsqueeze(1), centroids, self.words))

        self.step += 1
        # (index_fill_, not hit[nearest] = 1.0: that makes a tensor of the 1.0 on the host, which a CUDA graph refuses)
        hit = torch.zeros(k, device=features.device).index_fill_(0, nearest, 1.0)
        self.last_assigned.copy_(torch.where(D.all_reduce_max(hit) > 0, self.step, self.last_assigned))
        diagnostics = {"words_updated": assigned.float().mean()}
        if self.rare_word_steps is not None:
            diagnostics["rare_words_replaced"] = self._replace_rare_words(feature_map)
        return diagnostics

    def _replace_rare_words(self, feature_map: Tensor) -> Tensor:
        """Replace the stalest words that are rare by random local features of the batch; returns how many.

        Shapes do not depend on the data (no host read, and one graph for a compiled step): the ``n`` stalest words
        (``n``: the global batch, or ``K``) are the candidates, and those of them that are rare are replaced. The
        random draws (a location per image, a permutation of the batch) are made on every step, whether a word is
        rare or not, so that an eager step and a compiled one draw the same numbers."""
        stale = self.step - self.last_assigned
        candidates = D.all_gather_cat(sample_one_feature_per_image(feature_map, "local"))
        n = min(self.num_words, candidates.shape[0])
        choice = D.broadcast_(torch.randperm(candidates.shape[0], device=candidates.device)[:n])
        stalest = torch.argsort(stale, descending=True, stable=True)[:n]  # the rare ones first, stalest first
        assert self.rare_word_steps is not None  # replacement is on
        rare = (stale[stalest] > self.rare_word_steps).unsqueeze(1)
        words = torch.where(rare, candidates[choice].to(self.words.dtype), self.words[stalest])
        self.words.index_copy_(0, stalest, words)
        self.counts.index_copy_(0, stalest, torch.where(rare[:, 0], 0.0, self.counts[stalest]))
        self.sums.index_copy_(0, stalest, torch.where(rare, 0.0, self.sums[stalest]))
        self.last_assigned.index_copy_(0, stalest, torch.where(rare[:, 0], self.step, self.last_assigned[stalest]))
        return rare.sum().to(self.words.dtype)


def build_vocabulary(cfg: ModelConfig, num_channels: int) -> Vocabulary:
    """The online vocabulary ``cfg.vocabulary`` names, of ``cfg.num_words`` words of ``num_channels`` channels."""
    if cfg.vocabulary == "queue":
        return QueueVocabulary(cfg.num_words, num_channels, cfg.queue_sampling)
    return KMeansVocabulary(cfg.num_words, num_channels, cfg.kmeans_momentum, cfg.rare_word_steps)
