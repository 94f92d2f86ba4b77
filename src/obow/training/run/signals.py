"""The signals that stop a run: SIGINT, SIGTERM and SIGHUP (:data:`STOP_SIGNALS`) turned by :func:`handle_signals`
into a request the loop honours when the step under way is done (it writes a checkpoint at that step boundary and
raises :class:`Interrupted`); a second signal aborts at once; SIGHUP stays ignored under ``nohup``. A step that
compiles stops at once instead, keeping nothing (:mod:`obow.training.step.watch`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger("obow")


class Interrupted(Exception):
    """Raised by the training loop at the step boundary after SIGINT / SIGTERM / SIGHUP, once the checkpoint is
    written.

    ``signal`` names the signal (``None`` on a process that only learnt of it from another one)."""

    def __init__(self, signal_name: str | None) -> None:
        super().__init__(signal_name or "a signal received by another process")
        self.signal = signal_name

    @property
    def exit_code(self) -> int:
        """The shell's code for a run stopped by this signal: 128 + its number (130 for SIGINT, 143 for SIGTERM;
        SIGINT's when the signal is not known here)."""
        name = self.signal if self.signal is not None and self.signal in signal.Signals.__members__ else "SIGINT"
        return 128 + int(signal.Signals[name])


#: The signals that stop a run at a step boundary: Ctrl-C, a scheduler's or ``kill``'s SIGTERM, and SIGHUP (the
#: terminal closed, the ssh connection dropped), which would otherwise end the process at once without a checkpoint.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


#: In a process whose parent passes signals on (a ``torchrun`` worker, an ``obow tables run --jobs`` process), a
#: repeat this close after the first counts as the same request: a terminal's Ctrl-C reaches the parent and its
#: workers, and the parent passes it on to them, so each worker receives it twice at once. Elsewhere a second
#: signal aborts at once, however soon it comes.
SAME_REQUEST_SECONDS = 1.0


def nohup(signum: int) -> bool:
    """Whether ``signum`` is a SIGHUP the process was started ignoring (``nohup``), which obow leaves ignored."""
    return signum == signal.SIGHUP and signal.getsignal(signum) is signal.SIG_IGN


def signals_passed_on() -> bool:
    """Whether this process's parent passes its signals on to it: a ``torchrun`` worker (``TORCHELASTIC_RUN_ID``),
    or a process started by ``multiprocessing`` (``obow tables run --jobs``)."""
    import multiprocessing

    return "TORCHELASTIC_RUN_ID" in os.environ or multiprocessing.parent_process() is not None


class SignalFlag:
    """The first SIGINT / SIGTERM / SIGHUP received by this process (:attr:`received`: its name, or ``None``) and when
    (:attr:`at`, ``time.monotonic()``); :attr:`doing` names what the loop finishes before its checkpoint (the
    step under way, or the end-of-epoch monitor, which can take minutes on a CPU), for the message a signal
    prints. While :attr:`abort` is set (a step compiling, :mod:`obow.training.step.watch`), the first signal
    raises ``abort(name)`` instead: the step is not finished."""

    STEP = "the step under way"

    def __init__(self) -> None:
        self.received: str | None = None
        self.at = 0.0
        self.doing = self.STEP
        self.abort: Callable[[str], BaseException] | None = None

    @contextlib.contextmanager
    def finishing(self, what: str) -> Iterator[None]:
        """While the block runs, a signal's message says it finishes ``what`` first."""
        self.doing = what
        try:
            yield
        finally:
            self.doing = self.STEP


@contextlib.contextmanager
def handle_signals(announce: bool = True, repeat_window: float | None = None) -> Iterator[SignalFlag]:
    """Note the first SIGINT, SIGTERM or SIGHUP (:data:`STOP_SIGNALS`) in the flag this yields, so that the loop
    finishes the step under way, writes a checkpoint at the step boundary and stops (:class:`Interrupted`). A
    second signal aborts at once with ``KeyboardInterrupt``: a checkpoint being written is then dropped and the
    previous one stays whole. Only a repeat within ``repeat_window`` seconds of the first counts as the same
    request (default: :data:`SAME_REQUEST_SECONDS` where :func:`signals_passed_on`, else none). SIGHUP stays
    ignored where it is (under ``nohup``: the run goes on). ``announce`` logs what the first signal does (the main
    process)."""
    flag = SignalFlag()
    window = repeat_window if repeat_window is not None else SAME_REQUEST_SECONDS if signals_passed_on() else 0.0

    def note(signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if flag.received is None:
            flag.received, flag.at = name, time.monotonic()
            if flag.abort is not None:
                raise flag.abort(name)
            if announce:
                log.warning("%s: finishing %s, then writing a checkpoint (again to abort)", name, flag.doing)
        elif time.monotonic() - flag.at >= window:
            raise KeyboardInterrupt(name)

    try:
        previous = {s: signal.signal(s, note) for s in STOP_SIGNALS if not nohup(s)}
    except ValueError:  # not the main thread: leave signals alone
        yield flag
        return
    try:
        yield flag
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
