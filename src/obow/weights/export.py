"""Backbone-only weights for other tools: torchvision and Detectron2 (official notes 5.3 and 6.1).

``obow export`` reads a pretraining checkpoint, takes the student (or teacher) backbone and writes:

* ``--format torchvision``: ``out_path`` holds a plain ``state_dict`` that loads with ``strict=True`` into
  ``torchvision.models.<arch>()``, i.e. ``model.load_state_dict(torch.load(out_path))``. OBoW trains no
  classifier, so the ``fc`` entries (needed for strict loading) are torchvision's own initialisation of that
  architecture under ``torch.manual_seed(0)``: untrained. (The official export fills ``fc`` with the BoW
  weight generator's output instead, official notes 5.3; those 8192 "classes" are of no use downstream.)
* ``--format timm`` (for ``timm:<name>`` backbones): a ``state_dict`` that loads with ``strict=True`` into
  ``timm.create_model(name, **arch_options)``; ``--format torchvision`` does the same for
  ``torchvision:<name>`` backbones and ``torchvision.models.get_model(name)``. The parts of those models that
  OBoW does not train (the classifier, and e.g. MobileNetV3's ``conv_head``) are the library's own
  initialisation under ``torch.manual_seed(0)``, listed in the sidecar as untrained.
* ``--format detectron2``: a pickle ``{"model": {name: ndarray}, "__author__": "obow",
  "matching_heuristics": True}`` with Detectron2's ResNet names, for the VOC/COCO detection transfer of
  paper section 4.3 (R50-C4; the keys follow the renaming of MoCo's detection conversion script).

The torchvision and timm formats are written with ``torch.save``, or as safetensors when ``out_path`` ends in
``.safetensors`` (the Hugging Face / timm convention: ``safetensors.torch.load_file(out_path)`` gives the same
``state_dict``, and ``timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=out_path))``
loads it). Detectron2 reads pickles only, so ``--format detectron2`` refuses a ``.safetensors`` name.

Always, ``out_path + ".json"`` records what the file is: architecture, stem, network, source checkpoint,
epoch, iteration, obow version, the evaluation view, and what ``fc`` holds; for the torchvision and timm
formats, ``usage`` holds Python lines that load the file into the library's model, give it obow's stem and
compute obow's ``pool5`` features of a list of image files (:func:`usage_lines`). The metadata stays out of the
``state_dict`` so that torchvision loads the file as it is; a safetensors file also carries it in its header
(``{"format": "pt", "obow": <the sidecar's JSON>}``), so that it describes itself without the sidecar.
"""

from __future__ import annotations

import datetime
import json
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import torch
import torchvision
from torch import Tensor

from obow.backbones import Backbone, ResNetBackbone, TimmBackbone, TorchvisionBackbone, parse_arch
from obow.checks import check_choice
from obow.files import writing
from obow.notices import ObowWarning
from obow.version import __version__
from obow.weights.checkpoint import save_atomic
from obow.weights.load import SAFETENSORS_META_KEY, SAFETENSORS_SUFFIX, load_backbone
from obow.weights.onnx import ONNX_SUFFIX, check_can_write_onnx, write_onnx
from obow.weights.onnx import usage_lines as onnx_usage_lines

