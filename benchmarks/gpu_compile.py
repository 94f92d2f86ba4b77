"""The compiled step (``train.compile: step``) replayed as CUDA graphs: does anything make Inductor skip them, and
does an unlogged step make the host wait for the device?

The recipe's run is built as benchmarks/throughput.py builds it (device pipeline by default), with
``train.compile=step`` and the step's Inductor option ``triton.cudagraphs`` (what ``mode="reduce-overhead"``
sets; ``--no-cudagraphs``: without). ``--warmup`` steps are run, the first one logged (so that both variants of
the forward-backward graph are compiled and recorded), then, on one batch already on the device:

* ``cudagraph_skips``: Inductor's count of graphs it did not replay as CUDA graphs
  (``torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]``; must be 0), with the reasons it logged
  ("skipping cudagraphs due to ...", captured from the ``torch._inductor`` loggers);
* ``graph_breaks`` and ``unique_graphs``: Dynamo's counters (the forward-backward graphs are ``fullgraph``: a break
  there is an error, not a count; the two "user-inserted" breaks are torch.optim's own, around the optimiser
  step; 3 graphs: unlogged and logged forward-backward, optimiser; on a GPU a 4th, the device pipeline's compiled
  render, :func:`obow.data.batched_views.compiled_render`);
* ``sync_error``: ``--checked`` unlogged steps under ``torch.cuda.set_sync_debug_mode("error")``, where an
  operation that synchronises the host with the device raises; ``null`` when none did (the error's text
  otherwise).

Prints one JSON object (and writes it to ``--json``). On a CPU (``--device cpu``, a dry run of the plumbing)
there are no CUDA graphs and no synchronisation check.

    python benchmarks/gpu_compile.py --config cifar10_resnet18 --data /tmp/c10/train data.batch_size=512 \\
        train.precision=bf16 train.channels_last=true
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import throughput
import torch

from obow.training.step import compiled as compiled_module


class Reasons(logging.Handler):
    """The messages of Inductor's loggers that say a graph is not replayed as a CUDA graph."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "skipping cudagraphs" in message.lower() or "cudagraph" in message.lower() and "skip" in message.lower():
            self.seen.append(message[:500])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--data", required=True, help="a folder of training images")
    parser.add_argument("--pipeline", default="device", choices=["workers", "device"])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--warmup", type=int, default=6, help="steps before the checks, the first one logged")
    parser.add_argument("--checked", type=int, default=3, help="unlogged steps under the synchronisation check")
    parser.add_argument("--min-images", type=int, default=2_000)
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--no-cudagraphs", action="store_true", help="compile the step without CUDA graphs")
    parser.add_argument("--compile-backend", default="inductor", help="aot_eager: a dry run without Inductor")
    parser.add_argument("--json", default=None, help="write the result here too")
    parser.add_argument("overrides", nargs="*", help="recipe overrides, key=value")
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    compiled_module.BACKEND = args.compile_backend
    if cuda and not args.no_cudagraphs and args.compile_backend == "inductor":
        compiled_module.OPTIONS = {"triton.cudagraphs": True}
    reasons = Reasons()
    for name in ("torch._inductor", "torch._inductor.cudagraph_trees", "torch._inductor.cudagraph_utils"):
        logging.getLogger(name).addHandler(reasons)
    from torch._dynamo.utils import counters

    # this torch's probes (each a toy graph, compiled once a process) before the count: only the step's graphs count
    compiled_module.traces_leaf_tensors()
    compiled_module.lerps_as_eager()
    # and a fresh Dynamo: what this process compiled before (another test's step on the same network) is compiled
    # again and counted, so the count is this step's whatever ran earlier
    torch._dynamo.reset()
    counters.clear()
    overrides = [*args.overrides, "train.compile=step"]
    cfg = throughput.benchmark_config(
        args.config, args.data, args.pipeline, args.workers, device, args.cache_dir, overrides
    )
    setup = throughput.build("compiled step", cfg, device, args.min_images)
    start = time.perf_counter()
    for i in range(args.warmup):
        throughput.step(setup, next(setup.batches), logged=i == 0)
    fixed = next(setup.batches)
    throughput.step(setup, fixed, logged=False)
    throughput.synchronize(device)
    warmup_s = time.perf_counter() - start
    sync_error = None
    if cuda:
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(args.checked):
                throughput.step(setup, fixed, logged=False)
        except RuntimeError as err:
            sync_error = str(err).splitlines()[0][:500]
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        torch.cuda.synchronize(device)
    result = {
        "config": args.config,
        "overrides": overrides,
        "device": torch.cuda.get_device_name(device) if cuda else "CPU",
        "torch": torch.__version__,
        "cudagraphs": bool(compiled_module.OPTIONS and compiled_module.OPTIONS.get("triton.cudagraphs")),
        "warmup_steps": args.warmup + 1,
        "warmup_s": round(warmup_s, 1),
        "cudagraph_skips": int(counters["inductor"]["cudagraph_skips"]),
        "cudagraph_skip_reasons": reasons.seen,
        "graph_breaks": {k.splitlines()[0]: int(v) for k, v in counters["graph_break"].items()},
        "unique_graphs": int(counters["stats"]["unique_graphs"]),
        "sync_checked_steps": args.checked if cuda else 0,
        "sync_error": sync_error,
    }
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
