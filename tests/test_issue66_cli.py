"""What a demanding newcomer still broke (issue 66), the command's side: silent long waits (no recipe, the cost
check), a probe that diverged reported as an accuracy, out-of-memory errors in the allocator's words, and the
smaller items (what --config is when it is no file, the export's fallback warning first, a damaged checkpoint
called damaged, a finished run in a read-only folder, the demo's pretraining time over every call)."""

import contextlib
import io
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import zipfile

import numpy as np
import pytest
import torch

from obow.cli import main
from obow.config import ConfigError, load_config
from obow.evaluate.linear import DIVERGED_ABOVE, divergence, stable_lr
from obow.training import cost, step_cost
from obow.training.run.lock import LOCK_NAME, RunLock, still_at_path
from obow.training.step_cost import SavedPeak, estimate_step
from obow.weights.checkpoint import load_checkpoint


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("obow: error:")]


# ------------------------------------------------------------------------------------------ 2: silent long waits


def test_pretrain_without_a_recipe_is_refused_in_one_line(tmp_path, write_images, obow_cli):
    """Without --config obow's defaults, the paper's ResNet-50 run, started without a word."""
    data = write_images(tmp_path / "data", per_class=2)
    result = obow_cli("pretrain", "--data", data, "--out", tmp_path / "run", check=False)
    assert result.code == 2
    (line,) = error_lines(result.err)
    assert line.startswith("obow: error: no recipe: pass --config NAME") and "imagenet_resnet50_full" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_the_estimate_is_what_a_real_step_of_the_batch_keeps(tiny_recipe):
    """The step traced on fake tensors at the whole batch keeps, byte for byte, what a real step of that batch
    keeps for its backward pass (counted the same way), and counts the same floating-point operations."""
    from torch.utils.flop_counter import FlopCounterMode

    from obow.methods import build_method
    from obow.training.run.precision import precision_context
    from obow.training.step.shared import forward_backward, to_device

    cfg = load_config(tiny_recipe, ["data.batch_size=8", "data.path=/unused", "train.precision=fp32"])
    states, activations, seconds, _ = estimate_step(cfg, torch.device("cpu"))
    model = build_method(cfg, total_iterations=1000, resuming=True).train()
    model.diagnose = False
    teacher, views = to_device(step_cost.probe_batch(cfg, 8), torch.device("cpu"), False)
    with FlopCounterMode(display=False) as flops, SavedPeak().watching() as saved:
        forward_backward(model, teacher, views, None, precision_context("fp32", torch.device("cpu")), True)
    assert activations == saved.peak
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert states > 3 * 4 * trained and seconds is not None and seconds > 0
    assert flops.get_total_flops() > 0


def test_a_run_refused_by_its_cost_says_what_it_measures_first_and_leaves_nothing(
    tmp_path, tiny_recipe, write_images, obow_cli, monkeypatch
):
    """A run folder with its lock was left behind by a refusal, and the check said nothing while it measured."""
    monkeypatch.setattr(cost, "available_memory", lambda device: 1 << 20)
    data = write_images(tmp_path / "data", per_class=4)
    out = tmp_path / "runs" / "big"
    result = obow_cli("pretrain", "--config", tiny_recipe, "--data", data, "--out", out, check=False)
    assert result.code == 2
    (line,) = error_lines(result.err)
    assert line.startswith("obow: error: this run does not fit in memory: about ")
    said = result.err.index("Cost: estimating the memory and time of a step at data.batch_size=8 before the first")
    assert said < result.err.index("obow: error:")
    assert not out.exists() and not out.parent.exists()  # nor the folder above it, made for it


