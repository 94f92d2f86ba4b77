"""Faults a demanding newcomer met (issue 60): an empty recipe, a run too large for the machine, SIGHUP, a
checkpoint damaged in place, a diverging run, a second signal, views far larger than the images.

Where the finding was a process or a file (a hang-up, a signal, bytes changed in a checkpoint), the tests use
the real ``obow`` command and real files, with the helpers of ``test_run_safety``.
"""

import fcntl
import logging
import os
import pty
import shutil
import signal
import subprocess
import sys
import termios
import textwrap
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from test_run_safety import ENV, STEPS_PER_EPOCH, pretrain_args, read_log, setup, start, wait_for_iteration

from obow.config import ConfigError, load_config
from obow.diagnostics import effective_rank, feature_diagnostics
from obow.training import cost as budget_check
from obow.training.cost import check_view_sizes, judge
from obow.training.run.guards import COLLAPSED_RANK, RunGuard
from obow.training.run.signals import SAME_REQUEST_SECONDS, handle_signals
from obow.training.run.state import RunError
from obow.training.step_cost import SavedPeak, measure_step, probe_batch
from obow.weights.checkpoint import load_checkpoint

__all__ = ["setup"]  # the module-scoped fixture of test_run_safety: its recipe and images

V1_CHECKPOINT = Path(__file__).parent / "data" / "v1_run" / "checkpoint_epoch1.pt"


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("obow: error:")]


# ------------------------------------------------------------------------------------------------ 4: recipes and memory


@pytest.mark.parametrize("text", ["", "# nothing but a comment\n"], ids=["empty", "comments"])
def test_an_empty_recipe_is_refused_in_one_line_naming_it(tmp_path, write_images, obow_cli, text):
    """An empty recipe was the defaults: the paper's ResNet-50 at batch 256, killed for memory on a CPU."""
    recipe = tmp_path / "mine.yaml"
    recipe.write_text(text)
    data = write_images(tmp_path / "data", per_class=2)
    result = obow_cli("pretrain", "--config", recipe, "--data", data, "--out", tmp_path / "run", check=False)
    assert result.code == 2
    (line,) = error_lines(result.err)
    assert line.startswith(f"obow: error: recipe {recipe.resolve()} is empty")
    assert not (tmp_path / "run").exists()


def test_saved_peak_is_the_most_autograd_holds_at_once():
    """Hand count: ``exp`` keeps its output for the backward pass, so ``exp(exp(x))`` holds two ``n``-float
    tensors; a second graph built after the first is freed holds them again, not on top."""
    n = 1000
    x = torch.randn(n, requires_grad=True)
    with SavedPeak().watching() as saved:
        x.exp().exp().sum().backward()
        assert saved.now == 0  # the graph is freed with its backward
        x.exp().exp().sum().backward()
    assert saved.peak == 2 * n * 4


def test_the_cost_measured_on_small_steps_extrapolates_to_the_batch(tiny_recipe):
    """The activations measured on steps of 1 and 2 images, extended to the batch, equal what a real step of the
    whole batch keeps (counted the same way), to 5%."""
    cfg = load_config(tiny_recipe, ["data.batch_size=8", "data.path=/unused", "train.precision=fp32"])
    states, activations, seconds, _ = measure_step(cfg, torch.device("cpu"))
    from obow.methods import build_method
    from obow.training.run.precision import precision_context
    from obow.training.step.shared import forward_backward, to_device

    model = build_method(cfg, total_iterations=1000, resuming=True).train()
    model.begin_step(logged=False)
    teacher, views = to_device(probe_batch(cfg, 8), torch.device("cpu"), False)
    with SavedPeak().watching() as saved:
        forward_backward(model, teacher, views, None, precision_context("fp32", torch.device("cpu")), True)
    assert activations == pytest.approx(saved.peak, rel=0.05)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert states > 3 * 4 * trained and seconds > 0  # float32 weights, their gradients and momentum


