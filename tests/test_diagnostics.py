"""Collapse diagnostics against NumPy and hand-worked cases."""

import numpy as np
import pytest
import torch

from obow.diagnostics import effective_rank, mean_pairwise_cosine


def numpy_effective_rank(x: np.ndarray) -> float:
    s = np.linalg.svd(x.astype(np.float64), compute_uv=False)
    p = s / s.sum()
    p = p[p > 0]
    return float(np.exp(-(p * np.log(p)).sum()))


def numpy_mean_cosine(x: np.ndarray) -> float:
    u = x / np.linalg.norm(x, axis=1, keepdims=True)
    c = u @ u.T
    n = len(x)
    return float((c.sum() - np.trace(c)) / (n * (n - 1)))


@pytest.mark.parametrize("shape", [(64, 16), (10, 40), (128, 512)])
def test_effective_rank_matches_numpy(shape):
    rng = np.random.default_rng(0)
    x = rng.normal(size=shape) * rng.uniform(0.1, 3.0, size=shape[1])  # an uneven spectrum
    assert float(effective_rank(torch.tensor(x, dtype=torch.float32))) == pytest.approx(
        numpy_effective_rank(x), rel=1e-5
    )


def test_effective_rank_hand_worked_cases():
    # rank one: a single singular value -> entropy 0 -> 1
    x = torch.outer(torch.arange(1.0, 9.0), torch.tensor([1.0, -2.0, 0.5]))
    assert float(effective_rank(x)) == pytest.approx(1.0, abs=1e-4)
    # orthogonal rows of equal norm: d equal singular values -> d
    assert float(effective_rank(3.0 * torch.eye(5))) == pytest.approx(5.0, rel=1e-6)
    # singular values 3 and 1: p = (3/4, 1/4)
    expected = np.exp(-(0.75 * np.log(0.75) + 0.25 * np.log(0.25)))
    assert float(effective_rank(torch.diag(torch.tensor([3.0, 1.0])))) == pytest.approx(expected, rel=1e-6)


def test_mean_cosine_matches_numpy_and_extremes():
    rng = np.random.default_rng(1)
    x = np.abs(rng.normal(size=(50, 32)))
    assert float(mean_pairwise_cosine(torch.tensor(x))) == pytest.approx(numpy_mean_cosine(x), rel=1e-6)
    same = torch.ones(6, 4) * torch.arange(1.0, 7.0)[:, None]  # one direction, different norms
    assert float(mean_pairwise_cosine(same)) == pytest.approx(1.0, abs=1e-6)
    assert float(mean_pairwise_cosine(torch.eye(4))) == pytest.approx(0.0, abs=1e-7)
    opposite = torch.tensor([[1.0, 0.0], [-1.0, 0.0]])
    assert float(mean_pairwise_cosine(opposite)) == pytest.approx(-1.0, abs=1e-7)


def test_bad_shapes_are_rejected():
    with pytest.raises(ValueError, match=r"\[N, D\]"):
        effective_rank(torch.ones(3))
    with pytest.raises(ValueError, match="N >= 2"):
        mean_pairwise_cosine(torch.ones(1, 3))


@pytest.mark.parametrize("interval", [1, 3, 4, 7])
def test_logged_steps_counts_what_logged_step_selects(interval):
    from obow.training.run.logger import logged_step, logged_steps

    for first in range(0, 15):
        for steps in range(0, 12):
            iterations = range(first + 1, first + steps + 1)
            expected = sum(logged_step(i, interval, i == first + steps) for i in iterations)
            assert logged_steps(first, steps, interval) == expected, (first, steps)


def test_a_run_computes_the_diagnostics_on_its_logged_steps_and_averages_them_per_epoch(
    tmp_path, tiny_recipe, write_images, read_log, monkeypatch
):
    """The effective rank's SVD costs more than a small GPU step, so only the logged steps compute it; the epoch
    record's value is the mean of theirs."""
    from obow.config import load_config
    from obow.training.loop import pretrain
    from obow.training.run import logger

    monkeypatch.setattr(logger, "MIN_LOGGED_STEPS", 1)  # a short run would otherwise log every step

    data = write_images(tmp_path / "data", per_class=10, size=20)  # 20 images, batch 4: 5 steps an epoch
    overrides = [f"data.path={data}", "data.batch_size=4", "optim.epochs=2", "train.log_every=2"]
    pretrain(load_config(tiny_recipe, [*overrides, "train.knn_every=0", "train.tensorboard=false"]), tmp_path / "r")
    records = read_log(tmp_path / "r")
    steps = [r for r in records if "type" not in r and "iteration" in r]
    assert [r["iteration"] for r in steps] == [2, 4, 5, 6, 8, 10]  # every 2nd step and each epoch's last
    assert all("student/effective_rank" in r for r in steps)
    epochs = [r for r in records if r.get("type") == "epoch"]
    for epoch, logged in zip(epochs, ([2, 4, 5], [6, 8, 10]), strict=True):
        values = [r["student/effective_rank"] for r in steps if r["iteration"] in logged]
        assert epoch["effective_rank"] == pytest.approx(np.mean(values), rel=1e-5)


def test_the_progress_bar_reads_the_loss_on_logged_steps_only():
    """On a GPU reading a step's loss waits for the device; the bar shows the last logged step's between them."""
    from obow.training.run.logger import Progress

    class Unread:
        def __float__(self):
            raise AssertionError("an unlogged step's loss was read")

    bar = Progress(enabled=True, desc="epoch 1", start=0, per_epoch=4, remaining_total=4)
    bar.update(8, {"loss": torch.tensor(2.5)}, 0.1, logged=True)
    bar.update(8, {"loss": Unread()}, 0.1, logged=False)
    assert bar.bar.postfix.startswith("step loss 2.500") and bar.bar.n == 2
    bar.update(8, {"loss": torch.tensor(1.25), "student/effective_rank": torch.tensor(3.0)}, 0.1, logged=True)
    assert bar.bar.postfix.startswith("step loss 1.250 rank 3.0")
    bar.close()