def test_a_step_that_cannot_be_traced_is_measured_as_before(tiny_recipe, monkeypatch, caplog):
    """A method with an operation fake tensors cannot run (a value read off the device) is not refused for it:
    its small steps are measured, as before the trace, and the log says so."""

    def untraceable(*args, **kwargs):
        raise RuntimeError("Tensor.item() of a fake tensor")

    monkeypatch.setattr(step_cost, "trace_step", untraceable)
    cfg = load_config(tiny_recipe, ["data.batch_size=8", "data.path=/unused", "train.precision=fp32"])
    with caplog.at_level("INFO", logger="obow"):
        states, activations, seconds, how = estimate_step(cfg, torch.device("cpu"))
    assert "the step cannot be traced at its shapes (Tensor.item() of a fake tensor)" in caplog.text
    assert activations > 0 and seconds > 0 and how == "kept for the backward pass, a floor"


@pytest.mark.slow
def test_the_papers_recipe_on_small_images_is_refused_in_seconds_without_a_real_step(
    tmp_path, write_images, obow_cli, monkeypatch
):
    """``imagenet_resnet50_full`` on 300 small images took 749 s to refuse (three real ResNet-50 steps, the
    8192-word vocabularies and weight generator). Now the step is traced at its shapes: no real step is run."""
    monkeypatch.setattr(cost, "available_memory", lambda device: 8 << 30)
    monkeypatch.setattr(step_cost, "measure_step", lambda *a: pytest.fail("a real step was measured on the CPU"))
    monkeypatch.setattr(cost, "measure_step", lambda *a: pytest.fail("a real step was measured on the CPU"))
    data = write_images(tmp_path / "data", per_class=150, size=8)
    out = tmp_path / "run"
    result = obow_cli("pretrain", "--config", "imagenet_resnet50_full", "--data", data, "--out", out, check=False)
    assert result.code == 2
    (line,) = error_lines(result.err)
    assert "does not fit in memory" in line and "8.0 GiB available" in line
    assert "Cost: estimating the memory and time of a step at data.batch_size=256" in result.err
    assert not out.exists()


def test_a_lock_that_wrote_nothing_else_leaves_nothing_and_one_that_did_keeps_its_file(tmp_path):
    made = tmp_path / "a" / "b"
    with RunLock(made):
        assert (made / LOCK_NAME).is_file()
    assert not (tmp_path / "a").exists()
    kept = tmp_path / "run"
    with RunLock(kept):
        (kept / "config.yaml").write_text("x: 1\n")
    assert (kept / LOCK_NAME).read_text() == ""  # a clean end empties the file; the run's files stay
    mine = tmp_path / "mine"
    mine.mkdir()  # the user's own empty folder stays, empty
    with RunLock(mine):
        pass
    assert mine.is_dir() and not list(mine.iterdir())


def test_a_lock_file_removed_after_it_was_opened_is_not_the_lock(tmp_path):
    """A process that opened the lock file as its holder removed it locks the file now at the path instead."""
    folder = tmp_path / "run"
    folder.mkdir()
    fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT)
    try:
        assert still_at_path(fd, folder / LOCK_NAME)
        (folder / LOCK_NAME).unlink()
        assert not still_at_path(fd, folder / LOCK_NAME)
        (folder / LOCK_NAME).write_text("")
        assert not still_at_path(fd, folder / LOCK_NAME)  # another file of the same name
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------- 3: a diverged probe


def test_divergence_is_a_non_finite_or_a_last_loss_far_above_chance():
    chance = math.log(10)
    assert divergence([2.3, 1.2, 0.4], 10) is None
    assert divergence([2.3, 2.31], 10) is None  # uninformative features: near chance, not diverged
    assert divergence([2.3, DIVERGED_ABOVE * chance * 0.99], 10) is None
    why = divergence([5096.0, 165335.0], 10)
    assert why is not None and "2.30 of an untrained head (ln 10)" in why and "5096, 1.653e+05" in why
    assert "non-finite" in (divergence([2.0, float("nan"), float("nan")], 10) or "")
    assert divergence([3.0, 50.0, 0.1], 10) is None  # diverged, then recovered: judged by where it ended


