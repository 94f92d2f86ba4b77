"""A run that compiles (obow.training.step.watch): what it says about compiling, and a signal that comes while a step
compiles stopping the run within seconds, with one line, no traceback and no compiler left running.

In this process, toy functions compiled by Dynamo with backends that stand for a long compilation; in subprocesses
(slow), the real ``obow pretrain``: Inductor compiling ``train.compile=step`` (minutes on a CPU), and C++
compilers run as Inductor runs them on a CPU (its thread pool, ``CppCompileError`` when a compiler dies), where a
terminal's Ctrl-C reaches them too."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import TINY_RECIPE, write_checkpoint

from obow.config import Config, from_dict
from obow.training.run.logger import RunLogger
from obow.training.run.signals import Interrupted, handle_signals
from obow.training.step.watch import CompileWatch


def config(compile_mode: str) -> Config:
    values = yaml.safe_load(TINY_RECIPE)
    values["train"]["compile"] = compile_mode
    return from_dict(Config, values)


def deliver(signum: int) -> None:
    """Send ``signum`` to this process and let its handler run (between two bytecodes of this thread)."""
    os.kill(os.getpid(), signum)
    for _ in range(1000):
        pass


def compiling_for(seconds: float, signum: int | None = None, then: Exception | None = None, sent: list | None = None):
    """A Dynamo backend that compiles for ``seconds`` (a Python loop, as Dynamo's and Inductor's own work is),
    receiving ``signum`` first when given (noting when in ``sent``), then raising ``then`` when given, else running
    the graph as it is."""

    def backend(gm, example_inputs):
        if signum is not None:
            if sent is not None:
                sent.append(time.monotonic())
            deliver(signum)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(0.01)
        if then is not None:
            raise then
        return gm.forward

    return backend


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    yield
    torch._dynamo.reset()


def compile_and_call(backend) -> torch.Tensor:
    """A new function each time: Dynamo compiles it at its first call."""

    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    return torch.compile(double, backend=backend)(torch.ones(3))


def test_a_signal_while_a_step_compiles_stops_it_at_once_with_one_line(tmp_path, caplog):
    """Not "finishing the step under way" after minutes of compiling: the signal stops the compilation where it is,
    and says that nothing of the step is kept (its state in memory is not a step boundary)."""
    sent = []
    with caplog.at_level("INFO", logger="obow"), handle_signals() as signals, pytest.raises(Interrupted) as err:
        with CompileWatch(config("step"), torch.device("cpu"), tmp_path, signals) as watch, watch.step(1):
            compile_and_call(compiling_for(30, signal.SIGINT, sent=sent))
    assert time.monotonic() - sent[0] < 5  # not the 30 s the compilation would take
    assert err.value.exit_code == 130
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [
        "SIGINT while compiling (train.compile=step, iteration 1): stopped at once; nothing of this step is kept, "
        "there is no checkpoint yet; run the same command to start again"
    ]
    assert signals.abort is None
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handlers are back


def test_the_checkpoint_on_disk_is_named_and_left_as_it_was(tmp_path, caplog):
    checkpoint = write_checkpoint(tmp_path / "checkpoint.pt", iteration=30)
    before = checkpoint.read_bytes()
    with caplog.at_level("INFO", logger="obow"), handle_signals() as signals, pytest.raises(Interrupted):
        with CompileWatch(config("networks"), torch.device("cpu"), tmp_path, signals) as watch, watch.step(31):
            compile_and_call(compiling_for(30, signal.SIGTERM))
    assert (
        f"SIGTERM while compiling (train.compile=networks, iteration 31): stopped at once; nothing of this step is "
        f"kept, the last checkpoint is {checkpoint} (iteration 30); run the same command to resume" in caplog.text
    )
    assert checkpoint.read_bytes() == before


def test_an_error_of_a_compilation_after_a_signal_is_that_signal(tmp_path, caplog):
    """A terminal's Ctrl-C reaches the C++ compilers too, which die of it: the compilation's error
    (``CppCompileError`` and pages of compiler output) is the interruption, said in one line."""

    class CppCompileError(RuntimeError):
        pass

    def killed_compiler(gm, example_inputs):
        signals.received = "SIGINT"  # as if the signal came while the compiler ran, and killed it
        raise CppCompileError("C++ compile error\n" + "warning: overflow\n" * 2670)

    with caplog.at_level("INFO", logger="obow"), handle_signals() as signals, pytest.raises(Interrupted) as err:
        with CompileWatch(config("step"), torch.device("cpu"), tmp_path, signals) as watch, watch.step(1):
            compile_and_call(killed_compiler)
    assert err.value.exit_code == 130
    assert "SIGINT while compiling" in caplog.text and "overflow" not in caplog.text


def test_a_signal_just_before_a_step_compiles_stops_it_when_it_starts(tmp_path, caplog):
    with caplog.at_level("INFO", logger="obow"), handle_signals() as signals, pytest.raises(Interrupted):
        with CompileWatch(config("step"), torch.device("cpu"), tmp_path, signals) as watch, watch.step(1):
            deliver(signal.SIGINT)  # e.g. while the first batch loads: the step then starts compiling
            compile_and_call(compiling_for(30))
    assert "SIGINT while compiling (train.compile=step, iteration 1)" in caplog.text


def test_a_signal_in_a_step_that_does_not_compile_lets_it_finish(tmp_path, caplog):
    with caplog.at_level("INFO", logger="obow"), handle_signals() as signals:
        with CompileWatch(config("step"), torch.device("cpu"), tmp_path, signals) as watch, watch.step(1):
            deliver(signal.SIGINT)
        assert signals.received == "SIGINT"
    assert "SIGINT: finishing the step under way, then writing a checkpoint" in caplog.text
    assert "while compiling" not in caplog.text


def test_an_error_while_compiling_without_a_signal_is_that_error(tmp_path):
    failed = torch._dynamo.exc.BackendCompilerFailed
    with handle_signals() as signals, pytest.raises(failed, match="not a signal"):
        with CompileWatch(config("step"), torch.device("cpu"), tmp_path, signals) as watch, watch.step(1):
            compile_and_call(compiling_for(0, then=ValueError("not a signal")))


def test_a_step_that_compiles_says_so_and_how_long_it_took(tmp_path, caplog):
    """Said when a step starts compiling, with what it took before; then the time to that step and how much of it
    was compiling, in the log and in log.jsonl; on a CPU, said first that compiling does not pay there."""
    cfg = config("step")
    logger = RunLogger(tmp_path, cfg, enabled=True)
    with caplog.at_level("INFO", logger="obow"), handle_signals() as signals:
        with CompileWatch(cfg, torch.device("cpu"), tmp_path, signals, logger) as watch:
            with watch.step(1):
                compile_and_call(compiling_for(0.2))
            with watch.step(2):
                pass
            with watch.step(3):
                compile_and_call(compiling_for(0.1))  # a graph not compiled before (the logged steps' variant)
    logger.close()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == (
        "Compile: train.compile=step on a CPU measured 84 images/s against 81 with off, after 234 s of compiling: "
        "paid back after about 500,000 images (docs/results/compile_cpu.md); off is the CPU default"
    )
    assert lines[1] == (
        "Compile: compiling (train.compile=step) before the first step; it took 234 s on 2 CPU cores, more than "
        "140 s on an H200 with 16 cores (docs/performance.md). Ctrl-C stops it at once, keeping the last checkpoint"
    )
    assert re.fullmatch(r"Compile: first step done after \d+ s, \d+ s of it compiling", lines[2])
    assert lines[3] == "Compile: compiling again at iteration 3 (a graph not compiled yet)"
    assert re.fullmatch(r"Compile: iteration 3 done after \d+ s, \d+ s of it compiling", lines[4])
    assert len(lines) == 5
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [(r["type"], r["iteration"]) for r in records] == [("compile", 1), ("compile", 3)]
    first = records[0]
    assert 0.2 <= first["compile_s"] <= first["step_s"] < 5


def test_a_run_that_does_not_compile_says_nothing_of_it(tmp_path, caplog):
    with caplog.at_level("INFO", logger="obow"), handle_signals() as signals:
        with CompileWatch(config("off"), torch.device("cpu"), tmp_path, signals) as watch, watch.step(1):
            torch.ones(3) * 2
    assert "Compile" not in caplog.text


# ------------------------------------------------------------------------------------------------ the command

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

#: The one-block tiny network, 16 images of 20 px, batch 8: 2 steps; no monitor, no TensorBoard.
RECIPE = {
    **yaml.safe_load(TINY_RECIPE),
    "train": {"log_every": 1, "knn_every": 0, "progress_bar": False, "tensorboard": False},
}
RECIPE["model"] = {**RECIPE["model"], "arch_options": {**RECIPE["model"]["arch_options"], "layers": [1, 1, 1, 1]}}
RECIPE["optim"] = {**RECIPE["optim"], "epochs": 1}


@pytest.fixture
def run_setup(tmp_path, write_images):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(RECIPE))
    return recipe, write_images(tmp_path / "data", per_class=8, size=20)


@pytest.fixture
def start(tmp_path):
    """``start(argv, env) -> (process, stderr file)``: a command in a new session (its own process group, as a job
    started from a terminal); whatever is left of it is killed when the test ends, passed or failed."""
    started = []

    def run(argv: list[str], env: dict[str, str]) -> tuple[subprocess.Popen, Path]:
        stderr = tmp_path / "stderr.txt"
        with open(stderr, "w") as err:
            started.append(subprocess.Popen(argv, stderr=err, env=env, start_new_session=True))
        return started[-1], stderr

    yield run
    for proc in started:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def session_processes(sid: int) -> list[str]:
    """The processes of session ``sid`` (a started run and everything it started), as ``pid name``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == sid:
                    found.append(f"{entry.name} {(entry / 'comm').read_text().strip()}")
            except OSError:
                continue
    return found