def test_a_run_that_cannot_fit_is_refused_before_its_first_step(tmp_path, tiny_recipe, write_images, obow_cli,
                                                                monkeypatch):  # fmt: skip
    """The step is measured on the real method; with less memory available than it needs (here 1 MiB, as a small
    control group would leave), the run is refused in one line naming what to lower, before its recipe or a
    checkpoint is written."""
    monkeypatch.setattr(budget_check, "available_memory", lambda device: 1 << 20)
    data = write_images(tmp_path / "data", per_class=4)
    out = tmp_path / "run"
    result = obow_cli("pretrain", "--config", tiny_recipe, "--data", data, "--out", out, "train.knn_every=0",
                      check=False)  # fmt: skip
    assert result.code == 2
    (line,) = error_lines(result.err)
    assert line.startswith("obow: error: this run does not fit in memory: about ")
    assert "GiB available; lower data.batch_size" in line
    assert not (out / "config.yaml").exists() and not (out / "checkpoint.pt").exists()


def test_the_cost_line_warns_close_to_the_limit(caplog):
    cfg = load_config("cifar10_fast")
    cost = budget_check.Cost(states=1 << 30, activations=3 << 30, epoch_seconds=600.0, available=9 << 29, how="x")
    with caplog.at_level(logging.INFO, logger="obow"):
        judge(cost, cfg, torch.device("cpu"))
    assert "Cost: about 4.0 GiB at data.batch_size=128" in caplog.text
    assert "about 10 min of steps per epoch on this CPU: close to what the machine has" in caplog.text
    with pytest.raises(RunError, match="does not fit in memory"):
        judge(budget_check.Cost(1 << 30, 5 << 30, None, 5 << 30, "x"), cfg, torch.device("cpu"))


def test_an_out_of_memory_error_in_training_is_one_line(tmp_path, tiny_recipe, write_images, obow_cli, monkeypatch):
    """The CPU allocator's own failure (a real allocation too large for any machine) ends the run with one line
    naming what to lower, not the allocator's message."""
    from obow.training import loop

    def allocate(*args, **kwargs):
        return torch.empty(1 << 60, dtype=torch.uint8)

    monkeypatch.setattr(loop, "train_step", allocate)
    data = write_images(tmp_path / "data", per_class=4)
    result = obow_cli("pretrain", "--config", tiny_recipe, "--data", data, "--out", tmp_path / "run",
                      "train.knn_every=0", check=False)  # fmt: skip
    assert result.code == 2
    (line,) = error_lines(result.err)
    assert line.startswith("obow: error: out of memory during training (it asked for 1152921504606846976 bytes more)")
    assert "lower data.batch_size" in line and "DefaultCPUAllocator" not in result.err


# ------------------------------------------------------------------------------------------------ 13: view sizes


def test_a_crop_larger_than_the_teacher_view_is_refused(tiny_recipe):
    with pytest.raises(ConfigError, match=r"views.crop_size \(30\) must be <= views.teacher_size \(24\)"):
        load_config(tiny_recipe, ["views.crop_size=30"])
    assert load_config(tiny_recipe, ["views.crop_size=24"]).views.crop_size == 24


def test_views_far_above_the_images_size_are_warned_about_once(tmp_path, tiny_recipe, write_images, caplog):
    data = write_images(tmp_path / "data", per_class=4, size=32)
    paths = sorted(str(p) for p in data.rglob("*.png"))
    big = load_config(tiny_recipe, ["views.teacher_size=200", "views.teacher_resize=228", "views.crop_size=160"])
    with caplog.at_level(logging.WARNING, logger="obow"):
        assert check_view_sizes(load_config(tiny_recipe), paths) == pytest.approx(24 / 32)
        assert caplog.text == ""
        assert check_view_sizes(big, paths) == pytest.approx(200 / 32)
    assert caplog.text.count("the views are far above the images' size") == 1
    assert "views.teacher_size=200, views.crop_size=160 against a shorter side of 32 px" in caplog.text
    assert "far above the recipe's size" not in caplog.text


