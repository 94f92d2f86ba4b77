"""Rough edges of issue 10: each test fails on the old behaviour."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from obow import cli
from obow.backbones import ARCHITECTURES, STEMS, BackboneOutput
from obow.bow.predictor import DynamicBoWPredictor
from obow.bow.targets import BoWExtractor
from obow.bow.vocabulary import QueueVocabulary
from obow.cli import common as cli_common
from obow.cli import evaluate as cli_eval
from obow.config import ConfigError, load_config
from obow.data.folders import scan_images
from obow.evaluate.finetune import FINETUNE_PRESETS
from obow.evaluate.knn import DEFAULT_TEMPERATURE
from obow.evaluate.linear import LINEAR_PRESETS
from obow.evaluate.monitor import KNNMonitor
from obow.methods.obow import OBoW
from obow.weights.export import FORMATS
from obow.weights.load import NETWORKS

ONE_IMAGE_BATCHES = ("data.batch_size=1", "model.num_words=1", "optim.epochs=2", "train.tensorboard=false")


def run_module(*args, cwd=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(cli.__file__).parents[1])}
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, env=env, cwd=cwd)


def test_python_dash_m_obow_and_a_parser_without_torch():
    proc = run_module("-m", "obow", "--help")
    assert proc.returncode == 0 and "pretrain" in proc.stdout and "eval" in proc.stdout
    check = "import sys, obow.cli; obow.cli.build_parser(); print(sorted({'torch', 'torchvision'} & set(sys.modules)))"
    assert run_module("-c", check).stdout.strip() == "[]"


def test_the_installed_console_script_runs():
    """`pip install -e .` puts an `obow` script beside the interpreter; it runs the same command."""
    script = Path(sys.executable).parent / "obow"
    if not script.is_file():
        pytest.skip(f"no obow console script in {script.parent}: the package is not installed in this environment")
    env = {**os.environ, "PYTHONPATH": str(Path(cli.__file__).parents[1])}
    proc = subprocess.run([str(script), "recipes"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "imagenet_resnet50_full" in proc.stdout and "cifar10_resnet18" in proc.stdout


def test_the_light_parser_offers_the_library_choices():
    assert cli_common.ARCHITECTURES == ARCHITECTURES and cli_common.STEMS == STEMS
    assert cli_common.NETWORKS == NETWORKS and cli_common.FORMATS == FORMATS
    assert cli_eval.LINEAR_PRESET_NAMES == tuple(LINEAR_PRESETS)
    assert cli_eval.FRACTIONS == {p.fraction: name for name, p in FINETUNE_PRESETS.items()}
    assert cli_eval.DEFAULT_TEMPERATURE == DEFAULT_TEMPERATURE


def test_random_init_without_checkpoint_writes_a_default_report(tmp_path, monkeypatch, noise_images, obow_cli):
    for seed, folder in enumerate(("train/a", "train/b", "val/a", "val/b")):
        noise_images(tmp_path / "data" / folder, 3, seed=seed)
    monkeypatch.chdir(tmp_path)
    argv = ["eval", "knn", "--random-init", "--arch", "resnet18", "--stem", "cifar", "--data", "data"]
    out = obow_cli(*argv, "--k", "3", "--size", "16", "--workers", "0", "--device", "cpu").out
    report = tmp_path / "runs" / "eval" / "random_init_resnet18_cifar" / "knn.json"
    assert "top-1" in out and f"wrote {report.relative_to(tmp_path)}" in out
    data = json.loads(report.read_text())
    assert data["source"]["kind"] == "random_init" and data["results"]["knn"][0]["k_used"] == 3


def test_random_init_of_a_recipe_reports_in_a_folder_named_after_it(tmp_path, monkeypatch, noise_images, obow_cli):
    """``--random-init --config cifar10_fast``: the report lands in ``runs/eval/random_init_cifar10_fast/`` (no
    ``:`` of ``timm:resnet18`` in a folder name; another recipe of the same arch gets its own folder), and its
    header does not say that the weights were trained with the recipe's view."""
    for seed, folder in enumerate(("train/a", "train/b", "val/a", "val/b")):
        noise_images(tmp_path / "data" / folder, 3, seed=seed)
    monkeypatch.chdir(tmp_path)
    argv = ["eval", "knn", "--random-init", "--config", "cifar10_fast", "--data", "data", "--k", "3"]
    out = obow_cli(*argv, "--workers", "0", "--device", "cpu").out
    report = Path("runs") / "eval" / "random_init_cifar10_fast" / "knn.json"
    assert f"wrote {report}" in out and "trained with" not in out
    assert "(recipe cifar10_fast (its network, untrained))" in out.splitlines()[0]
    assert json.loads(report.read_text())["source"]["arch"] == "timm:resnet18"
    assert [p.name for p in (tmp_path / "runs" / "eval").iterdir()] == ["random_init_cifar10_fast"]


