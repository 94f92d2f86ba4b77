"""The real command line: pretraining writes checkpoints and logs, resumes after a kill to the same weights,
trains through unreadable and unusual images, and rejects bad settings with clear errors."""

import io
import json
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

TINY_RECIPE = """
description: test-sized recipe
model: {arch: resnet18, stem: cifar, levels: [conv4], num_words: 16, kappa: 5.0, delta_base: 1/10}
views: {teacher_resize: 28, teacher_size: 24, num_crops: 1, crop_size: 16, num_patches: 2, patch_size: 8,
        patch_jitter: 2, patch_grid_size: 24, blur_sigma: [0.05, 0.3]}
data: {batch_size: 8, num_workers: 0}
optim: {epochs: 3, lr: 0.05, warmup_epochs: 0.5, end_lr: 0.0, weight_decay: 5.0e-4}
train: {log_every: 1, knn_every: 1, knn_k: 5, progress_bar: false, deterministic: true}
"""


def write_images(root: Path, per_class: int = 12, classes: int = 2, size: int = 32, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    for c in range(classes):
        folder = root / f"class{c}"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            base = np.zeros((size, size, 3), dtype=np.uint8)
            base[..., c % 3] = 160
            noise = rng.integers(0, 90, size=(size, size, 3), dtype=np.uint8)
            Image.fromarray(base + noise).save(folder / f"{i:03d}.png")
    return root


@pytest.fixture
def recipe(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY_RECIPE)
    return path


def run_cli(*args, check=True, **kwargs):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "obow.cli", *map(str, args)], capture_output=True, text=True, env=env, **kwargs
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


def read_log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def test_pretrain_writes_checkpoint_logs_and_monitor(tmp_path, recipe):
    data = write_images(tmp_path / "data" / "train")
    val = write_images(tmp_path / "data" / "val", per_class=4, seed=1)
    out = tmp_path / "run"
    proc = run_cli("pretrain", "--config", recipe, "--data", data, "--val", val, "--out", out, "optim.epochs=2")
    assert "New run" in proc.stderr and "done: 2 epochs" in proc.stdout
    ckpt = load_checkpoint(out / "checkpoint.pt")
    assert (ckpt["epoch"], ckpt["batch_in_epoch"], ckpt["iteration"]) == (2, 0, 6)
    assert {"model", "optimizer", "rng", "config", "history"} <= set(ckpt)
    assert "extractors.conv4.vocabulary.words" in ckpt["model"] and int(ckpt["model"]["iteration"]) == 6
    assert ckpt["config"]["optim"]["epochs"] == 2
    records = read_log(out)
    steps = [r for r in records if r.get("type") != "epoch"]
    epochs = [r for r in records if r.get("type") == "epoch"]
    assert [r["iteration"] for r in steps] == [1, 2, 3, 4, 5, 6]
    for r in steps:
        assert np.isfinite(r["loss"]) and {"lr", "teacher_momentum", "conv4/perplexity_batch"} <= set(r)
    assert [r["epoch"] for r in epochs] == [1, 2]
    assert all(0 <= r["knn_top1"] <= 100 for r in epochs)
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert "optim:" in (out / "config.yaml").read_text()
    # running the same command again: the run is complete, nothing is redone
    again = run_cli("pretrain", "--config", recipe, "--data", data, "--val", val, "--out", out, "optim.epochs=2")
    assert "already complete" in again.stderr
    assert load_checkpoint(out / "checkpoint.pt")["iteration"] == 6


def test_killed_run_resumes_to_the_same_weights(tmp_path, recipe):
    data = write_images(tmp_path / "data", per_class=20)  # 40 images: 5 iterations per epoch, 15 in all
    args = ["pretrain", "--config", recipe, "--data", data, "train.checkpoint_every=1", "train.knn_every=0"]
    run_cli(*args, "--out", tmp_path / "whole")

    out = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "obow.cli", *map(str, args), "--out", str(out)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 120
    while time.time() < deadline:  # iteration 7 logged: the checkpoint of iteration 6 (epoch 2, batch 1) is written
        if (out / "log.jsonl").exists() and any(r["iteration"] >= 7 for r in read_log(out)):
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    partial = load_checkpoint(out / "checkpoint.pt")
    assert partial["epoch"] == 1 and partial["batch_in_epoch"] > 0, "the kill should land in the middle of epoch 2"

    resumed = run_cli(*args, "--out", out)
    assert "Resuming" in resumed.stderr
    whole = load_checkpoint(tmp_path / "whole" / "checkpoint.pt")
    done = load_checkpoint(out / "checkpoint.pt")
    assert done["iteration"] == whole["iteration"] == 15
    for name, value in whole["model"].items():
        assert torch.equal(value, done["model"][name]), name
    assert [r["iteration"] for r in read_log(out) if r.get("type") != "epoch"] == list(range(1, 16))


