"""A run that compiles (``train.compile``): what it says about the time compiling takes, and how a signal stops it.

Compiling is slow where a step is fast: ``train.compile=step`` compiled its step for 234 s on 2 CPU cores and had
not finished after 140 s on an H200 (16 cores); ``networks`` took 95 s to 3.5 minutes on 2 CPU cores
(docs/performance.md, docs/results/compile_cpu.md). :class:`CompileWatch` follows a run's training through
Dynamo's compile callbacks, so that it sees every compilation wherever it happens (the first call of each graph
of a compiled step, the networks compiled at their first call, a graph compiled again), and:

* says, when the run starts on a CPU, what compiling was measured to gain there (:data:`ON_A_CPU`);
* says when a step starts compiling and what it took before (:data:`TAKES`), then how long that step took and how
  much of it was compiling, in the log and in ``log.jsonl`` (``{"type": "compile", ...}``);
* stops a step that compiles at once on SIGINT / SIGTERM. A signal normally lets the step under way finish, then
  writes a checkpoint (:func:`obow.training.run.signals.handle_signals`); a compilation can take minutes, and once a
  step has started compiling its state in memory is no step boundary (a compiled step's optimiser graph compiles
  after its forward and backward pass has run and moved the teacher, the queues and the batch-norm statistics),
  so nothing of it is kept: the run stops within seconds with one line, the checkpoint on disk stays the last
  good one, and the same command resumes from it. Inductor's compile workers go with it (:func:`stop_compilers`):
  the C++ kernels queued for its thread pool are dropped and the compilers under way killed; otherwise the
  interpreter waits for them at exit, and a terminal's Ctrl-C, which reaches the compilers too, turns into a
  ``CppCompileError`` with pages of compiler output.

A compilation outside a step (the kNN monitor's, or the views' render on a GPU, made with the batch) is not
watched: a signal lets it finish, as any other work. Checked on the CPU (``tests/test_compiling.py``), not yet on
a GPU, where Inductor compiles Triton kernels in a pool of Python processes that its own exit handler stops.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from obow.config import Config
from obow.notices import CPP_EXTENSION_LOGGER, NO_CUDA_RUNTIME
from obow.training.run.logger import RunLogger, log_main
from obow.training.run.signals import Interrupted, SignalFlag

__all__ = ["ON_A_CPU", "TAKES", "CompileInterrupted", "CompileWatch", "stop_compilers"]

log = logging.getLogger("obow")

#: What each ``train.compile`` took to compile before its first step, as measured (docs/performance.md).
TAKES = {
    "step": "234 s on 2 CPU cores, more than 140 s on an H200 with 16 cores (docs/performance.md)",
    "networks": "95 s to 3.5 minutes on 2 CPU cores (docs/performance.md)",
}

#: What each ``train.compile`` was measured to gain on a CPU, said when a run on a CPU starts with it
#: (docs/results/compile_cpu.md: cifar10_fast, bf16, the device pipeline, 2 cores).
ON_A_CPU = {
    "step": (
        "84 images/s against 81 with off, after 234 s of compiling: paid back after about 500,000 images "
        "(docs/results/compile_cpu.md)"
    ),
    "networks": "81 images/s, as with off, after 95 s of compiling: no gain (docs/results/compile_cpu.md)",
}


class CompileInterrupted(BaseException):
    """SIGINT / SIGTERM while a step compiles: raised in the main thread at once, wherever the compiler is. A
    ``BaseException``, as ``KeyboardInterrupt`` is, so that the compiler's ``except Exception`` lets it through."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(signal_name)
        self.signal = signal_name


