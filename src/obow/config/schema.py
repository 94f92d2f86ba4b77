"""Typed, validated configuration.

Each section is a dataclass whose fields carry their defaults; :func:`from_dict` builds one from a plain
mapping (a YAML recipe, command-line overrides), rejecting unknown keys and values of the wrong type with a
message that names the key and what it allows. Choices and ranges are checked in ``__post_init__``, so a
section built directly in Python is validated the same way.
"""

from __future__ import annotations

import dataclasses
import logging
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, TypeVar

from obow.checks import check_choice, check_positive, check_unit_interval
from obow.config.choices import (
    ASSIGNMENTS,
    COMPILE_MODES,
    DATA_CHANGES,
    DEVICES,
    HEADS,
    LABEL_MODES,
    LOSS_WEIGHTINGS,
    METHODS,
    MOCO_AUGMENTATIONS,
    MOMENTUM_SCHEDULES,
    PIPELINES,
    POOLINGS,
    PRECISIONS,
    QUEUE_SAMPLINGS,
    VOCABULARIES,
)

#: Smallest side a BoW level's map may have after border removal (room for the 3x3 local average).
MIN_BOW_MAP = 3

log = logging.getLogger("obow")


class ConfigError(ValueError):
    """A configuration key is unknown or its value is not allowed."""


@dataclass
class ModelConfig:
    """The OBoW method: backbone, BoW levels, vocabulary rule, head and teacher (paper section 3).

    Defaults are the paper's ResNet-50 "full" setting (official notes 1.3); ``vanilla`` is ``levels:
    [conv5]`` with one student crop, a configuration rather than a code path.

    ``method`` picks the pretraining method (``obow``; the baselines ``mocov2``, ``bownet``, ``rotnet`` read
    the backbone settings here and their own in the ``moco`` / ``bownet`` sections). ``cutmix`` (Table 4's
    "1 x 224 + cutmix", BoWNet's augmentation) pastes, in every student view group, a random box of another
    image of the batch and mixes the two images' BoW targets by area. ``learn_kappa`` makes each level's
    ``kappa`` a learned parameter starting at ``kappa`` (an option of the official code that its recipes
    leave off). With ``vocabulary: queue``, ``num_words`` is a multiple of ``data.batch_size`` (the queue replaces
    one word per image of the batch each step; checked when the recipe is loaded).
    """

    method: str = "obow"
    arch: str = "resnet50"
    arch_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    stem: str = "torchvision"
    levels: tuple[str, ...] = ("conv4", "conv5")
    num_words: int = 8192
    kappa: float = 8.0
    learn_kappa: bool = False
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
    normalize_student: bool = False
    split_generator: bool = False
    teacher_momentum: float = 0.99
    teacher_momentum_schedule: str = "cosine"
    loss_weighting: str = "group_sum"
    cutmix: bool = False

    def __post_init__(self) -> None:
        # Architectures, stems and levels are the backbone module's names; it imports PyTorch, so it is read
        # here, when a model section is checked, not when obow.config is imported.
        from obow.backbones import LEVEL_TO_STAGE, STEMS, parse_arch

        check_choice("model.method", self.method, METHODS)
        try:
            source, _ = parse_arch(self.arch, "model.arch")
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if self.arch_options and source == "resnet":
            raise ConfigError(
                f"model.arch_options are constructor arguments of timm: and torchvision: models; the plain "
                f"{self.arch} takes none (use e.g. model.arch=timm:{self.arch} to pass them)"
            )
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


