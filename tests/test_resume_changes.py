"""Resuming a run whose surroundings changed (issue 60): its training images gained or lost some, moved to
another folder, or its short run is extended; a run folder whose earlier attempt died before its first
checkpoint; a run folder given where a checkpoint is expected.

The runs are real ``obow pretrain`` commands on the tiny recipe (24 images, batch 8: 3 steps an epoch), in this
process (``obow_cli``) or, for ``kill -9``, in a process of their own; they are marked slow. The rules themselves
(what identifies the images, what counts as a change of settings, where a run folder's checkpoint is) are
checked without training, on real files."""

import gzip
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import write_class_images

TRAIN = ("train.knn_every=0", "train.tensorboard=false")


def pretrain(recipe, data, out, *extra):
    return ["pretrain", "--config", recipe, "--data", data, "--out", out, *TRAIN, *extra]


def error_line(result) -> str:
    """The one ``obow: error:`` line of a failed command (its stderr holds nothing else of obow's own)."""
    lines = [line for line in result.err.splitlines() if line.startswith("obow: error:")]
    assert result.code == 2 and len(lines) == 1, result.err
    assert "Traceback" not in result.err
    return lines[0]


def steps(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------------------------------------ 1: changed data


@pytest.mark.slow
@pytest.mark.parametrize(
    ("change", "said"),
    [
        ("add 1", "1 image added (e.g. class0/new000.png)"),  # 25 images: still 3 steps an epoch (was silent)
        ("add 8", "8 images added (e.g. class0/new000.png)"),  # 32: 4 steps (was "host_iteration 4 is not ...")
        ("remove 8", "8 images removed (e.g. class0/000.png)"),  # 16: 2 steps
    ],
)
def test_a_resume_on_changed_images_is_refused_in_one_line_naming_the_change(
    tmp_path, tiny_recipe, obow_cli, change, said
):
    data, out = write_class_images(tmp_path / "data"), tmp_path / "run"
    obow_cli(*pretrain(tiny_recipe, data, out, "optim.epochs=1"))
    before = (out / "checkpoint.pt").read_bytes()
    verb, n = change.split()
    for i in range(int(n)):
        if verb == "add":
            shutil.copy(data / "class0" / "000.png", data / "class0" / f"new{i:03d}.png")
        else:
            (data / f"class{i % 2}" / f"{i // 2:03d}.png").unlink()
    line = error_line(obow_cli(*pretrain(tiny_recipe, data, out, "optim.epochs=2"), check=False))
    assert f"the training images in {data} (data.path) are not those the run in {out} was trained on" in line
    assert said in line
    assert "another --out" in line and "data.on_change=continue" in line
    assert (out / "checkpoint.pt").read_bytes() == before  # nothing of the run was touched


@pytest.mark.slow
def test_data_on_change_continue_goes_on_with_the_new_images_and_the_new_steps_per_epoch(
    tmp_path, tiny_recipe, obow_cli
):
    from obow.schedules import learning_rate
    from obow.weights.checkpoint import load_checkpoint

    data, out = write_class_images(tmp_path / "data"), tmp_path / "run"
    obow_cli(*pretrain(tiny_recipe, data, out, "optim.epochs=1"))
    write_class_images(tmp_path / "more", per_class=4, seed=3)  # 8 more images: 32, 4 steps an epoch
    for c in range(2):
        for image in (tmp_path / "more" / f"class{c}").iterdir():
            shutil.copy(image, data / f"class{c}" / f"more_{image.name}")
    result = obow_cli(*pretrain(tiny_recipe, data, out, "optim.epochs=2", "data.on_change=continue"))
    assert "8 images added (e.g. class0/more_000.png); continuing on the images now there" in result.err
    assert "steps per epoch 3 -> 4: the schedules follow the new count" in result.err
    ckpt = load_checkpoint(out / "checkpoint.pt")
    assert ckpt["iteration"] == 8 and int(ckpt["model"]["iteration"]) == 8  # epoch 2 is 4 steps from iteration 4
    assert ckpt["data"]["images"] == 32
    lrs = {r["iteration"]: r["lr"] for r in steps(out) if "type" not in r and "lr" in r}
    o = ckpt["config"]["optim"]
    for it in (5, 8):  # the second epoch on the 4-step plan
        assert lrs[it] == pytest.approx(learning_rate(it - 1, 4, base_lr=o["lr"], epochs=2, end_lr=o["end_lr"],
                                                      warmup_epochs=o["warmup_epochs"]))  # fmt: skip
    with gzip.open(out / "images.tsv.gz", "rt") as f:
        assert len(f.read().splitlines()) == 32  # the list now says what the run trains on
    # the changed set is the run's now: extending it needs nothing more
    assert obow_cli(*pretrain(tiny_recipe, data, out, "optim.epochs=3")).code == 0


@pytest.mark.slow
def test_a_continuing_run_killed_before_its_checkpoint_leaves_the_refusal_naming_what_changed(
    tmp_path, tiny_recipe, obow_cli
):
    """``data.on_change=continue`` on 8 added images, kill -9 before that run's first checkpoint, then the plain
    command: refused, naming the 8 images (the list was rewritten when the continuing run started, and the refusal
    said only ``88 images now, 80 then``); the continuing run's list is adopted with its checkpoint."""
    data, out = write_class_images(tmp_path / "data", per_class=40), tmp_path / "run"  # 80 images: 10 steps
    obow_cli(*pretrain(tiny_recipe, data, out, "optim.epochs=1"))
    for i in range(8):
        shutil.copy(data / "class0" / "000.png", data / "class0" / f"new{i:03d}.png")
    args = pretrain(tiny_recipe, data, out, "optim.epochs=2", "data.on_change=continue", "train.checkpoint_minutes=0")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "obow.cli", *map(str, args)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.time() + 240
    # the first step on the 88 images: the plan counts epoch 1 as 11 steps now, so epoch 2 runs iterations 12-22
    while '"iteration": 12' not in (out / "log.jsonl").read_text():
        assert proc.poll() is None, proc.communicate()[1]
        assert time.time() < deadline, "iteration 12 was not logged in time"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    from obow.weights.checkpoint import load_checkpoint

    assert load_checkpoint(out / "checkpoint.pt")["iteration"] == 10  # killed before the continuing run's checkpoint
    line = error_line(obow_cli(*pretrain(tiny_recipe, data, out, "optim.epochs=2"), check=False))
    assert "8 images added (e.g. class0/new000.png)" in line, line
    # continued again, to its checkpoint: the new list is in place with it, the one before kept beside it
    obow_cli(*pretrain(tiny_recipe, data, out, "optim.epochs=2", "data.on_change=continue"))
    with gzip.open(out / "images.tsv.gz", "rt") as f, gzip.open(out / "images.prev.tsv.gz", "rt") as g:
        assert (len(f.read().splitlines()), len(g.read().splitlines())) == (88, 80)
    assert not (out / "images.next.tsv.gz").exists()


@pytest.mark.slow
def test_continuing_mid_epoch_on_fewer_images_ends_the_shorter_epoch_at_once(tmp_path, tiny_recipe, obow_cli):
    """A checkpoint at batch 2 of 3, resumed on 8 images (1 step an epoch): the epoch under way is past its new end,
    so it ends there (its record over the steps it had), and the next epoch has the one step."""
    from obow.weights.checkpoint import load_checkpoint

    data, out = write_class_images(tmp_path / "data"), tmp_path / "run"
    obow_cli(*pretrain(tiny_recipe, data, out, "optim.epochs=1", "train.checkpoint_every=2"))
    shutil.copy(out / "checkpoint.prev.pt", out / "checkpoint.pt")  # the one at iteration 2 (batch 2 of epoch 1)
    assert load_checkpoint(out / "checkpoint.pt")["batch_in_epoch"] == 2
    for c in range(2):
        for i in range(4, 12):
            (data / f"class{c}" / f"{i:03d}.png").unlink()
    obow_cli(*pretrain(tiny_recipe, data, out, "optim.epochs=2", "train.checkpoint_every=2", "data.on_change=continue"))
    ckpt = load_checkpoint(out / "checkpoint.pt")
    assert (ckpt["epoch"], ckpt["iteration"], int(ckpt["model"]["iteration"])) == (2, 2, 2)
    assert [h["iteration"] for h in ckpt["history"]] == [1, 2]


@pytest.mark.slow
def test_an_out_inside_the_data_folder_is_refused_before_anything_is_written(tmp_path, tiny_recipe, obow_cli):
    data = write_class_images(tmp_path / "data")
    for out in (data / "runs" / "mine", data):
        line = error_line(obow_cli(*pretrain(tiny_recipe, data, out, "optim.epochs=1"), check=False))
        assert f"--out {out} is inside --data {data}" in line and "nothing was written" in line
    assert sorted(p.name for p in data.iterdir()) == ["class0", "class1"]


# ------------------------------------------------------------------------------------------------ 3: moved data


@pytest.mark.slow
def test_the_same_images_in_another_folder_resume_with_one_line_saying_so(tmp_path, tiny_recipe, obow_cli):
    data, out = write_class_images(tmp_path / "data"), tmp_path / "run"
    obow_cli(*pretrain(tiny_recipe, data, out, "optim.epochs=1"))
    moved = tmp_path / "mounted" / "elsewhere"
    shutil.copytree(data, moved)  # a copy: other modification times, the same names and sizes
    (moved / "class1" / "000.png").unlink()  # moved and changed: refused, naming both folders and the change
    line = error_line(obow_cli(*pretrain(tiny_recipe, moved, out, "optim.epochs=2"), check=False))
    assert f"the training images in {moved} (data.path; it was {data}) are not those the run in {out}" in line
    assert "1 image removed (e.g. class1/000.png)" in line
    shutil.copy(data / "class1" / "000.png", moved / "class1" / "000.png")
    shutil.rmtree(data)
    result = obow_cli(*pretrain(tiny_recipe, moved, out, "optim.epochs=2"))
    assert f"data.path is now {moved}, was {data}: the same 24 images (names and sizes), resuming" in result.err
    assert f"Resuming {out} from iteration 3" in result.err


# ------------------------------------------------------------------------------------------------ 2: extending


@pytest.mark.slow
def test_a_short_run_whose_warm_up_obow_shortened_is_extended_with_the_warm_up_asked(tmp_path, tiny_recipe, obow_cli):
    """1 epoch with a 1-epoch warm-up runs its warm-up over half the epoch; the same command with optim.epochs=2
    continues it (it was refused: ``optim.warmup_epochs: 0.5 -> 1.0``), and the second epoch follows the 2-epoch
    plan, whose 1-epoch warm-up is as asked. Learning rates by hand (smooth cosine, end 0, base 0.05; the step
    logged at iteration i ran at i - 1): warm-up over 1.5 steps, then cos over the 1.5 left; in the extension a
    warm-up of 3 steps (done), then cos over the 3 steps left."""
    from obow.config import load_config

    data, out = write_class_images(tmp_path / "data"), tmp_path / "run"
    asked = ("optim.warmup_epochs=1", "optim.cosine_per_epoch=false")
    first = obow_cli(*pretrain(tiny_recipe, data, out, "optim.epochs=1", *asked))
    assert "the warm-up is shortened to 0.5 epochs for this run" in first.err
    assert load_config(out / "config.yaml").optim.warmup_epochs == 1  # what was asked
    second = obow_cli(*pretrain(tiny_recipe, data, out, "optim.epochs=2", *asked))
    assert "Extending the run from 1 to 2 epochs at iteration 3" in second.err
    assert "shortened" not in second.err
    lrs = [r["lr"] for r in steps(out) if "type" not in r and "lr" in r]
    base = 0.05
    cos = lambda done, total: base * 0.5 * (1 + math.cos(math.pi * done / total))  # noqa: E731
    expected = [0.0, base / 1.5, cos(0.5, 1.5), cos(0, 3), cos(1, 3), cos(2, 3)]
    assert lrs == pytest.approx(expected, abs=1e-9)


def test_a_checkpoint_holding_the_warm_up_obow_shortened_is_compared_with_what_was_asked():
    """Checkpoints written before the fix hold the shortened warm-up (half their epochs); the user's own value
    asked again is not a change of settings, while another warm-up of a run that was long enough still is."""
    from obow.config import Config, OptimConfig, to_dict
    from obow.training.run.settings_check import check_same_run
    from obow.training.run.state import RunError

    def cfg(epochs, warmup):
        return Config(optim=OptimConfig(epochs=epochs, warmup_epochs=warmup))

    saved = to_dict(cfg(1, 0.5))  # a 1-epoch run of a recipe with a 1-epoch (or longer) warm-up
    assert check_same_run(cfg(2, 1.0), saved, Path("checkpoint.pt")) == 1  # extended, the warm-up as asked
    assert check_same_run(cfg(1, 3.0), saved, Path("checkpoint.pt")) is None  # resumed as it was
    with pytest.raises(RunError, match=r"optim.warmup_epochs: 0.5 -> 0.25"):
        check_same_run(cfg(2, 0.25), saved, Path("checkpoint.pt"))
    # a checkpoint that keeps what was asked (it has its images' record too): 2 of 4 asked, then 5, is a change
    with pytest.raises(RunError, match=r"optim.warmup_epochs: 2.0 -> 5.0"):
        check_same_run(cfg(10, 5.0), to_dict(cfg(4, 2.0)), Path("checkpoint.pt"), warmup_as_asked=True)


def test_a_change_of_settings_names_each_setting_for_a_caller_to_say_in_its_own_words():
    """The refusal is a RunError (one line for the user) that also carries the changed settings alone, which the
    demo puts in its own sentence (tests/test_demo.py); two changes are both named, before and after."""
    from obow.config import load_config, to_dict
    from obow.training.run.settings_check import SettingsChanged, check_same_run
    from obow.training.run.state import RunError

    saved = to_dict(load_config("demo", ["model.teacher_momentum=0.95"]))
    now = load_config("demo", ["model.num_words=512"])
    with pytest.raises(SettingsChanged) as err:
        check_same_run(now, saved, Path("runs/demo/pretrain/checkpoint.pt"))
    assert isinstance(err.value, RunError)
    assert err.value.diffs == "model.num_words: 1024 -> 512; model.teacher_momentum: 0.95 -> 0.9"
    assert str(err.value).startswith("runs/demo/pretrain/checkpoint.pt belongs to a run with other settings (model.num")
    assert check_same_run(load_config("demo", []), to_dict(load_config("demo", [])), Path("c.pt")) is None


def test_the_warm_up_of_a_run_not_longer_than_it_is_half_the_run():
    from obow.schedules import learning_rate, run_warmup

    assert (run_warmup(1.0, 1), run_warmup(3.0, 2), run_warmup(1.0, 2), run_warmup(0.0, 1)) == (0.5, 1.0, 1.0, 0.0)
    # 1 epoch of 4 steps, 1-epoch warm-up asked: linear over 2 steps, as the shortened recipe did
    assert learning_rate(1, 4, base_lr=1.0, epochs=1, warmup_epochs=1.0) == pytest.approx(0.5)


# ------------------------------------------------------------------------------------------------ identity


def test_images_are_identified_by_relative_names_and_sizes_not_folder_or_times(tmp_path):
    from obow.data.folders import scan_images
    from obow.data.identity import compare, identify

    data = write_class_images(tmp_path / "a", per_class=3)
    first = identify(scan_images(data))
    assert first.record["images"] == 6 and first.record["bytes"] == sum(p.stat().st_size for p in data.rglob("*.png"))
    assert first.files[0] == ("class0/000.png", (data / "class0" / "000.png").stat().st_size)
    moved = shutil.copytree(data, tmp_path / "b")  # new times, same names and sizes
    os.utime(moved / "class0" / "000.png", (0, 0))
    assert identify(scan_images(moved)).digest == first.digest
    (moved / "class1" / "002.png").write_bytes((moved / "class1" / "002.png").read_bytes() + b"\0")
    (moved / "class0" / "001.png").rename(moved / "class0" / "x.png")
    changed = identify(scan_images(moved))
    assert changed.digest != first.digest
    diff = compare(first.files, changed.files)
    assert (diff.added, diff.removed, diff.resized) == (["class0/x.png"], ["class0/001.png"], ["class1/002.png"])
    assert diff.describe() == "1 image added, 1 removed, 1 changed in size (e.g. class0/x.png)"


def test_the_image_list_is_trusted_only_when_it_matches_the_checkpoints_digest(tmp_path):
    from obow.data.folders import scan_images
    from obow.data.identity import identify, read_list, write_list

    identity = identify(scan_images(write_class_images(tmp_path / "a", per_class=2)))
    path = tmp_path / "images.tsv.gz"
    write_list(identity, path)
    assert read_list(path, identity.digest) == identity.files
    assert read_list(path, "0" * 64) is None  # another run's list
    path.write_bytes(path.read_bytes()[:10])
    assert read_list(path, identity.digest) is None  # cut short
    assert read_list(tmp_path / "missing.gz", identity.digest) is None


def test_the_image_list_keeps_any_file_name_linux_allows(tmp_path):
    """Newlines, carriage returns, backslashes, tabs, Unicode line separators and bytes that are no UTF-8 in file
    names: the list reads back to the same names (a newline in one name made the whole list unreadable, and a resume
    on changed images could not say which changed); a list written before the names were escaped still reads."""
    import gzip

    from obow.data.identity import DataIdentity, compare, digest, read_list, write_list

    names = ["a/new\nline.png", "a/cr\rhere.png", "a/back\\slash\\n.png", "a/tab\there.png", "a/nel\x85.png",
             "a/sep\u2028.png", "a/\udcff-not-utf8.png", "b/plain.png"]  # fmt: skip
    files = sorted((name, 100 + i) for i, name in enumerate(names))
    identity = DataIdentity(files, digest(files))
    path = tmp_path / "images.tsv.gz"
    write_list(identity, path)
    assert read_list(path, identity.digest) == files
    assert len(gzip.decompress(path.read_bytes()).split(b"\n")) == len(files) + 1  # one line a name
    old = [(name, size) for name, size in files if "\n" not in name and "\r" not in name]  # what the old format kept
    old_identity = DataIdentity(old, digest(old))
    path.write_bytes(gzip.compress("".join(f"{n}\t{s}\n" for n, s in old).encode("utf-8", "surrogateescape")))
    assert read_list(path, old_identity.digest) == old  # written raw: "back\slash\n" read as it was written
    # a change names the file on the line, a name with a newline quoted as Python writes it
    change = compare(files, [f for f in files if f[0] != "a/new\nline.png"])
    assert change.describe() == "1 image removed (e.g. 'a/new\\nline.png')"


def test_what_a_resume_says_of_its_images_when_the_list_or_the_record_is_missing(tmp_path, caplog):
    from obow.config import Config, DataConfig, to_dict
    from obow.data.folders import scan_images
    from obow.data.identity import identify
    from obow.training.run.data_check import check_same_data
    from obow.training.run.state import RunError

    def cfg(path, **data):
        return Config(data=DataConfig(path=str(path), batch_size=4, **data))

    data, out = write_class_images(tmp_path / "data", per_class=4), tmp_path / "run"  # 8 images: 2 steps
    out.mkdir()
    identity = identify(scan_images(data))
    ckpt = {"config": to_dict(cfg(data)), "data": identity.record}
    with caplog.at_level("INFO", logger="obow"):
        check_same_data(cfg(data), ckpt, out, identity)
    assert not caplog.text  # the same images in the same folder: nothing to say
    (data / "class0" / "000.png").unlink()
    fewer = identify(scan_images(data))
    with pytest.raises(RunError, match=r": 7 images now, 8 then \(the list that would say which, .*images.tsv.gz, is"):
        check_same_data(cfg(data), ckpt, out, fewer)  # no list in the run folder: counted
    with caplog.at_level("WARNING", logger="obow"):
        check_same_data(cfg(data, on_change="continue"), ckpt, out, fewer)
    assert "continuing on the images now there (data.on_change=continue); steps per epoch 2 -> 1" in caplog.text
    old = {"config": to_dict(cfg(tmp_path / "elsewhere"))}  # written before runs recorded their images
    check_same_data(cfg(tmp_path / "elsewhere"), old, out, fewer)  # resumed on its own folder, unchecked
    with pytest.raises(RunError, match=r"written before obow recorded which images .* resume with --data "):
        check_same_data(cfg(data), old, out, fewer)
    with pytest.raises(ValueError, match=r"data.on_change=.ignore. is not allowed; choose one of .refuse., .continue."):
        DataConfig(on_change="ignore")


# ------------------------------------------------------------------------------------------------ 6: dead attempt


@pytest.mark.slow
def test_a_run_killed_before_its_first_checkpoint_leaves_no_log_to_the_next_one(tmp_path, tiny_recipe, obow_cli):
    """kill -9 at iteration 2 of a 10-step epoch (no checkpoint yet); the next start's log.jsonl and TensorBoard
    hold its own iterations only, from 1 (they held 1-2 then 1-10), and the dead attempt's are set aside."""
    data, out = write_class_images(tmp_path / "data", per_class=40), tmp_path / "run"
    args = [*pretrain(tiny_recipe, data, out, "optim.epochs=1", "train.checkpoint_minutes=0")]
    args[args.index("train.tensorboard=false")] = "train.tensorboard=true"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "obow.cli", *map(str, args)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.time() + 240
    while not ((out / "log.jsonl").exists() and '"iteration": 2' in (out / "log.jsonl").read_text()):
        assert proc.poll() is None, proc.communicate()[1]
        assert time.time() < deadline, "iteration 2 was not logged in time"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert not (out / "checkpoint.pt").exists() and not (out / "checkpoint.prev.pt").exists()
    dead_events = list((out / "tensorboard").glob("events.*"))
    assert dead_events

    result = obow_cli(*args)
    iterations = [r["iteration"] for r in steps(out) if "type" not in r and "lr" in r]
    assert iterations == list(range(1, 11))
    assert len(list((out / "tensorboard").glob("events.*"))) == 1
    assert f"{out} holds the logs of an earlier attempt that wrote no checkpoint: moved to" in result.err
    assert [p.name for p in (out / "previous_attempt" / "tensorboard").glob("events.*")] == [dead_events[0].name]
    old = [json.loads(x)["iteration"] for x in (out / "previous_attempt" / "log.jsonl").read_text().splitlines()]
    assert old[:2] == [1, 2]


def test_logs_are_set_aside_only_for_a_new_run(tmp_path):
    from obow.training.run.folder import set_aside_attempt

    out = tmp_path / "run"
    set_aside_attempt(out)  # no folder: nothing to do
    out.mkdir()
    (out / "log.jsonl").write_text('{"iteration": 1}\n')
    (out / "config.yaml").write_text("description: first\n")
    (out / "previous_attempt").mkdir()
    (out / "previous_attempt" / "log.jsonl").write_text("an older attempt\n")
    set_aside_attempt(out)
    assert not (out / "log.jsonl").exists() and not (out / "config.yaml").exists()
    assert (out / "previous_attempt" / "log.jsonl").read_text() == '{"iteration": 1}\n'  # the older one replaced
    assert (out / "previous_attempt" / "config.yaml").read_text() == "description: first\n"


# ------------------------------------------------------------------------------------------------ 10: run folder


@pytest.mark.slow
def test_a_run_folder_is_read_as_its_newest_checkpoint_that_reads(tmp_path, make_checkpoint, caplog):
    from obow.weights.locate import checkpoint_path

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"--checkpoint .*run is a folder without a checkpoint \(looked for"):
        checkpoint_path(run)
    make_checkpoint(run / "checkpoints" / "epoch_0002.pt", iteration=20)
    make_checkpoint(run / "checkpoints" / "epoch_0004.pt", iteration=40)
    assert checkpoint_path(run) == str(run / "checkpoints" / "epoch_0004.pt")
    make_checkpoint(run / "checkpoint.prev.pt", iteration=50)
    make_checkpoint(run / "checkpoint.pt", iteration=55)
    with caplog.at_level("INFO", logger="obow"):
        assert checkpoint_path(run) == str(run / "checkpoint.pt")
    assert "its newest checkpoint" in caplog.text and "(iteration 55)" in caplog.text
    (run / "checkpoint.pt").write_bytes((run / "checkpoint.pt").read_bytes()[:1000])  # cut short
    with pytest.warns(UserWarning, match=r"checkpoint.pt: .*cut short.*using .*checkpoint.prev.pt \(iteration 50\)"):
        assert checkpoint_path(run) == str(run / "checkpoint.prev.pt")
    assert checkpoint_path(run / "checkpoint.prev.pt") == str(run / "checkpoint.prev.pt")  # a file: as given
    for path in [run / "checkpoint.prev.pt", *(run / "checkpoints").iterdir()]:
        path.write_bytes(b"")
    with pytest.raises(ValueError, match=r"no checkpoint of .*run can be read \(checkpoint.pt: .*epoch_0002.pt: "):
        checkpoint_path(run)