FORMATS = ("torchvision", "timm", "detectron2", "onnx")
FC_SEED = 0
FC_NOTE = f"untrained, torchvision init, seed {FC_SEED}"
STEM_NOTES = {
    "cifar": (
        "CIFAR stem: conv1 is a 3x3 stride-1 convolution (padding 1) without max-pool; a torchvision model needs "
        "model.conv1 = torch.nn.Conv2d(3, 64, 3, 1, 1, bias=False) and model.maxpool = torch.nn.Identity() "
        "before it can load these weights (the sidecar's usage lines do both)"
    ),
    "no_maxpool": (
        "no_maxpool stem: the network was trained without the 3x3 max-pool after conv1; the weights load into a "
        "standard torchvision model, but set model.maxpool = torch.nn.Identity() to compute the same features "
        "(the sidecar's usage lines do)"
    ),
}
TIMM_STEM_NOTES = {
    "cifar": (
        "CIFAR stem: the stem's first strided convolution was trained with stride 1 and without the stem's "
        "max-pool; the weights load as they are, but set that convolution's stride to 1 and the max-pool to "
        "torch.nn.Identity() to compute the same features (the sidecar's usage lines do both)"
    ),
    "no_maxpool": (
        "no_maxpool stem: set the stem's max-pool to torch.nn.Identity() to compute the same features "
        "(the sidecar's usage lines do)"
    ),
}
#: ``MODEL.RESNETS`` settings Detectron2 needs to build the same trunk as torchvision.
_DETECTRON2_RESNETS = {
    "resnet18": {"DEPTH": 18, "RES2_OUT_CHANNELS": 64},
    "resnet34": {"DEPTH": 34, "RES2_OUT_CHANNELS": 64},
    "resnet50": {"DEPTH": 50},
    "resnet101": {"DEPTH": 101},
    "resnet152": {"DEPTH": 152},
    "resnext50_32x4d": {"DEPTH": 50, "NUM_GROUPS": 32, "WIDTH_PER_GROUP": 4},
    "wide_resnet50_2": {"DEPTH": 50, "WIDTH_PER_GROUP": 128},
}


def export_backbone(
    checkpoint_path: str | Path,
    out_path: str | Path,
    *,
    network: str = "student",
    fmt: str | None = None,
) -> dict[str, Any]:
    """Write the ``network`` backbone of a pretraining checkpoint as ``fmt``; returns the metadata written
    to ``out_path + ".json"``. A non-torchvision stem gives a warning (torchvision) or an error (detectron2)."""
    if fmt is not None:
        check_choice("format", fmt, FORMATS)
    out_path = Path(out_path)
    safetensors_path = out_path.suffix == SAFETENSORS_SUFFIX
    onnx_path = out_path.suffix.lower() == ONNX_SUFFIX
    if onnx_path or fmt == "onnx":
        if fmt not in (None, "onnx"):
            raise ValueError(
                f"--out {out_path.name} names an ONNX file: leave out --format {fmt}, or give another name"
            )
        if not onnx_path:
            raise ValueError(f"--format onnx writes an ONNX file: give --out {out_path.with_suffix(ONNX_SUFFIX).name}")
        return _export_onnx(checkpoint_path, out_path, network)
    if fmt == "detectron2" and safetensors_path:
        raise ValueError(
            "--format detectron2 writes the pickle Detectron2's checkpointer reads (it does not read safetensors): "
            f"give --out {out_path.with_suffix('.pkl').name}"
        )
    backbone, info = load_backbone(checkpoint_path, network=network)
    source = parse_arch(backbone.arch)[0]
    fmt = fmt or ("timm" if source == "timm" else "torchvision")
    if fmt == "timm" and source != "timm" or source == "timm" and fmt != "timm":
        if source == "timm":
            raise ValueError(
                f"checkpoint {str(checkpoint_path)!r} holds a {backbone.arch} backbone, which exports with --format "
                f"timm (the default for it): --format {fmt} takes torchvision ResNets (model.arch resnet18, ...)"
            )
        raise ValueError(
            f"checkpoint {str(checkpoint_path)!r} holds a {backbone.arch} backbone: --format timm is for timm: "
            "backbones; use --format torchvision (the default) or detectron2"
        )
    if fmt == "detectron2" and source != "resnet":
        raise ValueError(f"--format detectron2 takes torchvision ResNets only, not {backbone.arch}")
    if fmt == "detectron2" and backbone.stem != "torchvision":
        raise ValueError(
            f"checkpoint {str(checkpoint_path)!r} uses the {backbone.stem} stem; Detectron2's ResNet stem is the "
            "torchvision one (7x7 stride-2 conv1 and a max-pool), so only such backbones can be exported to it"
        )
    meta = describe_export(fmt, backbone, info, checkpoint_path, network)
    meta["container"] = "safetensors" if safetensors_path else "pickle" if fmt == "detectron2" else "torch.save"
    state: dict[str, Tensor] | None = None
    if source != "resnet":
        assert isinstance(backbone, (TimmBackbone, TorchvisionBackbone))  # a timm: or torchvision: arch
        state, untrained = library_state_dict(backbone)
        meta["arch_options"] = backbone.options
        meta["untrained_keys"] = untrained
        meta["usage"] = usage_lines(backbone, out_path, info["views"])
    elif fmt == "torchvision":
        assert isinstance(backbone, ResNetBackbone)  # a plain resnet arch
        state = torchvision_state_dict(backbone)
        meta["fc"] = FC_NOTE
        meta["usage"] = usage_lines(backbone, out_path, info["views"])
    else:
        meta["fc"] = "not exported (Detectron2 builds its own heads)"
        meta["detectron2_config"] = detectron2_config(backbone.arch, info["views"])
    note = STEM_NOTES.get(backbone.stem) if source == "resnet" else TIMM_STEM_NOTES.get(backbone.stem)
    if note:
        meta["stem_note"] = note
        warnings.warn(note, ObowWarning, stacklevel=2)
    if state is None:
        with writing(out_path), open(out_path, "wb") as f:
            pickle.dump(detectron2_checkpoint(backbone.state_dict()), f)
    elif safetensors_path:
        save_safetensors(state, out_path, meta)
    else:
        save_atomic(state, out_path)
    with writing(f"{out_path}.json") as sidecar:
        sidecar.write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def describe_export(
    fmt: str, backbone: Backbone, info: dict[str, Any], checkpoint_path: str | Path, network: str
) -> dict[str, Any]:
    """The sidecar's entries every export has: what the file is, which network of which checkpoint, the view."""
    return {
        "format": fmt,
        "arch": backbone.arch,
        "stem": backbone.stem,
        "network": network,
        "source_checkpoint": str(checkpoint_path),
        "epoch": info["epoch"],
        "iteration": info["iteration"],
        "obow_version": __version__,
        "views": info["views"],
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
    }


