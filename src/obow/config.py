"""Typed, validated configuration.

Each section is a dataclass whose fields carry their defaults; :func:`from_dict` builds one from a plain
mapping (a YAML recipe, command-line overrides), rejecting unknown keys and values of the wrong type with a
message that names the key and what it allows. Choices and ranges are checked in ``__post_init__``, so a
section built directly in Python is validated the same way.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, TypeVar

from obow.backbones import ARCHITECTURES, LEVEL_TO_STAGE, STEMS
from obow.bow import ASSIGNMENTS, POOLINGS
from obow.validation import check_choice, check_positive, check_unit_interval
from obow.vocabulary import QUEUE_SAMPLINGS

VOCABULARIES = ("queue", "kmeans")
HEADS = ("dynamic", "fixed")
MOMENTUM_SCHEDULES = ("cosine", "constant")
LOSS_WEIGHTINGS = ("group_sum", "view_mean")


class ConfigError(ValueError):
    """A configuration key is unknown or its value is not allowed."""


@dataclass
class ModelConfig:
    """The OBoW method: backbone, BoW levels, vocabulary rule, head and teacher (paper section 3).

    Defaults are the paper's ResNet-50 "full" setting (official notes 1.3); ``vanilla`` is ``levels:
    [conv5]`` with one student crop, a configuration rather than a code path.
    """

    arch: str = "resnet50"
    stem: str = "torchvision"
    levels: tuple[str, ...] = ("conv4", "conv5")
    num_words: int = 8192
    kappa: float = 8.0
    delta_base: float = 1 / 15
    assignment: str = "soft"
    pooling: str = "max"
    border: int = 1
    temperature_momentum: float = 0.99
    temperature_init: float | None = 0.5
    vocabulary: str = "queue"
    queue_sampling: str = "local_average"
    kmeans_momentum: float = 0.99
    rare_word_steps: int | None = 1000
    sinkhorn_epsilon: float = 1 / 15
    sinkhorn_iterations: int = 3
    head: str = "dynamic"
    teacher_momentum: float = 0.99
    teacher_momentum_schedule: str = "cosine"
    loss_weighting: str = "group_sum"

    def __post_init__(self) -> None:
        check_choice("model.arch", self.arch, ARCHITECTURES)
        check_choice("model.stem", self.stem, STEMS)
        if not self.levels:
            raise ConfigError("model.levels must name at least one level, e.g. [conv5] or [conv4, conv5]")
        for level in self.levels:
            check_choice("model.levels", level, tuple(LEVEL_TO_STAGE))
        if len(set(self.levels)) != len(self.levels):
            raise ConfigError(f"model.levels has duplicates: {list(self.levels)}")
        _check_int("model.num_words", self.num_words, minimum=1)
        check_positive("model.kappa", self.kappa)
        check_positive("model.delta_base", self.delta_base)
        check_choice("model.assignment", self.assignment, ASSIGNMENTS)
        check_choice("model.pooling", self.pooling, POOLINGS)
        _check_int("model.border", self.border, minimum=0)
        check_unit_interval("model.temperature_momentum", self.temperature_momentum, closed=False)
        if self.temperature_init is not None:
            check_positive("model.temperature_init", self.temperature_init)
        check_choice("model.vocabulary", self.vocabulary, VOCABULARIES)
        check_choice("model.queue_sampling", self.queue_sampling, QUEUE_SAMPLINGS)
        check_unit_interval("model.kmeans_momentum", self.kmeans_momentum, closed=False)
        if self.rare_word_steps is not None:
            _check_int("model.rare_word_steps", self.rare_word_steps, minimum=1)
        check_positive("model.sinkhorn_epsilon", self.sinkhorn_epsilon)
        _check_int("model.sinkhorn_iterations", self.sinkhorn_iterations, minimum=1)
        check_choice("model.head", self.head, HEADS)
        check_unit_interval("model.teacher_momentum", self.teacher_momentum)
        check_choice("model.teacher_momentum_schedule", self.teacher_momentum_schedule, MOMENTUM_SCHEDULES)
        check_choice("model.loss_weighting", self.loss_weighting, LOSS_WEIGHTINGS)


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")


T = TypeVar("T")


def from_dict(cls: type[T], values: Mapping[str, Any], prefix: str = "") -> T:
    """Build the dataclass ``cls`` from ``values``, coercing YAML scalars to the declared field types.

    Unknown keys and values that do not fit the declared type raise :class:`ConfigError` naming the key.
    Nested dataclass fields take nested mappings. Floats also accept fractions written as ``"1/15"``.
    """
    if not isinstance(values, Mapping):
        raise ConfigError(f"{prefix or 'config'} must be a mapping of keys to values, got {values!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kwargs = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if key not in fields:
            raise ConfigError(f"unknown key {name!r}; allowed keys here: {', '.join(sorted(fields))}")
        kwargs[key] = _coerce(name, hints[key], value)
    try:
        return cls(**kwargs)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _coerce(name: str, hint: Any, value: Any) -> Any:
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, prefix=f"{name}.")
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        (inner,) = [o for o in options if o is not type(None)]
        return _coerce(name, inner, value)
    if origin is tuple:
        item_type = typing.get_args(hint)[0]
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            value = [value]
        return tuple(_coerce(f"{name}[{i}]", item_type, v) for i, v in enumerate(value))
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            return int(value)
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(Fraction(value.strip()))
            except (ValueError, ZeroDivisionError):
                pass
        raise ConfigError(f"{name} must be a number (e.g. 0.05 or 1/15), got {value!r}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{name} must be a string, got {value!r}")
    raise ConfigError(f"{name}: unsupported type {hint!r}")  # pragma: no cover - a programming error


def to_dict(section: Any) -> dict[str, Any]:
    """The plain-data form of a config section (tuples become lists), e.g. for YAML or JSON."""

    def plain(v: Any) -> Any:
        if isinstance(v, tuple):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return plain(dataclasses.asdict(section))
