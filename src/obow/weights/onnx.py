"""A pretrained backbone as an ONNX graph: ``obow export --out backbone.onnx``, for ONNX Runtime, TensorRT or
OpenVINO, where neither PyTorch nor obow is installed.

The graph is obow's own network, its stem included (a ``cifar`` or ``no_maxpool`` stem needs no edit, unlike the
torchvision and timm formats): input ``images`` ``[N, 3, H, W]`` float32, normalised with the recipe's mean and
std (the sidecar's ``views``); outputs ``pool5`` ``[N, C]`` (the features obow evaluates) and ``conv5``
``[N, C, h, w]`` (the last stage's map, for dense tasks). N, H and W are free. It is written by PyTorch's
exporter (``torch.onnx.export`` with ``dynamo=True``: ``torch.export``, then ONNX Script), which needs the
``onnx`` and ``onnxscript`` packages (``pip install "obow[onnx]"``). Where ``onnxruntime`` is installed, the file
is run on two random images of the recipe's size before it is kept, and its outputs must equal the PyTorch
network's to :data:`CHECK_RTOL` of their largest value; the sidecar says how close they were.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from obow.backbones import Backbone

ONNX_SUFFIX = ".onnx"
INPUT = "images"
OUTPUTS = ("pool5", "conv5")
#: An ONNX Runtime result is kept when each output is within this fraction of its largest value of PyTorch's
#: (float32 arithmetic in another order: measured 3e-7 on a ResNet-18).
CHECK_RTOL = 1e-4
EXTRA = 'pip install "obow[onnx]" (the onnx and onnxscript packages)'


class _Features(nn.Module):
    """The backbone as a function of images alone, returning ``(pool5, conv5)``."""

    def __init__(self, backbone: Backbone) -> None:
        super().__init__()
        self.backbone = backbone

    def forward(self, images: Tensor) -> tuple[Tensor, Tensor]:
        out = self.backbone(images, ("conv5",))
        return out.pool5, out.maps["conv5"]


@contextlib.contextmanager
def _quiet_logs() -> Iterator[None]:
    """The exporter's optimiser logs each pass at INFO ("Removed 202 unused nodes"): not for a user's terminal."""
    previous = logging.root.manager.disable
    logging.disable(logging.INFO)
    try:
        yield
    finally:
        logging.disable(previous)


def missing_packages() -> list[str]:
    """The packages PyTorch's ONNX exporter needs that are not installed."""
    import importlib.util

    return [name for name in ("onnx", "onnxscript") if importlib.util.find_spec(name) is None]


def check_can_write_onnx() -> None:
    """Raise ``ValueError`` (one line, with the install command) now, before a checkpoint is read, when the
    exporter's packages are missing."""
    missing = missing_packages()
    if missing:
        raise ValueError(f"writing ONNX needs {' and '.join(missing)}, not installed here: {EXTRA}")


def write_onnx(backbone: Backbone, out_path: str | Path, side: int) -> dict[str, Any]:
    """Write ``backbone`` (eval mode) to ``out_path`` as ONNX, atomically, checked with ONNX Runtime where it is
    installed (see the module); returns the sidecar's ONNX entries. ``side``: the recipe's image size, for the
    trace and the check. Raises ``ValueError`` (one line) when the exporter fails or the check does not pass;
    nothing is left at ``out_path`` then."""
    check_can_write_onnx()
    out_path = Path(out_path)
    model = _Features(backbone).eval()
    example = torch.rand(2, 3, side, side, generator=torch.Generator().manual_seed(0))
    batch, height, width = (torch.export.Dim(name) for name in ("batch", "height", "width"))
    partial = out_path.with_name(out_path.name + ".partial")
    said = io.StringIO()  # the exporter's progress lines, shown only when it fails
    try:
        with contextlib.redirect_stdout(said), _quiet_logs(), torch.no_grad():
            program = torch.onnx.export(
                model,
                (example,),
                dynamo=True,
                input_names=[INPUT],
                output_names=list(OUTPUTS),
                dynamic_shapes=({0: batch, 2: height, 3: width},),
                verbose=False,
            )
            if program is None:  # only when a file name is given to the exporter, which is not done here
                raise RuntimeError("the exporter returned no program")
            program.save(str(partial))
    except Exception as err:  # the exporter raises many kinds; each means "this network did not export"
        partial.unlink(missing_ok=True)
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"PyTorch's ONNX exporter could not export {backbone.arch}: {first}") from err
    try:
        check = check_with_onnxruntime(model, partial, side)
    except Exception:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, out_path)
    return {
        "inputs": {INPUT: "[N, 3, H, W] float32, normalised with views.mean and views.std"},
        "outputs": {"pool5": "[N, C]", "conv5": "[N, C, h, w]"},
        "opset": _opset(out_path),
        "checked": check,
    }


