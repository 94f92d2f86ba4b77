"""How many graphs ``train.compile=step`` runs a step, and their size: the forward-backward and the optimiser step
compiled with ``backend="aot_eager"`` (the same graphs Inductor would get, without its minutes of C++), on
random views of the recipe's shapes, over unlogged and logged steps. A graph is one call from the host (one
CUDA-graph replay with ``mode="reduce-overhead"``); a number that grows after the first logged step is a
recompilation.

    python benchmarks/step_graphs.py --config demo model.num_words=64 data.batch_size=8
"""

from __future__ import annotations

import argparse
import contextlib

import torch
from torch._dynamo.testing import CompileCounterWithBackend

from obow.config import load_config
from obow.training.build import build_model, build_optimizer
from obow.training.step.compiled import CompiledStep, step_per_group
from obow.training.step.shared import forward_backward


def random_views(cfg, batch: int, generator: torch.Generator) -> tuple[torch.Tensor, list[torch.Tensor]]:
    v = cfg.views
    teacher = torch.rand(batch, 3, v.teacher_size, v.teacher_size, generator=generator)
    groups = [(v.num_crops, v.crop_size), (v.num_patches, v.patch_size)]
    return teacher, [torch.rand(batch, n, 3, s, s, generator=generator) for n, s in groups if n]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="demo")
    parser.add_argument("--steps", type=int, default=4, help="steps; the third is logged")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = load_config(args.config, args.overrides)
    model = build_model(cfg, args.steps, torch.device("cpu")).train()
    optimizer = build_optimizer(model, cfg)
    per_group = step_per_group(cfg.train.backward_per_group and model.supports_groups)
    passes, optimiser = CompileCounterWithBackend("aot_eager"), CompileCounterWithBackend("aot_eager")

    def body(teacher, views):
        return forward_backward(model, teacher, views, None, contextlib.nullcontext(), per_group)

    step = CompiledStep(model, optimizer, body, backend=passes)
    step._step = torch.compile(step._optimizer_step, backend=optimiser)
    generator = torch.Generator().manual_seed(0)
    for i in range(args.steps):
        model.diagnose, model.host_iteration = i == 2, i
        step(*random_views(cfg, cfg.data.batch_size, generator), 0.01)
        print(
            f"after step {i + 1} ({'logged' if i == 2 else 'unlogged'}): forward-backward graphs compiled "
            f"{passes.frame_count} ({passes.op_count} operators in all), optimiser graphs {optimiser.frame_count} "
            f"({optimiser.op_count} operators)"
        )


if __name__ == "__main__":
    main()