@pytest.mark.slow
def test_eval_export_and_show_take_a_run_folder(tiny_run, tmp_path, obow_cli):
    run = tiny_run.copy(tmp_path / "run")
    data = tiny_run.data
    exported = obow_cli("export", "--checkpoint", run, "--out", tmp_path / "b.pth")
    assert f"--checkpoint {run}: its newest checkpoint, {run / 'checkpoint.pt'}" in exported.err
    assert json.loads((tmp_path / "b.pth.json").read_text())["source_checkpoint"] == str(run / "checkpoint.pt")
    obow_cli("eval", "knn", "--checkpoint", run, "--data", data, "--k", "3", "--device", "cpu", "--workers", "0")
    assert (run / "eval" / "knn.json").is_file()  # the report beside the checkpoint, as for the file
    obow_cli("show", "neighbours", "--checkpoint", run, "--data", data, "--out", tmp_path / "n.png", "--queries", "2",
             "--k", "2", "--device", "cpu", "--workers", "0")  # fmt: skip
    assert (tmp_path / "n.png").is_file()
    empty = tmp_path / "empty"
    empty.mkdir()
    for command in (["export", "--out", tmp_path / "c.pth"], ["eval", "knn", "--data", data, "--device", "cpu"],
                    ["show", "words", "--data", data, "--out", tmp_path / "w"]):  # fmt: skip
        line = error_line(obow_cli(*command, "--checkpoint", empty, check=False))
        assert f"--checkpoint {empty} is a folder without a checkpoint" in line
    assert torch.load(tmp_path / "b.pth", weights_only=True)
