"""The machine's other work, watched during a run: one intra-op thread fewer for each core that others keep busy.

A 2-thread PyTorch step on 2 cores collapses when another process holds one of them: every parallel region
waits at its barrier for the thread that shares its core, and the OpenMP runtime's waiting threads spin in the
meantime (libgomp spins about a millisecond before it sleeps). The demo's steps took 4.4-4.7 s beside one busy
process against about 0.35 s quiet (issue 65). Telling the runtime never to spin (``OMP_WAIT_POLICY=PASSIVE``)
avoids the collapse but costs every quiet run the wake-up of a sleeping thread at each of the many small parallel
regions of a step: the demo's fp32 step took 0.147 s against 0.092 s quiet (docs/results/busy_machine.md). So obow
keeps the runtime as it is and changes the number of threads instead, while the run goes on:

* every :data:`INTERVAL_S` seconds (checked between steps, at the cost of reading a few ``/proc`` files) it
  measures how many cores the machine's other processes used meanwhile: the busy time of all cores
  (``/proc/stat``, the hypervisor's steal included) less this process's and its children's (the loader workers);
* it trains with as many threads as the cores they leave, rounded (at least one, at most the run's choice), and
  says so in one line when that changes, and when the cores are back.

It is on for a run whose threads obow chose (not ``train.threads`` nor ``OMP_NUM_THREADS``), on a CPU, in one
training process (several would count each other as other work). Where ``/proc`` cannot be read it does nothing.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from obow.training.run.logger import log_main

__all__ = ["INTERVAL_S", "BusyWatch", "CpuTimes", "others_now", "read_cpu_times", "threads_for"]

#: Seconds between two looks at the machine.
INTERVAL_S = 5.0
#: Clock ticks a second of ``/proc`` times.
TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class CpuTimes:
    """Seconds of CPU time since boot: every core's busy time, and this process tree's."""

    machine: float
    ours: float


def machine_busy_seconds(stat: str) -> float:
    """Busy seconds of all cores from ``/proc/stat``'s first line: user, nice, system, irq, softirq and steal (the
    time a hypervisor gave to another machine is time this one did not get); idle and iowait are not busy."""
    fields = stat.splitlines()[0].split()
    assert fields[0] == "cpu", "not /proc/stat's first line"
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / TICKS


def process_seconds(stat: str) -> float:
    """User and system seconds of one process (all its threads) from its ``/proc/<pid>/stat``."""
    after_name = stat.rsplit(")", 1)[1].split()  # the command name may hold spaces and parentheses
    return (int(after_name[11]) + int(after_name[12])) / TICKS  # fields 14 and 15 of proc(5)


def children(pid: int | str, proc: Path) -> list[str]:
    """The living child processes of ``pid`` (every thread's ``children`` file)."""
    found: list[str] = []
    for task in (proc / str(pid) / "task").iterdir():
        try:
            found += (task / "children").read_text().split()
        except OSError:
            continue
    return found


def read_cpu_times(proc: Path = Path("/proc")) -> CpuTimes | None:
    """The machine's busy seconds and this process tree's (itself and its living descendants); ``None`` where
    ``/proc`` does not say."""
    try:
        machine = machine_busy_seconds((proc / "stat").read_text())
        ours, pending, seen = 0.0, [str(os.getpid())], set()
        while pending:
            pid = pending.pop()
            if pid in seen:
                continue
            seen.add(pid)
            try:
                ours += process_seconds((proc / pid / "stat").read_text())
                pending += children(pid, proc)
            except (OSError, IndexError, ValueError):
                continue  # a child that just ended
        return CpuTimes(machine, ours)
    except (OSError, IndexError, ValueError, AssertionError):
        return None


def others_now(seconds: float = 0.5, read: Callable[[], CpuTimes | None] = read_cpu_times) -> float | None:
    """The cores other processes keep busy, measured over the next ``seconds`` (``None``: ``/proc`` does not say)."""
    first, start = read(), time.monotonic()
    time.sleep(seconds)
    second = read()
    if first is None or second is None:
        return None
    return max(0.0, (second.machine - first.machine) - (second.ours - first.ours)) / (time.monotonic() - start)


def threads_for(others: float, cores: int, chosen: int) -> int:
    """Threads for a run that chose ``chosen`` on ``cores`` cores while other processes use ``others`` cores:
    the cores they leave, rounded to the nearest (0.5 rounds up to the run), between 1 and ``chosen``."""
    return max(1, min(chosen, int(cores - others + 0.5)))


class BusyWatch:
    """Adapts the intra-op threads of a training process to the cores other processes leave it (module docstring).

    ``check()`` between steps: at most every ``interval`` seconds it reads the CPU times and sets the threads.
    ``clock``, ``read`` and ``set_threads`` are the time, the ``/proc`` reader and ``torch.set_num_threads``,
    replaceable in tests."""

    def __init__(
        self,
        chosen: int,
        cores: int,
        interval: float = INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        read: Callable[[], CpuTimes | None] = read_cpu_times,
        set_threads: Callable[[int], None] = torch.set_num_threads,
    ) -> None:
        self.chosen, self.cores, self.interval = chosen, cores, interval
        self.clock, self.read, self.set_threads = clock, read, set_threads
        self.threads = chosen
        self.last_time = clock()
        self.last = read()
        #: (time, threads) each time the threads changed: what the run's summary can tell
        self.changes: list[tuple[float, int]] = []

    def check(self) -> int:
        """Look at the machine when :attr:`interval` has passed since the last look; return the threads in use."""
        now = self.clock()
        if self.last is None or now - self.last_time < self.interval:
            return self.threads
        current = self.read()
        if current is None:
            return self.threads
        wall = now - self.last_time
        others = max(0.0, (current.machine - self.last.machine) - (current.ours - self.last.ours)) / wall
        self.last, self.last_time = current, now
        wanted = threads_for(others, self.cores, self.chosen)
        if wanted != self.threads:
            self.set_threads(wanted)
            self.changes.append((now, wanted))
            if wanted < self.threads:
                log_main(
                    "Threads: other processes keep %.1f of this machine's %d cores busy: training on %d thread%s "
                    "until they are free (threads that wait for a taken core slow every step)",
                    others,
                    self.cores,
                    wanted,
                    "" if wanted == 1 else "s",
                    level=logging.WARNING,
                )
            else:
                log_main("Threads: the cores are free again (others use %.1f): training on %d threads", others, wanted)
            self.threads = wanted
        return self.threads
