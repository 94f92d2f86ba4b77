"""obow.training.run.busy: the threads of a run follow the cores other processes leave it."""

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from obow.training.run import busy
from obow.training.run.busy import (
    BusyWatch,
    CpuTimes,
    machine_busy_seconds,
    others_now,
    process_seconds,
    read_cpu_times,
    threads_for,
)


def test_threads_are_the_cores_others_leave_rounded_between_one_and_the_runs_choice():
    assert threads_for(0.0, cores=2, chosen=2) == 2
    assert threads_for(0.4, cores=2, chosen=2) == 2  # 1.6 cores left: still 2
    assert threads_for(0.5, cores=2, chosen=2) == 2  # 1.5 rounds up to the run
    assert threads_for(0.67, cores=2, chosen=2) == 1  # a neighbour's share of 3 threads on 2 cores
    assert threads_for(1.0, cores=2, chosen=2) == 1
    assert threads_for(3.0, cores=2, chosen=2) == 1  # never fewer than one
    assert threads_for(0.0, cores=8, chosen=4) == 4  # never more than the run chose
    assert threads_for(5.2, cores=8, chosen=8) == 3


def test_proc_files_are_read_as_proc5_says():
    # cpu user nice system idle iowait irq softirq steal guest guest_nice, in clock ticks
    stat = "cpu  100 20 30 4000 50 6 7 8 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n"
    assert machine_busy_seconds(stat) == pytest.approx((100 + 20 + 30 + 6 + 7 + 8) / busy.TICKS)
    # a command name with a space and a parenthesis; utime and stime are fields 14 and 15
    fields = ["S", "1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "250", "50", "0", "0"]
    assert process_seconds("123 (py (x) y) " + " ".join(fields)) == pytest.approx(300 / busy.TICKS)


def test_the_watch_drops_to_one_thread_while_others_work_and_comes_back(caplog):
    caplog.set_level(logging.INFO, "obow")
    now, times, set_to = [0.0], [CpuTimes(0.0, 0.0)], []
    watch = BusyWatch(2, 2, interval=5.0, clock=lambda: now[0], read=lambda: times[-1], set_threads=set_to.append)
    # quiet: 10 s, the machine busy 2 cores' worth, all of it ours
    now[0], times[-1] = 10.0, CpuTimes(20.0, 20.0)
    assert watch.check() == 2 and set_to == []
    # 3 s later: not yet time to look
    now[0], times[-1] = 13.0, CpuTimes(26.0, 21.0)
    assert watch.check() == 2
    # a neighbour: over 5 s the machine busy 10 s, ours 6.5 s (its share of 3 threads on 2 cores): others 0.7
    now[0], times[-1] = 15.0, CpuTimes(30.0, 26.5)
    assert watch.check() == 1 and set_to == [1]
    assert "other processes keep 0.7 of this machine's 2 cores busy: training on 1 thread" in caplog.text
    # still there: nothing changes
    now[0], times[-1] = 20.0, CpuTimes(40.0, 31.5)
    assert watch.check() == 1 and set_to == [1]
    # gone: the machine busy 5 s, all ours
    now[0], times[-1] = 25.0, CpuTimes(45.0, 36.5)
    assert watch.check() == 2 and set_to == [1, 2]
    assert "the cores are free again" in caplog.text
    assert [threads for _, threads in watch.changes] == [1, 2]


def test_others_now_is_the_machines_busy_time_less_ours_over_the_wall_time():
    reads = iter([CpuTimes(100.0, 10.0), CpuTimes(100.3, 10.1)])
    assert others_now(0.2, read=lambda: next(reads)) == pytest.approx(0.2 / 0.2, rel=0.5)  # 0.2 s of others' in 0.2 s
    assert others_now(0.0, read=lambda: None) is None


def test_without_proc_the_watch_does_nothing():
    set_to = []
    watch = BusyWatch(2, 2, interval=0.0, read=lambda: None, set_threads=set_to.append)
    assert watch.check() == 2 and set_to == []


@pytest.mark.skipif(not Path("/proc/stat").is_file(), reason="no /proc here")
@pytest.mark.slow
def test_a_real_neighbour_is_seen_as_other_work_and_our_own_work_is_not(tmp_path):
    before = read_cpu_times()
    assert before is not None and before.machine > 0 and before.ours > 0
    # our own work (this process, and a living child process of ours) is ours, not others': each spins until it
    # has used half a second of CPU (not of wall time: the machine may be loaded), the child then waits, alive
    spin = "import sys, time\nwhile time.process_time() < 0.5: pass\nprint('done', flush=True)\nsys.stdin.read()"
    child = subprocess.Popen([sys.executable, "-c", spin], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    start = time.process_time()
    while time.process_time() - start < 0.5:
        pass
    assert child.stdout.readline() == "done\n"
    mid = read_cpu_times()
    child.communicate("")
    assert mid is not None and mid.ours - before.ours >= 0.9  # our half second and the child's (and its start)
    # a process that is not ours: started by another one (a grandchild reparented: here, a detached child of a shell)
    spinner = subprocess.Popen(
        ["sh", "-c", f"{sys.executable} -c 'while True: pass' & echo $!"], stdout=subprocess.PIPE, text=True
    )
    pid = int(spinner.stdout.readline())
    spinner.wait()
    try:
        first, start = read_cpu_times(), time.monotonic()
        time.sleep(1.5)
        second = read_cpu_times()
        wall = time.monotonic() - start
    finally:
        os.kill(pid, 9)
    assert first is not None and second is not None
    others = ((second.machine - first.machine) - (second.ours - first.ours)) / wall
    assert others >= 0.5  # the spinner's core (less whatever the scheduler gave others meanwhile)


def test_the_watch_runs_only_where_obow_chose_the_threads_of_one_process_on_a_cpu(monkeypatch):
    from obow.training.run.threads import chosen_threads

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    with chosen_threads(2, "2 cores, 1 training process here", False, cpu) as watch:
        assert isinstance(watch, BusyWatch) and (watch.chosen, watch.threads) == (2, 2)
    for threads, why, device in ((2, "train.threads", cpu), (2, "OMP_NUM_THREADS", cpu), (1, "1 core", cpu)):
        with chosen_threads(threads, why, False, device) as watch:
            assert watch is None
    with chosen_threads(2, "2 cores", False, gpu) as watch:
        assert watch is None  # a GPU run's threads feed the device
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with chosen_threads(2, "2 cores, 2 training processes here", False, cpu) as watch:
        assert watch is None  # its sibling processes would count as other work
