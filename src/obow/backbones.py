"""Convnet trunks that expose the feature levels OBoW needs.

The teacher quantises intermediate feature maps (``conv4`` = ``layer3`` and ``conv5`` = ``layer4`` in
torchvision's naming, paper section 3.3) and the student predicts every BoW from its global-average-pooled
``pool5`` vector (paper section 3.3, official notes 2.6-2.7).

:class:`ResNetBackbone` registers torchvision's own modules under torchvision's own names (``conv1``,
``bn1``, ``layer1`` ... ``layer4``) and drops only ``avgpool`` and ``fc``, so its ``state_dict`` loads into
the matching ``torchvision.models.resnetXX()`` once an ``fc`` is supplied (see ``obow.weights.export``).

Three sources of networks, named by ``model.arch``:

* a plain torchvision ResNet name (``resnet18``, ``resnet50``, ...): :class:`ResNetBackbone`, with the stems
  below, exported and evaluated as torchvision ResNets (the paper's networks);
* ``timm:<name>``: any timm model that supports ``features_only`` (:class:`TimmBackbone`), e.g.
  ``timm:resnet10t``, ``timm:regnetx_002``, ``timm:mobilenetv3_small_100``;
* ``torchvision:<name>``: any torchvision classification model, through torchvision's feature-extraction
  utilities (:class:`TorchvisionBackbone`), e.g. ``torchvision:mobilenet_v3_small``, ``torchvision:regnet_x_400mf``.

For every source the BoW levels are named as in the paper: ``conv5`` is the last stage (stride 32 with the
standard stem), ``conv4`` the one before it, then ``conv3`` and ``conv2``; ``pool5`` is the global average of
``conv5``.

Stems (ResNets):

* ``"torchvision"``: 7x7 stride-2 convolution and a 3x3 stride-2 max-pool (output stride 32), as in the paper.
* ``"no_maxpool"``: the same convolution without the max-pool (output stride 16), for small views such as
  96 px, where stride 32 leaves a conv5 map too small for border removal and local averaging.
* ``"cifar"``: a 3x3 stride-1 convolution and no max-pool (output stride 8), for 32-64 px images. Its
  ``conv1.weight`` has shape ``[64, 3, 3, 3]``; a torchvision model needs the same ``conv1`` to load it.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torchvision
from torch import Tensor, nn

from obow.checks import check_choice

ARCHITECTURES = (
    "resnet18",
    "resnet34",
    "resnet50",
    "resnet101",
    "resnet152",
    "resnext50_32x4d",
    "wide_resnet50_2",
)
STEMS = ("torchvision", "no_maxpool", "cifar")
SOURCES = ("timm", "torchvision")
#: Paper level names, last stage first.
LEVELS = ("conv5", "conv4", "conv3", "conv2")
#: Paper level names (ResNet convention conv2..conv5) and the torchvision stage that produces each.
LEVEL_TO_STAGE = {"conv2": "layer1", "conv3": "layer2", "conv4": "layer3", "conv5": "layer4"}


@dataclass
class BackboneOutput:
    """What one backbone pass returns: the pooled vector and the requested feature maps."""

    pool5: Tensor
    maps: dict[str, Tensor]


class Backbone(nn.Module):
    """What every backbone is (:func:`build_backbone`): ``forward(x, levels)`` returns a :class:`BackboneOutput`;
    ``level_channels`` the channels of each level's map, ``num_features`` those of ``pool5``."""

    arch: str
    stem: str
    level_channels: dict[str, int]
    num_features: int

    def maps(self, x: Tensor, levels: tuple[str, ...]) -> dict[str, Tensor]:
        """The ``levels``' feature maps alone, computed no deeper than the deepest of them (OBoW's teacher needs
        ``conv4`` alone in a one-level recipe: ``conv5`` is a quarter of a ResNet's forward pass). Equal to
        ``forward(x, levels).maps``; this default runs the whole trunk, the backbones that can stop early do."""
        return self(x, levels).maps