def test_stable_lr_against_a_float64_reference():
    """Rank one by hand: features all equal to ``a`` give ``E[x x^T]`` (with the bias's 1) of eigenvalue
    ``|a|^2 + 1``; random features against NumPy's eigenvalues."""
    a = torch.tensor([3.0, 4.0])
    assert stable_lr(a.expand(50, 2), 10, momentum=0.9) == pytest.approx(1.9 * 10 / 26, rel=1e-9)
    rng = np.random.default_rng(0)
    x = rng.normal(0.5, 2.0, size=(400, 12))
    xa = np.concatenate([x, np.ones((400, 1))], 1)
    lam = np.linalg.eigvalsh(xa.T @ xa / 400)[-1]
    assert stable_lr(torch.from_numpy(x).float(), 7, momentum=0.5) == pytest.approx(1.5 * 7 / lam, rel=1e-5)
    z = (x - x.mean(0)) / np.sqrt(x.var(0) + 1e-5)
    za = np.concatenate([z, np.ones((400, 1))], 1)
    lam_bn = np.linalg.eigvalsh(za.T @ za / 400)[-1]
    # two close eigenvalues here: the power iteration converges from below, to 0.1% (plenty for a cap)
    assert stable_lr(torch.from_numpy(x), 7, 0.5, batch_norm=True) == pytest.approx(1.5 * 7 / lam_bn, rel=1e-3)


def test_a_diverged_linear_probe_is_one_error_line_not_an_accuracy(tiny_run, obow_cli, tmp_path):
    """``--epochs 2`` printed ``top-1 10.00, top-5 50.00`` with rc 0 while its loss went 5,096 then 165,335."""
    out = tmp_path / "linear.json"
    argv = ("eval", "linear", "--checkpoint", tiny_run.out, "--data", tiny_run.data, "--workers", 0)
    result = obow_cli(*argv, "--epochs", 2, "--lr", 1e6, "--out", out, check=False)
    assert result.code == 2
    (line,) = error_lines(result.err)
    assert line.startswith("obow: error: the linear probe diverged at lr 1e+06: its training loss ")
    assert "no accuracy is reported" in line and "top-1" not in result.out
    # said once, in the error line: the library's warning of the same divergence was a second line before it
    assert [text for text in result.err.splitlines() if "diverged" in text] == [line]
    report = json.loads(out.read_text())
    assert "top1" not in report["results"] and report["results"]["diverged"] in line


def half_the_stable_rate(tiny_run) -> float:
    """``(1 + 0.9) C / lambda_max(E[x x^T])`` of the tiny run's training features (and a 1), in float64 NumPy."""
    from obow.data.eval_sets import eval_dataset, scan_labelled
    from obow.evaluate.features import extract_features
    from obow.weights.load import load_backbone

    backbone, info = load_backbone(str(tiny_run.checkpoint))
    views = load_config(tiny_run.recipe).views
    x, _ = extract_features(backbone, eval_dataset(scan_labelled(tiny_run.data / "train"), views), batch_size=64)
    xa = np.concatenate([x.double().numpy(), np.ones((len(x), 1))], 1)
    return 1.9 * 2 / np.linalg.eigvalsh(xa.T @ xa / len(xa))[-1]


def test_the_linear_probe_takes_a_rate_its_features_allow(tiny_run, obow_cli, tmp_path):
    """The preset's lr 10 (tuned on ImageNet's features and 1000 classes) is lowered to half the largest stable
    rate where it is above it, in one line; ``--lr`` is taken as given."""
    out = tmp_path / "linear.json"
    argv = ("eval", "linear", "--checkpoint", tiny_run.out, "--data", tiny_run.data, "--workers", 0, "--epochs", 2)
    result = obow_cli(*argv, "--out", out)
    settings = json.loads(out.read_text())["settings"]
    assert settings["preset_lr"] == 10.0 and settings["lr"] < 10.0  # the tiny run's features take less
    assert f"linear: lr {settings['lr']:.3g}, not the resnet18 preset's 10" in result.out
    assert settings["lr"] == pytest.approx(half_the_stable_rate(tiny_run), rel=1e-3)
    obow_cli(*argv, "--out", out, "--lr", 20)
    assert json.loads(out.read_text())["settings"]["lr"] == 20