def _export_onnx(checkpoint_path: str | Path, out_path: Path, network: str) -> dict[str, Any]:
    """``obow export --out FILE.onnx``: the backbone as an ONNX graph (:mod:`obow.weights.onnx`) and its sidecar."""
    check_can_write_onnx()  # before the checkpoint is read
    backbone, info = load_backbone(checkpoint_path, network=network)
    views = info["views"]
    side = views["teacher_size"] if views else 224
    meta = {**describe_export("onnx", backbone, info, checkpoint_path, network), "container": "onnx"}
    with writing(out_path):
        meta.update(write_onnx(backbone, out_path, side))
    meta["usage"] = onnx_usage_lines(out_path, views)
    with writing(f"{out_path}.json") as sidecar:
        sidecar.write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def usage_lines(backbone: Backbone, out_path: Path, views: dict[str, Any] | None) -> list[str]:
    """The sidecar's ``usage``: Python lines that, run in order as they are (given ``files``, a list of image
    paths), build the library's model, load the export into it strictly, give it obow's stem, and leave in
    ``features`` what obow computes for those images: the global average of the last stage (``pool5``) in eval
    mode, of the recipe's evaluation view (``Resize``, ``CenterCrop``, the recipe's mean and std, the same
    torchvision transforms as :func:`obow.data.transforms.eval_transform`)."""
    source, name = parse_arch(backbone.arch)
    kwargs = "".join(f", {k}={v!r}" for k, v in getattr(backbone, "options", {}).items())
    safetensors_path = out_path.suffix == SAFETENSORS_SUFFIX
    read = "safetensors.torch.load_file(path)" if safetensors_path else "torch.load(path)"
    library = "timm" if source == "timm" else "torchvision"
    lines = [
        f"import PIL.Image, PIL.ImageOps, torch, {library}" + (", safetensors.torch" if safetensors_path else ""),
        "from torchvision.transforms import v2",
        f"path = {str(out_path)!r}",
    ]
    if source == "resnet":
        assert isinstance(backbone, ResNetBackbone)
        lines.append(f"model = torchvision.models.{name}()")
        if backbone.stem == "cifar":
            conv = backbone.conv1
            assert isinstance(conv, torch.nn.Conv2d)
            lines.append(
                f"model.conv1 = torch.nn.Conv2d({conv.in_channels}, {conv.out_channels}, 3, 1, 1, bias=False)"
                "  # the cifar stem's conv1"
            )
        if backbone.stem != "torchvision":
            lines.append(f"model.maxpool = torch.nn.Identity()  # the {backbone.stem} stem has no max-pool")
        lines += [
            f"model.load_state_dict({read})",
            "model.fc = torch.nn.Identity()  # fc is untrained: the pooled last stage is the output",
        ]
        forward = "model(batch)"
    elif source == "timm":
        assert isinstance(backbone, TimmBackbone)
        if safetensors_path:  # timm's own way to read a local file, strict as well
            lines.append(
                f"model = timm.create_model({name!r}, pretrained=True, pretrained_cfg_overlay=dict(file=path){kwargs})"
            )
        else:
            lines += [f"model = timm.create_model({name!r}{kwargs})", f"model.load_state_dict({read})"]
        edits = backbone.stem_edits
        if edits.stride_one is not None:
            lines.append(f"{_module_ref(edits.stride_one)}.stride = (1, 1)  # the cifar stem: stride 1")
        for pool in edits.pools:
            lines.append(f"{_set_module(pool, 'torch.nn.Identity()')}  # the {backbone.stem} stem has no max-pool")
        forward = "model.forward_intermediates(batch, indices=1, intermediates_only=True)[0].mean((2, 3))"
    else:
        assert isinstance(backbone, TorchvisionBackbone)
        lines += [
            "from torchvision.models.feature_extraction import create_feature_extractor",
            f"model = torchvision.models.get_model({name!r}{kwargs})",
            f"model.load_state_dict({read})",
            f"model = create_feature_extractor(model, {{{backbone.stage_nodes[-1]!r}: 'conv5'}})",
        ]
        forward = "model(batch)['conv5'].mean((2, 3))"
    lines.append("model.eval()")
    if views is not None:
        lines += [
            f"preprocess = v2.Compose([v2.Resize({views['teacher_resize']}), v2.CenterCrop({views['teacher_size']}), "
            f"v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize({list(views['mean'])}, "
            f"{list(views['std'])})])",
            "batch = torch.stack([preprocess(PIL.ImageOps.exif_transpose(PIL.Image.open(f)).convert('RGB')) "
            "for f in files])  # files: your images",
        ]
    else:
        lines.append("# batch: the images [N, 3, H, W], normalised as the network saw them in pretraining")
    lines.append(f"with torch.no_grad(): features = {forward}  # obow's pool5 features, one row per image")
    return lines


