"""What a demanding newcomer met (issue 60, items 12 and 14), each with the command or file that showed it."""

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import TINY_RECIPE
from PIL import Image

from obow.config import from_dict, load_config
from obow.config.schema import Config
from obow.show.run_plots import panels_for, read_run, runs_figure
from obow.training.run.signals import SignalFlag
from obow.training.step.watch import CompileWatch

ROOT = Path(__file__).parents[1]


def error_lines(result) -> list[str]:
    return [line for line in result.err.splitlines() if line.strip()]


# ------------------------------------------------------------------------------------------- item 12: no --data


@pytest.mark.parametrize("with_recipe", [False, True], ids=["alone", "with-config"])
def test_pretrain_without_data_is_one_line_that_names_the_demo(
    tmp_path, monkeypatch, obow_cli, tiny_recipe, with_recipe
):
    """``obow pretrain`` with neither ``--data`` nor ``--config`` ran the whole demo (docs/cli.md: an error)."""
    from obow.experiments import demo

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(demo, "run_demo", lambda *a, **k: pytest.fail("obow pretrain started the demo"))
    result = obow_cli("pretrain", *(["--config", tiny_recipe] if with_recipe else []), check=False)
    assert result.code == 2
    [line] = error_lines(result)
    assert line.startswith("obow: error: no training images: pass --data DIR") and "`obow demo`" in line
    assert not list(tmp_path.iterdir())  # nothing written


# ----------------------------------------------------------------------------------------------- item 14: small


def test_obow_version_prints_the_packages_version():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, "-m", "obow", "--version"], capture_output=True, text=True, env=env)
    version = re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.MULTILINE).group(1)
    assert done.returncode == 0 and done.stdout == f"obow {version}\n", done.stderr


def test_show_words_captions_name_the_class_folder_of_each_image(tiny_run, tmp_path, obow_cli):
    val = tiny_run.data / "val"  # class0/000.png and class1/000.png ...: file names shared by the class folders
    assert (val / "class0" / "000.png").is_file() and (val / "class1" / "000.png").is_file()
    out = tmp_path / "words"
    obow_cli("show", "words", "--checkpoint", tiny_run.checkpoint, "--data", val, "--out", out,
             "--words", "12,13", "--workers", 0, "--device", "cpu")  # fmt: skip
    captions = re.findall(r"<figcaption>([^<]*)</figcaption>", (out / "index.html").read_text())
    names = {caption.split(",")[0] for caption in captions}
    assert len(captions) == 16 and names <= {f"class{c}/{i:03d}.png" for c in (0, 1) for i in range(3)}
    assert {name.split("/")[0] for name in names} == {"class0", "class1"}


def test_show_run_of_two_runs_tells_every_curve_apart(tiny_run, tmp_path):
    """With several runs, a colour per run, and each of a run's curves in a panel its own style; the legend names
    the run and the curve."""
    runs = []
    for name in ("first", "second"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "log.jsonl").write_text((tiny_run.out / "log.jsonl").read_text())
        runs.append(read_run(tmp_path / name))
    loss_panel = panels_for(runs)[0]
    assert len([k for k, dashed in loss_panel.series if not dashed]) >= 2  # several loss curves per run
    ax = runs_figure(runs).axes[0]
    by_run: dict[str, list] = {"first": [], "second": []}
    for line in ax.get_lines():
        run, _, key = line.get_label().partition(": ")
        by_run[run].append((key, line.get_color(), line.get_linestyle(), line.get_marker()))
    assert [len(lines) for lines in by_run.values()] == [len(loss_panel.series)] * 2
    for lines in by_run.values():
        assert len({colour for _, colour, _, _ in lines}) == 1  # the run's colour
        assert len({(style, marker) for _, _, style, marker in lines}) == len(lines)  # each curve its style
    assert by_run["first"][0][1] != by_run["second"][0][1]
    legend = [text.get_text() for text in ax.get_legend().get_texts()]
    assert "first: loss/group0/conv4" in legend and "second: loss/group0/conv4" in legend


def test_recipes_doc_gives_the_demo_and_fast_networks_their_widths():
    """docs/recipes.md called the quarter-width demo network half-width; every width it names is the recipe's."""
    rows = {
        m.group(1): m.group(2)
        for m in re.finditer(r"^\| `(\w+)` \| (.*)$", (ROOT / "docs" / "recipes.md").read_text(), re.MULTILINE)
    }
    named = {name: re.search(r"(half|quarter)-width ResNet-18", text) for name, text in rows.items()}
    named = {name: m.group(1) for name, m in named.items() if m}
    assert {"demo", "cifar10_fast"} <= set(named)
    for name, width in named.items():
        cfg = load_config(name)
        assert cfg.model.arch == "timm:resnet18"
        share = cfg.model.arch_options["channels"][-1] / 512  # timm's ResNet-18 ends at 512 channels
        assert share == {"half": 0.5, "quarter": 0.25}[width], name


