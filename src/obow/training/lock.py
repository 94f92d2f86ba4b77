"""One writer per run folder: ``<folder>/.obow.lock``.

Two ``obow pretrain`` on the same ``--out`` would each write the checkpoint, ``config.yaml`` and the logs, and
the run that finishes last would silently replace the other's. :class:`RunLock` holds an exclusive
``flock`` on ``<folder>/.obow.lock`` for as long as a command writes the folder; a second command stops at
once, naming the folder and the process that holds it (host, PID, start time and command line, which the
holder writes into the file).

The operating system releases a ``flock`` when its process ends, however it ends (a crash, ``kill -9``, the
OOM killer), so a dead holder never blocks the next run: when the lock is free but the file still names a
holder (it did not end cleanly), the new process takes the lock over and says whose it was. A clean exit
empties the file. The file itself is kept: removing it could let two processes lock two different files of
the same name.

``flock`` is reliable on a local disk. On a network file system it may hold only among the processes of one
machine (NFS before Linux 2.6.12, some FUSE and SMB mounts): there a lock taken over from another host is
reported as such, and two hosts should not be pointed at the same ``--out``. Under ``torchrun`` only the main
process takes the lock; every process learns whether it got it, so all of them stop together.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import logging
import os
import shlex
import socket
import sys
from pathlib import Path
from typing import Any

import torch

from obow import distributed as D
from obow.files import make_folder, write_error

log = logging.getLogger("obow")

LOCK_NAME = ".obow.lock"


class FolderInUse(RuntimeError):
    """Another process holds the folder; the message names it."""


class RunLock:
    """``with RunLock(folder):`` holds ``folder`` for this command (see the module docstring).

    ``device`` is where the processes of a distributed run agree on the outcome (a CUDA device under NCCL).
    """

    def __init__(self, folder: str | Path, *, device: torch.device | None = None) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self.device = device or torch.device("cpu")
        self.fd: int | None = None

    def __enter__(self) -> RunLock:
        failure: BaseException | None = None
        if D.is_main_process():
            try:
                self.acquire()
            except (OSError, RuntimeError) as err:
                failure = err
        (failed,) = D.agree_any([failure is not None], self.device)
        if failure is not None:
            raise failure
        if failed:
            raise FolderInUse(f"{self.folder}: the main process could not lock the run folder (see its message)")
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def acquire(self) -> None:
        """Take the lock or raise :class:`FolderInUse`; write who holds it."""
        make_folder(self.folder)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise write_error(self.path, err) from err
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = read_holder(fd)
            os.close(fd)
            raise FolderInUse(
                f"{self.folder} is in use by {describe_holder(holder)}; wait for it to end, stop it, or use "
                "another --out"
            ) from None
        left = read_holder(fd)
        if left:
            log.warning("%s", takeover_message(self.folder, left))
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(this_process()).encode(), 0)
        except OSError as err:
            os.close(fd)
            raise write_error(self.path, err) from err
        self.fd = fd

    def release(self) -> None:
        """Empty the file (a clean end) and let the lock go."""
        if self.fd is None:
            return
        try:
            os.ftruncate(self.fd, 0)
        except OSError:
            pass  # a full or read-only disk now: the next run will report a take-over, which is still right
        finally:
            os.close(self.fd)  # closing the last descriptor releases the flock
            self.fd = None


def this_process() -> dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": shlex.join(sys.argv),
    }


def read_holder(fd: int) -> dict[str, Any]:
    """What the lock file says about its holder (``{}`` when empty or unreadable)."""
    try:
        text = os.pread(fd, 1 << 16, 0).decode(errors="replace")
        holder = json.loads(text) if text.strip() else {}
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def live_holder(folder: str | Path) -> dict[str, Any] | None:
    """The process named in ``folder``'s lock file when it is alive on this host, else ``None``; for reports
    (``obow tables status``): it only reads the file and never takes the lock, so it cannot get in a starting
    run's way. A holder on another host is reported as it is (it cannot be checked from here)."""
    try:
        text = (Path(folder) / LOCK_NAME).read_text(errors="replace")
        holder = json.loads(text) if text.strip() else {}
    except (OSError, ValueError):
        return None
    if not isinstance(holder, dict) or not isinstance(holder.get("pid"), int):
        return None
    if holder.get("host") != socket.gethostname():
        return holder
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return None  # it ended without a clean exit; the next run takes the lock over
    except PermissionError:
        pass  # alive, another user's
    return holder


def describe_holder(holder: dict[str, Any]) -> str:
    if not holder:  # it has the lock but has not written its name yet
        return "another process (it has just started)"
    return (
        f"process {holder.get('pid')} on {holder.get('host')} (started {holder.get('started')}: "
        f"{holder.get('command')})"
    )


def takeover_message(folder: Path, left: dict[str, Any]) -> str:
    message = f"{folder}: taking over the lock left by {describe_holder(left)}, which did not end cleanly"
    if left.get("host") not in (None, socket.gethostname()):
        message += (
            f"; it ran on another host, and locks may not reach across hosts on this file system: make sure "
            f"nothing on {left['host']} still writes here"
        )
    return message
