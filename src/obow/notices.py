"""Warnings for the user, and how the ``obow`` command shows them.

obow warns its user with :class:`ObowWarning` (a ``UserWarning``): skipped unreadable or empty images, an export
without its sidecar, a diverged linear probe, a stem the reader must set. Python would print such a warning as
``/path/to/obow/evaluate/features.py:52: UserWarning: ...`` followed by a line of source code, which reads like a
traceback. The ``obow`` command (:func:`route_warnings`) shows each one instead as one line of its log,
``HH:MM:SS WARNING <message>``, through the ``obow`` logger; the warnings of the libraries underneath (PyTorch,
torchvision, timm, scikit-learn) say nothing a user can act on and go to that logger at DEBUG level, which is
not shown. Anyone who wants Python's own display back asks for it as usual, with ``python -W ...`` or
``PYTHONWARNINGS``: then nothing is routed.

Code that uses obow as a library sees ordinary Python warnings (filter or record them as usual).

``obow pretrain`` holds its log lines back while it reads the recipe (:func:`notices_held`) and shows them once the
training images are found (:func:`release_notices`): a missing or empty ``--data`` is then the only line printed,
not the last line after a warning about a setting of a run that does not start.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from collections.abc import Iterator
from typing import Any, TextIO

log = logging.getLogger("obow")


class ObowWarning(UserWarning):
    """A warning obow gives its user; the ``obow`` command shows it as one log line (:func:`route_warnings`)."""


def route_warnings() -> None:
    """Show :class:`ObowWarning` as one ``obow`` log line and hide other warnings (at DEBUG level), unless the
    user chose Python's warnings display (``-W`` or ``PYTHONWARNINGS``). For the ``obow`` command and the
    processes it starts; a forked process (a data-loading worker) inherits the routing."""
    if sys.warnoptions:
        return
    warnings.showwarning = show_warning


def show_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
    **_: Any,
) -> None:
    """:data:`warnings.showwarning` for the ``obow`` command: one line, no source path or code."""
    if issubclass(category, ObowWarning):
        log.warning("%s", message)
    else:
        log.debug("%s: %s (%s:%d)", category.__name__, message, filename, lineno)


class DropMessage(logging.Filter):
    """Drops the log records whose message starts with ``start``."""

    def __init__(self, start: str) -> None:
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.start)


#: PyTorch's ``No CUDA runtime is found, using CUDA_HOME=...``, logged by its C++ extension set-up, which a
#: compile imports: on a machine with a CUDA toolkit but no usable GPU, i.e. a CPU run, where it is nothing to act
#: on. :class:`obow.training.step.watch.CompileWatch` puts this filter on :data:`CPP_EXTENSION_LOGGER` while a run
#: compiles.
NO_CUDA_RUNTIME = DropMessage("No CUDA runtime is found")
CPP_EXTENSION_LOGGER = "torch.utils.cpp_extension"


class _Held(logging.Filter):
    """Keeps the records of the ``obow`` logger instead of letting them through."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        self.records.append(record)
        return False


_held: _Held | None = None


@contextlib.contextmanager
def notices_held() -> Iterator[None]:
    """Hold the ``obow`` log lines (and so :class:`ObowWarning`) of the block until :func:`release_notices`: those
    still held when the block ends are shown then, or dropped when it ends with an error, which is then the only
    line; for a command whose first lines would otherwise come before an error about its input."""
    global _held
    held = _held = _Held()
    log.addFilter(held)
    failed = True
    try:
        yield
        failed = False
    finally:
        log.removeFilter(held)
        _held = None
        if not failed:
            _replay(held)


def release_notices() -> None:
    """Show the lines :func:`notices_held` holds, in order, and let the next ones through (nothing when none are
    held): called once the input is known to be usable."""
    global _held
    if _held is not None:
        log.removeFilter(_held)
        _replay(_held)
        _held = None


def _replay(held: _Held) -> None:
    records, held.records = held.records, []
    for record in records:
        log.handle(record)


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun`` agreeing in number: ``1 image``, ``3 images``, ``2 symbolic links`` (``plural`` where the
    plural is not ``noun + "s"``)."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"
