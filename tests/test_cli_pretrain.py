"""The real command line: pretraining writes checkpoints and logs, resumes after a kill to the same weights,
trains through unreadable and unusual images, and rejects bad settings with clear errors.

Most commands run in this process (``obow_cli``); the kill and the interrupt need a process of their own."""

import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from obow.weights.checkpoint import load_checkpoint


def popen_cli(*args, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "obow.cli", *map(str, args)], env=env, **kwargs)


def wait_for_iteration(out: Path, iteration: int, read_log, proc: subprocess.Popen, timeout: float = 300) -> None:
    """Poll ``out/log.jsonl`` until ``iteration`` is logged; fail if the process ends or the time runs out first."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (out / "log.jsonl").exists() and any(r["iteration"] >= iteration for r in read_log(out)):
            return
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (exit {proc.returncode}) before iteration {iteration} was logged")
        time.sleep(0.01)
    proc.kill()
    raise AssertionError(f"iteration {iteration} was not logged within {timeout} s")


def test_pretrain_writes_checkpoint_logs_and_monitor(tiny_run, obow_cli, read_log, tmp_path):
    assert "New run" in tiny_run.result.err and "done: 2 epochs" in tiny_run.result.out
    out = tiny_run.out
    ckpt = load_checkpoint(out / "checkpoint.pt")
    assert (ckpt["epoch"], ckpt["batch_in_epoch"], ckpt["iteration"]) == (2, 0, 6)
    assert {"model", "optimizer", "rng", "config", "history"} <= set(ckpt)
    assert "extractors.conv4.vocabulary.words" in ckpt["model"] and int(ckpt["model"]["iteration"]) == 6
    assert ckpt["config"]["optim"]["epochs"] == 2
    records = read_log(out)
    steps = [r for r in records if "type" not in r]
    epochs = [r for r in records if r.get("type") == "epoch"]
    assert [r["iteration"] for r in steps] == [1, 2, 3, 4, 5, 6]
    for r in steps:
        assert np.isfinite(r["loss"]) and {"lr", "teacher_momentum", "conv4/perplexity_batch"} <= set(r)
    assert [r["epoch"] for r in epochs] == [1, 2]
    assert all(0 <= r["knn_top1"] <= 100 and 0 < r["monitor_time_s"] < r["epoch_time_s"] + 60 for r in epochs)
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert "optim:" in (out / "config.yaml").read_text()
    # running the same command again (on a copy of the shared run): the run is complete, nothing is redone
    again = tiny_run.copy(tmp_path / "again")
    args = [str(again) if str(a) == str(out) else a for a in tiny_run.args]
    assert "is finished (6 of 6 iterations)" in obow_cli(*args).err
    assert load_checkpoint(again / "checkpoint.pt")["iteration"] == 6
    assert read_log(again) == records


@pytest.mark.slow  # a real process: CI runs it (--runslow)
def test_killed_run_resumes_to_the_same_weights(tmp_path, tiny_recipe, write_images, obow_cli, read_log):
    data = write_images(tmp_path / "data", per_class=40)  # 80 images: 10 iterations per epoch, 20 in all
    args = ["pretrain", "--config", tiny_recipe, "--data", data, "optim.epochs=2", "train.checkpoint_every=1"]
    args += ["train.knn_every=0", "train.tensorboard=false"]
    obow_cli(*args, "--out", tmp_path / "whole")

    out = tmp_path / "killed"
    proc = popen_cli(*args, "--out", out, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # iteration 12 logged: the checkpoint of iteration 11 (epoch 2, batch 1) is written; the kill lands before
    # the end of epoch 2 (iteration 20) unless 8 more steps slip in between two polls
    wait_for_iteration(out, 12, read_log, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    partial = load_checkpoint(out / "checkpoint.pt")
    assert partial["epoch"] == 1 and partial["batch_in_epoch"] > 0, "the kill should land in the middle of epoch 2"

    resumed = obow_cli(*args, "--out", out)
    assert "Resuming" in resumed.err
    whole = load_checkpoint(tmp_path / "whole" / "checkpoint.pt")
    done = load_checkpoint(out / "checkpoint.pt")
    assert done["iteration"] == whole["iteration"] == 20
    for name, value in whole["model"].items():
        assert torch.equal(value, done["model"][name]), name
    assert [r["iteration"] for r in read_log(out) if "type" not in r] == list(range(1, 21))


@pytest.mark.slow  # a real process: CI runs it (--runslow)
def test_interrupt_writes_a_mid_epoch_checkpoint(tmp_path, tiny_recipe, write_images, read_log):
    data = write_images(tmp_path / "data", per_class=40)
    out = tmp_path / "run"
    args = ["pretrain", "--config", tiny_recipe, "--data", data, "--out", out, "train.tensorboard=false"]
    proc = popen_cli(*args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_iteration(out, 2, read_log, proc)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "Interrupted: checkpoint written" in stderr
    ckpt = load_checkpoint(out / "checkpoint.pt")
    assert ckpt["epoch"] == 0 and 2 <= ckpt["batch_in_epoch"] < 10
    assert ckpt["iteration"] == ckpt["batch_in_epoch"]


def test_unreadable_and_unusual_images_are_converted_or_skipped(
    tmp_path, tiny_recipe, write_images, obow_cli, read_log
):
    data = write_images(tmp_path / "data", per_class=6)
    odd = data / "class1"
    rng = np.random.default_rng(3)
    pixels = rng.integers(0, 255, size=(32, 32, 3), dtype=np.uint8)
    Image.fromarray(pixels[..., 0]).save(odd / "gray.png")
    Image.fromarray(pixels).convert("CMYK").save(odd / "cmyk.jpg")
    Image.fromarray(np.dstack([pixels, pixels[..., :1]])).save(odd / "rgba.png")
    Image.fromarray(pixels).save(odd / "webp.webp")
    Image.fromarray(pixels).save(odd / "bitmap.bmp")
    (odd / "corrupt.jpg").write_bytes(rng.integers(0, 255, size=500, dtype=np.uint8).tobytes())
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG")
    (odd / "truncated.jpg").write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    out = tmp_path / "run"
    proc = obow_cli(
        "pretrain", "--config", tiny_recipe, "--data", data, "--out", out,
        "optim.epochs=1", "data.num_workers=1", "train.knn_every=0", "train.tensorboard=false",
    )  # fmt: skip
    skipped = load_checkpoint(out / "checkpoint.pt")["skipped_images"]
    assert sorted(Path(p).name for p in skipped) == ["corrupt.jpg", "truncated.jpg"]
    assert "skipped image" in proc.err and "corrupt.jpg" in proc.err
    last = [r for r in read_log(out) if r.get("type") == "epoch"][-1]
    assert last["skipped_images"] == 2


def test_bad_settings_and_data_give_clear_errors(tmp_path, tiny_recipe, write_images, obow_cli):
    data = write_images(tmp_path / "data", per_class=4)

    def refused(*args, out="a"):
        proc = obow_cli("pretrain", "--config", tiny_recipe, "--out", tmp_path / out, *args, check=False)
        assert proc.code == 2, proc.err
        return proc.err

    assert "unknown key 'optim.lrr'" in refused("--data", data, "optim.lrr=1")
    assert "conv4 BoW map is 2x2" in refused("--data", data, "views.teacher_size=16", "views.teacher_resize=16")
    assert "model.num_words (12) must be a multiple of data.batch_size (8)" in refused(
        "--data", data, "model.num_words=12"
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no images" in refused("--data", empty, out="b")
    assert "does not exist" in refused("--data", tmp_path / "missing", out="b")
    assert "larger than the number of images" in refused(
        "--data", data, "data.batch_size=64", "model.num_words=64", out="c"
    )


def test_resuming_with_other_settings_is_refused(tiny_run, obow_cli, tmp_path):
    out = tiny_run.copy(tmp_path / "run")
    args = [str(out) if str(a) == str(tiny_run.out) else a for a in tiny_run.args]
    proc = obow_cli(*args, "model.kappa=8", check=False)
    assert proc.code == 2 and "model.kappa: 5.0 -> 8.0" in proc.err


def test_recipes_command_lists_and_prints(obow_cli):
    listing = obow_cli("recipes").out
    assert "imagenet_resnet50_full" in listing and "cifar10_resnet18" in listing
    assert "num_words: 8192" in obow_cli("recipes", "imagenet_resnet50_full").out


@pytest.fixture(scope="module")
def fp32_first_loss(tmp_path_factory, tiny_recipe, write_images, obow_cli, read_log):
    """``fp32_first_loss(*overrides) -> (args, loss)``: the float32 baseline of the switch tests, one epoch (3 steps)
    of the tiny recipe on 24 images, run once per set of overrides."""
    root = tmp_path_factory.mktemp("switches")
    data = write_images(root / "data")
    runs = {}

    def baseline(*overrides):
        if overrides not in runs:
            args = ("pretrain", "--config", tiny_recipe, "--data", data, "optim.epochs=1", "train.tensorboard=false")
            args = (*args, *overrides)
            out = root / f"fp32_{len(runs)}"
            obow_cli(*args, "--out", out)
            steps = [r for r in read_log(out) if "type" not in r]
            assert [r["iteration"] for r in steps] == [1, 2, 3]
            assert all(np.isfinite(r["loss"]) for r in steps)
            runs[overrides] = args, steps[0]["loss"]
        return runs[overrides]

    return baseline


@pytest.mark.parametrize(
    ("overrides", "settings", "rtol"),
    [
        ((), ("train.precision=bf16", "train.channels_last=true"), 0.05),
        ((), ("train.precision=fp16",), 0.01),
        # Compiling takes minutes on the CPU (mostly the C++ compiler, one kernel per fused operator), half as
        # long again when the student also sees the patches' image size and is compiled again for it: one view
        # group here, and one block a stage (the same code, fewer operators to compile).
        pytest.param(
            ("views.num_patches=0", "model.arch_options.layers=[1,1,1,1]"),
            ("train.compile=true",),
            1e-4,
            marks=pytest.mark.slow,
        ),
    ],
    ids=["bf16_channels_last", "fp16", "compile"],
)
def test_precision_memory_format_and_compile_switches_train(
    tmp_path, fp32_first_loss, obow_cli, read_log, overrides, settings, rtol
):
    """Each switch trains through the real command line, and the first step's loss (same seed, same batch)
    is the float32 one up to the switch's rounding: bf16 keeps 8 bits of mantissa, fp16 11, and a compiled
    network computes the same maths. fp16 also keeps its gradient scaler's state in the checkpoint."""
    args, fp32_loss = fp32_first_loss(*overrides)
    out = tmp_path / "switch"
    obow_cli(*args, "--out", out, *settings)
    steps = [r for r in read_log(out) if "type" not in r]
    assert [r["iteration"] for r in steps] == [1, 2, 3]
    assert all(np.isfinite(r["loss"]) for r in steps)
    assert steps[0]["loss"] == pytest.approx(fp32_loss, rel=rtol)
    ckpt = load_checkpoint(out / "checkpoint.pt")
    if "train.precision=fp16" in settings:
        assert ckpt["scaler"]["scale"] > 0
    else:
        assert not ckpt.get("scaler")


