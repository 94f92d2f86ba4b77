"""A checkpoint's checksum: the SHA-256 of everything it holds, stored inside it and checked on every read.

``torch.load`` reads a checkpoint whose bytes were changed in place (a disk or copy fault, not a file cut short)
without a word: random bytes written over its tensors gave non-finite weights, and ``obow eval knn`` printed
chance level. :func:`seal` adds the entry :data:`KEY`, the SHA-256 of every tensor's dtype, shape and bytes and
of every other value, in the dictionary's order; :func:`verify` computes it again on the loaded dictionary and
takes the entry out. A checkpoint written before checksums has none: it is read as before, said once per file
(:class:`~obow.notices.ObowWarning`).
"""

from __future__ import annotations

import hashlib
import warnings
from pathlib import Path
from typing import Any

import torch

from obow.notices import ObowWarning

#: The checkpoint entry holding the checksum (hexadecimal).
KEY = "sha256"

_said_unverified: set[str] = set()


def digest(obj: Any) -> str:
    """The SHA-256 (hexadecimal) of a checkpoint's contents: tensors by dtype, shape and bytes, containers by
    their entries in order (a list and a tuple alike: a saved tuple may come back as either), other values by
    ``repr``."""
    h = hashlib.sha256()
    _feed(h, obj)
    return h.hexdigest()


def _feed(h: Any, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        h.update(f"tensor {t.dtype} {tuple(t.shape)}\0".encode())
        if t.numel():
            h.update(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    elif isinstance(obj, dict):
        h.update(f"dict {len(obj)}\0".encode())
        for key, value in obj.items():
            _feed(h, key)
            _feed(h, value)
    elif isinstance(obj, (list, tuple)):
        h.update(f"list {len(obj)}\0".encode())
        for value in obj:
            _feed(h, value)
    else:
        h.update(f"{type(obj).__name__} {obj!r}\0".encode())


def seal(ckpt: dict[str, Any]) -> dict[str, Any]:
    """``ckpt`` with its checksum (:data:`KEY`, last)."""
    contents = {k: v for k, v in ckpt.items() if k != KEY}
    return {**contents, KEY: digest(contents)}


def verify(ckpt: dict[str, Any], path: str | Path) -> str | None:
    """Take the checksum out of a loaded checkpoint and check it: ``None`` when it matches, else what is wrong in
    a few words. A checkpoint without one is accepted, with a warning the first time this process reads it."""
    expected = ckpt.pop(KEY, None)
    if expected is None:
        if str(path) not in _said_unverified:
            _said_unverified.add(str(path))
            warnings.warn(
                f"{path} has no checksum (written by an obow before checksums): read without checking that its "
                "contents are whole",
                ObowWarning,
                stacklevel=3,
            )
        return None
    if digest(ckpt) != expected:
        return "its contents do not match the checksum written with it (the file was damaged after it was written)"
    return None
