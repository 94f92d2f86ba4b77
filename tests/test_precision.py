"""Mixed precision: a bf16 autocast step on the CPU runs, and its BoW targets stay close to float32's.

The distances and soft codes are computed in float32 whatever autocast says (bow.BoWExtractor); the teacher's
feature maps are bf16 under autocast (8 bits of mantissa, a relative rounding of about 0.4%), so the targets
differ a little. Stated tolerance: the total-variation distance between the bf16 and fp32 target of every
image is below 0.05, and the mean below 0.02, with the temperature calibrated on the batch
(``temperature_init=None``). With the official cold start (``mu_MSD = 0.5`` whatever the feature scale) an
untrained network's assignments are nearly hard, bf16 rounding flips some nearest words, and the
total-variation distance reached 0.16 on conv5 in our measurements: expected, and the reason that option
exists.

The network is a ResNet-18 with an eighth of the channels (8 to 64): bf16 on a CPU without bf16 units is
emulated, and the full-width step took 45 s where this one takes 1.5 s. The distances measured are alike: at
most 0.011 (full width) and 0.012 (narrow) over three seeds, means below 0.01 for both.
"""

import copy
import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from obow.config import ModelConfig, load_config
from obow.methods.obow import OBoW
from obow.training import build
from obow.training.run import precision as prec


