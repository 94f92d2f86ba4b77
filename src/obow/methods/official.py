"""The authors' released checkpoints (valeoai/obow, official notes 6.1 and 6.4) as obow checkpoints: on the floor
of the methods, since a full checkpoint becomes an :class:`~obow.methods.obow.OBoW` model's state.

``obow import-official FILE --out CKPT`` reads one of:

* a full model checkpoint ``{"epoch", "network": state_dict, ...}`` (``model_net_checkpoint_<E>.pth.tar``,
  or the ``*_OBoW_full`` / ``*_vanilla`` releases); keys may carry DDP's ``module.`` prefix;
* a feature-extractor-only file (``feature_extractor_net_checkpoint_<E>.pth.tar``): the student backbone;
* a torchvision-format file (``--convert-to-torchvision``): the student backbone, its ``fc`` (the generated
  weights of the last level, official notes 5.3) dropped;

and writes an obow pretraining checkpoint that ``obow eval``, ``obow export`` and ``obow show`` read. A
backbone-only import holds only the student (``--network teacher`` and ``obow show words`` need a full
model). The import is for evaluation and pictures, not for resuming training: it has no optimiser state.

Official names and how they map (official notes 2.5-2.7, 6.1):

======================================================  ===============================================
official                                                obow
======================================================  ===============================================
``feature_extractor._feature_blocks.0.0.*``             ``student.conv1.*``
``feature_extractor._feature_blocks.0.1.*``             ``student.bn1.*``
``feature_extractor._feature_blocks.N.*`` (N = 1..4)    ``student.layerN.*`` (torchvision block names)
``feature_extractor_teacher.*``                         ``teacher.*`` (the same renaming)
``bow_extractor.bow_extractor.<i>._embedding`` [K, C]   ``extractors.<level>.vocabulary.words``
``bow_extractor.bow_extractor.<i>._embedding_ptr``      ``extractors.<level>.vocabulary.ptr``
``bow_extractor.bow_extractor.<i>._min_distance_mean``  ``extractors.<level>.min_distance_mean``
``bow_predictor.layers_w.<i>.<fc>.weight``              ``predictor.generators.<i>.fc1.weight``
``bow_predictor.layers_w.<i>.<bn>.*``                   ``predictor.generators.<i>.bn.*``
``bow_predictor.layers_w.<i>.<last>.*``                 ``predictor.generators.<i>.fc2.*``
``bow_predictor.scale`` [L]                             ``kappa`` of the recipe (must be equal for all levels)
``_iteration``                                          ``iteration`` (the teacher momentum schedule's step)
======================================================  ===============================================

Assumptions, where the released files could not be checked offline: the generator layers are named either by
position in their ``nn.Sequential`` (``1`` Linear without bias, ``2`` BatchNorm1d, ``4`` Linear; ``0``, ``3``
and ``5``, L2 normalisations and a ReLU, hold nothing) or by the names the authors' code gives them
(``b<i>_fc``, ``b<i>_bn``, ``b<i>_last_layer``); both are accepted. The level index ``<i>`` follows the
recipe's level order; its name (``conv4``, ``conv5``) is found from the words' channel count. The
architecture is recognised from the backbone's blocks; the stem is torchvision's. ``delta_base`` is not in
the checkpoint (it is ``inv_delta`` in the authors' YAML): the matching built-in recipe's value is used
(1/15 for ResNet-50, 1/10 for ResNet-18) unless given; the recipe's batch size is cut to a divisor of ``K``
when it is not one (it only matters for training). The monitoring classifier (``linear_classifier.*``),
``_track_num_batches`` and ``_alpha`` are not needed and dropped.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from obow.backbones import ResNetBackbone
from obow.config import Config, from_dict, load_config, to_dict
from obow.methods.obow import OBoW
from obow.weights.checkpoint import FORMAT, build_checkpoint, describe, read_torch_file, save_atomic
from obow.weights.load import guess_architecture

#: The built-in recipe an imported run is described by, per architecture (the authors' own recipes).
RECIPES = {"resnet50": "imagenet_resnet50_full", "resnet18": "imagenet20_resnet18_full"}
_GENERATOR_LAYERS = {"fc1": (r"1", r"b\d+_fc"), "bn": (r"2", r"b\d+_bn"), "fc2": (r"4", r"b\d+_last_layer")}


def backbone_key(key: str) -> str | None:
    """The torchvision name of an official ``_feature_blocks`` key (``None`` for anything else)."""
    match = re.fullmatch(r"_feature_blocks\.(\d+)\.(.+)", key)
    if match is None:
        return None
    block, rest = int(match.group(1)), match.group(2)
    if block == 0:
        layer, _, name = rest.partition(".")
        return {"0": f"conv1.{name}", "1": f"bn1.{name}"}.get(layer)
    return f"layer{block}.{rest}" if block <= 4 else None


def convert_backbone(state: dict[str, Tensor], prefix: str = "") -> dict[str, Tensor]:
    """The backbone weights under ``prefix`` (e.g. ``"feature_extractor."``) with torchvision names."""
    out = {}
    for key, value in state.items():
        if key.startswith(prefix):
            new = backbone_key(key[len(prefix) :])
            if new is not None:
                out[new] = value
    return out


def read_official(path: str | Path) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The ``state_dict`` of an official file (``module.`` stripped) and the rest of the file's dictionary."""
    obj = read_torch_file(path, "official checkpoint", numpy_arrays=True)  # an obow v1 checkpoint is named below
    if not isinstance(obj, dict) or obj.get("format") == FORMAT:
        raise ValueError(f"{str(path)!r} is not an official OBoW checkpoint: {describe(obj)}")
    state = obj.get("network", obj)
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        entry = "'network' entry" if "network" in obj else "content"
        raise ValueError(
            f"{str(path)!r} is not an official OBoW checkpoint: its {entry} is not a state_dict (names to tensors); "
            f"{describe(obj)}"
        )
    state = {k.removeprefix("module."): v for k, v in state.items()}
    return state, {k: v for k, v in obj.items() if k != "network"}