def test_a_diverged_fine_tuning_is_one_error_line_not_an_accuracy(tiny_run, obow_cli, tmp_path):
    out = tmp_path / "finetune.json"
    argv = ("eval", "finetune", "--checkpoint", tiny_run.out, "--data", tiny_run.data, "--workers", 0)
    rates = ("--head-lr", 1e6, "--trunk-lr", 1e6)
    result = obow_cli(*argv, "--fraction", 0.1, "--epochs", 2, *rates, "--out", out, check=False)
    assert result.code == 2
    (line,) = error_lines(result.err)
    assert line.startswith("obow: error: fine-tuning diverged at head lr 1e+06") and "no accuracy" in line
    assert "top1" not in json.loads(out.read_text())["results"]


# ---------------------------------------------------------------------------------------------- 4: out of memory


def allocate(*args, **kwargs):
    return torch.empty(1 << 60, dtype=torch.uint8)  # the CPU allocator's own failure


def test_out_of_memory_before_the_first_step_is_one_line(tmp_path, tiny_recipe, write_images, obow_cli, monkeypatch):
    from obow.training import loop

    monkeypatch.setattr(loop, "build_model", allocate)
    data = write_images(tmp_path / "data", per_class=4)
    result = obow_cli("pretrain", "--config", tiny_recipe, "--data", data, "--out", tmp_path / "run", check=False)
    assert result.code == 2
    (line,) = error_lines(result.err)
    assert line.startswith("obow: error: out of memory during training (it asked for 1152921504606846976 bytes")
    assert "lower data.batch_size" in line and "DefaultCPUAllocator" not in result.err


def test_out_of_memory_building_the_image_cache_names_the_cache(tiny_recipe):
    """Python's ``MemoryError`` too, and where it happened: the device pipeline's cache names what lowers it."""
    from obow.data import cache as cache_module

    def build():
        raise MemoryError()

    code = compile("def inner(build):\n    build()\n", cache_module.__file__, "exec")  # a frame in cache.py
    scope: dict = {}
    exec(code, scope)
    try:
        scope["inner"](build)
    except MemoryError as err:
        line = str(cost.out_of_memory(err, load_config(tiny_recipe)))
    assert line.startswith("out of memory building or reading the image cache of data.pipeline=device: lower")
    assert "data.cache_size" in line and "data.pipeline=workers" in line
    assert cost.out_of_memory(ValueError("x"), load_config(tiny_recipe)) is None


def out_of_memory_through(*files: str) -> str:
    """The line for a ``MemoryError`` raised in a frame of the last of ``files``, called from a frame of each one
    before it, the first outermost."""

    def extract():
        raise MemoryError()

    call = extract
    for file in reversed(files):
        scope: dict = {}
        exec(compile("def frame(inner):\n    inner()\n", file, "exec"), scope)
        call = (lambda frame, inner: lambda: frame(inner))(scope["frame"], call)
    try:
        call()
    except MemoryError as err:
        return str(cost.out_of_memory(err, None))
    raise AssertionError("no error")


def test_out_of_memory_in_an_evaluation_after_training_is_not_blamed_on_the_monitor():
    """Features extracted by the kNN monitor between epochs, and by the demo or a table after training: only the
    monitor's are the --val images' and go with train.knn_every."""
    from obow.evaluate import features, monitor
    from obow.experiments import demo

    line = out_of_memory_through(monitor.__file__, features.__file__)
    assert line.startswith("out of memory in the kNN monitor (its --val images' features): use fewer --val images")
    line = out_of_memory_through(demo.__file__, features.__file__)
    assert line.startswith("out of memory evaluating the trained network's features: ") and "--val" not in line


def test_out_of_memory_in_the_demo_is_one_line(obow_cli, monkeypatch, tmp_path):
    from obow.experiments import demo

    monkeypatch.setattr(demo, "run_demo", allocate)
    result = obow_cli("demo", "--out", tmp_path / "demo", check=False)
    assert result.code == 2
    (line,) = error_lines(result.err)
    assert line.startswith("obow: error: out of memory during training (it asked for 1152921504606846976 bytes")
    assert "lower data.batch_size" in line and "DefaultCPUAllocator" not in result.err


