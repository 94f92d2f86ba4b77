"""Rough edges a newcomer hit (issue "A first hour that convinces", item 6): each test fails on the old code."""

import json
import logging
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from obow.cli import main
from obow.config import load_config
from obow.evaluate.linear import preset_for_arch
from obow.notices import ObowWarning
from obow.weights.load import load_backbone

V1 = Path(__file__).parent / "data" / "v1_run"


def test_a_short_run_of_a_long_recipe_shortens_its_warm_up(caplog):
    """The run warms up over half its length and says so; its recipe keeps the warm-up asked (issue 60: an
    extension of the run warms up as asked, and is not refused for a value obow chose)."""
    from obow.schedules import learning_rate
    from obow.training.run.settle import note_short_warmup

    cfg = load_config("cifar10_fast", ["optim.epochs=1"])
    assert cfg.optim.warmup_epochs == load_config("cifar10_fast").optim.warmup_epochs == 1
    o = cfg.optim  # 10 steps: linear over the first 5 (half the run), not over all 10
    lr = learning_rate(4, 10, base_lr=o.lr, epochs=1, warmup_epochs=o.warmup_epochs, end_lr=o.end_lr)
    assert lr == pytest.approx(o.lr * 4 / 5)
    with caplog.at_level(logging.WARNING, logger="obow"):
        note_short_warmup(cfg)
    assert "the warm-up is shortened to 0.5 epochs for this run" in caplog.text


@pytest.mark.parametrize(
    ("arch", "preset"),
    [
        ("resnet18", "resnet18"),
        ("resnet34", "resnet18"),
        ("timm:resnet18", "resnet18"),
        ("timm:resnet18d", "resnet18"),
        ("timm:resnet10t", "resnet18"),
        ("torchvision:resnet34", "resnet18"),
        ("resnet50", "resnet50"),
        ("timm:resnet101", "resnet50"),
        ("timm:resnet152", "resnet50"),
    ],
)
def test_linear_preset_follows_the_block_type_for_every_source(arch, preset):
    assert preset_for_arch(arch) == preset


def test_export_of_a_timm_backbone_names_the_format_that_works(tmp_path, capsys):
    ckpt = V1 / "checkpoint_epoch1.pt"  # a timm:resnet18 run
    code = main(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "b.pth"), "--format", "torchvision"])
    err = capsys.readouterr().err
    assert code == 2 and "exports with --format timm" in err and "--format torchvision takes torchvision ResNets" in err


def test_an_export_without_its_sidecar_is_loaded_with_a_warning(tmp_path):
    assert main(["export", "--checkpoint", str(V1 / "checkpoint_epoch1.pt"), "--out", str(tmp_path / "b.pth")]) == 0
    shutil.move(tmp_path / "b.pth", tmp_path / "alone.pth")
    # a narrow timm export: recognised from its weights, widths included; its stem cannot be seen in them
    with pytest.warns(UserWarning, match=r"has no alone.pth.json sidecar: .* the evaluation view is chosen from"):
        backbone, info = load_backbone(backbone_file=tmp_path / "alone.pth", stem="cifar")
    with_sidecar, _ = load_backbone(V1 / "checkpoint_epoch1.pt")
    assert (info["arch"], info["stem"]) == ("timm:resnet18", "cifar")
    assert info["arch_options"] == {"channels": [8, 8, 16, 16]}  # its stem_width: 8 has no effect in timm
    x = torch.randn(2, 3, 40, 40)
    torch.testing.assert_close(backbone.eval()(x).pool5, with_sidecar.eval()(x).pool5, rtol=0, atol=0)


