"""The demo's verdict on the pretext task: does the student beat the constant predictor (the batch's average BoW
for every image)? Read from hand-made log records, worked out by hand."""

import json

import pytest

from obow.experiments.demo import PREDICTION_SPREAD_SHARE, beats_constant_predictor, pretext_summary


def step(epoch, loss0, loss1, kl_mean, predicted, level="conv4"):
    return {
        "epoch": epoch,
        "iteration": 0,
        f"loss/group0/{level}": loss0,
        f"loss/group1/{level}": loss1,
        f"{level}/kl_to_mean_bow": kl_mean,
        f"{level}/predicted_kl_to_mean": predicted,
    }


def write_log(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_the_summary_reads_the_last_epoch_of_the_log(tmp_path):
    log = write_log(
        tmp_path / "log.jsonl",
        [
            step(1, 7.0, 5.0, 2.0, 0.3),
            {"type": "epoch", "epoch": 1, "loss": 3.0, "knn_top1": 20.0},
            step(2, 0.8, 0.6, 0.9, 0.2),
            step(2, 0.6, 0.4, 1.1, 0.4),
            {"type": "epoch", "epoch": 2, "loss": 1.0},
        ],
    )
    summary = pretext_summary(log, ("conv4",))
    assert summary["first_loss"] == pytest.approx(6.0)  # (7 + 5) / 2
    assert summary["last_epoch_loss"] == pytest.approx(0.6)  # mean of (0.8 + 0.6) / 2 and (0.6 + 0.4) / 2
    assert summary["last_epoch_average_bow_loss"] == pytest.approx(1.0)  # (0.9 + 1.1) / 2
    assert summary["last_epoch_predicted_kl_to_mean"] == pytest.approx(0.3)  # (0.2 + 0.4) / 2


def test_two_levels_are_averaged(tmp_path):
    records = [{**step(1, 1.0, 3.0, 2.0, 0.5), **step(1, 2.0, 4.0, 1.0, 0.1, level="conv5")}]
    summary = pretext_summary(write_log(tmp_path / "log.jsonl", records), ("conv4", "conv5"))
    assert summary["last_epoch_loss"] == pytest.approx(2.5)  # (1 + 3 + 2 + 4) / 4
    assert summary["last_epoch_average_bow_loss"] == pytest.approx(1.5)
    assert summary["last_epoch_predicted_kl_to_mean"] == pytest.approx(0.3)


def summary(loss, constant, spread):
    return {
        "first_loss": 7.0,
        "last_epoch_loss": loss,
        "last_epoch_average_bow_loss": constant,
        "last_epoch_predicted_kl_to_mean": spread,
    }


def test_a_student_below_the_constant_loss_with_spread_predictions_beats_it():
    verdict, sentence = beats_constant_predictor(summary(0.62, 0.80, 0.21))
    assert verdict is True
    assert sentence.startswith("The student beats the constant predictor")
    assert "loss 0.620 against 0.800" in sentence and "spread 0.210" in sentence


def test_the_collapsed_demo_of_before_does_not_beat_it():
    # the numbers of the demo's old recipe (last epoch: loss 1.03, average BoW 0.91, predictions spread ~0.01)
    verdict, sentence = beats_constant_predictor(summary(1.03, 0.91, 0.01))
    assert verdict is False
    assert "does NOT beat" in sentence and "not below" in sentence and "barely differ" in sentence


def test_a_lower_loss_with_predictions_that_barely_differ_is_not_enough():
    constant = 0.80
    just_under = PREDICTION_SPREAD_SHARE * constant * 0.99
    verdict, sentence = beats_constant_predictor(summary(0.70, constant, just_under))
    assert verdict is False and "barely differ" in sentence and "not below" not in sentence
    assert beats_constant_predictor(summary(0.70, constant, PREDICTION_SPREAD_SHARE * constant))[0] is True


def test_spread_predictions_with_a_loss_not_below_the_constant_one_are_not_enough():
    verdict, sentence = beats_constant_predictor(summary(0.80, 0.80, 0.5))  # equal is not below
    assert verdict is False and "not below" in sentence and "barely differ" not in sentence