def test_images_far_above_the_recipes_size_are_warned_about_once(tmp_path, tiny_recipe, write_images, caplog):
    """The tiny recipe's views are made from 28 px images: 224 px images (8x) are far above them, 200 px (7.1x) not."""
    cfg = load_config(tiny_recipe)
    for size in (200, 224):
        write_images(tmp_path / str(size), per_class=3, size=size)
    with caplog.at_level(logging.WARNING, logger="obow"):
        assert check_view_sizes(cfg, sorted(str(p) for p in (tmp_path / "200").rglob("*.png"))) == 24 / 200
        assert caplog.text == ""
        assert check_view_sizes(cfg, sorted(str(p) for p in (tmp_path / "224").rglob("*.png"))) == 24 / 224
    assert caplog.text.count("far above the recipe's size") == 1
    assert "a shorter side of 224 px (the median of 6 images) against views made from 28 px images" in caplog.text
    assert "1/8 of each side" in caplog.text and "far above the images' size" not in caplog.text


# ------------------------------------------------------------------------------------------------ 8: divergence


def test_a_diverging_run_stops_in_one_line_before_a_checkpoint_keeps_it(tmp_path, tiny_recipe, write_images, obow_cli):
    """``optim.lr=1e8``: before, a logged step's SVD failed on the non-finite features (``linalg.svd: The algorithm
    failed to converge``). Now one line names the iteration, the learning rate and the checkpoint kept, which
    holds finite weights only."""
    data = write_images(tmp_path / "data", per_class=16)
    out = tmp_path / "run"
    args = ("pretrain", "--config", tiny_recipe, "--data", data, "--out", out, "optim.lr=1e8", "optim.warmup_epochs=0",
            "train.checkpoint_every=1", "train.knn_every=0", "train.log_every=100")  # fmt: skip
    result = obow_cli(*args, check=False)
    assert result.code == 2
    (line,) = error_lines(result.err)
    assert "svd" not in result.err
    kept = load_checkpoint(out / "checkpoint.pt")
    assert line.startswith("obow: error: the ") and "became non-finite " in line
    assert "(learning rate 1e+08)" in line
    assert f"the last checkpoint, {out / 'checkpoint.pt'} (iteration {kept['iteration']}), is kept" in line
    tensors = [t for t in kept["model"].values() if torch.is_floating_point(t)]
    assert all(torch.isfinite(t).all() for t in tensors)


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_the_effective_rank_of_non_finite_features_is_nan_not_an_error(value):
    """A ``nan`` feature made the SVD fail (``linalg.svd: The algorithm failed to converge``)."""
    features = torch.randn(16, 8)
    assert float(effective_rank(features)) > 1
    features[3, 2] = float(value)
    assert torch.isnan(effective_rank(features)) and torch.isnan(feature_diagnostics(features)["effective_rank"])


def test_the_first_non_finite_loss_is_noted_on_the_device_and_a_collapse_warned_about_once(tmp_path, caplog):
    guard = RunGuard()
    for iteration, (loss, lr) in enumerate([(1.0, 0.1), (float("nan"), 0.2), (float("inf"), 0.3)], start=1):
        guard.note(torch.tensor(loss), iteration, lr)
    with pytest.raises(RunError, match=r"non-finite at iteration 2 \(learning rate 0.2\).*no checkpoint was written"):
        guard.check(tmp_path, None, torch.device("cpu"))
    fine = RunGuard()
    fine.note(torch.tensor(1.0), 1, 0.1)
    fine.check(tmp_path, None, torch.device("cpu"))
    with caplog.at_level(logging.WARNING, logger="obow"):
        fine.logged({"student/effective_rank": 2.0}, 10)
        fine.logged({"student/effective_rank": float("nan")}, 20)
        assert caplog.text == ""
        fine.logged({"student/effective_rank": COLLAPSED_RANK - 0.41}, 30)
        fine.logged({"student/effective_rank": 1.01}, 40)
    assert caplog.text.count("the student's features have collapsed: effective rank 1.09 at iteration 30") == 1


