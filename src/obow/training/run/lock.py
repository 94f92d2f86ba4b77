"""One writer per run folder: ``<folder>/.obow.lock``.

Two ``obow pretrain`` on the same ``--out`` would each write the checkpoint, ``config.yaml`` and the logs, and
the run that finishes last would silently replace the other's. :class:`RunLock` holds an exclusive
``flock`` on ``<folder>/.obow.lock`` for as long as a command writes the folder; a second command stops at
once, naming the folder and the process that holds it (host, PID, start time and command line, which the
holder writes into the file).

The operating system releases a ``flock`` when its process ends, however it ends (a crash, ``kill -9``, the
OOM killer), so a dead holder never blocks the next run: when the lock is free but the file still names a
holder (it did not end cleanly), the new process takes the lock over and says whose it was. A clean exit
empties the file, and where the command wrote nothing else (a run refused before its first file, e.g. by the
cost check) it removes the file, and the folders it created for it: a refused command leaves nothing behind.
The file is removed while it is still locked, and a process that locked it meanwhile finds it no longer at its
path and starts again, so two processes never lock two different files of the same name.

A ``flock`` belongs to the open file, which a forked child shares: a data-loading worker forked by the holder
would keep the lock after its parent's ``kill -9``, for the seconds it takes to notice (PyTorch's workers look
every 5 s), and a resume started at once would be refused in the dead parent's name. So the lock's descriptor
is closed in every child forked while it is held (:func:`os.register_at_fork`; the parent's lock is untouched)
and is not inherited through ``exec`` (``O_CLOEXEC``). Should a child that did not go through Python's fork
(a C library's) still hold it, a holder named in the file that is dead on this host is waited for a few
seconds (:data:`LEFTOVER_WAIT_S`), then reported as such.

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
import time
from pathlib import Path
from typing import Any

import torch

from obow import distributed as D
from obow.files import make_folder, write_error

log = logging.getLogger("obow")

LOCK_NAME = ".obow.lock"
#: How long a lock still held after its named holder died on this host is waited for (a leftover child of the
#: holder, e.g. a data-loading worker, lets go when it notices; PyTorch's workers look every 5 s).
LEFTOVER_WAIT_S = 10.0

#: The descriptors of the locks this process holds, closed in every forked child (:func:`_close_in_child`).
_HELD: set[int] = set()


def _close_in_child() -> None:
    """In a freshly forked child: drop its copies of the parent's lock descriptors, so that the lock ends with
    the parent (closing a copy leaves the parent's ``flock`` in place)."""
    for fd in list(_HELD):
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_child)


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
        #: The folders :meth:`acquire` created, the deepest first (removed again when nothing else was written).
        self.created: list[Path] = []

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
        for _ in range(ATTEMPTS):
            self.created = missing_folders(self.folder)
            make_folder(self.folder)
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)  # the umask decides the mode
            except FileNotFoundError:  # the folder was removed by a holder that wrote nothing: make it again
                continue
            except OSError as err:
                raise write_error(self.path, err) from err
            if not lock_or_wait_for_leftovers(fd):
                holder = read_holder(fd)
                os.close(fd)
                raise FolderInUse(refusal_message(self.folder, holder))
            if still_at_path(fd, self.path):
                break
            os.close(fd)  # a holder removed it as we opened it (release): lock the file now at the path
        else:
            raise FolderInUse(f"{self.folder}: its lock file kept being removed by other processes; try again")
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
        _HELD.add(fd)

    def release(self) -> None:
        """Empty the file (a clean end) and let the lock go; where nothing else was written in the folder, remove
        the file, and the folders :meth:`acquire` created, while the lock is still held."""
        if self.fd is None:
            return
        _HELD.discard(self.fd)
        try:
            if holds_only_the_lock(self.folder):
                os.unlink(self.path)
                for folder in self.created:
                    folder.rmdir()  # stops (OSError) at the first that another process wrote in meanwhile
            else:
                os.ftruncate(self.fd, 0)
        except OSError:
            pass  # a full or read-only disk now: the next run will report a take-over, which is still right
        finally:
            os.close(self.fd)  # closing the last descriptor releases the flock
            self.fd = None


#: How many times :meth:`RunLock.acquire` opens the lock file again after finding it removed as it locked it.
ATTEMPTS = 20


def missing_folders(folder: Path) -> list[Path]:
    """The folders ``mkdir -p folder`` would create, the deepest first."""
    missing = []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing


def still_at_path(fd: int, path: Path) -> bool:
    """Whether the file open as ``fd`` is the one at ``path`` (not removed, nor replaced, since it was opened)."""
    try:
        now, held = os.stat(path), os.fstat(fd)
    except OSError:
        return False
    return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


def holds_only_the_lock(folder: Path) -> bool:
    try:
        return [entry.name for entry in os.scandir(folder)] == [LOCK_NAME]
    except OSError:
        return False


def try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def lock_or_wait_for_leftovers(fd: int, wait_s: float | None = None) -> bool:
    """Take the lock on ``fd``; when it is held but the holder named in the file is dead on this host (a child
    it left still has the file open), try again for up to ``wait_s`` seconds (:data:`LEFTOVER_WAIT_S`).
    Whether the lock was taken."""
    if try_lock(fd):
        return True
    if not holder_is_dead(read_holder(fd)):
        return False
    deadline = time.monotonic() + (LEFTOVER_WAIT_S if wait_s is None else wait_s)
    while time.monotonic() < deadline:
        time.sleep(0.1)
        if try_lock(fd):
            return True
        if not holder_is_dead(read_holder(fd)):  # a live process took the lock meanwhile and wrote its name
            return False
    return False


def holder_is_dead(holder: dict[str, Any]) -> bool:
    """Whether ``holder`` (as the lock file names it) ran on this host and its process is gone."""
    pid = holder.get("pid")
    if holder.get("host") != socket.gethostname() or not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):
        return False
    return False


def refusal_message(folder: Path, holder: dict[str, Any]) -> str:
    """Why ``folder`` cannot be locked: its live holder, or a dead holder's leftover child that still has it."""
    if holder_is_dead(holder):
        return (
            f"{folder} is still locked by a process left behind by process {holder['pid']}, which ended without a "
            f"clean exit (a child of it still has {folder / LOCK_NAME} open; `fuser -v {folder / LOCK_NAME}` names "
            "it): stop that process, or wait for it to end"
        )
    return f"{folder} is in use by {describe_holder(holder)}; wait for it to end, stop it, or use another --out"


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
