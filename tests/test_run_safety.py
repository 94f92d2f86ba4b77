"""Never lose a run: one writer per run folder, exact resume after a signal or a hard kill, one-line errors
for failed writes, and checkpoints that a weights-only ``torch.load`` reads.

Where the process boundary is the point (two writers, a signal, ``kill -9``, a file size limit), the tests run
the real ``obow`` command in subprocesses, on a narrow network (8 to 16 channels) with
``train.deterministic: true`` and one thread, so that an interrupted run and an uninterrupted one can be
compared tensor for tensor.
"""

import errno
import fcntl
import json
import os
import random
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from conftest import TINY_RECIPE
from PIL import Image

from obow import cli
from obow.config import load_config, to_dict
from obow.files import WriteError, write_failure_cause
from obow.training.run import lock as lock_module
from obow.training.run.lock import LOCK_NAME, FolderInUse, RunLock
from obow.training.run.random_states import get_rng_state, set_rng_state
from obow.training.run.settings_check import RESUMABLE_CHANGES, check_same_run
from obow.training.run.signals import SAME_REQUEST_SECONDS, handle_signals
from obow.weights.checkpoint import load_checkpoint, previous_path, save_atomic

V1_CHECKPOINT = Path(__file__).parent / "data" / "v1_run" / "checkpoint_epoch1.pt"

#: 80 images, batch 8: 10 steps per epoch, 30 in all; about 0.1 s per step on one CPU thread.
NARROW_RECIPE = (
    TINY_RECIPE
    + """
train: {log_every: 1, knn_every: 0, progress_bar: false, deterministic: true, tensorboard: false}
"""
)  # the shared tiny recipe (conftest.py), without the kNN monitor and TensorBoard; a later key wins in YAML
STEPS_PER_EPOCH, EPOCHS = 10, 3
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def write_images(root: Path, per_class: int = 40, size: int = 32, seed: int = 0) -> Path:
    """``root/class0`` and ``root/class1``: noisy images whose dominant colour channel is the class."""
    rng = np.random.default_rng(seed)
    for c in range(2):
        folder = root / f"class{c}"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pixels = np.zeros((size, size, 3), dtype=np.uint8)
            pixels[..., c] = 160
            Image.fromarray(pixels + rng.integers(0, 90, size=(size, size, 3), dtype=np.uint8)).save(
                folder / f"{i:03d}.png"
            )
    return root


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The recipe file and the training images, shared by the module's runs (none writes to them)."""
    root = tmp_path_factory.mktemp("safety")
    recipe = root / "narrow.yaml"
    recipe.write_text(NARROW_RECIPE)
    return recipe, write_images(root / "data")


def pretrain_args(setup, out: Path, *extra: str) -> list[str]:
    recipe, data = setup
    return ["pretrain", "--config", str(recipe), "--data", str(data), "--out", str(out), *extra]


def obow(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "obow.cli", *args], capture_output=True, text=True, env=ENV, timeout=300, **kwargs
    )


def start(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "obow.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        **kwargs,
    )


def read_log(out: Path) -> list[dict]:
    lines = (out / "log.jsonl").read_text().splitlines() if (out / "log.jsonl").exists() else []
    return [json.loads(line) for line in lines if line.endswith("}")]


def wait_for_iteration(out: Path, iteration: int, proc: subprocess.Popen) -> None:
    """Until ``log.jsonl`` shows ``iteration`` (the run is then in the middle of its work)."""
    deadline = time.time() + 240
    while time.time() < deadline:
        if any(r.get("iteration", 0) >= iteration for r in read_log(out)):
            return
        if proc.poll() is not None:
            _, stderr = proc.communicate()
            raise AssertionError(f"the run ended (exit {proc.returncode}) before iteration {iteration}:\n{stderr}")
        time.sleep(0.01)
    raise AssertionError(f"iteration {iteration} was not reached in time")


def leaves(obj, prefix: str = "") -> dict[str, object]:
    """Every value in a checkpoint (tensors, numbers, strings), by its path of keys."""
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return {prefix: obj}
    out = {}
    for key, value in items:
        out.update(leaves(value, f"{prefix}/{key}"))
    return out


#: What may differ between a resumed run and an uninterrupted one: wall times, and the one setting the tests
#: change on resuming (a resumable one).
MAY_DIFFER = ("/epoch_time_s", "/monitor_time_s", "/epoch_progress/seconds", "/config/train/checkpoint_minutes")