# ------------------------------------------------------------------------------------------------ 7: checksums


def damage_in_place(path: Path, seed: int = 0) -> None:
    """Write random bytes over part of the largest tensor of a checkpoint, without changing its length."""
    with zipfile.ZipFile(path) as z:
        entry = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(path, "r+b") as f:
        f.seek(entry.header_offset + 26)
        name_length, extra_length = np.frombuffer(f.read(4), dtype="<u2")
        f.seek(entry.header_offset + 30 + int(name_length) + int(extra_length) + entry.file_size // 3)
        f.write(np.random.default_rng(seed).integers(0, 256, 64, dtype=np.uint8).tobytes())


def test_a_checkpoint_damaged_in_place_is_refused_by_eval_export_and_show(tiny_run, tmp_path, obow_cli):
    run = Path(shutil.copytree(tiny_run.out, tmp_path / "run"))
    checkpoint = run / "checkpoint.pt"
    size = checkpoint.stat().st_size
    damage_in_place(checkpoint)
    assert checkpoint.stat().st_size == size
    torch.load(checkpoint, weights_only=True)  # PyTorch alone reads it without a word
    why = "its contents do not match the checksum written with it"
    for command in (
        ("eval", "knn", "--checkpoint", checkpoint, "--data", tiny_run.data, "--k", "3"),
        ("export", "--checkpoint", checkpoint, "--out", tmp_path / "backbone.pth"),
        ("show", "words", "--checkpoint", checkpoint, "--data", tiny_run.data / "val", "--out", tmp_path / "w"),
    ):
        result = obow_cli(*command, check=False)
        assert result.code == 2, command
        (line,) = error_lines(result.err)
        assert why in line and f"the run's previous checkpoint is {str(run / 'checkpoint.prev.pt')!r}" in line


def test_a_resume_falls_back_from_a_checkpoint_damaged_in_place(tiny_run, tmp_path, obow_cli):
    run = Path(shutil.copytree(tiny_run.out, tmp_path / "run"))
    previous = load_checkpoint(run / "checkpoint.prev.pt")["iteration"]
    damage_in_place(run / "checkpoint.pt")
    args = [a if a != tiny_run.out else run for a in tiny_run.args]
    result = obow_cli(*args, "train.knn_every=0")
    assert f"{run / 'checkpoint.pt'} cannot be read (its contents do not match the checksum" in result.err
    assert f"resuming from the previous checkpoint {run / 'checkpoint.prev.pt'}, iteration {previous}" in result.err
    assert load_checkpoint(run / "checkpoint.pt")["iteration"] == load_checkpoint(tiny_run.checkpoint)["iteration"]


def test_a_checkpoint_without_a_checksum_still_loads_and_says_so_once(tmp_path):
    old = Path(shutil.copy(V1_CHECKPOINT, tmp_path / "old.pt"))  # a path this process has not read yet
    with pytest.warns(UserWarning, match="has no checksum") as said:
        assert load_checkpoint(old)["iteration"] == load_checkpoint(old)["iteration"] > 0
    assert sum("has no checksum" in str(w.message) for w in said) == 1


# ------------------------------------------------------------------------------------------------ 5 and 9: signals


def test_a_second_signal_aborts_at_once_and_a_repeat_passed_on_by_a_parent_does_not(caplog):
    """Alone, a process aborts on the second signal however soon it comes (the docs said so; a second Ctrl-C within
    a second was ignored); where a parent passes signals on (torchrun), a repeat at once is the same request."""

    def deliver(signum: int) -> None:
        os.kill(os.getpid(), signum)
        for _ in range(1000):
            pass

    with handle_signals() as flag, pytest.raises(KeyboardInterrupt, match="SIGINT"):
        deliver(signal.SIGHUP)
        assert flag.received == "SIGHUP"
        deliver(signal.SIGINT)
    with handle_signals(repeat_window=SAME_REQUEST_SECONDS) as flag:
        deliver(signal.SIGINT)
        deliver(signal.SIGINT)
        assert flag.received == "SIGINT"
    assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup: the hang-up stays ignored
    try:
        with handle_signals() as flag:
            deliver(signal.SIGHUP)
            assert flag.received is None
    finally:
        signal.signal(signal.SIGHUP, previous)


def take_terminal(slave: int):
    """A new session whose controlling terminal is the pseudo-terminal ``slave`` (as a login shell's is)."""

    def apply() -> None:
        os.setsid()
        fcntl.ioctl(slave, termios.TIOCSCTTY, 0)

    return apply


@pytest.mark.slow
def test_closing_the_terminal_checkpoints_and_exits_129(setup, tmp_path):
    """The run's terminal goes away (a closed window, a dropped ssh): the kernel sends SIGHUP, which ended the
    process at once (exit 129, no checkpoint). Now the step under way finishes and its checkpoint is written."""
    out = tmp_path / "run"
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "obow.cli", *pretrain_args(setup, out, "train.checkpoint_minutes=0")],
        stdin=slave, stdout=slave, stderr=slave, env=ENV, preexec_fn=take_terminal(slave), close_fds=True,
    )  # fmt: skip
    os.close(slave)
    try:
        wait_for_iteration(out, STEPS_PER_EPOCH + 3, proc)
    finally:
        os.close(master)  # the terminal is gone: SIGHUP to its session
    assert proc.wait(timeout=120) == 128 + signal.SIGHUP
    ckpt = load_checkpoint(out / "checkpoint.pt")
    assert 0 < ckpt["batch_in_epoch"] and ckpt["iteration"] == max(r["iteration"] for r in read_log(out))