def test_an_export_without_its_sidecar_is_recognised_never_contradicted(tmp_path, obow_cli):
    """Issue 39: evaluating ``runs/x/backbone.pth`` without its sidecar said "do not fit a resnet18 with the
    torchvision stem; they look like resnet18 (torchvision stem)" for a narrow timm export."""
    obow_cli("export", "--checkpoint", V1 / "checkpoint_epoch1.pt", "--out", tmp_path / "b.pth")
    (tmp_path / "b.pth.json").unlink()
    data = tmp_path / "data"
    for split in ("train", "val"):
        shutil.copytree(V1 / "images", data / split)
    args = ["eval", "knn", "--backbone", tmp_path / "b.pth", "--data", data, "--k", "3", "--workers", "0"]
    result = obow_cli(*args)
    assert "knn: timm:resnet18 (torchvision stem)" in result.out
    (warning,) = [line for line in result.err.splitlines() if "sidecar" in line]
    assert "recognised from its weights as timm:resnet18 with model.arch_options channels=[8, 8, 16, 16]" in warning
    assert "its stem cannot be told from the weights (torchvision, no_maxpool or cifar)" in warning
    assert "give --stem if it was trained with another" in warning
    # the wrong --arch: named against what the file holds, never "looks like" what was asked
    wrong = obow_cli(*args, "--arch", "resnet18", check=False)
    assert wrong.code == 2
    (line,) = wrong.err.strip().splitlines()
    assert "holds a timm:resnet18 backbone" in line and "resnet18 was requested (--arch)" in line


@pytest.mark.parametrize(
    ("arch", "options"),
    [
        ("timm:resnet18d", {"channels": [16, 16, 32, 32], "stem_width": 8}),
        ("timm:resnet18", {"channels": [16, 32, 64, 128], "stem_width": 8, "stem_type": "deep"}),  # the demo's
        ("timm:resnet18", {"channels": [16, 32, 64, 128], "stem_width": 16, "stem_type": "deep_tiered"}),
        ("timm:resnet10t", {}),
        ("timm:resnet50", {"channels": [8, 16, 16, 32]}),
        ("resnet34", {}),
    ],
)
def test_recognise_weights_reads_timm_resnets_and_their_widths(arch, options):
    from obow.backbones import build_backbone
    from obow.weights.load import recognise_weights

    net = build_backbone(arch, "torchvision", options)
    state = net.export_state_dict() if hasattr(net, "export_state_dict") else net.state_dict()
    found = recognise_weights(state)
    assert (found.arch, found.options, found.stem) == (arch, options, None)


def test_a_network_the_weights_do_not_show_asks_for_its_sidecar_or_arch(tmp_path):
    import timm

    path = tmp_path / "regnet.pth"
    torch.save(timm.create_model("regnetx_002").state_dict(), path)
    with pytest.raises(ValueError, match=r"not recognised from its weights .*put back the sidecar.*--arch .*--stem"):
        load_backbone(backbone_file=path)
    with pytest.warns(UserWarning, match="loaded as --arch timm:regnetx_002"):
        _, info = load_backbone(backbone_file=path, arch="timm:regnetx_002")
    assert info["arch"] == "timm:regnetx_002"
    with pytest.raises(ValueError, match=r"do not fit timm:regnetx_004.*needs the regnet.pth.json sidecar"):
        load_backbone(backbone_file=path, arch="timm:regnetx_004")


def test_a_weight_mismatch_never_says_the_weights_look_like_what_was_asked():
    from obow.backbones import ResNetBackbone
    from obow.weights.load import load_weights

    narrow = load_backbone(V1 / "checkpoint_epoch1.pt")[0].export_state_dict()
    with pytest.raises(ValueError) as refused:
        load_weights(ResNetBackbone("resnet18"), narrow, "these weights")
    message = str(refused.value)
    assert "do not fit a resnet18 with the torchvision stem" in message
    assert "they hold timm:resnet18 with model.arch_options channels=[8, 8, 16, 16])" in message
    assert "look like resnet18" not in message


def test_under_torchrun_only_the_main_process_prints_what_is_next(tmp_path, monkeypatch, capsys):
    images = shutil.copytree(V1 / "images", tmp_path / "images")
    args = ["pretrain", "--config", str(V1 / "recipe.yaml"), "--data", str(images), "optim.epochs=1"]
    monkeypatch.setenv("RANK", "1")
    assert main([*args, "--out", str(tmp_path / "r1")]) == 0
    assert "done:" not in capsys.readouterr().out
    monkeypatch.setenv("RANK", "0")
    assert main([*args, "--out", str(tmp_path / "r0")]) == 0
    assert "done: 1 epoch, checkpoint" in capsys.readouterr().out  # not "1 epochs" (issue 45)


