"""Where a training step's time goes: a ``torch.profiler`` trace of a few end-to-end steps of one recipe.

Builds the run as ``benchmarks/throughput.py`` does (the loop's own builders, ``--pipeline``), warms it up, then
profiles ``--steps`` steps with the batch-making (``views``: the loader's next batch) and the step (``step``)
marked. Prints: wall seconds per step; the device's work per step (:func:`device_work`: its kernels, copies and
fills, not the profiler's own ranges) as the time the device was busy (the union of their intervals: two streams'
overlapping work counts once) and the busy fraction (below 1: the device waits for the host, i.e. launches or the
loader set the pace), and the kernel time summed on each stream (the device pipeline makes the next batch's views
on a side stream while the step runs on the main one, so the streams split the views' work from the step's), with
each stream's ``--top`` longest kernels (:func:`top_kernels`);
kernel launches per step; the host time of each marked part; and the top operators by device time. ``--trace``
writes a Chrome trace. (Before 2026-11-30 the busy time summed the marked ranges' device spans with the kernels:
an H200's profile of ``imagenet20_resnet18_full`` said "fraction 2.99".)

    python benchmarks/gpu_profile.py --config cifar10_resnet18 --data /tmp/c10/train --pipeline device \\
        data.batch_size=512 train.precision=bf16 train.channels_last=true
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterable

import torch
from throughput import benchmark_config, build, step, synchronize
from torch.profiler import ProfilerActivity, profile, record_function

#: The ranges this profile marks; their spans on the device are not work.
MARKED = ("views", "step")


def top_kernels(
    kernels: Iterable[tuple[int, str, int]], steps: int, top: int
) -> dict[int, list[tuple[str, float, float]]]:
    """The ``top`` kernels of each stream by time, from ``(stream, name, duration_ns)``: stream id -> ``[(name, ms
    per step, launches per step)]``, the longest first."""
    totals: dict[int, dict[str, list[float]]] = {}
    for stream, name, duration in kernels:
        entry = totals.setdefault(stream, {}).setdefault(name, [0.0, 0.0])
        entry[0] += duration / 1e6 / steps
        entry[1] += 1 / steps
    return {
        stream: sorted(((name, ms, n) for name, (ms, n) in names.items()), key=lambda row: -row[1])[:top]
        for stream, names in totals.items()
    }


def device_work(intervals: Iterable[tuple[int, int, int]], steps: int) -> dict[str, object]:
    """The device's work per step from ``(stream, start_ns, end_ns)`` of each kernel, copy and fill: ``busy_ms`` (the
    union of the intervals: the time anything ran), ``summed_ms`` (their durations added: more than ``busy_ms``
    where streams overlapped), ``launches`` and ``streams`` (stream id -> ``{"ms", "launches"}``, per step)."""
    spans = sorted((start, end, stream) for stream, start, end in intervals)
    busy = summed = 0
    streams: dict[int, dict[str, float]] = {}
    reach = None  # the end of the union so far
    for start, end, stream in spans:
        summed += end - start
        on = streams.setdefault(stream, {"ms": 0.0, "launches": 0})
        on["ms"] += (end - start) / 1e6 / steps
        on["launches"] += 1 / steps
        if reach is None or start >= reach:
            busy += end - start
            reach = end
        elif end > reach:
            busy += end - reach
            reach = end
    return {
        "busy_ms": busy / 1e6 / steps,
        "summed_ms": summed / 1e6 / steps,
        "launches": len(spans) / steps,
        "streams": streams,
    }


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
    raw = prof.profiler.kineto_results.events() if prof.profiler and prof.profiler.kineto_results else []
    on_gpu = [
        e
        for e in raw
        if e.device_type() == torch.autograd.DeviceType.CUDA and not e.is_user_annotation() and e.name() not in MARKED
    ]
    work = device_work(((e.device_resource_id(), e.start_ns(), e.end_ns()) for e in on_gpu), args.steps)
    print(f"\n{args.config}, {args.pipeline} pipeline, batch {cfg.data.batch_size}, {cfg.train.precision}"
          f"{', channels_last' if cfg.train.channels_last else ''}: {args.steps} profiled steps")  # fmt: skip
    print(f"wall per step: {wall * 1e3:.1f} ms ({cfg.data.batch_size / wall:,.0f} images/s under the profiler)")
    if on_gpu:
        print(f"device busy per step: {work['busy_ms']:.1f} ms (fraction {work['busy_ms'] / 1e3 / wall:.2f}); kernel "
              f"time summed {work['summed_ms']:.1f} ms; launches per step: {work['launches']:.0f}")  # fmt: skip
        tops = top_kernels(((e.device_resource_id(), e.name(), e.duration_ns()) for e in on_gpu), args.steps, args.top)
        for stream, on in sorted(work["streams"].items(), key=lambda item: -item[1]["ms"]):
            print(f"  stream {stream}: {on['ms']:.1f} ms of kernels a step, {on['launches']:.0f} launches; longest:")
            for name, ms, launches in tops[stream]:
                print(f"    {ms:7.2f} ms {launches:6.1f}x  {name[:110]}")
    for part in ("views", "step"):
        marked = [e for e in events if e.key == part]
        if marked:
            cpu = marked[0].cpu_time_total / 1e3 / args.steps
            print(f"{part}: host {cpu:.1f} ms per step")
    sort = f"self_{on_device}" if device.type == "cuda" else "self_cpu_time_total"
    print(events.table(sort_by=sort, row_limit=args.top, max_name_column_width=60))
    if args.trace:
        prof.export_chrome_trace(args.trace)


if __name__ == "__main__":
    main(sys.argv[1:])
