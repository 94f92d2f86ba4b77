"""The signals that stop a run: SIGINT, SIGTERM and SIGHUP (:data:`STOP_SIGNALS`) turned by :func:`handle_signals`
into a request the loop honours when the step under way is done (it writes a checkpoint at that step boundary and
raises :class:`Interrupted`); a second signal aborts at once, however soon it comes (:class:`Deliveries` counts
the signals Python's handler would see as one); SIGHUP stays ignored under ``nohup``. A step that compiles stops
at once instead, keeping nothing (:mod:`obow.training.step.watch`), and so does a run still being set up (its
cost measured, its images cached, its model built or its checkpoint read: :func:`stopped_while_setting_up`).
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


class SetupStopped(Interrupted):
    """Raised at once by the first stop signal while a run is set up, before its first step
    (:func:`stopped_while_setting_up`): there is no step to finish and nothing new to checkpoint."""


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


class Deliveries:
    """How many stop signals reach this process, each one counted.

    Python runs a signal's handler once for every delivery of that signal that came before the handler could run:
    two Ctrl-C 0.05 s apart inside one long C call (a training step's operator) run it once, and looked like one
    request. Its C-level handler, though, writes one byte per delivery to the wakeup file descriptor
    (:func:`signal.set_wakeup_fd`): a non-blocking pipe here, which :meth:`take` empties. Where another part of the
    process already uses the wakeup descriptor, it is left to it, and each run of the handler counts as one signal,
    as before. Two signals of a kind sent before the process runs at all reach it as one (the kernel keeps one
    pending): nothing here can count those. A process forked while it is set (a DataLoader worker) stops writing to it
    (:func:`_forked`), so that a Ctrl-C that reaches the worker too does not count twice in its parent."""

    def __init__(self) -> None:
        self.read_end: int | None = None
        self.write_end: int | None = None

    def __enter__(self) -> Deliveries:
        global _COUNTING
        read_end, write_end = os.pipe()
        try:
            os.set_blocking(read_end, False)
            os.set_blocking(write_end, False)
            previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        except (ValueError, OSError):  # not the main thread, or a platform without it
            os.close(read_end)
            os.close(write_end)
            return self
        if previous != -1:  # someone else's (an event loop): leave it to them
            signal.set_wakeup_fd(previous)
            os.close(read_end)
            os.close(write_end)
            return self
        self.read_end, self.write_end = read_end, write_end
        _COUNTING = True
        return self

    def take(self) -> list[int] | None:
        """The stop signals delivered since the last call, the one whose handler calls it included, by number in the
        order they arrived (empty: this handler's signal was already taken by an earlier call); ``None`` where the
        descriptor is not this object's (nothing is counted, each run of a handler is one signal)."""
        if self.read_end is None:
            return None
        stop = {int(s) for s in STOP_SIGNALS}
        found: list[int] = []
        while True:
            try:
                data = os.read(self.read_end, 4096)
            except BlockingIOError:
                break
            if not data:
                break
            found += [byte for byte in data if byte in stop]
        return found

    def __exit__(self, *exc: object) -> None:
        global _COUNTING
        if self.read_end is None or self.write_end is None:
            return
        signal.set_wakeup_fd(-1)
        _COUNTING = False
        os.close(self.read_end)
        os.close(self.write_end)
        self.read_end = self.write_end = None


#: Whether :class:`Deliveries` holds the wakeup descriptor in this process (what :func:`_forked` reads).
_COUNTING = False


def _forked() -> None:
    """In a child forked while :class:`Deliveries` counts its parent's signals: no wakeup descriptor, so that the
    child's signals are not written into its parent's count."""
    if _COUNTING:
        with contextlib.suppress(ValueError, OSError):
            signal.set_wakeup_fd(-1)


os.register_at_fork(after_in_child=_forked)


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
    raises ``abort(name)`` instead: the step is not finished. :attr:`aborted` is set once a signal has raised: the
    handler runs of signals already counted then do nothing, so that the code unwinding the abort (the line naming
    the checkpoint kept) is not cut short by a second exception for the same signals."""

    STEP = "the step under way"

    def __init__(self) -> None:
        self.received: str | None = None
        self.at = 0.0
        self.doing = self.STEP
        self.abort: Callable[[str], BaseException] | None = None
        self.aborted = False

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
    second signal aborts at once with ``KeyboardInterrupt``, however soon it comes (two that come before the
    handler can run, inside one long C call, are counted as two: :class:`Deliveries`): a checkpoint being written is
    then dropped and the previous one stays whole. Only a repeat within ``repeat_window`` seconds of the first
    counts as the same request (default: :data:`SAME_REQUEST_SECONDS` where :func:`signals_passed_on`, else none).
    SIGHUP stays ignored where it is (under ``nohup``: the run goes on). ``announce`` logs what the first signal does
    (the main process)."""
    flag = SignalFlag()
    window = repeat_window if repeat_window is not None else SAME_REQUEST_SECONDS if signals_passed_on() else 0.0

    deliveries = Deliveries()

    def note(signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        delivered = deliveries.take()
        if flag.aborted:
            # a signal already counted by the handler that aborted, or the first request passed on again by a
            # parent (torchrun): one abort, not two
            if delivered == [] or time.monotonic() - flag.at < window:
                return
            raise KeyboardInterrupt(name)
        if flag.received is None:
            flag.received, flag.at = name, time.monotonic()
            if flag.abort is not None:
                flag.aborted = True
                raise flag.abort(name)
            if delivered is not None and len(delivered) > 1 and window <= 0.0:  # a second one came before this ran
                flag.aborted = True
                if signum in delivered:  # this handler's signal is the first request; the abort names another
                    delivered.remove(signum)
                raise KeyboardInterrupt(signal.Signals(delivered[-1]).name)
            if announce:
                log.warning("%s: finishing %s, then writing a checkpoint (again to abort)", name, flag.doing)
        elif time.monotonic() - flag.at >= window:
            flag.aborted = True
            raise KeyboardInterrupt(name)

    try:
        previous = {s: signal.signal(s, note) for s in STOP_SIGNALS if not nohup(s)}
    except ValueError:  # not the main thread: leave signals alone
        yield flag
        return
    try:
        with deliveries:
            yield flag
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def stopped_while_setting_up(flag: SignalFlag, kept: Callable[[], str], announce: bool = True) -> Iterator[None]:
    """While the block sets a run up (its cost measured, its images cached, its network built, its checkpoint read:
    seconds to minutes), the first stop signal noted in ``flag`` (:func:`handle_signals`) raises
    :class:`SetupStopped` at once, and the run stops before its first step with one line (``announce``: the main
    process) naming the signal and what is kept (``kept()``: the last checkpoint, or that there is none). Without
    it, SIGTERM and SIGHUP there killed the process without a word and left its lock behind, and Ctrl-C returned
    130 without a word. A cache build stopped this way says so itself (:mod:`obow.data.cache`): one line, not two."""
    flag.abort = SetupStopped
    try:
        yield
    except SetupStopped as stop:
        from obow.data.cache import BuildStopped  # here: this module stays free of PyTorch (tests/test_signals.py)

        said = isinstance(stop.__context__, BuildStopped)  # the cache build's own line names the signal
        if announce and not said:
            log.warning("%s while the run was set up: stopped before its first step; %s", stop.signal, kept())
        raise
    finally:
        flag.abort = None


def run_aborted(abort: KeyboardInterrupt, kept: str, announce: bool = True) -> BaseException:
    """Say why a run under way stopped at once (``kept``: the checkpoint it keeps), and return the exception the
    command stops with. Either a second signal aborted it (:func:`handle_signals`): ``abort`` itself, exit 130; or
    the first signal came while the image cache was rebuilt under the run (a memory-mapped cache found damaged as
    a batch read it) and stopped that rebuild (:class:`~obow.data.cache.BuildStopped`, said in the cache's own
    line): without its images the run cannot take its next step, so it stops there, between two steps, where the
    loop has written its checkpoint (one process), with the signal's exit code. It was called a second signal
    before. ``announce``: say it (the main process)."""
    from obow.data.cache import BuildStopped

    if isinstance(abort, BuildStopped):
        if announce:
            log.warning("%s: the run stops with the image cache's rebuild, between two steps; %s", abort.args[0], kept)
        return Interrupted(abort.args[0])
    if announce:
        log.warning(
            "a second signal (%s): aborted at once, without a checkpoint of the steps since the last one; %s",
            abort.args[0] if abort.args else "SIGINT",
            kept,
        )
    return abort