@dataclass
class ViewsConfig:
    """The teacher's view and the student's crops and patches (paper appendix, official notes 2.11).

    Defaults are the paper's ImageNet sizes: teacher Resize(256) + CenterCrop(224) + flip; 2 x 160 px
    random-resized crops of scale (0.08, 0.6) with colour jitter, grayscale, blur and flip; 5 of a 3x3 grid of
    96 px patches (jitter 24 px) cut from a 256 px random-resized crop of scale (0.6, 1), without blur.
    """

    teacher_resize: int = 256
    teacher_size: int = 224
    num_crops: int = 2
    crop_size: int = 160
    crop_scale: tuple[float, ...] = (0.08, 0.6)
    num_patches: int = 5
    patch_size: int = 96
    patch_jitter: int = 24
    patch_grid_size: int = 256
    patch_scale: tuple[float, ...] = (0.6, 1.0)
    color_jitter: tuple[float, ...] = (0.4, 0.4, 0.4, 0.1)
    color_jitter_prob: float = 0.8
    grayscale_prob: float = 0.2
    blur_prob: float = 0.5
    blur_sigma: tuple[float, ...] = (0.1, 2.0)
    mean: tuple[float, ...] = (0.485, 0.456, 0.406)
    std: tuple[float, ...] = (0.229, 0.224, 0.225)

    def __post_init__(self) -> None:
        for name in ("teacher_resize", "teacher_size", "crop_size", "patch_size", "patch_grid_size"):
            _check_int(f"views.{name}", getattr(self, name), minimum=1)
        for name in ("num_crops", "num_patches", "patch_jitter"):
            _check_int(f"views.{name}", getattr(self, name), minimum=0)
        if self.num_crops + self.num_patches == 0:
            raise ConfigError("views.num_crops + views.num_patches must be >= 1: the student needs views")
        if self.num_patches > 9:
            raise ConfigError(f"views.num_patches must be <= 9 (a 3x3 grid), got {self.num_patches}")
        if self.teacher_resize < self.teacher_size:
            raise ConfigError(
                f"views.teacher_resize ({self.teacher_resize}) must be >= views.teacher_size ({self.teacher_size})"
            )
        if self.num_crops and self.crop_size > self.teacher_size:
            raise ConfigError(
                f"views.crop_size ({self.crop_size}) must be <= views.teacher_size ({self.teacher_size}): the "
                "student's crops are smaller views than the teacher's (the paper: 160 and 224 px); lower "
                "views.crop_size"
            )
        if self.num_patches and self.patch_grid_size < self.patch_size + self.patch_jitter:
            raise ConfigError(
                f"views.patch_grid_size ({self.patch_grid_size}) must be >= views.patch_size + views.patch_jitter "
                f"({self.patch_size + self.patch_jitter})"
            )
        for name in ("crop_scale", "patch_scale"):
            lo_hi = getattr(self, name)
            if len(lo_hi) != 2 or not 0 < lo_hi[0] <= lo_hi[1] <= 1:
                raise ConfigError(f"views.{name} must be [low, high] with 0 < low <= high <= 1, got {list(lo_hi)}")
        if len(self.color_jitter) != 4 or min(self.color_jitter) < 0 or self.color_jitter[3] > 0.5:
            raise ConfigError(
                "views.color_jitter must be [brightness, contrast, saturation, hue], all >= 0, hue <= 0.5, "
                f"got {list(self.color_jitter)}"
            )
        for name in ("color_jitter_prob", "grayscale_prob", "blur_prob"):
            check_unit_interval(f"views.{name}", getattr(self, name))
        if len(self.blur_sigma) != 2 or not 0 < self.blur_sigma[0] <= self.blur_sigma[1]:
            raise ConfigError(f"views.blur_sigma must be [low, high] with 0 < low <= high, got {list(self.blur_sigma)}")
        if len(self.mean) != 3 or len(self.std) != 3 or min(self.std) <= 0:
            raise ConfigError("views.mean and views.std must hold 3 numbers each, std > 0")


