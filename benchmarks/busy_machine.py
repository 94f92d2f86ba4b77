"""A training run's speed on a quiet machine and beside one CPU-bound process, for several thread settings.

A 2-thread PyTorch run whose OpenMP threads spin while they wait collapses when another process holds one of
the cores: each parallel region waits for the thread that shares its core, and the spinning thread takes the
time that thread needed. This benchmark runs the same short ``obow pretrain`` (the demo's recipe on the demo's
digit mosaics, written once into a temporary folder) in a fresh process per measurement, as a user runs it:
with nothing beside it ("quiet") and beside one ``while True: pass`` process ("busy", started a second before),
for each setting of the environment given, in alternating rounds (each round rotates the order). It reads the
seconds a step from the run's own log (``epoch_time_s`` of the last epoch over its steps: views, step and
logging; the first epoch carries the start-up) and prints, per setting, the median quiet and busy seconds a step
and busy / quiet.

Settings are ``NAME=VAR=VALUE,VAR=VALUE`` (``NAME=`` alone: the environment as it is, so obow's own choice):

    python benchmarks/busy_machine.py --rounds 3
    python benchmarks/busy_machine.py --setting obow= --setting fixed=OMP_NUM_THREADS=2 --json busy.json

The defaults: ``obow`` (threads chosen by obow and adapted to the cores others leave,
:mod:`obow.training.run.busy`), ``fixed-2`` (``OMP_NUM_THREADS=2``: two threads throughout, what every run did
before; OpenMP's own waiting) and ``passive`` (two threads that sleep at once when they wait,
``OMP_WAIT_POLICY=PASSIVE``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_SETTINGS = ("obow=", "fixed-2=OMP_NUM_THREADS=2", "passive=OMP_NUM_THREADS=2,OMP_WAIT_POLICY=PASSIVE")


def parse_setting(text: str) -> tuple[str, dict[str, str]]:
    name, _, rest = text.partition("=")
    env = dict(item.split("=", 1) for item in rest.split(",") if item)
    return name, env


def spinner() -> subprocess.Popen:
    """One CPU-bound process (a pure-Python busy loop: one core, no OpenMP)."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def one_run(data: Path, out: Path, env: dict[str, str], args: argparse.Namespace) -> float:
    """Seconds a step of the last epoch of one short ``obow pretrain`` in a fresh process."""
    command = [
        sys.executable,
        "-m",
        "obow",
        "pretrain",
        "--config",
        args.config,
        "--data",
        str(data),
        "--out",
        str(out),
        f"optim.epochs={args.epochs}",
        "optim.warmup_epochs=0",
        f"data.cache_dir={out.parent / 'cache'}",
        f"train.precision={args.precision}",
        "train.knn_every=0",
        *args.overrides,
    ]
    environ = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    environ.update(env)
    proc = subprocess.run(command, env=environ, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:  # the run's own last lines, as benchmarks/threads.py says them
        raise SystemExit(proc.stderr[-2000:])
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    epochs = [r for r in records if r.get("type") == "epoch"]
    steps = epochs[-1]["iteration"] - (epochs[-2]["iteration"] if len(epochs) > 1 else 0)
    return float(epochs[-1]["epoch_time_s"]) / max(1, int(steps))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="demo_fp32")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--setting", action="append", help="NAME=VAR=VALUE,... (repeatable)")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--json", type=Path)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    settings = dict(parse_setting(s) for s in (args.setting or DEFAULT_SETTINGS))

    from obow.experiments.demo import write_digits

    times: dict[str, dict[str, list[float]]] = {n: {"quiet": [], "busy": []} for n in settings}
    with tempfile.TemporaryDirectory() as tmp:
        train, _ = write_digits(Path(tmp) / "digits")
        cases = [(name, load) for name in settings for load in ("quiet", "busy")]
        for r in range(args.rounds):
            shift = r % len(cases)
            for name, load in cases[shift:] + cases[:shift]:
                neighbour = spinner() if load == "busy" else None
                try:
                    time.sleep(1.0 if neighbour else 0)
                    out = Path(tmp) / f"run-{r}-{name}-{load}"
                    seconds = one_run(train, out, settings[name], args)
                finally:
                    if neighbour:
                        neighbour.kill()
                        neighbour.wait()
                times[name][load].append(seconds)
                print(f"round {r}: {name:20s} {load:5s} {seconds:.3f} s a step", flush=True)
    result = {
        "config": args.config,
        "precision": args.precision,
        "settings": settings,
        "seconds_per_step": times,
        "summary": {
            name: {
                "quiet_median": statistics.median(t["quiet"]),
                "busy_median": statistics.median(t["busy"]),
                "busy_over_quiet": statistics.median(t["busy"]) / statistics.median(t["quiet"]),
            }
            for name, t in times.items()
        },
        "cpu_count": os.cpu_count(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python benchmarks/busy_machine.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    print("\n| setting | quiet s/step | busy s/step | busy / quiet |\n|---|---|---|---|")
    for name, s in result["summary"].items():
        print(f"| {name} | {s['quiet_median']:.3f} | {s['busy_median']:.3f} | {s['busy_over_quiet']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
