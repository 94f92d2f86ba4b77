"""obow's training step against the authors' (valeoai/obow) at identical shapes, in one alternating run.

Both steps train the same network on the same synthetic batch (random-noise images through the recipe's own
view transform, as ``benchmarks/step_time.py`` makes them) in fp32, from the same initial weights:

* **obow**: :func:`obow.training.loop.train_step` on a model and optimiser from the loop's own builders (the
  recipe with ``train.precision=fp32``, then each ``--obow-settings`` group's overrides: one obow setting per
  group, e.g. ``--obow-settings --obow-settings train.channels_last=false --obow-settings train.compile=step``);
* **authors**: their ``OBoWSolver.train_step`` (``obow/builder_obow.py`` of ``--official DIR``, a copy of
  valeoai/obow): their ``OBoW.forward``, the sum of its losses, ``backward`` and their ``torch.optim.SGD`` step
  (built by their ``Solver.initialize_optimizer``: every parameter that needs a gradient, the recipe's lr,
  momentum, Nesterov flag and weight decay), with their metric logging.

Identical shapes: their ``OBoW`` is handed, as its feature extractor, the recipe's backbone built by obow
(:class:`LevelsExtractor`: their ``feature_extractor(x)`` / ``feature_extractor(x, levels)`` call convention,
the pooled ``[N, C, 1, 1]`` feature or the asked levels' maps, the trunk run only as far as the deepest level
asked for, as their ResNet wrapper does, where the trunk is timm's ``features_only`` sequence); the same levels,
``K`` words, ``kappa``, ``1 / delta_base`` as their ``inv_delta``, pooling, queue sampling, teacher momentum and
its cosine over the same 10,000 iterations as obow's. Their student, teacher, vocabularies and weight generators
start from obow's initial values (copied in), so that the first step of each is the same computation: the
script checks it, comparing the first step's loss and the student's weights after it, and exits with status 1
when an fp32 setting disagrees (a recipe the authors' code cannot express, e.g. Sinkhorn codes, is refused).

Timing: one process, ``--warmup`` untimed steps of each after that first step, then ``--rounds`` rounds in
which every step runs once, in an order rotated by one each round (``step_time.time_interleaved``). Printed,
per step: the median seconds per step, images per second, and authors / step as the ratio of the medians and
as the median over rounds of the same round's ratio (the sturdier one on a busy machine; above 1: faster
than the authors'). ``--json PATH`` keeps it all with the machine (CPU model and its AVX2 / AVX-512 / BF16 /
AMX flags, cores, threads), torch and timm versions, the date and the command. Memory: on CUDA the peak a
first step allocates beyond what was allocated before it; on a CPU only the process's peak resident set.

How the authors' modules are loaded: their files import ``obow.utils`` and ``obow.solver`` (their package
is named ``obow``, like this one). :func:`load_official` executes their ``utils``, ``solver``, ``fewshot``,
``classification`` and ``builder_obow`` from ``DIR/obow/`` under those names, registering them in
``sys.modules`` only while they import each other, then removes them (this package's ``obow`` is untouched).
Their files are not edited. The one setting changed on their objects: ``BoWExtractor._decay`` (their EMA
momentum of the mean distance to the nearest word, 0.99 in their code) is set to the recipe's
``model.temperature_momentum`` (the same 0.99 in most recipes; ``cifar10_fast``: 0.9), and their
``_min_distance_mean`` (0.5 in their code) to ``model.temperature_init`` (the same 0.5 unless a recipe changes it).

    python benchmarks/official_step.py --official /work/official-obow --config demo --rounds 7 --json s.json
    python benchmarks/official_step.py --official DIR --config cifar10_fast --threads 2 \\
        --obow-settings --obow-settings train.channels_last=false --obow-settings train.compile=step
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import importlib.util
import json
import os
import resource
import shlex
import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).parent))
import demo_time  # noqa: E402
import step_time  # noqa: E402

from obow.backbones import Backbone, build_backbone  # noqa: E402
from obow.config import Config, load_config  # noqa: E402
from obow.training.loop import Run  # noqa: E402
from obow.training.step.shared import to_device  # noqa: E402

#: the authors' modules a training step needs, in the order they import each other
OFFICIAL_MODULES = ("utils", "solver", "fewshot", "classification", "builder_obow")
#: the teacher momentum schedule's length on both sides (step_time's ``training_run`` uses the same)
TOTAL_ITERATIONS = 10_000
AUTHORS = "authors"


def load_official(root: Path) -> dict[str, ModuleType]:
    """The authors' modules from ``root/obow/`` (see the module's docstring); ``SystemExit`` with one line when
    ``root`` does not hold their code or it does not import."""
    package = root / "obow"
    builder = package / "builder_obow.py"
    missing = [name for name in OFFICIAL_MODULES if not (package / f"{name}.py").is_file()]
    if missing or "class OBoWSolver" not in builder.read_text(errors="replace"):
        raise SystemExit(
            f"--official {root}: not a copy of the authors' code (valeoai/obow): it needs obow/builder_obow.py "
            f"(with OBoWSolver) and obow/{{{','.join(OFFICIAL_MODULES[:-1])}}}.py"
            + (f"; missing: {', '.join(f'obow/{m}.py' for m in missing)}" if missing else "")
        )
    import obow as ours

    keys = [f"obow.{name}" for name in OFFICIAL_MODULES]
    saved = {key: sys.modules.get(key) for key in keys}
    loaded: dict[str, ModuleType] = {}
    try:
        for name, key in zip(OFFICIAL_MODULES, keys, strict=True):
            spec = importlib.util.spec_from_file_location(key, package / f"{name}.py")
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[key] = module
            spec.loader.exec_module(module)
            loaded[name] = module
    except Exception as err:  # their code, any failure: one line
        raise SystemExit(f"--official {root}: the authors' obow/{name}.py does not import here ({err!r})") from None
    finally:
        for name, key in zip(OFFICIAL_MODULES, keys, strict=True):
            if saved[key] is None:
                sys.modules.pop(key, None)
            else:
                sys.modules[key] = saved[key]  # type: ignore[assignment]
            if name in loaded and getattr(ours, name, None) is loaded[name]:
                delattr(ours, name)
    return loaded


class LevelsExtractor(nn.Module):
    """An obow backbone behind the authors' feature-extractor call convention (their
    ``SequentialFeatureExtractorAbstractClass.forward``): ``f(x)`` -> the global average of the last stage,
    ``[N, C, 1, 1]``; ``f(x, levels)`` -> the asked levels' maps (a list in the asked order, the tensor itself
    for one level). The trunk stops after the deepest asked level where it is a sequence of modules (timm's
    ``features_only`` networks, as their ResNet wrapper stops after its last asked block); other trunks (a
    torchvision graph) run whole."""

    def __init__(self, backbone: Backbone) -> None:
        super().__init__()
        self.backbone = backbone

    def forward(self, x: Tensor, out_feat_keys: Sequence[str] | None = None) -> Tensor | list[Tensor]:
        if out_feat_keys is None:
            return self.backbone(x).pool5[:, :, None, None]
        maps = self.level_maps(x, tuple(out_feat_keys))
        out = [maps[level] for level in out_feat_keys]
        return out[0] if len(out) == 1 else out

    def level_maps(self, x: Tensor, levels: tuple[str, ...]) -> dict[str, Tensor]:
        body = self.backbone.body
        return_layers = getattr(body, "return_layers", None)
        if not isinstance(body, nn.ModuleDict) or not isinstance(return_layers, dict):
            return self.backbone(x, levels=levels).maps
        wanted = {self.backbone.level_index[level]: level for level in levels}
        maps: dict[str, Tensor] = {}
        stage = 0
        for name, module in body.items():
            x = module(x)
            if name in return_layers:
                if stage in wanted:
                    maps[wanted[stage]] = x
                if len(maps) == len(wanted):
                    break
                stage += 1
        return maps


def refuse_unless_expressible(cfg: Config) -> None:
    """``SystemExit`` with one line when the authors' code cannot compute the recipe's step."""
    m, o = cfg.model, cfg.optim
    differences = {
        "model.method": (m.method, "obow"),
        "model.assignment": (m.assignment, "soft or hard"),
        "model.border": (m.border, 1),
        "model.vocabulary": (m.vocabulary, "queue"),
        "model.queue_sampling": (m.queue_sampling, "local_average or global_average"),
        "model.head": (m.head, "dynamic"),
        "model.normalize_student": (m.normalize_student, False),
        "model.loss_weighting": (m.loss_weighting, "group_sum"),
        "model.cutmix": (m.cutmix, False),
        "model.temperature_init": (m.temperature_init, "a number"),
        "optim.decay_norm_and_bias": (o.decay_norm_and_bias, True),
    }
    fits = {
        "model.method": m.method == "obow",
        "model.assignment": m.assignment in ("soft", "hard"),
        "model.border": m.border == 1,
        "model.vocabulary": m.vocabulary == "queue",
        "model.queue_sampling": m.queue_sampling in ("local_average", "global_average"),
        "model.head": m.head == "dynamic",
        "model.normalize_student": not m.normalize_student,
        "model.loss_weighting": m.loss_weighting == "group_sum",
        "model.cutmix": not m.cutmix,
        "model.temperature_init": m.temperature_init is not None,
        "optim.decay_norm_and_bias": o.decay_norm_and_bias,
    }
    wrong = [f"{key}={differences[key][0]} (theirs: {differences[key][1]})" for key, ok in fits.items() if not ok]
    if wrong:
        raise SystemExit(f"the authors' code cannot compute this recipe's step: {'; '.join(wrong)}")
    if m.num_words % cfg.data.batch_size:
        raise SystemExit(
            f"the authors' queue needs model.num_words ({m.num_words}) divisible by the batch "
            f"({cfg.data.batch_size}): choose another --batch"
        )


def authors_model(official: dict[str, ModuleType], cfg: Config, run: Run, device: torch.device) -> nn.Module:
    """Their ``OBoW`` for ``cfg`` on obow's backbone, starting from ``run``'s model as it is now."""
    m = cfg.model
    ours = run.model
    student = build_backbone(m.arch, m.stem, m.arch_options)  # fresh, contiguous: obow's memory format not inherited
    student.load_state_dict(ours.student.state_dict())
    extractor_opts = [
        {
            "num_words": m.num_words,
            "num_channels": student.level_channels[level],
            "update_type": m.queue_sampling,
            "inv_delta": None if m.assignment == "hard" else 1.0 / m.delta_base,
            "bow_pool": m.pooling,
        }
        for level in m.levels
    ]
    cosine = m.teacher_momentum_schedule == "cosine"
    alpha: Any = (m.teacher_momentum, TOTAL_ITERATIONS) if cosine else m.teacher_momentum
    model = official["builder_obow"].OBoW(
        LevelsExtractor(student),
        student.num_features,
        list(m.levels),
        extractor_opts,
        {"kappa": m.kappa, "learn_kappa": m.learn_kappa},
        alpha=alpha,
        num_classes=None,
    )
    with torch.no_grad():
        model.feature_extractor_teacher.backbone.load_state_dict(ours.teacher.state_dict())
        for i, level in enumerate(m.levels):
            theirs = model.bow_extractor.bow_extractor[i]
            extractor = ours.extractors[level]
            theirs._embedding.copy_(extractor.vocabulary.words)
            theirs._min_distance_mean.fill_(float(m.temperature_init))  # type: ignore[arg-type]
            theirs._decay = m.temperature_momentum
            generator, head = model.bow_predictor.layers_w[i], ours.predictor.generators[i]
            getattr(generator, f"b{i}_fc").load_state_dict(head.fc1.state_dict())
            getattr(generator, f"b{i}_bn").load_state_dict(head.bn.state_dict())
            getattr(generator, f"b{i}_last_layer").load_state_dict(head.fc2.state_dict())
    return model.to(device).train()


def authors_step(
    official: dict[str, ModuleType], cfg: Config, model: nn.Module, batch: dict[str, Tensor], device: torch.device
) -> Callable[[], None]:
    """One call = their ``OBoWSolver.train_step`` on ``batch`` (the teacher images, then the view groups as 5-D
    tensors, which their step flattens; labels unused: no monitoring head)."""
    o = cfg.optim
    opts = {
        "optim_type": "sgd",
        "lr": o.lr,
        "momentum": o.momentum,
        "weight_decay": o.weight_decay,
        "nesterov": o.nesterov,
        "num_epochs": o.epochs,
        "lr_schedule_type": "cos",
    }
    with tempfile.TemporaryDirectory(prefix="official-step-") as exp_dir:  # their Solver makes it; a step never writes
        solver = official["builder_obow"].OBoWSolver(model, exp_dir, None, opts)
    solver.initialize_optimizer()
    teacher, groups = to_device(batch, device, channels_last=False)
    images = [teacher.contiguous(), *(g.contiguous() for g in groups)]
    labels = torch.zeros(teacher.shape[0], dtype=torch.long, device=device)
    metrics = official["utils"].MetricLogger()
    return lambda: solver.train_step((images, labels), metrics)


def flat_parameters(module: nn.Module) -> Tensor:
    return torch.cat([p.detach().float().flatten().cpu() for p in module.parameters()])


def setting_name(overrides: Sequence[str]) -> str:
    return " ".join(["obow", *overrides])


def obow_config(args: argparse.Namespace, overrides: Sequence[str]) -> Config:
    batch = [f"data.batch_size={args.batch}"] if args.batch else []
    return load_config(args.config, [*batch, "train.precision=fp32", *overrides])


def peak_step_mib(step: Callable[[], None], device: torch.device) -> float | None:
    """Run ``step`` once; on CUDA, the peak it allocated beyond what was allocated before it (MiB)."""
    if device.type != "cuda":
        step()
        return None
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def first_steps(
    official: dict[str, ModuleType], args: argparse.Namespace, device: torch.device
) -> tuple[dict[str, Callable[[], None]], dict[str, dict[str, Any]], Config]:
    """Build every step, run each once from the same initial weights, and compare each obow setting's first step
    with the authors': its loss, and the student's weights after it."""
    settings = args.obow_settings or [[]]
    cfgs = {setting_name(s): obow_config(args, s) for s in settings}
    if len(cfgs) < len(settings):
        raise SystemExit("--obow-settings: the same setting twice")
    for cfg in cfgs.values():
        refuse_unless_expressible(cfg)
    base = next(iter(cfgs.values()))
    torch.manual_seed(0)  # the views' random draws: the same batch on every invocation
    batch = step_time.synthetic_batch(base)
    runs: dict[str, Run] = {}
    for name, cfg in cfgs.items():
        torch.manual_seed(0)  # every model starts from the same weights and vocabularies
        runs[name] = step_time.training_run(cfg, device)
    initial = flat_parameters(next(iter(runs.values())).model.student)

    model = authors_model(official, base, next(iter(runs.values())), device)
    steps = {AUTHORS: authors_step(official, base, model, batch, device)}
    losses: list[Tensor] = []
    hook = model.register_forward_hook(lambda _m, _i, out: losses.append(out[0].detach().sum().cpu()))
    report: dict[str, dict[str, Any]] = {AUTHORS: {"peak_step_mib": peak_step_mib(steps[AUTHORS], device)}}
    hook.remove()
    theirs_loss, theirs_student = float(losses[0]), flat_parameters(model.feature_extractor)
    change = float((theirs_student - initial).abs().max())
    report[AUTHORS].update(first_loss=theirs_loss, student_max_abs_change=change)

    for (name, run), overrides in zip(runs.items(), settings, strict=True):
        if not torch.equal(flat_parameters(run.model.student), initial):
            raise SystemExit(f"{name}: its model did not start from the same weights as the first setting's")
        step = step_time.timed_step(run, batch)
        loss, memory = first_obow_step(run, batch, device)
        entry = {
            "overrides": list(overrides),
            "peak_step_mib": memory,
            "first_loss": loss,
            "first_loss_relative_difference": abs(loss - theirs_loss) / max(abs(theirs_loss), 1e-12),
            "student_max_abs_difference": float((flat_parameters(run.model.student) - theirs_student).abs().max()),
            "fp32": run.cfg.train.precision == "fp32",
        }
        entry["same_computation"] = same_computation(entry, change)
        report[name] = entry
        steps[name] = step
    return steps, report, base


def first_obow_step(run: Run, batch: dict[str, Tensor], device: torch.device) -> tuple[float, float | None]:
    """Run ``run``'s first step: its loss and its peak memory (:func:`peak_step_mib`)."""
    metrics: list[dict[str, Tensor]] = []
    memory = peak_step_mib(lambda: metrics.append(step_time.timed_step(run, batch)()), device)
    return float(metrics[0]["loss"]), memory


