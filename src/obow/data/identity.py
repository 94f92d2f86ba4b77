"""Which images a run trains on, known without reading one: the sorted paths of its training images relative to
``data.path`` and their sizes in bytes, and a SHA-256 digest of that list.

A run records the digest (with the number of images and their bytes) in every checkpoint, and the list itself
once in its run folder (:data:`LIST_NAME`, gzipped text, one ``path<TAB>size`` line per image, :func:`escape`). A resume
compares the images it finds with the checkpoint's (:func:`obow.training.run.data_check.check_same_data`): the same
list under another ``data.path`` is the same data (a moved or remounted folder), and a different one is named
by what changed (:func:`compare`). Identifying costs one ``stat`` per image, no read of its contents: an image
rewritten in place with the same name and size is not noticed, and modification times are left out, so that a
copy made without keeping them (``cp -r``) is still the same data.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from obow.data.folders import ImageList
from obow.files import writing

#: The list of a run's training images, in its run folder.
LIST_NAME = "images.tsv.gz"


@dataclass(frozen=True)
class DataIdentity:
    """A set of training images: ``files``, ``(path relative to the data folder, '/'-separated; size in bytes)``
    sorted by path, and their :func:`digest`."""

    files: list[tuple[str, int]]
    digest: str

    @property
    def record(self) -> dict[str, Any]:
        """What a checkpoint keeps: the number of images, their bytes and the digest."""
        return {"images": len(self.files), "bytes": sum(size for _, size in self.files), "digest": self.digest}


def identify(images: ImageList) -> DataIdentity:
    """The identity of ``images`` (one ``stat`` per image)."""
    prefix = os.path.join(images.root, "")
    files = sorted((relative(path, images.root, prefix), os.stat(path).st_size) for path in images.paths)
    return DataIdentity(files, digest(files))


def relative(path: str, root: str, prefix: str) -> str:
    """``path`` relative to ``root`` (whose ``prefix`` is ``root`` and a separator), ``/``-separated: by slicing
    when it starts with ``prefix``, as the paths :func:`~obow.data.folders.scan_images` lists do
    (``os.path.relpath`` took 1.3 s per 100,000 images)."""
    name = path[len(prefix) :] if path.startswith(prefix) else os.path.relpath(path, root)
    return name.replace(os.sep, "/")


def digest(files: list[tuple[str, int]]) -> str:
    """SHA-256 of the ``path<TAB>size`` lines of ``files``, in their order."""
    h = hashlib.sha256()
    for path, size in files:
        h.update(f"{path}\t{size}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def escape(name: str) -> str:
    r"""A path as one field of a line of the list: a backslash, a newline or a carriage return in a file name (all
    legal on Linux) written as ``\\``, ``\n`` or ``\r``; a tab needs none (a line's last tab ends its path)."""
    return name.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")


_UNESCAPED = {"\\": "\\", "n": "\n", "r": "\r"}


def unescape(field: str) -> str:
    """:func:`escape`'s path back (a backslash before any other character stays as it is)."""
    return re.sub(r"\\(.)", lambda m: _UNESCAPED.get(m[1], m[0]), field, flags=re.S)


def write_list(identity: DataIdentity, path: Path) -> None:
    """``identity``'s list at ``path`` (gzipped ``path<TAB>size`` lines, the paths :func:`escape`'d; replaced whole,
    never half-written)."""
    with writing(path.with_name(f".{path.name}.tmp")) as tmp:
        with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
            f.writelines(
                f"{escape(name)}\t{size}\n".encode("utf-8", "surrogateescape") for name, size in identity.files
            )
        tmp.replace(path)


def read_list(path: Path, expected_digest: str) -> list[tuple[str, int]] | None:
    """The list :func:`write_list` wrote at ``path``, when it is there, reads and has ``expected_digest`` (the
    checkpoint's); else ``None``. A list written before the paths were escaped (obow 0.1 before 2026-11-30) is read
    as it was written."""
    try:
        with gzip.open(path, "rb") as f:
            lines = f.read().decode("utf-8", "surrogateescape").split("\n")  # not splitlines: \x85, \u2028 ...
        if lines[-1] != "":  # every line ends with a newline: cut short
            return None
        fields = [line.rpartition("\t") for line in lines[:-1]]
        sizes = [int(size) for _, _, size in fields]
    except (OSError, ValueError, EOFError):
        return None
    for read in (unescape, str):
        files = [(read(name), size) for (name, _, _), size in zip(fields, sizes, strict=True)]
        if digest(files) == expected_digest:
            return files
    return None


@dataclass(frozen=True)
class DataChange:
    """What differs between two lists of images: paths ``added``, ``removed`` and ``resized`` (same path, other
    size), each sorted."""

    added: list[str]
    removed: list[str]
    resized: list[str]

    def describe(self) -> str:
        """``3 images added, 1 removed, 1 changed in size (e.g. a/x.png)``: the example is of the first kind."""
        kinds = ((self.added, "added"), (self.removed, "removed"), (self.resized, "changed in size"))
        found = [(len(paths), what, paths[0]) for paths, what in kinds if paths]
        if not found:
            return "no image added, removed or changed in size"
        said = [f"{n} {what}" for n, what, _ in found]
        said[0] = f"{found[0][0]} image{'s' * (found[0][0] > 1)} {found[0][1]}"
        example = found[0][2]
        return f"{', '.join(said)} (e.g. {example if example.isprintable() else repr(example)})"  # a newline in it


def compare(before: list[tuple[str, int]], now: list[tuple[str, int]]) -> DataChange:
    """What changed from the images ``before`` to those ``now``."""
    old, new = dict(before), dict(now)
    return DataChange(
        added=sorted(new.keys() - old.keys()),
        removed=sorted(old.keys() - new.keys()),
        resized=sorted(p for p in old.keys() & new.keys() if old[p] != new[p]),
    )