def _module_ref(name: str) -> str:
    """Python for the submodule ``name`` of ``model``."""
    return f"model.{name}" if name.isidentifier() else f"model.get_submodule({name!r})"


def _set_module(name: str, value: str) -> str:
    """A Python statement that replaces the submodule ``name`` of ``model`` with ``value``."""
    parent, _, child = name.rpartition(".")
    if child.isidentifier():
        return f"{_module_ref(parent) if parent else 'model'}.{child} = {value}"
    return f"setattr({_module_ref(parent) if parent else 'model'}, {child!r}, {value})"


def save_safetensors(state: dict[str, Tensor], path: str | Path, meta: dict[str, Any]) -> None:
    """Write ``state`` as a safetensors file, atomically, with ``meta`` (the sidecar's JSON) in its header.

    Each tensor is copied to its own contiguous CPU storage: safetensors refuses tensors that share storage
    (tied weights) or are not contiguous (transposed views, channels-last), and each name must load on its own
    for ``load_state_dict(strict=True)``.
    """
    import safetensors.torch

    tensors = {k: v.detach().to("cpu").clone(memory_format=torch.contiguous_format) for k, v in state.items()}
    header = {"format": "pt", SAFETENSORS_META_KEY: json.dumps(meta)}  # "format": the Hugging Face convention
    save_atomic(tensors, path, dump=lambda obj, f: f.write(safetensors.torch.save(obj, metadata=header)))


