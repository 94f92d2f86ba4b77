"""``train.precision``: which arithmetic a run computes in, and the autocast of its steps.

``auto`` is bf16 where the device computes bfloat16 in hardware (:func:`native_bf16`), else fp32
(:func:`resolve_precision`); a run makes it concrete once, when it starts, and keeps it when resumed
(:func:`obow.training.run.settle.settle_precision`).
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch

from obow.config import Config
from obow.training.run.logger import log_main
from obow.training.run.state import RunError

__all__ = [
    "check_precision",
    "cpu_supports_bf16",
    "kernels_restricted_below_bf16",
    "native_bf16",
    "precision_context",
    "resolve_precision",
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
    not measured.

    A CPU restricted to older kernels answers ``False`` as well: ``ATEN_CPU_CAPABILITY=avx2`` or
    ``ONEDNN_MAX_CPU_ISA`` below ``AVX512_CORE_BF16`` in the environment (what an AVX2-only CPU runs, for its
    numbers on a newer one) leave oneDNN no bf16 instructions, and bf16 is emulated there."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type != "cpu":
        return False
    checks = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if not any(bool(check()) for check in checks if check is not None):
        return False
    return not kernels_restricted_below_bf16()


#: ``ONEDNN_MAX_CPU_ISA`` values (oneDNN's names) that leave out every bf16 instruction.
ISAS_WITHOUT_BF16 = frozenset({"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"})


#: ``torch.backends.cpu.get_cpu_capability()`` values (ATen's dispatch levels on x86) below AVX-512.
ATEN_BELOW_BF16 = frozenset({"DEFAULT", "NO AVX", "AVX2"})


def kernels_restricted_below_bf16() -> bool:
    """Whether the environment keeps PyTorch or oneDNN from the CPU's bf16 instructions: ATen's kernels at AVX2
    or below (``ATEN_CPU_CAPABILITY``), or oneDNN's ISA capped below ``AVX512_CORE_BF16`` (``ONEDNN_MAX_CPU_ISA``,
    or its older name ``DNNL_MAX_CPU_ISA``)."""
    if torch.backends.cpu.get_cpu_capability() in ATEN_BELOW_BF16:
        return True
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or ""
    return isa.strip().upper() in ISAS_WITHOUT_BF16


def resolve_precision(precision: str, device: torch.device) -> str:
    """``train.precision`` as a run computes it: ``auto`` is bf16 where :func:`native_bf16`, else fp32; the
    other values are themselves."""
    if precision != "auto":
        return precision
    return "bf16" if native_bf16(device) else "fp32"


def cpu_supports_bf16() -> bool | None:
    """Whether PyTorch's oneDNN has fast bfloat16 kernels for this CPU (they need AVX-512 or Arm's bf16
    extension); ``None`` when this PyTorch cannot say."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check()) if check is not None else None


def precision_context(precision: str, device: torch.device, cache: bool = True) -> contextlib.AbstractContextManager:
    """Autocast for bf16 / fp16 (the BoW distances and codes stay in float32 inside the extractor); ``auto`` as
    :func:`resolve_precision` makes it. ``cache=False``: no cache of the weights' casts (a CUDA graph's capture)."""
    precision = resolve_precision(precision, device)
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device.type, dtype=dtype, cache_enabled=cache)
