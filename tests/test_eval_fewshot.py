import math

import numpy as np
import pytest
import torch

from obow.evaluate.fewshot import Episode, default_ways, prototype_accuracy, sample_episodes


def labels_of(sizes):
    return torch.tensor([c for c, n in enumerate(sizes) for _ in range(n)])


def as_lists(episodes):
    return [(e.support.tolist(), e.query.tolist(), e.classes) for e in episodes]


def test_episodes_reproducible_from_the_seed_and_different_with_another():
    labels = labels_of([10] * 20)
    kw = dict(n_way=5, n_shot=2, n_query=3, n_episodes=30)
    assert as_lists(sample_episodes(labels, **kw, seed=0)) == as_lists(sample_episodes(labels, **kw, seed=0))
    assert as_lists(sample_episodes(labels, **kw, seed=0)) != as_lists(sample_episodes(labels, **kw, seed=1))


def test_episode_structure():
    labels = labels_of([7, 9, 6, 8, 10, 6, 7])
    for e in sample_episodes(labels, n_way=4, n_shot=3, n_query=2, n_episodes=100, seed=3):
        assert len(set(e.classes)) == 4
        assert len(e.support) == 12 and len(e.query) == 8
        assert not set(e.support.tolist()) & set(e.query.tolist())
        assert len(set(e.support.tolist())) == 12 and len(set(e.query.tolist())) == 8
        for i, c in enumerate(e.classes):
            assert labels[e.support[3 * i : 3 * i + 3]].tolist() == [c] * 3
            assert labels[e.query[2 * i : 2 * i + 2]].tolist() == [c] * 2


def test_every_class_is_drawn():
    labels = labels_of([5] * 10)
    seen = {c for e in sample_episodes(labels, n_way=3, n_shot=1, n_episodes=50) for c in e.classes}
    assert seen == set(range(10))


def test_separable_features_score_100():
    num_classes, dim = 12, 32
    directions = torch.linalg.qr(torch.randn(dim, dim))[0][:num_classes]
    labels = labels_of([10] * num_classes)
    features = 5.0 * directions[labels] + 0.1 * torch.randn(len(labels), dim)
    episodes = sample_episodes(labels, n_way=10, n_shot=1, n_query=3, n_episodes=50)
    assert prototype_accuracy(features, labels, episodes) == (100.0, 0.0)


def test_random_features_score_one_over_n_way():
    labels = labels_of([20] * 30)
    features = torch.randn(len(labels), 64)
    n_way, n_query, n_episodes = 5, 15, 400
    episodes = sample_episodes(labels, n_way=n_way, n_shot=1, n_query=n_query, n_episodes=n_episodes)
    mean, _ = prototype_accuracy(features, labels, episodes)
    predictions = n_way * n_query * n_episodes
    sd = 100 * math.sqrt(0.2 * 0.8 / predictions)
    assert abs(mean - 100 / n_way) < 4 * sd


def numpy_episode_accuracy(features, support, query, n_way, n_shot):
    """Independent float64 cosine prototypical classifier."""
    f = features / np.linalg.norm(features, axis=1, keepdims=True)
    protos = f[support].reshape(n_way, n_shot, -1).mean(axis=1)
    protos /= np.linalg.norm(protos, axis=1, keepdims=True)
    predicted = np.argmax(f[query] @ protos.T, axis=1)
    truth = np.repeat(np.arange(n_way), len(query) // n_way)
    return 100.0 * np.mean(predicted == truth)


def test_mean_and_confidence_interval_match_numpy():
    labels = labels_of([12] * 15)
    features = torch.randn(len(labels), 16) + 0.8 * torch.randn(15, 16)[labels]  # weakly separable
    episodes = sample_episodes(labels, n_way=5, n_shot=5, n_query=2, n_episodes=60, seed=7)
    acc = np.array(
        [numpy_episode_accuracy(features.double().numpy(), e.support.numpy(), e.query.numpy(), 5, 5) for e in episodes]
    )
    assert 0 < acc.std()  # the interval is not trivially zero
    mean, ci = prototype_accuracy(features, labels, episodes)
    assert mean == pytest.approx(acc.mean())
    assert ci == pytest.approx(1.96 * np.std(acc) / np.sqrt(60))


def test_prototypes_use_the_mean_of_normalised_support():
    # class 0's support is a long (10, 0) and a short (0, 1) vector: normalised first, both directions count
    # equally and the prototype is (1, 1)/sqrt(2); averaged raw it would point along x, and query 4 would go
    # to class 1 (support (1, 0.2)) instead
    features = torch.tensor([[10.0, 0.0], [0.0, 1.0], [1.0, 0.2], [1.0, 0.2], [0.6, 1.0], [1.0, 0.1]])
    labels = torch.tensor([0, 0, 1, 1, 0, 1])
    episode = Episode(support=torch.tensor([0, 1, 2, 3]), query=torch.tensor([4, 5]), classes=(0, 1))
    assert prototype_accuracy(features, labels, [episode]) == (100.0, 0.0)
    swapped = Episode(support=torch.tensor([0, 1, 2, 3]), query=torch.tensor([5, 4]), classes=(0, 1))
    with pytest.raises(ValueError, match="do not match"):
        prototype_accuracy(features, labels, [swapped])  # the query order must follow the classes


def test_too_many_ways_names_the_numbers():
    with pytest.raises(ValueError, match=r"50-way episodes need 50 classes, but the data hold only 3"):
        sample_episodes(labels_of([10, 10, 10]), n_way=50, n_shot=1)


def test_too_many_shots_names_the_small_classes():
    names = ["cat", "dog", "eel"]
    with pytest.raises(ValueError, match=r"need 6 images per class.*2 of 3 classes.*'cat' \(4\), 'eel' \(5\)"):
        sample_episodes(labels_of([4, 9, 5]), n_way=2, n_shot=5, n_query=1, class_names=names)


def test_default_ways():
    assert default_ways(300) == 50 and default_ways(50) == 50 and default_ways(7) == 7