def same_computation(entry: dict[str, Any], change: float) -> bool:
    """The first step's loss within 1e-4 (relative) of the authors', and the student's weights after it within
    1% of the step's largest change of a weight (at least 1e-6) of theirs: fp32 summation orders, not another
    computation (a step at another learning rate, or without one group's gradient, is far outside)."""
    return entry["first_loss_relative_difference"] < 1e-4 and entry["student_max_abs_difference"] <= max(
        1e-6, 0.01 * change
    )


def describe(args: argparse.Namespace, cfg: Config, device: torch.device) -> str:
    v, m = cfg.views, cfg.model
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    return (
        f"{args.config}: {m.arch} ({m.stem} stem), batch {cfg.data.batch_size}, teacher {v.teacher_size} px, "
        f"{v.num_crops} x {v.crop_size} px crops"
        + (f" + {v.num_patches} x {v.patch_size} px patches" if v.num_patches else "")
        + f", K={m.num_words}, {'+'.join(m.levels)}, "
        f"fp32; {where}"
    )


def table(times: dict[str, list[float]], batch: int) -> list[str]:
    ratios = step_time.speedups(times, AUTHORS)
    lines = [
        f"| {'step':40s} | {'median s/step':>13s} | {'img/s':>7s} | {'authors / step':>14s} | {'per round':>9s} |",
        f"|{'-' * 42}|{'-' * 15}|{'-' * 9}|{'-' * 16}|{'-' * 11}|",
    ]
    for name, t in times.items():
        median = statistics.median(t)
        of_medians, per_round = ratios[name]
        lines.append(f"| {name:40s} | {median:13.4f} | {batch / median:7.1f} | {of_medians:14.2f} | {per_round:9.2f} |")
    for name in list(times)[1:]:
        of_medians, per_round = ratios[name]
        lines.append(
            f"authors / {name}: {per_round:.2f} (median over rounds of the round's ratio; {of_medians:.2f} ratio of "
            "the medians; above 1: obow's step is faster)"
        )
    return lines


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--official", type=Path, required=True, help="a copy of valeoai/obow (holds obow/builder_obow.py)"
    )
    parser.add_argument("--config", default="demo", help="a built-in recipe or a YAML file (default: demo)")
    parser.add_argument("--batch", type=int, default=0, help="images per step (default: the recipe's batch)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=cores, help=f"intra-op threads (default: {cores}, the cores)")
    parser.add_argument("--rounds", type=int, default=7, help="alternating timed rounds (default: 7)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps of each after the first (default: 2)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument(
        "--obow-settings",
        nargs="*",
        action="append",
        metavar="KEY=VALUE",
        help="one obow setting: overrides on top of the recipe at fp32 (repeat for several; none: the recipe)",
    )
    args = parser.parse_args(argv)
    if args.threads < 1 or args.rounds < 1 or args.warmup < 0 or args.batch < 0:
        parser.error("--threads and --rounds must be at least 1, --warmup and --batch at least 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    official = load_official(args.official)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    try:
        steps, report, cfg = first_steps(official, args, device)
    except ValueError as err:  # a recipe or override obow refuses: its own one-line message
        raise SystemExit(f"{args.config}: {err}") from None
    times = step_time.time_interleaved(steps, args.warmup, args.rounds, device)
    ratios = step_time.speedups(times, AUTHORS)
    rounds = f"{args.rounds} alternating rounds after 1 + {args.warmup} untimed steps each"
    print(f"\n{describe(args, cfg, device)}; {rounds}")
    print("\n".join(table(times, cfg.data.batch_size)))
    disagree = [name for name, entry in report.items() if name != AUTHORS and not entry["same_computation"]]
    for name, entry in report.items():
        if name != AUTHORS:
            print(
                f"first step, {name}: loss {entry['first_loss']:.6f} against the authors' "
                f"{report[AUTHORS]['first_loss']:.6f}, student weights within "
                f"{entry['student_max_abs_difference']:.2e} of theirs (a weight moved up to "
                f"{report[AUTHORS]['student_max_abs_change']:.2e}): "
                + ("the same computation" if entry["same_computation"] else "NOT the same computation")
            )
    for name, t in times.items():
        report[name].update(
            seconds=t,
            median_s=statistics.median(t),
            authors_over_step_of_medians=ratios[name][0],
            authors_over_step_per_round=ratios[name][1],
        )
    if args.json:
        result = {
            "command": " ".join(shlex.quote(a) for a in [sys.executable, __file__, *argv]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cpu": demo_time.cpu_kind(),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "timm": _version("timm"),
            "setup": describe(args, cfg, device),
            "rounds": args.rounds,
            "warmup": args.warmup,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # KiB on Linux
            "steps": report,
        }
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    bad = [name for name in disagree if report[name]["fp32"]]
    if bad:
        print(f"not the authors' computation at fp32: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


def _version(name: str) -> str | None:
    with contextlib.suppress(ImportError):
        return str(importlib.import_module(name).__version__)
    return None


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
