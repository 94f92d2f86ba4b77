"""Training steps of several recipes (or one recipe with several sets of overrides) timed side by side.

Each ``--variant NAME RECIPE [key=value ...]`` is built with the loop's own builders and fed a synthetic batch
through its real view transform (as ``benchmarks/step_time.py`` does); the steps are timed in alternating
rounds, the order rotated each round, so that a neighbour's load hits every variant alike. Printed per variant:
the median seconds a step, the recipe's steps in all (``optim.epochs`` x steps an epoch over ``--images``
images), the pretraining seconds they add up to, and that time over the first variant's (the median over rounds
of the same round's ratio, scaled by the steps):

    python benchmarks/recipe_steps.py --images 3592 --precision fp32 \\
        --variant fp32 demo_fp32 --variant short demo_short \\
        --variant small demo_fp32 views.teacher_resize=21 views.teacher_size=18 views.crop_size=13

``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2`` in the environment runs the
kernels an AVX2-only CPU runs (oneDNN says which with ``ONEDNN_VERBOSE=1``); their speed is this CPU's, not an AVX2
CPU's (docs/results/step_profile_cpu.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from step_time import synthetic_batch, time_interleaved, timed_step, training_run  # noqa: E402

from obow.config import load_config  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--variant",
        nargs="+",
        action="append",
        required=True,
        metavar="NAME RECIPE [key=value]",
        help="a name, a recipe and its overrides; two or more",
    )
    parser.add_argument("--images", type=int, required=True, help="training images (the steps an epoch follow)")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    for variant in args.variant:
        if len(variant) < 2:
            parser.error(f"--variant {' '.join(variant)}: give a name and a recipe")
    if len(args.variant) < 2:
        parser.error("give two --variant or more: they are timed against the first")
    return args


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Time the variants; print the table and return its rows by name (median, steps, pretraining seconds,
    over the first)."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    steps, totals = {}, {}
    for name, recipe, *overrides in args.variant:
        cfg = load_config(recipe, [f"train.precision={args.precision}", "train.device=cpu", *overrides])
        run = training_run(cfg, device)
        steps[name] = timed_step(run, synthetic_batch(cfg))
        totals[name] = cfg.optim.epochs * (args.images // cfg.data.batch_size)
    times = time_interleaved(steps, args.warmup, args.repeats, device)
    first = args.variant[0][0]
    print(f"{args.precision}, {args.threads} threads, {args.repeats} rounds after {args.warmup} warm-up steps each")
    print("| variant | median s/step | steps | pretraining s | over the first (per round) |")
    print("|---|---|---|---|---|")
    rows = {}
    for name in times:
        median = statistics.median(times[name])
        ratio = statistics.median(
            (t * totals[name]) / (f * totals[first]) for t, f in zip(times[name], times[first], strict=True)
        )
        rows[name] = {"median": median, "steps": totals[name], "seconds": median * totals[name], "ratio": ratio}
        print(f"| {name} | {median:.4f} | {totals[name]} | {median * totals[name]:.1f} | {ratio:.2f} |")
    return rows


if __name__ == "__main__":
    main()