def test_folder_names_are_made_of_safe_characters():
    assert cli_eval.safe_name("timm:resnet18_cifar") == "timm-resnet18_cifar"
    assert cli_eval.safe_name("torchvision:resnet50 x/2") == "torchvision-resnet50-x-2"
    assert cli_eval.safe_name("resnet18_cifar.v1-a") == "resnet18_cifar.v1-a"


def test_overrides_anywhere_on_the_line():
    parser = cli.build_parser()
    argv = ["pretrain", "--out", "X", "optim.lr=1", "--config", "R", "--data", "D", "model.num_words=8"]
    args = cli.parse_args(parser, argv)
    assert (args.out, args.config, args.data) == ("X", "R", "D")
    assert args.overrides == ["optim.lr=1", "model.num_words=8"]
    for bad in (["pretrain", "a=1", "--out", "X", "stray"], ["recipes", "--bogus"], ["recipes", "demo", "a=1"]):
        with pytest.raises(SystemExit):
            cli.parse_args(parser, bad)


def test_yaml_syntax_error_names_file_line_and_column(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("model:\n  arch: resnet18\n   stem: cifar\n")
    with pytest.raises(ConfigError, match=rf"^{path}:3:8: not valid YAML: mapping values are not allowed here$"):
        load_config(path)


def test_zero_byte_files_are_skipped_at_scan_time(tmp_path, noise_images):
    noise_images(tmp_path / "a", 2)
    (tmp_path / "a" / "empty.png").write_bytes(b"")
    with pytest.warns(UserWarning, match="skipped 1 zero-byte image file under"):
        images = scan_images(tmp_path, labels="none")
    assert [Path(p).name for p in images.paths] == ["0.png", "1.png"]
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x.jpg").write_bytes(b"")
    with pytest.raises(ValueError, match="no images found.*1 zero-byte image file skipped"):
        scan_images(tmp_path / "b")


@pytest.mark.slow  # a real process: CI runs it (--runslow)
def test_only_image_unreadable_is_a_one_line_error(tmp_path, tiny_recipe):
    """The whole stderr of a real process (a data-loader worker's traceback included) holds one error line."""
    (tmp_path / "data" / "c").mkdir(parents=True)
    (tmp_path / "data" / "c" / "x.jpg").write_bytes(b"not an image")
    proc = run_module(
        "-m", "obow", "pretrain", "--config", tiny_recipe, "--data", tmp_path / "data", "--out", tmp_path / "run",
        "data.num_workers=1", *ONE_IMAGE_BATCHES,
    )  # fmt: skip
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert errors == [
        f"obow: error: 1 images in a row could not be read under {tmp_path / 'data'} "
        f"(first: {tmp_path / 'data' / 'c' / 'x.jpg'}); check or remove the damaged files"
    ]
    assert "Traceback" not in proc.stderr


def test_knn_monitor_warns_when_it_would_never_run_or_cuts_k(tmp_path, tiny_recipe, noise_images, caplog):
    noise_images(tmp_path / "train" / "a", 2)
    noise_images(tmp_path / "val" / "a", 1)
    settings = [*ONE_IMAGE_BATCHES, f"data.val_path={tmp_path / 'val'}"]
    cfg = load_config(tiny_recipe, [*settings, "train.knn_every=3", "train.knn_k=5"])
    with caplog.at_level(logging.WARNING, logger="obow"):
        monitor = KNNMonitor(cfg, scan_images(tmp_path / "train"), torch.device("cpu"))
    assert monitor.enabled
    assert "train.knn_every=3 is larger than optim.epochs=2, so it will never run" in caplog.text
    assert "train.knn_k=5 is more than the 2 training images; it uses k=2" in caplog.text
    caplog.clear()
    cfg = load_config(tiny_recipe, [*settings, "train.knn_every=2", "train.knn_k=2"])
    with caplog.at_level(logging.WARNING, logger="obow"):
        KNNMonitor(cfg, scan_images(tmp_path / "train"), torch.device("cpu"))
    assert caplog.text == ""


class _Parameterless(nn.Module):
    """A backbone without parameters: its conv5 map is the image itself."""

    num_features = 3

    def forward(self, x, levels=()):
        return BackboneOutput(pool5=x.mean(dim=(2, 3)), maps={level: x for level in levels})


def test_teacher_update_with_a_parameter_free_backbone():
    extractor = BoWExtractor(QueueVocabulary(4, 3))
    model = OBoW(_Parameterless(), {"conv5": extractor}, DynamicBoWPredictor([3], 3), total_iterations=2)
    model.update_teacher(0.5)
    out = model(torch.rand(2, 3, 6, 6), [torch.rand(2, 3, 6, 6)])
    assert torch.isfinite(out.loss)


def local_average_reference(feature_map: np.ndarray) -> np.ndarray:
    """3x3 stride-1 unpadded average of a [B, C, H, W] map, by brute force: [B, C, (H-2)*(W-2)]."""
    b, c, h, w = feature_map.shape
    out = np.zeros((b, c, h - 2, w - 2))
    for i in range(h - 2):
        for j in range(w - 2):
            out[:, :, i, j] = feature_map[:, :, i : i + 3, j : j + 3].mean(axis=(2, 3))
    return out.reshape(b, c, -1)


def test_queue_generator_and_recorded_intermediates():
    maps = torch.rand(4, 3, 7, 7, dtype=torch.float64)  # 5x5 after the border, 3x3 local averages
    extractors = []
    for _ in range(2):
        vocabulary = QueueVocabulary(8, 3, generator=torch.Generator().manual_seed(7))
        extractor = BoWExtractor(vocabulary, delta_base=0.25, temperature_init=0.5).double()
        extractor.record_intermediates = True
        extractors.append(extractor)
    words_before = extractors[0].vocabulary.words.clone()
    extractors[1].vocabulary.words.copy_(words_before)
    global_state = torch.get_rng_state()
    for extractor in extractors:
        extractor(maps, update=True)
    assert torch.equal(torch.get_rng_state(), global_state)  # the global generator was not used
    first, second = (e.intermediates for e in extractors)
    assert torch.equal(first["enqueued"], second["enqueued"])

    # the enqueued words are the local averages at the generator's draws, in slots 0..3
    index = torch.randint(9, (4,), generator=torch.Generator().manual_seed(7)).numpy()
    averages = local_average_reference(maps[:, :, 1:-1, 1:-1].numpy())
    expected = averages[np.arange(4), :, index]
    np.testing.assert_allclose(first["enqueued"].numpy(), expected, rtol=1e-12)
    np.testing.assert_allclose(extractors[0].vocabulary.words[:4].numpy(), expected, rtol=1e-12)

    # the recorded codes are the soft assignment to the words before the update, with the updated mu
    features = maps[:, :, 1:-1, 1:-1].reshape(4, 3, 25).transpose(1, 2).numpy()
    words = words_before.numpy()
    dist = ((features[:, :, None, :] - words[None, None]) ** 2).sum(-1)
    mu = 0.99 * 0.5 + 0.01 * dist.min(-1).mean()
    logits = -dist / (0.25 * mu)
    codes = np.exp(logits - logits.max(-1, keepdims=True))
    codes /= codes.sum(-1, keepdims=True)
    np.testing.assert_allclose(first["codes"].numpy(), codes, rtol=1e-9, atol=1e-12)
    np.testing.assert_array_equal(first["nearest"].numpy(), dist.argmin(-1))


def test_intermediates_are_not_recorded_unless_asked():
    extractor = BoWExtractor(QueueVocabulary(4, 3))
    extractor(torch.rand(2, 3, 5, 5), update=True)
    assert extractor.intermediates == {} and extractor.vocabulary.last_enqueued is None
