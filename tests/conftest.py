"""Shared fixtures: a test-sized recipe on a narrow network, image writers, a checkpoint factory, the ``obow``
command run in this process, one finished tiny run for every test that only needs *a* run, and the ``slow``
marker (``--runslow``)."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import socket
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

# The tests compute on tiny tensors, where intra-op threads only add synchronisation; on a busy machine they
# spin against each other (the tiny table run took 60 s with two threads beside other jobs, 6 s with one). The
# subprocesses that the tests start get OMP_NUM_THREADS=1 for the same reason.
torch.set_num_threads(1)
os.environ["OMP_NUM_THREADS"] = "1"  # and pretrain keeps to it (obow.training.run.threads.choose_threads)

# ------------------------------------------------------------------------------------------------ the slow marker


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="also run the tests marked slow")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow (CI does)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


# ------------------------------------------------------------------------------------------------ seeds and data


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    np.random.seed(0)


@pytest.fixture(scope="session")
def digits_images():
    """Real images: scikit-learn's handwritten digits, 8x8 grey upscaled to RGB tensors in [0, 1]."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32) / 16.0
    return images.unsqueeze(1).repeat(1, 3, 1, 1), torch.tensor(digits.target)


#: A test-sized OBoW recipe. The network is a timm ResNet-18 with 8 to 16 channels per stage instead of 64 to
#: 512: the same code paths as the full one (levels, stems, BoW maps) at a fraction of the cost. At 24 px the
#: CIFAR stem gives a 6x6 conv4 map, 4x4 after border removal.
TINY_RECIPE = """
description: test-sized recipe on a narrow network
model: {arch: "timm:resnet18", arch_options: {channels: [8, 8, 16, 16], stem_width: 8}, stem: cifar,
        levels: [conv4], num_words: 16, kappa: 5.0, delta_base: 1/10}
views: {teacher_resize: 28, teacher_size: 24, num_crops: 1, crop_size: 16, num_patches: 2, patch_size: 8,
        patch_jitter: 2, patch_grid_size: 24, blur_sigma: [0.05, 0.3]}
data: {batch_size: 8, num_workers: 0}
optim: {epochs: 3, lr: 0.05, warmup_epochs: 0.5, end_lr: 0.0, weight_decay: 5.0e-4}
train: {log_every: 1, knn_every: 1, knn_k: 5, progress_bar: false, deterministic: true}
"""


#: A tiny two-level recipe (conv4 and conv5, OBoW (full)'s levels) on a narrow network, for whole tables and the
#: GPU claim's dry run on a CPU.
TWO_LEVEL_RECIPE = """
description: tiny two-level base for tables and the GPU claim's dry run
model: {arch: "timm:resnet18", arch_options: {channels: [8, 16, 32, 64], stem_width: 8}, stem: cifar,
        levels: [conv4, conv5], num_words: 16, kappa: 5.0, delta_base: 1/10, border: 0}
views: {teacher_resize: 28, teacher_size: 24, num_crops: 2, crop_size: 16, num_patches: 2, patch_size: 8,
        patch_jitter: 2, patch_grid_size: 24, blur_sigma: [0.05, 0.3]}
data: {batch_size: 8, num_workers: 0}
optim: {epochs: 4, lr: 0.05, warmup_epochs: 1, end_lr: 0.0, weight_decay: 5.0e-4}
train: {log_every: 1, knn_every: 0, progress_bar: false, tensorboard: false}
"""


def write_class_images(root: Path, per_class: int = 12, classes: int = 2, size: int = 32, seed: int = 0) -> Path:
    """``root/class{c}/NNN.png``: noisy images whose dominant colour channel is the class (c mod 3)."""
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


