import numpy as np
import pytest
import torch

from obow.bow import targets as bow
from obow.bow.targets import BoWExtractor
from obow.bow.vocabulary import QueueVocabulary

from reference import bow_targets as ref_bow_targets
from reference import np64
from reference import softmax as ref_softmax
from reference import squared_distances as ref_squared_distances


def test_remove_border_matches_slicing():
    x = torch.randn(2, 3, 7, 6)
    np.testing.assert_array_equal(bow.remove_border(x, 1).numpy(), x.numpy()[:, :, 1:-1, 1:-1])
    np.testing.assert_array_equal(bow.remove_border(x, 2).numpy(), x.numpy()[:, :, 2:-2, 2:-2])
    assert bow.remove_border(x, 0) is x
    with pytest.raises(ValueError, match="border=3"):
        bow.remove_border(x, 3)


def test_squared_distances_match_float64_reference():
    feats = torch.randn(3, 10, 16).relu() * 5
    words = torch.randn(32, 16).relu() * 5
    got = bow.squared_distances(feats, words)
    assert got.shape == (3, 10, 32)
    np.testing.assert_allclose(np64(got), ref_squared_distances(np64(feats), np64(words)), rtol=1e-5, atol=1e-3)
    # a feature equal to a word is at distance exactly >= 0 (clamped), never negative
    same = bow.squared_distances(words[:4].unsqueeze(0), words)
    assert (same >= 0).all() and torch.all(same[0, torch.arange(4), torch.arange(4)] < 1e-3)


def test_soft_and_hard_codes_match_reference():
    d = torch.rand(2, 5, 12) * 10
    np.testing.assert_allclose(np64(bow.soft_assignment(d, 0.7)), ref_softmax(-np64(d) / 0.7), rtol=1e-5, atol=1e-7)
    hard = bow.hard_assignment(d)
    np.testing.assert_array_equal(hard.numpy(), np.eye(12)[np64(d).argmin(-1)])


def test_pooling_and_l1_normalisation():
    codes = torch.rand(4, 9, 20)
    np.testing.assert_allclose(np64(bow.pool_codes(codes, "max")), np64(codes).max(1))
    np.testing.assert_allclose(np64(bow.pool_codes(codes, "avg")), np64(codes).mean(1), rtol=1e-6)
    y = bow.l1_normalize(codes.amax(1))
    np.testing.assert_allclose(np64(y), np64(codes).max(1) / np64(codes).max(1).sum(-1, keepdims=True), rtol=1e-6)
    with pytest.raises(ValueError, match="pooling='sum'"):
        bow.pool_codes(codes, "sum")


def test_ema_update():
    avg = torch.tensor(0.5)
    np.testing.assert_allclose(float(bow.ema_update(avg, torch.tensor(3.0), 0.99)), 0.99 * 0.5 + 0.01 * 3.0, rtol=1e-7)


def test_perplexity_matches_reference():
    t = torch.softmax(torch.randn(6, 30) * 3, dim=-1)
    batch, image = bow.bow_perplexity(t)
    p = np64(t)
    mean = p.mean(0)
    np.testing.assert_allclose(float(batch), np.exp(-(mean * np.log(mean)).sum()), rtol=1e-5)
    np.testing.assert_allclose(float(image), np.exp(-(p * np.log(p)).sum(-1)).mean(), rtol=1e-5)
    one_hot = torch.eye(4)
    b, i = bow.bow_perplexity(one_hot)
    assert float(i) == pytest.approx(1.0) and float(b) == pytest.approx(4.0)


@pytest.mark.parametrize("assignment", ["soft", "hard"])
@pytest.mark.parametrize("pooling", ["max", "avg"])
def test_extractor_matches_reference_over_several_steps(assignment, pooling):
    vocab = QueueVocabulary(16, 8, sampling="global_average")
    ext = BoWExtractor(vocab, delta_base=0.1, assignment=assignment, pooling=pooling, border=1).train()
    mu = 0.5
    for _ in range(3):
        fmap = torch.randn(4, 8, 5, 6).relu() * 2
        words = np64(vocab.words)  # the targets of a step use the vocabulary from before its update
        expected, mu = ref_bow_targets(np64(fmap), words, mu, 0.1, pooling=pooling, assignment=assignment)
        out = ext(fmap)
        np.testing.assert_allclose(np64(out.targets), expected, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(float(ext.min_distance_mean), mu, rtol=1e-5)
        torch.testing.assert_close(out.targets.sum(-1), torch.ones(4))
        assert (out.targets >= 0).all()


def test_eval_mode_changes_no_state():
    ext = BoWExtractor(QueueVocabulary(8, 4), delta_base=0.1).eval()
    before = {k: v.clone() for k, v in ext.state_dict().items()}
    ext(torch.randn(2, 4, 5, 5).relu())
    for k, v in ext.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)