def test_a_batch_larger_than_the_images_is_refused_before_anything_is_written(tmp_path, write_images, obow_cli,
                                                                              tiny_recipe):  # fmt: skip
    data = write_images(tmp_path / "data", per_class=4)  # 8 images
    out = tmp_path / "run"
    result = obow_cli("pretrain", "--config", tiny_recipe, "--data", data, "--out", out,
                      "data.batch_size=16", "model.num_words=16", check=False)  # fmt: skip
    assert result.code == 2
    assert "obow: error: data.batch_size (16) is larger than the number of images (8)" in result.err
    assert not out.exists()


def test_a_jpeg_named_pt_is_said_to_be_an_image_not_a_checkpoint(tmp_path, obow_cli):
    fake = tmp_path / "model.pt"
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(fake, format="JPEG")
    result = obow_cli("export", "--checkpoint", fake, "--out", tmp_path / "b.pth", check=False)
    assert result.code == 2
    [line] = error_lines(result)
    assert f"{fake}" in line and "not a file written by torch.save but a JPEG image" in line
    assert "Python objects" not in line and not (tmp_path / "b.pth").exists()


def test_a_binary_recipe_names_its_file(tmp_path, write_images, obow_cli):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_bytes(bytes(range(256)) * 4)
    data = write_images(tmp_path / "data", per_class=4)
    result = obow_cli("pretrain", "--config", recipe, "--data", data, "--out", tmp_path / "run", check=False)
    assert result.code == 2
    [line] = error_lines(result)
    assert line.startswith(f"obow: error: {recipe}: not a text file, so not a YAML recipe"), line


def compile_config() -> Config:
    values = yaml.safe_load(TINY_RECIPE)
    values["train"]["compile"] = "step"
    return from_dict(Config, values)


class Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_the_no_cuda_runtime_line_is_hidden_while_obow_compiles(tmp_path):
    """PyTorch's C++ set-up logs ``No CUDA runtime is found`` on a machine with a CUDA toolkit and no GPU; a CPU
    run's compile is no place for it. Other lines of that logger, and the line outside a compile, go through."""
    logger = logging.getLogger("torch.utils.cpp_extension")
    kept = Kept()
    logger.addHandler(kept)
    try:
        with CompileWatch(compile_config(), __import__("torch").device("cpu"), tmp_path, SignalFlag()):
            logger.warning("No CUDA runtime is found, using CUDA_HOME='%s'", "/usr/local/cuda")
            logger.warning("another line")
        logger.warning("No CUDA runtime is found, using CUDA_HOME='%s'", "/elsewhere")
    finally:
        logger.removeHandler(kept)
    assert kept.messages == ["another line", "No CUDA runtime is found, using CUDA_HOME='/elsewhere'"]


COMPILE_IN_A_WATCH = """
import logging, sys, yaml, torch
logging.basicConfig(level=logging.INFO)
from obow.config import from_dict
from obow.config.schema import Config
from obow.training.step.watch import CompileWatch
from obow.training.run.signals import SignalFlag
values = yaml.safe_load(sys.argv[1])
values["train"]["compile"] = "step"
step = torch.compile(lambda x: x * 2 + 1)
if sys.argv[2] == "watched":
    with CompileWatch(from_dict(Config, values), torch.device("cpu"), sys.argv[3], SignalFlag()):
        print(step(torch.ones(3)).tolist())
else:
    print(step(torch.ones(3)).tolist())
"""


@pytest.mark.slow
def test_a_real_cpu_compile_in_obows_watch_does_not_print_the_no_cuda_runtime_line(tmp_path):
    """Two processes that compile with inductor on a CPU (no GPU visible) where a CUDA toolkit seems installed
    (``CUDA_HOME``): PyTorch's line appears without obow's watch, and not within it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "CUDA_VISIBLE_DEVICES": "", "CUDA_HOME": str(tmp_path)}
    stderr = {}
    for mode in ("plain", "watched"):
        done = subprocess.run(
            [sys.executable, "-c", COMPILE_IN_A_WATCH, TINY_RECIPE, mode, str(tmp_path)],
            capture_output=True, text=True, env=env, timeout=600,
        )  # fmt: skip
        assert done.returncode == 0 and done.stdout.strip() == "[3.0, 3.0, 3.0]", done.stderr
        stderr[mode] = done.stderr
    assert "No CUDA runtime is found" in stderr["plain"]  # the condition is met on this machine
    assert "No CUDA runtime is found" not in stderr["watched"]


# The demo's end and its re-run: tests/test_demo.py::test_demo_runs_end_to_end_at_a_tiny_size (a real demo).