class ResNetBackbone(Backbone):
    """A torchvision ResNet (random initialisation) that returns ``pool5`` and named feature maps.

    Args:
        arch: one of :data:`ARCHITECTURES`.
        stem: one of :data:`STEMS` (see the module docstring).
    """

    def __init__(self, arch: str = "resnet18", stem: str = "torchvision") -> None:
        super().__init__()
        check_choice("arch", arch, ARCHITECTURES)
        check_choice("stem", stem, STEMS)
        self.arch = arch
        self.stem = stem
        net = torchvision.models.get_model(arch, weights=None)
        if stem == "cifar":
            net.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
            nn.init.kaiming_normal_(net.conv1.weight, mode="fan_out", nonlinearity="relu")
        if stem in ("cifar", "no_maxpool"):
            net.maxpool = nn.Identity()
        self.conv1, self.bn1, self.relu, self.maxpool = net.conv1, net.bn1, net.relu, net.maxpool
        self.layer1, self.layer2, self.layer3, self.layer4 = net.layer1, net.layer2, net.layer3, net.layer4
        self.num_features: int = net.fc.in_features
        self.level_channels: dict[str, int] = {
            level: _stage_out_channels(getattr(self, stage)) for level, stage in LEVEL_TO_STAGE.items()
        }

    def forward(self, x: Tensor, levels: tuple[str, ...] = ()) -> BackboneOutput:
        """Run the trunk; ``levels`` names the maps to return (e.g. ``("conv4", "conv5")``)."""
        for level in levels:
            check_choice("level", level, tuple(LEVEL_TO_STAGE))
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        maps: dict[str, Tensor] = {}
        for level, stage in LEVEL_TO_STAGE.items():
            x = getattr(self, stage)(x)
            if level in levels:
                maps[level] = x
        return BackboneOutput(pool5=torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1), maps=maps)

    def maps(self, x: Tensor, levels: tuple[str, ...]) -> dict[str, Tensor]:
        """See :meth:`Backbone.maps`: the stages after the deepest of ``levels`` are not run."""
        for level in levels:
            check_choice("level", level, tuple(LEVEL_TO_STAGE))
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        maps: dict[str, Tensor] = {}
        for level, stage in LEVEL_TO_STAGE.items():
            if len(maps) == len(set(levels)):
                break
            x = getattr(self, stage)(x)
            if level in levels:
                maps[level] = x
        return {level: maps[level] for level in levels}

    def feature_map_size(self, input_size: int, level: str) -> int:
        """Side of the ``level`` map for a square ``input_size`` input (see :func:`feature_map_size`)."""
        return feature_map_size(input_size, level, self.stem)


def _stage_out_channels(stage: nn.Module) -> int:
    return [m for m in stage.modules() if isinstance(m, nn.BatchNorm2d)][-1].num_features


def _halve(n: int) -> int:
    # Every stride-2 layer of a ResNet (7x7 pad 3, 3x3 pad 1, 3x3 max-pool pad 1) maps n to floor((n-1)/2)+1.
    return (n - 1) // 2 + 1


def feature_map_size(input_size: int, level: str, stem: str = "torchvision") -> int:
    """Spatial side of a ResNet feature map, computed from the strides (no forward pass).

    Used to reject recipes whose BoW levels would be too small after border removal.
    """
    check_choice("level", level, tuple(LEVEL_TO_STAGE))
    check_choice("stem", stem, STEMS)
    if input_size < 1:
        raise ValueError(f"input_size must be a positive number of pixels, got {input_size}")
    n = input_size
    if stem != "cifar":
        n = _halve(n)
    if stem == "torchvision":
        n = _halve(n)
    for _ in range(int(level[-1]) - 2):  # conv3, conv4 and conv5 each halve once more
        n = _halve(n)
    return n


def parse_arch(arch: str, key: str = "arch") -> tuple[str, str]:
    """``"resnet18"`` -> ``("resnet", "resnet18")``; ``"timm:resnet10t"`` -> ``("timm", "resnet10t")``;
    ``"torchvision:mobilenet_v3_small"`` -> ``("torchvision", "mobilenet_v3_small")``."""
    if not isinstance(arch, str) or not arch:
        raise ValueError(f"arch must be a model name, got {arch!r}")
    source, sep, name = arch.partition(":")
    if not sep and arch in ARCHITECTURES:
        return "resnet", arch
    if not sep or source not in SOURCES or not name:
        raise ValueError(
            f"{key}={arch!r} is not understood: use a torchvision ResNet name ({', '.join(ARCHITECTURES)}), "
            "timm:<name> (any timm model with features_only, e.g. timm:resnet18) or torchvision:<name> (any "
            f"torchvision classification model, e.g. torchvision:mobilenet_v3_small){_prefix_hint(arch, sep)}"
        )
    return source, name