class CompileWatch:
    """Says what a run's compilations take and stops a compiling step at once on a signal (see the module's
    docstring). A context manager around the training, within :func:`obow.training.run.signals.handle_signals`, whose
    ``signals`` it takes; each step runs in :meth:`step`. On leaving it, a :class:`CompileInterrupted` becomes
    :class:`~obow.training.run.signals.Interrupted`, as a signal at a step boundary does."""

    def __init__(
        self, cfg: Config, device: torch.device, out: Path, signals: SignalFlag, logger: RunLogger | None = None
    ) -> None:
        self.mode = cfg.train.compile
        self.device = device
        self.out = out
        self.signals = signals
        self.logger = logger
        handler = getattr(torch._dynamo, "callback_handler", None)  # a torch without it: nothing is watched
        self.callbacks = handler if hasattr(handler, "remove_start_callback") else None
        self.started = time.monotonic()
        self.first = True  # the step under way, if any, is the first
        self.said = False  # the first compilation's line
        self.in_step: int | None = None  # the iteration the step under way makes
        self.compiled = False  # the step under way has started compiling
        self.compile_began: float | None = None
        self.compile_seconds = 0.0

    def __enter__(self) -> CompileWatch:
        logging.getLogger(CPP_EXTENSION_LOGGER).addFilter(NO_CUDA_RUNTIME)  # a CPU run's compile: nothing to act on
        if self.device.type == "cpu" and self.mode in ON_A_CPU:
            log_main(
                "Compile: train.compile=%s on a CPU measured %s; off is the CPU default", self.mode, ON_A_CPU[self.mode]
            )
        if self.callbacks is not None:
            self.callbacks.register_start_callback(self._compile_started)
            self.callbacks.register_end_callback(self._compile_ended)
        self.started = time.monotonic()
        return self

    def __exit__(self, kind: Any, err: BaseException | None, traceback: Any) -> None:
        logging.getLogger(CPP_EXTENSION_LOGGER).removeFilter(NO_CUDA_RUNTIME)
        if self.callbacks is not None:
            self.callbacks.remove_start_callback(self._compile_started)
            self.callbacks.remove_end_callback(self._compile_ended)
        if isinstance(err, CompileInterrupted):
            raise Interrupted(err.signal) from None

    @contextlib.contextmanager
    def step(self, iteration: int) -> Iterator[None]:
        """Watch the step that makes ``iteration``: from its first compilation on, a signal stops it at once, and
        an error it raises after a signal (a C++ compiler killed by the terminal's Ctrl-C) is that signal."""
        self.in_step, self.compiled, self.compile_seconds = iteration, False, 0.0
        first, begun = self.first, self.started if self.first else time.monotonic()  # the first: from the start
        try:
            yield
        except BaseException as err:
            self.signals.abort = None
            received = err.signal if isinstance(err, CompileInterrupted) else self.signals.received
            if not self.compiled or received is None:
                raise
            self.stopped(received)
            raise CompileInterrupted(received) from None
        finally:
            self.in_step, self.signals.abort, self.first = None, None, False
        if self.compiled:
            seconds = time.monotonic() - begun
            what = "first step" if first else f"iteration {iteration}"
            log_main("Compile: %s done after %.0f s, %.0f s of it compiling", what, seconds, self.compile_seconds)
            if self.logger is not None:
                record = {"type": "compile", "iteration": iteration, "step_s": round(seconds, 3)}
                self.logger.write({**record, "compile_s": round(self.compile_seconds, 3)})

    def _compile_started(self, *args: Any) -> None:
        """Dynamo's callback at the start of a compilation (on the thread that compiles: the main one)."""
        if self.in_step is None:
            return  # not a step's (a probe, the monitor): a signal finishes it as any other work
        self.compile_began = time.monotonic()
        if self.compiled:
            return
        self.compiled = True
        if not self.said:
            log_main(
                "Compile: compiling (train.compile=%s) %s; it took %s. Ctrl-C stops it at once, keeping the last "
                "checkpoint",
                self.mode,
                "before the first step" if self.first else f"at iteration {self.in_step}",
                TAKES.get(str(self.mode), "minutes"),
            )
            self.said = True
        else:
            log_main("Compile: compiling again at iteration %d (a graph not compiled yet)", self.in_step)
        self.signals.abort = CompileInterrupted
        if self.signals.received is not None and threading.current_thread() is threading.main_thread():
            raise CompileInterrupted(self.signals.received)  # came before the compilation, which would not wait

    def _compile_ended(self, *args: Any) -> None:
        if self.compile_began is not None:
            self.compile_seconds += time.monotonic() - self.compile_began
            self.compile_began = None

    def stopped(self, signal_name: str) -> None:
        """Say that the step under way stopped in its compilation, what is kept, and stop the compilers."""
        path = self.out / "checkpoint.pt"
        iteration = checkpoint_iteration(path)
        kept = (
            f"the last checkpoint is {path} (iteration {iteration}); run the same command to resume"
            if iteration is not None
            else "there is no checkpoint yet; run the same command to start again"
        )
        log_main(
            "%s while compiling (train.compile=%s, iteration %d): stopped at once; nothing of this step is kept, %s",
            signal_name,
            self.mode,
            self.in_step,
            kept,
            level=logging.WARNING,
        )
        stop_compilers()


def checkpoint_iteration(path: Path) -> int | None:
    """The iteration of the checkpoint at ``path`` (its tensors mapped, not read), or ``None`` when it cannot be
    read."""
    if not path.is_file():
        return None
    try:
        return int(torch.load(path, map_location="cpu", weights_only=True, mmap=True)["iteration"])
    except Exception:  # damaged: the next run says which checkpoint it resumes from
        return None


def stop_compilers() -> None:
    """Inductor's C++ compilation stopped: the kernels queued for its thread pool dropped and the compilers it
    started killed, with their own children (``cc1plus``, ``as``). Its Python compile workers (the process pool
    for Triton kernels) are left to its own shutdown at exit, which tells them to go."""
    async_compile = sys.modules.get("torch._inductor.async_compile")
    if async_compile is not None and async_compile.AsyncCompile.pool.cache_info().currsize:
        async_compile.AsyncCompile.pool().shutdown(wait=False, cancel_futures=True)
    kill_compilers(os.getpid())


def kill_compilers(parent: int) -> None:
    """Kill ``parent``'s child processes that are not Python (compilers), and their descendants: stopped first,
    so that none starts another after being listed, then killed. Linux only (``/proc``); elsewhere nothing."""
    python = executable(os.getpid())
    if python is None:
        return
    listed: set[int] = set()
    for action in (signal.SIGSTOP, signal.SIGKILL):
        tree = process_tree()
        roots = [pid for pid in tree.get(parent, ()) if executable(pid) != python]
        listed |= descendants(tree, roots)
        for pid in sorted(listed):
            with contextlib.suppress(OSError):
                os.kill(pid, action)


def process_tree() -> dict[int, list[int]]:
    """Each process's children (pid -> pids), from ``/proc``; empty where there is none."""
    children: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                stat = Path(entry.path, "stat").read_text()
            except OSError:  # ended meanwhile
                continue
            ppid = int(stat.rpartition(")")[2].split()[1])  # after the command name, which may hold anything
            children.setdefault(ppid, []).append(int(entry.name))
    return children


def descendants(tree: dict[int, list[int]], roots: list[int]) -> set[int]:
    found, todo = set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(tree.get(pid, ()))
    return found


def executable(pid: int) -> str | None:
    """The program that process ``pid`` runs, or ``None`` (not Linux, gone, or a zombie)."""
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return None