def _generator_state(state: dict[str, Tensor], index: int) -> dict[str, Tensor]:
    prefix = f"bow_predictor.layers_w.{index}."
    out = {}
    for key, value in state.items():
        if not key.startswith(prefix):
            continue
        layer, _, name = key[len(prefix) :].partition(".")
        for ours, patterns in _GENERATOR_LAYERS.items():
            if any(re.fullmatch(p, layer) for p in patterns):
                out[f"predictor.generators.{index}.{ours}.{name}"] = value
    return out


def _levels(state: dict[str, Tensor], backbone: ResNetBackbone) -> list[tuple[int, str]]:
    """``(official index, obow level)`` of every BoW level, from the words' channel counts."""
    by_channels = {c: level for level, c in backbone.level_channels.items()}
    found = sorted(
        int(m.group(1)) for k in state if (m := re.fullmatch(r"bow_extractor\.bow_extractor\.(\d+)\._embedding", k))
    )
    levels = []
    for i in found:
        channels = state[f"bow_extractor.bow_extractor.{i}._embedding"].shape[1]
        if channels not in by_channels:
            raise ValueError(
                f"BoW level {i} has {channels}-dimensional words, which no level of a {backbone.arch} produces "
                f"({', '.join(f'{lv}: {c}' for lv, c in backbone.level_channels.items())})"
            )
        levels.append((i, by_channels[channels]))
    return levels