def assert_same_final_state(done: dict, whole: dict) -> None:
    """Every tensor equal (weights, teacher, vocabularies, statistics, optimiser, random states), and every
    other value too (epoch records with their means, positions, random states), wall times aside."""
    a, b = leaves(done), leaves(whole)
    assert a.keys() == b.keys()
    tensors = [k for k, v in a.items() if isinstance(v, torch.Tensor)]
    assert len(tensors) > 100  # the model's and the optimiser's tensors are all in there
    different = [k for k in tensors if not torch.equal(a[k], b[k])]
    different += [k for k in a.keys() - set(tensors) if a[k] != b[k] and not k.endswith(MAY_DIFFER)]
    assert not different, different[:5]
    assert done["iteration"] == whole["iteration"] == STEPS_PER_EPOCH * EPOCHS
    assert [r["loss"] for r in done["history"]] == [r["loss"] for r in whole["history"]]  # (said again: the point)


@pytest.fixture(scope="module")
def uninterrupted(setup, tmp_path_factory):
    """The reference: the whole run without a stop; its final checkpoint and its stderr."""
    out = tmp_path_factory.mktemp("whole") / "run"
    proc = obow(*pretrain_args(setup, out))
    assert proc.returncode == 0, proc.stderr
    return load_checkpoint(out / "checkpoint.pt"), out, proc.stderr


# ------------------------------------------------------------------------------------------------ one writer


