"""Speed and memory of an OBoW training step next to its compute floor and a supervised step.

For one recipe and device, in one run, it measures the median time of:

* **OBoW**: a full training step (teacher EMA, teacher forward, BoW targets, vocabulary update, weight
  generator, student forward+backward on every view group, loss, SGD step), as ``obow pretrain`` runs it;
* **floor**: the same student forward+backward on the same views, the teacher forward, and the weight
  generator's forward+backward over the K words of every level, with nothing else (and the SGD step);
* **supervised**: one forward+backward+SGD step of the same backbone with a linear classifier on one view
  per image at ``--supervised-size`` (default 224, the paper's reference; the teacher size of a reduced
  recipe is the natural analogue);

and the peak memory of each (CUDA: ``max_memory_allocated``; CPU: the peak resident set size of a fresh
process per mode, which includes the interpreter and libraries, so the CPU ratios understate differences).
It prints a table and the ratios OBoW / floor, OBoW / supervised and memory OBoW / supervised.

    python benchmarks/step_time.py --config imagenette_resnet18 --batch 32
    python benchmarks/step_time.py --config imagenet_resnet50_full --batch 64 --precision bf16   # on a GPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
from torch import nn

from obow.backbones import ResNetBackbone
from obow.config import load_config
from obow.methods.obow import OBoW
from obow.training.loop import forward_backward, precision_context

MODES = ("obow", "floor", "supervised")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(args: argparse.Namespace, mode: str) -> dict[str, float]:
    torch.manual_seed(0)
    device = torch.device(args.device)
    cfg = load_config(args.config, [f"data.batch_size={args.batch}", *args.overrides])
    v = cfg.views
    model = OBoW.from_config(cfg.model, total_iterations=10_000).to(device).train()
    fmt = torch.channels_last if args.channels_last else torch.contiguous_format
    if args.channels_last:
        model.to(memory_format=fmt)
    b = args.batch
    teacher = torch.randn(b, 3, v.teacher_size, v.teacher_size, device=device).contiguous(memory_format=fmt)
    views = [
        torch.randn(b, n, 3, s, s, device=device)
        for n, s in ((v.num_crops, v.crop_size), (v.num_patches, v.patch_size))
        if n
    ]
    autocast = precision_context(args.precision, device)
    scaler = torch.amp.GradScaler(device.type, enabled=args.precision == "fp16")

    if mode == "obow":
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.SGD(params, lr=0.01, momentum=0.9, weight_decay=1e-4)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            forward_backward(model, teacher, views, scaler, autocast, args.per_group)
            scaler.step(opt)
            scaler.update()

    elif mode == "floor":
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.SGD(params, lr=0.01, momentum=0.9, weight_decay=1e-4)
        words = [model.extractors[lvl].vocabulary.words.clone() for lvl in model.levels]

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            with autocast:
                with torch.no_grad():
                    model.teacher(teacher, levels=model.levels)
                weights = model.predictor.weights(words)
            sum(w.float().sum() for w in weights).backward()
            for group in views:
                with autocast:
                    pooled = model.student(group.flatten(0, 1).contiguous(memory_format=fmt)).pool5
                pooled.float().sum().backward()
            opt.step()

    else:
        del model  # the supervised step holds none of OBoW's state
        backbone = ResNetBackbone(cfg.model.arch, cfg.model.stem).to(device).train()
        if args.channels_last:
            backbone.to(memory_format=fmt)
        head = nn.Linear(backbone.num_features, 1000).to(device)
        params = list(backbone.parameters()) + list(head.parameters())
        opt = torch.optim.SGD(params, lr=0.01, momentum=0.9, weight_decay=1e-4)
        size = args.supervised_size or v.teacher_size
        images = torch.randn(b, 3, size, size, device=device).contiguous(memory_format=fmt)
        labels = torch.randint(0, 1000, (b,), device=device)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            with autocast:
                loss = nn.functional.cross_entropy(head(backbone(images).pool5), labels)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(args.warmup):
        step()
    synchronize(device)
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - start)
    if device.type == "cuda":
        memory = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        memory = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {"median_s": statistics.median(times), "memory_mib": memory}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="imagenette_resnet18", help="a built-in recipe or a YAML file")
    parser.add_argument("--batch", type=int, default=32, help="images per step (the recipe's batch is replaced)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument(
        "--per-group",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="back-propagate each view group on its own (default; --no-per-group: one backward)",
    )
    parser.add_argument("--supervised-size", type=int, default=224, help="0: the recipe's teacher size")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="recipe overrides, e.g. model.num_words=4096")
    args = parser.parse_args()

    if args.mode:  # a child process measuring one mode
        print(json.dumps(measure(args, args.mode)))
        return
    results = {}
    for mode in MODES:  # one fresh process per mode, so that CPU peak memory is per mode
        cmd = [sys.executable, __file__, "--mode", mode, *sys.argv[1:]]
        out = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
        if out.returncode != 0:
            sys.exit(f"{mode} failed:\n{out.stderr}")
        results[mode] = json.loads(out.stdout.strip().splitlines()[-1])

    cfg = load_config(args.config, [f"data.batch_size={args.batch}", *args.overrides])
    v = cfg.views
    where = (
        torch.cuda.get_device_name() if args.device.startswith("cuda") else f"CPU, {torch.get_num_threads()} threads"
    )
    print(
        f"\n{args.config}: {cfg.model.arch} ({cfg.model.stem} stem), batch {args.batch}, teacher {v.teacher_size} px, "
        f"{v.num_crops} x {v.crop_size} + {v.num_patches} x {v.patch_size} px, K={cfg.model.num_words}, "
        f"{'+'.join(cfg.model.levels)}; supervised at {args.supervised_size or v.teacher_size} px; "
        f"{args.precision}{', channels_last' if args.channels_last else ''}"
        f"{', per-group backward' if args.per_group else ', one backward'}; {where}"
    )
    print(f"| {'step':12s} | {'median s':>9s} | {'img/s':>8s} | {'peak MiB':>9s} |")
    print(f"|{'-' * 14}|{'-' * 11}|{'-' * 10}|{'-' * 11}|")
    for mode, r in results.items():
        print(f"| {mode:12s} | {r['median_s']:9.4f} | {args.batch / r['median_s']:8.1f} | {r['memory_mib']:9.0f} |")
    o, f, s = results["obow"], results["floor"], results["supervised"]
    print(
        f"OBoW / floor: {o['median_s'] / f['median_s']:.2f}   OBoW / supervised: {o['median_s'] / s['median_s']:.2f}"
        f"   memory OBoW / supervised: {o['memory_mib'] / s['memory_mib']:.2f}"
    )


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
