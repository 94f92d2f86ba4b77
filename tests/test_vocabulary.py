import numpy as np
import pytest
import torch
import torch.nn.functional as F

from obow.bow.targets import flatten_locations, squared_distances
from obow.bow.vocabulary import KMeansVocabulary, QueueVocabulary, sample_one_feature_per_image

from reference import np64


def _local_averages(fmap):
    """All 3x3 stride-1 unpadded averages of a [B, C, H, W] array, as [B, positions, C] (float64)."""
    b, c, h, w = fmap.shape
    out = [fmap[:, :, i : i + 3, j : j + 3].mean(axis=(2, 3)) for i in range(h - 2) for j in range(w - 2)]
    return np.stack(out, axis=1)


def test_queue_fifo_contents_with_wrap_around():
    k, c, b = 12, 5, 4
    vocab = QueueVocabulary(k, c, sampling="global_average")
    initial = np64(vocab.words).copy()
    expected = initial.copy()
    ptr = 0
    for _step in range(5):  # 20 words pushed into 12 slots: the pointer wraps around after 3 steps
        fmap = torch.randn(b, c, 3, 4)
        vocab.update(fmap, torch.empty(0), None)
        expected[ptr : ptr + b] = np64(fmap).mean(axis=(2, 3))
        ptr = (ptr + b) % k
        np.testing.assert_allclose(np64(vocab.words), expected, rtol=1e-6, atol=1e-6)
        assert int(vocab.ptr) == ptr
    # the oldest surviving words are from step 2 (slots 8..11); steps 3 and 4 overwrote slots 0..7
    assert int(vocab.ptr) == 8


@pytest.mark.parametrize("mode", ["local_average", "local"])
def test_queue_samples_one_candidate_per_image(mode):
    fmap = torch.randn(6, 4, 5, 7)
    got = np64(sample_one_feature_per_image(fmap, mode))
    cands = _local_averages(np64(fmap)) if mode == "local_average" else np64(flatten_locations(fmap))
    for i in range(6):
        assert np.abs(cands[i] - got[i]).max(axis=1).min() < 1e-6  # each word is one of its image's candidates


def test_local_average_sampling_draws_every_position():
    fmap = torch.arange(2 * 1 * 5 * 5, dtype=torch.float32).view(2, 1, 5, 5).repeat(200, 1, 1, 1)
    got = sample_one_feature_per_image(fmap, "local_average")[:, 0]
    expected = F.avg_pool2d(fmap[:2], 3, 1).flatten()
    assert set(got.tolist()) == set(expected.tolist())  # all 2 x 9 averages drawn, nothing else


def test_queue_errors():
    vocab = QueueVocabulary(10, 4)
    with pytest.raises(ValueError, match="num_words=10 must be a multiple of the global batch size"):
        vocab.update(torch.randn(4, 4, 5, 5), torch.empty(0), None)
    with pytest.raises(ValueError, match="at least 3x3"):
        QueueVocabulary(8, 4).update(torch.randn(4, 4, 2, 2), torch.empty(0), None)
    with pytest.raises(ValueError, match="queue_sampling='random'"):
        QueueVocabulary(8, 4, sampling="random")
    with pytest.raises(ValueError, match="num_words"):
        QueueVocabulary(0, 4)


def _kmeans_reference(features, words, counts, sums, gamma, weights=None):
    k = words.shape[0]
    if weights is None:
        d = ((features[:, None, :] - words[None]) ** 2).sum(-1)
        weights = np.eye(k)[d.argmin(1)]
    n = weights.sum(0)
    m = weights.T @ features
    counts = gamma * counts + (1 - gamma) * n
    sums = gamma * sums + (1 - gamma) * m
    new_words = words.copy()
    new_words[n > 0] = sums[n > 0] / counts[n > 0, None]
    return new_words, counts, sums


@pytest.mark.parametrize("sinkhorn", [False, True])
def test_kmeans_statistics_match_reference(sinkhorn):
    k, c = 6, 3
    vocab = KMeansVocabulary(k, c, momentum=0.9, rare_word_steps=None)
    words, counts, sums = np64(vocab.words), np.zeros(k), np.zeros((k, c))
    for _ in range(4):
        fmap = torch.randn(3, c, 2, 2) * 2
        feats = flatten_locations(fmap)
        dist = squared_distances(feats, vocab.words)
        codes = torch.softmax(-dist, -1) if sinkhorn else None
        w = np64(codes).reshape(-1, k) if sinkhorn else None
        words, counts, sums = _kmeans_reference(np64(feats).reshape(-1, c), words, counts, sums, 0.9, w)
        vocab.update(fmap, dist, codes)
        np.testing.assert_allclose(np64(vocab.counts), counts, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(np64(vocab.sums), sums, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np64(vocab.words), words, rtol=1e-5, atol=1e-5)


def test_kmeans_first_assignment_jumps_to_the_mean_and_unassigned_words_stay():
    vocab = KMeansVocabulary(2, 2, momentum=0.99, rare_word_steps=None)
    vocab.words.copy_(torch.tensor([[0.0, 0.0], [100.0, 100.0]]))
    fmap = torch.tensor([[1.0, 2.0], [3.0, 4.0]]).t().reshape(1, 2, 1, 2)  # features (1, 2) and (3, 4)
    dist = squared_distances(flatten_locations(fmap), vocab.words)
    vocab.update(fmap, dist, None)
    torch.testing.assert_close(vocab.words[0], torch.tensor([2.0, 3.0]))  # M/N cancels the EMA's bias
    torch.testing.assert_close(vocab.words[1], torch.tensor([100.0, 100.0]))


def test_rare_words_are_replaced_by_batch_features():
    k, c = 8, 3
    vocab = KMeansVocabulary(k, c, rare_word_steps=3)
    vocab.words.copy_(torch.full((k, c), 1000.0))
    vocab.words[0] = 0.0  # the only word near the data: the other 7 are never assigned
    replaced = []
    for step in range(1, 6):
        fmap = torch.rand(4, c, 2, 2)
        dist = squared_distances(flatten_locations(fmap), vocab.words)
        before = vocab.words.clone()
        diag = vocab.update(fmap, dist, None)
        replaced.append(int(diag["rare_words_replaced"]))
        if step == 4:  # 4 steps since their last assignment (never: step 0) > 3
            locals_ = np64(flatten_locations(fmap)).reshape(-1, c)
            for i in range(1, k):
                if not torch.equal(vocab.words[i], before[i]):
                    assert np.abs(locals_ - np64(vocab.words[i])).max(1).min() < 1e-6
                    assert float(vocab.counts[i]) == 0 and int(vocab.last_assigned[i]) == 4
    # at most one replacement per image (4) per step: 4 words at step 4, the remaining 3 at step 5
    assert replaced == [0, 0, 0, 4, 3]
    assert (vocab.words < 10).all()


def test_kmeans_errors():
    with pytest.raises(ValueError, match="rare_word_steps"):
        KMeansVocabulary(4, 2, rare_word_steps=0)
    with pytest.raises(ValueError, match="kmeans_momentum"):
        KMeansVocabulary(4, 2, momentum=1.0)