@dataclass
class MoCoConfig:
    """MoCo v2 (``model.method=mocov2``), the paper's appendix baseline: a key encoder that is an EMA of the
    query encoder, a 2-layer MLP projection head and an InfoNCE loss over a queue of negative keys.

    ``augmentation: mocov2`` draws MoCo v2's own two views (random-resized crops of ``views.teacher_size``,
    scale ``crop_scale``, colour jitter, grayscale, blur, flip); ``ours`` uses OBoW's views: every student
    crop and patch is a query, contrasted with the key of the teacher's view ("MoCo v2 (our aug.)").
    ``hidden_dim: null`` makes the MLP's hidden layer as wide as the backbone's features (MoCo v2).
    ``bn_splits``: MoCo's shuffled batch norm on one device: the query and key encoders' batch norm computes
    its statistics over this many sub-batches of each process's batch, and the keys of a random permutation of
    the batch are encoded, so that a key is not normalised with its query's images (:mod:`obow.methods.mocov2`);
    it must divide the per-process batch. ``null``: sub-batches of at least 32 images, up to 8 of them
    (:func:`obow.methods.mocov2.auto_bn_splits`; batch 128 -> 4), settled when a run starts and recorded in its
    ``config.yaml``; a run started before the setting existed resumes with the 1 it trained with. ``1`` on one
    process is the leaky variant, where the pretext task can be solved through batch statistics.
    """

    augmentation: str = "mocov2"
    dim: int = 128
    hidden_dim: int | None = None
    queue_size: int = 65536
    temperature: float = 0.2
    key_momentum: float = 0.999
    crop_scale: tuple[float, ...] = (0.2, 1.0)
    bn_splits: int | None = None

    def __post_init__(self) -> None:
        check_choice("moco.augmentation", self.augmentation, MOCO_AUGMENTATIONS)
        if self.bn_splits is not None:
            _check_int("moco.bn_splits", self.bn_splits, minimum=1)
        _check_int("moco.dim", self.dim, minimum=1)
        if self.hidden_dim is not None:
            _check_int("moco.hidden_dim", self.hidden_dim, minimum=1)
        _check_int("moco.queue_size", self.queue_size, minimum=1)
        check_positive("moco.temperature", self.temperature)
        check_unit_interval("moco.key_momentum", self.key_momentum)
        if len(self.crop_scale) != 2 or not 0 < self.crop_scale[0] <= self.crop_scale[1] <= 1:
            raise ConfigError(
                f"moco.crop_scale must be [low, high] with 0 < low <= high <= 1, got {list(self.crop_scale)}"
            )


@dataclass
class BoWNetConfig:
    """BoWNet (``model.method=bownet``, paper Table 5): a static, pretrained teacher; a vocabulary from
    offline k-means over its ``model.levels`` feature maps; BoW targets with ``model.assignment`` (BoWNet:
    ``hard``) and ``model.pooling``; the head of ``model.head`` (BoWNet: ``fixed``).

    ``teacher``: an ``obow pretrain`` checkpoint (its student; e.g. a ``rotnet`` run, or a first BoWNet round
    for the second round) or an exported backbone of the same architecture. k-means runs once, before the
    first step, on ``kmeans_samples_per_image`` feature vectors (border removed) of each of
    ``kmeans_images`` training images (the teacher's view), for ``kmeans_iterations`` Lloyd iterations.
    """

    teacher: str | None = None
    kmeans_images: int = 10000
    kmeans_samples_per_image: int = 16
    kmeans_iterations: int = 50

    def __post_init__(self) -> None:
        for name in ("kmeans_images", "kmeans_samples_per_image", "kmeans_iterations"):
            _check_int(f"bownet.{name}", getattr(self, name), minimum=1)