@pytest.mark.slow
def test_sighup_is_one_line_and_a_checkpoint_like_sigterm(setup, tmp_path):
    out = tmp_path / "run"
    proc = start(*pretrain_args(setup, out, "train.checkpoint_minutes=0"))
    wait_for_iteration(out, 3, proc)
    proc.send_signal(signal.SIGHUP)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGHUP, stderr
    assert "SIGHUP: finishing the step under way, then writing a checkpoint" in stderr
    ckpt = load_checkpoint(out / "checkpoint.pt")
    assert f"Interrupted: checkpoint written at iteration {ckpt['iteration']}" in stderr
    assert ckpt["iteration"] == max(r["iteration"] for r in read_log(out))


@pytest.mark.slow
def test_a_second_signal_aborts_with_a_line_naming_the_checkpoint_kept(setup, tmp_path):
    """Two signals at once (the process stopped while both arrive, so that neither waits for the other): the first
    asks for a checkpoint, the second aborts at once, exit 130, naming the checkpoint on disk and its iteration."""
    out = tmp_path / "run"
    proc = start(*pretrain_args(setup, out, "train.checkpoint_every=2", "train.checkpoint_minutes=0"))
    wait_for_iteration(out, 5, proc)
    proc.send_signal(signal.SIGSTOP)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    proc.send_signal(signal.SIGCONT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    kept = load_checkpoint(out / "checkpoint.pt")["iteration"]
    assert (
        f"a second signal (SIGTERM): aborted at once, without a checkpoint of the steps since the last one; the last "
        f"checkpoint, {out / 'checkpoint.pt'} (iteration {kept}), is kept" in stderr
    )
    assert "Traceback" not in stderr


# ------------------------------------------------------------------------------------------------ a signal while set up


def stop_while_building(monkeypatch, signum: int) -> None:
    """Make the network's construction, part of the run's set-up, send ``signum`` to this process first."""
    from obow.training import loop

    real = loop.build_model

    def signalled(*args, **kwargs):
        os.kill(os.getpid(), signum)
        for _ in range(10_000):  # the handler runs at the next bytecode
            pass
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "build_model", signalled)


