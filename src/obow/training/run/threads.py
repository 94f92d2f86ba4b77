"""Intra-op threads of a training process (:func:`choose_threads`), and the hint for a busy machine."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping

import torch

from obow.config import Config
from obow.notices import counted
from obow.training.run.busy import BusyWatch
from obow.training.run.logger import log_main

__all__ = ["available_cores", "busy_machine_hint", "choose_threads", "chosen_threads", "ignored_omp_threads"]


@contextlib.contextmanager
def chosen_threads(
    threads: int, why: str, workers: bool = True, device: torch.device | None = None
) -> Iterator[BusyWatch | None]:
    """Run with ``threads``, :func:`choose_threads`'s choice for ``why`` (said in the run's header, with the
    loader workers' one thread when ``workers``: the device pipeline has none), then restore the caller's. Yields
    the :class:`~obow.training.run.busy.BusyWatch` that adapts the threads to the cores other processes leave,
    where obow chose them for one process on a CPU (else ``None``)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    log_main("Threads: %d per training process (%s)%s", threads, why, "; 1 per data-loading worker" if workers else "")
    ignored = ignored_omp_threads()
    if ignored:
        log_main("Threads: %s", ignored, level=logging.WARNING)
    chosen_here = why not in ("train.threads", "OMP_NUM_THREADS")
    one_process = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) <= 1
    on_cpu = device is None or device.type == "cpu"
    watch = BusyWatch(threads, available_cores()) if chosen_here and one_process and on_cpu and threads > 1 else None
    hint = None if watch is not None else busy_machine_hint(threads, why)
    if hint:
        log_main("Threads: %s", hint, level=logging.WARNING)
    try:
        yield watch
    finally:
        torch.set_num_threads(previous)


def choose_threads(cfg: Config, environ: Mapping[str, str] | None = None, cores: int | None = None) -> tuple[int, str]:
    """Intra-op threads for each training process, and why: ``train.threads`` when set; else the user's
    ``OMP_NUM_THREADS``; else the cores this process may use, shared by the training processes of this machine
    (``LOCAL_WORLD_SIZE``). Data-loading workers are not subtracted: on a quiet 2-core machine they need little
    of a core for small images, and one training thread beside one worker gave 0.58x the images/s of two
    threads (``cifar10_fast``) and 0.68x (``demo``) (``benchmarks/threads.py``). On a machine that other jobs
    keep busy the opposite holds (one thread was 3.3x faster there): :func:`busy_machine_hint` says so."""
    environ = os.environ if environ is None else environ
    if cfg.train.threads:
        return cfg.train.threads, "train.threads"
    if environ.get("OMP_NUM_THREADS", "").isdigit() and int(environ["OMP_NUM_THREADS"]) > 0:
        return int(environ["OMP_NUM_THREADS"]), "OMP_NUM_THREADS"
    if cores is None:
        cores = available_cores()
    processes = max(1, int(environ.get("LOCAL_WORLD_SIZE", "1")))
    threads = max(1, cores // processes)
    return threads, f"{cores} cores, {counted(processes, 'training process', 'training processes')} here"


def ignored_omp_threads(environ: dict[str, str] | None = None) -> str | None:
    """A one-line warning when ``OMP_NUM_THREADS`` is set to something :func:`choose_threads` cannot use (not a
    whole number above 0, e.g. ``zz``), which it then ignores; ``None`` when it is unset, empty or usable."""
    value = (os.environ if environ is None else environ).get("OMP_NUM_THREADS", "")
    if not value or (value.isdigit() and int(value) > 0):
        return None
    return (
        f"OMP_NUM_THREADS={value!r} is not a whole number of threads above 0, so it is ignored; set it to one "
        "(e.g. OMP_NUM_THREADS=2) or use train.threads"
    )


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def busy_machine_hint(threads: int, why: str, load: float | None = None, cores: int | None = None) -> str | None:
    """A hint when the machine was busy before the run started (the 1-minute load average at least its cores)
    and the threads were chosen, not set: oversubscribed cores make each step wait for its slowest thread (a
    tiny run took 43.5 s an epoch with 2 threads beside a neighbour's job, 2.0 s with one)."""
    if why in ("train.threads", "OMP_NUM_THREADS"):
        return None
    cores = available_cores() if cores is None else cores
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:
            return None
    if load < cores or threads == 1:
        return None
    return (
        f"this machine is busy (load {load:.1f} on {cores} cores): if other jobs keep running, one thread per "
        "process (OMP_NUM_THREADS=1 or train.threads=1) can be several times faster"
    )
