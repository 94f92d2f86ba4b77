"""Where a training step's time goes: a ``torch.profiler`` trace of a few end-to-end steps of one recipe.

Builds the run as ``benchmarks/throughput.py`` does (the loop's own builders, ``--pipeline``), warms it up, then
profiles ``--steps`` steps with the batch-making (``views``: the loader's next batch) and the step (``step``)
marked. Prints: wall seconds per step; the device's busy time per step (the sum of its kernels' times) and
the busy fraction (below 1: the device waits for the host, i.e. launches or the loader set the pace); kernel
launches per step; the time of each marked part; and the top operators by device time. ``--trace`` writes a
Chrome trace.

    python benchmarks/gpu_profile.py --config cifar10_resnet18 --data /tmp/c10/train --pipeline device \\
        data.batch_size=512 train.precision=bf16 train.channels_last=true
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from throughput import benchmark_config, build, step, synchronize
from torch.profiler import ProfilerActivity, profile, record_function


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--pipeline", default="device", choices=["workers", "device"])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--trace", default=None, help="write a Chrome trace here")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    cfg = benchmark_config(args.config, args.data, args.pipeline, args.workers, device, args.cache_dir, args.overrides)
    setup = build(args.pipeline, cfg, device, min_images=10_000)
    for _ in range(args.warmup):
        step(setup, next(setup.batches))
    synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            with record_function("views"):
                batch = next(setup.batches)
            with record_function("step"):
                step(setup, batch)
        synchronize(device)
        wall = (time.perf_counter() - start) / args.steps
    events = prof.key_averages()
    on_device = "device_time_total" if hasattr(events[0], "device_time_total") else "cuda_time_total"
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.time_range.elapsed_us() for e in kernels) / 1e6 / args.steps if kernels else float("nan")
    print(f"\n{args.config}, {args.pipeline} pipeline, batch {cfg.data.batch_size}, {cfg.train.precision}"
          f"{', channels_last' if cfg.train.channels_last else ''}: {args.steps} profiled steps")  # fmt: skip
    print(f"wall per step: {wall * 1e3:.1f} ms ({cfg.data.batch_size / wall:,.0f} images/s under the profiler)")
    if kernels:
        print(f"device busy per step: {busy * 1e3:.1f} ms (fraction {busy / wall:.2f}); "
              f"kernel launches per step: {len(kernels) / args.steps:.0f}")  # fmt: skip
    for part in ("views", "step"):
        marked = [e for e in events if e.key == part]
        if marked:
            cpu = marked[0].cpu_time_total / 1e3 / args.steps
            dev = getattr(marked[0], on_device, 0) / 1e3 / args.steps
            print(f"{part}: host {cpu:.1f} ms per step, device {dev:.1f} ms per step")
    sort = f"self_{on_device}" if device.type == "cuda" else "self_cpu_time_total"
    print(events.table(sort_by=sort, row_limit=args.top, max_name_column_width=60))
    if args.trace:
        prof.export_chrome_trace(args.trace)


if __name__ == "__main__":
    main(sys.argv[1:])