def import_official(
    path: str | Path, out: str | Path, *, arch: str | None = None, delta_base: float | None = None
) -> dict[str, Any]:
    """Convert the official file ``path`` into the obow checkpoint ``out``; returns a summary
    (``kind``: ``"full"`` or ``"backbone"``, ``arch``, ``levels``, ``num_words``, ``kappa``, ``epoch``)."""
    state, extra = read_official(path)
    student = convert_backbone(state, "feature_extractor.")
    kind = "full"
    if not student:  # a feature-extractor-only file, or a torchvision-format one
        student = convert_backbone(state) or {k: v for k, v in state.items() if not k.startswith("fc.")}
        kind = "backbone"
    found_arch, _ = guess_architecture(student)
    arch = arch or found_arch
    if arch is None or "conv1.weight" not in student:
        raise ValueError(
            f"{str(path)!r} does not look like an official OBoW checkpoint: no ResNet backbone under "
            "'feature_extractor._feature_blocks', '_feature_blocks' or torchvision names"
        )
    backbone = ResNetBackbone(arch, "torchvision")
    recipe = RECIPES.get(arch)
    cfg = load_config(recipe, [f"model.arch={arch}", "model.stem=torchvision"])
    epoch = extra.get("epoch")
    summary: dict[str, Any] = {"kind": kind, "arch": arch, "epoch": epoch}
    if kind == "backbone":
        model_state = {f"student.{k}": v for k, v in student.items()}
        _check_backbone(backbone, student, path)
        iteration = 0
    else:
        levels = _levels(state, backbone)
        if not levels:
            raise ValueError(f"{str(path)!r} holds a student but no 'bow_extractor.bow_extractor.<i>._embedding'")
        embeddings = [state[f"bow_extractor.bow_extractor.{i}._embedding"] for i, _ in levels]
        sizes = {e.shape[0] for e in embeddings}
        scale = state["bow_predictor.scale"].flatten().tolist()
        if len(sizes) != 1 or len(set(scale)) != 1:
            raise ValueError(
                f"{str(path)!r}: obow uses one vocabulary size and one kappa for all levels; found sizes "
                f"{sorted(sizes)} and kappa {scale}"
            )
        raw = to_dict(cfg)
        num_words = sizes.pop()
        raw["model"].update(levels=[lv for _, lv in levels], num_words=num_words, kappa=scale[0])
        # the recipe's batch must divide K (a queue rule); it only matters for training, which an import is not for
        raw["data"]["batch_size"] = math.gcd(num_words, raw["data"]["batch_size"])
        if delta_base is not None:
            raw["model"]["delta_base"] = delta_base
        cfg = from_dict(Config, raw)
        iteration = int(state["_iteration"].flatten()[0]) if "_iteration" in state else 0
        model = OBoW.from_config(cfg.model, total_iterations=max(1, iteration))
        model_state = {f"student.{k}": v for k, v in student.items()}
        model_state.update(
            {f"teacher.{k}": v for k, v in convert_backbone(state, "feature_extractor_teacher.").items()}
        )
        for i, level in levels:
            official = f"bow_extractor.bow_extractor.{i}."
            model_state[f"extractors.{level}.vocabulary.words"] = state[f"{official}_embedding"]
            model_state[f"extractors.{level}.vocabulary.ptr"] = state[f"{official}_embedding_ptr"].reshape(()).long()
            model_state[f"extractors.{level}.min_distance_mean"] = state[f"{official}_min_distance_mean"].reshape(())
            model_state.update(_generator_state(state, i))
        model_state["iteration"] = torch.tensor(iteration)
        _load_strict(model, model_state, path)
        model_state = model.state_dict()
        summary.update(levels=list(cfg.model.levels), num_words=cfg.model.num_words, kappa=cfg.model.kappa)
    ckpt = build_checkpoint(to_dict(cfg), model_state, epoch=epoch, iteration=iteration, imported_from=str(path))
    save_atomic(ckpt, out)
    return summary


def _check_backbone(backbone: ResNetBackbone, weights: dict[str, Tensor], path: str | Path) -> None:
    from obow.weights.load import load_weights

    load_weights(backbone, weights, f"official file {str(path)!r}")


def _load_strict(model: torch.nn.Module, state: dict[str, Tensor], path: str | Path) -> None:
    expected = model.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    if missing or unexpected:
        raise ValueError(
            f"{str(path)!r} does not map onto an obow model: {len(missing)} missing entries "
            f"{missing[:3]}, {len(unexpected)} unexpected {unexpected[:3]}; the official names are listed in "
            "obow.methods.official's docstring"
        )
    model.load_state_dict(state, strict=True)
