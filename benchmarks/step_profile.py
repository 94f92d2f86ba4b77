"""Where an fp32 training step's time goes, by operator: PyTorch's profiler over a few steps of a recipe.

Builds the recipe's model, optimiser and step with the loop's own builders (as ``benchmarks/step_time.py``
does), runs ``--warmup`` untimed steps, then profiles ``--steps`` steps on the CPU and groups the operators
into what a reader of the paper recognises: the convolutions (forward and backward, by input shape), batch
norm, ReLU and the other element-wise work, the BoW targets (distances, codes, pooling), the weight generator
and the BoW loss, the teacher's EMA, the optimiser, and the rest. Each group's share of the profiled
self-time (the time spent in the operator itself, not in what it calls) and its seconds per step are printed
and, with ``--json``, written with the machine's CPU flags, the command and the date.

    python benchmarks/step_profile.py --config demo_fp32 --precision fp32
    python benchmarks/step_profile.py --config cifar10_fast --precision fp32 --json docs/results/profile.json

On a CPU with AVX-512, ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2`` in the
environment makes PyTorch, oneDNN and MKL use their AVX2 kernels only (what an AVX2-only CPU runs: their shares,
not that CPU's seconds, docs/results/step_profile_cpu.md); the JSON records the three variables.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from demo_time import cpu_kind  # noqa: E402
from step_time import synthetic_batch, timed_step, training_run  # noqa: E402

from obow.config import load_config  # noqa: E402

#: Operator groups, first match wins: (group, substrings of the profiler's event names).
GROUPS = (
    ("convolution", ("convolution", "conv2d", "mkldnn_conv", "conv_depthwise")),
    ("batch norm", ("batch_norm", "native_batch_norm")),
    ("optimiser (SGD)", ("sgd", "_foreach", "optimizer")),
    ("BoW targets and loss", ("cdist", "addmm", "mm", "bmm", "softmax", "log_softmax", "kl_div", "topk", "max_pool")),
    ("pooling", ("avg_pool", "adaptive_avg", "max_pool2d")),
    ("element-wise (ReLU, add, mul, copy)", ("relu", "threshold", "add", "mul", "copy_", "clone", "fill_", "div")),
)


def group_of(name: str) -> str:
    lowered = name.lower()
    for group, keys in GROUPS:
        if any(k in lowered for k in keys):
            return group
    return "other"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="demo_fp32")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--batch", type=int, default=0, help="the recipe's batch when 0")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch's default when 0")
    parser.add_argument("--json", type=Path)
    parser.add_argument("overrides", nargs="*", help="key=value settings of the recipe")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    overrides = [*([f"data.batch_size={args.batch}"] if args.batch else []), *args.overrides]
    cfg = load_config(args.config, [*overrides, f"train.precision={args.precision}"])
    device = torch.device("cpu")
    run = training_run(cfg, device)
    batch = synthetic_batch(cfg)
    step = timed_step(run, batch)
    for _ in range(args.warmup):
        step()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    plain = (time.perf_counter() - start) / args.steps
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(args.steps):
            step()
    groups: dict[str, float] = defaultdict(float)
    convs: dict[str, float] = defaultdict(float)
    ops: dict[str, float] = defaultdict(float)
    for event in prof.key_averages(group_by_input_shape=True):
        seconds = event.self_cpu_time_total / 1e6 / args.steps
        groups[group_of(event.key)] += seconds
        ops[event.key] += seconds
        if group_of(event.key) == "convolution" and seconds > 0:
            shapes = event.input_shapes[:2] if event.input_shapes else []
            convs[f"{event.key} {shapes}"] += seconds
    total = sum(groups.values())
    result = {
        "config": args.config,
        "precision": args.precision,
        "batch": cfg.data.batch_size,
        "channels_last": cfg.train.channels_last,
        "threads": torch.get_num_threads(),
        "step_seconds_unprofiled": plain,
        "profiled_self_seconds_per_step": total,
        "groups": {g: {"seconds": s, "share": s / total} for g, s in sorted(groups.items(), key=lambda kv: -kv[1])},
        "top_operators": {k: v for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:15]},
        "top_convolutions": {k: v for k, v in sorted(convs.items(), key=lambda kv: -kv[1])[:12]},
        "machine": {
            "cpu": cpu_kind(),
            "capability": torch.backends.cpu.get_cpu_capability(),
            "ATEN_CPU_CAPABILITY": os.environ.get("ATEN_CPU_CAPABILITY"),
            "ONEDNN_MAX_CPU_ISA": os.environ.get("ONEDNN_MAX_CPU_ISA"),
            "MKL_ENABLE_INSTRUCTIONS": os.environ.get("MKL_ENABLE_INSTRUCTIONS"),
            "torch": torch.__version__,
        },
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python benchmarks/step_profile.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    print(
        f"{args.config} {args.precision}, batch {cfg.data.batch_size}, channels_last {cfg.train.channels_last}, "
        f"{torch.get_num_threads()} threads, {result['machine']['capability']}: {plain:.3f} s a step unprofiled"
    )
    for g, v in result["groups"].items():
        print(f"  {g:40s} {v['seconds']:7.3f} s  {100 * v['share']:5.1f} %")
    print("  top operators (self s/step):")
    for k, v in result["top_operators"].items():
        print(f"    {k:50s} {v:7.3f}")
    print("  convolutions by input shape (self s/step):")
    for k, v in result["top_convolutions"].items():
        print(f"    {k[:100]:100s} {v:7.3f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