def wait_until(condition, seconds: float, proc: subprocess.Popen, what: str, stderr: Path) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (exit {proc.returncode}) before {what}:\n{stderr.read_text()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} after {seconds} s:\n{stderr.read_text()[-3000:]}")
        time.sleep(0.1)


def interrupt(proc: subprocess.Popen, stderr: Path, group: bool) -> tuple[float | None, float]:
    """SIGINT to the run (``group``: to its whole process group, as a terminal's Ctrl-C); the seconds until it
    said it stopped compiling (``None``: it did not) and until it ended; an error if still running at 60 s."""
    start = time.monotonic()
    if group:
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGINT)
    said = None
    while proc.poll() is None and time.monotonic() - start < 60:
        if said is None and "while compiling" in stderr.read_text():
            said = time.monotonic() - start
        time.sleep(0.05)
    if proc.poll() is None:
        raise AssertionError(f"still running 60 s after SIGINT:\n{stderr.read_text()[-3000:]}")
    return said, time.monotonic() - start


def assert_stopped_in_one_line(proc: subprocess.Popen, stderr: Path, group: bool, after: str) -> None:
    """SIGINT stops the run within seconds, with one line and nothing of the compilers left."""
    said, ended = interrupt(proc, stderr, group)
    text = stderr.read_text()
    assert proc.returncode == 130, text[-3000:]
    # The line within seconds; then the interpreter's exit, most of it torch's own: a process that only imports
    # torch and obow took 3 to 11 s to exit on a 2-core machine at load 11.
    assert said is not None and said < 5 and ended < 30, (said, ended)
    lines = text[text.index(after) :].splitlines()[1:]  # what the run said once the signal came
    assert len(lines) == 1 and "SIGINT while compiling" in lines[0], lines[:20]
    assert "nothing of this step is kept, there is no checkpoint yet" in lines[0]
    assert not (stderr.parent / "run" / "checkpoint.pt").exists()
    deadline = time.monotonic() + 5  # the compilers killed, the compile workers told to go
    while (left := session_processes(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left


@pytest.mark.slow
def test_ctrl_c_while_inductor_compiles_the_step_stops_the_run_at_once(run_setup, start, tmp_path):
    """The real thing: ``train.compile=step`` compiled by Inductor (minutes on a CPU; its cache in a new folder, so
    that nothing compiled before is found), Ctrl-C once the run says it compiles."""
    recipe, data = run_setup
    args = ["pretrain", "--config", recipe, "--data", data, "--out", tmp_path / "run", "train.compile=step"]
    env = {**ENV, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    proc, stderr = start([sys.executable, "-m", "obow.cli", *map(str, args)], env)
    said = "Compile: compiling (train.compile=step) before the first step"
    wait_until(lambda: said in stderr.read_text(), 120, proc, "compiling line", stderr)
    time.sleep(3)  # well into Dynamo's and Inductor's work
    assert_stopped_in_one_line(proc, stderr, group=True, after=said)


#: ``obow`` with its networks compiled (``train.compile=networks``) by a backend that compiles C++ as Inductor does
#: on a CPU: in Inductor's thread pool, each compiler in a subprocess (``cpp_builder.run_compile_cmd``, which
#: raises ``CppCompileError`` with the compiler's output when it fails), more files than the pool's threads, each
#: for seconds; then it runs the graph as it is.
COMPILING_CPP = """
import functools, sys, torch
from torch._inductor.async_compile import AsyncCompile
from torch._inductor.cpp_builder import run_compile_cmd

source = sys.argv.pop(1)

def compiling_cpp(gm, example_inputs):
    pool = AsyncCompile.pool()
    jobs = [pool.submit(run_compile_cmd, f"g++ -O2 -c {source} -o kernel{i}.o", str(source.rpartition("/")[0]))
            for i in range(8)]
    for job in jobs:
        job.result()
    return gm.forward

torch.nn.Module.compile = functools.partialmethod(torch.nn.Module.compile, backend=compiling_cpp)
from obow.cli import main
sys.exit(main(sys.argv[1:]))
"""

#: C++ that takes seconds to compile, and warns while it does (as Inductor's kernels do).
SLOW_CPP = """
#include <map>
#include <regex>
#include <string>
char overflow = 255;
int kernel(const std::string& s) {
    std::map<std::string, std::regex> patterns{{"a", std::regex("a+b*")}, {"b", std::regex("[0-9]+x?")}};
    return std::regex_match(s, patterns["a"]) + std::regex_search(s, patterns["b"]);
}
"""


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None or not Path("/proc").is_dir(), reason="needs g++ and /proc")
@pytest.mark.parametrize("group", [True, False], ids=["ctrl_c_to_the_group", "sigint_to_the_run"])
def test_sigint_while_cpp_compilers_run_stops_the_run_at_once_and_leaves_none(run_setup, start, tmp_path, group):
    """Ctrl-C from a terminal reaches the compilers too: before, their deaths became ``obow: error:
    CppCompileError`` with pages of compiler output, and the pool went on starting compilers. A SIGINT to the run
    alone leaves them running: before, the run went on compiling."""
    recipe, data = run_setup
    (tmp_path / "cpp").mkdir()
    source = tmp_path / "cpp" / "kernel.cpp"
    source.write_text(SLOW_CPP)
    args = ["pretrain", "--config", recipe, "--data", data, "--out", tmp_path / "run", "train.compile=networks"]
    env = {**ENV, "TORCHINDUCTOR_COMPILE_THREADS": "2"}  # Inductor's thread pool, whatever the cores
    proc, stderr = start([sys.executable, "-c", COMPILING_CPP, str(source), *map(str, args)], env)
    compilers = lambda: sum(name.endswith(" g++") for name in session_processes(proc.pid)) >= 2  # noqa: E731
    wait_until(compilers, 120, proc, "two compilers running", stderr)
    assert_stopped_in_one_line(proc, stderr, group, after="Compile: compiling (train.compile=networks)")
    assert "CppCompileError" not in stderr.read_text() and "overflow" not in stderr.read_text()
