"""``train.precision``: which arithmetic a run computes in, and the autocast of its steps.

``auto`` is made concrete once, when a run starts (:func:`settle_precision`): bf16 where the device computes
bfloat16 in hardware (:func:`native_bf16`), else fp32; a resumed run keeps the precision it started with.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any

import torch

from obow.config import Config
from obow.config.choices import PRECISIONS
from obow.training.logger import log_main
from obow.training.state import RunError

__all__ = [
    "check_precision",
    "cpu_supports_bf16",
    "native_bf16",
    "precision_context",
    "resolve_precision",
    "settle_precision",
    "started_precision",
]


def check_precision(cfg: Config, device: torch.device) -> None:
    """Refuse ``train.precision=bf16`` on a GPU without bfloat16, and warn when a CPU would emulate it."""
    if cfg.train.precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise RunError("train.precision=bf16 needs a GPU with bfloat16 support; use fp16 or fp32")
    if cfg.train.precision == "bf16" and device.type == "cpu" and cpu_supports_bf16() is False:
        log_main(
            "train.precision=bf16 on a CPU without AVX-512: PyTorch emulates bfloat16 there, and a step is far "
            "slower than in fp32 (20 to 35 times for the cifar10_fast and demo recipes on a 2-core AVX2 EPYC; "
            "benchmarks/step_time.py measures it); train.precision=fp32 is the faster choice on this machine",
            level=logging.WARNING,
        )


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes bfloat16 in hardware, where bf16 autocast is the faster choice: a CUDA GPU
    with bfloat16 arithmetic (compute capability 8.0 and above), or an x86 CPU with AVX-512 BF16 or AMX
    instructions. Measured on 2-core AMD EPYCs (docs/results/step_time_cpu.md): with AVX-512 BF16 a
    ``cifar10_fast`` step is 2.1x faster in bf16 than in fp32 (2.5x with channels_last), on an AVX2-only one
    20x slower (PyTorch emulates bfloat16 there). Other CPUs (Arm's bf16 extension among them) answer ``False``:
    not measured."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type != "cpu":
        return False
    checks = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(bool(check()) for check in checks if check is not None)


def resolve_precision(precision: str, device: torch.device) -> str:
    """``train.precision`` as a run computes it: ``auto`` is bf16 where :func:`native_bf16`, else fp32; the
    other values are themselves."""
    if precision != "auto":
        return precision
    return "bf16" if native_bf16(device) else "fp32"


def settle_precision(cfg: Config, device: torch.device, started_with: dict[str, Any] | None) -> Config:
    """``cfg`` with ``train.precision: auto`` made concrete for a run: a run being resumed keeps the precision it
    started with (``started_with``, the configuration :func:`obow.training.state.started_config` reads; a resume
    on another machine computes as the run did, exactly), a new run (``None``) takes :func:`resolve_precision`'s
    choice for ``device``. Every other ``cfg`` is returned as it is. ``config.yaml`` and the checkpoint then hold
    the concrete value."""
    if cfg.train.precision != "auto":
        return cfg
    started = started_precision(started_with)
    precision = started or resolve_precision("auto", device)
    why = (
        "as the run started"
        if started
        else f"{'native' if precision == 'bf16' else 'no native'} bf16 on this {device.type}"
    )
    log_main("Precision: train.precision=auto -> %s (%s)", precision, why)
    if precision == "bf16" and device.type == "cpu" and not native_bf16(device):
        log_main(
            "this run started in bf16 on a CPU with bf16 instructions; this one has none and emulates bfloat16, far "
            "slower than fp32: the run keeps bf16 to resume exactly (a new --out can start in fp32 here)",
            level=logging.WARNING,
        )
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision=precision))


def started_precision(started_with: dict[str, Any] | None) -> str | None:
    """The ``train.precision`` a run started with, from its configuration (``None``: a new run, or none
    recorded)."""
    precision = ((started_with or {}).get("train") or {}).get("precision")
    return precision if precision in PRECISIONS and precision != "auto" else None


def cpu_supports_bf16() -> bool | None:
    """Whether PyTorch's oneDNN has fast bfloat16 kernels for this CPU (they need AVX-512 or Arm's bf16
    extension); ``None`` when this PyTorch cannot say."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check()) if check is not None else None


def precision_context(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast for bf16 / fp16 (the BoW distances and codes stay in float32 inside the extractor); ``auto`` as
    :func:`resolve_precision` makes it."""
    precision = resolve_precision(precision, device)
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device.type, dtype=dtype)
