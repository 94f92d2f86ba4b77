"""Where the time of one OBoW training step goes.

Times, on the same inputs and in one run, the full training step (forward, backward, SGD step) and each of
its parts on its own:

* backbone passes: the student's forward+backward over every view group, the teacher's forward;
* the weight generator's forward+backward over all K words of every level (a fixed cost per step);
* OBoW's own machinery: distances and codes, pooling and L1 normalisation, the queue update, the teacher
  EMA, and the loss (logits, log-softmax, KL and their backward);
* the SGD step.

It prints one table per configuration with the median of ``--repeats`` timings, and the share of the step
that is neither a backbone pass nor the generator ("overhead"), measured two ways: the residual of the full
step, and the sum of OBoW's own parts. Target: overhead <= 10% of the step.

    python benchmarks/step_breakdown.py                      # resnet18 and resnet50 at a small size
    python benchmarks/step_breakdown.py --arch resnet50 --batch 16 --teacher-size 96
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from obow.bow.loss import bow_loss
from obow.bow.targets import (
    flatten_locations,
    l1_normalize,
    pool_codes,
    remove_border,
    soft_assignment,
    squared_distances,
)
from obow.config import ModelConfig
from obow.methods.obow import OBoW


def timed(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def breakdown(args: argparse.Namespace, arch: str, batch: int) -> dict[str, float]:
    cfg = ModelConfig(arch=arch, stem=args.stem, num_words=args.num_words, levels=("conv4", "conv5"))
    model = OBoW.from_config(cfg, total_iterations=1000).train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.01, momentum=0.9, weight_decay=1e-4)
    teacher_images = torch.randn(batch, 3, args.teacher_size, args.teacher_size)
    views = [
        torch.randn(batch, args.num_crops, 3, args.crop_size, args.crop_size),
        torch.randn(batch, args.num_patches, 3, args.patch_size, args.patch_size),
    ]
    words = [model.extractors[lvl].vocabulary.words.clone() for lvl in model.levels]
    with torch.no_grad():
        maps = model.teacher(teacher_images, levels=model.levels).maps
    interiors = {lvl: remove_border(m.float()) for lvl, m in maps.items()}
    features = {lvl: flatten_locations(m) for lvl, m in interiors.items()}
    distances = {lvl: squared_distances(features[lvl], w) for lvl, w in zip(model.levels, words, strict=True)}
    codes = {lvl: soft_assignment(d, 0.1 * d.min(-1).values.mean()) for lvl, d in distances.items()}
    targets = {lvl: l1_normalize(pool_codes(c)) for lvl, c in codes.items()}

    def full_step() -> None:
        out = model(teacher_images, views)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()

    def student_passes() -> None:
        for v in views:
            f = model.student(v.flatten(0, 1)).pool5
            f.sum().backward()

    def teacher_pass() -> None:
        with torch.no_grad():
            model.teacher(teacher_images, levels=model.levels)

    def generator() -> None:
        w = model.predictor.weights(words)
        sum(x.sum() for x in w).backward()

    @torch.no_grad()
    def distances_and_codes() -> None:
        for lvl, w in zip(model.levels, words, strict=True):
            d = squared_distances(features[lvl], w)
            d.min(dim=-1)
            soft_assignment(d, 1.0)

    @torch.no_grad()
    def pooling() -> None:
        for c in codes.values():
            l1_normalize(pool_codes(c))

    @torch.no_grad()
    def queue() -> None:
        for lvl in model.levels:
            model.extractors[lvl].vocabulary.update(interiors[lvl], distances[lvl], None)

    def ema() -> None:
        model.update_teacher(0.99)

    pooled = [torch.randn(batch * v.shape[1], model.student.num_features) for v in views]
    weights = [w.detach().requires_grad_(True) for w in model.predictor.weights(words)]

    def loss() -> None:
        total = 0.0
        for f, v in zip(pooled, views, strict=True):
            f = f.requires_grad_(True)
            for z, lvl in zip(model.predictor(f, weights), model.levels, strict=True):
                total = total + bow_loss(z.view(batch, v.shape[1], -1), targets[lvl])
        total.backward()

    def sgd() -> None:
        opt.step()

    parts = {
        "student forward+backward": student_passes,
        "teacher forward": teacher_pass,
        "weight generator forward+backward": generator,
        "distances and codes": distances_and_codes,
        "pooling and L1": pooling,
        "queue update": queue,
        "teacher EMA": ema,
        "loss forward+backward": loss,
        "SGD step": sgd,
        "full training step": full_step,
    }
    return {name: timed(fn, args.repeats) for name, fn in parts.items()}


def report(arch: str, batch: int, args: argparse.Namespace, t: dict[str, float]) -> None:
    step = t["full training step"]
    compute = t["student forward+backward"] + t["teacher forward"] + t["weight generator forward+backward"]
    own = sum(
        t[k] for k in ("distances and codes", "pooling and L1", "queue update", "teacher EMA", "loss forward+backward")
    )
    print(
        f"\n{arch}, stem {args.stem}, batch {batch}, teacher {args.teacher_size} px, "
        f"{args.num_crops} x {args.crop_size} px + {args.num_patches} x {args.patch_size} px, K={args.num_words}, "
        f"conv4+conv5, {torch.get_num_threads()} threads"
    )
    print(f"| {'part':36s} | {'median s':>9s} | {'% of step':>9s} |")
    print(f"|{'-' * 38}|{'-' * 11}|{'-' * 11}|")
    for name, seconds in t.items():
        print(f"| {name:36s} | {seconds:9.4f} | {100 * seconds / step:8.1f}% |")
    print(f"overhead (residual: step - backbones - generator): {100 * (step - compute) / step:.1f}% of the step")
    print(f"overhead (sum of OBoW's own parts, SGD step excluded): {100 * own / step:.1f}% of the step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", nargs="+", default=["resnet18", "resnet50"])
    parser.add_argument("--batch", type=int, nargs="+", default=[32, 16], help="one per --arch")
    parser.add_argument("--stem", default="no_maxpool")
    parser.add_argument("--teacher-size", type=int, default=96)
    parser.add_argument("--crop-size", type=int, default=64)
    parser.add_argument("--patch-size", type=int, default=40)
    parser.add_argument("--num-crops", type=int, default=2)
    parser.add_argument("--num-patches", type=int, default=5)
    parser.add_argument("--num-words", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if len(args.batch) != len(args.arch):
        parser.error("give one --batch per --arch")
    torch.manual_seed(0)
    for arch, batch in zip(args.arch, args.batch, strict=True):
        report(arch, batch, args, breakdown(args, arch, batch))


if __name__ == "__main__":
    main()
