"""The graphed step's smoke test on a GPU (``train.compile=graph``): does it capture, how long until the first
replay, does a replay synchronise, and is it the eager step?

One recipe's run is built twice with the training loop's own builders (``benchmarks/throughput.py``'s ``build``),
``train.compile=graph`` and ``off``, from the same seed; ``--steps`` batches are taken from the loader once and
both runs train on them, as the loop would (logged steps every ``train.log_every``, the learning rate of the
recipe's schedule), from the same random state. Written as JSON lines the moment each exists (``--jsonl``):

1. ``capture``: the seconds from the first step to the capture's end and to the first replay's, the capture
   itself, the steps before it (warm-up and logged ones);
2. ``graph_run`` / ``eager_run``: each run's step times (median of the replayed steps, of the eager unlogged
   ones) and its peak GPU memory;
3. ``compare``: the graphed run against the eager one, step by step (the losses) and at the end (every parameter
   of student and teacher, and the vocabularies: the largest difference relative to the tensor's norm);
4. ``sync_check``: ``--replays`` more unlogged steps of the graphed run under
   ``torch.cuda.set_sync_debug_mode("error")``: a replay that synchronises raises, and the line says where.

    python benchmarks/gpu_graph.py --config cifar10_resnet18 --data /tmp/c10/train --cache-dir /tmp/obow_cache \\
        --jsonl /tmp/out/graph.jsonl data.batch_size=512 train.precision=bf16 train.channels_last=true

On a CPU, ``--stand-in`` runs the plumbing with the tape that stands in for a CUDA graph (a dry run).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
import throughput  # noqa: E402

from obow.schedules import learning_rate  # noqa: E402
from obow.training.loop import train_step  # noqa: E402
from obow.training.run.logger import logged_step  # noqa: E402
from obow.training.step import graphed  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--data", required=True, help="a folder of training images")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=50, help="steps of each run, from one state")
    parser.add_argument("--replays", type=int, default=20, help="replays under the synchronisation check")
    parser.add_argument("--min-images", type=int, default=2_000)
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--jsonl", default=None, help="append each result here as a JSON line at once")
    parser.add_argument("--stand-in", action="store_true", help="on a CPU: the tape that stands in for a CUDA graph")
    parser.add_argument("overrides", nargs="*", help="recipe overrides, key=value")
    return parser


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b| / (|b|_max + tiny)``: how far apart two tensors of the same meaning are, as a fraction of
    the tensor's scale."""
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / (b.abs().max() + 1e-30)) if b.numel() else 0.0


def train(setup: throughput.Setup, batches: list[dict[str, Any]], seed: int, device: torch.device) -> dict[str, Any]:
    """``batches`` steps of ``setup``'s run as the loop makes them, from ``seed``; the steps' losses and times."""
    cfg, run = setup.cfg, setup.run
    iters = 10_000  # the learning-rate schedule of a long run (its warm-up), as throughput.build's model's
    interval = cfg.train.log_every
    torch.manual_seed(seed)
    losses, seconds, logged_at = [], [], []
    throughput.reset_peak_memory(device)
    first = time.perf_counter()
    for i, batch in enumerate(batches):
        lr = learning_rate(i, iters // cfg.optim.epochs, base_lr=cfg.optim.lr, epochs=cfg.optim.epochs,
                           warmup_epochs=cfg.optim.warmup_epochs, end_lr=cfg.optim.end_lr,
                           cosine_per_epoch=cfg.optim.cosine_per_epoch)  # fmt: skip
        logged = logged_step(i + 1, interval, False)
        run.model.begin_step(logged, i)
        start = time.perf_counter()
        metrics = train_step(run, batch["image"], lr)
        throughput.synchronize(device)
        seconds.append(time.perf_counter() - start)
        losses.append(float(metrics["loss"]))
        if logged:
            logged_at.append(i)
    return {"losses": losses, "seconds": seconds, "logged": logged_at, "total_s": time.perf_counter() - first}