@dataclass
class DataConfig:
    """Where the images are and how they are batched. ``batch_size`` is global (divided among processes).

    ``pipeline`` says who makes the views: ``workers`` (``num_workers`` loader processes, one image at a time, PIL
    and torchvision: :mod:`obow.data.transforms`), ``device`` (the images decoded once into a cache, then every
    view of a batch made at once on the training device: :mod:`obow.data.batched_views`), or ``auto``: ``device``
    when training on a GPU, ``workers`` on a CPU (why: docs/gpu.md), settled when a run starts and recorded in
    its ``config.yaml`` (:func:`obow.training.run.settle.settle_pipeline`).
    ``cache_dir`` (default ``~/.cache/obow``) and ``cache_size`` (the shorter side every whole image is cached at;
    default: its own, up to the side where none of the recipe's views is upsampled) configure the device
    pipeline's cache (:mod:`obow.data.cache`).
    ``on_change`` is what resuming a run does when its training images are not the checkpoint's (added, removed,
    changed in size: :mod:`obow.data.identity`): ``refuse`` (the default) or ``continue`` on the images now there,
    given for that resume (``data.on_change=continue``).
    """

    path: str | None = None
    val_path: str | None = None
    labels: str = "auto"
    images_per_class: int | None = None
    batch_size: int = 256
    num_workers: int = 8
    pin_memory: bool = True
    pipeline: str = "auto"
    cache_dir: str | None = None
    cache_size: int | None = None
    on_change: str = "refuse"

    def __post_init__(self) -> None:
        check_choice("data.labels", self.labels, LABEL_MODES)
        check_choice("data.on_change", self.on_change, DATA_CHANGES)
        check_choice("data.pipeline", self.pipeline, PIPELINES)
        if self.cache_size is not None:
            _check_int("data.cache_size", self.cache_size, minimum=1)
        _check_int("data.batch_size", self.batch_size, minimum=1)
        _check_int("data.num_workers", self.num_workers, minimum=0)
        if self.images_per_class is not None:
            _check_int("data.images_per_class", self.images_per_class, minimum=1)


@dataclass
class OptimConfig:
    """SGD with a linear warm-up then a cosine learning rate (official notes 2.12). ``warmup_epochs`` stays as
    asked; a run not longer than it warms up over half its length (:func:`obow.schedules.run_warmup`)."""

    epochs: int = 200
    lr: float = 0.03
    warmup_epochs: float = 10.0
    end_lr: float = 3e-5
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 1e-4
    cosine_per_epoch: bool = True
    decay_norm_and_bias: bool = True

    def __post_init__(self) -> None:
        _check_int("optim.epochs", self.epochs, minimum=1)
        check_positive("optim.lr", self.lr)
        check_positive("optim.warmup_epochs", self.warmup_epochs, allow_zero=True)
        check_positive("optim.end_lr", self.end_lr, allow_zero=True)
        check_unit_interval("optim.momentum", self.momentum, closed=False)
        check_positive("optim.weight_decay", self.weight_decay, allow_zero=True)


@dataclass
class TrainConfig:
    """Run-time settings: device, precision, logging, checkpoints and the online kNN monitor."""

    seed: int = 0
    device: str = "auto"
    precision: str = "fp32"
    channels_last: bool = False
    compile: str | bool = "off"  # a bool in recipes and checkpoints written before `step` existed
    deterministic: bool = False
    #: On CUDA, float32 matrix products and convolutions on the tensor cores in TF32 (10 mantissa bits, as bf16
    #: has 7): what an fp32 recipe and the fp32 kNN monitor of a run compute with; ``false``: IEEE float32
    #: throughout. PyTorch's own defaults are TF32 convolutions and float32 matrix products. No effect on a CPU.
    tf32: bool = True
    sync_batchnorm: bool = True
    backward_per_group: bool = True
    log_every: int = 20
    checkpoint_every: int = 0
    checkpoint_minutes: float = 10.0
    keep_every: int = 0
    knn_every: int = 1
    knn_k: int = 20
    knn_temperature: float = 0.1
    progress_bar: bool = True
    tensorboard: bool = True
    #: Intra-op threads of each training process; 0: chosen from the cores
    #: (see obow.training.run.threads.choose_threads)
    threads: int = 0

    def __post_init__(self) -> None:
        _check_int("train.seed", self.seed, minimum=0)
        _check_int("train.threads", self.threads, minimum=0)
        check_choice("train.device", self.device, DEVICES)
        check_choice("train.precision", self.precision, PRECISIONS)
        if isinstance(self.compile, bool):
            self.compile = "networks" if self.compile else "off"
        check_choice("train.compile", self.compile, COMPILE_MODES)
        _check_int("train.log_every", self.log_every, minimum=1)
        for name in ("checkpoint_every", "keep_every", "knn_every"):
            _check_int(f"train.{name}", getattr(self, name), minimum=0)
        check_positive("train.checkpoint_minutes", self.checkpoint_minutes, allow_zero=True)
        _check_int("train.knn_k", self.knn_k, minimum=1)
        check_positive("train.knn_temperature", self.knn_temperature)


