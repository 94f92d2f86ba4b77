"""The device pipeline's render, eager or compiled: which makes a recipe's views faster on this device?

Times :class:`obow.data.batched_views.BatchedViews` rendering every view of a batch (teacher view, crops,
patches; MoCo v2's two crops with ``model.method=mocov2``) from decoded ``uint8`` images already on ``--device``,
the random parameters drawn on the host each time as a run draws them, three ways:

* ``eager``: the render a run uses by default: each photometric operation on the views that draw it, picked on
  the host (fewer operations, a few hundred kernels);
* ``dense``: eager, every view through every operation, kept where drawn (what a compiled render traced before
  2026-11-30: the hue rotation of every view in every round);
* ``slots``: ``dense`` with the hue rotated only in each round's slots
  (:meth:`obow.data.batched_views.BatchedViews.with_hue_slots`, what the compiled and graphed renders run now);
* ``compiled``: ``dense`` compiled by Inductor into one graph (:func:`obow.data.batched_views.compiled_render`,
  what ``train.compile: step`` uses on a GPU); its first call, the compilation, is timed apart;
* ``graphed``: the dense render captured once as a CUDA graph and replayed
  (:func:`obow.data.batched_views.graphed_render`, what ``train.compile: graph`` uses with the device pipeline; on a
  CPU the tape stands in for the CUDA graph); its first call, the capture, is timed apart;
* ``baseline`` (with ``--baseline REF``): the eager render of ``src/obow/data/batched_views.py`` as it was at the
  git commit ``REF`` (``git show``, loaded as a module of its own), e.g. ``6aa5d3d``, the last with ``roi_align``
  resampling and float colour maths: the cost of Pillow's filter and rounding, in the same alternating rounds.

Alternating rounds of ``--steps`` renders after ``--warmup``; prints the median source images/s of each and writes
``--json`` (the compilation's and capture's times and each round's rates are printed the moment they exist, so a run
stopped by a time limit keeps them). The images are random pixels of the recipe's cache size (the render's work does
not depend on them). Checked on the way, on the same parameters: the largest difference of the dense and compiled
views from the eager ones (``max_abs_diff``; 0 for ``dense``, float32 rounding for Inductor's fused kernels), and
whether the views made one batch ahead on a side stream (:func:`obow.data.device_loader.made_ahead`, what a GPU run
does) are the eager ones bit for bit (``ahead_equal``; ``null`` on a CPU, which has no streams). For ``baseline``
the difference is how far today's views moved from that commit's (same draws).

    python benchmarks/render.py --config cifar10_fast --device cpu --rounds 3
    python benchmarks/render.py --config cifar10_resnet18 --device cuda data.batch_size=512
    python benchmarks/render.py --config imagenet_resnet50_full --device cuda --baseline 6aa5d3d --modes eager baseline
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

from obow.config import load_config
from obow.data.batched_views import compiled_render, graphed_render
from obow.data.device_loader import made_ahead
from obow.graphs import CudaStepGraph, TapeGraph
from obow.methods import build_batched_views, views_side

MODES = ("eager", "dense", "slots", "compiled", "graphed", "baseline")
ROOT = Path(__file__).resolve().parents[1]


def baseline_module(ref: str) -> types.ModuleType:
    """``obow.data.batched_views`` as it was at the git commit ``ref``, as a module of its own."""
    path = "src/obow/data/batched_views.py"
    source = subprocess.run(["git", "show", f"{ref}:{path}"], cwd=ROOT, capture_output=True, text=True, check=True)
    module = types.ModuleType(f"batched_views_at_{ref}")
    module.__file__ = f"{ref}:{path}"
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(source.stdout, module.__file__, "exec"), module.__dict__)
    return module


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--modes", nargs="+", default=list(MODES[:3]), choices=MODES)
    parser.add_argument("--baseline", help="a git commit: its render as the mode 'baseline' (e.g. 6aa5d3d)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed renders per mode and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads on a CPU (0: torch's default)")
    parser.add_argument("--compile-backend", default="inductor", help="aot_eager: the dry run's quick trace")
    parser.add_argument("--json", type=Path)
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. data.batch_size=512")
    return parser


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = load_config(args.config, args.overrides)
    device = torch.device(args.device)
    side = cfg.data.cache_size or views_side(cfg.views)
    batch = cfg.data.batch_size
    views = build_batched_views(cfg, side)
    images = torch.randint(0, 256, (batch, 3, side, side), dtype=torch.uint8).to(device)
    generator = torch.Generator().manual_seed(0)
    drawers = dict.fromkeys(args.modes, views)  # whose draw each mode renders
    renders = {
        "eager": views.render,
        "dense": lambda im, p: views.render(im, p.to(device), dense=True),
        "slots": lambda im, p: views.render(im, (views.with_hue_slots(p) or p).to(device), dense=True),
    }
    if "baseline" in args.modes:
        if not args.baseline:
            raise SystemExit("render.py: the mode 'baseline' needs --baseline REF (a git commit, e.g. 6aa5d3d)")
        old = baseline_module(args.baseline).BatchedViews(
            views.cfg, side, mocov2=views.mocov2, moco_crop_scale=views.moco_crop_scale
        )
        drawers["baseline"], renders["baseline"] = old, old.render
    compile_s = None
    if "compiled" in args.modes:
        compiled = compiled_render(views, device, backend=args.compile_backend)
        start = time.perf_counter()
        compiled(images, views.draw(batch, generator))
        synchronize(device)
        compile_s = time.perf_counter() - start
        print(f"render: compiled in {compile_s:.1f} s", flush=True)  # each figure out as it exists: a part cut later
        renders["compiled"] = compiled
    capture_s = None
    if "graphed" in args.modes:
        graphed = graphed_render(views, device, CudaStepGraph if device.type == "cuda" else TapeGraph)
        start = time.perf_counter()
        graphed(images, views.draw(batch, generator))
        synchronize(device)
        capture_s = time.perf_counter() - start
        print(f"render: captured in {capture_s:.2f} s", flush=True)
        renders["graphed"] = graphed
    state = generator.get_state()
    reference = views.render(images, views.draw(batch, generator))
    max_abs_diff = {}
    for mode in args.modes:  # each on the same draws (the baseline draws the same numbers with its own classes)
        generator.set_state(state)
        made = renders[mode](images, drawers[mode].draw(batch, generator))
        max_abs_diff[mode] = max(float((made[k] - v).abs().max()) for k, v in reference.items())
    ahead_equal = None
    if device.type == "cuda":
        draws = [views.draw(batch, generator) for _ in range(4)]
        ahead = made_ahead(lambda p: {"image": views.render(images, p)}, draws, device)
        ahead_equal = all(
            torch.equal(made["image"][k], v)
            for made, p in zip(ahead, draws, strict=True)
            for k, v in views.render(images, p).items()
        )
    for mode in args.modes:
        for _ in range(args.warmup):
            renders[mode](images, drawers[mode].draw(batch, generator))
    synchronize(device)
    rounds: dict[str, list[float]] = {mode: [] for mode in args.modes}
    for i in range(args.rounds):
        for mode in args.modes:
            start = time.perf_counter()
            for _ in range(args.steps):
                renders[mode](images, drawers[mode].draw(batch, generator))
            synchronize(device)
            rounds[mode].append(batch * args.steps / (time.perf_counter() - start))
        print(f"render: round {i + 1}: " + ", ".join(f"{m} {r[-1]:.0f}" for m, r in rounds.items()), flush=True)
    result = {
        "config": args.config,
        "overrides": args.overrides,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "batch": batch,
        "side": side,
        "compile_backend": args.compile_backend,
        "baseline": args.baseline,
        "compile_s": compile_s,
        "capture_s": capture_s,
        "max_abs_diff": max_abs_diff,
        "ahead_equal": ahead_equal,
        "images_per_s": {mode: statistics.median(r) for mode, r in rounds.items()},
        "rounds": rounds,
    }
    print(f"render of {args.config} ({batch} images of {side} px) on {result['device']}, {args.rounds} alternating "
          f"rounds of {args.steps} renders; source images/s, median:")  # fmt: skip
    for mode, rate in result["images_per_s"].items():
        print(f"  {mode:9s} {rate:10.0f}  (rounds: {', '.join(f'{r:.0f}' for r in rounds[mode])})")
    if compile_s is not None:
        print(f"  compilation (first compiled call): {compile_s:.1f} s")
    if capture_s is not None:
        print(f"  capture (first graphed call): {capture_s:.2f} s")
    print(f"  largest difference from the eager views: {max_abs_diff}")
    if "baseline" in rounds:
        ratio = result["images_per_s"]["eager"] / result["images_per_s"]["baseline"] if "eager" in rounds else None
        print(f"  eager render / the render at {args.baseline}: {ratio:.2f}x the images/s" if ratio else "")
    print(f"  made one batch ahead on a side stream, equal to the eager views: {ahead_equal}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