def final_tensors(setup: throughput.Setup) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in setup.run.model.state_dict().items() if v.is_floating_point()}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = build_parser().parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    graphed.STAND_IN = args.stand_in
    record = throughput.Records(args.jsonl, {"config": args.config, "overrides": args.overrides})
    lines: list[dict[str, Any]] = []

    def say(**fields: Any) -> None:
        record(**fields)
        lines.append(fields)
        print(fields, flush=True)

    where = (args.config, args.data, "device", 0, device, args.cache_dir)
    setups = {}
    for mode in ("graph", "off"):
        cfg = throughput.benchmark_config(*where, [*args.overrides, f"train.compile={mode}"])
        setups[mode] = throughput.build(mode, cfg, device, args.min_images)
    graph_setup, eager_setup = setups["graph"], setups["off"]
    step = graph_setup.run.step
    if not isinstance(step, graphed.GraphedStep):
        say(part="capture", error=f"no graphed step on {device.type} (--stand-in for the CPU's tape)")
        return lines
    batches = [next(graph_setup.batches) for _ in range(args.steps)]
    seed = graph_setup.cfg.train.seed

    run = train(graph_setup, batches, seed, device)
    replayed = [s for i, s in enumerate(run["seconds"]) if i not in run["logged"]][graphed.WARMUP_STEPS + 1 :]
    say(part="capture", captured=step.captured, eager_why=step.eager_why, capture_s=step.capture_s,
        warmup_steps=graphed.WARMUP_STEPS, first_replay_after_s=first_replay_after(run, step),
        operators=getattr(step.graph, "operators", None))  # fmt: skip
    say(part="graph_run", steps=args.steps, logged=run["logged"], total_s=run["total_s"],
        replay_median_s=statistics.median(replayed) if replayed else None, replays=step.replays,
        **throughput.peak_memory(device))  # fmt: skip
    graph_final = final_tensors(graph_setup)

    eager = train(eager_setup, batches, seed, device)
    unlogged = [s for i, s in enumerate(eager["seconds"]) if i not in eager["logged"]][graphed.WARMUP_STEPS + 1 :]
    say(part="eager_run", steps=args.steps, total_s=eager["total_s"],
        step_median_s=statistics.median(unlogged) if unlogged else None, **throughput.peak_memory(device))  # fmt: skip
    eager_final = final_tensors(eager_setup)
    worst = sorted(((relative_difference(graph_final[k], v), k) for k, v in eager_final.items()), reverse=True)
    loss_diff = [abs(a - b) / max(abs(b), 1e-30) for a, b in zip(run["losses"], eager["losses"], strict=True)]
    say(part="compare", steps=args.steps, precision=graph_setup.cfg.train.precision,
        loss_rel_diff_max=max(loss_diff), loss_rel_diff_last=loss_diff[-1],
        losses_graph=run["losses"][-3:], losses_eager=eager["losses"][-3:],
        state_rel_diff_max=worst[0][0], worst_tensors=[[k, d] for d, k in worst[:5]],
        bit_equal=all(d == 0.0 for d, _ in worst))  # fmt: skip

    error = None
    checked = 0
    if device.type == "cuda":
        torch.cuda.set_sync_debug_mode("error")
    try:
        fixed = batches[-1]
        for i in range(args.replays):
            graph_setup.run.model.begin_step(False, args.steps + i)
            train_step(graph_setup.run, fixed["image"], graph_setup.cfg.optim.lr)
            checked += 1
    except RuntimeError as err:
        error = str(err).splitlines()[0]
    finally:
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode(0)
    say(part="sync_check", replays=checked, error=error, checked=device.type == "cuda")
    return lines


def first_replay_after(run: dict[str, Any], step: graphed.GraphedStep) -> float | None:
    """Seconds from the first step's start to the end of the step that captured (its first replay), or ``None``."""
    if not step.captured:
        return None
    logged = set(run["logged"])
    unlogged = [i for i in range(len(run["seconds"])) if i not in logged]
    capture = unlogged[graphed.WARMUP_STEPS]
    return sum(run["seconds"][: capture + 1])


if __name__ == "__main__":
    main(sys.argv[1:])