@dataclass
class Config:
    """A whole recipe. Cross-section rules (map sizes, queue divisibility) are checked here."""

    description: str = ""
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    views: ViewsConfig = dataclasses.field(default_factory=ViewsConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    moco: MoCoConfig = dataclasses.field(default_factory=MoCoConfig)
    bownet: BoWNetConfig = dataclasses.field(default_factory=BoWNetConfig)

    def __post_init__(self) -> None:
        m, v = self.model, self.views
        if m.method == "mocov2":
            if self.moco.queue_size % self.data.batch_size != 0:
                raise ConfigError(
                    f"moco.queue_size ({self.moco.queue_size}) must be a multiple of data.batch_size "
                    f"({self.data.batch_size}): the queue takes one key per image of the global batch each step"
                )
            splits = self.moco.bn_splits
            if splits is not None and self.data.batch_size % splits != 0:
                raise ConfigError(
                    f"moco.bn_splits ({splits}) must divide data.batch_size ({self.data.batch_size}): batch norm "
                    "takes equal sub-batches of each process's batch"
                )
            return  # no BoW levels: the map-size and vocabulary rules below are OBoW's and BoWNet's
        if m.method == "rotnet":
            return
        if m.method == "bownet" and not self.bownet.teacher:
            raise ConfigError(
                "model.method=bownet needs bownet.teacher: the static teacher, an obow pretrain checkpoint (e.g. of "
                "a model.method=rotnet run) or an exported backbone of the same model.arch"
            )
        from obow.backbones import level_map_size

        for level in m.levels:
            try:
                side = level_map_size(m.arch, v.teacher_size, level, m.stem, m.arch_options) - 2 * m.border
            except ValueError as err:
                raise ConfigError(f"model.arch={m.arch!r}, model.stem={m.stem!r}: {err}") from None
            if side < MIN_BOW_MAP:
                raise ConfigError(
                    f"the {level} BoW map is {max(side, 0)}x{max(side, 0)} after border removal "
                    f"(views.teacher_size={v.teacher_size}, model.stem={m.stem!r}, model.border={m.border}); "
                    f"every level needs at least {MIN_BOW_MAP}x{MIN_BOW_MAP}: raise views.teacher_size, choose a "
                    "stem with a smaller stride (no_maxpool: 16, cifar: 8) or drop the level from model.levels"
                )
        if m.method == "obow" and m.vocabulary == "queue" and m.num_words % self.data.batch_size != 0:
            raise ConfigError(
                f"model.num_words ({m.num_words}) must be a multiple of data.batch_size ({self.data.batch_size}): "
                "the queue takes one word per image of the global batch each step"
            )


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


def _expected(hint: Any) -> str:
    """What a setting of type ``hint`` takes, in words."""
    origin = typing.get_origin(hint)
    if origin is tuple:
        return f"a list of {_expected(typing.get_args(hint)[0]).removeprefix('a ').removeprefix('an ')}s"
    if hint is dict or origin is dict:
        return "a mapping of keys to values"
    return {bool: "true or false", int: "an integer", float: "a number (e.g. 0.05 or 1/15)", str: "a string"}.get(
        hint, str(hint)
    )


def _coerce(name: str, hint: Any, value: Any) -> Any:
    origin = typing.get_origin(hint)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return from_dict(hint, value, prefix=f"{name}.")
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        if set(options) == {str, bool}:  # a choice that also takes true / false (train.compile)
            boolean = isinstance(value, bool) or (isinstance(value, str) and value.lower() in ("true", "false"))
            return _coerce(name, bool if boolean else str, value)
        (inner,) = [o for o in options if o is not type(None)]
        return _coerce(name, inner, value)
    if value is None:  # `optim.lr=` on the command line, or `lr:` with nothing after it in a recipe
        raise ConfigError(f"an empty value was given for {name}, which takes {_expected(hint)}")
    if hint is dict or origin is dict:
        if isinstance(value, Mapping):
            return dict(value)
        raise ConfigError(f"{name} must be a mapping of keys to values, got {value!r}")
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
