"""Backbone weights, from wherever they come: the layer below both training and evaluation.

A backbone comes from one of three sources:

* a pretraining checkpoint (``obow pretrain``): the ``student.*`` or ``teacher.*`` entries of the OBoW
  ``state_dict``, loaded with ``strict=True`` (the official code loads with ``strict=False`` and an ignored
  message, official notes 5.1, so a key mismatch went unnoticed there);
* a file written by ``obow export`` (``--format torchvision`` or ``timm``; its ``.json`` sidecar names the
  architecture, options and stem, and so does the header of a ``.safetensors`` export, which is read first), or
  any torchvision ResNet ``state_dict`` (``torch.save`` or safetensors). Without the sidecar the network is
  recognised from the weights (:func:`recognise_weights`): a torchvision ResNet, or a timm ResNet (plain, ``d``,
  ``t`` ...) at any widths, whose ``model.arch_options`` (``channels``, ``stem_width``) are read from the shapes;
  a stem the weights cannot show (a timm stem, ``no_maxpool``) comes from ``--stem``;
* a random initialisation (seeded), the baseline every number should be compared with.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from obow.backbones import (
    STEMS,
    Backbone,
    ResNetBackbone,
    TimmBackbone,
    TorchvisionBackbone,
    build_backbone,
    parse_arch,
)
from obow.checks import check_choice
from obow.config import Config, from_dict
from obow.data.eval_sets import views_dict
from obow.notices import ObowWarning
from obow.weights.checkpoint import describe, load_checkpoint, read_torch_file

NETWORKS = ("student", "teacher")
#: A backbone file named so is read (and written by ``obow export``) as safetensors, any other with torch.
SAFETENSORS_SUFFIX = ".safetensors"
#: The safetensors header entry that holds ``obow export``'s metadata (the sidecar's JSON).
SAFETENSORS_META_KEY = "obow"


def load_backbone(
    checkpoint: str | Path | None = None,
    *,
    network: str = "student",
    backbone_file: str | Path | None = None,
    random_init: bool = False,
    arch: str | None = None,
    stem: str | None = None,
    seed: int = 0,
    arch_options: dict[str, Any] | None = None,
) -> tuple[Backbone, dict[str, Any]]:
    """A :class:`~obow.backbones.ResNetBackbone` and a description of where its weights came from.

    Give a pretraining ``checkpoint`` (``network`` picks the student or the EMA teacher), or an exported
    ``backbone_file``, or ``random_init=True`` (seeded by ``seed``; the architecture comes from ``checkpoint``'s
    recipe, or from what ``backbone_file`` is read as, when one is given, else from ``arch`` and ``stem``).
    ``arch`` and ``stem``, when given with a file, are the architecture the caller expects: a file holding
    another raises ``ValueError`` naming both.

    The description holds ``kind`` (``"checkpoint"``, ``"exported"`` or ``"random_init"``), ``path``,
    ``network``, ``epoch``, ``iteration``, ``arch``, ``stem``, ``seed`` (random init) and ``views``: the
    recipe's ``teacher_resize``, ``teacher_size``, ``mean`` and ``std`` (``None`` when unknown).
    """
    check_choice("network", network, NETWORKS)
    if stem is not None:
        check_choice("stem", stem, STEMS)
    if checkpoint is not None and backbone_file is not None:
        raise ValueError("give either a pretraining checkpoint or an exported backbone file, not both")
    if checkpoint is None and backbone_file is None and not random_init:
        raise ValueError("nothing to evaluate: give a checkpoint, an exported backbone file or random_init=True")

    if checkpoint is not None:
        ckpt = load_checkpoint(checkpoint)
        cfg = from_dict(Config, ckpt["config"])
        what = f"checkpoint {str(checkpoint)!r}"
        _check_expected(arch, stem, cfg.model.arch, cfg.model.stem, what)
        info: dict[str, Any] = {
            "path": str(checkpoint),
            "arch": cfg.model.arch,
            "stem": cfg.model.stem,
            "arch_options": dict(cfg.model.arch_options),
            "views": views_dict(cfg.views),
        }
        if random_init:
            backbone = _random_backbone(cfg.model.arch, cfg.model.stem, seed, cfg.model.arch_options)
            return backbone, {**info, **_random_info(seed)}
        backbone = build_backbone(cfg.model.arch, cfg.model.stem, cfg.model.arch_options)
        load_weights(backbone, network_state(ckpt["model"], network, what), f"{what} ({network})")
        info.update(kind="checkpoint", network=network, epoch=ckpt.get("epoch"), iteration=ckpt.get("iteration"))
        return backbone, info

    if backbone_file is not None:
        backbone, info = _load_exported(Path(backbone_file), arch, stem)
        if random_init:  # the file's network afresh, as a checkpoint's: its seed alone fixes the weights
            backbone = _random_backbone(info["arch"], info["stem"], seed, info["arch_options"])
            return backbone, {**info, **_random_info(seed)}
        return backbone, info

    if arch is None:
        raise ValueError("a random initialisation without a checkpoint needs an architecture: give arch (--arch)")
    stem = stem or "torchvision"
    info = {"path": None, "arch": arch, "stem": stem, "arch_options": dict(arch_options or {}), "views": None}
    return _random_backbone(arch, stem, seed, arch_options), {**info, **_random_info(seed)}


def network_state(model_state: dict[str, Tensor], network: str, what: str = "the checkpoint") -> dict[str, Tensor]:
    """The ``student.*`` or ``teacher.*`` entries of an OBoW ``state_dict``, prefix stripped."""
    check_choice("network", network, NETWORKS)
    prefix = f"{network}."
    state = {k[len(prefix) :]: v for k, v in model_state.items() if k.startswith(prefix)}
    if not state:
        raise ValueError(f"{what} holds no {network!r} weights (no keys starting with {prefix!r})")
    return state


def _random_info(seed: int) -> dict[str, Any]:
    return {"kind": "random_init", "network": None, "epoch": None, "iteration": None, "seed": seed}


def _random_backbone(arch: str, stem: str, seed: int, options: dict[str, Any] | None = None) -> Backbone:
    # fork_rng: the seed fixes this network without reseeding the caller's generator
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build_backbone(arch, stem, options)


def _check_expected(arch: str | None, stem: str | None, found_arch: str, found_stem: str, what: str) -> None:
    if arch is not None and arch != found_arch:
        raise ValueError(
            f"{what} holds a {found_arch} backbone ({found_stem} stem), but {arch} was requested (--arch); "
            f"drop --arch or give a {arch} checkpoint"
        )
    if stem is not None and stem != found_stem:
        raise ValueError(
            f"{what} holds a backbone with the {found_stem} stem ({found_arch}), but the {stem} stem was requested "
            "(--stem); drop --stem or give a matching checkpoint"
        )


def _load_exported(path: Path, arch: str | None, stem: str | None) -> tuple[Backbone, dict[str, Any]]:
    """Read an ``obow export`` file (``--format torchvision`` or ``timm``, ``torch.save`` or safetensors), or a
    torchvision ResNet ``state_dict``."""
    state, meta = read_backbone_file(path)
    what = f"backbone file {str(path)!r}"
    meta_path = Path(f"{path}.json")
    if meta is None and meta_path.is_file():
        meta = json.loads(meta_path.read_text())
    if meta is None:
        return _load_without_sidecar(path, state, arch, stem)
    if meta.get("arch") and parse_arch(meta["arch"])[0] != "resnet":
        found_arch, found_stem = meta["arch"], meta.get("stem", "torchvision")
        _check_expected(arch, stem, found_arch, found_stem, what)
        backbone = build_backbone(found_arch, found_stem, meta.get("arch_options"))
        assert isinstance(backbone, (TimmBackbone, TorchvisionBackbone))  # not a plain resnet (above)
        backbone.load_export_state_dict(state)
        keys = ("network", "epoch", "iteration", "views", "arch_options")
        return backbone, {"kind": "exported", "path": str(path), "arch": found_arch, "stem": found_stem} | {
            k: meta.get(k) for k in keys
        }
    state = {k: v for k, v in state.items() if not k.startswith("fc.")}
    guessed_arch, guessed_stem = guess_architecture(state)
    found_arch = meta.get("arch") or guessed_arch
    found_stem = meta.get("stem") or guessed_stem or "torchvision"
    if found_arch is None:
        if arch is None:
            raise ValueError(
                f"{what}: its sidecar names no architecture and the weights are not recognised: give --arch"
            )
        found_arch = arch
    _check_expected(arch, stem, found_arch, found_stem, what)
    backbone = ResNetBackbone(found_arch, found_stem)
    load_weights(backbone, state, what)
    return backbone, _exported_info(path, found_arch, found_stem, {}, meta)


def read_backbone_file(path: str | Path) -> tuple[dict[str, Tensor], dict[str, Any] | None]:
    """The ``state_dict`` in an exported backbone file, and the metadata ``obow export`` put in its header
    (safetensors files only; ``None`` for others, whose metadata is the ``.json`` sidecar). A name ending in
    ``.safetensors`` is read as safetensors, any other with ``torch.load``; a file that cannot be read, or holds
    something else than tensors, raises a one-line ``ValueError``."""
    path = Path(path)
    if path.suffix == SAFETENSORS_SUFFIX:
        return _read_safetensors(path)
    try:
        state = read_torch_file(path, "backbone file")
    except ValueError as err:
        raise ValueError(
            f"{err}; give a file written by obow export --format torchvision or timm (a detectron2 export is for "
            "Detectron2 only)"
        ) from None
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise ValueError(
            f"backbone file {str(path)!r} does not hold a state_dict (a mapping of names to tensors): {describe(state)}"
        )
    return state, None


def _read_safetensors(path: Path) -> tuple[dict[str, Tensor], dict[str, Any] | None]:
    import safetensors

    if not path.is_file():
        raise ValueError(f"backbone file {str(path)!r} does not exist")
    try:
        with safetensors.safe_open(path, framework="pt", device="cpu") as f:
            header = f.metadata() or {}
            state = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as err:  # noqa: BLE001 - safetensors' own error, or the OSError of the read: one line
        if path.stat().st_size == 0:
            why = "the file is empty"
        elif isinstance(err, OSError):
            why = err.strerror or str(err)
        else:
            detail = str(err).splitlines()[0].removeprefix("Error while deserializing header: ")
            why = f"it is not a safetensors file, or it is damaged or cut short ({detail})"
        raise ValueError(f"cannot read backbone file {str(path)!r}: {why}") from None
    text = header.get(SAFETENSORS_META_KEY)
    if text is None:  # safetensors from elsewhere (a Hugging Face download): the sidecar, or the weights, tell
        return state, None
    try:
        meta = json.loads(text)
    except json.JSONDecodeError:
        meta = None
    if not isinstance(meta, dict):
        raise ValueError(
            f"backbone file {str(path)!r}: its header's {SAFETENSORS_META_KEY!r} entry is not the JSON object "
            "obow export writes"
        )
    return state, meta


def _exported_info(path: Path, arch: str, stem: str, options: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    return {
        "kind": "exported",
        "path": str(path),
        "network": meta.get("network"),
        "epoch": meta.get("epoch"),
        "iteration": meta.get("iteration"),
        "arch": arch,
        "stem": stem,
        "arch_options": options,
        "views": meta.get("views"),
    }


def _load_without_sidecar(
    path: Path, state: dict[str, Tensor], arch: str | None, stem: str | None
) -> tuple[Backbone, dict[str, Any]]:
    """An export whose ``.json`` sidecar is missing: the network recognised from its weights
    (:func:`recognise_weights`), or built from ``--arch`` / ``--stem``; a warning says what was assumed."""
    what, sidecar = f"backbone file {str(path)!r}", f"{path.name}.json"
    found = recognise_weights(state)
    if found is None and arch is None:
        raise ValueError(
            f"{what} has no {sidecar} sidecar and its network is not recognised from its weights (neither a "
            "torchvision nor a timm ResNet layout): put back the sidecar obow export wrote beside it, or give the "
            "network it was trained with: --arch (resnet18 ..., timm:NAME or torchvision:NAME) and --stem"
        )
    if found is None:  # --arch names a network the weights are not recognised as: try it, and say what failed
        assert arch is not None  # refused above without either
        return _load_as_given(path, state, arch, stem or "torchvision")
    found_stem = found.stem or stem or "torchvision"
    _check_expected(arch, stem, found.arch, found_stem, what)
    if found.stem is None and stem is None:
        stem_text = (
            "its stem cannot be told from the weights (torchvision, no_maxpool"
            + (" or cifar" if parse_arch(found.arch)[0] == "timm" else "")
            + "): taken as torchvision; give --stem if it was trained with another (its recipe's model.stem)"
        )
    else:
        stem_text = f"{found_stem} stem"
    warnings.warn(
        f"{what} has no {sidecar} sidecar: recognised from its weights as {found.describe()}; {stem_text}; it has "
        "no recipe, so the evaluation view is chosen from the images",
        ObowWarning,
        stacklevel=4,
    )
    backbone = _build_loaded(found.arch, found_stem, found.options, state, what)
    return backbone, _exported_info(path, found.arch, found_stem, dict(found.options), {})


def _load_as_given(path: Path, state: dict[str, Tensor], arch: str, stem: str) -> tuple[Backbone, dict[str, Any]]:
    what = f"backbone file {str(path)!r}"
    try:
        backbone = _build_loaded(arch, stem, {}, state, what)
    except ValueError as err:
        raise ValueError(
            f"{err}; a network built with model.arch_options (e.g. other channels) needs the {path.name}.json "
            "sidecar obow export wrote beside it"
        ) from None
    warnings.warn(
        f"{what} has no {path.name}.json sidecar: loaded as --arch {arch} (--stem {stem}); it has no recipe, so "
        "the evaluation view is chosen from the images",
        ObowWarning,
        stacklevel=4,
    )
    return backbone, _exported_info(path, arch, stem, {}, {})


def _build_loaded(arch: str, stem: str, options: dict[str, Any], state: dict[str, Tensor], what: str) -> Backbone:
    """``arch`` with ``stem`` and ``options``, holding ``state``; a ``ValueError`` naming ``what`` if it does not
    fit."""
    if parse_arch(arch)[0] == "resnet":
        resnet = ResNetBackbone(arch, stem)
        load_weights(resnet, {k: v for k, v in state.items() if not k.startswith("fc.")}, what)
        return resnet
    backbone = build_backbone(arch, stem, options)
    assert isinstance(backbone, (TimmBackbone, TorchvisionBackbone))  # not a plain resnet (above)
    try:
        backbone.load_export_state_dict(state)
    except ValueError as err:
        raise ValueError(f"the weights in {what} {str(err).removeprefix('the weights ')}") from None
    return backbone


@dataclass(frozen=True)
class Recognised:
    """What a backbone ``state_dict`` is (:func:`recognise_weights`): ``model.arch``, ``model.arch_options`` and
    the stem when the weights show it (a 3x3 ``conv1``: the CIFAR stem), else ``None``."""

    arch: str
    options: dict[str, Any]
    stem: str | None

    def describe(self) -> str:
        text = self.arch
        if self.options:
            text += " with model.arch_options " + ", ".join(f"{k}={v}" for k, v in self.options.items())
        return text + (f" ({self.stem} stem)" if self.stem else "")


#: timm ResNets by blocks per stage and block type (``True``: bottleneck), tried in order; the letters are stems
#: (``d``: deep, average-pool shortcut; ``t``: tiered deep; ``c``: deep; ``s``: wide deep).
TIMM_RESNETS: dict[tuple[tuple[int, ...], bool], tuple[str, ...]] = {
    ((1, 1, 1, 1), False): ("resnet10t",),
    ((1, 1, 1, 1), True): ("resnet14t",),
    ((2, 2, 2, 2), False): ("resnet18", "resnet18d"),
    ((2, 2, 2, 2), True): ("resnet26", "resnet26d", "resnet26t"),
    ((3, 4, 6, 3), False): ("resnet34", "resnet34d"),
    ((3, 4, 6, 3), True): ("resnet50", "resnet50d", "resnet50c", "resnet50s", "resnet50t"),
    ((3, 4, 23, 3), True): ("resnet101", "resnet101d", "resnet101c", "resnet101s"),
    ((3, 8, 36, 3), True): ("resnet152", "resnet152d", "resnet152c", "resnet152s"),
}


def recognise_weights(state: dict[str, Tensor]) -> Recognised | None:
    """The network a backbone ``state_dict`` holds, from its names and shapes alone (``None`` when unknown): a
    torchvision ResNet of :data:`~obow.backbones.ARCHITECTURES` (the CIFAR stem recognised by its 3x3 ``conv1``),
    else a timm ResNet of :data:`TIMM_RESNETS`, with the ``channels``, ``stem_width`` and ``stem_type`` options its
    widths and stem need. (A timm ResNet at torchvision's widths is a torchvision one: same names, shapes and
    computation.)"""
    state = {k: v for k, v in state.items() if not k.startswith("fc.")}
    arch, stem = guess_architecture(state)
    if arch is not None:
        with torch.device("meta"):
            expected = ResNetBackbone(arch, stem or "torchvision").state_dict()
        if _same_shapes(expected, state):
            return Recognised(arch, {}, "cifar" if stem == "cifar" else None)
    return _recognise_timm_resnet(state)


def _recognise_timm_resnet(state: dict[str, Tensor]) -> Recognised | None:
    stages = [f"layer{i}.0.conv1.weight" for i in range(1, 5)]
    stem_conv = "conv1.weight" if "conv1.weight" in state else "conv1.3.weight"
    if not all(k in state for k in (*stages, stem_conv)):
        return None
    blocks = tuple(len({k.split(".")[1] for k in state if k.startswith(f"layer{i}.")}) for i in range(1, 5))
    names = TIMM_RESNETS.get((blocks, "layer1.0.conv3.weight" in state), ())
    channels = {"channels": [int(state[k].shape[0]) for k in stages]}
    # the fewest options that fit (timm's single-convolution stem ignores stem_width: always 64 channels); a
    # three-convolution stem on a plain name is stem_type deep (its two first widths equal) or deep_tiered
    tries: tuple[dict[str, Any], ...] = ({}, channels, {**channels, "stem_width": int(state[stem_conv].shape[0])})
    if stem_conv == "conv1.3.weight":
        kind = "deep" if state["conv1.0.weight"].shape[0] == state[stem_conv].shape[0] else "deep_tiered"
        tries = (*tries, {**tries[-1], "stem_type": kind})
    for name in names:
        for options in tries:
            try:
                with torch.device("meta"):
                    expected = TimmBackbone(name, "torchvision", options).body.state_dict()
            except ValueError:
                continue
            if _same_shapes(expected, state):
                return Recognised(f"timm:{name}", options, None)
    return None


def _same_shapes(expected: dict[str, Tensor], state: dict[str, Tensor]) -> bool:
    return expected.keys() == state.keys() and all(state[k].shape == v.shape for k, v in expected.items())


#: Blocks per stage and block type of each torchvision ResNet (``layer1.0.conv2`` tells the Bottleneck kinds apart).
_SIGNATURES: dict[tuple[tuple[int, ...], tuple[int, ...] | None], str] = {
    ((2, 2, 2, 2), None): "resnet18",
    ((3, 4, 6, 3), None): "resnet34",
    ((3, 4, 6, 3), (64, 64)): "resnet50",
    ((3, 4, 6, 3), (128, 4)): "resnext50_32x4d",
    ((3, 4, 6, 3), (128, 128)): "wide_resnet50_2",
    ((3, 4, 23, 3), (64, 64)): "resnet101",
    ((3, 8, 36, 3), (64, 64)): "resnet152",
}


def guess_architecture(state: dict[str, Tensor]) -> tuple[str | None, str | None]:
    """The torchvision architecture and stem a backbone ``state_dict`` looks like (``None`` when unknown).

    The stem is ``"cifar"`` for a 3x3 ``conv1``, else ``"torchvision"`` (a ``"no_maxpool"`` stem has the same
    weights and cannot be recognised from them).
    """
    blocks = tuple(len({k.split(".")[1] for k in state if k.startswith(f"layer{i}.")}) for i in range(1, 5))
    conv3 = state.get("layer1.0.conv3.weight")
    conv2 = state.get("layer1.0.conv2.weight")
    bottleneck = tuple(conv2.shape[:2]) if conv3 is not None and conv2 is not None else None
    conv1 = state.get("conv1.weight")
    stem = None if conv1 is None else ("cifar" if conv1.shape[-1] == 3 else "torchvision")
    return _SIGNATURES.get((blocks, bottleneck)), stem


def load_weights(backbone: Backbone, state: dict[str, Tensor], what: str) -> None:
    """``load_state_dict(strict=True)`` with a message naming the expected and the found architecture."""
    expected = backbone.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    reshaped = [k for k in expected if k in state and state[k].shape != expected[k].shape]
    if missing or unexpected or reshaped:
        found = recognise_weights(state)
        looks = f"they hold {found.describe()}" if found is not None else "their network is not recognised"
        details = []
        if missing:
            details.append(f"{len(missing)} missing keys (e.g. {missing[0]})")
        if unexpected:
            details.append(f"{len(unexpected)} unexpected keys (e.g. {unexpected[0]})")
        if reshaped:
            k = reshaped[0]
            details.append(
                f"{len(reshaped)} of another shape (e.g. {k}: {list(state[k].shape)} instead of "
                f"{list(expected[k].shape)})"
            )
        raise ValueError(
            f"the weights in {what} do not fit a {backbone.arch} with the {backbone.stem} stem ({looks}): "
            f"{', '.join(details)}"
        )
    backbone.load_state_dict(state, strict=True)