def _prefix_hint(arch: str, prefixed: str) -> str:
    """``"; did you mean timm:NAME?"`` when an unprefixed ``arch`` is a timm or torchvision model name."""
    if prefixed:
        return ""
    import timm

    found = [f"timm:{arch}"] if timm.is_model(arch) else []
    if arch in torchvision.models.list_models(module=torchvision.models):
        found.append(f"torchvision:{arch}")
    return f"; did you mean {' or '.join(found)}?" if found else ""


def build_backbone(arch: str, stem: str = "torchvision", options: Mapping[str, Any] | None = None) -> Backbone:
    """The backbone ``model.arch`` names (see the module docstring), randomly initialised.

    ``options`` are keyword arguments for the model's constructor (timm or torchvision), e.g.
    ``{"channels": [32, 64, 128, 256], "stem_width": 32}`` for a narrow timm ResNet.
    """
    source, name = parse_arch(arch)
    check_choice("stem", stem, STEMS)
    if source == "resnet":
        if options:
            raise ValueError(f"model.arch_options are for timm: and torchvision: models, not the plain {arch}")
        return ResNetBackbone(name, stem)
    if source == "timm":
        return TimmBackbone(name, stem, options)
    return TorchvisionBackbone(name, stem, options)


@functools.lru_cache(maxsize=64)
def _level_sizes(arch: str, stem: str, options: tuple, input_size: int) -> dict[str, int]:
    with torch.random.fork_rng(devices=[]):
        backbone = build_backbone(arch, stem, dict(options)).eval()
    with torch.no_grad():
        maps = backbone(torch.zeros(1, 3, input_size, input_size), levels=tuple(backbone.level_channels)).maps
    return {level: m.shape[-1] for level, m in maps.items()}


def level_map_size(
    arch: str, input_size: int, level: str, stem: str = "torchvision", options: Mapping[str, Any] | None = None
) -> int:
    """Side of the ``level`` map of ``arch`` for a square ``input_size`` input.

    ResNets: computed from the strides (:func:`feature_map_size`); other networks: from one forward pass of
    a zero image (cached), since their stems and strides vary.
    """
    source, _ = parse_arch(arch)
    if source == "resnet":
        return feature_map_size(input_size, level, stem)
    sizes = _level_sizes(arch, stem, tuple(sorted((k, _hashable(v)) for k, v in (options or {}).items())), input_size)
    if level not in sizes:
        raise ValueError(f"{arch} has no level {level!r}; its levels are {', '.join(sorted(sizes))}")
    return sizes[level]


def _hashable(value: Any) -> Any:
    return tuple(_hashable(v) for v in value) if isinstance(value, (list, tuple)) else value


def _plain_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    # YAML gives lists; timm and torchvision constructors expect tuples for per-stage settings.
    return {k: tuple(v) if isinstance(v, list) else v for k, v in (options or {}).items()}


