"""Few-shot episodes with a cosine prototypical-network classifier (paper section 4.1 and appendix).

Protocol (appendix "Evaluation protocols in Section 4.1", official notes 5.2): 200 episodes; each draws
``n_way`` classes (50 in the paper) and, per class, ``n_shot`` support images (1 or 5) and ``n_query`` query
images (1), all distinct. Features are L2-normalised; a class prototype is the mean of its normalised
support features, re-normalised; a query goes to the prototype of highest cosine similarity. The score is
the mean accuracy over episodes, reported with its 95% confidence interval ``1.96 * std / sqrt(episodes)``.
The episodes are drawn once from a seed (the official code pre-samples them with seed 0), so two backbones
are compared on the same tasks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

#: The paper's number of ways, used whenever the data hold at least that many classes.
PAPER_WAYS = 50


@dataclass(frozen=True)
class Episode:
    """One few-shot task. Indices are class-major: ``support[i * n_shot:(i + 1) * n_shot]`` and
    ``query[i * n_query:(i + 1) * n_query]`` are images of ``classes[i]``."""

    support: Tensor
    query: Tensor
    classes: tuple[int, ...]

    @property
    def n_way(self) -> int:
        return len(self.classes)

    @property
    def n_shot(self) -> int:
        return self.support.numel() // self.n_way

    @property
    def n_query(self) -> int:
        return self.query.numel() // self.n_way


def default_ways(num_classes: int) -> int:
    """The paper's 50 ways, or all classes when there are fewer."""
    return min(PAPER_WAYS, num_classes)


def sample_episodes(
    labels: Tensor | Sequence[int],
    *,
    n_way: int,
    n_shot: int,
    n_query: int = 1,
    n_episodes: int = 200,
    seed: int = 0,
    class_names: Sequence[str] | None = None,
) -> list[Episode]:
    """Draw ``n_episodes`` episodes, reproducibly from ``seed``.

    Classes are drawn without replacement within an episode, and a class's support and query images
    without replacement too, so they are disjoint. ``class_names`` (index -> name) only makes the error
    messages readable.
    """
    for name, value, minimum in (("n_way", n_way, 1), ("n_shot", n_shot, 1), ("n_query", n_query, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if isinstance(n_episodes, bool) or not isinstance(n_episodes, int) or n_episodes < 1:
        raise ValueError(f"n_episodes must be a positive integer, got {n_episodes!r}")
    array = np.asarray(labels.tolist() if isinstance(labels, Tensor) else labels, dtype=np.int64)
    classes, counts = np.unique(array, return_counts=True)
    if n_way > len(classes):
        raise ValueError(f"{n_way}-way episodes need {n_way} classes, but the data hold only {len(classes)}")
    per_class = n_shot + n_query
    too_small = [(int(c), int(n)) for c, n in zip(classes, counts, strict=True) if n < per_class]
    if too_small:
        shown = ", ".join(f"{_class_name(c, class_names)} ({n})" for c, n in too_small[:10])
        more = f" and {len(too_small) - 10} more" if len(too_small) > 10 else ""
        raise ValueError(
            f"{n_shot}-shot episodes with {n_query} quer{'y' if n_query == 1 else 'ies'} need {per_class} images per "
            f"class, but {len(too_small)} of {len(classes)} classes have fewer (images in brackets): {shown}{more}"
        )
    members = {int(c): np.flatnonzero(array == c) for c in classes}
    rng = np.random.default_rng(seed)
    episodes = []
    for _ in range(n_episodes):
        chosen = rng.choice(classes, size=n_way, replace=False)
        picks = [rng.choice(members[int(c)], size=per_class, replace=False) for c in chosen]
        episodes.append(
            Episode(
                support=torch.from_numpy(np.concatenate([p[:n_shot] for p in picks])),
                query=torch.from_numpy(np.concatenate([p[n_shot:] for p in picks])),
                classes=tuple(int(c) for c in chosen),
            )
        )
    return episodes


def episode_accuracy(features: Tensor, episode: Episode) -> float:
    """Accuracy (percent) of the cosine prototype classifier on one episode's queries."""
    feats = F.normalize(features.float(), dim=1)
    support = feats[episode.support].view(episode.n_way, episode.n_shot, -1)
    prototypes = F.normalize(support.mean(dim=1), dim=1)
    predicted = (feats[episode.query] @ prototypes.T).argmax(dim=1)
    truth = torch.arange(episode.n_way).repeat_interleave(episode.n_query)
    return 100.0 * (predicted.cpu() == truth).float().mean().item()


def prototype_accuracy(features: Tensor, labels: Tensor, episodes: Sequence[Episode]) -> tuple[float, float]:
    """Mean accuracy over ``episodes`` and its 95% confidence half-width, both in percent.

    The half-width is ``1.96 * std / sqrt(n_episodes)`` with the population standard deviation (NumPy's
    default ``ddof=0``), the convention of the few-shot literature. ``labels`` is used to check that each
    episode's indices hold the classes it names.
    """
    if not episodes:
        raise ValueError("no episodes to evaluate")
    labels = torch.as_tensor(labels).long()
    accuracies = []
    for episode in episodes:
        expected = torch.tensor(episode.classes)
        if not (
            torch.equal(labels[episode.support], expected.repeat_interleave(episode.n_shot))
            and torch.equal(labels[episode.query], expected.repeat_interleave(episode.n_query))
        ):
            raise ValueError("an episode's indices do not match its classes: were they drawn from these labels?")
        accuracies.append(episode_accuracy(features, episode))
    acc = np.asarray(accuracies, dtype=np.float64)
    return float(acc.mean()), float(1.96 * acc.std() / np.sqrt(len(acc)))


def _class_name(index: int, class_names: Sequence[str] | None) -> str:
    return repr(class_names[index]) if class_names is not None else f"class {index}"
