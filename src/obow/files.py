"""Writing files: a failed write becomes one line that names the file and the cause.

Every command that writes (checkpoints, ``config.yaml``, logs, reports, exports, pictures) goes through
:func:`writing`, so that a read-only folder, a full disk or an ``--out`` under a regular file ends in
``obow: error: cannot write FILE: CAUSE`` rather than a traceback. PyTorch's writer reports a failed write as
``unexpected pos N vs M``, which names neither; the operating system's error it met is found in the
exception's context, and a full disk is recognised from the free space left.
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import shutil
from collections.abc import Iterator
from pathlib import Path

#: Below this many free bytes a failed write is put down to a full disk (writes fill it before they fail).
FULL_DISK_BYTES = 1 << 20


class WriteError(RuntimeError):
    """A file could not be written; the message names it and says why."""


def write_error(path: str | Path, err: BaseException) -> WriteError:
    """The :class:`WriteError` for ``err``, met while writing ``path``."""
    return WriteError(f"cannot write {path}: {write_failure_cause(Path(path), err)}")


def as_write_error(path: str | Path, err: Exception) -> WriteError | None:
    """The :class:`WriteError` for ``err`` when it is a failed write (an ``OSError``, or PyTorch's writer error
    with or without the ``OSError`` it met), else ``None`` (an error of another kind, left as it is)."""
    if isinstance(err, WriteError):
        return err
    if find_os_error(err) is not None or is_torch_write_error(err):
        return write_error(path, err)
    return None


def write_failure_cause(path: Path, err: BaseException) -> str:
    """Why writing ``path`` failed with ``err``, in a few words: the disk is full, a parent is a file, the
    file size limit, or the operating system's own words."""
    os_error = find_os_error(err)
    if os_error is None or os_error.errno in (errno.ENOSPC, errno.EDQUOT):
        free = free_bytes(path)
        if free is not None and free < FULL_DISK_BYTES:
            return f"the disk is full ({free} bytes free)"
    if os_error is None:  # torch's writer: "[enforce fail at inline_container.cc:672] . unexpected pos N vs M"
        return f"the write stopped part-way ({first_line(err)})"
    if os_error.errno in (errno.ENOTDIR, errno.EEXIST) and (blocker := file_in_the_way(path)) is not None:
        return f"{blocker} is a file, not a folder"
    if os_error.errno == errno.EFBIG:
        limit, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
        if limit != resource.RLIM_INFINITY:
            return f"{os_error.strerror} (the file size limit, ulimit -f, is {limit} bytes)"
    return os_error.strerror or first_line(os_error)


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def find_os_error(err: BaseException | None) -> OSError | None:
    """``err`` itself when it is an ``OSError``, else the first one in its chain of causes and contexts
    (PyTorch raises its own error while handling the ``OSError`` a write met)."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, OSError):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def free_bytes(path: Path) -> int | None:
    """Free bytes on the disk that holds ``path`` (its nearest existing folder); ``None`` if unknown."""
    for folder in (path, *path.parents):
        if folder.is_dir():
            try:
                return shutil.disk_usage(folder).free
            except OSError:
                return None
    return None


def file_in_the_way(path: Path) -> Path | None:
    """The nearest existing one of ``path`` and its ancestors, when it is not a folder."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return None if candidate.is_dir() else candidate
    return None


def is_inside(path: str | Path, folder: str | Path) -> bool:
    """Whether ``path`` is ``folder`` or lies under it, links resolved."""
    inner, outer = Path(os.path.realpath(path)), Path(os.path.realpath(folder))
    return inner == outer or outer in inner.parents


@contextlib.contextmanager
def writing(path: str | Path) -> Iterator[Path]:
    """Write ``path`` inside this block: an ``OSError`` (or PyTorch's writer error) becomes a
    :class:`WriteError` that names it. The parent folders are created first."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        yield path
    except (OSError, RuntimeError) as err:
        failure = as_write_error(path, err)
        if failure is None or failure is err:
            raise
        raise failure from err


def check_writable(path: str | Path) -> Path:
    """Raise :class:`WriteError` now when the file ``path`` could not be written later (a command checks its
    outputs before long work, so that a wrong ``--out`` does not lose it): ``path`` is a folder, a file in the way
    of its folders, a read-only file system or a folder without write permission. Creates nothing; a
    failure that only the write can meet (a full disk) is still reported then, by :func:`writing`."""
    path = Path(path)
    if path.is_dir():
        raise WriteError(f"cannot write {path}: it is a folder (give a file name)")
    if path.exists():
        if not os.access(path, os.W_OK):
            raise WriteError(f"cannot write {path}: {_access_cause(path)}")
        return path
    blocker = file_in_the_way(path)
    if blocker is not None:
        raise WriteError(f"cannot write {path}: {blocker} is a file, not a folder")
    folder = next(p for p in path.parents if p.exists())
    if not os.access(folder, os.W_OK | os.X_OK):
        raise WriteError(f"cannot write {path}: {_access_cause(folder)}")
    return path


def _access_cause(path: Path) -> str:
    try:
        read_only = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    return f"{path} is on a read-only file system" if read_only else f"{path} is not writable (permission denied)"


def file_mode() -> int:
    """The mode a new file gets from ``open()``: ``0o666`` less the process's umask (``0o644`` under the usual
    ``022``). Files written through a temporary file (:func:`obow.weights.checkpoint.save_atomic`, whose
    ``mkstemp`` makes them ``0o600``) are given it, so that every file of a run has the same mode; a user who
    wants private runs sets ``umask 077``."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0o022)  # no other way to read it; set back at once
    os.umask(umask)
    return 0o666 & ~umask


def make_folder(path: str | Path) -> Path:
    """``mkdir -p path``, or a :class:`WriteError` that says why it cannot be created."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise write_error(path, err) from err
    return path


def is_torch_write_error(err: BaseException) -> bool:
    """PyTorch's zip writer's message when a write came up short (no ``OSError`` in its context)."""
    text = str(err)
    return "inline_container" in text or "PytorchStreamWriter" in text


def sync_folder(folder: Path) -> None:
    """Flush a folder's entries to disk, so that a rename in it survives a power loss (where supported)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