def released(out: Path) -> bool:
    """Whether the run folder's lock was let go cleanly (emptied or removed), not left naming a dead holder."""
    lock = out / ".obow.lock"
    return not lock.exists() or lock.stat().st_size == 0


def test_ctrl_c_while_a_run_is_set_up_stops_it_in_one_line_and_frees_its_folder(
    tmp_path, tiny_recipe, write_images, obow_cli, monkeypatch
):
    """Ctrl-C after the run folder was locked and before the first step (the cost measured, the images cached,
    the network built: seconds to minutes) returned 130 without a word; SIGTERM and SIGHUP there killed the process
    silently, leaving the lock. Now the run stops at once in one line naming what is kept, the lock is released,
    and the same command then trains."""
    data = write_images(tmp_path / "data", per_class=4)
    out = tmp_path / "run"
    args = ("pretrain", "--config", tiny_recipe, "--data", data, "--out", out, "train.knn_every=0")
    stop_while_building(monkeypatch, signal.SIGINT)
    result = obow_cli(*args, check=False)
    assert result.code == 130, result.err
    said = [line for line in result.err.splitlines() if "while the run was set up" in line]
    assert said == [
        f"WARNING SIGINT while the run was set up: stopped before its first step; no checkpoint was written in {out} "
        "yet; run the same command to start it again"
    ], result.err
    assert "Traceback" not in result.err and not (out / "log.jsonl").exists()
    assert released(out)
    monkeypatch.undo()
    assert obow_cli(*args).code == 0 and (out / "checkpoint.pt").is_file()
    assert "earlier attempt" not in obow_cli(*args).err  # the stopped start left no logs to set aside


def test_a_signal_while_a_run_resumes_keeps_its_checkpoint_as_it_was(tmp_path, tiny_run, obow_cli, monkeypatch):
    out = tiny_run.copy(tmp_path / "run")
    before = (out / "checkpoint.pt").read_bytes()
    args = [out if a == tiny_run.out else a for a in tiny_run.args]
    stop_while_building(monkeypatch, signal.SIGINT)
    result = obow_cli(*args, "optim.epochs=3", check=False)
    assert result.code == 130, result.err
    assert (
        f"SIGINT while the run was set up: stopped before its first step; the last checkpoint, {out / 'checkpoint.pt'} "
        "(iteration 6), is kept; run the same command to resume"
    ) in result.err
    assert (out / "checkpoint.pt").read_bytes() == before and released(out)


@pytest.mark.slow
@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_sigterm_while_a_run_is_set_up_is_one_line_not_a_silent_death(
    tmp_path, tiny_recipe, write_images, signum, code
):
    """A real process: its network's construction waits (as a long cost probe or cache build would) and the test
    sends the signal then. Before, the process died of it (exit -15 / -1) with nothing said and its lock left."""
    data = write_images(tmp_path / "data", per_class=4)
    out, ready = tmp_path / "run", tmp_path / "building"
    driver = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from obow.training import loop
        real = loop.build_model
        def waiting(*args, **kwargs):
            Path({str(ready)!r}).touch()
            time.sleep(60)
            return real(*args, **kwargs)
        loop.build_model = waiting
        from obow.cli import main
        sys.exit(main(sys.argv[1:]))
        """
    )
    args = ["pretrain", "--config", str(tiny_recipe), "--data", str(data), "--out", str(out), "train.knn_every=0"]
    proc = subprocess.Popen([sys.executable, "-c", driver, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=ENV)  # fmt: skip
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    name = signal.Signals(signum).name
    assert f"{name} while the run was set up: stopped before its first step; no checkpoint was written" in err, err
    assert "Traceback" not in err and released(out)
