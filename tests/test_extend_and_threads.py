"""Extending a finished run (a larger optim.epochs), BoWNet resuming without its teacher file, the log's
density for short runs, and the training processes' thread count."""

import json
import shutil
from pathlib import Path

import pytest

from obow.config import load_config
from obow.schedules import learning_rate
from obow.training.loop import pretrain
from obow.training.run.logger import log_interval
from obow.training.run.state import RunError
from obow.training.run.threads import busy_machine_hint, choose_threads
from obow.weights.checkpoint import load_checkpoint

V1 = Path(__file__).parent / "data" / "v1_run"  # a narrow network, 24 images, batch 8: 3 steps an epoch


@pytest.fixture
def images(tmp_path):
    return shutil.copytree(V1 / "images", tmp_path / "images")


def config(images, *overrides):
    return load_config(V1 / "recipe.yaml", [f"data.path={images}", "train.keep_every=0", *overrides])


def steps(out):
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_finished_run_is_extended_with_a_larger_epoch_count(images, tmp_path, caplog):
    out = tmp_path / "run"
    assert pretrain(config(images, "optim.epochs=2"), out)["iteration"] == 6
    with pytest.raises(RunError, match=r"optim.lr: 0.05 -> 0.02.*optim.epochs may grow"):
        pretrain(config(images, "optim.epochs=3", "optim.lr=0.02"), out)
    with pytest.raises(RunError, match=r"optim.epochs: 2 -> 1"):
        pretrain(config(images, "optim.epochs=1"), out)
    cfg = config(images, "optim.epochs=4")
    with caplog.at_level("INFO", logger="obow"):
        result = pretrain(cfg, out)
    assert (result["epochs"], result["iteration"]) == (4, 12)
    assert "Extending the run from 2 to 4 epochs at iteration 6" in caplog.text
    records = steps(out)
    plans = [r for r in records if r.get("type") == "plan"]
    assert plans == [{"type": "plan", "iteration": 6, "epochs": 4, "previous_epochs": 2}]
    lrs = {r["iteration"]: r["lr"] for r in records if "type" not in r}
    o = cfg.optim
    for it in (7, 9, 12):  # the step that ends at iteration `it` ran at iteration it - 1 of the 4-epoch plan
        planned = learning_rate(it - 1, 3, base_lr=o.lr, epochs=4, warmup_epochs=o.warmup_epochs, end_lr=o.end_lr)
        assert lrs[it] == pytest.approx(planned)
    first = learning_rate(5, 3, base_lr=o.lr, epochs=2, warmup_epochs=o.warmup_epochs, end_lr=o.end_lr)
    assert lrs[6] == pytest.approx(first)  # the steps before the change kept the 2-epoch plan
    ckpt = load_checkpoint(out / "checkpoint.pt")
    assert ckpt["config"]["optim"]["epochs"] == 4 and [h["epoch"] for h in ckpt["history"]] == [1, 2, 3, 4]


def test_bownet_resumes_from_the_teacher_in_its_checkpoint(images, tmp_path):
    rotnet = tmp_path / "rotnet"
    pretrain(config(images, "optim.epochs=1", "model.method=rotnet"), rotnet)
    teacher = tmp_path / "teacher.pt"
    shutil.copy(rotnet / "checkpoint.pt", teacher)
    bownet = ["model.method=bownet", f"bownet.teacher={teacher}", "model.levels=[conv5]", "bownet.kmeans_images=24"]
    out = tmp_path / "bownet"
    pretrain(config(images, "optim.epochs=1", *bownet), out)
    before = load_checkpoint(out / "checkpoint.pt")["model"]
    teacher.unlink()
    result = pretrain(config(images, "optim.epochs=2", *bownet), out)
    assert result["iteration"] == 6
    after = load_checkpoint(out / "checkpoint.pt")["model"]
    teacher_keys = [k for k in before if k.startswith("teacher.")]
    assert teacher_keys and all((before[k] == after[k]).all() for k in teacher_keys)  # static teacher kept


def test_short_runs_log_often_enough_to_draw_a_curve():
    cfg = load_config(V1 / "recipe.yaml", ["train.log_every=20"])
    assert log_interval(cfg, 30) == 1 and log_interval(cfg, 500) == 5 and log_interval(cfg, 100_000) == 20


@pytest.mark.parametrize(
    ("overrides", "environ", "cores", "expected"),
    [
        ([], {}, 2, (2, "2 cores, 1 training process here")),
        (["data.num_workers=1"], {}, 2, (2, "2 cores, 1 training process here")),  # workers not subtracted
        (["data.num_workers=2"], {"LOCAL_WORLD_SIZE": "4"}, 64, (16, "64 cores, 4 training processes here")),
        ([], {"LOCAL_WORLD_SIZE": "4"}, 2, (1, "2 cores, 4 training processes here")),  # at least one
        (["data.num_workers=1"], {"OMP_NUM_THREADS": "3"}, 2, (3, "OMP_NUM_THREADS")),
        (["train.threads=5"], {"OMP_NUM_THREADS": "3"}, 2, (5, "train.threads")),
    ],
)
def test_threads_follow_the_cores_of_the_training_process(overrides, environ, cores, expected):
    cfg = load_config(V1 / "recipe.yaml", overrides)
    assert choose_threads(cfg, environ=environ, cores=cores) == expected


def test_busy_machine_hint_only_when_the_load_fills_the_cores_and_threads_were_chosen():
    assert busy_machine_hint(2, "2 cores, 1 training process here", load=1.9, cores=2) is None
    hint = busy_machine_hint(2, "2 cores, 1 training process here", load=2.4, cores=2)
    assert "load 2.4 on 2 cores" in hint and "OMP_NUM_THREADS=1" in hint
    assert busy_machine_hint(2, "OMP_NUM_THREADS", load=9.0, cores=2) is None  # the user chose
    assert busy_machine_hint(1, "2 cores, 2 training processes here", load=9.0, cores=2) is None