def check_with_onnxruntime(model: nn.Module, path: Path, side: int) -> str:
    """Run ``path`` with ONNX Runtime on two random images (a batch and a size other than the trace's) and compare
    with ``model``; returns what was found, or says that it was not checked. Raises ``ValueError`` when an output
    is off by more than :data:`CHECK_RTOL` of its largest value."""
    try:
        import onnxruntime
    except ImportError:
        return "not run here (onnxruntime is not installed)"
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    images = torch.rand(3, 3, side + 8, side, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(images)
    got = session.run(list(OUTPUTS), {INPUT: images.numpy()})
    worst = 0.0
    for name, a, b in zip(OUTPUTS, got, expected, strict=True):
        if tuple(a.shape) != tuple(b.shape):
            raise ValueError(f"the ONNX file's {name} has shape {tuple(a.shape)}, PyTorch's {tuple(b.shape)}")
        off = float((torch.from_numpy(a) - b).abs().max() / b.abs().max().clamp_min(1e-30))
        if off > CHECK_RTOL:
            raise ValueError(
                f"ONNX Runtime's {name} differs from PyTorch's by {off:.2g} of its largest value (more than "
                f"{CHECK_RTOL:g}): the export is not kept"
            )
        worst = max(worst, off)
    return (
        f"onnxruntime {onnxruntime.__version__}: pool5 and conv5 equal PyTorch's to {worst:.1e} of their largest "
        f"value (3 random images of {side + 8}x{side} px)"
    )


def _opset(path: Path) -> int | None:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return next((entry.version for entry in model.opset_import if entry.domain in ("", "ai.onnx")), None)


def usage_lines(out_path: Path, views: dict[str, Any] | None) -> list[str]:
    """The sidecar's ``usage`` for an ONNX export: Python lines that, given ``files`` (image paths), leave obow's
    ``pool5`` features in ``features`` with ONNX Runtime, NumPy and Pillow alone (the recipe's evaluation view:
    shorter side resized, centre crop, mean and std)."""
    lines = [
        "import numpy as np, onnxruntime, PIL.Image, PIL.ImageOps",
        f"session = onnxruntime.InferenceSession({str(out_path)!r})",
    ]
    if views is None:
        lines.append("# batch: the images [N, 3, H, W] float32, normalised as the network saw them in pretraining")
    else:
        resize, size = views["teacher_resize"], views["teacher_size"]
        lines += [
            "def view(f):",
            "    image = PIL.ImageOps.exif_transpose(PIL.Image.open(f)).convert('RGB')",
            "    w, h = image.size  # the shorter side to the view's resize, as torchvision's Resize does:",
            f"    w, h = ({resize}, int({resize} * h / w)) if w <= h else (int({resize} * w / h), {resize})",
            "    image = image.resize((w, h), PIL.Image.BILINEAR)",
            f"    left, top = int(round((w - {size}) / 2)), int(round((h - {size}) / 2))  # CenterCrop's",
            f"    x = np.asarray(image.crop((left, top, left + {size}, top + {size})), np.float32) / 255",
            f"    return ((x - {list(views['mean'])}) / {list(views['std'])}).transpose(2, 0, 1).astype(np.float32)",
            "batch = np.stack([view(f) for f in files])  # files: your images",
        ]
    lines.append(f"features = session.run(['pool5'], {{'{INPUT}': batch}})[0]  # obow's pool5 features, a row an image")
    return lines