def test_lock_refuses_a_second_holder_and_takes_over_a_dead_ones(tmp_path, caplog):
    folder = tmp_path / "run"
    with RunLock(folder):
        (folder / "config.yaml").write_text("a: 1\n")  # a run's file: the lock's file is kept with it
        holder = json.loads((folder / LOCK_NAME).read_text())
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
        with pytest.raises(FolderInUse) as refused:
            RunLock(folder).__enter__()  # another open file description: flock refuses it even in-process
        message = str(refused.value)
        assert str(folder) in message and f"process {os.getpid()} on {socket.gethostname()}" in message
    assert (folder / LOCK_NAME).read_text() == ""  # a clean end empties the file
    # a holder that died without cleaning up: the lock is free, its name is still in the file
    dead = {"host": socket.gethostname(), "pid": 999999, "started": "2026-01-01T00:00:00", "command": "obow x"}
    (folder / LOCK_NAME).write_text(json.dumps(dead))
    with caplog.at_level("WARNING", logger="obow"), RunLock(folder):
        assert json.loads((folder / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert "taking over the lock left by process 999999" in caplog.text and "another host" not in caplog.text
    (folder / LOCK_NAME).write_text(json.dumps({**dead, "host": "elsewhere"}))
    with caplog.at_level("WARNING", logger="obow"), RunLock(folder):
        pass
    assert "it ran on another host" in caplog.text and "elsewhere" in caplog.text


@pytest.mark.slow
def test_a_lock_held_only_by_a_dead_holders_child_is_waited_for_then_named_as_such(tmp_path, caplog, monkeypatch):
    """A dead holder's leftover child (here a ``sleep`` given the lock's descriptor) still holds the ``flock``:
    the lock is taken once the child lets go, or refused naming the leftover, never the dead process as if alive."""
    folder = tmp_path / "run"
    folder.mkdir()
    dead = {"host": socket.gethostname(), "pid": 999999, "started": "2026-01-01T00:00:00", "command": "obow x"}
    (folder / LOCK_NAME).write_text(json.dumps(dead))

    def leftover(seconds: float) -> subprocess.Popen:
        fd = os.open(folder / LOCK_NAME, os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        child = subprocess.Popen(["sleep", str(seconds)], pass_fds=[fd])
        os.close(fd)  # only the child holds it now
        return child

    child = leftover(30)
    monkeypatch.setattr(lock_module, "LEFTOVER_WAIT_S", 0.3, raising=False)
    with pytest.raises(FolderInUse) as refused:
        RunLock(folder).__enter__()
    child.kill()
    child.wait()
    message = str(refused.value)
    assert "left behind by process 999999, which ended without a clean exit" in message and "in use by" not in message
    child = leftover(1)
    monkeypatch.setattr(lock_module, "LEFTOVER_WAIT_S", 20.0, raising=False)
    with caplog.at_level("WARNING", logger="obow"), RunLock(folder):
        assert child.poll() is not None  # taken once the leftover had ended
    assert "taking over the lock left by process 999999" in caplog.text
    child.wait()


def test_a_forked_child_does_not_keep_the_lock_after_its_parent(tmp_path):
    """The lock's descriptor is closed in a forked child (e.g. a data-loading worker): the child neither holds
    the lock after the parent lets go, nor can it release the parent's."""
    folder = tmp_path / "run"
    with RunLock(folder) as held:
        pid = os.fork()
        if pid == 0:  # the child: its copy of the descriptor must be closed already
            try:
                os.fstat(held.fd)
                os._exit(1)
            except OSError:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the forked child inherited the lock's descriptor"
        with pytest.raises(FolderInUse):
            RunLock(folder).__enter__()  # the child's exit left the parent's lock in place


def child_processes(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from ``/proc``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                found.append(int(entry.name))
    return found


@pytest.mark.slow  # a real process: CI runs it (--runslow)
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the data worker in /proc")
def test_a_resume_right_after_kill_9_is_not_refused_for_the_dead_runs_data_worker(
    setup, tmp_path, obow_cli, monkeypatch
):
    """``kill -9`` leaves the run's forked data-loading worker alive until it notices (it looks for its parent
    every 5 s, once its batch is done; here it is held stopped, as in a slow batch); the same command run at
    once resumes, without waiting for it."""
    out = tmp_path / "run"
    args = pretrain_args(setup, out, "data.num_workers=1", "train.checkpoint_every=1")
    proc = start(*args)
    wait_for_iteration(out, 2, proc)  # a checkpoint every step
    (worker,) = child_processes(proc.pid)
    os.kill(worker, signal.SIGSTOP)
    try:
        proc.send_signal(signal.SIGKILL)
        proc.wait()  # not communicate(): the stopped worker holds the output pipes open
        monkeypatch.setattr(lock_module, "LEFTOVER_WAIT_S", 0.0, raising=False)  # no waiting: nothing to wait for
        resumed = obow_cli(*args, check=False)
    finally:
        os.kill(worker, signal.SIGKILL)
        proc.communicate()
    assert resumed.code == 0, resumed.err
    assert f"Resuming {out} from iteration" in resumed.err
    assert f"taking over the lock left by process {proc.pid}" in resumed.err


@pytest.mark.slow
def test_a_second_pretrain_is_refused_and_a_killed_ones_lock_is_taken_over(setup, tmp_path):
    out = tmp_path / "run"
    long = "optim.epochs=50"  # long enough to be running still when the second command starts
    first = start(*pretrain_args(setup, out, long, "optim.lr=0.05"))
    wait_for_iteration(out, 2, first)
    second = obow(*pretrain_args(setup, out, long, "optim.lr=0.02"))
    assert first.poll() is None, "the first run ended before the second one started"
    assert second.returncode == 2, second.stderr
    (line,) = second.stderr.strip().splitlines()
    assert line.startswith(f"obow: error: {out} is in use by process {first.pid} on {socket.gethostname()} (started ")
    assert "pretrain" in line and "optim.lr=0.05" in line  # the holder's command line
    first.send_signal(signal.SIGKILL)
    first.communicate()
    assert load_config(out / "config.yaml").optim.lr == 0.05  # the refused run wrote nothing
    steps_before = [r["iteration"] for r in read_log(out) if "type" not in r]

    third = start(*pretrain_args(setup, out, long, "optim.lr=0.05"))
    wait_for_iteration(out, steps_before[-1] + 2, third)
    third.send_signal(signal.SIGTERM)
    _, stderr = third.communicate(timeout=120)
    assert third.returncode == 128 + signal.SIGTERM, stderr
    assert f"taking over the lock left by process {first.pid} on {socket.gethostname()}" in stderr
    assert "which did not end cleanly" in stderr
    steps = [r["iteration"] for r in read_log(out) if "type" not in r]
    assert steps == list(range(1, len(steps) + 1))  # one writer at a time: each step once, in order
    assert (out / LOCK_NAME).read_text() == ""  # the third run ended cleanly


# ------------------------------------------------------------------------------------------------ signals


def deliver(signum: int) -> None:
    """Send ``signum`` to this process and let its handler run (between two bytecodes of this thread)."""
    os.kill(os.getpid(), signum)
    for _ in range(1000):
        pass


@pytest.mark.slow
def test_first_signal_is_noted_a_repeat_at_once_is_the_same_and_a_later_one_aborts(caplog):
    """Where a parent passes signals on (torchrun's window; alone, a second signal aborts at once:
    test_run_faults.py)."""
    with caplog.at_level("WARNING", logger="obow"), handle_signals(repeat_window=SAME_REQUEST_SECONDS) as flag:
        assert flag.received is None
        deliver(signal.SIGTERM)
        assert flag.received == "SIGTERM"
        deliver(signal.SIGINT)  # at once: torchrun passing on the Ctrl-C its workers also received
        assert flag.received == "SIGTERM"
        time.sleep(SAME_REQUEST_SECONDS + 0.1)
        with pytest.raises(KeyboardInterrupt):
            deliver(signal.SIGINT)
    assert caplog.text.count("SIGTERM: finishing the step under way, then writing a checkpoint") == 1
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the previous handlers are back


class SignalAtTheLastEpoch:
    """A monitor that sends this process SIGTERM while it measures the last epoch's student (the epoch's end)."""

    def __init__(self, cfg, images, device) -> None:
        self.epochs = cfg.optim.epochs

    def due(self, epoch: int) -> bool:
        return epoch == self.epochs

    def __call__(self, backbone) -> dict[str, float]:
        deliver(signal.SIGTERM)
        return {}


def test_a_signal_during_the_last_epochs_end_stops_the_command_after_a_complete_run(tmp_path, write_images, caplog):
    """A signal that comes as the run ends (the last epoch's monitor or checkpoint) is not swallowed: the run is
    complete and saved, and :class:`Interrupted` stops the command before what follows the training (a table's
    evaluation and next run). Before, pretrain returned as if nothing came, and ``obow tables run`` went on."""
    from obow.training.loop import Interrupted, pretrain

    data = write_images(tmp_path / "data", per_class=8, size=20)  # 16 images, batch 8: 2 steps per epoch
    overrides = [f"data.path={data}", "optim.epochs=2", "train.tensorboard=false", "train.knn_every=0"]
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(TINY_RECIPE)
    cfg = load_config(recipe, overrides)
    out = tmp_path / "run"
    with caplog.at_level("INFO", logger="obow"), pytest.raises(Interrupted) as err:
        pretrain(cfg, out, monitor=SignalAtTheLastEpoch)
    assert err.value.exit_code == 128 + signal.SIGTERM
    assert "Interrupted as the run ended: it is complete (checkpoint written at iteration 4)" in caplog.text
    # the message says what is finished first: the monitor (minutes of kNN on a CPU), not a step
    assert (
        "SIGTERM: finishing the end-of-epoch monitor under way (the epoch's steps are done), then writing a "
        "checkpoint" in caplog.text
    )
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    assert ckpt["epoch"] == 2 and ckpt["iteration"] == 4
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    caplog.clear()
    with caplog.at_level("INFO", logger="obow"):  # the same command then goes on: nothing is trained again
        assert pretrain(cfg, out, monitor=SignalAtTheLastEpoch)["iteration"] == 4
    assert "is finished (4 of 4 iterations); raise optim.epochs to extend it" in caplog.text


class AbortWhilePickled:
    """Stands for a second Ctrl-C arriving in the middle of ``torch.save``."""

    def __reduce__(self):
        raise KeyboardInterrupt


def test_a_save_cut_short_keeps_the_previous_file_whole(tmp_path):
    path = tmp_path / "checkpoint.pt"
    save_atomic({"w": torch.arange(10.0)}, path)
    before = path.read_bytes()
    with pytest.raises(KeyboardInterrupt):
        save_atomic({"w": torch.zeros(1000, 1000), "then": AbortWhilePickled()}, path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]  # no temporary file left behind


@pytest.mark.slow
def test_sigterm_mid_epoch_resumes_to_the_uninterrupted_final_state(setup, uninterrupted, tmp_path):
    whole, whole_out, whole_stderr = uninterrupted
    assert f"New run in {whole_out} (no checkpoint there)" in whole_stderr
    out = tmp_path / "run"
    proc = start(*pretrain_args(setup, out, "train.checkpoint_minutes=0"))
    wait_for_iteration(out, STEPS_PER_EPOCH + 3, proc)  # well inside the second epoch
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "SIGTERM: finishing the step under way" in stderr and "Interrupted: checkpoint written" in stderr
    partial = load_checkpoint(out / "checkpoint.pt")
    assert partial["epoch"] == 1 and 0 < partial["batch_in_epoch"] < STEPS_PER_EPOCH, "not in the middle of epoch 2"
    assert partial["epoch_progress"]["steps"] == partial["batch_in_epoch"]
    # the checkpoint is at the last logged step: nothing of a step after it was kept
    assert max(r["iteration"] for r in read_log(out)) == partial["iteration"]

    resumed = obow(*pretrain_args(setup, out))
    assert resumed.returncode == 0, resumed.stderr
    n, b = partial["iteration"], partial["batch_in_epoch"]
    assert f"Resuming {out} from iteration {n} of 30 (epoch 2, batch {b} of 10)" in resumed.stderr
    assert_same_final_state(load_checkpoint(out / "checkpoint.pt"), whole)
    steps = [r["iteration"] for r in read_log(out) if "type" not in r]
    assert steps == list(range(1, 31))


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl_c", "sigterm_to_the_job"])
def test_ctrl_c_reaches_the_data_workers_too_and_still_stops_at_a_step_boundary(setup, tmp_path, sig):
    """A terminal's Ctrl-C goes to the whole process group, and so does a scheduler's SIGTERM (``scancel``,
    ``docker stop``, ``pkill -f``): the loader's worker processes leave it to the main process (otherwise the
    next batch fails with 'DataLoader worker ... killed by signal' and no checkpoint is written), and the
    process still exits (the workers that ignore SIGTERM are ended at exit)."""
    out = tmp_path / "run"
    proc = start(*pretrain_args(setup, out, "data.num_workers=2"), start_new_session=True)
    wait_for_iteration(out, 3, proc)
    os.killpg(proc.pid, sig)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, stderr
    assert "Traceback" not in stderr and "exited unexpectedly" not in stderr and "killed by signal" not in stderr
    ckpt = load_checkpoint(out / "checkpoint.pt")
    assert ckpt["iteration"] == max(r["iteration"] for r in read_log(out)) >= 3


def torchrun(setup, out: Path, **popen) -> subprocess.Popen:
    """``torchrun --nproc_per_node 2 -m obow.cli pretrain ...`` on the CPU (gloo)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port)]
    return subprocess.Popen(
        [*launcher, "-m", "obow.cli", *pretrain_args(setup, out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        **popen,
    )


@pytest.mark.slow
def test_ctrl_c_under_torchrun_stops_both_processes_at_one_boundary_and_resumes_exactly(setup, tmp_path):
    """The terminal's Ctrl-C reaches torchrun and both workers, and torchrun passes it on: each worker gets it
    twice at once, which counts as one request; both agree on the step boundary, and the checkpoint holds
    both processes' random states and epoch sums."""
    whole = torchrun(setup, tmp_path / "whole")
    _, stderr = whole.communicate(timeout=300)
    assert whole.returncode == 0, stderr[-3000:]
    out = tmp_path / "run"
    proc = torchrun(setup, out, start_new_session=True)
    wait_for_iteration(out, STEPS_PER_EPOCH + 3, proc)
    os.killpg(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=300)  # torchrun itself ends with its own error: it was interrupted
    assert "Interrupted: checkpoint written" in stderr, stderr[-3000:]
    partial = load_checkpoint(out / "checkpoint.pt")
    assert partial["epoch"] == 1 and 0 < partial["batch_in_epoch"] < STEPS_PER_EPOCH
    assert len(partial["rng"]) == len(partial["epoch_progress"]["sums"]) == 2
    assert partial["epoch_progress"]["sums"][0] != partial["epoch_progress"]["sums"][1]  # each its own half

    resumed = torchrun(setup, out)
    _, stderr = resumed.communicate(timeout=300)
    assert resumed.returncode == 0 and "Resuming" in stderr, stderr[-3000:]
    assert_same_final_state(
        load_checkpoint(out / "checkpoint.pt"), load_checkpoint(tmp_path / "whole" / "checkpoint.pt")
    )


# ------------------------------------------------------------------------------------------------ hard kill


def test_checkpoint_minutes_is_checked_and_may_change_on_resume():
    assert load_config(None, []).train.checkpoint_minutes == 10
    with pytest.raises(ValueError, match="train.checkpoint_minutes"):
        load_config(None, ["train.checkpoint_minutes=-1"])
    assert "train.checkpoint_minutes" in RESUMABLE_CHANGES
    saved = to_dict(load_config(None, ["train.checkpoint_minutes=0.5"]))
    check_same_run(load_config(None, []), saved, Path("checkpoint.pt"))  # no error


@pytest.mark.slow
def test_kill_9_loses_at_most_the_steps_since_the_last_timed_checkpoint(setup, uninterrupted, tmp_path):
    whole, _, _ = uninterrupted
    out = tmp_path / "run"
    proc = start(*pretrain_args(setup, out, "train.checkpoint_minutes=0.001"))  # about every step
    wait_for_iteration(out, STEPS_PER_EPOCH + 4, proc)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    partial = load_checkpoint(out / "checkpoint.pt")
    assert partial["epoch"] == 1 and partial["batch_in_epoch"] > 0, "no time-based checkpoint inside epoch 2"

    resumed = obow(*pretrain_args(setup, out))  # the default checkpoint_minutes: a resumable change
    assert resumed.returncode == 0, resumed.stderr
    assert f"Resuming {out} from iteration {partial['iteration']} of 30" in resumed.stderr
    assert f"taking over the lock left by process {proc.pid}" in resumed.stderr
    assert_same_final_state(load_checkpoint(out / "checkpoint.pt"), whole)


# ------------------------------------------------------------------------------------------------ write errors


def one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) >= 1 and "Traceback" not in stderr, stderr
    assert lines[-1].startswith("obow: error: "), stderr
    return lines[-1]


def test_an_out_under_a_regular_file_is_one_line_in_every_command(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    data = tmp_path / "data"
    write_images(data / "train", per_class=4)
    write_images(data / "val", per_class=4, seed=1)
    run = tmp_path / "run"
    run.mkdir()
    (run / "log.jsonl").write_text(json.dumps({"epoch": 1, "iteration": 1, "lr": 0.1, "loss": 2.0}) + "\n")
    commands = {
        "export": ["export", "--checkpoint", str(V1_CHECKPOINT), "--out", str(blocker / "b.pth")],
        "eval": [
            "eval",
            "knn",
            "--checkpoint",
            str(V1_CHECKPOINT),
            "--data",
            str(data),
            "--out",
            str(blocker / "r.json"),
            "--k",
            "3",
        ],  # noqa: E501
        "show": ["show", "run", str(run), "--out", str(blocker / "curves.png")],
    }
    for name, args in commands.items():
        assert cli.main(args) == 2, name
        line = one_error_line(capsys.readouterr().err)
        assert line.startswith(f"obow: error: cannot write {blocker}/"), (name, line)
        assert line.endswith(f"{blocker} is a file, not a folder"), (name, line)


@pytest.mark.parametrize("protocol", ["knn", "fewshot"])
def test_an_eval_out_that_cannot_be_written_fails_before_the_evaluation(
    tiny_run, tmp_path, obow_cli, monkeypatch, protocol
):
    """A wrong --out used to fail after the whole evaluation, losing it: it is now checked first."""
    import obow.cli.evaluate as cli_eval

    def evaluated(*args, **kwargs):
        raise AssertionError("the evaluation ran before --out was checked")

    monkeypatch.setattr(cli_eval._Run, "features", evaluated)
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    args = ["eval", protocol, "--checkpoint", tiny_run.out / "checkpoint.pt", "--data", tiny_run.data, "--workers", 0]
    for out, cause in ((blocker / "r.json", f"{blocker} is a file, not a folder"), (tmp_path, "it is a folder")):
        result = obow_cli(*args, "--out", out, check=False)
        assert result.code == 2
        assert one_error_line(result.err).startswith(f"obow: error: cannot write {out}: {cause}")


def test_a_missing_data_or_val_folder_stops_pretrain_before_the_run_folder_is_made(tiny_run, tmp_path, obow_cli):
    out = tmp_path / "run"
    common = ["pretrain", "--config", tiny_run.recipe, "--out", out]
    for option, key, args in (
        ("--val", "data.val_path", ["--data", tiny_run.data / "train", "--val", tmp_path / "no_such_val"]),
        ("--data", "data.path", ["--data", tmp_path / "no_such_train"]),
    ):
        result = obow_cli(*common, *args, check=False)
        assert result.code == 2
        assert (
            one_error_line(result.err)
            == f"obow: error: {option} {args[-1]} ({key}) does not exist: nothing was written"
        )
        assert not out.exists()  # no folder, lock, config.yaml or log to clear up


@pytest.mark.slow  # a real process: CI runs it (--runslow)
def test_pretrain_with_an_out_under_a_regular_file(setup, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    proc = obow(*pretrain_args(setup, blocker / "run"))
    assert proc.returncode == 2
    assert (
        one_error_line(proc.stderr) == f"obow: error: cannot write {blocker / 'run'}: {blocker} is a file, not a folder"
    )


def limit_file_size(limit: int):
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write then fails with EFBIG instead of killing us
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


@pytest.mark.slow
def test_a_failed_checkpoint_write_keeps_the_previous_one(setup, tmp_path):
    out = tmp_path / "run"
    proc = start(*pretrain_args(setup, out, "train.checkpoint_minutes=0"))
    wait_for_iteration(out, 2, proc)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    before = (out / "checkpoint.pt").read_bytes()
    limit = len(before) // 2  # the logs still fit; the next checkpoint does not

    proc = subprocess.run(
        [sys.executable, "-m", "obow.cli", *pretrain_args(setup, out, "train.checkpoint_minutes=0")],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
        preexec_fn=limit_file_size(limit),
    )
    assert proc.returncode == 2
    assert one_error_line(proc.stderr) == (
        f"obow: error: cannot write {out / 'checkpoint.pt'}: File too large (the file size limit, ulimit -f, "
        f"is {limit} bytes)"
    )
    assert (out / "checkpoint.pt").read_bytes() == before
    assert not list(out.glob(".*.tmp"))
    assert load_checkpoint(out / "checkpoint.pt")["iteration"] >= 2


@pytest.fixture
def small_disk(tmp_path):
    """A real 1 MiB file system (tmpfs), for a full disk and a read-only folder; skipped where this process
    may not mount one (not root, or a container without the capability)."""
    folder = tmp_path / "disk"
    folder.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def test_full_disk_and_read_only_folder_are_one_line(small_disk, capsys):
    previous = {"w": torch.arange(1000.0)}
    save_atomic(previous, small_disk / "checkpoint.pt")
    with pytest.raises(WriteError) as full:
        save_atomic({"w": torch.zeros(1 << 20)}, small_disk / "checkpoint.pt")  # 4 MiB into 1 MiB
    assert str(full.value).startswith(f"cannot write {small_disk / 'checkpoint.pt'}: the disk is full (")
    assert torch.equal(torch.load(small_disk / "checkpoint.pt", weights_only=True)["w"], previous["w"])
    assert [p.name for p in small_disk.iterdir()] == ["checkpoint.pt"]

    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    out = small_disk / "backbone.pth"
    assert cli.main(["export", "--checkpoint", str(V1_CHECKPOINT), "--out", str(out)]) == 2
    assert one_error_line(capsys.readouterr().err) == f"obow: error: cannot write {out}: Read-only file system"


def test_write_failure_causes_in_words(tmp_path):
    """What the real failures above do not reach: PyTorch's writer error with and without the OSError it met."""
    bare = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    assert write_failure_cause(tmp_path / "x.pt", bare) == f"the write stopped part-way ({bare})"
    try:
        try:
            raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598") from None
    except RuntimeError as err:
        assert err.__context__ is not None and err.__suppress_context__
        assert write_failure_cause(tmp_path / "x.pt", err).startswith(os.strerror(errno.EFBIG))


# ------------------------------------------------------------------------------------------------ portable files


def test_every_file_obow_writes_loads_with_weights_only(setup, tmp_path, capsys):
    from obow.training.loop import pretrain

    recipe, data = setup
    out = tmp_path / "run"
    settings = [f"data.path={data}", "data.images_per_class=8", "optim.epochs=1", "train.keep_every=1"]
    cfg = load_config(recipe, [*settings, "train.deterministic=false"])  # (the switch would outlive the test)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: more threads only contend with each other
    try:
        pretrain(cfg, out)
    finally:
        torch.set_num_threads(threads)
    exported = tmp_path / "backbone.pth"
    assert cli.main(["export", "--checkpoint", str(out / "checkpoint.pt"), "--out", str(exported)]) == 0
    official = tmp_path / "official.pth.tar"
    torch.save({"epoch": 200, "network": torchvision.models.resnet18().state_dict()}, official)
    imported = tmp_path / "imported.pt"
    assert cli.main(["import-official", str(official), "--out", str(imported)]) == 0
    capsys.readouterr()
    for path in (out / "checkpoint.pt", out / "checkpoints" / "epoch_0001.pt", exported, imported):
        loaded = torch.load(path, weights_only=True)  # no error: tensors and plain values only
        assert isinstance(loaded, dict) and loaded, path
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    numpy_state = ckpt["rng"][0]["numpy"]
    assert numpy_state["key"].dtype == torch.int64 and numpy_state["key"].shape == (624,)
    assert int(numpy_state["key"].max()) < 2**32
    assert load_checkpoint(V1_CHECKPOINT)["version"] == 1  # a NumPy-holding checkpoint of version 1 still reads


def test_a_version_1_random_state_pickled_by_numpy_1_still_reads(tmp_path):
    """NumPy 1 pickles its arrays' constructor as numpy.core.multiarray._reconstruct, NumPy 2 as
    numpy._core...; a weights-only load matches names, so both must be allowed. The NumPy 1 name is produced
    here by pickling while the constructor reports NumPy 1's module."""
    reconstruct = np.empty(0).__reduce__()[0]
    module = reconstruct.__module__
    state = np.random.get_state()
    try:
        reconstruct.__module__ = "numpy.core.multiarray"
        torch.save({"format": "obow-checkpoint", "version": 1, "rng": [{"numpy": state}]}, tmp_path / "old.pt")
    finally:
        reconstruct.__module__ = module
    assert "numpy.core.multiarray._reconstruct" in torch.serialization.get_unsafe_globals_in_checkpoint(
        tmp_path / "old.pt"
    )
    key = load_checkpoint(tmp_path / "old.pt")["rng"][0]["numpy"][1]
    assert np.array_equal(key, state[1]) and key.dtype == np.uint32


def test_the_random_states_round_trip_through_a_weights_only_file(tmp_path):
    np.random.normal()  # a cached Gaussian in NumPy's state: has_gauss and cached_gaussian matter too
    state = get_rng_state()
    expected = (random.random(), float(np.random.normal()), float(np.random.rand()), float(torch.rand(())))
    random.random(), np.random.rand(3), torch.rand(3)  # move every generator on
    torch.save(state, tmp_path / "rng.pt")
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert (random.random(), float(np.random.normal()), float(np.random.rand()), float(torch.rand(()))) == expected


def test_wrong_files_are_named_in_one_line(tmp_path, capsys):
    text = tmp_path / "notes.txt"
    text.write_text("hello\n")
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(V1_CHECKPOINT.read_bytes()[:5000])
    code = tmp_path / "code.pt"
    torch.save({"object": Path("x")}, code)  # a pickled class: a weights-only load refuses it
    backbone = tmp_path / "backbone.pth"
    torch.save(torchvision.models.resnet18().state_dict(), backbone)
    official = tmp_path / "official.pth.tar"
    torch.save({"epoch": 1, "network": {"x": torch.zeros(1)}}, official)
    expected = {
        text: "it is not a file written by torch.save",
        empty: "the file is empty",
        truncated: "the file is damaged or cut short",
        code: "it holds Python objects (pathlib",
        backbone: f"it holds a state_dict of {len(torchvision.models.resnet18().state_dict())} tensors",
        official: "convert it with obow import-official",
    }
    for path, words in expected.items():
        with pytest.raises(ValueError) as err:
            load_checkpoint(path)
        message = str(err.value)
        assert words in message and str(path) in message and "\n" not in message, message
    for path, words in ((V1_CHECKPOINT, "already an obow pretraining checkpoint"), (text, "not a file written")):
        assert cli.main(["import-official", str(path), "--out", str(tmp_path / "x.pt")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err and "Weights only load failed" not in err, err
    with pytest.raises(ValueError, match="does not exist"):
        load_checkpoint(tmp_path / "missing.pt")


def cut_short(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def test_each_checkpoint_write_keeps_the_one_before_it(tmp_path, monkeypatch):
    """``save_atomic(keep_previous=True)``: ``checkpoint.prev.pt`` holds what ``checkpoint.pt`` held before the
    write, as a hard link or, where the file system refuses links, as a copy; no temporary file is left."""
    path = tmp_path / "checkpoint.pt"
    save_atomic({"iteration": 1}, path, keep_previous=True)
    assert not previous_path(path).exists()
    save_atomic({"iteration": 2}, path, keep_previous=True)
    monkeypatch.setattr(os, "link", lambda *args: (_ for _ in ()).throw(OSError(errno.EPERM, "no links here")))
    save_atomic({"iteration": 3}, path, keep_previous=True)
    assert previous_path(path) == tmp_path / "checkpoint.prev.pt"
    assert torch.load(path)["iteration"] == 3 and torch.load(previous_path(path))["iteration"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.prev.pt", "checkpoint.pt"]


def test_a_damaged_checkpoint_resumes_from_the_previous_one_and_ends_as_the_whole_run(tiny_run, tmp_path, obow_cli):
    """``checkpoint.pt`` cut short: the same command resumes from ``checkpoint.prev.pt`` (the first epoch's end),
    says so in one line, and ends with every tensor and record of the uninterrupted run's checkpoint."""
    out = tiny_run.copy(tmp_path / "run")
    whole = load_checkpoint(out / "checkpoint.pt")
    assert (whole["iteration"], load_checkpoint(out / "checkpoint.prev.pt")["iteration"]) == (6, 3)
    cut_short(out / "checkpoint.pt")
    args = [*tiny_run.args[: tiny_run.args.index("--out")], "--out", out, "optim.epochs=2"]
    err = obow_cli(*args).err
    notes = [line for line in err.splitlines() if "previous checkpoint" in line]
    assert len(notes) == 1, err
    assert notes[0].startswith(f"WARNING {out / 'checkpoint.pt'} cannot be read (the file is damaged or cut short (")
    assert notes[0].endswith(f"): resuming from the previous checkpoint {out / 'checkpoint.prev.pt'}, iteration 3")
    assert f"Resuming {out} from iteration 3 of 6" in err
    done = load_checkpoint(out / "checkpoint.pt")
    a, b = leaves(done), leaves(whole)
    assert a.keys() == b.keys()
    different = [k for k in a if not k.endswith(MAY_DIFFER) and not same_leaf(a[k], b[k])]
    assert not different, different[:5]
    assert sum(isinstance(v, torch.Tensor) for v in a.values()) > 100
    assert load_checkpoint(out / "checkpoint.prev.pt")["iteration"] == 3  # the damaged file was not kept


def same_leaf(a: object, b: object) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_when_no_checkpoint_reads_resume_eval_and_export_say_what_to_do_in_one_line(tiny_run, tmp_path, obow_cli):
    """Both checkpoints damaged: pretrain stops with one line naming both and what to do (exit 2); without a
    previous copy, the line says none is kept. eval and export of a damaged checkpoint name the previous one."""
    out = tiny_run.copy(tmp_path / "run")
    latest, previous = out / "checkpoint.pt", out / "checkpoint.prev.pt"
    cut_short(latest)
    for command in (["eval", "knn", "--data", tiny_run.data, "--workers", 0], ["export", "--out", tmp_path / "b.pth"]):
        result = obow_cli(*command, "--checkpoint", latest, check=False)
        assert result.code == 2
        line = one_error_line(result.err)
        assert f"cannot read checkpoint '{latest}': the file is damaged or cut short" in line
        assert line.endswith(f"; the run's previous checkpoint is '{previous}'"), line
    cut_short(previous)
    args = [*tiny_run.args[: tiny_run.args.index("--out")], "--out", out, "optim.epochs=2"]
    result = obow_cli(*args, check=False)
    assert result.code == 2
    line = one_error_line(result.err)
    assert line.startswith(f"obow: error: cannot resume the run in {out}: checkpoint.pt: the file is damaged or cut ")
    assert "; checkpoint.prev.pt: the file is damaged or cut short (" in line
    assert line.endswith(
        f". Start the run again with another --out, or delete {out} to start it over in the same folder"
    )
    previous.unlink()
    result = obow_cli(*args, check=False)
    assert result.code == 2 and "; no previous copy (checkpoint.prev.pt) is kept. Start" in one_error_line(result.err)
