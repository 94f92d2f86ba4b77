import math

import numpy as np
import pytest
import torch

from obow.evaluate.knn import knn_accuracy, knn_predict, knn_scores, topk_accuracy


def separable(num_classes=6, per_class=40, dim=32, noise=0.05, seed=0):
    """Class-specific orthonormal directions (the same for every seed) plus noise drawn from ``seed``."""
    directions = torch.linalg.qr(torch.randn(dim, dim, generator=torch.Generator().manual_seed(123)))[0]
    directions = directions[:num_classes]
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(num_classes).repeat_interleave(per_class)
    return directions[labels] + noise * torch.randn(len(labels), dim, generator=g), labels


def reference_knn(train, train_labels, test, k, temperature, num_classes):
    """Independent float64 NumPy weighted kNN: one query at a time, explicit loops over the neighbours."""
    train = train / np.linalg.norm(train, axis=1, keepdims=True)
    test = test / np.linalg.norm(test, axis=1, keepdims=True)
    scores = np.zeros((len(test), num_classes))
    for i, q in enumerate(test):
        sims = train @ q
        for j in np.argsort(-sims, kind="stable")[:k]:
            scores[i, train_labels[j]] += math.exp(sims[j] / temperature)
    return scores


def test_exact_on_separable_features():
    train, train_labels = separable(seed=0)
    test, test_labels = separable(per_class=25, seed=1)
    for k in (1, 20, 200):
        assert knn_accuracy(train, train_labels, test, test_labels, k=k) == 100.0
        assert torch.equal(knn_predict(train, train_labels, test, k=k), test_labels)


def test_chance_on_random_labels():
    g = torch.Generator().manual_seed(0)
    num_classes, queries = 10, 3000
    train = torch.randn(2000, 32, generator=g)
    train_labels = torch.randint(num_classes, (2000,), generator=g)
    test = torch.randn(queries, 32, generator=g)
    test_labels = torch.randint(num_classes, (queries,), generator=g)
    acc = knn_accuracy(train, train_labels, test, test_labels, k=20, num_classes=num_classes)
    p = 1 / num_classes
    sd = 100 * math.sqrt(p * (1 - p) / queries)  # binomial standard deviation, in percent
    assert abs(acc - 100 * p) < 4 * sd


def test_exponential_weighting_beats_majority_vote_by_hand():
    # query (1, 0); one class-0 neighbour at cosine 1, two class-1 neighbours at cosine 0.5
    train = torch.tensor([[1.0, 0.0], [0.5, math.sqrt(0.75)], [0.5, -math.sqrt(0.75)], [-1.0, 0.0]])
    labels = torch.tensor([0, 1, 1, 2])
    query = torch.tensor([[2.0, 0.0]])  # unnormalised on purpose
    scores = knn_scores(train, labels, query, k=3, temperature=0.1, num_classes=3)
    torch.testing.assert_close(scores, torch.tensor([[math.exp(10.0), 2 * math.exp(5.0), 0.0]]), rtol=1e-5, atol=0)
    assert knn_predict(train, labels, query, k=3, temperature=0.1).item() == 0  # exp(10) > 2 exp(5)
    # a large temperature makes every vote ~1: the majority (class 1) wins
    assert knn_predict(train, labels, query, k=3, temperature=100.0).item() == 1
    # only the k nearest vote: with k=1 the class-1 pair is not counted
    assert knn_scores(train, labels, query, k=1, num_classes=3)[0, 1].item() == 0.0


def test_matches_numpy_reference_and_chunking_changes_nothing():
    g = torch.Generator().manual_seed(3)
    train, test = torch.randn(300, 16, generator=g), torch.randn(50, 16, generator=g)
    labels = torch.randint(5, (300,), generator=g)
    expected = reference_knn(train.double().numpy(), labels.numpy(), test.double().numpy(), 20, 0.1, 5)
    for chunk in (7, 1024):
        got = knn_scores(train, labels, test, k=20, temperature=0.1, num_classes=5, chunk_size=chunk)
        np.testing.assert_allclose(got.double().numpy(), expected, rtol=1e-4)


def test_k_larger_than_memory_uses_every_feature():
    train, labels = separable(num_classes=2, per_class=3)
    query = train[:1]
    all_votes = knn_scores(train, labels, query, k=6)
    torch.testing.assert_close(knn_scores(train, labels, query, k=200), all_votes)


def test_topk_accuracy_counts_label_among_best():
    scores = torch.tensor([[0.1, 0.5, 0.4], [0.9, 0.05, 0.05], [0.2, 0.3, 0.5]])
    labels = torch.tensor([2, 0, 0])
    assert topk_accuracy(scores, labels, 1) == pytest.approx(100 / 3)
    assert topk_accuracy(scores, labels, 2) == pytest.approx(200 / 3)


def test_bad_arguments_raise():
    train, labels = separable(num_classes=2, per_class=3)
    with pytest.raises(ValueError, match="k must be"):
        knn_scores(train, labels, train, k=0)
    with pytest.raises(ValueError, match="temperature"):
        knn_scores(train, labels, train, temperature=0.0)
    with pytest.raises(ValueError, match="same c"):
        knn_scores(train, labels, train[:, :3])