def test_out_of_memory_in_eval_is_one_line(tiny_run, obow_cli, monkeypatch, tmp_path):
    from obow.evaluate import features

    monkeypatch.setattr(features, "extract_features", allocate)
    argv = ("eval", "knn", "--checkpoint", tiny_run.out, "--data", tiny_run.data, "--workers", 0)
    result = obow_cli(*argv, "--out", tmp_path / "knn.json", check=False)
    assert result.code == 2
    (line,) = error_lines(result.err)
    assert line.startswith("obow: error: out of memory in obow eval knn (it asked for 1152921504606846976 bytes")
    assert "--batch-size (images per batch, now 256)" in line and "DefaultCPUAllocator" not in result.err


def python_out_of_memory(*args, **kwargs):
    raise MemoryError()


@pytest.mark.parametrize("fail", [allocate, python_out_of_memory])
def test_out_of_memory_in_tables_run_is_one_line(obow_cli, monkeypatch, tmp_path, fail):
    """``obow tables run`` trains runs as ``pretrain`` does: the allocator's text was its line, Python's
    ``MemoryError`` a traceback."""
    from obow.experiments import tables

    monkeypatch.setattr(tables, "run_table", fail)
    result = obow_cli("tables", "run", "table1", "--data", tmp_path, "--minutes", 1, check=False)
    assert result.code == 2
    (line,) = error_lines(result.err)
    assert line.startswith("obow: error: out of memory during training") and "lower data.batch_size" in line
    assert "DefaultCPUAllocator" not in result.err and "Traceback" not in result.err


def test_out_of_memory_in_a_tables_job_is_one_line(monkeypatch, caplog):
    """A ``--jobs`` process (the body :func:`_task_process` runs in its own process) says its out-of-memory error
    in one line and exits with 2, where its traceback was printed before the line naming the failed task."""
    from obow.experiments.tables import run as table_run

    monkeypatch.setattr(table_run, "_run_task", allocate)
    monkeypatch.setattr(table_run, "route_warnings", lambda: None)
    threads = torch.get_num_threads()
    try:
        with caplog.at_level("ERROR", logger="obow"), pytest.raises(SystemExit) as stop:
            table_run._task_process(("table1/row/seed0",), threads)
    finally:
        torch.set_num_threads(threads)
    assert stop.value.code == 2
    (line,) = caplog.messages
    assert line.startswith("out of memory during training (it asked for 1152921504606846976 bytes more)")


def test_out_of_memory_in_any_other_command_is_one_line(obow_cli, monkeypatch):
    """Where a command has no line of its own for it (``obow recipes`` here), an out-of-memory error is still one
    line, not Python's traceback of a ``MemoryError`` nor the allocator's text."""
    import obow.config

    monkeypatch.setattr(obow.config, "available_recipes", python_out_of_memory)
    result = obow_cli("recipes", check=False)
    assert result.code == 2
    (line,) = error_lines(result.err)
    assert line.startswith("obow: error: out of memory: ") and "Traceback" not in result.err


# ------------------------------------------------------------------------------------------------------ 9: smaller


def test_a_config_that_is_no_file_is_named_for_what_it_is(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, kind in (("/dev/zero", "a character device"), (str(tmp_path), "a folder"), (str(fifo), "a FIFO")):
        with pytest.raises(ConfigError, match=f"^recipe '{path}' is {kind}"):
            load_config(path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "none.yaml"))


def both_streams(*args) -> str:
    """``obow ARGS`` in this process, stdout and stderr in one stream, in the order they were written."""
    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
        assert main([str(a) for a in args]) == 0, text.getvalue()
    return text.getvalue()


def test_export_warns_of_the_fallback_before_it_says_what_it_wrote(tiny_run, tmp_path):
    run = tiny_run.copy(tmp_path / "run")
    shutil.copyfile(run / "checkpoint.pt", run / "checkpoint.prev.pt")
    (run / "checkpoint.pt").write_bytes((run / "checkpoint.pt").read_bytes()[:1000])
    text = both_streams("export", "--checkpoint", run, "--out", tmp_path / "b.pth")
    assert "using " in text and text.index("checkpoint.prev.pt") < text.index("wrote ")