class _StagedBackbone(Backbone):
    """Shared part of the timm and torchvision wrappers: ``self.body(x)`` returns the stage maps in order."""

    options: dict[str, Any]
    body: nn.Module

    def _stage_maps(self, x: Tensor) -> list[Tensor]:
        raise NotImplementedError

    def forward(self, x: Tensor, levels: tuple[str, ...] = ()) -> BackboneOutput:
        """Run the trunk; ``levels`` names the maps to return (e.g. ``("conv4", "conv5")``)."""
        for level in levels:
            check_choice("level", level, tuple(self.level_channels))
        stages = self._stage_maps(x)
        maps = {level: stages[self.level_index[level]] for level in levels}
        return BackboneOutput(pool5=torch.flatten(nn.functional.adaptive_avg_pool2d(stages[-1], 1), 1), maps=maps)

    def _set_levels(self, channels: list[int]) -> None:
        if len(channels) < 2:
            raise ValueError(
                f"{self.arch} exposes {len(channels)} feature stage(s); OBoW needs at least conv4 and conv5"
            )
        n = len(channels)
        self.level_index = {level: n - 1 - i for i, level in enumerate(LEVELS) if n - 1 - i >= 0}
        self.level_channels = {level: channels[i] for level, i in sorted(self.level_index.items())}
        self.num_features = channels[-1]

    def feature_map_size(self, input_size: int, level: str) -> int:
        return level_map_size(self.arch, input_size, level, self.stem, self.options)

    def export_state_dict(self) -> dict[str, Tensor]:
        """The weights under the original model's parameter names (without the wrapper's ``body.`` prefix)."""
        return {k: v.detach().cpu().clone() for k, v in self.body.state_dict().items()}

    def load_export_state_dict(self, state: Mapping[str, Tensor]) -> list[str]:
        """Load weights named as the original model's (extra entries, e.g. a classifier, are ignored and
        returned); every backbone weight must be there with its shape."""
        own = self.body.state_dict()
        missing = [k for k in own if k not in state]
        reshaped = [k for k in own if k in state and state[k].shape != own[k].shape]
        if missing or reshaped:
            k = (missing or reshaped)[0]
            raise ValueError(
                f"the weights do not fit {self.arch}: {len(missing)} missing and {len(reshaped)} reshaped keys "
                f"(e.g. {k})"
            )
        self.body.load_state_dict({k: state[k] for k in own}, strict=True)
        return [k for k in state if k not in own]


