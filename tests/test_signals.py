"""The signals that stop a run (``obow.training.run.signals``), in real processes: a second SIGINT aborts however
soon after the first it comes, even when both arrive while the process is inside one long C call (a training
step's operator), where Python runs a signal's handler once for the two; a process forked after the handlers are
set (a DataLoader worker) does not make one signal to its parent count twice.

The child processes import only the signals module (no PyTorch): each starts in a fraction of a second."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

# real processes, each with a C call of about 2 s (docs/development.md: a test that starts a process is slow)
pytestmark = pytest.mark.slow

#: The child: handlers set, then one C call (PBKDF2, which releases no signal to Python until it returns) of about
#: ``seconds`` seconds, calibrated on this machine; "ready" printed just before it. After the call, Python runs the
#: handlers; "one request" or "aborted" says what they made of the signals.
CHILD = textwrap.dedent(
    """
    import hashlib, sys, time
    from obow.training.run.signals import handle_signals

    seconds = float(sys.argv[1])
    start = time.perf_counter()
    hashlib.pbkdf2_hmac("sha256", b"obow", b"salt", 20_000)
    rounds = int(20_000 * seconds / max(time.perf_counter() - start, 1e-6))
    try:
        with handle_signals(announce=False) as flag:
            print("ready", flush=True)
            try:
                hashlib.pbkdf2_hmac("sha256", b"obow", b"salt", rounds)  # the signals land here
                for _ in range(1000):  # the handlers run between these bytecodes
                    pass
                print("one request" if flag.received else "no signal", flush=True)
            except KeyboardInterrupt as abort:
                for _ in range(1000):  # what unwinds an abort (the line naming the checkpoint kept) runs to its end
                    pass
                print("aborted", abort.args[0], flush=True)
    except KeyboardInterrupt as again:
        print("aborted again", again.args[0], flush=True)
    """
)


def send_two(gap: float, seconds: float = 2.0, second: signal.Signals = signal.SIGINT) -> str:
    """A SIGINT, then ``second`` ``gap`` seconds later, to a child inside a ``seconds``-long C call; what the child
    said."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(seconds)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "ready", child.communicate()[1]
    time.sleep(0.2)
    child.send_signal(signal.SIGINT)
    time.sleep(gap)
    child.send_signal(second)
    out, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    return out.strip()


def test_a_second_sigint_aborts_however_soon_it_comes():
    """Two SIGINTs 0.05 s apart, both within one C call: they were one request (Python's handler ran once for the
    two). Two sent at the same instant can reach the process as one (the kernel keeps one pending signal of a kind
    until the process runs): nothing in the process can count those."""
    assert send_two(0.05) == "aborted SIGINT"


def test_two_kinds_of_signal_at_once_abort_once_naming_the_second():
    """A SIGINT and a SIGTERM inside one C call (CI's failure on stop 69): Python runs both handlers one after the
    other once the call returns. The first raises the abort, naming the second signal; the second's handler, whose
    signal was already counted, must not raise again while the abort unwinds (it cut the line naming the checkpoint
    kept)."""
    assert send_two(0.05, second=signal.SIGTERM) == "aborted SIGTERM"


def test_a_forked_child_does_not_make_one_signal_count_twice():
    """One SIGINT to the process and one to a child it forked (a DataLoader worker, which Ctrl-C reaches too, in the
    terminal's process group): the process sees its first request, not a second signal."""
    code = textwrap.dedent(
        """
        import os, signal, time
        from obow.training.run.signals import handle_signals

        with handle_signals(announce=False) as flag:
            pid = os.fork()
            if pid == 0:  # a worker with Python's own SIGINT handler, whose KeyboardInterrupt it ignores (torch's)
                signal.signal(signal.SIGINT, signal.default_int_handler)
                try:
                    time.sleep(30)
                except KeyboardInterrupt:
                    time.sleep(30)
                os._exit(0)
            time.sleep(0.5)
            os.kill(pid, signal.SIGINT)
            time.sleep(0.3)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):
                pass
            print("one request" if flag.received else "no signal", flush=True)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "one request"
