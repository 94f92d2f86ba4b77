import numpy as np
import pytest
import torch

from obow.bow.predictor import DynamicBoWPredictor, FixedBoWPredictor, WeightGenerator

from reference import np64
from reference import weight_generator as ref_weight_generator


def test_weight_generator_matches_reference_and_has_unit_norm_outputs():
    gen = WeightGenerator(word_dim=12, feature_dim=6).train()
    torch.nn.init.normal_(gen.bn.weight, 1.0, 0.3)
    torch.nn.init.normal_(gen.bn.bias, 0.0, 0.3)
    words = torch.randn(40, 12).relu()
    out = gen(words)
    assert out.shape == (40, 6)
    torch.testing.assert_close(out.norm(dim=1), torch.ones(40))
    expected = ref_weight_generator(
        np64(words),
        np64(gen.fc1.weight),
        np64(gen.bn.weight),
        np64(gen.bn.bias),
        np64(gen.fc2.weight),
        np64(gen.fc2.bias),
    )
    np.testing.assert_allclose(np64(out), expected, rtol=1e-4, atol=1e-5)
    assert gen.fc1.bias is None and gen.fc1.out_features == 12  # hidden width 2c, no bias before the BN


def test_weight_generator_is_invariant_to_the_scale_of_words():
    gen = WeightGenerator(8, 4).eval()
    words = torch.randn(10, 8).relu() + 0.1
    torch.testing.assert_close(gen(words), gen(words * 37.0))


def test_dynamic_logits_are_kappa_times_dot_products_with_unnormalised_features():
    head = DynamicBoWPredictor(word_dims=[16, 32], feature_dim=8, kappa=5.0).train()
    vocabs = [torch.randn(20, 16).relu(), torch.randn(20, 32).relu()]
    features = torch.randn(7, 8) * 3  # not normalised, on purpose (official notes 2.6)
    weights = head.weights(vocabs)
    logits = head(features, weights)
    for w, z in zip(weights, logits, strict=True):
        np.testing.assert_allclose(np64(z), 5.0 * np64(features) @ np64(w).T, rtol=1e-5, atol=1e-5)
    # permuting the words permutes the logits (the dynamic head is equivariant to word order)
    perm = torch.randperm(20)
    head.eval()
    z1 = head(features, head.weights([v[perm] for v in vocabs]))[0]
    z0 = head(features, head.weights(vocabs))[0]
    torch.testing.assert_close(z1, z0[:, perm])


def test_fixed_head_ignores_the_vocabulary():
    head = FixedBoWPredictor(num_words=[20], feature_dim=8, kappa=8.0)
    features = torch.randn(3, 8)
    a = head(features, head.weights([torch.randn(20, 4)]))[0]
    b = head(features, head.weights([torch.randn(20, 4)]))[0]
    torch.testing.assert_close(a, b)
    w = head.weights([torch.empty(0)])[0]
    torch.testing.assert_close(w.norm(dim=1), torch.ones(20))


def test_kappa_must_be_positive():
    with pytest.raises(ValueError, match="kappa"):
        DynamicBoWPredictor([4], 4, kappa=0.0)


def test_normalised_student_features_give_cosine_logits_bounded_by_kappa():
    head = DynamicBoWPredictor(word_dims=[16], feature_dim=8, kappa=5.0, normalize_features=True).train()
    features = torch.randn(6, 8) * 30
    w = head.weights([torch.randn(20, 16).relu()])[0]
    z = head(features, [w])[0]
    f = np64(features) / np.linalg.norm(np64(features), axis=1, keepdims=True)
    np.testing.assert_allclose(np64(z), 5.0 * f @ np64(w).T, rtol=1e-5, atol=1e-5)
    assert z.abs().max() <= 5.0 + 1e-5


@pytest.mark.parametrize("head_kind", ["dynamic", "fixed"])
def test_learned_kappa_scales_each_level_and_gets_its_gradient(head_kind):
    """model.learn_kappa: one learned scale per level, starting at kappa; the logits are that scale times the
    dot products, and d(sum of logits)/d(kappa_l) = sum of level l's dot products."""
    if head_kind == "dynamic":
        head = DynamicBoWPredictor(word_dims=[16, 32], feature_dim=8, kappa=5.0, learn_kappa=True).train()
    else:
        head = FixedBoWPredictor(num_words=[20, 20], feature_dim=8, kappa=5.0, learn_kappa=True)
    assert head.learned_kappa.tolist() == [5.0, 5.0] and head.learned_kappa.requires_grad
    with torch.no_grad():
        head.learned_kappa.copy_(torch.tensor([2.0, 7.0]))
    features = torch.randn(7, 8) * 3
    weights = [w.detach() for w in head.weights([torch.randn(20, 16).relu(), torch.randn(20, 32).relu()])]
    logits = head(features, weights)
    dots = [np64(features) @ np64(w).T for w in weights]
    for kappa, z, d in zip([2.0, 7.0], logits, dots, strict=True):
        np.testing.assert_allclose(np64(z), kappa * d, rtol=1e-5, atol=1e-5)
    sum(z.sum() for z in logits).backward()
    np.testing.assert_allclose(np64(head.learned_kappa.grad), [d.sum() for d in dots], rtol=1e-4)


def test_kappa_is_a_constant_unless_learned():
    head = DynamicBoWPredictor(word_dims=[16], feature_dim=8, kappa=5.0)
    assert head.learned_kappa is None and "learned_kappa" not in head.state_dict()
    assert head.kappas() == [5.0]