def test_what_is_next_names_the_folder_that_holds_the_runs_train_split(tmp_path, capsys):
    """After ``--data my_images/train`` beside ``my_images/val``, the eval line gives ``--data my_images`` (quoted
    for the shell); a folder that is no split gets the placeholder."""
    recipe = ["--config", str(V1 / "recipe.yaml"), "optim.epochs=1"]
    photos = tmp_path / "my photos"
    shutil.copytree(V1 / "images", photos / "train")
    (photos / "val").mkdir()
    assert main(["pretrain", *recipe, "--data", str(photos / "train"), "--out", str(tmp_path / "a")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"--data '{photos}'" in lines[-2] and lines[-2].startswith("next: obow eval knn --checkpoint")
    assert main(["pretrain", *recipe, "--data", str(V1 / "images"), "--out", str(tmp_path / "b")]) == 0
    assert "--data <folder with train/ and val/>" in capsys.readouterr().out.splitlines()[-2]


def test_a_run_logger_in_a_folder_named_in_no_utf8_leaves_tensorboard_out_in_one_line(tmp_path):
    """TensorBoard's writer encodes its folder's name as UTF-8 and stopped a run whose ``--out`` was named in an old
    archive's Latin-1 (Python reads the bytes as surrogates) with "'utf-8' codec can't encode"; such a run goes on
    without TensorBoard's logs, saying so in one line. ``drawable`` makes such a name one matplotlib can draw."""
    import os

    from obow.show import drawable
    from obow.training.run.logger import RunLogger

    assert drawable("caf\udce9") == "caf\\xe9" and drawable("café") == "café"
    out = Path(os.fsdecode(os.path.join(os.fsencode(tmp_path), b"caf\xe9")))
    out.mkdir()
    cfg = load_config(str(V1 / "recipe.yaml"), "train.tensorboard=true")
    with pytest.warns(ObowWarning) as said:
        logger = RunLogger(out, cfg, enabled=True)
    assert [str(w.message) for w in said] == [
        f"no TensorBoard logs in {out}: the folder's name is not UTF-8 and TensorBoard cannot write there; log.jsonl "
        "holds every value (train.tensorboard=false leaves them out without this line)"
    ]
    assert logger.tb is None and not (out / "tensorboard").exists()
    logger.write({"type": "epoch", "epoch": 1})
    logger.close()
    assert (out / "log.jsonl").read_text() == '{"type": "epoch", "epoch": 1}\n'
    utf8 = tmp_path / "café"
    utf8.mkdir()
    logger = RunLogger(utf8, cfg, enabled=True)
    assert logger.tb is not None
    logger.close()


@pytest.mark.slow
def test_a_run_named_in_no_utf8_trains_resumes_and_draws(tmp_path):
    """The commands in real processes (pytest's worker processes cannot send such names back in a test's captured
    output), on images and a run folder named in Latin-1: the override took the name as YAML and refused it, the
    TensorBoard writer stopped the run, ``show run`` raised inside matplotlib; now each finishes."""
    import os
    import subprocess
    import sys

    base = os.fsencode(tmp_path)
    images, out = os.path.join(base, b"\xe9t\xe9"), os.path.join(base, b"caf\xe9")
    shutil.copytree(V1 / "images", os.fsdecode(images))
    obow = [os.fsencode(sys.executable), b"-m", b"obow"]
    pretrain = [*obow, b"pretrain", b"--config", os.fsencode(V1 / "recipe.yaml"), b"--data", images, b"--out", out]
    for epochs in (b"1", b"2"):
        done = subprocess.run([*pretrain, b"train.tensorboard=true", b"optim.epochs=" + epochs], capture_output=True)
        assert done.returncode == 0, done.stderr.decode(errors="backslashreplace")
        assert done.stdout.startswith(b"done: " + epochs + b" epoch")
        assert done.stderr.count(b"no TensorBoard logs in ") == 1
    drawn = subprocess.run([*obow, b"show", b"run", out], capture_output=True)
    assert drawn.returncode == 0, drawn.stderr.decode(errors="backslashreplace")
    assert os.path.getsize(os.path.join(out, b"curves.png")) > 0


def test_show_words_leaves_out_unused_words_and_titles_the_picture(tmp_path):
    from PIL import Image

    from obow.show.words import TITLE_HEIGHT, show_words

    result = show_words(V1 / "checkpoint_epoch1.pt", V1 / "images", tmp_path / "w", level="conv5", num_words=16)
    assert result["usage"] and all(u > 0 for u in result["usage"])
    assert len(result["words"]) < 16  # 16 words, 24 images of 3x3 border-free conv5 maps: some words go unused
    grid = Image.open(result["grid"])
    assert grid.size[1] == TITLE_HEIGHT + len(result["words"]) * 68 + 4
    band = np.asarray(grid)[:TITLE_HEIGHT]
    assert (band < 128).any()  # the title is drawn: "conv5 visual words, teacher network, epoch 1"


def test_a_few_shot_column_the_test_set_cannot_fill_says_why():
    import torch

    from obow.evaluate.protocol import evaluate_features
    from obow.experiments.tables import aggregate, markdown

    train_x, train_y = torch.randn(12, 4), torch.arange(12) % 3
    test_x, test_y = torch.randn(9, 4), torch.arange(9) % 3  # 3 images per class: 1-shot yes, 5-shot no
    scores = evaluate_features(train_x, train_y, test_x, test_y, k=5, episodes=5, linear=False)
    assert "fewshot_1" in scores and "fewshot_5" not in scores
    note = "5-shot not measured: episodes need 5 support and 1 query image per class; the smallest test class has 3"
    assert scores["notes"] == [note]
    run = {"seed": 0, "scores": scores, "steps": 0, "minutes": 0.0}
    record = {
        "title": "t",
        "note": "n",
        "recipe": "r",
        "budget": {"epochs": 1},
        "seeds": [0],
        "train_images": 12,
        "test_images": 9,
        "protocol": {"k": 5, "temperature": 0.1, "episodes": 5},
        "random_init": aggregate("random init", "random_init", {}, [run]),
        "rows": [aggregate("a", "a", {}, [run])],
    }
    table = markdown(record, ("1-shot", "5-shot"))
    assert table.count(note) == 1 and table.rstrip().endswith(f"- `-`: {note}")
    row_a = next(line for line in table.splitlines() if line.startswith("| a |"))
    cells = [c.strip() for c in row_a.split("|")[1:-1]]  # row a: label, 2 paper, 1-shot, 5-shot
    assert cells[0] == "a" and cells[3] != "-" and cells[4] == "-"


def test_a_tables_header_gives_the_k_its_runs_used():
    """Issue 39: with 100 training images the kNN memory holds 100, the JSON records knn_k 100, and the header
    said k=200."""
    from obow.experiments.tables import aggregate, markdown

    def record(k_used: int) -> dict:
        run = {"seed": 0, "scores": {"knn": 30.0, "knn_k": k_used}, "steps": 0, "minutes": 0.0}
        return {
            "title": "t",
            "note": "n",
            "recipe": "r",
            "budget": {"epochs": 1},
            "seeds": [0],
            "train_images": 100,
            "test_images": 50,
            "protocol": {"k": 200, "temperature": 0.1, "episodes": 5},
            "random_init": aggregate("random init", "random_init", {}, [run]),
            "rows": [aggregate("a", "a", {}, [run])],
        }

    header = markdown(record(100), ("1-shot",)).splitlines()[2]
    assert "kNN k=100 (200 asked; at most the 100 training images the kNN memory holds), T=0.1" in header
    assert "k=200" not in header
    assert "kNN k=200, T=0.1" in markdown(record(200), ("1-shot",))


def test_a_runs_files_share_one_mode_which_follows_the_umask(tiny_run, tmp_path):
    """Issue 39: checkpoints were 0600 (mkstemp's mode) beside a run's 0644 files."""
    import os
    import stat

    from obow.weights.checkpoint import save_atomic

    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tiny_run.out.iterdir() if p.is_file()}
    assert {"checkpoint.pt", "config.yaml", "log.jsonl", ".obow.lock"} <= set(modes)
    assert len(set(modes.values())) == 1, modes
    for umask, expected in ((0o077, 0o600), (0o002, 0o664), (0o022, 0o644)):
        previous = os.umask(umask)
        try:
            save_atomic({"x": torch.zeros(1)}, tmp_path / f"{umask:o}.pt")
            (tmp_path / f"{umask:o}.json").write_text("{}")
        finally:
            os.umask(previous)
        assert stat.S_IMODE((tmp_path / f"{umask:o}.pt").stat().st_mode) == expected
        assert stat.S_IMODE((tmp_path / f"{umask:o}.json").stat().st_mode) == expected


def test_an_omp_num_threads_that_is_not_a_number_is_said_in_one_line(tmp_path, monkeypatch, obow_cli):
    from obow.training.run.threads import ignored_omp_threads

    assert ignored_omp_threads({}) is None and ignored_omp_threads({"OMP_NUM_THREADS": ""}) is None
    assert ignored_omp_threads({"OMP_NUM_THREADS": "3"}) is None
    assert "OMP_NUM_THREADS='0' is not a whole number of threads above 0" in ignored_omp_threads(
        {"OMP_NUM_THREADS": "0"}
    )
    images = shutil.copytree(V1 / "images", tmp_path / "images")
    monkeypatch.setenv("OMP_NUM_THREADS", "zz")
    args = ["pretrain", "--config", V1 / "recipe.yaml", "--data", images, "--out", tmp_path / "run", "optim.epochs=1"]
    result = obow_cli(*args, "train.threads=1")  # one thread, as every test (it is said whatever chooses them)
    (line,) = [x for x in result.err.splitlines() if "OMP_NUM_THREADS" in x and "zz" in x]
    assert line.startswith("WARNING Threads: OMP_NUM_THREADS='zz' is not a whole number of threads above 0, so it is")
    assert "ignored; set it to one (e.g. OMP_NUM_THREADS=2) or use train.threads" in line


# ------------------------------------------------------------------------------------ issue 45: the obow command


def _parsers(parser):
    """``parser`` and every sub-command's parser below it."""
    import argparse

    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_an_override_after_a_list_option_is_an_override_not_a_value():
    from obow.cli import build_parser, parse_args

    line = ["tables", "run", "table1", "--data", "D", "--minutes", "5", "--seeds", "0", "1", "optim.lr=0.1"]
    args = parse_args(build_parser(), [*line, "--rows", "2", "3", "model.num_words=64", "--out", "runs/a=1"])
    assert args.seeds == [0, 1] and args.rows == ["2", "3"] and args.out == "runs/a=1"
    assert args.overrides == ["optim.lr=0.1", "model.num_words=64"]
    args = parse_args(build_parser(), ["pretrain", "a.b=1", "--data", "D", "c=2", "--config", "R"])
    assert (args.data, args.config, args.overrides) == ("D", "R", ["a.b=1", "c=2"])


def test_every_parser_of_the_command_takes_whole_option_names_only(capsys):
    from obow.cli import build_parser

    parsers = list(_parsers(build_parser()))
    assert len(parsers) > 15 and all(not p.allow_abbrev for p in parsers)
    with pytest.raises(SystemExit) as refused:
        main(["tables", "run", "table1", "--data", "D", "--minute", "5"])
    assert refused.value.code == 2 and "--minute" in capsys.readouterr().err


def _table_folder(tmp_path, write_images, recipe):
    data = tmp_path / "data"
    write_images(data / "train", per_class=8, size=28)
    write_images(data / "test", per_class=4, size=28, seed=1)
    return [
        "tables",
        "run",
        "table3",
        "--data",
        data,
        "--recipe",
        recipe,
        "--out",
        tmp_path / "t",
        "--rows",
        "1",
        "model.border=0",
    ]


def test_a_folder_planned_for_a_wrong_budget_is_planned_again_with_replan(
    tmp_path, write_images, tiny_recipe, obow_cli
):
    line = _table_folder(tmp_path, write_images, tiny_recipe)
    folder = tmp_path / "t" / "table3"
    obow_cli(*line, "--budget", "3", "--plan-only")
    refused = obow_cli(*line, "--budget", "1", "--plan-only", check=False)
    assert refused.code == 2
    (error,) = refused.err.strip().splitlines()
    assert "planned for 3 epochs a row and 2 steps an epoch; this call asks for 1 epoch and 2" in error
    assert "{" not in error and "--replan" in error
    obow_cli(*line, "--budget", "1", "--plan-only", "--replan")
    plan = json.loads((folder / "plan.json").read_text())
    assert plan["budget"] == {"epochs": 1} and plan["stages"]["soft_dynamic/pretrain"]["epochs"] == 1
    (folder / "soft_dynamic" / "seed0").mkdir(parents=True)
    (folder / "soft_dynamic" / "seed0" / "config.yaml").write_text("{}")  # a row that began training
    refused = obow_cli(*line, "--budget", "3", "--plan-only", "--replan", check=False)
    assert refused.code == 2 and "has rows that trained for its plan (soft_dynamic/seed0)" in refused.err
    assert json.loads((folder / "plan.json").read_text())["budget"] == {"epochs": 1}  # kept


def test_a_budget_reads_as_words():
    from obow.experiments.tables.plan import budget_text

    assert budget_text({"minutes": 25.0}) == "25 minutes" and budget_text({"minutes": 0.5}) == "0.5 minutes"
    assert budget_text({"epochs": 3}) == "3 epochs" and budget_text({"epochs": 1}) == "1 epoch"
    assert budget_text({"minutes": 1}) == "1 minute"


def test_show_run_writes_curves_png_in_the_run_when_no_out_is_given(tiny_run, tmp_path, obow_cli):
    run = tiny_run.copy(tmp_path / "run")
    result = obow_cli("show", "run", run)
    assert result.out.strip() == f"wrote {run / 'curves.png'}" and (run / "curves.png").is_file()


def test_every_panel_title_of_show_run_stays_over_its_panel(tiny_run):
    from obow.show.run_plots import read_run, runs_figure

    fig = runs_figure([read_run(tiny_run.out)])
    renderer = fig.canvas.get_renderer()
    titled = [ax for ax in fig.axes if ax.get_title()]
    assert any("spread of the student's predicted BoWs" in ax.get_title() for ax in titled)
    for ax in titled:
        title, panel = ax.title.get_window_extent(renderer), ax.get_window_extent(renderer)
        assert title.x0 >= 0 and title.x1 <= fig.bbox.x1, ax.get_title()  # inside the picture
        assert title.width <= panel.width, ax.get_title()  # no wider than its panel: it reaches no neighbour


def test_a_finished_run_started_again_says_it_is_finished(tiny_run, tmp_path, obow_cli):
    run = tiny_run.copy(tmp_path / "run")
    args = [*tiny_run.args[:-2], run, "optim.epochs=2"]  # its own command line, on the copy
    assert tiny_run.args[-2] == tiny_run.out
    result = obow_cli(*args)
    assert f"{run} is finished (6 of 6 iterations); raise optim.epochs to extend it" in result.err  # 2 epochs of 3
    assert "Resuming" not in result.err and "done: 2 epochs" in result.out


def test_an_export_without_its_sidecar_is_evaluated_without_epoch_none(tmp_path, obow_cli):
    obow_cli("export", "--checkpoint", V1 / "checkpoint_epoch1.pt", "--out", tmp_path / "b.pth")
    (tmp_path / "b.pth.json").unlink()
    data = tmp_path / "data"
    for split in ("train", "val"):
        shutil.copytree(V1 / "images", data / split)
    args = ["eval", "knn", "--backbone", tmp_path / "b.pth", "--data", data, "--k", "3", "--workers", "0"]
    (header,) = [line for line in obow_cli(*args).out.splitlines() if line.startswith("knn: ")]
    assert f"exported of {tmp_path / 'b.pth'}, view" in header and "None" not in header


def test_obow_help_names_every_export_format(capsys):
    from obow.cli.common import FORMATS

    with pytest.raises(SystemExit):
        main(["--help"])
    printed = " ".join(capsys.readouterr().out.split())  # argparse wraps the help's lines
    entry = printed[printed.index(" export ") :].split(" import-official ")[0]
    assert all(fmt in entry.lower() for fmt in FORMATS), entry


@pytest.mark.parametrize(
    ("item", "expected"),
    [
        ("optim.lr=", "an empty value was given for optim.lr, which takes a number (e.g. 0.05 or 1/15)"),
        ("data.batch_size=", "an empty value was given for data.batch_size, which takes an integer"),
        ("model.levels=", "an empty value was given for model.levels, which takes a list of strings"),
        ("train.deterministic=", "an empty value was given for train.deterministic, which takes true or false"),
    ],
)
def test_an_empty_override_says_it_is_empty_and_what_the_setting_takes(item, expected):
    from obow.config import ConfigError

    with pytest.raises(ConfigError) as refused:
        load_config("cifar10_fast", [item])
    assert str(refused.value) == expected
    assert load_config("cifar10_fast", ["model.temperature_init="]).model.temperature_init is None  # may be empty


def test_the_recipes_page_says_num_words_is_a_multiple_of_the_batch():
    from obow.config import ConfigError

    page = " ".join((Path(__file__).parents[1] / "docs" / "recipes.md").read_text().split())
    assert "`model.num_words` must be a multiple of `data.batch_size`" in page
    with pytest.raises(ConfigError, match=r"^model.num_words \(500\) must be a multiple of data.batch_size \(128\)"):
        load_config("cifar10_fast", ["model.num_words=500"])


def test_an_empty_data_folder_is_one_line_and_leaves_no_run_folder(tmp_path, tiny_recipe, obow_cli):
    (tmp_path / "empty").mkdir()
    out = tmp_path / "run"
    result = obow_cli("pretrain", "--config", tiny_recipe, "--data", tmp_path / "empty", "--out", out, check=False)
    assert result.code == 2
    (line,) = [x for x in result.err.splitlines() if "error" in x]
    assert line.startswith(f"obow: error: no images found under {tmp_path / 'empty'}") and "Traceback" not in result.err
    assert not out.exists()  # no config.yaml, no lock


@pytest.mark.parametrize("name", ["cifar10_fast", "imagenet_resnet50_full"])
def test_recipes_name_prints_every_setting_of_the_resolved_recipe_under_its_header(name, tmp_path, obow_cli):
    import yaml

    from obow.config import RECIPES_DIR
    from obow.config.schema import to_dict

    printed = obow_cli("recipes", name).out
    first_comment = (RECIPES_DIR / f"{name}.yaml").read_text().splitlines()[0]
    assert printed.startswith(first_comment + "\n") and "\nbase:" not in printed
    settings = yaml.safe_load(printed)
    assert settings == to_dict(load_config(name))  # base and defaults applied: every section, every key
    assert {"model", "views", "data", "optim", "train"} <= set(settings)
    (tmp_path / "again.yaml").write_text(printed)
    assert load_config(tmp_path / "again.yaml") == load_config(name)  # what it prints is the recipe itself


def test_a_log_line_during_a_progress_bar_starts_on_its_own_line(monkeypatch, capsys):
    import sys

    from tqdm import tqdm

    import obow.cli

    def command(args):
        with tqdm(total=3, file=sys.stderr, ascii=True, desc="epoch 1/2") as bar:
            bar.update(1)
            logging.getLogger("obow").warning("a warning mid-epoch")
            bar.update(2)
        return 0

    monkeypatch.setattr(obow.cli, "cmd_recipes", command)
    handler = logging.StreamHandler(sys.stderr)  # the console handler that logging.basicConfig makes outside pytest
    logging.root.addHandler(handler)
    try:
        assert main(["recipes"]) == 0
    finally:
        logging.root.removeHandler(handler)
    err = capsys.readouterr().err
    assert err.count("a warning mid-epoch") == 1
    assert err[: err.index("a warning mid-epoch")].endswith(("\r", "\n"))  # the bar cleared first, not "...it/s]a"


def correlated_features(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """64-d features of 4 classes, every dimension the same shared factor plus a weak class signal and noise: batch
    norm leaves them strongly correlated (the top eigenvalue of their second moment about 33), as a small network's
    pool5 features are, so that the resnet18 preset's lr 10 diverges from the first steps."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % 4
    shared = torch.randn(n, 1, generator=g)
    signal = torch.nn.functional.one_hot(labels, 4).float().repeat(1, 16)
    return shared + 0.3 * signal + torch.randn(n, 64, generator=g), labels


def test_the_tables_linear_probe_is_capped_at_a_stable_rate_and_a_diverged_one_is_no_score(monkeypatch):
    """The tables' protocol ran the resnet18 preset at lr 10 as it is; on batch-normed features of a small network
    that diverges at once (CIFAR-10 features of cifar10_fast at random init: 25.35 against 29.30 at the stable
    rate, seed 0). It is now capped as `obow eval linear` caps it, says the rate, and a probe that diverges anyway
    gives no score (a note instead)."""
    from obow.evaluate.linear import preset_settings, stable_lr, train_linear_probe
    from obow.evaluate.protocol import evaluate_features

    train_x, train_y = correlated_features(800, 0)
    test_x, test_y = correlated_features(400, 1)
    settings = preset_settings("resnet18")
    cap = stable_lr(train_x, 4, settings["momentum"], batch_norm=True)
    assert cap < settings["lr"] / 10
    with pytest.warns(ObowWarning, match="the linear probe diverged at lr 10"):
        as_before = train_linear_probe([train_x], train_y, test_x, test_y, **settings, batch_norm=True)
    assert as_before["diverged"] is not None  # what every table's linear column was until this test
    with warnings.catch_warnings():
        warnings.simplefilter("error", ObowWarning)  # no divergence now
        scores = evaluate_features(train_x, train_y, test_x, test_y, k=20, episodes=5)
    assert scores["linear_lr"] == pytest.approx(cap)
    assert scores["linear"] > 45.0  # chance is 25

    from obow.evaluate import protocol

    def diverging(*args, **kwargs):
        return {"top1": 10.0, "diverged": "its training loss rose (a stand-in)"}

    monkeypatch.setattr(protocol, "train_linear_probe", diverging)
    scores = evaluate_features(train_x, train_y, test_x, test_y, k=20, episodes=5)
    assert "linear" not in scores
    assert f"linear not measured: the probe diverged at lr {cap:.3g}" in scores["notes"]


def test_a_command_piped_into_head_ends_quietly():
    """``obow recipes | head -1``: the reader closes the pipe (here before anything is written, as a reader that has
    its line does); obow ends as a process killed by SIGPIPE would (status 141), without the "obow: error: [Errno
    32] Broken pipe" it printed before."""
    import os
    import subprocess
    import sys

    command = [sys.executable, "-c", "import sys; from obow.cli import main; sys.exit(main())", "recipes"]
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert process.stdout is not None and process.stderr is not None
    process.stdout.close()  # the pipe's only reader gone (Python's start-up takes far longer than this line)
    err = process.stderr.read().decode()
    assert process.wait(timeout=60) == 141, err
    assert err == ""