def write_colour_folders(root: Path, colours: dict, counts: dict, size: int = 16, noise: float = 40.0, seed: int = 0):
    """``root/<split>/<colour name>/<i>.png``: ``counts[split]`` images per colour with Gaussian pixel noise."""
    rng = np.random.default_rng(seed)
    for split, n in counts.items():
        for name, rgb in colours.items():
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                pixels = np.clip(np.array(rgb) + rng.normal(0, noise, (size, size, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.png")
    return root


def write_noise_images(folder: Path, n: int, size: int = 16, seed: int = 0) -> None:
    """``n`` images of uniform random pixels in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(n):
        Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(folder / f"{i}.png")


@pytest.fixture(scope="session")
def tiny_recipe(tmp_path_factory) -> Path:
    """:data:`TINY_RECIPE` as a YAML file (one for the session: no test writes to it)."""
    path = tmp_path_factory.mktemp("recipe") / "tiny.yaml"
    path.write_text(TINY_RECIPE)
    return path


@pytest.fixture(scope="session")
def write_images():
    """``write_images(root, per_class=12, classes=2, size=32, seed=0)``: see :func:`write_class_images`."""
    return write_class_images


@pytest.fixture(scope="session")
def colour_folders():
    """``colour_folders(root, colours, counts, size=16, noise=40.0, seed=0)``: see :func:`write_colour_folders`."""
    return write_colour_folders


@pytest.fixture(scope="session")
def noise_images():
    """``noise_images(folder, n, size=16, seed=0)``: see :func:`write_noise_images`."""
    return write_noise_images


def read_run_log(out: Path) -> list[dict]:
    """The records of ``out/log.jsonl``."""
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


@pytest.fixture(scope="session")
def read_log():
    return read_run_log


def find_free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def free_port():
    """``free_port()``: a TCP port on 127.0.0.1 that nothing listens on, for a process group's rendezvous."""
    return find_free_port


# ------------------------------------------------------------------------------------------------ checkpoints


def write_checkpoint(path, arch="resnet18", stem="cifar", size=32, epoch=3, iteration=30, options=None) -> Path:
    """A pretraining checkpoint of an untrained OBoW whose student differs from its teacher, written with the
    library's own :func:`~obow.weights.checkpoint.build_checkpoint`. Its weights come from a seed of its own,
    the file's name and its folder's (two checkpoints of a test differ; a test gets the same weights in every run,
    whichever test ran before it in the worker: drawn from the global random state, a module's shared checkpoint
    once made a probe diverge in one run of about ten)."""
    with torch.random.fork_rng():
        torch.manual_seed(zlib.crc32(f"{Path(path).parent.name}/{Path(path).name}".encode()))
        return _write_checkpoint(path, arch, stem, size, epoch, iteration, options)


def _write_checkpoint(path, arch, stem, size, epoch, iteration, options) -> Path:
    from obow.config import Config, DataConfig, ModelConfig, ViewsConfig, to_dict
    from obow.methods.obow import OBoW
    from obow.weights.checkpoint import build_checkpoint, save_atomic

    cfg = Config(
        model=ModelConfig(arch=arch, stem=stem, arch_options=options or {}, levels=("conv4",), num_words=16, border=0),
        views=ViewsConfig(
            teacher_resize=size,
            teacher_size=size,
            crop_size=min(160, size),
            mean=(0.5, 0.5, 0.5),
            std=(0.25, 0.25, 0.25),
        ),
        data=DataConfig(batch_size=16),
    )
    model = OBoW.from_config(cfg.model, total_iterations=100)
    with torch.no_grad():
        for p in model.student.parameters():
            p.add_(0.01 * torch.randn_like(p))
        for name, buf in model.student.named_buffers():
            if "running" in name:  # non-trivial BN statistics, so that eval-mode features test them too
                buf.add_(0.1 * torch.rand_like(buf))
    save_atomic(build_checkpoint(to_dict(cfg), model.state_dict(), epoch=epoch, iteration=iteration), path)
    return Path(path)


@pytest.fixture(scope="session")
def make_checkpoint():
    """``make_checkpoint(path, arch=..., stem=..., size=..., options=...)``: see :func:`write_checkpoint`."""
    return write_checkpoint


# ------------------------------------------------------------------------------------------------ the command


@dataclass
class CliResult:
    code: int
    out: str
    #: what the command printed to stderr, then its log records as "LEVEL message" lines
    err: str


def invoke(*args) -> CliResult:
    """``obow ARGS`` in this process: ``obow.cli.main`` with stdout, stderr and the ``obow`` log captured.

    ``main`` calls ``logging.basicConfig``, which under pytest finds pytest's handlers on the root logger and does
    nothing (so the root level stays WARNING and the INFO lines would be lost); the ``obow`` logger is therefore
    given its own handler here. Where ``basicConfig`` does add a root handler (pytest's logging plugin off), that
    handler is bound to the temporary stderr and removed afterwards. ``pretrain`` switches on PyTorch's
    deterministic algorithms for ``train.deterministic``; the setting is put back so that it does not leak into
    later tests."""
    from obow.cli import main

    out, err = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(err)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger = logging.getLogger("obow")
    level, root_handlers = logger.level, list(logging.root.handlers)
    deterministic = torch.are_deterministic_algorithms_enabled()
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main([str(a) for a in args])
            except SystemExit as exit_:  # argparse errors
                code = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        for extra in [h for h in logging.root.handlers if h not in root_handlers]:
            logging.root.removeHandler(extra)
        torch.use_deterministic_algorithms(deterministic)
    return CliResult(code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="session")
def obow_cli():
    """``obow_cli(*args, check=True)``: run the command in this process (see :func:`invoke`); with ``check``, a
    non-zero exit fails the test with everything the command printed."""

    def run(*args, check: bool = True) -> CliResult:
        result = invoke(*args)
        if check and result.code != 0:
            raise AssertionError(f"obow {' '.join(map(str, args))}: exit {result.code}\n{result.out}\n{result.err}")
        return result

    return run


def one_error_line(result: CliResult) -> str:
    """The one line a command stopped by a user's mistake prints (exit status 2)."""
    lines = result.err.strip().splitlines()
    assert result.code == 2 and len(lines) == 1, result.err
    return lines[0]


@dataclass(frozen=True)
class TinyRun:
    """A finished ``obow pretrain`` of the tiny recipe: 2 epochs of 3 steps on 24 images, kNN monitor on 6."""

    root: Path
    recipe: Path
    data: Path  # train/ (2 classes x 12) and val/ (2 classes x 3)
    out: Path
    args: tuple  # the command line that made it
    result: CliResult

    @property
    def checkpoint(self) -> Path:
        return self.out / "checkpoint.pt"

    def copy(self, dest: Path) -> Path:
        """A copy of the run folder, for tests that write into a run (the shared one stays as it was made)."""
        shutil.copytree(self.out, dest)
        return dest


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, tiny_recipe) -> TinyRun:
    """One tiny finished run shared by every test that only needs *a* run (eval, export, show, resume checks)."""
    root = tmp_path_factory.mktemp("tiny_run")
    recipe = tiny_recipe
    data = root / "data"
    write_class_images(data / "train")
    write_class_images(data / "val", per_class=3, seed=1)
    out = root / "run"
    args = ("pretrain", "--config", recipe, "--data", data / "train", "--val", data / "val", "--out", out)
    args = (*args, "optim.epochs=2")
    result = invoke(*args)
    assert result.code == 0, result.err
    return TinyRun(root, recipe, data, out, args, result)
