"""Argument checks that raise errors naming the offending parameter and what it allows."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def check_choice(name: str, value: Any, allowed: Iterable[Any]) -> None:
    """Raise ``ValueError`` unless ``value`` is one of ``allowed``."""
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not allowed; choose one of {', '.join(map(repr, allowed))}")


def check_positive(name: str, value: float, *, allow_zero: bool = False) -> None:
    """Raise ``ValueError`` unless ``value`` is a number > 0 (or >= 0 with ``allow_zero``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be {bound}, got {value!r}")


def check_unit_interval(name: str, value: float, *, closed: bool = True) -> None:
    """Raise ``ValueError`` unless ``0 <= value <= 1`` (``0 <= value < 1`` when not ``closed``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    ok = 0 <= value <= 1 if closed else 0 <= value < 1
    if not ok:
        raise ValueError(f"{name} must be in [0, 1{']' if closed else ')'}, got {value!r}")


def is_utf8(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8: a path named in no UTF-8 (an old archive's Latin-1) does not, Python reading
    its bytes as surrogates, which YAML, TensorBoard and matplotlib refuse."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