def test_bf16_step_runs_and_targets_match_float32():
    torch.manual_seed(0)
    cfg = ModelConfig(
        arch="timm:resnet18",
        arch_options={"channels": [8, 16, 32, 64], "stem_width": 8},
        stem="cifar",
        levels=("conv4", "conv5"),
        num_words=64,
        kappa=5.0,
        temperature_init=None,
    )
    fp32 = OBoW.from_config(cfg, total_iterations=10).train()
    bf16 = copy.deepcopy(fp32)
    teacher = torch.randn(8, 3, 40, 40)
    views = [torch.randn(8, 2, 3, 24, 24), torch.randn(8, 3, 3, 16, 16)]

    torch.manual_seed(1)
    ref = fp32(teacher, views)
    torch.manual_seed(1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = bf16(teacher, views)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert all(torch.isfinite(p.grad).all() for p in bf16.parameters() if p.grad is not None)
    for level in cfg.levels:
        t16, t32 = out.targets[level], ref.targets[level]
        assert t16.dtype == torch.float32  # the BoW machinery ran in float32
        tv = 0.5 * (t16 - t32).abs().sum(dim=-1)
        assert tv.max() < 0.05 and tv.mean() < 0.02, (level, tv)
        assert not torch.equal(t16, t32)  # bf16 really was used upstream
    torch.testing.assert_close(out.loss.float(), ref.loss, rtol=0.05, atol=0.05)


def test_pytorch_says_whether_this_cpu_has_fast_bf16():
    assert isinstance(prec.cpu_supports_bf16(), bool)  # None would silence the warning below everywhere


@pytest.mark.parametrize(
    ("precision", "fast_bf16", "warned"),
    [("bf16", False, True), ("bf16", True, False), ("bf16", None, False), ("fp32", False, False)],
)
def test_bf16_on_a_cpu_without_fast_bf16_runs_there_with_a_warning(
    monkeypatch, caplog, tiny_recipe, precision, fast_bf16, warned
):
    monkeypatch.setattr(prec, "cpu_supports_bf16", lambda: fast_bf16)
    overrides = [f"train.precision={precision}", "train.device=cpu", "train.deterministic=false"]
    cfg = load_config(str(tiny_recipe), overrides)
    with caplog.at_level(logging.WARNING, logger="obow"):
        device = build.setup_process(cfg)
    assert device.type == "cpu"  # still runs, on the device asked for, at the precision asked for
    assert ("emulates bfloat16" in caplog.text) == warned


def _cpu_flags() -> set[str]:
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return set()
    return {flag for line in text.splitlines() if line.startswith("flags") for flag in line.split(":", 1)[1].split()}


#: the environment variables that cap PyTorch's or oneDNN's kernels (read when a process starts)
KERNEL_CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")


def test_auto_is_bf16_exactly_where_the_cpu_has_bf16_instructions():
    flags = _cpu_flags()
    if "avx2" not in flags:
        pytest.skip("needs an x86 CPU whose flags Linux lists in /proc/cpuinfo (the independent reference)")
    if any(os.environ.get(cap) for cap in KERNEL_CAPS):
        pytest.skip("this process's kernels are capped: the tests below check auto under caps")
    native = "avx512_bf16" in flags or "amx_bf16" in flags  # the instructions oneDNN's fast bf16 kernels use
    cpu = torch.device("cpu")
    assert prec.native_bf16(cpu) is native
    assert prec.resolve_precision("auto", cpu) == ("bf16" if native else "fp32")
    for precision in ("fp32", "bf16", "fp16"):  # asked for: kept, even where slow (the warning says so)
        assert prec.resolve_precision(precision, cpu) == precision


@pytest.mark.parametrize(
    ("capability", "env", "capped"),
    [
        ("AVX512", {}, False),
        ("AVX2", {}, True),  # ATEN_CPU_CAPABILITY=avx2 (or a CPU whose ATen dispatch stops there)
        ("DEFAULT", {}, True),  # ATEN_CPU_CAPABILITY=default
        ("AVX512", {"ONEDNN_MAX_CPU_ISA": "AVX2"}, True),
        ("AVX512", {"DNNL_MAX_CPU_ISA": " avx512_core "}, True),  # oneDNN's older name, any case
        ("AVX512", {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"}, True),
        ("AVX512", {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, False),
        ("AVX512", {"ONEDNN_MAX_CPU_ISA": "ALL"}, False),
    ],
)
def test_kernels_capped_below_bf16_are_read_from_atens_capability_and_onednns_isa(monkeypatch, capability, env, capped):
    for name in KERNEL_CAPS:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    assert prec.kernels_restricted_below_bf16() is capped
    bf16_cpu = {"_is_avx512_bf16_supported": lambda: True, "_is_amx_tile_supported": lambda: False}
    for name, check in bf16_cpu.items():
        monkeypatch.setattr(torch.cpu, name, check, raising=False)
    assert prec.resolve_precision("auto", torch.device("cpu")) == ("fp32" if capped else "bf16")


@pytest.mark.slow  # two fresh processes (the caps are read when a process starts)
def test_auto_is_fp32_in_a_process_whose_kernels_the_environment_caps():
    """A process started with ATen's kernels capped at AVX2 (an AVX2-only CPU's kernels on a newer one) emulates
    bf16, so ``auto`` is fp32 there, whatever the flags."""
    flags = _cpu_flags()
    if not ({"avx512_bf16", "amx_bf16"} & flags):
        pytest.skip("needs a CPU with bf16 instructions (elsewhere auto is fp32 anyway)")
    code = (
        "import torch; from obow.training.run import precision as p; cpu = torch.device('cpu'); "
        "print(p.native_bf16(cpu), p.resolve_precision('auto', cpu), torch.backends.cpu.get_cpu_capability())"
    )
    clean = {k: v for k, v in os.environ.items() if k not in KERNEL_CAPS}

    def answer(environment: dict[str, str]) -> list[str]:
        done = subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True, check=True)
        return done.stdout.split()

    assert answer(clean) == ["True", "bf16", "AVX512"]
    assert answer({**clean, "ATEN_CPU_CAPABILITY": "avx2"}) == ["False", "fp32", "AVX2"]


def test_an_auto_run_records_its_choice_and_a_resume_keeps_it_on_another_machine(
    monkeypatch, tmp_path, tiny_recipe, write_images, obow_cli, caplog
):
    data = write_images(tmp_path / "data", per_class=8, size=28)
    out = tmp_path / "run"
    args = ["pretrain", "--config", tiny_recipe, "--data", data, "--out", out, "train.precision=auto"]
    args += ["train.knn_every=0", "train.deterministic=false", "train.device=cpu"]  # a CPU even where a GPU is seen
    monkeypatch.setattr(prec, "native_bf16", lambda device: True)  # a machine with AVX-512 BF16
    with caplog.at_level(logging.INFO, logger="obow"):
        obow_cli(*args, "optim.epochs=1")
    assert "train.precision=auto -> bf16 (native bf16 on this cpu)" in caplog.text
    assert "emulates" not in caplog.text
    assert load_config(str(out / "config.yaml")).train.precision == "bf16"
    assert torch.load(out / "checkpoint.pt", weights_only=False)["config"]["train"]["precision"] == "bf16"

    monkeypatch.setattr(prec, "native_bf16", lambda device: False)  # resumed (extended) on an AVX2 machine
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="obow"):
        obow_cli(*args, "optim.epochs=2")
    assert "train.precision=auto -> bf16 (as the run started)" in caplog.text
    assert "this one has none and emulates bfloat16" in caplog.text  # told why it may be slow here
    assert load_config(str(out / "config.yaml")).train.precision == "bf16"
    epochs = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in epochs if r.get("type") == "epoch"] == [1, 2]  # resumed, not restarted

    fresh = tmp_path / "fresh"  # a new run on that machine chooses for itself
    obow_cli(*[fresh if a == out else a for a in args], "optim.epochs=1")
    assert load_config(str(fresh / "config.yaml")).train.precision == "fp32"