@pytest.mark.parametrize("data", ["missing", "empty"])
@pytest.mark.slow
def test_a_bad_data_folder_is_the_only_line(tmp_path, tiny_recipe, data):
    """Issue 54: a setting's warning (the warm-up shortened for a 1-epoch run) came before the error of a missing
    or empty --data; the error is now the only line on stderr (the warning waits until the images are found)."""
    (tmp_path / "empty").mkdir()
    argv = ["pretrain", "--config", tiny_recipe, "--data", tmp_path / data, "--out", tmp_path / "run"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "obow", *map(str, argv), "optim.epochs=1", "optim.warmup_epochs=1"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("obow: error: "), proc.stderr
    assert ("does not exist" if data == "missing" else "no images found") in lines[0]
    assert not (tmp_path / "run").exists()


def test_a_settings_warning_still_shows_when_the_data_is_there(tmp_path, tiny_recipe, write_images, obow_cli):
    """The warm-up warning held back while the data is checked is shown once the images are found."""
    data = write_images(tmp_path / "data", per_class=4)
    args = ["pretrain", "--config", tiny_recipe, "--data", data, "--out", tmp_path / "run", "optim.epochs=1"]
    proc = obow_cli(*args, "optim.warmup_epochs=1", "train.knn_every=0", "train.tensorboard=false")
    assert proc.err.count("the warm-up is shortened to 0.5 epochs") == 1
    assert proc.err.index("the warm-up is shortened") < proc.err.index("New run")


@pytest.mark.parametrize("pipeline", ["workers", "device"])
def test_tiny_images_are_used_and_reported_once_each(tmp_path, tiny_recipe, write_images, obow_cli, read_log, pipeline):
    """Issue 54: a 1x1 and a 2x50 image were upscaled into the views without a word. Their shorter side is under a
    quarter of the 28 px the tiny recipe's views are made from: each is used, reported in one warning the first
    time it is met (not again in the next epoch), and counted in the epoch record (``tiny_images``) and the
    checkpoint; ``skipped_images`` stays 0. Both pipelines: loader workers, and the device pipeline's cache."""
    data = write_images(tmp_path / "data", per_class=3)  # 6 images of 32 px + 2 tiny ones: one batch of 8
    Image.new("RGB", (1, 1), (200, 30, 30)).save(data / "class0" / "one.png")
    Image.new("RGB", (2, 50), (30, 200, 30)).save(data / "class1" / "strip.png")
    out = tmp_path / "run"

    def proc_args(data, out, pipeline, tmp_path):
        return ("pretrain", "--config", tiny_recipe, "--data", data, "--out", out, f"data.pipeline={pipeline}",
                f"data.cache_dir={tmp_path / 'cache'}", "train.knn_every=0", "train.tensorboard=false")  # fmt: skip

    proc = obow_cli(*proc_args(data, out, pipeline, tmp_path), "optim.epochs=2")
    for name, side in (("one.png", 1), ("strip.png", 2)):
        lines = [line for line in proc.err.splitlines() if name in line]
        assert len(lines) == 1 and f"tiny image {data}" in lines[0] and f"shorter side {side} px" in lines[0], proc.err
    assert "upscaled more than 4x" in proc.err
    epochs = [r for r in read_log(out) if r.get("type") == "epoch"]
    assert [(r["tiny_images"], r["skipped_images"]) for r in epochs] == [(2, 0), (2, 0)]
    ckpt = load_checkpoint(out / "checkpoint.pt")
    assert sorted(Path(p).name for p in ckpt["tiny_images"]) == ["one.png", "strip.png"]
    assert ckpt["skipped_images"] == []
    extended = obow_cli(*proc_args(data, out, pipeline, tmp_path), "optim.epochs=3")  # resumed: known already
    assert "WARNING tiny image" not in extended.err
    assert [r["tiny_images"] for r in read_log(out) if r.get("type") == "epoch"] == [2, 2, 2]