def test_sinkhorn_codes_have_uniform_marginals():
    d = torch.rand(6, 20, 32) * 4  # 120 local features, 32 words
    codes = bow.sinkhorn_assignment(d, epsilon=0.5, iterations=50)
    m = 120
    q = np64(codes).reshape(m, 32) / m  # the transport plan Q^T
    np.testing.assert_allclose(q.sum(1), np.full(m, 1 / m), rtol=1e-3)  # every feature 1/M
    np.testing.assert_allclose(q.sum(0), np.full(32, 1 / 32), rtol=1e-3)  # every word 1/K
    # a plain softmax of the same scores is far from balanced, so the test can fail
    plain = ref_softmax(-np64(d).reshape(m, 32) / 0.5).sum(0) / m
    assert np.abs(plain - 1 / 32).max() > 1e-3


def test_sinkhorn_matches_reference_iterations():
    d = torch.rand(2, 8, 5) * 3
    eps, its = 0.4, 4
    q = np.exp(-np64(d).reshape(16, 5) / eps)
    for _ in range(its):
        q = q / q.sum(0, keepdims=True) / 5
        q = q / q.sum(1, keepdims=True) / 16
    expected = q * 16
    got = bow.sinkhorn_assignment(d, eps, its)
    np.testing.assert_allclose(np64(got).reshape(16, 5), expected, rtol=1e-4, atol=1e-7)


def test_cold_start_underflows_to_exact_zeros_but_stays_finite():
    """Fresh vocabulary (ReLU noise, unit scale), temperature statistic at 0.5, large features: the first
    codes are so sharp that float32 softmax underflows; targets must still be distributions."""
    ext = BoWExtractor(QueueVocabulary(256, 64), delta_base=1 / 15).train()
    fmap = torch.randn(8, 64, 7, 7).relu() * 3
    out = ext(fmap)
    assert (out.targets == 0).any(), "expected exact zeros at the cold start"
    assert torch.isfinite(out.targets).all()
    torch.testing.assert_close(out.targets.sum(-1), torch.ones(8))
    assert out.diagnostics["zero_target_share"] > 0


def test_diagnostics_words_used():
    words = torch.eye(4, 4)
    vocab = QueueVocabulary(4, 4)
    vocab.words.copy_(words)
    ext = BoWExtractor(vocab, border=0).eval()
    fmap = torch.zeros(1, 4, 1, 2)
    fmap[0, 0, 0, 0] = 1.0
    fmap[0, 2, 0, 1] = 1.0  # locations nearest to words 0 and 2
    out = ext(fmap)
    assert float(out.diagnostics["words_used"]) == pytest.approx(0.5)


def test_bad_arguments_name_the_parameter():
    vocab = QueueVocabulary(8, 4)
    with pytest.raises(ValueError, match="delta_base"):
        BoWExtractor(vocab, delta_base=0.0)
    with pytest.raises(ValueError, match="delta_base"):
        BoWExtractor(vocab, delta_base=-1.0)
    with pytest.raises(ValueError, match="assignment='fuzzy'"):
        BoWExtractor(vocab, assignment="fuzzy")
    with pytest.raises(ValueError, match="border"):
        BoWExtractor(vocab, border=-1)
    with pytest.raises(ValueError, match="sinkhorn_iterations"):
        BoWExtractor(vocab, sinkhorn_iterations=0)


def test_kl_to_mean_bow_matches_reference():
    t = torch.softmax(torch.randn(5, 12) * 2, dim=-1)
    p = np64(t)
    mean = p.mean(0)
    expected = np.mean([(row * np.log(row / mean)).sum() for row in p])
    np.testing.assert_allclose(float(bow.kl_to_mean_bow(t)), expected, rtol=1e-5)
    assert float(bow.kl_to_mean_bow(t[:1].repeat(4, 1))) == pytest.approx(0.0, abs=1e-6)


def test_prediction_diagnostics_match_a_float64_reference():
    from obow.bow.loss import prediction_diagnostics

    logits = torch.randn(6, 5, generator=torch.Generator().manual_seed(3)) * 2
    p = np64(torch.softmax(logits.double(), dim=-1))
    mean = p.mean(axis=0)
    kl = np.mean([np.sum(row * (np.log(row) - np.log(mean))) for row in p])
    perplexity_image = np.mean([np.exp(-np.sum(row * np.log(row))) for row in p])
    got = prediction_diagnostics(logits)
    np.testing.assert_allclose(float(got["predicted_kl_to_mean"]), kl, rtol=1e-5)
    np.testing.assert_allclose(float(got["predicted_perplexity_image"]), perplexity_image, rtol=1e-5)
    np.testing.assert_allclose(
        float(got["predicted_perplexity_batch"]), np.exp(-np.sum(mean * np.log(mean))), rtol=1e-5
    )
    # a student that predicts one BoW for every view: no spread, whatever that BoW is
    same = prediction_diagnostics(logits[:1].repeat(4, 1))
    assert float(same["predicted_kl_to_mean"]) == pytest.approx(0.0, abs=1e-6)
    assert float(same["predicted_perplexity_image"]) == pytest.approx(float(same["predicted_perplexity_batch"]))
