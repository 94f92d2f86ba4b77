"""Recipes: the built-in YAML files under ``recipes/``, ``base:`` inheritance, ``key=value`` overrides."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from obow.checks import is_utf8
from obow.config.schema import Config, ConfigError, from_dict, to_dict
from obow.files import writing

RECIPES_DIR = Path(__file__).parent / "recipes"


def available_recipes() -> dict[str, str]:
    """Built-in recipe names and their one-line descriptions."""
    out = {}
    for path in sorted(RECIPES_DIR.glob("*.yaml")):
        raw = _read_yaml(path)
        out[path.stem] = str(raw.get("description", "")).strip().splitlines()[0] if raw.get("description") else ""
    return out


def _read_yaml(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:  # bytes: PyYAML decodes them, and names the file when they are not text
        try:
            raw = yaml.safe_load(f)
        except yaml.reader.ReaderError as err:  # bytes that are not UTF-8 (or UTF-16) text, or control characters
            raise ConfigError(
                f"{path}: not a text file, so not a YAML recipe (character #x{err.character:02x} at byte "
                f"{err.position}: {err.reason})"
            ) from None
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ConfigError(f"{where}: not valid YAML: {problem}") from None
    if raw is None:  # taken as obow's defaults, it would be the paper's ResNet-50 run, hours a step on a CPU
        raise ConfigError(
            f"recipe {path} is empty: write its settings in it, or start from a built-in one with 'base: NAME' "
            "(obow recipes lists them)"
        )
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a mapping of settings, got {type(raw).__name__}")
    return raw


def _merge(base: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _resolve_recipe(source: str | Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    text = str(source)
    builtin = RECIPES_DIR / f"{text}.yaml"
    looks_like_file = text.endswith((".yaml", ".yml")) or "/" in text or "\\" in text
    if not looks_like_file and builtin.is_file():
        path = builtin
    elif Path(text).is_file():
        path = Path(text)
    elif Path(text).exists():  # /dev/zero, a folder, a FIFO: reading it would never end, or fail
        raise ConfigError(f"recipe {text!r} is {file_kind(Path(text))}, not a YAML file: give a recipe file or name")
    elif looks_like_file:
        raise ConfigError(f"recipe file {text!r} does not exist")
    else:
        raise ConfigError(f"unknown recipe {text!r}: give a YAML file or one of: {', '.join(available_recipes())}")
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"recipe {path} inherits from itself through 'base'")
    raw = _read_yaml(path)
    base = raw.pop("base", None)
    if base is None:
        return raw
    base_path = Path(base) if Path(base).suffix else base
    if isinstance(base_path, Path) and not base_path.is_absolute():
        base_path = path.parent / base_path
    return _merge(_resolve_recipe(base_path, (*seen, path)), raw)


def file_kind(path: Path) -> str:
    """What ``path`` is when it exists and is no regular file: ``"a folder"``, ``"a character device"``, ..."""
    import stat

    mode = path.stat().st_mode
    for test, kind in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return "a special file"


def parse_override(item: str) -> dict[str, Any]:
    """``"model.num_words=4096"`` -> ``{"model": {"num_words": 4096}}`` (the value is read as YAML)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.key=value, e.g. optim.lr=0.05")
    key, _, text = item.partition("=")
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {item!r} has an empty key part")
    value: Any = text  # a path named in no UTF-8, which YAML cannot read, is the string it is
    if is_utf8(text):
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError as err:
            said = " ".join(str(err).split())  # YAML's message spans lines
            raise ConfigError(f"override {item!r}: cannot read the value ({said})") from None
    for part in reversed(parts):
        value = {part: value}
    return value


def load_config(source: str | Path | None = None, overrides: str | Sequence[str] = ()) -> Config:
    """A validated :class:`Config` from a built-in recipe name or a YAML path, plus ``key=value`` overrides (a list
    of them, or one as a string: ``load_config("cifar10_fast", "optim.epochs=30")``).

    With ``source=None`` the defaults (the paper's ResNet-50 recipe) are the starting point. A recipe may
    name another in ``base:`` and change only what differs.
    """
    raw = _resolve_recipe(source) if source is not None else {}
    for item in [overrides] if isinstance(overrides, str) else overrides:
        raw = _merge(raw, parse_override(item))
    return from_dict(Config, raw)


def save_config(cfg: Config, path: str | Path) -> None:
    with writing(path) as path, open(path, "w") as f:
        yaml.safe_dump(to_dict(cfg), f, sort_keys=False)
