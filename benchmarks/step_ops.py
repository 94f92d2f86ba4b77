"""How many operations one training step issues, and where: the host-side cost that CUDA launches pay.

On a GPU each operation that computes something (not a view) is at least one kernel launch, and the profile in
docs/results/gpu_profile.md found the step bound by the host issuing them. This counts them on any device, a
CPU included, with a ``TorchDispatchMode`` that sees every operation below autograd (the backward pass and the
optimiser too): views and other aliases are left out, everything else is counted once. Among them, the reads of a
device value by the host (``_local_scalar_dense``: ``.item()``, ``int()``, ``bool()`` of a tensor), each of which
makes the host wait for the device on a GPU, so that it cannot issue the next step's work ahead. Each is attributed to
the innermost obow source file and function on the Python stack (``backward`` for the autograd engine's work,
``optimizer`` for ``torch.optim``), for a logged step (diagnostics computed) and an unlogged one, and for
rendering a batch's views on the device pipeline. The views are rendered from images on PyTorch's ``meta``
device (shapes, no data) so that their device work (on ``meta``) and the drawing and bookkeeping of their
parameters on the host's CPU are told apart, whichever device runs the step.

    python benchmarks/step_ops.py --config cifar10_resnet18 --data /tmp/c10/train --batch 64
    python benchmarks/step_ops.py --config cifar10_resnet18 --data /tmp/c10/train --json ops.json

A count is a lower bound of the kernel launches on a GPU (a cuDNN convolution may launch several, autocast
adds casts of the weights); the profiler's launch count is in gpu_profile.py.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import sys
from pathlib import Path
from typing import Any

import torch
from throughput import benchmark_config, build, step
from torch.utils._python_dispatch import TorchDispatchMode

import obow


def is_alias(func: Any) -> bool:
    """Whether an operator only returns a view of (or writes nothing new beside) its input: no kernel."""
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


OBOW = Path(obow.__file__).resolve().parent


@functools.cache
def obow_module(filename: str) -> str | None:
    """The obow module (``bow.targets``) whose source ``filename`` is, ``None`` for any other file: judged by the
    package's own folder, not by ``/obow/`` in the path, which also holds torch's files when the clone is a folder
    named ``obow`` with its venv inside."""
    path = Path(filename).resolve()
    if not path.is_relative_to(OBOW):
        return None
    return ".".join(path.relative_to(OBOW).with_suffix("").parts)


def call_site() -> str:
    """``module:function`` of the innermost obow frame, ``backward`` inside the autograd engine, ``optimizer``
    inside ``torch.optim``."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename.replace("\\", "/")
        if "/torch/autograd/" in name and frame.f_code.co_name in ("backward", "_engine_run_backward"):
            return "backward"
        if "/torch/optim/" in name:
            return "optimizer"
        module = obow_module(frame.f_code.co_filename)
        if module is not None:
            return f"{module}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "other"


class OpCounter(TorchDispatchMode):
    """Counts the non-alias operations dispatched inside it, by call site and by operator; with ``device_type``,
    only those with a tensor (argument or result) on that kind of device, and the others as ``host``."""

    def __init__(self, device_type: str | None = None) -> None:
        super().__init__()
        self.device_type = device_type
        self.sites: collections.Counter[str] = collections.Counter()
        self.operators: collections.Counter[str] = collections.Counter()
        self.host = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        if not is_alias(func):
            if self.device_type is None or any(
                isinstance(t, torch.Tensor) and t.device.type == self.device_type
                for t in torch.utils._pytree.tree_leaves((args, kwargs, out))
            ):
                self.sites[call_site()] += 1
                self.operators[func.overloadpacket.__name__] += 1
            else:
                self.host += 1
        return out

    @property
    def total(self) -> int:
        return sum(self.sites.values())


def count(fn: Any, device_type: str | None = None) -> OpCounter:
    counter = OpCounter(device_type)
    with counter:
        fn()
    return counter


def views_ops(cfg: Any, batch: int) -> OpCounter:
    """The device-side operations of rendering one batch's views (:class:`~obow.data.batched_views.BatchedViews`),
    with parameters drawn as the device pipeline draws them."""
    from obow.methods import build_batched_views, views_side

    side = views_side(cfg.views)
    views = build_batched_views(cfg, side)
    params = views.draw(batch, torch.Generator().manual_seed(0))
    images = torch.empty(batch, 3, side, side, dtype=torch.uint8, device="meta")
    return count(lambda: views.render(images, params), "meta")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--pipeline", default="device", choices=["workers", "device"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=None, help="data.batch_size (default: the recipe's)")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--json", default=None, help="write the counts here")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    batch = [f"data.batch_size={args.batch}"] if args.batch else []
    cfg = benchmark_config(args.config, args.data, args.pipeline, 0, device, args.cache_dir, [*batch, *args.overrides])
    setup = build(args.pipeline, cfg, device, min_images=4 * cfg.data.batch_size)
    batch = next(setup.batches)
    setup.diagnose_every = 2
    for _ in range(2):  # the optimiser's state and the lazily built parts exist after the first steps
        step(setup, batch)
    unlogged = count(lambda: step(setup, batch))  # step 3 of diagnose_every 2: unlogged
    logged = count(lambda: step(setup, batch))
    counted = {
        "step (unlogged)": unlogged,
        "step (logged)": logged,
        "views (device side)": views_ops(cfg, cfg.data.batch_size),
    }
    print(f"\n{args.config}, batch {cfg.data.batch_size}, {cfg.train.precision}, {device.type}: operations "
          f"(not views/aliases) per step")  # fmt: skip
    for name, counter in counted.items():
        print(f"{name}: {counter.total:,}" + (f" (and {counter.host:,} on the host)" if counter.host else ""))
    print(
        "reads of a device value by the host (.item(), int(), bool(); each a wait for the device on a GPU): "
        + ", ".join(f"{name} {c.operators.get('_local_scalar_dense', 0)}" for name, c in counted.items())
    )
    print("\nby call site, unlogged step (logged step beside it):")
    for site, n in unlogged.sites.most_common(args.top):
        print(f"{n:7,d} {logged.sites[site]:7,d}  {site}")
    extra = logged.sites - unlogged.sites
    print(f"\nonly on logged steps: {sum(extra.values()):,}")
    for site, n in extra.most_common(args.top):
        print(f"{n:7,d}  {site}")
    print("\nby operator, unlogged step:")
    for op, n in unlogged.operators.most_common(args.top):
        print(f"{n:7,d}  {op}")
    print("\nviews, by call site:")
    for site, n in counted["views (device side)"].sites.most_common(args.top):
        print(f"{n:7,d}  {site}")
    result = {
        "config": args.config,
        "batch": cfg.data.batch_size,
        "device": device.type,
        "precision": cfg.train.precision,
        "overrides": args.overrides,
        **{
            name: {"total": c.total, "host": c.host, "sites": dict(c.sites), "operators": dict(c.operators)}
            for name, c in counted.items()
        },
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
