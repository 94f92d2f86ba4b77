"""How long ``obow demo`` takes on this machine, and what it gains: one plain demo per seed, one after the other.

Each seed runs ``python -m obow demo --out OUT/seed<N> train.seed=<N>`` (plus ``--recipe`` and the overrides
given) in a child process, as a user runs it: the demo picks its recipe for this CPU
(:func:`obow.experiments.demo.choose_recipe`), its threads and its precision itself. Per seed it records the
wall time, the child's CPU time (user and system: on a quiet machine a 2-thread run's wall time is about half of
it; on a loaded one the wall time grows and the CPU time much less), the load average before and after, the
recipe and precision the run used, the pretraining's time per part (the epochs' steps, the kNN monitor: from the
run's ``log.jsonl``) and the kNN gain (pretrained minus random init, ``demo_results.json``). Beside them: the CPU
kind (model name, AVX2 / AVX-512F / AVX-512 BF16 / AMX flags, :func:`obow.training.run.precision.native_bf16`), the
cores and the torch version. Prints one line per seed and writes ``--json``.

    python benchmarks/demo_time.py --json demo_time.json                 # seed 0: the demo's timing here
    python benchmarks/demo_time.py --seeds 0 1 2 --json demo_time.json   # the 3 seeds of docs/results/demo.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from obow.training.run.precision import native_bf16

#: /proc/cpuinfo flags that decide which arithmetic a CPU computes fast.
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/demo-time"), help="one demo folder per seed under it")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--recipe", help="obow demo --recipe (default: the demo's own choice for this CPU)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("overrides", nargs="*", help="key=value changes passed to obow demo")
    return parser


def cpu_kind() -> dict:
    """This CPU: its model, the flags of :data:`CPU_FLAGS` it has (Linux; ``None`` elsewhere), whether it computes
    bfloat16 natively, its cores, and the kernels the environment leaves PyTorch and oneDNN (capped at AVX2 they
    are an AVX2 CPU's on any newer one)."""
    model, flags = platform.processor() or platform.machine(), None
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        lines = cpuinfo.read_text().splitlines()
        model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), model)
        have = set(next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), []))
        flags = {flag: flag in have for flag in CPU_FLAGS}
    bf16 = native_bf16(torch.device("cpu"))
    return {
        "model": model,
        "flags": flags,
        "native_bf16": bf16,
        "kind": "native bf16 (AVX-512 BF16 or AMX)" if bf16 else "no native bf16 (the demo runs fp32)",
        "cores": os.cpu_count(),
        # the kernels run: an AVX2 CPU's on a newer one where the environment caps them (docs/results/demo.md)
        "aten_capability": torch.backends.cpu.get_cpu_capability(),
        "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA"),
        "mkl_enable_instructions": os.environ.get("MKL_ENABLE_INSTRUCTIONS"),
    }


def pretraining_parts(log_path: Path) -> dict:
    """The pretraining's steps, and the seconds of its epochs (their steps) and of the kNN monitor's passes,
    summed over the run's epoch records, with how many there were."""
    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    epochs = [r for r in records if r.get("type") == "epoch"]
    monitors = [r["monitor_time_s"] for r in epochs if "monitor_time_s" in r]
    return {
        "steps": epochs[-1].get("iteration") if epochs else 0,
        "epochs": len(epochs),
        "epochs_s": round(sum(r.get("epoch_time_s", 0.0) for r in epochs), 1),
        "monitor_passes": len(monitors),
        "monitor_s": round(sum(monitors), 1),
    }


def run_seed(out: Path, seed: int, recipe: str | None, overrides: list[str]) -> dict:
    """One ``obow demo`` in a child process, timed: wall, CPU (the child's user + system), load; and its numbers."""
    command = [sys.executable, "-m", "obow", "demo", "--out", str(out)]
    command += ["--recipe", recipe] if recipe else []
    command += [f"train.seed={seed}", "train.progress_bar=false", *overrides]
    load_before = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    report = json.loads((out / "demo_results.json").read_text())
    from obow.config import load_config

    cfg = load_config(out / "pretrain" / "config.yaml")
    rows = report["results"]
    random_init, pretrained = rows["random init"]["knn_k20"], rows["OBoW pretrained"]["knn_k20"]
    user, system = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
    return {
        "seed": seed,
        "recipe": report.get("recipe"),
        "precision": report.get("precision", cfg.train.precision),
        "choice": report.get("choice"),
        "knn_random_init": round(random_init, 2),
        "knn_pretrained": round(pretrained, 2),
        "gain": round(pretrained - random_init, 2),
        "beats_constant_predictor": report["beats_constant_predictor"],
        "wall_s": round(wall, 1),
        "cpu_user_s": round(user, 1),
        "cpu_system_s": round(system, 1),
        "cpu_s": round(user + system, 1),
        "demo_pretrain_s": round(report["pretrain_seconds"], 1),
        "demo_total_s": round(report["total_seconds"], 1),
        **pretraining_parts(out / "pretrain" / "log.jsonl"),
        "load_before": round(load_before, 2),
        "load_after": round(os.getloadavg()[0], 2),
        "command": " ".join(command),
    }


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    result = {"cpu": cpu_kind(), "torch": torch.__version__, "runs": []}
    print(f"CPU: {result['cpu']['model']}, {result['cpu']['cores']} cores, {result['cpu']['kind']}", flush=True)
    for seed in args.seeds:
        row = run_seed(args.out / f"seed{seed}", seed, args.recipe, list(args.overrides))
        result["runs"].append(row)
        print(
            f"seed {seed}: recipe {row['recipe']}, {row['precision']}: kNN {row['knn_random_init']:.2f} -> "
            f"{row['knn_pretrained']:.2f} ({row['gain']:+.2f}); wall {row['wall_s'] / 60:.1f} min, CPU "
            f"{row['cpu_s'] / 60:.1f} min (user + system; load {row['load_before']:.1f} -> {row['load_after']:.1f})",
            flush=True,
        )
        if args.json:
            args.json.write_text(json.dumps(result, indent=2) + "\n")  # after every seed: a stopped run keeps some
    return result


if __name__ == "__main__":
    main()