def library_state_dict(backbone: TimmBackbone | TorchvisionBackbone) -> tuple[dict[str, Tensor], list[str]]:
    """A timm / torchvision backbone's weights completed into the whole library model's ``state_dict``
    (strict loading), and the names of the entries that OBoW did not train (seeded fresh initialisation)."""
    state = {k: v.detach().clone() for k, v in backbone.full_model(seed=FC_SEED).state_dict().items()}
    trained = backbone.export_state_dict()
    for key, value in trained.items():
        if key not in state or state[key].shape != value.shape:
            raise ValueError(f"{backbone.arch}: backbone weight {key} has no counterpart in the library's model")
        state[key] = value
    return state, sorted(k for k in state if k not in trained)


def torchvision_state_dict(backbone: ResNetBackbone) -> dict[str, Tensor]:
    """The backbone's weights plus an untrained ``fc``: exactly what ``torch.manual_seed(0);
    torchvision.models.<arch>()`` initialises, so the file loads with ``strict=True``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(FC_SEED)
        fc = torchvision.models.get_model(backbone.arch, weights=None).fc
    state = {k: v.detach().cpu().clone() for k, v in backbone.state_dict().items()}
    state["fc.weight"] = fc.weight.detach().clone()
    state["fc.bias"] = fc.bias.detach().clone()
    return state


def detectron2_key(key: str) -> str | None:
    """Detectron2's name for a torchvision ResNet key, ``None`` for keys it does not take (``fc``).

    The renaming of MoCo's ``detection/convert-pretrain-to-detectron2.py``: the stem's ``conv1`` / ``bn1``
    go under ``stem.``; ``layerN`` is ``res{N+1}``; each ``bnK`` is the norm of ``convK``
    (``convK.norm``); ``downsample.0`` / ``downsample.1`` are ``shortcut`` / ``shortcut.norm``.
    """
    if key.startswith("fc."):
        return None
    if not key.startswith("layer"):
        key = f"stem.{key}"
    key = re.sub(r"^layer(\d+)", lambda m: f"res{int(m.group(1)) + 1}", key)
    key = re.sub(r"(^|\.)bn(\d+)\.", r"\1conv\2.norm.", key)
    return key.replace("downsample.0.", "shortcut.").replace("downsample.1.", "shortcut.norm.")


def detectron2_checkpoint(state: dict[str, Tensor]) -> dict[str, Any]:
    """The pickled object Detectron2's ``DetectionCheckpointer`` reads (``matching_heuristics`` lets it match
    names by suffix, as for MoCo's converted weights)."""
    model = {}
    for key, value in state.items():
        new = detectron2_key(key)
        if new is not None:
            model[new] = value.detach().cpu().numpy()
    return {"model": model, "__author__": "obow", "matching_heuristics": True}


def detectron2_config(arch: str, views: dict[str, Any] | None) -> dict[str, Any]:
    """Detectron2 settings that make its ResNet compute what the exported torchvision trunk computes.

    torchvision puts a Bottleneck's stride in its 3x3 conv (``STRIDE_IN_1X1: False``) and takes RGB input
    normalised by the recipe's mean and std, which Detectron2 expresses on the 0-255 scale.
    """
    mean = views["mean"] if views else [0.485, 0.456, 0.406]
    std = views["std"] if views else [0.229, 0.224, 0.225]
    resnets = {f"MODEL.RESNETS.{k}": v for k, v in _DETECTRON2_RESNETS[arch].items()}
    return {
        **resnets,
        "MODEL.RESNETS.STRIDE_IN_1X1": False,
        "INPUT.FORMAT": "RGB",
        "MODEL.PIXEL_MEAN": [round(255 * m, 3) for m in mean],
        "MODEL.PIXEL_STD": [round(255 * s, 3) for s in std],
    }
