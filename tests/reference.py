"""Independent float64 NumPy re-computations of the OBoW formulas, written from the paper's equations."""

import numpy as np


def np64(t):
    return t.detach().cpu().double().numpy()


def squared_distances(features, words):
    # features [B, N, C], words [K, C]; direct difference, no expansion trick
    diff = features[:, :, None, :] - words[None, None, :, :]
    return (diff**2).sum(-1)


def softmax(x, axis=-1):
    x = x - x.max(axis=axis, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=axis, keepdims=True)


def log_softmax(x, axis=-1):
    x = x - x.max(axis=axis, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=axis, keepdims=True))


def bow_targets(fmap, words, mu, delta_base, momentum=0.99, border=1, pooling="max", assignment="soft"):
    """fmap [B, C, H, W]; returns (targets, new_mu). mu is updated with the batch before the codes."""
    if border:
        fmap = fmap[:, :, border:-border, border:-border]
    b, c = fmap.shape[:2]
    feats = fmap.reshape(b, c, -1).transpose(0, 2, 1)
    d = squared_distances(feats, words)
    mu = momentum * mu + (1 - momentum) * d.min(-1).mean()
    if assignment == "soft":
        codes = softmax(-d / (delta_base * mu))
    else:
        codes = np.eye(words.shape[0])[d.argmin(-1)]
    pooled = codes.max(1) if pooling == "max" else codes.mean(1)
    return pooled / pooled.sum(-1, keepdims=True), mu


def kl_loss(logits, targets):
    """mean over rows of sum_k t (log t - log softmax(z)), with 0 log 0 = 0."""
    logp = log_softmax(logits)
    tlogt = np.where(targets > 0, targets * np.log(np.where(targets > 0, targets, 1)), 0.0)
    return (tlogt - targets * logp).sum(-1).mean()


def weight_generator(words, w1, gamma, beta, w2, b2, eps=1e-5):
    """L2 -> fc1 -> batch norm over the K words (batch statistics, biased variance) -> ReLU -> fc2 -> L2."""
    v = words / np.linalg.norm(words, axis=1, keepdims=True)
    h = v @ w1.T
    h = (h - h.mean(0)) / np.sqrt(h.var(0) + eps) * gamma + beta
    h = np.maximum(h, 0) @ w2.T + b2
    return h / np.linalg.norm(h, axis=1, keepdims=True)