def test_interrupt_writes_a_mid_epoch_checkpoint(tmp_path, recipe):
    data = write_images(tmp_path / "data", per_class=40)
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "obow.cli", "pretrain", "--config", str(recipe), "--data", str(data), "--out", str(out)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    while time.time() < deadline:
        if (out / "log.jsonl").exists() and any(r["iteration"] >= 2 for r in read_log(out)):
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "Interrupted: checkpoint written" in stderr
    ckpt = load_checkpoint(out / "checkpoint.pt")
    assert ckpt["epoch"] == 0 and 2 <= ckpt["batch_in_epoch"] < 10
    assert ckpt["iteration"] == ckpt["batch_in_epoch"]


def test_unreadable_and_unusual_images_are_converted_or_skipped(tmp_path, recipe):
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
    proc = run_cli(
        "pretrain",
        "--config",
        recipe,
        "--data",
        data,
        "--out",
        out,
        "optim.epochs=1",
        "data.num_workers=1",
        "train.knn_every=0",
    )
    skipped = load_checkpoint(out / "checkpoint.pt")["skipped_images"]
    assert sorted(Path(p).name for p in skipped) == ["corrupt.jpg", "truncated.jpg"]
    assert "skipped unreadable image" in proc.stderr and "corrupt.jpg" in proc.stderr
    last = [r for r in read_log(out) if r.get("type") == "epoch"][-1]
    assert last["skipped_images"] == 2


def test_bad_settings_and_data_give_clear_errors(tmp_path, recipe):
    data = write_images(tmp_path / "data", per_class=4)
    proc = run_cli("pretrain", "--config", recipe, "--data", data, "--out", tmp_path / "a", "optim.lrr=1", check=False)
    assert proc.returncode == 2 and "unknown key 'optim.lrr'" in proc.stderr
    proc = run_cli(
        "pretrain",
        "--config",
        recipe,
        "--data",
        data,
        "--out",
        tmp_path / "a",
        "views.teacher_size=16",
        "views.teacher_resize=16",
        check=False,
    )
    assert proc.returncode == 2 and "conv4 BoW map is 2x2" in proc.stderr
    proc = run_cli(
        "pretrain", "--config", recipe, "--data", data, "--out", tmp_path / "a", "model.num_words=12", check=False
    )
    assert proc.returncode == 2 and "model.num_words (12) must be a multiple of data.batch_size (8)" in proc.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = run_cli("pretrain", "--config", recipe, "--data", empty, "--out", tmp_path / "b", check=False)
    assert proc.returncode == 2 and "no images" in proc.stderr
    proc = run_cli("pretrain", "--config", recipe, "--data", tmp_path / "missing", "--out", tmp_path / "b", check=False)
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    proc = run_cli(
        "pretrain",
        "--config",
        recipe,
        "--data",
        data,
        "--out",
        tmp_path / "c",
        "data.batch_size=64",
        "model.num_words=64",
        check=False,
    )
    assert proc.returncode == 2 and "larger than the number of images" in proc.stderr


def test_resuming_with_other_settings_is_refused(tmp_path, recipe):
    data = write_images(tmp_path / "data", per_class=4)
    out = tmp_path / "run"
    run_cli("pretrain", "--config", recipe, "--data", data, "--out", out, "optim.epochs=1", "train.knn_every=0")
    proc = run_cli(
        "pretrain", "--config", recipe, "--data", data, "--out", out, "optim.epochs=1", "model.kappa=8", check=False
    )
    assert proc.returncode == 2 and "model.kappa: 5.0 -> 8.0" in proc.stderr


def test_recipes_command_lists_and_prints():
    proc = run_cli("recipes")
    assert "imagenet_resnet50_full" in proc.stdout and "cifar10_resnet18" in proc.stdout
    assert "num_words: 8192" in run_cli("recipes", "imagenet_resnet50_full").stdout


@pytest.mark.parametrize(
    ("settings", "rtol"),
    [
        (("train.precision=bf16", "train.channels_last=true"), 0.05),
        (("train.precision=fp16",), 0.01),
        (("train.compile=true",), 1e-4),  # compiling on the CPU takes about two minutes
    ],
    ids=["bf16_channels_last", "fp16", "compile"],
)
def test_precision_memory_format_and_compile_switches_train(tmp_path, recipe, settings, rtol):
    """Each switch trains through the real command line, and the first step's loss (same seed, same batch)
    is the float32 one up to the switch's rounding: bf16 keeps 8 bits of mantissa, fp16 11, and a compiled
    network computes the same maths. fp16 also keeps its gradient scaler's state in the checkpoint."""
    data = write_images(tmp_path / "data")
    losses = {}
    for name, extra in (("fp32", ()), ("switch", settings)):
        out = tmp_path / name
        run_cli("pretrain", "--config", recipe, "--data", data, "--out", out, "optim.epochs=1", *extra)
        steps = [r for r in read_log(out) if r.get("type") != "epoch"]
        assert [r["iteration"] for r in steps] == [1, 2, 3]
        assert all(np.isfinite(r["loss"]) for r in steps)
        losses[name] = steps[0]["loss"]
    assert losses["switch"] == pytest.approx(losses["fp32"], rel=rtol)
    ckpt = load_checkpoint(tmp_path / "switch" / "checkpoint.pt")
    if "train.precision=fp16" in settings:
        assert ckpt["scaler"]["scale"] > 0
    else:
        assert not ckpt.get("scaler")