class TimmBackbone(_StagedBackbone):
    """Any timm model that supports ``features_only``; ``conv5`` is its last feature stage.

    Stems: ``"torchvision"`` keeps the model's own stem; ``"no_maxpool"`` drops the stem's max-pool (timm
    ResNets and their relatives); ``"cifar"`` also gives the stem's first strided convolution stride 1 (its
    weights keep their shape, so exported weights still load into ``timm.create_model(name)``; the reader sets
    the same stride to compute the same features). The wrapper's ``body`` holds timm's modules under timm's
    names.
    """

    def __init__(self, name: str, stem: str = "torchvision", options: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        import timm

        check_choice("stem", stem, STEMS)
        self.arch, self.stem, self.options = f"timm:{name}", stem, dict(options or {})
        try:
            body: Any = timm.create_model(name, pretrained=False, features_only=True, **_plain_options(options))
        except (RuntimeError, TypeError, ValueError) as err:
            raise ValueError(f"model.arch timm:{name}: timm cannot build it with features_only ({err})") from None
        #: the stem's modules that obow changed, by name (``obow.weights.export`` prints the same changes)
        self.stem_edits = _shrink_stem(body, stem, self.arch) if stem != "torchvision" else StemEdits((), None)
        self.body = body
        self._set_levels(list(body.feature_info.channels()))

    def _stage_maps(self, x: Tensor) -> list[Tensor]:
        return list(self.body(x))

    def maps(self, x: Tensor, levels: tuple[str, ...]) -> dict[str, Tensor]:
        """See :meth:`Backbone.maps`: timm's feature network (a dict of its modules, run in order) is run up to
        the module that ends the deepest of ``levels``; a feature network of another kind (hooks) runs whole."""
        from timm.models._features import FeatureDictNet

        body = self.body
        if not isinstance(body, FeatureDictNet) or body.grad_checkpointing or not levels:
            return super().maps(x, levels)
        for level in levels:
            check_choice("level", level, tuple(self.level_channels))
        names = body.feature_info.module_name()
        wanted = {names[self.level_index[level]]: level for level in levels}
        maps: dict[str, Tensor] = {}
        for name, module in body.items():
            x = module(x)
            if name in wanted:
                maps[wanted[name]] = x
                if len(maps) == len(wanted):
                    break
        return {level: maps[level] for level in levels}

    def full_model(self, seed: int = 0) -> nn.Module:
        """A freshly initialised ``timm.create_model(name, **options)`` (seeded): what an export loads into."""
        import timm

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return timm.create_model(self.arch.partition(":")[2], pretrained=False, **_plain_options(self.options))


@dataclass(frozen=True)
class StemEdits:
    """What :func:`_shrink_stem` changed, by module name: the max-pools made ``nn.Identity()`` and the
    convolution given stride 1 (``None``: none)."""

    pools: tuple[str, ...]
    stride_one: str | None


def _shrink_stem(body: Any, stem: str, arch: str) -> StemEdits:
    """Drop the stem's max-pool and, for ``"cifar"``, the stride of its first strided convolution."""
    stage_names = [info["module"] for info in body.feature_info.info]
    first_stage = stage_names[1] if len(stage_names) > 1 else stage_names[0]
    stem_modules: list[tuple[str, nn.Module]] = []
    for name, module in body.named_modules():
        if name and name.split(".")[0] == first_stage.split(".")[0]:
            break
        stem_modules.append((name, module))
    pools = [n for n, m in stem_modules if isinstance(m, nn.MaxPool2d)]
    if stem == "no_maxpool" and not pools:
        raise ValueError(f"{arch} has no max-pool in its stem: use stem torchvision or cifar")
    for name in pools:
        parent, _, child = name.rpartition(".")
        setattr(body.get_submodule(parent) if parent else body, child, nn.Identity())
    if stem != "cifar":
        return StemEdits(tuple(pools), None)
    convs = [(n, m) for n, m in stem_modules if isinstance(m, nn.Conv2d) and m.stride != (1, 1)]
    if not convs:
        raise ValueError(f"{arch} has no strided convolution in its stem: use stem torchvision")
    convs[0][1].stride = (1, 1)
    return StemEdits(tuple(pools), convs[0][0])


class TorchvisionBackbone(_StagedBackbone):
    """Any torchvision classification model, cut at its stages with ``create_feature_extractor``.

    The stages are found once, by a forward pass of a 224 px zero image: for every output stride, the last
    top-level (or second-level) module whose output has that stride ends a stage. ``conv5`` is the last of
    them (e.g. ``layer4`` of a ResNet, ``features`` of a MobileNet, ``trunk_output`` of a RegNet).
    """

    def __init__(self, name: str, stem: str = "torchvision", options: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        from torchvision.models.feature_extraction import create_feature_extractor

        if stem != "torchvision":
            raise ValueError(f"torchvision:{name} keeps its own stem: model.stem must be torchvision, got {stem!r}")
        self.arch, self.stem, self.options = f"torchvision:{name}", stem, dict(options or {})
        try:
            model = torchvision.models.get_model(name, weights=None, **_plain_options(options))
        except (ValueError, TypeError, KeyError) as err:
            raise ValueError(f"model.arch torchvision:{name}: torchvision cannot build it ({err})") from None
        stages = _find_stages(model)
        self.stage_nodes = [node for node, _ in stages]
        self.body = create_feature_extractor(
            model, return_nodes={node: str(i) for i, node in enumerate(self.stage_nodes)}
        )
        self._set_levels([channels for _, channels in stages])

    def _stage_maps(self, x: Tensor) -> list[Tensor]:
        out = self.body(x)
        return [out[str(i)] for i in range(len(self.stage_nodes))]

    def full_model(self, seed: int = 0) -> nn.Module:
        """A freshly initialised ``torchvision.models.get_model(name, **options)`` (seeded)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return torchvision.models.get_model(
                self.arch.partition(":")[2], weights=None, **_plain_options(self.options)
            )


def _find_stages(model: nn.Module, size: int = 224) -> list[tuple[str, int]]:
    """``(module name, channels)`` of the module ending each output stride, in order of stride."""
    records: list[tuple[str, int, int]] = []
    hooks = []
    for name, module in model.named_modules():
        if name and name.count(".") <= 1:
            hooks.append(
                module.register_forward_hook(
                    lambda m, i, o, name=name: (
                        records.append((name, size // o.shape[-1], o.shape[1]))
                        if isinstance(o, Tensor) and o.dim() == 4 and o.shape[-1] > 1
                        else None
                    )
                )
            )
    was_training = model.training
    try:
        with torch.no_grad():
            model.eval()(torch.zeros(1, 3, size, size))
    finally:
        model.train(was_training)
        for h in hooks:
            h.remove()
    last: dict[int, tuple[str, int]] = {}
    for name, stride, channels in records:
        last[stride] = (name, channels)
    return [last[s] for s in sorted(last)]