def test_bytes_flipped_in_the_pickle_are_reported_as_damage(tiny_run, tmp_path):
    """Before: "it holds Python objects ..." or "not a file written by torch.save (UnicodeDecodeError ...)"."""
    path = tmp_path / "checkpoint.pt"
    data = bytearray(tiny_run.checkpoint.read_bytes())
    with zipfile.ZipFile(tiny_run.checkpoint) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("data.pkl"))
    # the pickle's first byte: after the local header, whose name and extra field (torch.save pads each file to 64
    # bytes there; the central directory's info.extra is empty) have the lengths the header itself records
    name_length, extra_length = struct.unpack_from("<HH", data, info.header_offset + 26)
    start = info.header_offset + 30 + name_length + extra_length
    assert data[start : start + 2] == b"\x80\x02"  # PROTO 2
    original = load_checkpoint(tiny_run.checkpoint)
    seen = set()
    for offset in range(start, start + 64):  # the protocol, "format", its value and "version" with its value
        flipped = bytearray(data)
        flipped[offset] ^= 0xFF
        path.write_bytes(flipped)
        try:
            read = load_checkpoint(path)
        except ValueError as err:
            seen.add(str(err).partition(": ")[2])
        else:  # a byte torch.load does not read (e.g. a memo index): the same contents, its checksum says so
            assert read["iteration"] == original["iteration"] and read.keys() == original.keys()
    # the bytes torch.load reads wrongly, the zip's CRC-32 names; those it reads as other values (the version
    # number), the checksum obow writes into the checkpoint
    assert seen == {
        "the file is damaged: archive/data.pkl in it does not match its CRC-32 checksum",
        "its contents do not match the checksum written with it (the file was damaged after it was written)",
    }


@pytest.mark.slow
def test_a_finished_run_in_a_read_only_folder_says_it_is_finished(tiny_run, tmp_path):
    """A finished run on a read-only file system was refused (the lock could not be written); a real read-only
    bind mount (root, in a mount namespace) or a folder without write permission (another user)."""
    run = tiny_run.copy(tmp_path / "run")
    args = [*map(str, tiny_run.args)]
    args[args.index("--out") + 1] = str(run)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "obow", *args]
    if os.geteuid() == 0:
        if shutil.which("unshare") is None:
            pytest.skip("root without unshare: no read-only folder to be had")
        script = f'mount --bind "{run}" "{run}" && mount -o remount,ro,bind "{run}" && exec "$@"'
        command = ["unshare", "-m", "sh", "-c", script, "sh", *command]
    else:
        for path in (run, *run.rglob("*")):
            path.chmod(path.stat().st_mode & ~0o222)
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    if os.geteuid() == 0 and "mount" in proc.stderr and proc.returncode != 0:
        pytest.skip(f"no mount namespace here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    assert f"{run} is finished (2 of 2 epochs" in proc.stderr and "read-only" in proc.stderr
    assert f"done: 2 epochs, checkpoint {run / 'checkpoint.pt'}" in proc.stdout


def test_the_demos_pretraining_time_is_the_runs_over_every_call(tmp_path):
    """After a resume, "pretraining N min" counted the resuming call alone: now every epoch's steps and monitor,
    whichever call ran them (the epoch records of the run's log; a resumed epoch's record counts its time before
    the resume too)."""
    from obow.experiments.demo import run_seconds

    log = tmp_path / "log.jsonl"
    records = [
        {"epoch": 1, "iteration": 1, "loss": 1.0},
        {"type": "epoch", "epoch": 1, "epoch_time_s": 100.0, "monitor_time_s": 5.0},  # the first call
        {"type": "epoch", "epoch": 2, "epoch_time_s": 120.0, "monitor_time_s": 5.0},  # the resuming call
        {"type": "epoch", "epoch": 3, "epoch_time_s": 90.0},
    ]
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert run_seconds(log) == pytest.approx(320.0)
